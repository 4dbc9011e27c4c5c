"""Survivors of a stage failure: keep the state, agree where to resume, re-form the pipeline.

What a training script calls instead of writing its own loop (a few lines)::

    loop = ResilientLoop(client, store, RecoveryConfig(run_id=..., stage=k, num_stages=S),
                         rebuild=build_stage_and_schedule, optimizer=optimizer)
    loop.run(start, stop, forward_backward=lambda it: client.step(it, x, target=y),
             apply=lambda it: (optimizer.step(), lr_scheduler.step(), optimizer.zero_grad(set_to_none=True)))

The protocol (DESIGN.md "Failure protocol"), per failure, on every surviving stage:

1. A peer's death surfaces as a communication error in ``forward_backward`` (gloo neighbours:
   "Connection closed by peer" within milliseconds) or as an aborted commit (the generation was
   marked failed by the scheduler, by another survivor, or by this module's heartbeat monitor,
   which marks it when a stage's heartbeat in the store goes stale).
2. The survivor marks generation ``g`` failed in the store (every stage waiting in ``commit``
   aborts), writes "abort" for the iteration, and destroys its process group at once so that its
   other neighbours' pending receives fail too (gloo would otherwise wait for its timeout). The
   destruction (gloo joins its threads: ~30 ms) runs on a thread of its own while step 3 goes on,
   so the report does not wait for it; it is joined before the next group forms.
3. It keeps model, optimizer and scheduler state, zeroes the gradients of the unfinished
   iteration, drains its log writer (the replacement reads the records it sent) and reports
   ``{resume, t_detect, error}`` under ``swiftlog/{run}/recovery/gen{g}/survivor/{stage}``.
   ``resume`` is the iteration it was in: the commit step guarantees it did not apply it (a stage
   that fails before reporting done can never see "commit"), and that every survivor stands at
   the same iteration; the replacement checks that they agree.
4. It waits (``rejoin_timeout``) until every replaced stage reported ``ready`` (or the
   replacement reported a fallback: then :class:`RecoveryFailedError` says why), joins process
   group generation ``g + 1`` over ``PrefixStore(f"{run}/pg/gen{g+1}")`` of the same store, calls
   ``rebuild()`` (new stage and schedule over the new group) and continues at ``resume``.

The store must be hosted outside the training ranks (it survives any of them). Its key names and
the waits on them are in ``trainer_client.recovery_keys``: every wait has a deadline and raises
:class:`RecoveryTimeoutError` naming what it waited for.

Never: retries an iteration whose decision was
"commit", applies a half-finished iteration, or recovers from an error that is not a failure of
the pipeline (a bug in the user's step is re-raised unchanged).
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainer_client import fsdp
from trainer_client.buffers import BufferSnapshot, named_buffers
from trainer_client.client import SwiftlogClient
from trainer_client.config import ENV_NODE, ENV_NODE_URL, RecoveryConfig, group_of
from trainer_client.errors import (
    CommitStoreError,
    IterationAbortedError,
    RecoveryFailedError,
    RecoveryTimeoutError,
    RestartRequired,
)
from trainer_client.mesh import build_mesh, recovery_paths
from trainer_client.multi_stage import MultiStageClient
from trainer_client.progress import Progress
from trainer_client.recovery_keys import RecoveryKeys, as_str, pg_prefix, wait_for_keys, wait_until_woken
from trainer_client.replicas import TransferReport, receive_state, send_state
from trainer_client.snapshots import save_snapshot

__all__ = [
    "RecoveryEvent",
    "ResilientLoop",
    "form_mesh",
    "is_pipeline_failure",
]

logger = logging.getLogger(__name__)

# messages of gloo / c10d errors that mean "a peer is gone"
_COMM_MARKERS = (
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "gloo",
    "timed out",
    "socket",
    "connection refused",
    "process group",
    "has been destroyed",
    "not initialized",
)


@dataclass(slots=True)
class RecoveryEvent:
    """One recovery as this stage saw it (wall-clock ``time.time()`` stamps, seconds)."""

    generation: int
    resume: int
    error: str
    t_detect: float
    t_reported: float
    t_ready: float = 0.0
    t_rejoined: float = 0.0
    replaced: list[int] = field(default_factory=list)
    replayed_in_place: list[int] = field(default_factory=list)  # this rank's group, replayed with it

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


class _GroupTeardown:
    """``dist.destroy_process_group()`` of a failed group, on a thread of its own (never raises:
    the group is already broken, it only has to go)."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self._t0 = time.monotonic()
        self._t1: float | None = None
        self._thread = threading.Thread(target=self._run, name="swiftlog-failed-pg-teardown", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            dist.destroy_process_group()
        except Exception as e:  # noqa: BLE001 - already broken; we only need it gone
            logger.info("stage %d: destroying the failed process group: %s", self.stage, e)
        self._t1 = time.monotonic()

    def seconds(self) -> float:
        """How long the teardown took, or has taken so far."""
        return (self._t1 if self._t1 is not None else time.monotonic()) - self._t0

    def wait(self, timeout_s: float) -> None:
        """Until the old group is gone (a new one must not form before); RecoveryTimeoutError after ``timeout_s``."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RecoveryTimeoutError(
                f"stage {self.stage}: the failed process group was not torn down within {timeout_s:.0f} s"
            )


def is_pipeline_failure(e: BaseException) -> bool:
    """True for errors that mean "the pipeline lost a peer": aborted commits, c10d/gloo errors,
    also as the cause of another error (a stage's forward wraps what its FSDP all-gather raised)."""
    if isinstance(e, IterationAbortedError):
        return True
    if isinstance(e, CommitStoreError):
        return False  # the store itself is gone: nothing to recover with
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = f"{type(e).__name__}: {e}".lower()
    if isinstance(e, RuntimeError) and any(m in text for m in _COMM_MARKERS):
        return True
    cause = e.__cause__
    return isinstance(e, RuntimeError) and cause is not None and cause is not e and is_pipeline_failure(cause)


class _Heartbeat:
    """Background thread: writes this stage's heartbeat (with the training thread's
    :class:`~trainer_client.progress.Progress`: a watcher tells a hung rank by it) and marks the
    generation failed when another stage's heartbeat goes stale. Own store connection; never
    raises into training."""

    def __init__(self, cfg: RecoveryConfig, keys: RecoveryKeys, progress: Progress) -> None:
        self.cfg, self.keys, self.progress = cfg, keys, progress
        self.rank, self.world = cfg.rank, cfg.world_size  # derived once: the loop asks every 100 ms
        self.generation = cfg.generation
        self._stop = threading.Event()
        self._store = dist.TCPStore(
            cfg.store_host,
            cfg.store_port,
            is_master=False,
            timeout=datetime.timedelta(seconds=30),
        )
        self._thread = threading.Thread(target=self._run, name=f"swiftlog-heartbeat-{self.rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cfg, keys = self.cfg, self.keys
        seen: dict[tuple[int, int], tuple[str, float]] = {}
        while not self._stop.wait(cfg.heartbeat_interval.total_seconds()):
            g = self.generation
            try:
                now = time.monotonic()
                beat = {"t": time.time(), **self.progress.snapshot()}
                self._store.set(keys.heartbeat(g, self.rank), json.dumps(beat))
                if cfg.heartbeat_timeout is None or self._store.check([keys.failed(g)]):
                    continue
                for k in range(self.world):
                    if k == self.rank or not self._store.check([keys.heartbeat(g, k)]):
                        continue  # not started yet in this generation: not judged
                    v = as_str(self._store.get(keys.heartbeat(g, k)))
                    prev = seen.get((g, k))
                    if prev is None or prev[0] != v:
                        seen[(g, k)] = (v, now)
                    elif now - prev[1] > cfg.heartbeat_timeout.total_seconds():
                        logger.warning(
                            "rank %d: rank %d's heartbeat is %.1f s old: marking generation %d failed",
                            self.rank,
                            k,
                            now - prev[1],
                            g,
                        )
                        self._store.set(
                            keys.failed(g),
                            f"heartbeat of rank {k} stale (seen by rank {self.rank})",
                        )
            except Exception as e:  # noqa: BLE001 - the monitor must never take the stage down
                logger.debug("heartbeat: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


#: (run id, generation, mesh) of the default group :func:`form_mesh` formed, until a loop adopts it
_formed: tuple[str, int, Any] | None = None


def _form_group(store: dist.Store, cfg: RecoveryConfig, g: int, who: str) -> None:
    """The default process group of generation ``g`` over the whole mesh (an older one destroyed)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    store.set_timeout(cfg.rejoin_timeout)
    try:
        dist.init_process_group(
            cfg.backend,
            store=dist.PrefixStore(pg_prefix(cfg.run_id, g), store),
            rank=cfg.rank,
            world_size=cfg.world_size,
            timeout=cfg.pg_timeout,
        )
    except Exception as e:
        raise RecoveryTimeoutError(
            f"{who}: process group generation {g} did not form: {e}",
            hint="a rank of the new generation never joined (check the replacement's log)",
        ) from e


def _adopt_formed(cfg: RecoveryConfig, g: int) -> tuple[bool, Any]:
    """Whether :func:`form_mesh` formed generation ``g``'s group for this run, and its mesh (taken
    once: every rank builds a generation's mesh once, its sub-groups are collectives)."""
    global _formed
    if _formed is not None and _formed[:2] == (cfg.run_id, g) and dist.is_initialized():
        mesh, _formed = _formed[2], None
        return True, mesh
    return False, None


def form_mesh(store: dist.Store, config: RecoveryConfig, client: SwiftlogClient) -> None:
    """Form generation ``config.generation``'s process group before the loop exists and give its
    mesh to ``client``, e.g. to ``fully_shard`` a stage over ``client.shard_mesh`` before its
    optimizer is built; the :class:`ResilientLoop`'s first ``join`` of that generation adopts both.
    The mesh is not returned: a failed generation's sockets close only once nothing refers to its
    groups, and a peer blocked on this rank waits until then. Raises RecoveryTimeoutError when the
    group does not form."""
    global _formed
    _form_group(store, config, config.generation, config.layout.describe(config.rank))
    mesh = None if config.layout.dp_size == 1 else build_mesh(config.layout)
    _formed = (config.run_id, config.generation, mesh)
    if mesh is not None:
        client.set_mesh(mesh)


class ResilientLoop:
    """A training loop that survives the loss of other stages (see the module docstring).

    Args:
        client: this stage's SwiftlogClient (built with ``commit_store``: the commit step is what
            makes the resume iteration well defined).
        store: the TCPStore client (server outside the training ranks) for the process groups
            and the recovery keys.
        config: :class:`RecoveryConfig`.
        rebuild: called after every (re-)formation of the process group: build the stage and the
            schedule over the new default group (``client.pipeline_stage`` + ``client.schedule``).
        optimizer: zeroed when an iteration is discarded; the client tracks it (``SwiftlogClient.track_optimizer``).
            With a :class:`~trainer_client.MultiStageClient`: one per stage, in the order of its ``stages``
            (and ``lr_scheduler`` likewise).
        lr_scheduler: optional; the client counts its steps (``SwiftlogClient.track_lr_scheduler``; ``checkpoint``
            does that too), so that one not stepped once per iteration is replayed as it ran.
        on_event: called with each :class:`RecoveryEvent` once the pipeline re-formed.
        replay_group: in-place group recovery: called as ``replay_group(generation, members)``
            when another stage of this rank's logging group failed, instead of this rank being
            replaced with it. It must load this stage's checkpoint into the live objects, replay
            with the group (``replay.group_recovery.replay_in_place``) and return the iteration
            reached (the resume iteration). None (default): the scheduler replaces the whole group.
        replay_shards: FSDP (``dp_shard`` > 1): called as ``replay_shards(generation)`` when a
            member of this rank's shard group was lost without a replica, once the failed group is
            down. It must load this rank's shard of the group's checkpoint into the live objects
            and replay with the group (``replay.replay_shard_in_place``), and return the iteration
            reached. Required to survive such a loss (RecoveryFailedError without it).
    """

    def __init__(
        self,
        client: SwiftlogClient | MultiStageClient,
        store: dist.Store,
        config: RecoveryConfig,
        *,
        rebuild: Callable[[], None],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        lr_scheduler: Any | None = None,
        on_event: Callable[[RecoveryEvent], None] | None = None,
        replay_group: Callable[[int, list[int]], int] | None = None,
        replay_shards: Callable[[int], int] | None = None,
    ) -> None:
        if client.coordinator is None:
            raise ValueError(
                "ResilientLoop needs a SwiftlogClient with commit_store (the commit decides the resume iteration)"
            )
        if config.stages_per_rank != client.config.stages_per_rank or config.stage != client.config.stage:
            raise ValueError("the RecoveryConfig and the client's config place this rank differently")
        if config.stages_per_rank > 1 and (config.snapshot_dir is not None or replay_group or replay_shards):
            raise ValueError("snapshots, group and shard replays are not supported with several stages per rank")
        self.client, self.store, self.cfg = client, store, config
        self.rebuild, self.optimizer, self.on_event = rebuild, optimizer, on_event
        self.replay_group = replay_group
        self.replay_shards = replay_shards
        self._teardown: _GroupTeardown | None = None  # the failed group's, during a recovery
        self.lr_scheduler = lr_scheduler
        client.track_optimizer(optimizer)  # META says what each step uses, and a step that differs is caught
        client.track_lr_scheduler(lr_scheduler)
        self.keys = RecoveryKeys(config.run_id, config.commit_prefix or client.coordinator.prefix)
        self.generation = config.generation
        self.events: list[RecoveryEvent] = []
        self.iteration_end: list[tuple[int, float, int]] = []  # (iteration, time.time() at apply, generation)
        self._hb: _Heartbeat | None = None
        #: the DeviceMesh of the current generation (None with one replica: the world is the pipeline)
        self.mesh: Any = None
        #: the state transfers this rank took part in (a replica copied to a replacement)
        self.transfers: list[TransferReport] = []
        # module buffers at the start of the current iteration (restored when it is discarded)
        self._buffers = BufferSnapshot()
        self._buffers_of: torch.nn.Module | None = None
        self._terminate: str | None = None  # why the job's agent asked this rank to stop (snapshot mode)

    # ------------------------------------------------------------------ module buffers
    def _save_buffers(self) -> None:
        """Before an iteration: copy the stage module's buffers, so that an iteration discarded after
        its forwards ran (BatchNorm's running statistics moved) leaves none of their updates behind.
        A copy into buffers kept from the previous iteration: the buffers' bytes once per iteration."""
        self._buffers_of = self.client.stage_module
        if self._buffers_of is not None:
            self._buffers.take(named_buffers({"": self._buffers_of}))

    # ------------------------------------------------------------------ process groups
    def join(self, generation: int | None = None) -> float:
        """Form the process group of ``generation`` (default: the current one) over the whole
        mesh, build the mesh (with replicas) and give it to the client, set the commit
        generation, rebuild stage and schedule, and copy the state of every rank the last recovery
        replaced from a live replica (:meth:`_heal`); returns the seconds it took."""
        g = self.generation if generation is None else generation
        t0 = time.monotonic()
        adopted, mesh = _adopt_formed(self.cfg, g)
        if not adopted:
            _form_group(self.store, self.cfg, g, self._who)
        self.generation = g
        if self.cfg.layout.dp_size > 1:  # new groups under the client (an FSDP module is rebound to them)
            self.mesh = None
            self.mesh = mesh if mesh is not None else build_mesh(self.cfg.layout)
            self.client.set_mesh(self.mesh)
        self.client.set_generation(g)
        if self._hb is not None:
            self._hb.generation = g
        self.rebuild()
        self._heal(g)
        return time.monotonic() - t0

    @property
    def _who(self) -> str:
        return self.cfg.layout.describe(self.cfg.rank)

    def _heal(self, g: int) -> None:
        """After the recovery of generation ``g - 1``: every rank replaced from a live replica
        receives the state of its donor (``trainer_client.mesh.recovery_paths``: the same answer
        on every rank), over the new generation's group, verified by digest. Donors send in rank
        order; every other rank goes on at once."""
        key = self.keys.failed_stages(g - 1)
        if g == 0 or self.cfg.dp_replicate == 1 or not self.store.check([key]):
            return
        me = self.cfg.rank
        lost = [int(x) for x in json.loads(as_str(self.store.get(key)))]
        for p in recovery_paths(self.cfg.layout, lost).values():
            if p.path != "replica" or me not in (p.donor, p.rank):
                continue
            module = self.client.stage_module
            if module is None:
                raise RecoveryFailedError(f"{self._who}: rebuild() built no stage, so there is no state to copy")
            if p.donor == me:
                state = {  # sharded (HSDP): this rank's shards; the receiver holds the same ones
                    "stage": self.cfg.stage,
                    "model": fsdp.local_state(module.state_dict()),
                    "optimizer": fsdp.local_state(self.optimizer.state_dict()),
                    "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
                }
                self.transfers.append(send_state(state, p.rank))
                continue
            # parameters and buffers arrive in place; the optimizer's state is new memory
            into = {f"model/{k}": fsdp.local_tensor(v) for k, v in module.state_dict().items()}
            state, report = receive_state(p.donor, into=into)
            if state["stage"] != self.cfg.stage:
                raise RecoveryFailedError(f"{self._who}: rank {p.donor} sent the state of stage {state['stage']}")
            if not fsdp.is_sharded(module):  # a sharded module's shards arrived in place already
                module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            fsdp.reshard_optimizer_state_(self.optimizer)
            if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            self.transfers.append(report)
            self.store.set(self.keys.healed(g - 1, me), json.dumps(report.to_dict()))
            logger.warning(
                "%s: state copied from rank %d: %.1f MB in %.3f s (%.2f GB/s)",
                self._who,
                p.donor,
                report.bytes / 1e6,
                report.seconds,
                report.gb_per_s,
            )

    # ------------------------------------------------------------------ the loop
    def run(
        self,
        start: int,
        stop: int,
        *,
        forward_backward: Callable[[int], Any],
        apply: Callable[[int], Any],
        before: Callable[[int], Any] | None = None,
        joined: bool = False,
    ) -> int:
        """Train iterations ``[start, stop)``, recovering from failures of other stages.

        Per iteration: ``before(it)`` (e.g. checkpoints), ``forward_backward(it)`` (the schedule
        step, e.g. ``client.step``), ``client.commit(it)``, ``apply(it)`` (optimizer and scheduler
        step, zero grads). ``joined``: the process group of the current generation is already up
        and ``rebuild`` was called (otherwise :meth:`join` runs first). After the last iteration
        every stage waits for the others to finish it (a stage lost in its last optimizer step is
        replaced and replayed to ``stop`` like any other: the survivors report ``resume = stop``,
        rejoin, and finish with it). Returns ``stop``. Raises what ``forward_backward``/``apply``
        raise when it is not a pipeline failure, and RecoveryFailedError when recovery is impossible.
        """
        # objects alive now (torch, model, optimizer) live for the whole run: keep them out of the
        # collection that _recover runs to close the failed group's sockets (0.4 s -> milliseconds)
        gc.freeze()
        restore_sigterm = self._catch_sigterm()
        progress = self.client.progress
        if self.cfg.store_host is not None and self.cfg.store_port is not None and self._hb is None:
            self._hb = _Heartbeat(self.cfg, self.keys, progress)
            self._hb.generation = self.generation
        try:
            if not joined:
                self.join()
            it = start
            failures = 0
            while True:
                while it < stop:
                    failure = self._attempt(it, before, forward_backward, failures)
                    if failure is not None:
                        failures += 1
                        with progress.section_of("recovery"):
                            it = self._recover(it, failure)
                        continue
                    apply(it)
                    self.iteration_end.append((it, time.time(), self.generation))
                    it += 1
                failure = self._finish(stop)
                if failure is None:
                    return it
                if failures >= self.cfg.max_failures:
                    raise RecoveryFailedError(f"{self._who}: {failure} (after {failures} recoveries)")
                failures += 1
                it = self._recover(it, failure, discard=False)
        finally:
            restore_sigterm()
            if self._hb is not None:
                self._hb.close()
                self._hb = None

    def _attempt(
        self,
        it: int,
        before: Callable[[int], Any] | None,
        forward_backward: Callable[[int], Any],
        failures: int,
    ) -> str | None:
        """Iteration ``it`` up to its commit. None when it committed; else what failed: a pipeline
        failure's text, or the stop torchrun's SIGTERM asked for (snapshot mode). Raises what is
        not a pipeline failure, and any failure past ``max_failures``."""
        if self._terminate is not None:
            return self._terminate
        progress = self.client.progress
        try:
            progress.busy()
            if before is not None:
                before(it)
            self._save_buffers()
            forward_backward(it)
            progress.waiting()  # on the other ranks' done reports
            self.client.commit(it)
            progress.busy()
        except Exception as e:
            if not is_pipeline_failure(e) or failures >= self.cfg.max_failures:
                raise
            # keep only the text: the traceback's frames hold the schedule's pending work and
            # with it the process group, whose connections must close now (see _recover)
            return f"{type(e).__name__}: {' | '.join(str(e).splitlines())[:300]}"
        return None

    def _catch_sigterm(self) -> Callable[[], None]:
        """With ``snapshot_dir``: torchrun's SIGTERM (sent to every rank when one failed) asks for a
        snapshot at the next iteration boundary instead of ending the process at once. Returns
        what puts the previous handler back."""
        if self.cfg.snapshot_dir is None or threading.current_thread() is not threading.main_thread():
            return lambda: None

        def stop(signum: int, frame: Any) -> None:
            self._terminate = "SIGTERM: the job's agent stops every rank"

        previous = signal.signal(signal.SIGTERM, stop)
        return lambda: signal.signal(signal.SIGTERM, previous)

    def _finish(self, stop: int) -> str | None:
        """The end-of-run barrier: report this stage finished and wait until every stage did, so
        that a stage lost after the last commit (in its optimizer step) is still replaced and
        replayed to the end while the others keep their state. Returns None when every stage
        finished, else what failed (the generation was marked failed: by the scheduler, the
        heartbeat monitor or a stage). Raises RecoveryTimeoutError after ``rejoin_timeout``."""
        cfg, g = self.cfg, self.generation
        done = [self.keys.finished(g, stop, k) for k in range(cfg.world_size)]
        self.store.set(done[cfg.rank], repr(time.time()))
        try:
            wait_for_keys(
                self.store,
                done,
                timeout=cfg.rejoin_timeout,
                abort_keys=[self.keys.failed(g)],
                what=f"{self._who}: waiting for every rank to finish the run (generation {g})",
            )
        except RecoveryTimeoutError:
            raise
        except RecoveryFailedError as e:
            # everyone finished; a late mark (a heartbeat of a stage that left) changes nothing
            if all(self.store.check([k]) for k in done):
                return None
            return f"a stage failed after the last iteration: {e}"
        return None

    def _recover(self, it: int, msg: str, *, discard: bool = True) -> int:
        """Steps 2-4 of the protocol for a failure in iteration ``it`` (``discard``: an unfinished
        iteration's gradients and buffer updates are thrown away; False at the end-of-run barrier,
        where every iteration was applied)."""
        cfg, keys, g = self.cfg, self.keys, self.generation
        t_detect = time.time()
        logger.warning(
            "%s: pipeline failure in iteration %d (generation %d): %s",
            self._who,
            it,
            g,
            msg,
        )
        self._abort_generation(it, msg)
        teardown, report = self._stand_down(it, discard)
        ev = RecoveryEvent(
            generation=g,
            resume=it,
            error=msg,
            t_detect=t_detect,
            t_reported=time.time(),
        )
        self.store.set(
            keys.survivor(g, cfg.rank),
            json.dumps(
                {
                    "resume": it,
                    "stage": cfg.stage,
                    "replica": cfg.replica,
                    # where this node's logs are (a replacement without explicit sources reads them there)
                    "store_root": str(self.client.config.store_root),
                    "cold_url": self.client.config.cold_url,
                    # set by a node agent: which node that root is on, and its node server
                    "node": os.environ.get(ENV_NODE),
                    "node_url": os.environ.get(ENV_NODE_URL),
                    "t_detect": t_detect,
                    "t_reported": ev.t_reported,
                    "error": msg,
                    **report,
                    "destroy_s": teardown.seconds(),  # so far, if it is still running
                }
            ),
        )
        if cfg.snapshot_dir is not None:  # torchrun: nobody replaces the lost rank in place
            self._snapshot_and_stop(it, g, teardown)
        self._teardown = teardown
        try:
            self._await_replacements(ev)
        finally:
            self._teardown = None
        ev.t_ready = time.time()
        teardown.wait(cfg.rejoin_timeout.total_seconds())
        self.join(g + 1)
        ev.t_rejoined = time.time()
        self.store.set(keys.rejoined(g, cfg.rank), repr(ev.t_rejoined))
        self.events.append(ev)
        logger.warning(
            "%s: rejoined as generation %d, resuming at iteration %d",
            self._who,
            g + 1,
            it,
        )
        if self.on_event is not None:
            self.on_event(ev)
        return it

    def _snapshot_and_stop(self, it: int, g: int, teardown: _GroupTeardown) -> None:
        """Save this rank's state at ``it`` node-locally, then raise RestartRequired (once the
        failed group is torn down: a process must not exit under gloo's threads)."""
        cfg = self.cfg
        module = self.client.stage_module if self.client.stage_module is not None else self._buffers_of
        if module is None:
            raise RecoveryFailedError(f"{self._who}: no stage module to snapshot (was rebuild called?)")
        path = save_snapshot(
            cfg.snapshot_dir,  # type: ignore[arg-type]
            run_id=cfg.run_id,
            rank=cfg.rank,
            stage=cfg.stage,
            replica=cfg.replica,
            iteration=it,
            generation=g,
            commit_prefix=self.keys.commit_prefix,
            module=module,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
        )
        logger.warning("%s: state at iteration %d saved to %s; the job must restart", self._who, it, path)
        teardown.wait(cfg.rejoin_timeout.total_seconds())
        raise RestartRequired(
            f"{self._who}: state at iteration {it} saved to {path}: restart the job "
            "(replay.recover_on_restart resumes this rank from it)"
        )

    def _abort_generation(self, it: int, msg: str) -> None:
        """Step 2: every stage waiting in commit aborts; nobody can commit ``it`` any more."""
        keys, g = self.keys, self.generation
        try:
            if not self.store.check([keys.failed(g)]):
                self.store.set(keys.failed(g), f"{self._who} saw: {msg[:200]}")
            self.client.abort(it, f"{self._who} saw a failure")
        except Exception as e:
            raise RecoveryFailedError(f"{self._who}: the store is unreachable during recovery: {e}") from e

    def _stand_down(self, it: int, discard: bool) -> tuple[_GroupTeardown, dict[str, Any]]:
        """Tear the failed group down, keep the state (step 3: discard the unfinished iteration)
        and drain the log writer. Returns the teardown under way and what the report says of it."""
        cfg, g = self.cfg, self.generation
        t_a = time.monotonic()
        # at once, so that neighbours blocked in a receive from (or a send to) us fail fast too; on
        # its own thread: shutting gloo down joins its threads (~30 ms) and nothing below needs it
        teardown = _GroupTeardown(cfg.rank)
        # destroy_process_group only unregisters the group; its sockets close when the last reference
        # (stage, schedule, pending work, the mesh) is gone. A non-neighbour blocked on us waits until then.
        self.client.release_pipeline()
        self.mesh = None
        if self._buffers_of is not None:
            fsdp.release(self._buffers_of)  # a sharded stage's module holds its shard group too
        gc.collect()
        t_b = time.monotonic()
        decision = self.client.coordinator.decision(it, g) if self.client.coordinator else None
        if decision == "commit":  # cannot happen: we never reported done for `it` without raising before
            raise RecoveryFailedError(f"{self._who}: iteration {it} was committed but this rank did not apply it")
        if discard:  # 3. discard the unfinished iteration: its gradients and its buffer updates
            if self._buffers_of is not None:
                fsdp.discard_unfinished(self._buffers_of)  # FSDP: unsharded parameters, pending reductions
            for opt in self.optimizer if isinstance(self.optimizer, (list, tuple)) else [self.optimizer]:
                opt.zero_grad(set_to_none=True)
            if self._buffers_of is not None:
                self._buffers.restore(self._buffers_of)
        drained = self.client.writer.drain(cfg.rejoin_timeout.total_seconds())
        t_c = time.monotonic()
        if not drained:
            logger.warning("%s: log writer not drained before recovery; the replay may miss records", self._who)
        return teardown, {"drained": drained, "teardown_s": t_b - t_a, "drain_s": t_c - t_b}

    def _replay_with_group(self, ev: RecoveryEvent) -> None:
        """In-place group recovery: another member of this rank's logging group failed and this
        rank replays with it (``replay_group``). Raises RecoveryFailedError when it could not."""
        cfg = self.cfg
        members = group_of(self.client.config.logging_groups, cfg.stage, cfg.num_stages)
        if self.replay_group is None or cfg.stage in ev.replaced or not set(members) & set(ev.replaced):
            return
        reached = self.replay_group(self.generation, members)
        if reached != ev.resume:
            raise RecoveryFailedError(
                f"{self._who}: the in-place replay of group {members} reached iteration {reached}, not {ev.resume}"
            )
        ev.replayed_in_place = members

    def _replay_shard_group(self, ev: RecoveryEvent) -> None:
        """FSDP: a member of this rank's shard group was lost without a replica, so the group
        replays together (``replay_shards``) once the failed group is down. Raises
        RecoveryFailedError when it could not."""
        cfg = self.cfg
        if cfg.dp_shard == 1 or cfg.rank in ev.replaced:
            return
        try:
            paths = recovery_paths(cfg.layout, ev.replaced)
        except ValueError as e:
            raise RecoveryFailedError(f"{self._who}: {e}") from e
        if not any(p.path == "shard" and cfg.rank in p.in_place for p in paths.values()):
            return
        if self.replay_shards is None:
            raise RecoveryFailedError(
                f"{self._who}: a member of this rank's shard group was lost and the loop has no replay_shards",
                hint="ResilientLoop(..., replay_shards=lambda g: replay.replay_shard_in_place(...))",
            )
        if self._teardown is not None:  # the shard group's replay forms a default group of its own
            self._teardown.wait(cfg.rejoin_timeout.total_seconds())
        reached = self.replay_shards(self.generation)
        if reached != ev.resume:
            raise RecoveryFailedError(
                f"{self._who}: the in-place replay of its shard group reached iteration {reached}, not {ev.resume}"
            )
        ev.replayed_in_place = cfg.layout.shard_group(cfg.stage, cfg.replica)

    def _await_replacements(self, ev: RecoveryEvent) -> None:
        """Step 4: wait for the scheduler to name the replaced stages (``ev.replaced``) and for them
        to be ready. Raises RecoveryFailedError on a fallback, RecoveryTimeoutError after
        ``rejoin_timeout``."""
        cfg, keys, g = self.cfg, self.keys, self.generation
        v = wait_for_keys(
            self.store,
            [keys.failed_stages(g)],
            timeout=cfg.rejoin_timeout,
            what=f"{self._who}: waiting for the scheduler to name the failed rank(s) of generation {g}",
            abort_keys=[keys.fallback(g)],
        )
        ev.replaced = [int(x) for x in json.loads(v[keys.failed_stages(g)])]
        self._replay_with_group(ev)
        self._replay_shard_group(ev)
        wait_until_woken(
            self.store,
            keys,
            g,
            timeout=cfg.rejoin_timeout,
            what=f"{self._who}: replacement(s) of rank(s) {ev.replaced}",
        )
        wait_for_keys(
            self.store,
            [keys.ready(g, k) for k in ev.replaced],
            timeout=cfg.rejoin_timeout,
            what=f"{self._who}: waiting for replacement(s) of rank(s) {ev.replaced}",
            abort_keys=[keys.fallback(g)],
        )
