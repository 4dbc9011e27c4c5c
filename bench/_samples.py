"""Real activation and gradient tensors for the codec benchmark.

Builds a small GPT-style stack (token + position embedding, pre-LayerNorm blocks with causal
self-attention and a GELU MLP, dropout everywhere, a final LayerNorm and a vocabulary head),
runs a real forward and backward pass on CPU in the requested dtype with a cross-entropy loss,
and returns what a pipeline stage would put on the wire if every block were its own stage:

- the activations at every block boundary (embedding output, outputs of all blocks but the last),
- the gradients of the loss with respect to those same tensors.

Compression ratios depend on value distributions, not on the exact model, so a random-init model
with GPT-2 style initialisation is used (no training steps). Everything is seeded: the same
(dtype, hidden, seed) on the same machine returns the same tensors.

Never used by the library itself; bench only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer_client.examples.gpt import Block

__all__ = ["SampleConfig", "real_samples"]


class SampleConfig:
    """Sizes of the sample model. Defaults give 16 tensors of 1 M elements (32 MB in bf16, 64 MB in fp32)."""

    vocab: int = 8192
    blocks: int = 4
    heads: int = 16
    seq: int = 256
    batch: int = 4
    micro_batches: int = 2
    dropout: float = 0.1


# the example pipeline's transformer block: the samples are what that model sends
_Block = Block


def real_samples(dtype: torch.dtype, hidden: int = 1024, seed: int = 0) -> list[torch.Tensor]:
    """Inter-block activations and their gradients from a real forward + backward pass.

    ``dtype`` is the compute dtype (``torch.bfloat16`` or ``torch.float32``; any floating dtype
    the CPU kernels support works). Returns detached, contiguous CPU tensors of shape
    ``(batch, seq, hidden)``: first the activations at every block boundary of every micro-batch,
    then the gradients w.r.t. them in the same order. Deterministic for a given (dtype, hidden, seed) and machine.
    Never touches global RNG state of the caller (uses a forked RNG).
    """
    if hidden < 64 or hidden % SampleConfig.heads:
        raise ValueError(f"hidden must be a multiple of {SampleConfig.heads} and >= 64, got {hidden}")
    cfg = SampleConfig()
    out_acts: list[torch.Tensor] = []
    out_grads: list[torch.Tensor] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tok_emb = nn.Embedding(cfg.vocab, hidden)
        pos_emb = nn.Embedding(cfg.seq, hidden)
        nn.init.normal_(tok_emb.weight, std=0.02)
        nn.init.normal_(pos_emb.weight, std=0.01)
        blocks = nn.ModuleList(_Block(hidden, cfg.heads, cfg.dropout, cfg.blocks) for _ in range(cfg.blocks))
        ln_f = nn.LayerNorm(hidden)
        head = nn.Linear(hidden, cfg.vocab, bias=False)
        nn.init.normal_(head.weight, std=0.02)
        model = nn.ModuleList([tok_emb, pos_emb, blocks, ln_f, head]).to(dtype)
        model.train()
        emb_drop = nn.Dropout(cfg.dropout)

        for _ in range(cfg.micro_batches):
            tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1))
            inp, target = tokens[:, :-1], tokens[:, 1:]
            pos = torch.arange(cfg.seq)
            x = emb_drop(tok_emb(inp) + pos_emb(pos))
            boundaries: list[torch.Tensor] = []
            for block in blocks:
                x.retain_grad()
                boundaries.append(x)
                x = block(x)
            logits = head(ln_f(x)).float()
            loss = F.cross_entropy(logits.view(-1, cfg.vocab), target.reshape(-1))
            model.zero_grad(set_to_none=True)
            loss.backward()
            out_acts.extend(b.detach().contiguous().clone() for b in boundaries)
            out_grads.extend(b.grad.detach().contiguous().clone() for b in boundaries)
    return out_acts + out_grads
