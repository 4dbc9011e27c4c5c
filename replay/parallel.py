"""Parallel replay (SWIFT's parallel recovery): K workers share every iteration's micro-batches.

Each worker loads the same checkpoint(s), replays a contiguous slice of each iteration's
micro-batches (in the live backward order: worker 0 the first positions, worker K - 1 the last;
equal sizes ``[r*n//K, (r+1)*n//K)`` until the workers' speeds are known, see "Balance" below),
forward and backward, reads only the records of its own micro-batches, and verifies the sends
of its own micro-batches. Then the parameter gradients are reduced over the workers (gloo), and
every worker divides them by the schedule's factor and steps its optimizer and scheduler
identically. Worker 0 writes the recovered checkpoint(s); before that the workers compare a
digest of their parameters and buffers, so "they stepped identically" is checked, not assumed.

Buffers: a forward may update module buffers (BatchNorm's running statistics), and the live run
updated them with every micro-batch in the live forward order. A worker that ran only its own
forwards would end with statistics of its slice alone (and a forward that reads them would see
wrong ones). So when the stages have buffers, every worker runs, in the first iteration, the
other workers' forwards too, in the live forward order ("shadow" forwards: outputs discarded, no
backward, no check), and compares the buffers' contents before and after: if any worker saw a change,
every later iteration runs the shadow forwards as well (exact buffers for about a third more
compute per worker: a forward without its backward); if none did, later iterations skip them,
and a change that shows up later anyway is an error naming the buffer, never a silent difference.

Balance: the slices need not be equal. Every worker measures its time per micro-batch in each
iteration and the reduction carries those times to every worker; iteration ``i``'s slice sizes
follow from the (exponentially averaged) times measured up to iteration ``i - prefetch - 1``
(:func:`balanced_counts`: the split whose slowest worker is done first), the same on every worker
and known before the prefetch thread asks. A worker on a busier core or a slower machine gets
fewer micro-batches; the results do not depend on the split (the exact chain's order is the
backward order whatever the sizes).

Dynamic shares (``job.dynamic_share_min_s``): measured speeds only predict; a worker stalled in
one iteration (a busy core, a page-in) would hold its partner up at that iteration's reduction.
So the workers pair up, (0, 1), (2, 3), ..., and of a pair's planned positions the first worker
is sure of a prefix, the second of a suffix, and the middle half is claimed one micro-batch at a
time, from the front by the first and from the back by the second, with tickets from an atomic
counter in the rendezvous store (:class:`_Claims`, about 0.25 ms a ticket on loopback): the pair's
boundary lands where the two actually got to in this iteration. Each worker still ends with a
contiguous run of positions, so the chain (and the result, every byte of it) is unchanged; worker
0 claims one backward ahead so that it knows which backward is its last (the gradient hooks below),
and so does its partner (claiming later would hand every near tie to worker 0).
The prefetch thread (by default only where it has a spare core or a network source to hide,
:func:`worker_prefetch`; otherwise the compute thread fetches each record when it needs it) fetches
the sure micro-batches and the contested ones on this worker's side of the planned boundary; a
contested one it did not fetch is fetched when claimed, one it fetched for nothing is dropped
when the iteration ends. A claim costs a store round trip and perhaps a
fetch on the compute thread, so iterations whose micro-batches were measured (``lag`` iterations
before, the slowest worker's) to take less than ``dynamic_share_min_s`` (default 20 ms) keep fixed
shares (the first ``lag`` iterations, with nothing measured yet, share dynamically: freshly
started workers differ most there), as do iterations with shadow forwards (below). An odd last worker has no partner and a fixed share.

Two reductions:

**exact** (default): the sequential replay's ``.grad`` after an iteration is
``((g_0 + g_1) + g_2) + ...`` in backward order (autograd's AccumulateGrad adds each micro-batch's
gradient in place, elementwise; the first one is assigned). Each ``g_i`` a worker computes is
bit-identical to the sequential one (same weights, inputs, per-micro-batch seed and thread
count). So the workers form exactly that sum as an ordered chain: worker 0 lets autograd
accumulate its slice in ``.grad``; worker r > 0 keeps its slice's gradients apart, receives the
running sum from worker r - 1, adds its own in order and passes it on; the last worker sends the
total to every other worker. The result is bit-identical to sequential replay (the tests compare
every byte). The chain is pipelined in buckets of about 1 MiB of consecutive parameters: worker 0
sends a bucket from a gradient hook as soon as its last backward has finished that bucket's
parameters (while it computes the others), the next worker adds its stash to a bucket as soon as
it arrives, and each finished bucket travels on while the next ones are added. Cost: worker
r > 0 holds its ``n/K`` micro-batches' gradients (``n/K x`` the parameter bytes), workers other
than the last a second gradient buffer for the total; communication is ``K - 1`` point-to-point
hops plus ``K - 1`` sends of the total per iteration (an all-reduce's volume, with a latency that
grows with K, most of it hidden behind worker 0's last backward and the adds).

Same host (``job.shared_memory``, default): the running sum is not sent at all. Worker 0 creates
a file in ``/dev/shm`` (space reserved up front) that every worker maps (:class:`_SharedChain`);
worker 0 writes its gradients there, each next worker adds its stash in place, the last one and
then the others copy the total out for their step, and only each bucket's "present" flags go over
gloo, as the signal that the bucket is ready. Two buffers alternate by iteration, so a worker
still copying out one iteration's total never meets the next one's writes (those wait for its
part in the chain of the iteration in between). Over loopback TCP a K = 2 replay of the bench
stage spent about a tenth of its time on the two socket copies per iteration (paired A/B: 0.89x
the time with shared memory). Workers that cannot all map the file (other hosts, another IPC
namespace, no ``/dev/shm``, no room) fall back to gloo, all of them; ``ReplayResult.chain`` says
which was used.

**approximate** (``exact=False``): each worker sums its slice locally, then one all-reduce. Both
this and the sequential replay are floating-point sums of the same ``n`` terms in different
orders; any order satisfies ``|fl(sum g_i) - sum g_i| <= gamma_{n-1} * sum |g_i|`` elementwise
(``gamma_k = k u / (1 - k u)``, ``u`` the unit roundoff: 2**-24 for float32), so from identical
states the reduced gradient differs from the sequential one by at most
``2 * gamma_{n-1} * sum_i |g_i|`` per element (before the identical division by the scale factor).
The workers compute that bound (one more all-reduce of ``sum |g_i|``) and report its largest
value as ``grad_error_bound``; ``dump_gradients`` writes the reduced gradients and the elementwise
bound per iteration. The approximate replay therefore equals a sequential replay whose every
gradient is perturbed within that bound. AdamW's update is ``m_hat / (sqrt(v_hat) + eps)``, whose
size is at most ``C = (1 - b1) / sqrt(1 - b2) / sqrt(1 - b1**2 / b2)`` (about 7.3 for betas
(0.9, 0.999), bias correction included), so the final parameters of the two replays differ by at
most ``2 * C * sum_t lr_t``: a valid bound but a loose one (the measured difference, see
``bench/results/replay.json``, is many orders smaller). Sends after the first iteration then differ
from the logged ones, so the approximate mode verifies only the first iteration's sends and never
reports ``verified``.

Launching: :func:`run_parallel` spawns the workers with ``torch.multiprocessing`` (a TCPStore in the
calling process carries the rendezvous); under torchrun run ``python -m replay.parallel --job
job.json --result result.json`` (every rank reads the same job; ``WORLD_SIZE`` is the number of
workers; rank 0 writes the result).

Never: lets workers step with different gradients (they all use the reduced sum), or writes an
output when a worker failed or the workers' parameters differ.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import logging
import math
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from logstore import RecordKey
from logstore.errors import CorruptRecordError, SwiftlogError
from replay.core import locate_logs, replay_device, replay_stages
from replay.errors import ReplayError, ReplayInputMissingError, ReplayOrderError
from replay.job import (
    ProgressTracker,
    ReplayJob,
    ReplayProgress,
    ReplayResult,
    SourceSpec,
    StageFactory,
    close_sources,
    log_outcome,
    open_sources,
)
from replay.reader import LogReader
from replay.report import ReplayReport
from replay.stage import ReplayHooks, StageState
from replay.states import PreparedStates, build_states, loss_and_data, write_outputs
from trainer_client.buffers import BufferSnapshot, named_buffers
from trainer_client.commit import gloo_on_loopback, loopback_store
from trainer_client.digest import tensor_digest

__all__ = [
    "run_parallel",
    "worker_main",
    "worker_prefetch",
    "result_of",
    "slice_of",
    "balanced_counts",
    "adamw_update_bound",
    "main",
]

logger = logging.getLogger(__name__)

PG_TIMEOUT = datetime.timedelta(minutes=10)


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
    (:class:`_Claims`), so the pair's boundary lands where their speeds put it in this very
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


class _Share:
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


class _Claims:
    """Tickets for the contested micro-batches, from an atomic counter per (pair, iteration) in a
    ``torch.distributed.Store`` every worker reaches (the rendezvous store): ticket ``t`` of an
    iteration wins iff ``t <= len(contested)``, so the two workers of a pair take every contested
    position exactly once between them, whichever asks first. A worker stops at its first losing
    ticket; the first worker of the pair deletes the counter once the iteration's reduction is over
    (every claim of the iteration precedes it)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def take(self, sh: _Share) -> int | None:
        """Claim the next contested position of ``sh`` (front or back); None: all are taken."""
        if sh.done:
            return None
        if self.store.add(sh.key, 1) > len(sh.contested):
            sh.done = True
            return None
        sh.won += 1
        return sh.contested.start + sh.won - 1 if sh.front else sh.contested.stop - sh.won

    def forget(self, sh: _Share) -> None:
        if sh.front and sh.contested:
            self.store.delete_key(sh.key)


