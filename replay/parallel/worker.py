"""One worker of a parallel replay: build, meet the others, replay a share, reduce, agree, write.

:func:`worker_main` is the whole life of a worker, the same under ``torch.multiprocessing``
(``replay.parallel.launch.run_parallel``), under torchrun and as a replacement's helper: it builds
its stage objects before the rendezvous (each worker's set-up overlaps the others' start), joins
the gloo process group, replays its share of every iteration through the replay loop's hooks
(``replay.parallel.reducer.GradReducer``), compares a digest of every worker's parameters and
buffers, and on rank 0 merges the reports and writes the recovered checkpoints.
:func:`worker_prefetch` says how far a worker fetches ahead.

Never: writes an output when a worker failed or the workers' parameters differ.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from replay.core import locate_logs, replay_device, replay_stages
from replay.errors import ReplayError
from replay.job import ProgressTracker, ReplayJob, SourceSpec, StageFactory, close_sources, open_sources
from replay.parallel.chain import PG_TIMEOUT, SharedChain
from replay.parallel.reducer import GradReducer
from replay.parallel.shares import Claims
from replay.reader import LogReader
from replay.report import ReplayReport
from replay.stage import ReplayHooks, StageState
from replay.states import PreparedStates, build_states, loss_and_data, write_outputs
from trainer_client.digest import tensor_digest

__all__ = ["worker_main", "worker_prefetch"]

logger = logging.getLogger(__name__)


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
    :class:`~replay.stage.StageState` objects under ``"states"`` (not JSON; for a caller that goes
    on with them in this process, e.g. a replacement that is rank 0 itself). ``timeout``: of the
    rendezvous and of every collective. ``prepared``: this worker's stage objects built ahead
    (:class:`~replay.states.PreparedStates`; used only when they match the job). Raises what the
    replay raises (every rank that sees it).
    """
    t0 = time.perf_counter()
    opened = []
    reducer: GradReducer | None = None
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
        loss, data, start = _prepare(job, world, reader, states, loss_fn, data_source)
        claims = _rendezvous(rank, world, job, store, timeout)
        # (the split's lag follows job.fetch_ahead either way: the same splits on any host)
        prefetch = worker_prefetch(job, world)
        reducer = GradReducer(
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
            reducer.use_shared(SharedChain.open(reducer.sizes, rank, job.shared_memory))
        hooks = _hooks(reducer, job, start)
        tracker: ProgressTracker | None = None
        mb_done = 0

        def on_iteration(it: int, report: ReplayReport) -> None:
            nonlocal mb_done
            reducer.end_iteration()
            mb_done += sum(reducer.schedule.splits[it])
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
            loss_fn=loss,
            data_source=data,
            prefetch=prefetch,
            hooks=hooks,
            on_iteration=on_iteration,
            **job.replay_options(),
        )
        replay_s = time.perf_counter() - t_replay
        replay_cpu = time.process_time() - cpu0
        if not job.exact:
            note = (
                f"approximate parallel replay: only iteration {start}'s sends are verified "
                "(later states differ within the stated bound)"
            )
            report.warnings.append(note)
        payload = {
            "report": report.to_dict(),
            "setup_s": setup_s,
            "build_s": build_s,
            "replay_s": replay_s,
            "cpu_s": replay_cpu,
            "bound": reducer.bound_max,
            "digest": _state_digest(states),
        }
        gathered = _gather(world, payload)
        result = None
        if rank == 0:
            result = _result(job, states, reducer, gathered, world, result_path, keep_states)
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


