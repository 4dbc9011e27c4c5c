"""Checkpoint registration and garbage collection, off the training thread.

A checkpoint is registered with the log store (``store.register_checkpoint``), which makes every
record received by the stage below the checkpoint's iteration garbage; ``store.gc()`` then
deletes them in both tiers. Both can block on the object store, so they run here, in one
background thread per client. GC after a checkpoint waits until the writer has written every
record submitted before the checkpoint (an event set by a writer marker), so that no record
below the watermark is written after the GC that should have removed it.

Registrations also go through the commit store when there is one (``SharedRegistrations``):
each is published there. Without a cold tier, the other stages' registrations are recorded in
this node's index before each GC, so the GC frees what they received from this stage.

Never: raises into the caller (failures are writer faults of kind "checkpoint_register",
"checkpoint_share" or "gc"); deletes anything itself (the store decides what is garbage).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from logstore import LogStore
from logstore.errors import ColdTierError, SwiftlogError
from trainer_client.checkpoint import canonical_uri, remove_checkpoint
from trainer_client.commit import SharedRegistrations
from trainer_client.writer import AsyncLogWriter

__all__ = ["CheckpointMaintenance"]

logger = logging.getLogger(__name__)


class CheckpointMaintenance:
    """Background thread: register checkpoints (retrying while the cold tier is down: a few
    attempts at once, then every ``retry_s`` seconds, before each later registration and at
    close, until it is up again) and run GC once the writer has written every record older than
    the checkpoint.

    Tasks (``submit``): ``("register", stage, iteration, uri, meta, drained_event, run_gc, complete)``
    (``complete``: None, or a callable that waits for the save to finish, raising when it failed)
    and ``("gc",)``. Faults are reported through the writer's fault list; the thread survives any task.
    """

    def __init__(
        self,
        store: LogStore,
        writer: AsyncLogWriter,
        name: str,
        *,
        keep: int | None = None,
        own_uri: Callable[[int, int], str] | None = None,
        storage_options: dict[str, Any] | None = None,
        shared: SharedRegistrations | None = None,
    ) -> None:
        self._store = store
        self._shared = shared  # registrations through the commit store: published always, adopted without a cold tier
        self._adopted: dict[int, int] = {}  # stage -> the newest iteration of its registration recorded here
        self._writer = writer
        self.keep = keep  # retention: this stage's newest ``keep`` checkpoints whose uri is own_uri(stage, iteration)
        self._own_uri = own_uri
        self._storage_options = dict(storage_options or {})
        self.retired: list[tuple[int, int, str]] = []
        self._q: queue.Queue[tuple | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self.registered: list[tuple[int, int, str]] = []
        self.gc_runs = 0
        self.gc_deleted_records = 0
        self.last_gc: dict[str, Any] | None = None
        self._pending = 0
        self._lock = threading.Lock()
        # registrations the cold tier refused (the newest 8): retried every ``retry_s``, before later ones
        # and at close, oldest first
        self.unregistered: list[tuple[int, int, str, dict[str, Any], bool]] = []
        self.retry_s = 10.0
        self._last_refusal = ""
        self._thread = threading.Thread(target=self._run, name=f"{name}-maint", daemon=True)
        self._thread.start()

    def stats(self) -> dict[str, Any]:
        """What ``SwiftlogClient.stats()["checkpoints"]`` says: registered, refused (retried),
        retired (``CheckpointConfig.keep``: withdrawn and deleted), GC runs."""
        return {
            "registered": [list(x) for x in self.registered],
            "unregistered": [[st, it, uri] for st, it, uri, _m, _g in self.unregistered],
            "retired": [list(x) for x in self.retired],
            "gc_runs": self.gc_runs,
            "gc_deleted_records": self.gc_deleted_records,
            "last_gc": self.last_gc,
        }

    def submit(self, task: tuple) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._q.put(task)

    def wait_idle(self, timeout: float | None) -> bool:
        return self._idle.wait(timeout)

    def close(self, timeout: float | None) -> None:
        self._q.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            try:
                task = self._q.get(timeout=self.retry_s if self.unregistered else None)
            except queue.Empty:
                self._retry_unregistered()
                continue
            if task is None:
                self._retry_unregistered()
                return
            try:
                if task[0] == "register":
                    _, stage, iteration, uri, meta, drained, gc, complete = task
                    if complete is not None and not self._complete(iteration, uri, complete):
                        continue
                    self._retry_unregistered()
                    if not self._register(stage, iteration, uri, meta):
                        self._keep_unregistered((stage, iteration, uri, meta, gc))
                    elif gc:
                        drained.wait()
                        self._gc()
                elif task[0] == "gc":
                    self._retry_unregistered()
                    self._gc()
            except Exception as e:  # survive anything; report through the writer's faults
                logger.exception("swiftlog maintenance task failed")
                self._writer.note_fault("maintenance", f"{task[0]}: {type(e).__name__}: {e}")
            finally:
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()

    def _complete(self, iteration: int, uri: str, complete: Callable[[], str]) -> bool:
        """Wait for a checkpoint's save to finish (an async DCP save: ``complete`` waits for its
        future and writes the pointer). False, with a "checkpoint_write" fault, when it failed:
        such a checkpoint is never registered."""
        try:
            complete()
            return True
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            self._writer.note_fault("checkpoint_write", f"{uri}: {type(e).__name__}: {e}", iteration=iteration)
            return False

    def _register(self, stage: int, iteration: int, uri: str, meta: dict[str, Any], attempts: int = 4) -> bool:
        """Register, retrying a retryable error ``attempts`` times; False when it stays refused
        for a retryable reason (the caller keeps it for later), True otherwise (done, or a
        permanent error, reported)."""
        delay = 0.2
        for attempt in range(attempts):
            try:
                info = self._store.register_checkpoint(stage, iteration, uri=uri, meta=meta)
                self.registered.append((stage, iteration, uri))
                self._publish(asdict(info))
                self._retire(stage)
                return True
            except SwiftlogError as e:
                self._last_refusal = f"{type(e).__name__}: {e.message}"
                # the object store's refusals too (a bucket missing while it restarts): kept and retried
                retryable = getattr(e, "retryable", False) or isinstance(e, ColdTierError)
                if attempts > 1 or not retryable:  # a later retry of a refused one is not reported again
                    self._writer.note_fault(
                        "checkpoint_register", f"attempt {attempt + 1}: {type(e).__name__}: {e}", iteration=iteration
                    )
                if not retryable:
                    return True
                if attempt + 1 < attempts:
                    time.sleep(delay)
                    delay = min(delay * 2, 5.0)
        return False

    def _retire(self, stage: int) -> None:
        """Retention (``keep``): withdraw the registration of this stage's older checkpoints that
        this client's checkpoint location holds, then delete their files; a failure is a fault and the
        rest waits for the next checkpoint."""
        if self.keep is None or self._own_uri is None:
            return
        try:
            own = self._own_uri
            mine = sorted(
                (
                    c
                    for c in self._store.checkpoints()
                    if c.stage == stage and c.uri and canonical_uri(c.uri) == canonical_uri(own(stage, c.iteration))
                ),
                key=lambda c: c.iteration,
            )
            for c in mine[: -self.keep]:
                # first: no plan may start from a file about to go
                self._store.unregister_checkpoint(stage, c.iteration)
                assert c.uri is not None
                remove_checkpoint(c.uri, storage_options=self._storage_options)
                self.retired.append((stage, c.iteration, c.uri))
        except Exception as e:  # noqa: BLE001 - a retention failure never touches training
            self._writer.note_fault("checkpoint_retire", f"{type(e).__name__}: {e}")

    def _keep_unregistered(self, item: tuple[int, int, str, dict[str, Any], bool]) -> None:
        self.unregistered.append(item)
        del self.unregistered[:-8]  # the newest few: a newer checkpoint makes an older one's registration moot for GC
        logger.warning(
            "checkpoint of stage %d at iteration %d not registered (%s): retried every %g s",
            item[0],
            item[1],
            self._last_refusal,
            self.retry_s,
        )

    def _retry_unregistered(self) -> None:
        """One attempt for each checkpoint the cold tier refused, oldest first; GC after the
        newest one that gets through (if its registration asked for one)."""
        gc = False
        left = []
        for item in self.unregistered:
            stage, iteration, uri, meta, want_gc = item
            if self._register(stage, iteration, uri, meta, attempts=1):
                logger.info("checkpoint of stage %d at iteration %d registered late", stage, iteration)
                gc = gc or want_gc
            else:
                left.append(item)
        self.unregistered = left
        if gc:
            self._gc()

    def _publish(self, doc: dict[str, Any]) -> None:
        """Put this stage's newest registration in the commit store; a failure is a fault."""
        if self._shared is None:
            return
        try:
            self._shared.publish(doc)
        except Exception as e:  # noqa: BLE001 - the store client's errors: a fault, never into training
            self._writer.note_fault("checkpoint_share", f"publishing in the commit store: {type(e).__name__}: {e}")

    def _adopt(self) -> None:
        """Without a cold tier: record in this node's index the other stages' registrations newer
        than those recorded before (once each, so one an operator withdrew here stays withdrawn)."""
        if self._shared is None or self._store.cold is not None:
            return
        try:
            for doc in self._shared.others():
                stage, iteration = doc.get("stage"), doc.get("iteration")
                if isinstance(stage, int) and isinstance(iteration, int) and iteration > self._adopted.get(stage, -1):
                    self._store.adopt_registration(doc)
                    self._adopted[stage] = iteration
        except Exception as e:  # noqa: BLE001 - a fault; the GC goes on with what this node knows
            why = f"reading the commit store's registrations: {type(e).__name__}: {e}"
            self._writer.note_fault("checkpoint_share", why)

    def _gc(self) -> None:
        self._adopt()
        try:
            rep = self._store.gc()
        except SwiftlogError as e:
            self._writer.note_fault("gc", f"{type(e).__name__}: {e}")
            return
        self.gc_runs += 1
        self.gc_deleted_records += rep.hot_records
        self.last_gc = {
            "watermarks": rep.watermarks,
            "hot_records": rep.hot_records,
            "hot_segments": rep.hot_segments,
            "cold_segments": rep.cold_segments,
        }