def _gamma(k: int, dtype: torch.dtype) -> float:
    u = torch.finfo(dtype).eps / 2
    return k * u / (1 - k * u)


def adamw_update_bound(beta1: float = 0.9, beta2: float = 0.999) -> float:
    """``C``: the largest size of one AdamW update direction ``m_hat / sqrt(v_hat)`` (module docstring).

    Valid when ``beta1**2 < beta2`` and the bias-correction factor ``sqrt(1 - b2**t) / (1 - b1**t)``
    stays <= 1 (true for the default betas); raises ValueError otherwise.
    """
    if not beta1**2 < beta2:
        raise ValueError(f"the bound needs beta1**2 < beta2, got {beta1}, {beta2}")
    worst = max(math.sqrt(1 - beta2**t) / (1 - beta1**t) for t in range(1, 100_000, 7))
    if worst > 1.0 + 1e-12:
        raise ValueError(f"bias correction exceeds 1 ({worst:.3f}) for betas ({beta1}, {beta2})")
    return (1 - beta1) / math.sqrt(1 - beta2) / math.sqrt(1 - beta1**2 / beta2)


# ====================================================================== gradient reduction
def _buckets(params: Sequence[torch.Tensor], limit: int = 1 << 20) -> list[range]:
    """Runs of consecutive parameters of one dtype, at most ``limit`` bytes each (a bigger parameter
    alone): a run's gradients are one contiguous slice of its dtype's flat buffer."""
    buckets: list[range] = []
    lo = size = 0
    for i, p in enumerate(params):
        n = p.numel() * p.element_size()
        if i > lo and (size + n > limit or p.dtype != params[lo].dtype):
            buckets.append(range(lo, i))
            lo, size = i, 0
        size += n
    if lo < len(params):
        buckets.append(range(lo, len(params)))
    return buckets


SHM_DIR = "/dev/shm"
CHAIN_PREFIX = "swiftlog-chain-"


def _remove_stale_chains(directory: str, older_than_s: float = PG_TIMEOUT.total_seconds()) -> list[str]:
    """Unlink shared-chain files in ``directory`` older than ``older_than_s`` (default: the
    rendezvous timeout); returns their names. Worker 0 unlinks its file as soon as every worker
    has mapped it, which happens within that timeout or never; a file older than it was left by a
    worker 0 killed in between (its memory is tmpfs RAM until unlinked). Never touches a younger
    file or anything not named like a chain."""
    gone = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(CHAIN_PREFIX)]
    except OSError:
        return gone
    now = time.time()
    for n in names:
        path = os.path.join(directory, n)
        try:
            if now - os.stat(path).st_mtime > older_than_s:
                os.unlink(path)
                gone.append(n)
        except OSError:  # gone already, or not ours to remove
            continue
    if gone:
        logger.info(
            "parallel replay: removed %d stale shared-chain file(s) from %s: %s",
            len(gone),
            directory,
            ", ".join(gone[:3]),
        )
    return gone


