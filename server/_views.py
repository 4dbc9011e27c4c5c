"""Log-store objects as the admin API's models: record entries, checkpoints, tensor statistics, cursors.

Shared by :class:`server.node.Node` and the run summaries (``_summary.py``), so that a record, a
kind or a checkpoint reads the same in every answer.

Never: opens a store or reads a record; it only converts what the caller read.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import torch

from logstore import RecordInfo
from logstore.checkpoints import check_portable_json
from logstore.errors import SwiftlogError
from logstore.keys import KEY_SIZE, Kind, RecordKey
from server.errors import BadRequestError
from server.models import Checkpoint, TensorStats

__all__ = [
    "checkpoint_view",
    "decode_cursor",
    "encode_cursor",
    "hex64",
    "kind_name",
    "record_entry",
    "tensor_stats",
]

_CURSOR_RE = re.compile(rf"^[0-9a-f]{{{2 * KEY_SIZE}}}$")
_STATS_CHUNK = 1 << 22  # elements per float64 pass: bounds the memory of tensor statistics


def encode_cursor(key: RecordKey) -> str:
    """Opaque page cursor: the last key of a page, hex-encoded."""
    return key.encode().hex()


def decode_cursor(cursor: str) -> RecordKey:
    """Inverse of :func:`encode_cursor`; BadRequestError for anything else."""
    if not isinstance(cursor, str) or not _CURSOR_RE.match(cursor):
        raise BadRequestError(
            f"invalid cursor {cursor[:80]!r}", hint="pass back next_cursor from the previous page unchanged"
        )
    try:
        return RecordKey.decode(bytes.fromhex(cursor))
    except SwiftlogError:
        raise BadRequestError(
            f"invalid cursor {cursor!r}", hint="pass back next_cursor from the previous page unchanged"
        ) from None


def hex64(x: int) -> str:
    return f"{x:016x}"


def kind_name(k: Kind) -> str:
    return k.name.lower()


def tensor_stats(t: torch.Tensor) -> TensorStats:
    """min / max / mean / L2 norm over the finite values, NaN and Inf counts; float64 accumulation
    in bounded chunks. Raises TypeError for dtypes without a real numeric value (complex, bits)."""
    if t.is_complex():
        raise TypeError(f"no real statistics for complex dtype {t.dtype}")
    flat = t.reshape(-1)
    n = flat.numel()
    mn, mx, total, sq, count, nans, infs = math.inf, -math.inf, 0.0, 0.0, 0, 0, 0
    for start in range(0, n, _STATS_CHUNK):
        c = flat[start : start + _STATS_CHUNK]
        c = c.to(torch.uint8) if c.dtype == torch.bool else c
        c = c.to(torch.float64)
        finite = torch.isfinite(c)
        nf = int(finite.sum())
        if nf != c.numel():
            nans += int(torch.isnan(c).sum())
            infs += int(torch.isinf(c).sum())
            c = c[finite]
        if nf:
            mn = min(mn, float(c.min()))
            mx = max(mx, float(c.max()))
            total += float(c.sum())
            sq += float(torch.dot(c, c))
            count += nf
    if not count:
        return TensorStats(numel=n, nan_count=nans, inf_count=infs)
    return TensorStats(numel=n, min=mn, max=mx, mean=total / count, norm=math.sqrt(sq), nan_count=nans, inf_count=infs)


def checkpoint_view(c: Any) -> Checkpoint:
    meta = c.meta
    # a registration older than the check on portable JSON may hold a lone surrogate: served, not a 500 on every list
    try:
        check_portable_json(meta)
    except ValueError:
        meta = {"unreadable_meta": json.dumps(meta, ensure_ascii=True, default=repr)}
    return Checkpoint(stage=c.stage, iteration=c.iteration, uri=c.uri, registered_at=c.registered_at, meta=meta)


def record_entry(info: RecordInfo) -> dict[str, Any]:
    k = info.key
    return {
        "key": str(k),
        "channel": k.channel.name,
        "kind": kind_name(k.channel.kind),
        "iteration": k.iteration,
        "micro_batch": k.micro_batch,
        "part": k.part,
        "tier": info.tier,
        "writer": info.writer,
        "stored_bytes": info.stored_bytes,
        "raw_bytes": info.raw_bytes,
        "checksum": hex64(info.checksum),
    }
