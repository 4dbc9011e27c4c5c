"""Copies of module buffers, to put them back or to see which changed.

A forward can update buffers (BatchNorm's running statistics) inside a kernel that does not bump
the tensors' version counters, so "did a buffer change" is answered here by comparing contents.
Used by the survivors of a failure (an iteration they discard must not leave its buffer updates
behind) and by parallel replay (are the forwards changing buffers at all?).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["BufferSnapshot", "named_buffers"]


def named_buffers(modules: Mapping[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every buffer of ``modules`` by ``"{key}{name}"`` (key: e.g. ``"stage 1 "``, or ``""`` for one module)."""
    return {f"{key}{name}": b for key, mod in modules.items() for name, b in mod.named_buffers()}


class BufferSnapshot:
    """The values of a set of named buffers at one moment (:meth:`take`), kept in copies that are
    reused from one snapshot to the next (no allocation while shapes stay the same)."""

    def __init__(self) -> None:
        self._copies: dict[str, torch.Tensor] = {}

    def take(self, buffers: Mapping[str, torch.Tensor]) -> None:
        """Copy the current values of ``buffers`` (forgetting names no longer there)."""
        copies = {}
        with torch.no_grad():
            for name, b in buffers.items():
                c = self._copies.get(name)
                if c is None or c.shape != b.shape or c.dtype != b.dtype or c.device != b.device:
                    c = torch.empty(b.shape, dtype=b.dtype, device=b.device)  # contiguous
                c.copy_(b)
                copies[name] = c
        self._copies = copies

    def changed(self, buffers: Mapping[str, torch.Tensor]) -> list[str]:
        """Names whose value differs from the snapshot's (or that appeared or disappeared since), sorted."""
        out = [name for name, b in buffers.items() if name not in self._copies or not _same(self._copies[name], b)]
        out += [name for name in self._copies if name not in buffers]
        return sorted(out)

    def restore(self, module: torch.nn.Module) -> None:
        """Put the snapshot's values back into ``module``'s buffers (taken with ``named_buffers({"": module})``):
        in place where shape and dtype still match, else as the buffer again. A buffer that appeared
        since (a lazily filled one, or one registered meanwhile) becomes None again: absent from
        ``named_buffers`` and the state dict, as before."""
        current = dict(module.named_buffers())
        for name in current.keys() - self._copies.keys():
            owner_name, _, leaf = name.rpartition(".")
            module.get_submodule(owner_name)._buffers[leaf] = None
        with torch.no_grad():
            for name, c in self._copies.items():
                b = current.get(name)
                if b is not None and b.shape == c.shape and b.dtype == c.dtype and b.device == c.device:
                    b.copy_(c)
                    continue
                owner_name, _, leaf = name.rpartition(".")
                owner = module.get_submodule(owner_name)
                owner.register_buffer(leaf, c.clone(), persistent=leaf not in owner._non_persistent_buffers_set)


def _same(copy: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (-0.0 vs 0.0 differ, equal NaNs are equal)."""
    if copy.shape != b.shape or copy.dtype != b.dtype:
        return False
    return torch.equal(copy.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