class _SharedChain:
    """Same-host transport for the exact chain's running sums: two flat buffers per dtype (one per
    iteration parity) in one shared-memory file that every worker maps. Worker 0 writes its
    gradients there, each next worker adds its stash in place, and only the buckets' small
    "present" flags travel over gloo, as the signal that a bucket is ready: no socket copies of
    the gradients. Two buffers because a worker may still copy iteration ``i``'s total out while
    worker 0 already writes iteration ``i + 1``'s; iteration ``i + 2``'s writes wait for every
    worker's part in ``i + 1``'s chain, which comes after its copy.

    Never: used unless every worker mapped the same file (a random token written by worker 0 is
    read back by each; workers on other hosts, or in another IPC namespace, fail that and every
    worker keeps gloo), or leaves the file behind (it is unlinked once mapped, or on failure; one
    that a worker 0 killed in between left is removed by the next :meth:`create` once it is older
    than the rendezvous timeout, :func:`_remove_stale_chains`).
    """

    ALIGN = 64

    def __init__(self, flat: torch.Tensor, sizes: dict[torch.dtype, int]) -> None:
        offsets, _ = self._layout(sizes)
        self.bufs = [
            {dt: flat[off : off + sizes[dt] * dt.itemsize].view(dt) for dt, off in offs.items()} for offs in offsets
        ]

    @classmethod
    def _layout(cls, sizes: dict[torch.dtype, int]) -> tuple[list[dict[torch.dtype, int]], int]:
        """Byte offset of each parity's buffer of each dtype (after the token), and the file's size."""
        offsets: list[dict[torch.dtype, int]] = [{}, {}]
        off = cls.ALIGN
        for parity in (0, 1):
            for dt, n in sizes.items():
                offsets[parity][dt] = off
                off += -(-n * dt.itemsize // cls.ALIGN) * cls.ALIGN
        return offsets, off

    @staticmethod
    def create(directory: str, size: int, token: bytes) -> str | None:
        """A new file of ``size`` bytes in ``directory`` (space reserved, so a full tmpfs fails here
        and not later as SIGBUS) starting with ``token``; its path, or None when that is not possible."""
        if not hasattr(os, "posix_fallocate"):
            return None
        _remove_stale_chains(directory)
        fd, path = -1, None
        try:
            fd, path = tempfile.mkstemp(prefix=CHAIN_PREFIX, dir=directory)
            os.posix_fallocate(fd, 0, size)
            os.pwrite(fd, token, 0)
            return path
        except OSError as e:
            logger.info("parallel replay: no shared-memory chain (%s); gradients go over gloo", e)
            if path is not None:
                os.unlink(path)
            return None
        finally:
            if fd >= 0:
                os.close(fd)

    @classmethod
    def open(
        cls, sizes: dict[torch.dtype, int], rank: int, wanted: bool = True, directory: str = SHM_DIR
    ) -> _SharedChain | None:
        """Collective (every worker calls it after the process group is up, with worker 0's
        ``wanted`` and ``directory`` deciding): the shared buffers, or None (gloo carries the
        gradients) when not ``wanted``, when worker 0 cannot make the file (:meth:`create`: no
        ``/dev/shm``, no room) or when any worker cannot map it."""
        _, size = cls._layout(sizes)
        token = uuid.uuid4().bytes
        path = cls.create(directory, size, token) if rank == 0 and wanted else None
        mine = path
        flat: torch.Tensor | None = None
        try:
            where = [path, token]
            dist.broadcast_object_list(where, src=0)
            path, token = where
            if path is not None and os.path.exists(path):  # (from_file would create a missing one)
                try:
                    flat = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                    if bytes(flat[: len(token)].tolist()) != token:
                        flat = None
                except (OSError, RuntimeError):
                    flat = None
            ok = torch.tensor([flat is not None], dtype=torch.int32)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every worker has mapped it (or failed) after this
        finally:
            if mine is not None:
                os.unlink(mine)
        if not ok.item():
            if path is not None:
                logger.info(
                    "parallel replay: not every worker could map the shared-memory chain; gradients go over gloo"
                )
            return None
        assert flat is not None
        return cls(flat, sizes)


class _GradReducer:
    """Collects each worker's micro-batch gradients and reduces them over the workers.

    Exact mode: worker 0's slice starts the running sum, so autograd accumulates it in ``.grad``
    exactly as the sequential replay does; a worker r > 0 takes each micro-batch's gradient tensors
    out of ``.grad`` (references, no copy) until the running sum of the slices before it arrives.
    The running sum travels in buckets (consecutive parameters, about 1 MiB, sent last parameters
    first) so that the chain is a pipeline: worker 0 sends a bucket from a gradient hook as soon as
    its last backward has finished that bucket's parameters (while it computes the rest), worker
    r > 0 adds its stash to a bucket as soon as it arrives and passes it on while the next ones
    travel, and the last worker sends each finished bucket back to the others. Each bucket's
    "present" flags travel with it (they decide, per parameter, whether the next gradient is
    assigned or added).
    Approximate mode: every worker sums its slice into a flat buffer (the same arithmetic) and,
    for the error bound, the absolute values. Flat buffers hold one dtype each (views give each
    parameter its slice); a parameter's "present" flag says whether any micro-batch produced a
    gradient for it, so one without keeps ``grad=None`` as in the sequential replay.
    Call :meth:`close` when done: it removes the gradient hooks from the (surviving) modules.
    """

    #: weight of the newest iteration in the averaged time per micro-batch
    EMA = 0.5

    def __init__(
        self,
        states: Sequence[StageState],
        rank: int,
        world: int,
        *,
        exact: bool,
        start: int,
        dump_dir: str | None = None,
        lag: int = 1,
        claims: _Claims | None = None,
        claim_min_s: float = 0.0,
    ) -> None:
        self.rank, self.world, self.exact = rank, world, exact
        self.claims = claims if world > 1 else None  # None: every iteration's shares are fixed up front
        self.claim_min_s = claim_min_s  # claims only when a micro-batch took this long (seconds)
        self._shares: dict[int, _Share] = {}  # iteration -> this worker's share (a fixed one has nothing contested)
        self._finished = start - 1  # the last iteration whose gradients were reduced
        self.states = list(states)
        self.first_it = start
        # module buffers (running statistics) follow every micro-batch's forward: None = not known yet
        # whether the forwards change them; the first iteration runs all forwards and finds out
        self.buffers_mutate: bool | None = None if world > 1 and self._named_buffers() else False
        self._buffers = BufferSnapshot()  # the buffers at the start of the current iteration
        self.lag = max(1, lag)  # iteration i's split uses the times measured up to i - lag
        self.per_mb: dict[int, list[float]] = {}  # iteration -> averaged seconds per micro-batch, per worker
        self.splits: dict[int, list[int]] = {}  # iteration -> micro-batches per worker, as replayed
        self._planned: dict[int, list[int]] = {}  # iteration -> micro-batches per worker, as planned by balanced_counts
        self._t_ready = time.perf_counter()
        self.params = [p for st in states for p in st.module.parameters()]
        self.dtypes = sorted({p.dtype for p in self.params}, key=str)
        sizes = {dt: 0 for dt in self.dtypes}
        self.where: list[tuple[torch.dtype, int, int]] = []
        for p in self.params:
            self.where.append((p.dtype, sizes[p.dtype], p.numel()))
            sizes[p.dtype] += p.numel()
        self.sizes = sizes
        self.buckets = _buckets(self.params)
        self.bucket_of = [b for b, r in enumerate(self.buckets) for _ in r]
        self.send_order = list(range(len(self.buckets)))[::-1]  # backward usually finishes the last parameters first
        self.dump_dir = dump_dir
        self.bound_max = 0.0
        self.global_n = 0
        self.chained = exact and world > 1
        self.shared: _SharedChain | None = (
            None  # the chain's running sums in shared memory (use_shared), else sent over gloo
        )
        self._par = 1  # iteration parity: which of the shared buffers this iteration uses (flipped by _reset)
        self._hooks: list[Any] = []
        self._armed = False
        if self.chained:
            self.flags = torch.zeros(len(self.params), dtype=torch.uint8)  # "present", as it travels with the buckets
            self.info = torch.zeros(
                2 * world + 1, dtype=torch.float64
            )  # every worker's time per micro-batch and count; "buffers changed" anywhere
            if rank < world - 1:  # the total arrives in buffers of its own (this worker's sends may still read acc)
                self.final = {dt: torch.zeros(self.sizes[dt], dtype=dt) for dt in self.dtypes}
                self.final_views = [self._view(self.final, i) for i in range(len(self.params))]
                self.final_flags = torch.zeros(len(self.params), dtype=torch.uint8)
                self.final_info = torch.zeros(2 * world + 1, dtype=torch.float64)
            if rank == 0:  # (a frozen parameter has no hook; its bucket goes when the backward is over)
                self._hooks = [
                    p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
                    for i, p in enumerate(self.params)
                    if p.requires_grad
                ]
        self._reset()

    def use_shared(self, shared: _SharedChain | None) -> None:
        """Carry the exact chain's running sums in ``shared`` (every worker's, from
        :meth:`_SharedChain.open`) instead of sending them over gloo; None: gloo."""
        if shared is None or not self.chained:
            return
        self.shared = shared
        self._shared_views = [
            [self._view(shared.bufs[parity], i) for i in range(len(self.params))] for parity in (0, 1)
        ]
        if (
            self.rank < self.world - 1
        ):  # only the last worker keeps a private copy of the sums (its step divides them in place)
            self.acc, self.views = {}, []

    def _copy_total(self, dst: dict[torch.dtype, torch.Tensor], b: int) -> None:
        """Bucket ``b`` of this iteration's shared total into ``dst``, a buffer of this worker's own."""
        assert self.shared is not None
        self._flat(dst, b).copy_(self._flat(self.shared.bufs[self._par], b))

    def _chain_views(self) -> list[torch.Tensor]:
        """Where the running sum of this iteration is formed: the shared buffer of its parity, or acc."""
        return self._shared_views[self._par] if self.shared is not None else self.views

    def close(self) -> None:
        """Remove the gradient hooks (the modules go on without them)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _reset(self) -> None:
        """Ready for the next iteration; buffers are allocated once (the optimizer has let go of the
        gradient views by now: ``zero_grad(set_to_none=True)``)."""
        if not hasattr(self, "acc"):
            self.acc = {dt: torch.zeros(self.sizes[dt], dtype=dt) for dt in self.dtypes}
            self.abs = None if self.exact else {dt: torch.zeros(self.sizes[dt], dtype=dt) for dt in self.dtypes}
            self.views = [
                self._view(self.acc, i) for i in range(len(self.params))
            ]  # made once: slicing costs more than adding here
        elif not self.exact:  # summed by all-reduce: a slice no micro-batch wrote must be zero
            assert self.abs is not None
            for dt in self.dtypes:
                self.acc[dt].zero_()
                self.abs[dt].zero_()
        # exact mode: a slice is assigned by its first gradient; one that none wrote is never read
        self._par ^= 1
        self.present = [False] * len(self.params)
        self.stash: list[tuple[int, list[torch.Tensor | None]]] = []  # (position in backward order, gradients)
        self.n_mb = 0
        self._armed = False
        self._shipped = [False] * len(self.buckets)
        self._pending = [
            sum(self.params[i].requires_grad for i in r) or -1 for r in self.buckets
        ]  # hooks to go (-1: none)
        self._sends: list[Any] = []
        self._chain_in: dict[int, list[Any]] | None = None  # bucket -> receives (data, flags) from rank - 1
        self._info_in: Any = None

    def _view(self, flats: dict[torch.dtype, torch.Tensor], i: int) -> torch.Tensor:
        dt, off, n = self.where[i]
        return flats[dt][off : off + n].view(self.params[i].shape)

    def _flat(self, flats: dict[torch.dtype, torch.Tensor], b: int) -> torch.Tensor:
        """Bucket ``b``'s slice of ``flats`` (its parameters are consecutive of one dtype)."""
        r = self.buckets[b]
        dt, off, _ = self.where[r.start]
        _, off_last, n_last = self.where[r.stop - 1]
        return flats[dt][off : off_last + n_last]

    def _accumulate(
        self, idx: Sequence[int], grads: Sequence[torch.Tensor | None], views: Sequence[torch.Tensor] | None = None
    ) -> None:
        """``views[i] += grads[i]`` for ``i`` in ``idx`` (default views: acc's), in AccumulateGrad's
        arithmetic: a parameter's first gradient is assigned, the next ones added (one
        ``_foreach_add_`` call: on CPU the same per-tensor ``add_``, without a Python round per parameter)."""
        views = self.views if views is None else views
        add_to: list[torch.Tensor] = []
        add: list[torch.Tensor] = []
        for i in idx:
            g = grads[i]
            if g is None:
                continue
            if self.present[i]:
                add_to.append(views[i])
                add.append(g)
            else:
                views[i].copy_(g)
                self.present[i] = True
        if add_to:
            torch._foreach_add_(add_to, add)

    def _add(self, grads: Sequence[torch.Tensor | None]) -> None:
        """``acc += grads`` (see :meth:`_accumulate`)."""
        self._accumulate(range(len(self.params)), grads)

    def _take(self) -> list[torch.Tensor | None]:
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return grads

    # -- hooks --------------------------------------------------------------------------
    def start(self) -> None:
        """The replay starts now (the first iteration's time per micro-batch is measured from here)."""
        self._snap_buffers()
        self._t_ready = time.perf_counter()

    # -- module buffers -------------------------------------------------------------------
    def _named_buffers(self) -> dict[str, torch.Tensor]:
        return named_buffers({f"stage {st.stage} ": st.module for st in self.states})

    def _watching_buffers(self) -> bool:
        """Whether a buffer change could still be missed: several workers, and not every forward runs here."""
        return self.world > 1 and self.buffers_mutate is not True

    def _snap_buffers(self) -> None:
        """Copy the buffers at the start of an iteration, while it is still open whether the forwards
        change them (contents are compared: BatchNorm's kernel updates its running statistics
        without bumping their version counters)."""
        if self._watching_buffers():
            self._buffers.take(self._named_buffers())

    def shadow_forwards(self, it: int) -> bool:
        """Whether iteration ``it`` runs every micro-batch's forward here (ReplayHooks.shadow_forwards):
        in the first iteration whenever the stages have buffers (to find out whether the forwards
        change them), later iff they did. Until the first iteration has shown it, the prefetch
        thread asking ahead hears no (a record it did not fetch is fetched when needed)."""
        if self.buffers_mutate is None:
            return it == self.first_it
        return self.buffers_mutate

    def _settle_buffers(self, it: int, changed_here: list[str], changed_anywhere: bool) -> None:
        """After iteration ``it``'s forwards: the first iteration decides whether later ones run
        every forward; a change after a first iteration without any is an error (the other
        workers' forwards did not run here, so the buffers would be wrong), never silent."""
        if self.buffers_mutate is None:
            self.buffers_mutate = changed_anywhere
            if changed_anywhere:
                logger.info(
                    "parallel replay: the forwards change module buffers (%s): every worker runs every forward",
                    ", ".join(changed_here[:3]) or "seen by another worker",
                )
        elif changed_anywhere and not self.buffers_mutate:
            where = ", ".join(changed_here[:5]) or "on another worker"
            raise ReplayError(
                f"parallel replay: module buffers changed in iteration {it} ({where}) but not in iteration {self.first_it}, "
                "so this worker did not run the other workers' forwards and its buffers would differ from the live run's",
                hint="replay these stages with one worker (sequential replay reproduces every buffer update)",
            )

    def _buffers_changed(self) -> list[str]:
        return self._buffers.changed(self._named_buffers()) if self._watching_buffers() else []

    def _dynamic(self, it: int) -> bool:
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
        if it <= self._finished:  # a prefetch thread that fell behind: the iteration is over
            return slice_of(order, self.rank, self.world, self.splits.get(it))
        counts = self._planned[it] = balanced_counts(len(order), self.per_mb.get(it - self.lag), self.world)
        if self._dynamic(it):
            sure, contested, front = share_layout(len(order), counts, self.rank, self.world)
        else:  # a fixed share: nothing contested
            lo = sum(counts[: self.rank])
            sure, contested, front = range(lo, lo + counts[self.rank]), range(0), True
        sh = _Share(order, sure, contested, front, key=f"{self.rank // 2}/{it}")
        old = self._shares.setdefault(it, sh)
        if old is not sh and old.layout() != sh.layout() and old.won == 0 and old.pending is None:
            self._shares[it] = old = sh
        return [order[i] for i in old.sure]

    def likely(self, it: int, order: Sequence[int]) -> list[int]:
        """The contested micro-batches this worker would get if the workers kept their measured
        speeds (its side of the planned boundary): prefetched with the sure ones."""
        sh = self._shares.get(it)
        if sh is None:
            return []
        b = sum(self._planned.get(it, [])[: self.rank - self.rank % 2 + 1])  # the planned boundary of the pair
        return [sh.order[i] for i in sh.contested if (i < b) == sh.front]

    def claim(self, it: int) -> int | None:
        """ReplayHooks.claim: the next contested micro-batch this worker won (claimed ahead by
        :meth:`before_backward` on the front side), or None once they are all taken."""
        sh = self._shares.get(it)
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

    def _is_last(self, it: int, mb: int) -> bool:
        """Whether ``mb`` is this worker's last micro-batch of iteration ``it``. With a dynamic share
        the next position is claimed now, one backward ahead: worker 0 must know when to send its
        running sum from the gradient hooks, and its partner claims as early so that neither gets
        an edge (of two equally fast workers, the one whose backward starts first ends first)."""
        sh = self._shares[it]
        if mb == sh.last and sh.pending is None and self.claims is not None:
            sh.pending = self.claims.take(sh)
        return mb == sh.last and sh.pending is None and sh.done

    def before_backward(self, it: int, mb: int) -> None:
        last = self._is_last(it, mb)
        if not self.chained:
            return
        if self.rank == 0:  # the last backward of worker 0's slice finishes the running sum parameter by parameter
            self._armed = last
        elif self._chain_in is None:  # the previous step has let go of acc: the running sum may arrive
            self._post_chain_receives()

    def _grad_ready(self, i: int, _param: torch.Tensor) -> None:
        """Worker 0's gradient hook: parameter ``i``'s ``.grad`` is final once its last backward
        accumulated it; a bucket whose parameters all are goes on its way."""
        if not self._armed:
            return
        b = self.bucket_of[i]
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._ship_first(b)

    def after_backward(self, it: int, mb: int) -> None:
        self.n_mb += 1
        if self.exact:
            if self.rank > 0:  # kept apart until the running sum of the earlier slices arrives
                self.stash.append((self._shares[it].order.index(mb), self._take()))
            return  # worker 0: autograd accumulates in .grad, as sequentially
        grads = self._take()
        self._add(grads)
        assert self.abs is not None
        for i, g in enumerate(grads):
            if g is not None:
                self._view(self.abs, i).add_(g.abs())

    def before_step(self, it: int, scale: int) -> None:
        if self.exact and self.world == 1:
            return  # nothing to reduce: .grad holds the sum
        mine = (time.perf_counter() - self._t_ready) / self.n_mb if self.n_mb else 0.0
        changed = self._buffers_changed()
        if self.exact:
            times, counts, anywhere = self._chain(mine, bool(changed))
        elif self.world > 1:
            times, counts, anywhere = self._all_reduce(mine, bool(changed))
            for i, p in enumerate(self.params):
                p.grad = self.views[i] if self.present[i] else None
        else:
            self.global_n = self.n_mb
            times, counts, anywhere = [mine], [self.n_mb], False  # one worker runs every forward: nothing to miss
            for i, p in enumerate(self.params):
                p.grad = self.views[i] if self.present[i] else None
        self._settle_buffers(it, changed, anywhere)
        self._record(it, times)
        self.splits[it] = counts
        self._planned.pop(it, None)
        self._finished = it
        sh = self._shares.pop(it, None)
        if (
            sh is not None and self.claims is not None
        ):  # every worker's claims of the iteration came before the reduction
            self.claims.forget(sh)
        if self.dump_dir is not None and self.rank == 0:
            self._dump(it, scale)

    def _record(self, it: int, times: Sequence[float]) -> None:
        """Average the workers' times per micro-batch of iteration ``it`` into the estimate that sizes
        iteration ``it + lag``'s slices (a worker without micro-batches keeps its estimate)."""
        prev = self.per_mb.get(it - 1)
        est = []
        for r, t in enumerate(times):
            old = prev[r] if prev is not None else 0.0
            est.append(t if old <= 0 else old if t <= 0 else self.EMA * t + (1 - self.EMA) * old)
        self.per_mb[it] = est
        self.per_mb.pop(it - self.lag - 1, None)  # no select() asks below it - lag any more

    # -- the exact chain ------------------------------------------------------------------
    def _tags(self, b: int, final: bool) -> tuple[int, int]:
        """Message tags of bucket ``b``'s data and flags, on the chain or on the way back."""
        n = len(self.buckets)
        return (2 * n + b, 3 * n + b) if final else (b, n + b)

    def _isend(self, b: int, data: dict[torch.dtype, torch.Tensor], flags: torch.Tensor, dst: int, final: bool) -> None:
        """Send bucket ``b``'s data (from ``data``; not with a shared chain: it is in shared
        memory already) and flags (the signal that the bucket is ready)."""
        r = self.buckets[b]
        t_data, t_flags = self._tags(b, final)
        if self.shared is None:
            self._sends.append(dist.isend(self._flat(data, b), dst=dst, tag=t_data))
        self._sends.append(dist.isend(flags[r.start : r.stop], dst=dst, tag=t_flags))

    def _irecv(
        self, b: int, data: dict[torch.dtype, torch.Tensor], flags: torch.Tensor, src: int, final: bool
    ) -> list[Any]:
        """Receive bucket ``b``'s data and flags into ``data`` / ``flags`` (the counterpart of :meth:`_isend`)."""
        r = self.buckets[b]
        t_data, t_flags = self._tags(b, final)
        works = [] if self.shared is not None else [dist.irecv(self._flat(data, b), src=src, tag=t_data)]
        return [*works, dist.irecv(flags[r.start : r.stop], src=src, tag=t_flags)]

    def _set_flags(self, b: int) -> None:
        r = self.buckets[b]
        self.flags[r.start : r.stop] = torch.tensor(self.present[r.start : r.stop], dtype=torch.uint8)

    def _ship_first(self, b: int) -> None:
        """Worker 0: bucket ``b``'s (final) ``.grad`` into the running sum and on to worker 1."""
        if self._shipped[b]:
            return
        self._shipped[b] = True
        views = self._chain_views()
        for i in self.buckets[b]:
            g = self.params[i].grad
            if g is not None:
                views[i].copy_(g)
                self.present[i] = True
        self._set_flags(b)
        self._isend(b, self.acc, self.flags, 1, final=False)

    def _post_chain_receives(self) -> None:
        """Worker r > 0: receive the running sum of the earlier slices into acc, bucket by bucket."""
        self._chain_in = {
            b: self._irecv(b, self.acc, self.flags, self.rank - 1, final=False) for b in range(len(self.buckets))
        }
        self._info_in = dist.irecv(self.info, src=self.rank - 1, tag=4 * len(self.buckets))

    def _chain(self, mine: float, changed: bool) -> tuple[list[float], list[int], bool]:
        """Running sum in backward order: 0 -> 1 -> ... -> K-1, bucket by bucket; the last worker
        sends each finished bucket to every other one. Every worker's time per micro-batch, its
        micro-batch count and whether its buffers ``changed`` travel with it; returns the times,
        the counts and whether any worker's buffers changed. On return ``.grad`` holds the total
        and no send is in flight."""
        n, last = len(self.buckets), self.world - 1
        dsts = (
            [self.rank + 1] if self.rank < last else range(last)
        )  # on along the chain, or (last) the total back to everyone
        finals: dict[int, list[Any]] = {}
        if self.rank < last:  # the total comes back from the last worker
            finals = {b: self._irecv(b, self.final, self.final_flags, last, final=True) for b in range(n)}
            final_info = dist.irecv(self.final_info, src=last, tag=4 * n + 1)
        sums = self._chain_views()
        if self.rank == 0:
            for b in self.send_order:  # those its gradient hooks have not sent (no gradient in the last micro-batch)
                self._ship_first(b)
            self._take()
            self.info[0] = mine
            self.info[self.world] = self.n_mb
            self.info[2 * self.world] = float(changed)
            self._sends.append(dist.isend(self.info, dst=1, tag=4 * n))
        else:
            if self._chain_in is None:  # no micro-batch here this iteration
                self._post_chain_receives()
            assert self._chain_in is not None
            self.stash.sort(key=lambda e: e[0])  # a back-side share is claimed from the back: add in backward order
            for b in self.send_order:
                r = self.buckets[b]
                for w in self._chain_in[b]:
                    w.wait()
                self.present[r.start : r.stop] = [bool(x) for x in self.flags[r.start : r.stop].tolist()]
                for (
                    _,
                    grads,
                ) in self.stash:  # per bucket: its running sums (about 1 MiB) stay in cache across the passes
                    self._accumulate(r, grads, sums)
                if self.shared is not None and self.rank == last:  # the step divides in place: a copy of its own
                    self._copy_total(self.acc, b)
                self._set_flags(b)
                for dst in dsts:
                    self._isend(b, self.acc, self.flags, dst, final=self.rank == last)
            self.stash = []
            self._info_in.wait()
            self.info[self.rank] = mine
            self.info[self.world + self.rank] = self.n_mb
            self.info[2 * self.world] = max(float(self.info[2 * self.world]), float(changed))
            for dst in dsts:
                self._sends.append(dist.isend(self.info, dst=dst, tag=4 * n + (self.rank == last)))
        for w in self._sends:  # the step divides the gradients in place; and acc is reused
            w.wait()
        self._sends = []
        if self.rank < last:
            for b in self.send_order:
                for w in finals[b]:
                    w.wait()
                if self.shared is not None:
                    self._copy_total(self.final, b)
            final_info.wait()
            self.present = [bool(x) for x in self.final_flags.tolist()]
        views = self.views if self.rank == last else self.final_views
        for i, p in enumerate(self.params):
            p.grad = views[i] if self.present[i] else None
        info = (self.info if self.rank == last else self.final_info).tolist()
        return info[: self.world], [int(x) for x in info[self.world : 2 * self.world]], info[2 * self.world] > 0

    def _all_reduce(self, mine: float, changed: bool) -> tuple[list[float], list[int], bool]:
        """Sum the gradients, their absolute values (for the bound), the "present" flags, the
        micro-batch counts and the "buffers changed" flags over the workers; returns every
        worker's time per micro-batch and micro-batch count, and whether any worker's buffers changed."""
        for dt in self.dtypes:
            dist.all_reduce(self.acc[dt])
        n, w = len(self.params), self.world
        counts = torch.zeros(n + 2 + 2 * w, dtype=torch.int64)
        counts[:n] = torch.tensor(self.present, dtype=torch.int64)
        counts[n] = self.n_mb
        counts[n + 1 + self.rank] = round(mine * 1e9)  # the others add zeros: a gather
        counts[n + 1 + w + self.rank] = self.n_mb
        counts[n + 1 + 2 * w] = int(changed)
        dist.all_reduce(counts)
        self.present = [bool(x) for x in counts[:n].tolist()]
        self.global_n = int(counts[n].item())
        assert self.abs is not None
        for dt in self.dtypes:
            dist.all_reduce(self.abs[dt])
            if self.abs[dt].numel():
                self.bound_max = max(self.bound_max, self._factor(dt) * float(self.abs[dt].max()))
        per = counts[n + 1 :].tolist()
        return [x / 1e9 for x in per[:w]], per[w : 2 * w], per[2 * w] > 0

    def _factor(self, dt: torch.dtype) -> float:
        """``2 * gamma_{n-1}`` for this iteration's n micro-batches."""
        return 2 * _gamma(max(self.global_n - 1, 0), dt)

    def _dump(self, it: int, scale: int) -> None:
        assert self.dump_dir is not None
        os.makedirs(self.dump_dir, exist_ok=True)
        doc: dict[str, Any] = {
            "iteration": it,
            "scale": scale,
            "exact": self.exact,
            "grads": [None if p.grad is None else p.grad.clone() for p in self.params],
        }
        if self.abs is not None:
            doc["bound"] = [self._factor(p.dtype) * self._view(self.abs, i) for i, p in enumerate(self.params)]
        torch.save(doc, os.path.join(self.dump_dir, f"grads-it{it:012d}.pt"))

    def end_iteration(self) -> None:
        self._reset()
        self._snap_buffers()
        self._t_ready = time.perf_counter()


# ====================================================================== a worker
def worker_main(
    rank: int,
    world: int,
    job: ReplayJob,
    *,
    store: dist.Store | None = None,
    result_path: str | None = None,
    progress: Any = None,
    factory: StageFactory | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    data_source: Callable[[int], Any] | None = None,
    sources: Sequence[Any] | None = None,
    keep_states: bool = False,
    timeout: datetime.timedelta = PG_TIMEOUT,
    prepared: PreparedStates | None = None,
) -> dict[str, Any] | None:
    """One worker of a parallel replay; returns the result document on rank 0 (None elsewhere).

    ``store``: the rendezvous store (None: ``env://``, as torchrun sets it up). ``result_path``:
    where rank 0 writes the result JSON. ``progress``: a queue that receives rank 0's progress
    dicts. ``sources``: record sources already open (not closed here; default: open
    ``job.sources``). ``keep_states``: rank 0's result also carries the recovered
    :class:`StageState` objects under ``"states"`` (not JSON; for a caller that goes on with them
    in this process, e.g. a replacement that is rank 0 itself). ``timeout``: of the rendezvous and
    of every collective. ``prepared``: this worker's stage objects built ahead
    (:class:`~replay.states.PreparedStates`; used only when they match the job). Raises what the
    replay raises (every rank that sees it).
    """
    t0 = time.perf_counter()
    opened = []
    reducer: _GradReducer | None = None
    try:
        if job.threads is not None:
            torch.set_num_threads(job.threads)
        if sources is None:
            opened = open_sources(job.sources, job.run)
        reader = LogReader(list(sources) if sources is not None else opened)
        # build first, then meet: each worker's set-up overlaps the others' start
        t_build = time.perf_counter()
        states = build_states(job, factory, prepared)
        build_s = time.perf_counter() - t_build
        dev = replay_device(states)
        if world > 1 and dev.type != "cpu":  # the same on every worker: each raises before the rendezvous
            raise ReplayError(
                f"parallel replay exchanges gradients over gloo, which runs on CPU; the stage factory put stages {job.stages} on {dev}",
                hint=f"replay with one worker on {dev}, or build the stages on CPU for workers > 1",
            )
        ck = states[0].checkpoint
        assert ck is not None
        loss, data = loss_and_data(job, ck.seed, loss_fn, data_source)
        start = ck.iteration
        # while the others may still be building: open the sources, read META, list the first iteration's records
        locate_logs(
            reader,
            job.stages,
            job.num_stages,
            start,
            data_source=data is not None,
            verify=job.verify,
            compare_logged=job.compare_logged,
        )
        if (
            job.threads is None
        ):  # this process is the worker's own: the live thread count for all it runs, not only inside each iteration
            _use_live_threads(reader, job.stages[0], start)
        if store is not None:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=timeout)
        claims = None
        if (
            world > 1 and job.dynamic_share_min_s is not None
        ):  # counters in the rendezvous store, under a name every worker agrees on
            nonce = [uuid.uuid4().hex if rank == 0 else None]
            dist.broadcast_object_list(nonce, src=0)
            claims = _Claims(
                dist.PrefixStore(
                    f"swiftlog-claims/{nonce[0]}",
                    store if store is not None else dist.distributed_c10d._get_default_store(),
                )
            )
        prefetch = worker_prefetch(
            job, world
        )  # (the split's lag follows job.fetch_ahead either way: the same splits on any host)
        reducer = _GradReducer(
            states,
            rank,
            world,
            exact=job.exact,
            start=start,
            dump_dir=job.dump_gradients,
            lag=job.fetch_ahead + 1,
            claims=claims,
            claim_min_s=job.dynamic_share_min_s or 0.0,
        )
        if reducer.chained:  # the same on every worker: a collective
            reducer.use_shared(_SharedChain.open(reducer.sizes, rank, job.shared_memory))
        hooks = ReplayHooks(
            select=reducer.select,
            claim=reducer.claim,
            likely=reducer.likely,
            before_backward=reducer.before_backward,
            after_backward=reducer.after_backward,
            before_step=reducer.before_step,
            verify=None if job.exact else (lambda it: it == start),
            verify_step=None
            if job.exact
            else (lambda it: False),  # sums in another order: other bits than the live step's
            shadow_forwards=reducer.shadow_forwards,
        )
        tracker: ProgressTracker | None = None
        mb_done = 0

        def on_iteration(it: int, report: ReplayReport) -> None:
            nonlocal mb_done
            reducer.end_iteration()
            mb_done += sum(reducer.splits[it])
            if tracker is not None:
                p = tracker(it, report, micro_batches=mb_done)
                if progress is not None:
                    progress.put(p.to_dict())

        setup_s = time.perf_counter() - t0
        dist.barrier()  # replay time is measured from a common start
        t_replay = time.perf_counter()
        cpu0 = time.process_time()
        tracker = ProgressTracker(job, start, None, workers=world) if rank == 0 else None
        reducer.start()
        report = replay_stages(
            states,
            reader,
            num_stages=job.num_stages,
            stop_iteration=job.stop_iteration,
            loss_fn=loss,
            data_source=data,
            n_microbatches=job.n_microbatches,
            scale_grads=job.scale_grads,
            verify=job.verify,
            compare_logged=job.compare_logged,
            prefetch=prefetch,
            hooks=hooks,
            on_iteration=on_iteration,
        )
        replay_s = time.perf_counter() - t_replay
        replay_cpu = time.process_time() - cpu0
        if not job.exact:
            note = f"approximate parallel replay: only iteration {start}'s sends are verified (later states differ within the stated bound)"
            report.warnings.append(note)
        digest = _state_digest(states)
        payload = {
            "report": report.to_dict(),
            "setup_s": setup_s,
            "build_s": build_s,
            "replay_s": replay_s,
            "cpu_s": replay_cpu,
            "bound": reducer.bound_max,
            "digest": digest,
        }
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, payload)
        if len({g["digest"] for g in gathered}) != 1:
            raise ReplayError(
                f"parallel replay workers ended with different parameters or buffers (digests {[g['digest'] for g in gathered]})",
                hint="a nondeterministic kernel or an environment difference between workers",
            )
        result = None
        if rank == 0:
            merged = ReplayReport.from_dict(gathered[0]["report"])
            for g in gathered[1:]:
                merged.merge(ReplayReport.from_dict(g["report"]))
            merged.compute_seconds = max(g["report"]["compute_seconds"] for g in gathered)
            merged.seconds = max(g["report"]["seconds"] for g in gathered)
            bound = max(g["bound"] for g in gathered) if not job.exact else None
            outputs = write_outputs(job, states, merged, extra={"grad_error_bound": bound})
            result = {
                "report": merged.to_dict(),
                "outputs": {str(k): v for k, v in outputs.items()},
                "setup_seconds": max(g["setup_s"] for g in gathered),
                "build_seconds": max(g["build_s"] for g in gathered),
                "replay_seconds": max(g["replay_s"] for g in gathered),
                "cpu_seconds": [g["cpu_s"] for g in gathered],
                "grad_error_bound": bound,
                "workers": world,
                "split": sorted(reducer.splits.items()),  # [iteration, micro-batches per worker]
                "chain": None if not reducer.chained else "shared memory" if reducer.shared is not None else "gloo",
            }
            if result_path is not None:
                tmp = f"{result_path}.partial-{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump(result, f)
                os.replace(tmp, result_path)
            if keep_states:
                result["states"] = list(states)
        dist.barrier()
        return result
    except BaseException as e:
        if result_path is not None:
            _write_error(result_path, rank, e)
        raise
    finally:
        if reducer is not None:
            reducer.close()
        close_sources(opened)
        if dist.is_initialized():
            _destroy_default_group()


