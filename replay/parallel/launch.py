"""Starting a parallel replay: K worker processes of this host, or ranks under torchrun.

:func:`run_parallel` spawns ``job.workers`` workers with ``torch.multiprocessing`` (a TCPStore in
the calling process carries the rendezvous), forwards their progress, raises the root cause of a
failure (a missing or corrupt record before the errors it caused in the other workers), and
returns the :class:`~replay.job.ReplayResult` (:func:`result_of`). Under torchrun, every rank runs
``python -m replay.parallel --job job.json --result result.json`` (:func:`main`): every rank reads
the same job, ``WORLD_SIZE`` is the number of workers, rank 0 writes the result.

Never: leaves a worker running (on a timeout or an error every worker is killed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from logstore import RecordKey
from logstore.errors import CorruptRecordError, SwiftlogError
from replay.errors import ReplayError, ReplayInputMissingError, ReplayOrderError
from replay.job import ReplayJob, ReplayProgress, ReplayResult, StageFactory, log_outcome
from replay.parallel.worker import worker_main
from replay.report import ReplayReport
from trainer_client.commit import gloo_on_loopback, loopback_store

__all__ = ["main", "result_of", "run_parallel"]

logger = logging.getLogger(__name__)


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


def main(argv: Sequence[str] | None = None) -> int:
    """``torchrun --nproc-per-node K -m replay.parallel --job job.json --result result.json``
    (``replay/parallel/__main__.py`` calls it)."""
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
