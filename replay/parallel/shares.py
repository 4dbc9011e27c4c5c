"""Which micro-batches of each iteration a parallel-replay worker replays.

Every worker replays a contiguous run of each iteration's micro-batches in the live backward order
(:func:`slice_of`), sized by the workers' measured time per micro-batch (:func:`balanced_counts`).
With dynamic shares, workers pair up and claim the middle of a pair's positions one micro-batch at
a time (:func:`share_layout`, :class:`Share`, :class:`Claims`), so a worker stalled in one
iteration hands micro-batches to its partner in that very iteration. :class:`ShareSchedule` keeps
one worker's shares, times and splits across iterations (the ``select``, ``likely`` and ``claim``
hooks of the replay loop). ``docs/parallel-replay.md`` ("Balance", "Dynamic shares") says why.

Never: gives two workers the same micro-batch, or a worker a share that is not contiguous.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch.distributed as dist

__all__ = ["Claims", "Share", "ShareSchedule", "balanced_counts", "share_layout", "slice_of"]


def slice_of(order: Sequence[int], rank: int, world: int, counts: Sequence[int] | None = None) -> list[int]:
    """Worker ``rank``'s contiguous share of ``order``: ``counts[rank]`` items after those of the
    lower ranks (default counts: equal, sizes differing by at most one)."""
    n = len(order)
    if counts is None:
        return list(order[rank * n // world : (rank + 1) * n // world])
    lo = sum(counts[:rank])
    return list(order[lo : lo + counts[rank]])


def balanced_counts(n: int, per_mb: Sequence[float] | None, world: int) -> list[int]:
    """How many of ``n`` micro-batches each of ``world`` workers replays, given each worker's time per
    micro-batch (``per_mb``; None or a non-positive entry: unknown, equal split as :func:`slice_of`).

    The split that minimises the slowest worker's time ``max(count_r * per_mb_r)`` (one micro-batch
    at a time to the worker that would finish it first: optimal for equal items), at least one
    micro-batch each when ``n >= world``; ties go to the lower rank. Deterministic: the same inputs
    give the same split on every worker.
    """
    if per_mb is None or len(per_mb) != world or not all(math.isfinite(t) and t > 0 for t in per_mb):
        return [len(slice_of(range(n), r, world)) for r in range(world)]
    counts = [1 if n >= world else 0 for _ in range(world)]
    for _ in range(n - sum(counts)):
        r = min(range(world), key=lambda r: ((counts[r] + 1) * per_mb[r], r))
        counts[r] += 1
    return counts


def share_layout(n: int, counts: Sequence[int], rank: int, world: int) -> tuple[range, range, bool]:
    """Worker ``rank``'s part of ``n`` positions (backward order) when they are shared dynamically.

    Workers pair up, (0, 1), (2, 3), ...; a pair owns the consecutive positions its two ``counts``
    add up to. Of those, the first worker is sure of a prefix and the second of a suffix; the
    middle half (around where ``counts`` put the boundary) is *contested*: the first worker claims
    it from the front, the second from the back, one position at a time, until it is all taken
    (:class:`Claims`), so the pair's boundary lands where their speeds put it in this very
    iteration. An unpaired last worker (odd ``world``) keeps its ``counts`` share. Returns (sure
    positions, contested positions, claims from the front); the contested ranges and the sure ones
    partition ``range(n)`` over the workers.
    """
    lo = sum(counts[: rank - rank % 2])
    if rank % 2 == 0 and rank == world - 1:  # unpaired
        return range(lo, lo + counts[rank]), range(0), True
    first, second = counts[rank - rank % 2], counts[rank - rank % 2 + 1]
    b = lo + first
    c = (first + second) // 2
    c_front, c_back = min(first, c // 2), min(second, c - c // 2)
    contested = range(b - c_front, b + c_back)
    if rank % 2 == 0:
        return range(lo, contested.start), contested, True
    return range(contested.stop, b + second), contested, False


class Share:
    """One worker's share of one iteration: the positions it is sure of, the contested ones
    (:func:`share_layout`; none in a fixed share) and what it has claimed of them."""

    __slots__ = ("order", "sure", "contested", "front", "key", "won", "pending", "done", "last")

    def __init__(self, order: Sequence[int], sure: range, contested: range, front: bool, key: str) -> None:
        self.order, self.sure, self.contested, self.front, self.key = list(order), sure, contested, front, key
        self.won = 0  # contested positions claimed so far
        self.pending: int | None = None  # a position claimed ahead, not handed out yet
        self.done = not contested  # a claim failed: the contested positions are all taken
        self.last = order[sure[-1]] if sure else None  # the latest micro-batch this worker knows it replays

    def layout(self) -> tuple[list[int], range, range, bool]:
        return self.order, self.sure, self.contested, self.front


class Claims:
    """Tickets for the contested micro-batches, from an atomic counter per (pair, iteration) in a
    ``torch.distributed.Store`` every worker reaches (the rendezvous store): ticket ``t`` of an
    iteration wins iff ``t <= len(contested)``, so the two workers of a pair take every contested
    position exactly once between them, whichever asks first. A worker stops at its first losing
    ticket; the first worker of the pair deletes the counter once the iteration's reduction is over
    (every claim of the iteration precedes it)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def take(self, sh: Share) -> int | None:
        """Claim the next contested position of ``sh`` (front or back); None: all are taken."""
        if sh.done:
            return None
        if self.store.add(sh.key, 1) > len(sh.contested):
            sh.done = True
            return None
        sh.won += 1
        return sh.contested.start + sh.won - 1 if sh.front else sh.contested.stop - sh.won

    def forget(self, sh: Share) -> None:
        if sh.front and sh.contested:
            self.store.delete_key(sh.key)