def _local(spec: SourceSpec) -> bool:
    """Whether reading from ``spec`` costs CPU only (this host's files), not a network round trip."""
    if spec.kind == "metas":
        return True
    if spec.kind == "store":
        return spec.cold_url is None or spec.cold_url.startswith("file://")
    return spec.kind == "cold" and spec.location.startswith("file://")


def worker_prefetch(job: ReplayJob, world: int, cores: int | None = None) -> int:
    """How many iterations a parallel worker fetches ahead: ``job.prefetch`` when set; by default
    (None) ``DEFAULT_PREFETCH``, except 0 (each record fetched by the compute thread when it needs
    it) when the ``world`` workers leave no core of this host's ``cores`` (default: those this
    process may run on) spare and every source is local. A prefetch thread pays when it hides I/O
    latency or has a core of its own; with neither it only competes with the compute thread for the GIL, and a thread preempted while
    holding it stalls the next forward: a 2-worker replay of the bench stage on 2 cores waited
    2-5 ms for its first record of each iteration and ran that forward 5-10 ms slower (paired
    A/B, 12 rounds twice: 0.96x the replay time without the thread)."""
    if job.prefetch is not None:
        return job.prefetch
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 0 if world >= cores and all(_local(s) for s in job.sources) else job.fetch_ahead


