"""A small GPT-style model split into pipeline stages, and a deterministic synthetic token dataset.

Used by the example training script, the tests, the benchmark and the recovery demo. Tensor
name suffixes: B batch, S sequence, H hidden, V vocabulary.

- :class:`GPTConfig`: sizes (defaults are tiny: fast multi-process tests on 2 CPU cores).
- :func:`build_stage_module`: stage k of a GPT (stage 0: token + position embedding with dropout;
  every stage: ``layers_per_stage`` pre-LayerNorm blocks with causal attention and a GELU MLP,
  dropout everywhere; last stage: final LayerNorm + vocabulary head). Initialised from
  (seed, stage) only, so a replacement rebuilds the same initial module anywhere.
- :class:`SyntheticTokens`: batch of iteration ``it`` as a pure function of (seed, it): a
  deterministic, iteration-addressable data source (a ``trainer_client.DataSource``).
- :func:`example_io`: static input/output examples for ``PipelineStage`` (no shape inference).

Never touches the caller's global RNG state (initialisation runs under a forked RNG).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "GPTConfig",
    "Block",
    "StageModule",
    "build_stage_module",
    "loss_fn",
    "SyntheticTokens",
    "example_io",
    "make_optimizer",
    "make_lr_scheduler",
]


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Model and batch sizes.

    vocab: vocabulary size (default 64). hidden: model width (default 32; a multiple of heads).
    heads: attention heads (default 4). layers_per_stage: blocks per stage (default 1).
    seq: sequence length (default 16). dropout: dropout probability everywhere (default 0.1).
    micro_batch_size: sequences per micro-batch (default 2). n_microbatches: micro-batches per
    iteration (default 4). mlp_norm: the norm before each block's MLP, "layer" (default: LayerNorm)
    or "batch" (BatchNorm over the micro-batch's tokens: a module whose forward updates buffers,
    its running statistics). recompute: activation recomputation (``torch.utils.checkpoint``
    around each block: its forward runs again in the backward, and with ``mlp_norm="batch"`` the
    running statistics are updated there too; default False).
    """

    vocab: int = 64
    hidden: int = 32
    heads: int = 4
    layers_per_stage: int = 1
    seq: int = 16
    dropout: float = 0.1
    micro_batch_size: int = 2
    n_microbatches: int = 4
    mlp_norm: str = "layer"
    recompute: bool = False

    def __post_init__(self) -> None:
        if self.mlp_norm not in ("layer", "batch"):
            raise ValueError(f"mlp_norm must be 'layer' or 'batch', got {self.mlp_norm!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        for name in ("vocab", "hidden", "heads", "layers_per_stage", "seq", "micro_batch_size", "n_microbatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def batch_size(self) -> int:
        return self.micro_batch_size * self.n_microbatches

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class TokenBatchNorm(nn.BatchNorm1d):
    """BatchNorm1d over every token of a ``(batch, seq, hidden)`` input (statistics per hidden feature)."""

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return super().forward(x_BSH.reshape(-1, x_BSH.shape[-1])).view_as(x_BSH)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, with dropout."""

    def __init__(self, hidden: int, heads: int, dropout: float, n_blocks: int, mlp_norm: str = "layer") -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = TokenBatchNorm(hidden) if mlp_norm == "batch" else nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)
        for lin in (self.qkv, self.proj, self.fc1, self.fc2):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        for lin in (self.proj, self.fc2):  # GPT-2: residual projections scaled by depth
            nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * n_blocks))

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        B, S, H = x_BSH.shape
        q, k, v = self.qkv(self.ln1(x_BSH)).split(H, dim=-1)
        q, k, v = (t.view(B, S, self.heads, H // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x_BSH = x_BSH + self.drop(self.proj(a.transpose(1, 2).reshape(B, S, H)))
        return x_BSH + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x_BSH)))))


class StageModule(nn.Module):
    """One pipeline stage of the GPT: embedding on stage 0, blocks, head on the last stage."""

    def __init__(self, cfg: GPTConfig, stage: int, num_stages: int) -> None:
        super().__init__()
        self.first = stage == 0
        self.last = stage == num_stages - 1
        self.recompute = cfg.recompute
        if self.first:
            self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
            self.pos = nn.Embedding(cfg.seq, cfg.hidden)
            self.edrop = nn.Dropout(cfg.dropout)
            nn.init.normal_(self.tok.weight, std=0.02)
            nn.init.normal_(self.pos.weight, std=0.01)
        n_blocks = cfg.layers_per_stage * num_stages
        self.blocks = nn.ModuleList(
            Block(cfg.hidden, cfg.heads, cfg.dropout, n_blocks, cfg.mlp_norm) for _ in range(cfg.layers_per_stage)
        )
        if self.last:
            self.lnf = nn.LayerNorm(cfg.hidden)
            self.head = nn.Linear(cfg.hidden, cfg.vocab)
            nn.init.normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.edrop(self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device)))
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.recompute and torch.is_grad_enabled() else b(x)
        if self.last:
            x = self.head(self.lnf(x))
        return x


def build_stage_module(cfg: GPTConfig, stage: int, num_stages: int, seed: int = 0) -> StageModule:
    """Stage ``stage`` of the model, initialised from (seed, stage) only; in train mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1_000_003 * seed + 7919 * stage + 17)
        mod = StageModule(cfg, stage, num_stages)
    mod.train()
    return mod


