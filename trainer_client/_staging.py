"""What the asynchronous writer's queue holds: the queued item, and the pinned host buffers
that CUDA records are copied into.

Never: allocates pinned memory for a shape it has a free buffer of; keeps more than its bound of
free pinned memory.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from logstore import Channel

__all__ = ["PinnedPool", "QueueItem"]


class PinnedPool:
    """Reusable pinned host buffers keyed by (dtype, numel); allocating pinned memory is slow.

    At most ``max_free_bytes`` are kept free for reuse (a run whose shapes keep changing, e.g.
    variable sequence lengths, would otherwise keep a buffer of every shape it ever logged); a
    buffer returned beyond that is released to torch's pinned-memory allocator. ``nbytes``: the
    pinned memory this pool holds now, in use or free.
    """

    def __init__(self, max_free_bytes: int) -> None:
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = collections.defaultdict(list)
        self._lock = threading.Lock()
        self._max_free = max_free_bytes
        self._free_bytes = 0
        self.nbytes = 0

    def get(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        with self._lock:
            free = self._free.get((dtype, n))
            buf = free.pop() if free else None
            if buf is not None:
                self._free_bytes -= buf.numel() * buf.element_size()
        if buf is None:
            buf = torch.empty(n, dtype=dtype, pin_memory=True)
            with self._lock:
                self.nbytes += buf.numel() * buf.element_size()
        return buf.view(shape)

    def put(self, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        with self._lock:
            if self._free_bytes + size > self._max_free:
                self.nbytes -= size  # dropped: torch's caching host allocator takes it back
                return
            self._free_bytes += size
            self._free[(t.dtype, t.numel())].append(t.reshape(-1))


class QueueItem:
    """One entry of the writer's queue: a record (its tensors, or their digests), a marker or a gap."""

    __slots__ = (
        "kind",
        "channel",
        "iteration",
        "micro_batch",
        "tensors",
        "nparts",
        "events",
        "pinned",
        "hash_only",
        "digests",
        "nbytes",
        "held",
        "fn",
        "reason",
        "future",
    )

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "rec" | "mark" | "gap"
        self.channel: Channel | None = None
        self.iteration = 0
        self.micro_batch = 0
        self.tensors: list[torch.Tensor] = []
        self.nparts = 0
        self.events: list[Any] = []
        self.pinned = False
        self.hash_only = False  # a digest record: store the digests, not the tensors
        self.digests: list[int] | None = None  # computed at submit (CPU) or by the encoder (staged CUDA copies)
        self.nbytes = 0  # reserved in queue_bytes (records)
        self.held = 0  # counted in digest_bytes (digest records, until their buffers are let go)
        self.fn: Callable[[], None] | None = None
        self.reason = ""
        self.future: Future | None = None