def _use_live_threads(reader: LogReader, stage: int, iteration: int) -> None:
    """``torch.set_num_threads`` to the live run's value (META ``env.num_threads`` of ``stage`` at
    ``iteration``), for the whole worker process. The replay runs each iteration with that count
    anyway; without this, work between and around iterations (buffer snapshots, the prefetch
    thread's tensors) ran with one thread per core, and OpenMP's threads spin for a while after
    each parallel region, on cores the other workers compute on. Missing or unreadable META:
    left as is (the replay reports it)."""
    try:
        doc = reader.meta(stage, iteration) or {}
        live = doc.get("env", {}).get("num_threads")
    except Exception as e:  # noqa: BLE001 - the replay meets it again and reports it
        logger.debug("no live thread count for stage %d at iteration %d: %s", stage, iteration, e)
        return
    if isinstance(live, int) and live > 0 and live != torch.get_num_threads():
        torch.set_num_threads(live)


def _destroy_default_group() -> None:
    """``destroy_process_group()``, with the gloo backend's destructor (it joins the backend's
    threads: ~20 ms) run on another thread, off a recovery's critical path. Not a daemon thread:
    the interpreter waits for it at exit (a backend torn down during interpreter shutdown aborts)."""
    last_ref = [dist.group.WORLD]
    dist.destroy_process_group()
    threading.Thread(target=last_ref.clear, name="swiftlog-replay-pg-release").start()


