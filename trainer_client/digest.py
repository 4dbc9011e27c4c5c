"""Digests of sent tensors: the proof that a replay regenerated exactly what a stage sent.

A digest is the xxh3_64 of a tensor's raw bytes (logical tensor, C order), which is what
``logstore.codec.checksum`` computes and what a record's header carries
(``codec.read_header(blob).checksum``), so a digest can be compared with a logged record
without decoding it. A digest record holds one int64 (the digest's two's-complement bit
pattern) under ``RecordKey(Channel.digest(src, dst), iteration, micro_batch, part)``, mirroring
the key of the data record ``(Channel.activation(src) | Channel.gradient(src), iteration,
micro_batch, part)``.

The same hash proves a replay's optimizer step: the client puts the digest of every parameter
gradient of the stage as the coming optimizer step will use it into the iteration's META
(:func:`grad_digests`, on CPU), and the replay compares its own before its step.

Never: touches a GPU (callers copy to host first), keeps a reference to the tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from logstore import codec
from trainer_client.fsdp import local_tensor

__all__ = ["tensor_digest", "digest_record", "digest_from_record", "hex_digests", "grad_digests", "grad_digest_changes"]

_U64 = 2**64


def tensor_digest(t: torch.Tensor) -> int:
    """xxh3_64 of the raw bytes of ``t`` (a CPU tensor; any strides, dtype or requires_grad; of
    a DTensor, its local part).

    Equals ``codec.read_header(codec.encode_tensor(t)).checksum``. Copies only when ``t`` is not
    contiguous (or has a lazy conj/neg bit). Raises ValueError for a non-CPU tensor.
    """
    t = local_tensor(t)
    if t.device.type != "cpu":
        raise ValueError(f"tensor_digest needs a CPU tensor, got one on {t.device}; copy it to host first")
    h = t.detach().resolve_conj().resolve_neg().contiguous()
    return codec.checksum(h.reshape(-1).view(torch.uint8).numpy())


def digest_record(digest: int) -> torch.Tensor:
    """The record value for ``digest``: a 1-element int64 tensor with the same 64 bits."""
    return torch.tensor([digest - _U64 if digest >= 2**63 else digest], dtype=torch.int64)


def digest_from_record(t: torch.Tensor) -> int:
    """Inverse of :func:`digest_record` (an unsigned 64-bit int)."""
    if t.dtype != torch.int64 or t.numel() != 1:
        raise ValueError(f"a digest record is one int64, got dtype={t.dtype} shape={tuple(t.shape)}")
    return int(t.reshape(-1)[0].item()) % _U64


def hex_digests(tensors: Sequence[torch.Tensor | None]) -> list[str | None] | None:
    """The digest of each tensor as 16 hex digits (JSON-safe), None for a missing one; None as a
    whole when one is not a dense CPU tensor (hashing it would synchronise with the device). About
    20 GB/s on one core."""
    out: list[str | None] = []
    for t in tensors:
        if t is None:
            out.append(None)
        elif t.device.type != "cpu" or t.is_sparse:
            return None
        else:
            out.append(f"{tensor_digest(t):016x}")
    return out


def grad_digests(module: torch.nn.Module | None) -> list[str | None] | None:
    """:func:`hex_digests` of each parameter's ``.grad`` of ``module`` (in ``parameters()`` order);
    None without a module. Never changes the gradients."""
    return None if module is None else hex_digests([p.grad for p in module.parameters()])


def grad_digest_changes(names: Sequence[str], before: Sequence[str | None], after: Sequence[str | None]) -> list[str]:
    """The names of the parameters whose gradient digests differ between ``before`` and ``after``
    (one present and one absent counts); every name when the lists differ in length."""
    if len(before) != len(after) or len(names) != len(before):
        return list(names) or ["(the parameter lists differ)"]
    return [n for n, a, b in zip(names, before, after, strict=True) if a != b]