def _prepare(
    job: ReplayJob,
    world: int,
    reader: LogReader,
    states: list[StageState],
    loss_fn: Callable[..., torch.Tensor] | None,
    data_source: Callable[[int], Any] | None,
) -> tuple[Any, Any, int]:
    """A worker's set-up before the rendezvous: the loss function, the data source and the first
    iteration (the checkpoint's); META read and the first iteration's records listed."""
    dev = replay_device(states)
    if world > 1 and dev.type != "cpu":  # the same on every worker: each raises before the rendezvous
        raise ReplayError(
            f"parallel replay exchanges gradients over gloo, which runs on CPU; "
            f"the stage factory put stages {job.stages} on {dev}",
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
    if job.threads is None:
        # this process is the worker's own: the live thread count for all it runs, not only inside each iteration
        _use_live_threads(reader, job.stages[0], start)
    return loss, data, start


def _rendezvous(
    rank: int, world: int, job: ReplayJob, store: dist.Store | None, timeout: datetime.timedelta
) -> Claims | None:
    """Join the workers' gloo process group (over ``store``, or ``env://`` as torchrun sets it up);
    returns the claim counters of dynamic shares (None: the job's shares are fixed)."""
    if store is not None:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world, timeout=timeout)
    if world <= 1 or job.dynamic_share_min_s is None:
        return None
    # counters in the rendezvous store, under a name every worker agrees on
    nonce = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(nonce, src=0)
    return Claims(
        dist.PrefixStore(
            f"swiftlog-claims/{nonce[0]}",
            store if store is not None else dist.distributed_c10d._get_default_store(),
        )
    )


def _hooks(reducer: GradReducer, job: ReplayJob, start: int) -> ReplayHooks:
    """The replay loop's hooks of a worker: its shares, the reduction, the shadow forwards."""
    return ReplayHooks(
        select=reducer.schedule.select,
        claim=reducer.schedule.claim,
        likely=reducer.schedule.likely,
        before_backward=reducer.before_backward,
        after_backward=reducer.after_backward,
        before_step=reducer.before_step,
        verify=None if job.exact else (lambda it: it == start),
        # sums in another order: other bits than the live step's
        verify_step=None if job.exact else (lambda it: False),
        shadow_forwards=reducer.buffers.shadow_forwards,
    )


def _gather(world: int, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Every worker's ``payload``; raises ReplayError when their parameters and buffers differ."""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, payload)
    if len({g["digest"] for g in gathered}) != 1:
        raise ReplayError(
            "parallel replay workers ended with different parameters or buffers "
            f"(digests {[g['digest'] for g in gathered]})",
            hint="a nondeterministic kernel or an environment difference between workers",
        )
    return gathered


def _result(
    job: ReplayJob,
    states: list[StageState],
    reducer: GradReducer,
    gathered: list[dict[str, Any]],
    world: int,
    result_path: str | None,
    keep_states: bool,
) -> dict[str, Any]:
    """Rank 0: the workers' reports merged, the outputs written, the result document (also written
    to ``result_path``)."""
    merged = ReplayReport.from_dict(gathered[0]["report"])
    for g in gathered[1:]:
        merged.merge(ReplayReport.from_dict(g["report"]))
    merged.compute_seconds = max(g["report"]["compute_seconds"] for g in gathered)
    merged.seconds = max(g["report"]["seconds"] for g in gathered)
    bound = max(g["bound"] for g in gathered) if not job.exact else None
    outputs = write_outputs(job, states, merged, extra={"grad_error_bound": bound})
    result: dict[str, Any] = {
        "report": merged.to_dict(),
        "outputs": {str(k): v for k, v in outputs.items()},
        "setup_seconds": max(g["setup_s"] for g in gathered),
        "build_seconds": max(g["build_s"] for g in gathered),
        "replay_seconds": max(g["replay_s"] for g in gathered),
        "cpu_seconds": [g["cpu_s"] for g in gathered],
        "grad_error_bound": bound,
        "workers": world,
        "split": sorted(reducer.schedule.splits.items()),  # [iteration, micro-batches per worker]
        "chain": None if not reducer.chained else "shared memory" if reducer.shared is not None else "gloo",
    }
    if result_path is not None:
        tmp = f"{result_path}.partial-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, result_path)
    if keep_states:
        result["states"] = list(states)
    return result


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
    latency or has a core of its own. With neither, it only competes with the compute thread for
    the GIL, and a thread preempted while holding it stalls the next forward
    (``docs/parallel-replay.md``, "Prefetching")."""
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