def _state_digest(states: Sequence[StageState]) -> str:
    """A digest of every parameter's and buffer's bytes (the same on every worker iff they stepped
    identically and their buffers evolved alike)."""
    h = hashlib.blake2b(digest_size=16)
    for st in states:
        for t in (*st.module.parameters(), *st.module.buffers()):
            h.update(tensor_digest(t.detach()).to_bytes(8, "big"))
    return h.hexdigest()


def _write_error(result_path: str, rank: int, e: BaseException) -> None:
    doc = {
        "rank": rank,
        "type": type(e).__name__,
        "message": getattr(e, "message", None) or str(e),
        "key": str(getattr(e, "key", "") or "") or None,
        "hint": getattr(e, "hint", None),
    }
    try:
        with open(f"{result_path}.error-{rank}", "w") as f:
            json.dump(doc, f)
    except OSError:
        logger.warning("worker %d could not record its error %s", rank, doc)


def _raise_worker_error(result_path: str, world: int, fallback: str) -> None:
    docs = []
    for r in range(world):
        try:
            with open(f"{result_path}.error-{r}") as f:
                docs.append(json.load(f))
        except (OSError, ValueError):
            continue
    # the root cause: a missing / corrupt record beats the errors it caused in the other workers
    docs.sort(key=lambda d: (d["type"] not in ("ReplayInputMissingError", "CorruptRecordError"), d["rank"]))
    if not docs:
        raise ReplayError(f"parallel replay failed: {fallback}")
    d = docs[0]
    msg = f"worker {d['rank']}: {d['message']}"
    if d["type"] == "ReplayInputMissingError" and d.get("key"):
        raise ReplayInputMissingError(msg, key=RecordKey.parse(d["key"]), hint=d.get("hint"))
    if d["type"] == "CorruptRecordError":
        key = RecordKey.parse(d["key"]) if d.get("key") else None
        raise CorruptRecordError(msg, key=key, hint=d.get("hint"))
    if d["type"] == "ReplayOrderError":
        raise ReplayOrderError(msg, hint=d.get("hint"))
    raise ReplayError(f"parallel replay failed in {msg} ({d['type']})", hint=d.get("hint"))


