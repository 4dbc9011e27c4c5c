"""The prefetch thread of a replay: it fetches and decodes the records of the next iterations.

:class:`Prefetcher` plans each iteration ahead (``plan_iteration``, without recording warnings)
and asks the reader for every record the compute thread will ask for, in the order it will ask,
at most ``depth`` iterations ahead of it. A failed prefetch is never fatal by itself: the compute
thread meets the same error when it asks for that record, and reports it.

Never: consumes RNG or touches a module (it only reads and decodes).
"""

from __future__ import annotations

import logging
import threading

from logstore import Channel, RecordKey
from replay._context import Context
from replay._iteration_plan import passes, plan_iteration

__all__ = ["Prefetcher"]

logger = logging.getLogger(__name__)


class Prefetcher:
    """Background thread that fetches the records of iterations ``[current, current + depth]``."""

    def __init__(self, ctx: Context, start: int, stop: int, depth: int) -> None:
        self._ctx = ctx
        self._start, self._stop_it, self._depth = start, stop, depth
        self._current = start
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"swiftlog-replay-prefetch-{ctx.first}", daemon=True)
        self._thread.start()

    def advance(self, it: int) -> None:
        with self._cond:
            self._current = it
            self._cond.notify_all()

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        for it in range(self._start, self._stop_it):
            with self._cond:
                while not self._stop.is_set() and it > self._current + self._depth:
                    self._cond.wait()
            if self._stop.is_set():
                return
            try:
                self._ctx.reader.prefetch(self._keys(it), self._stop)
            except Exception as e:  # the compute thread meets the same problem and reports it
                logger.debug("prefetch of iteration %d stopped: %s", it, e)

    def _keys(self, it: int) -> list[RecordKey]:
        """Every record the compute thread will ask for in iteration ``it``, in the order it asks."""
        ctx = self._ctx
        plan = plan_iteration(ctx, it, None)
        first, last, S = ctx.first, ctx.last, ctx.num_stages
        src = ctx.data_source is not None
        check = ctx.checks(it)
        fwd: list[Channel] = []
        bwd: list[Channel] = []
        if first > 0:
            fwd.append(Channel.activation(first - 1))
        elif not src:
            fwd.append(Channel.input(0))
        if last == S - 1:
            if not src:
                fwd.append(Channel.target(last))
        else:
            if ctx.verify and check:
                fwd.append(Channel.digest(last, last + 1))
            if ctx.compare_logged and check:
                fwd.append(Channel.activation(last))
            bwd.append(Channel.gradient(last + 1))
        if first > 0:
            if ctx.verify and check:
                bwd.append(Channel.digest(first, first - 1))
            if ctx.compare_logged and check:
                bwd.append(Channel.gradient(first))
        shadow = fwd[:1] if first > 0 or not src else []  # a shadow forward reads only the inputs
        keys: list[RecordKey] = []
        likely: list[int] = []
        if ctx.hooks.likely is not None and not plan.shadow:
            likely = [mb for mb in ctx.hooks.likely(it, plan.bwd_order) if mb in plan.bwd_order and mb not in plan.mine]
        for kind, mb in passes(plan) + [p for m in likely for p in (("F", m), ("B", m))]:
            for c in fwd if kind == "F" else shadow if kind == "S" else bwd:
                keys += ctx.reader.part_keys(c, it, mb)
        return keys
