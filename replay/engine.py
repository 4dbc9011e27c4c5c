"""Running a replay job: :func:`replay`, from a :class:`~replay.job.ReplayJob` to a recovered stage state.

:func:`replay` runs a job sequentially in this process (``workers == 1``) or over ``workers``
processes (``replay.parallel``), and returns a :class:`~replay.job.ReplayResult`: the merged
:class:`~replay.report.ReplayReport`, the output URIs, timings. Progress (iterations done, rate,
ETA) goes to ``on_progress`` and to the log at INFO every ``job.progress_every_s``. The job's
types are in ``replay.job``; building the stages and writing the outputs in ``replay.states``.

Never: modifies a source checkpoint or a store; writes an output when the replay raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from replay.core import locate_logs, replay_stages
from replay.job import (
    ProgressTracker,
    ReplayJob,
    ReplayProgress,
    ReplayResult,
    StageFactory,
    close_sources,
    log_outcome,
    open_sources,
)
from replay.parallel import run_parallel
from replay.reader import LogReader, RecordSource
from replay.stage import ReplayHooks
from replay.states import PreparedStates, build_states, loss_and_data, require_factory, write_outputs

__all__ = ["replay"]

logger = logging.getLogger(__name__)


def replay(
    job: ReplayJob,
    *,
    factory: StageFactory | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    data_source: Callable[[int], tuple[Any, Any]] | None = None,
    sources: Sequence[RecordSource] | None = None,
    on_progress: Callable[[ReplayProgress], None] | None = None,
    start_method: str = "forkserver",
    timeout_s: float | None = None,
    prepared: PreparedStates | None = None,
    replica_group: Any = None,
) -> ReplayResult:
    """Run ``job``: sequentially here (``workers == 1``) or over ``workers`` processes.

    In-process objects override the job's specs: ``factory``, ``loss_fn``, ``data_source`` (for
    parallel replay they must be picklable, e.g. module-level functions) and, for sequential
    replay only, ``sources`` (already opened record sources; not closed here; parallel workers
    open ``job.sources`` themselves). ``start_method`` / ``timeout_s`` apply to parallel replay
    (see :func:`replay.parallel.run_parallel`). ``prepared``: stage objects built ahead for a
    sequential replay (:class:`PreparedStates`; used only when they match the job).
    ``replica_group``: sequential replay of one of a stage's data-parallel replicas, all lost:
    the process group of the replicas replayed together (``ReplayHooks.replica_group``).

    Returns the result with the merged report (mismatches are reported, not raised: check
    ``result.verified`` or call ``result.report.raise_for_mismatch()``). Raises
    ReplayInputMissingError / CorruptRecordError naming a missing or corrupt record, ReplayError
    for inconsistent inputs, CheckpointError when a checkpoint cannot be read or written, ConfigError
    when neither ``job.model`` nor ``factory`` names the stage factory.
    """
    require_factory(job.model, factory)  # before any process starts or source opens
    if job.workers > 1:
        return run_parallel(
            job,
            factory=factory,
            loss_fn=loss_fn,
            data_source=data_source,
            on_progress=on_progress,
            start_method=start_method,
            timeout_s=timeout_s,
        )
    t0 = time.perf_counter()
    opened: list[RecordSource] = [] if sources is not None else open_sources(job.sources, job.run)
    try:
        reader = LogReader(list(sources) if sources is not None else opened)
        t_build = time.perf_counter()
        states = build_states(job, factory, prepared)
        t_build = time.perf_counter() - t_build
        seed = states[0].checkpoint.seed if states[0].checkpoint is not None else 0
        loss, data = loss_and_data(job, seed, loss_fn, data_source)
        start = states[0].checkpoint.iteration if states[0].checkpoint is not None else 0
        locate_logs(
            reader,
            job.stages,
            job.num_stages,
            start,
            data_source=data is not None,
            verify=job.verify,
            compare_logged=job.compare_logged,
        )
        t_setup = time.perf_counter() - t0
        logger.info(
            "replay run=%s stages=%s iterations [%d, %d) from %s",
            job.run,
            job.stages,
            start,
            job.stop_iteration,
            ", ".join(s.describe() for s in job.sources),
        )
        cpu0 = time.process_time()
        with _thread_setting(job.threads):
            report = replay_stages(
                states,
                reader,
                loss_fn=loss,
                data_source=data,
                prefetch=job.fetch_ahead,
                on_iteration=ProgressTracker(job, start, on_progress),
                hooks=ReplayHooks(replica_group=replica_group),
                **job.replay_options(),
            )
        cpu = time.process_time() - cpu0
        outputs = write_outputs(job, states, report)
    finally:
        close_sources(opened)
    res = ReplayResult(
        job, report, outputs, states, time.perf_counter() - t0, report.compute_seconds, t_setup, None, [cpu], t_build
    )
    log_outcome(res)
    return res


class _thread_setting:
    """``torch.set_num_threads(n)`` for a block (None: unchanged); the replay's per-iteration
    setting from META still applies inside."""

    def __init__(self, n: int | None) -> None:
        self.n = n
        self.before = torch.get_num_threads()

    def __enter__(self) -> None:
        if self.n is not None:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        if self.n is not None:
            torch.set_num_threads(self.before)