class ShareSchedule:
    """One worker's shares of every iteration: sized by the measured speeds, fixed or dynamic.

    ``select`` / ``likely`` / ``claim`` are the replay loop's hooks (``ReplayHooks``); the
    reduction reports each iteration's times and counts back (:meth:`finish`), which size the
    split of iteration ``it + lag``. ``claims``: the ticket counters of dynamic shares (None:
    every share is fixed up front); ``claim_min_s``: claims only when a micro-batch took this long
    (seconds); ``shadow_forwards``: whether an iteration runs every forward here (then its shares
    are fixed: the forwards run in the live forward order).
    """

    #: weight of the newest iteration in the averaged time per micro-batch
    EMA = 0.5

    def __init__(
        self,
        rank: int,
        world: int,
        *,
        start: int,
        lag: int = 1,
        claims: Claims | None = None,
        claim_min_s: float = 0.0,
        shadow_forwards: Callable[[int], bool] = lambda it: False,
    ) -> None:
        self.rank, self.world = rank, world
        self.claims = claims if world > 1 else None  # None: every iteration's shares are fixed up front
        self.claim_min_s = claim_min_s  # claims only when a micro-batch took this long (seconds)
        self.shadow_forwards = shadow_forwards
        self.shares: dict[int, Share] = {}  # iteration -> this worker's share (a fixed one has nothing contested)
        self.finished = start - 1  # the last iteration whose gradients were reduced
        self.lag = max(1, lag)  # iteration i's split uses the times measured up to i - lag
        self.per_mb: dict[int, list[float]] = {}  # iteration -> averaged seconds per micro-batch, per worker
        self.splits: dict[int, list[int]] = {}  # iteration -> micro-batches per worker, as replayed
        self.planned: dict[int, list[int]] = {}  # iteration -> micro-batches per worker, as planned by balanced_counts

    def dynamic(self, it: int) -> bool:
        """Whether iteration ``it``'s micro-batches are shared by claims: when the slowest worker's
        micro-batch took at least ``claim_min_s`` (measured ``lag`` iterations before, the same
        numbers on every worker) or nothing was measured yet (the first iterations, where freshly
        started workers differ most), and not with shadow forwards (those run in the live forward
        order, so every worker's share must be known up front)."""
        if self.claims is None or self.shadow_forwards(it):
            return False
        per = self.per_mb.get(it - self.lag)
        return per is None or max(per) >= self.claim_min_s

    def select(self, it: int, order: Sequence[int]) -> list[int]:
        """This worker's contiguous share of ``order``, sized by :func:`balanced_counts`; with
        dynamic shares only the part it is sure of (:func:`share_layout`; the rest comes from
        :meth:`claim`). Called by the compute thread and, ahead, by the prefetch thread: both get
        the same answer (the sizes come from times measured ``lag`` iterations before)."""
        if it <= self.finished:  # a prefetch thread that fell behind: the iteration is over
            return slice_of(order, self.rank, self.world, self.splits.get(it))
        counts = self.planned[it] = balanced_counts(len(order), self.per_mb.get(it - self.lag), self.world)
        if self.dynamic(it):
            sure, contested, front = share_layout(len(order), counts, self.rank, self.world)
        else:  # a fixed share: nothing contested
            lo = sum(counts[: self.rank])
            sure, contested, front = range(lo, lo + counts[self.rank]), range(0), True
        sh = Share(order, sure, contested, front, key=f"{self.rank // 2}/{it}")
        old = self.shares.setdefault(it, sh)
        if old is not sh and old.layout() != sh.layout() and old.won == 0 and old.pending is None:
            self.shares[it] = old = sh
        return [order[i] for i in old.sure]

    def likely(self, it: int, order: Sequence[int]) -> list[int]:
        """The contested micro-batches this worker would get if the workers kept their measured
        speeds (its side of the planned boundary): prefetched with the sure ones."""
        sh = self.shares.get(it)
        if sh is None:
            return []
        b = sum(self.planned.get(it, [])[: self.rank - self.rank % 2 + 1])  # the planned boundary of the pair
        return [sh.order[i] for i in sh.contested if (i < b) == sh.front]

    def claim(self, it: int) -> int | None:
        """ReplayHooks.claim: the next contested micro-batch this worker won (claimed ahead by
        :meth:`is_last`, which the reducer asks before each backward), or None once they are all taken."""
        sh = self.shares.get(it)
        if sh is None or self.claims is None:
            return None
        if sh.pending is not None:
            pos, sh.pending = sh.pending, None
        else:
            pos = self.claims.take(sh)
            if pos is None:
                return None
        sh.last = sh.order[pos]
        return sh.last

    def is_last(self, it: int, mb: int) -> bool:
        """Whether ``mb`` is this worker's last micro-batch of iteration ``it``. With a dynamic share
        the next position is claimed now, one backward ahead: worker 0 must know when to send its
        running sum from the gradient hooks, and its partner claims as early so that neither gets
        an edge (of two equally fast workers, the one whose backward starts first ends first)."""
        sh = self.shares[it]
        if mb == sh.last and sh.pending is None and self.claims is not None:
            sh.pending = self.claims.take(sh)
        return mb == sh.last and sh.pending is None and sh.done

    def position(self, it: int, mb: int) -> int:
        """Micro-batch ``mb``'s position in iteration ``it``'s backward order."""
        return self.shares[it].order.index(mb)

    def finish(self, it: int, times: Sequence[float], counts: list[int]) -> None:
        """Iteration ``it`` is reduced: every worker's time per micro-batch (``times``) and count
        (``counts``) are known, and every claim of the iteration was made before the reduction."""
        self.record(it, times)
        self.splits[it] = counts
        self.planned.pop(it, None)
        self.finished = it
        sh = self.shares.pop(it, None)
        if sh is not None and self.claims is not None:  # every worker's claims of the iteration came before
            self.claims.forget(sh)

    def record(self, it: int, times: Sequence[float]) -> None:
        """Average the workers' times per micro-batch of iteration ``it`` into the estimate that sizes
        iteration ``it + lag``'s slices (a worker without micro-batches keeps its estimate)."""
        prev = self.per_mb.get(it - 1)
        est = []
        for r, t in enumerate(times):
            old = prev[r] if prev is not None else 0.0
            est.append(t if old <= 0 else old if t <= 0 else self.EMA * t + (1 - self.EMA) * old)
        self.per_mb[it] = est
        self.per_mb.pop(it - self.lag - 1, None)  # no select() asks below it - lag any more
