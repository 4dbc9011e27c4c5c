"""The gradient reduction of parallel replay: each worker's micro-batch gradients summed over the workers.

:class:`GradReducer` is the hooks a worker gives the replay loop around each backward and before
each step. Exact mode forms the sequential replay's sum as an ordered chain over the workers,
pipelined in buckets of consecutive parameters (:func:`buckets`), the running sums in shared
memory on one host (``replay.parallel.chain``) or sent over gloo. Approximate mode sums each
worker's share locally, then all-reduces, and bounds the error (``replay.parallel.bounds``). It
also carries the workers' times per micro-batch to every worker, for the next iterations' shares
(``replay.parallel.shares``), and whether their module buffers changed
(``replay.parallel.buffers``). ``docs/parallel-replay.md`` explains both reductions.

It is one class because its state is one: the flat gradient buffers, the "present" flags and the
in-flight sends of the current iteration, which every hook reads and writes.

Never: lets workers step with different gradients (they all use the reduced sum); adds a
micro-batch's gradient out of the live backward order in exact mode.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from replay.parallel.bounds import gamma
from replay.parallel.buffers import BufferWatch
from replay.parallel.chain import SharedChain
from replay.parallel.shares import Claims, ShareSchedule
from replay.stage import StageState

__all__ = ["GradReducer", "buckets"]


def buckets(params: Sequence[torch.Tensor], limit: int = 1 << 20) -> list[range]:
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


class GradReducer:
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
        claims: Claims | None = None,
        claim_min_s: float = 0.0,
    ) -> None:
        self.rank, self.world, self.exact = rank, world, exact
        self.buffers = BufferWatch(states, world, start)  # the module buffers' changes (shadow forwards)
        self.schedule = ShareSchedule(  # which micro-batches this worker replays, from the measured speeds
            rank,
            world,
            start=start,
            lag=lag,
            claims=claims,
            claim_min_s=claim_min_s,
            shadow_forwards=self.buffers.shadow_forwards,
        )
        self._t_ready = time.perf_counter()
        self.params = [p for st in states for p in st.module.parameters()]
        self.dtypes = sorted({p.dtype for p in self.params}, key=str)
        sizes = {dt: 0 for dt in self.dtypes}
        self.where: list[tuple[torch.dtype, int, int]] = []
        for p in self.params:
            self.where.append((p.dtype, sizes[p.dtype], p.numel()))
            sizes[p.dtype] += p.numel()
        self.sizes = sizes
        self.buckets = buckets(self.params)
        self.bucket_of = [b for b, r in enumerate(self.buckets) for _ in r]
        self.send_order = list(range(len(self.buckets)))[::-1]  # backward usually finishes the last parameters first
        self.dump_dir = dump_dir
        self.bound_max = 0.0
        self.global_n = 0
        self.chained = exact and world > 1
        self.shared: SharedChain | None = (
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

    def use_shared(self, shared: SharedChain | None) -> None:
        """Carry the exact chain's running sums in ``shared`` (every worker's, from
        :meth:`SharedChain.open`) instead of sending them over gloo; None: gloo."""
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
        self.buffers.snap()
        self._t_ready = time.perf_counter()

    def before_backward(self, it: int, mb: int) -> None:
        last = self.schedule.is_last(it, mb)
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
                self.stash.append((self.schedule.position(it, mb), self._take()))
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
        changed = self.buffers.changed()
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
        self.buffers.settle(it, changed, anywhere)
        self.schedule.finish(it, times, counts)
        if self.dump_dir is not None and self.rank == 0:
            self._dump(it, scale)

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
        return 2 * gamma(max(self.global_n - 1, 0), dt)

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
        self.buffers.snap()
        self._t_ready = time.perf_counter()
