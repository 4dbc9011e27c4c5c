"""Comparing stage states bit for bit: :func:`states_equal`, the one comparison tests and benches use.

A recovered run is right only if every stage's model, optimizer and lr-scheduler state equals a
failure-free run's, byte for byte. :func:`states_equal` names every difference by where it is.

Never: compares by value (``torch.equal`` or ``==`` on floats): -0.0 differs from 0.0, a float32
from a float64 of the same values, and a NaN equals the same NaN.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["states_equal"]

_STATE_PARTS = ("model", "optimizer", "lr_scheduler")


def states_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """What differs between two stages' states, bit for bit; [] when they are the same.

    ``a`` and ``b`` map ``"model"``, ``"optimizer"`` and ``"lr_scheduler"`` to state dicts, as a
    stage's result does (``RecoveryRun.results[k]``). Other keys are not compared, nor is a part
    that is None or absent on both sides. Every entry is compared, the optimizer's
    ``param_groups`` too. Tensors are the same when dtype, shape and bytes are: -0.0 differs from
    0.0, a float32 from a float64 of the same values, and a NaN equals the same NaN. Numbers are
    the same when type and bits are. A key on one side only is a difference. Each difference is
    named by where it is, e.g. ``model['0.weight']: bytes differ``.

    Never: compares by value (``torch.equal`` or ``==`` on floats).
    """
    bad: list[str] = []
    for part in _STATE_PARTS:
        x, y = a.get(part), b.get(part)
        if x is not None or y is not None:
            _differences(x, y, part, bad)
    return bad


def _differences(x: Any, y: Any, where: str, out: list[str]) -> None:
    """Append to ``out`` where ``x`` and ``y`` differ (nested state dicts, lists, tensors, scalars)."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        both = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        if not (both and x.dtype == y.dtype and x.shape == y.shape):
            out.append(f"{where}: {_kind(x)} vs {_kind(y)}")
        elif not torch.equal(_bits(x), _bits(y)):
            out.append(f"{where}: bytes differ")
    elif isinstance(x, Mapping) and isinstance(y, Mapping):
        for k in sorted(x.keys() | y.keys(), key=repr):
            if k not in x or k not in y:
                out.append(f"{where}[{k!r}]: in {'the first' if k in x else 'the second'} only")
            else:
                _differences(x[k], y[k], f"{where}[{k!r}]", out)
    elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        if len(x) != len(y):
            out.append(f"{where}: {len(x)} vs {len(y)} entries")
        for i, (v, w) in enumerate(zip(x, y, strict=False)):
            _differences(v, w, f"{where}[{i}]", out)
    elif type(x) is not type(y) or (struct.pack("<d", x) != struct.pack("<d", y) if isinstance(x, float) else x != y):
        out.append(f"{where}: {_kind(x)} vs {_kind(y)}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on the CPU."""
    return t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1).view(torch.uint8)


def _kind(v: Any) -> str:
    """A short description of ``v`` for a difference: a tensor's dtype and shape, a scalar's value, else its type."""
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)[:80]
    return type(v).__name__