def shard_stage_module(mod: StageModule, mesh: Any) -> StageModule:
    """FSDP2 as torchtitan applies it: every block ``fully_shard``-ed over ``mesh`` (the stage's
    shard group), then the stage (the embeddings and the head with it). Returns ``mod``."""
    from torch.distributed.fsdp import fully_shard

    for b in mod.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(mod, mesh=mesh)
    return mod


def loss_fn(logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch (unscaled; the schedule divides gradients)."""
    return F.cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]), target_BS.reshape(-1))


class SyntheticTokens:
    """Deterministic token batches: ``data(it) -> (tokens_BS, targets_BS)``, a pure function of (seed, it).

    Each sequence is an arithmetic progression modulo ``vocab`` with a random start and a step
    in 1..4, plus 10 % random tokens, so a model can learn it. ``targets`` are the tokens shifted
    by one. Fresh tensors on every call.
    """

    def __init__(self, cfg: GPTConfig, seed: int = 0) -> None:
        self.vocab = cfg.vocab
        self.seq = cfg.seq
        self.batch_size = cfg.batch_size
        self.seed = seed

    def __call__(self, iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(12_345 + 1_000_003 * self.seed + iteration)
        B, S, V = self.batch_size, self.seq + 1, self.vocab
        start = torch.randint(0, V, (B, 1), generator=g)
        step = torch.randint(1, 5, (B, 1), generator=g)
        seq = (start + step * torch.arange(S)) % V
        noise = torch.rand(B, S, generator=g) < 0.1
        seq = torch.where(noise, torch.randint(0, V, (B, S), generator=g), seq)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def example_io(cfg: GPTConfig, stage: int, num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Static (input, output) examples of one micro-batch for ``PipelineStage``.

    In static mode ``requires_grad`` of the examples decides whether receive buffers require
    grad and whether gradient buffers exist, so hidden states are marked ``requires_grad``.
    """
    mb, S, H, V = cfg.micro_batch_size, cfg.seq, cfg.hidden, cfg.vocab
    inp = torch.zeros(mb, S, dtype=torch.long) if stage == 0 else torch.zeros(mb, S, H, requires_grad=True)
    out = torch.zeros(mb, S, V if stage == num_stages - 1 else H, requires_grad=True)
    return inp, out


def make_optimizer(module: nn.Module) -> torch.optim.Optimizer:
    """AdamW(lr=1e-3, weight_decay=0.01, fused=True) over the stage's parameters (the fused kernel:
    ~3x faster than the per-parameter loop on CPU; live run and replay use the same kernel)."""
    return torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01, fused=True)


def make_lr_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up from half the learning rate over 10 iterations (state-dict friendly)."""
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=10)
