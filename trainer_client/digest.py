"""Digests of sent tensors: the proof that a replay regenerated exactly what a stage sent.

A digest is the xxh3_64 of a tensor's raw bytes (logical tensor, C order), which is what
``logstore.codec.checksum`` computes and what a record's header carries
(``codec.read_header(blob).checksum``), so a digest can be compared with a logged record
without decoding it. A digest record holds one int64 (the digest's two's-complement bit
pattern) under ``RecordKey(Channel.digest(src, dst), iteration, micro_batch, part)``, mirroring
the key of the data record ``(Channel.activation(src) | Channel.gradient(src), iteration,
micro_batch, part)``.

Never: touches a GPU (callers copy to host first), keeps a reference to the tensor.
"""

from __future__ import annotations

import torch

from logstore import codec

__all__ = ["tensor_digest", "digest_record", "digest_from_record"]

_U64 = 2**64


def tensor_digest(t: torch.Tensor) -> int:
    """xxh3_64 of the raw bytes of ``t`` (a CPU tensor; any strides, dtype or requires_grad).

    Equals ``codec.read_header(codec.encode_tensor(t)).checksum``. Copies only when ``t`` is not
    contiguous (or has a lazy conj/neg bit). Raises ValueError for a non-CPU tensor.
    """
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