# ====================================================================== spawning
def _spawn_entry(
    rank: int,
    world: int,
    job_doc: dict[str, Any],
    host: str,
    port: int,
    prefix: str,
    result_path: str,
    progress: Any,
    factory: StageFactory | None,
    loss_fn: Any,
    data_source: Any,
) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"replay-worker{rank} %(levelname)s %(name)s: %(message)s")
    gloo_on_loopback()  # spawned workers of one host
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=120))
    worker_main(
        rank,
        world,
        ReplayJob.from_dict(job_doc),
        store=dist.PrefixStore(prefix, store),
        result_path=result_path,
        progress=progress,
        factory=factory,
        loss_fn=loss_fn,
        data_source=data_source,
    )


def run_parallel(
    job: ReplayJob,
    *,
    factory: StageFactory | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    data_source: Callable[[int], Any] | None = None,
    on_progress: Callable[[ReplayProgress], None] | None = None,
    start_method: str = "forkserver",
    timeout_s: float | None = None,
) -> ReplayResult:
    """Spawn ``job.workers`` worker processes (torch.multiprocessing) and run the job over them.

    The rendezvous TCPStore is hosted here on 127.0.0.1. ``start_method``: "forkserver" (default:
    workers fork from a server that imported torch once), "spawn" or "fork" (only when this
    process has not opened the stores: an LMDB environment must not cross a fork, so a forked
    worker cannot open a hot tier its parent holds open and reads the cold tier instead).
    Callables given here must be picklable. Raises the workers' ReplayInputMissingError / CorruptRecordError (naming the
    record) or ReplayError; on ``timeout_s`` every worker is killed and ReplayError raised.
    """
    import torch.multiprocessing as tmp

    t0 = time.perf_counter()
    world = job.workers
    if start_method == "forkserver":
        import multiprocessing

        multiprocessing.get_context("forkserver").set_forkserver_preload(
            ["torch", "torch.distributed", "replay.parallel"]
        )
    host = loopback_store(datetime.timedelta(seconds=120))  # the workers are processes of this host
    ctx = tmp.get_context(start_method)
    queue = ctx.SimpleQueue() if on_progress is not None else None
    with tempfile.TemporaryDirectory(prefix="swiftlog-replay-") as d:
        result_path = os.path.join(d, "result.json")
        pc = tmp.start_processes(
            _spawn_entry,
            args=(
                world,
                job.to_dict(),
                "127.0.0.1",
                host.port,
                f"replay-{uuid.uuid4().hex}",
                result_path,
                queue,
                factory,
                loss_fn,
                data_source,
            ),
            nprocs=world,
            join=False,
            start_method=start_method,
        )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                try:
                    done = pc.join(timeout=0.05)
                except Exception as e:  # a worker raised or died: the others are terminated by join()
                    _raise_worker_error(result_path, world, f"{type(e).__name__}: {str(e)[-2000:]}")
                _drain(queue, on_progress)
                if done:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise ReplayError(f"parallel replay of stages {job.stages} did not finish within {timeout_s} s")
        finally:
            for p in pc.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        _drain(queue, on_progress)
        with open(result_path) as f:
            doc = json.load(f)
    res = result_of(job, doc, time.perf_counter() - t0, outputs={int(k): v for k, v in doc["outputs"].items()})
    log_outcome(res)
    return res


def result_of(
    job: ReplayJob, doc: dict[str, Any], seconds: float, *, outputs: dict[int, str] | None = None, states: Any = None
) -> ReplayResult:
    """The :class:`ReplayResult` of ``job`` from rank 0's result document (:func:`worker_main`),
    ``seconds`` end to end as the caller measured them."""
    return ReplayResult(
        job,
        ReplayReport.from_dict(doc["report"]),
        outputs or {},
        states,
        seconds,
        doc["replay_seconds"],
        doc["setup_seconds"],
        doc["grad_error_bound"],
        doc["cpu_seconds"],
        doc["build_seconds"],
        dict(doc["split"]),
        doc["chain"],
    )


def _drain(queue: Any, on_progress: Callable[[ReplayProgress], None] | None) -> None:
    if queue is None or on_progress is None:
        return
    while not queue.empty():
        d = queue.get()
        d["stages"] = tuple(d["stages"])
        on_progress(ReplayProgress(**d))


# ====================================================================== torchrun
def main(argv: Sequence[str] | None = None) -> int:
    """``torchrun --nproc-per-node K -m replay.parallel --job job.json --result result.json``."""
    ap = argparse.ArgumentParser(
        prog="python -m replay.parallel", description="one worker of a parallel replay (under torchrun)"
    )
    ap.add_argument("--job", required=True, help="ReplayJob as JSON (ReplayJob.to_dict)")
    ap.add_argument("--result", default=None, help="where rank 0 writes the result JSON")
    args = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"replay-rank{rank} %(levelname)s %(name)s: %(message)s",
    )
    with open(args.job) as f:
        job = ReplayJob.from_dict(json.load(f))
    if job.workers != world:
        logger.info("job says %d workers, torchrun started %d: using %d", job.workers, world, world)
        job = job.replace(workers=world)
    try:
        res = worker_main(rank, world, job, result_path=args.result)
    except SwiftlogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if rank == 0 and res is not None:
        print(
            "RESULT "
            + json.dumps(
                {k: res[k] for k in ("outputs", "replay_seconds", "grad_error_bound")}
                | {"verified": res["report"]["verified"]}
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
