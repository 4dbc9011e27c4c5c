"""Replay of one stage (or one logging group of consecutive stages) from a checkpoint and the logs.

This is the building block of recovery: a replacement (or a helper in parallel recovery) loads
the lost stage's checkpoint at iteration c, then :func:`replay_stages` re-executes iterations
``[c, target)`` offline, with no process group and no communication:

per iteration, for each micro-batch in the live forward order (from the stage's META record):
seed the RNG from (run seed, stage, iteration, micro-batch), run the forward on the logged
inputs (received activations become fresh leaves with ``requires_grad``; stage 0 reads its
logged inputs or a deterministic data source), and on the last stage compute the *unscaled*
``loss_fn(output, target)``; then backward per micro-batch in the live backward order with the
logged gradients (the last stage from its loss); then divide gradients by the schedule's factor
(``n_microbatches`` when ``scale_grads``), repeat the live ``client.clip_grad_norm_`` calls with
their logged total norms (META ``grad_clip``), ``optimizer.step()``, ``lr_scheduler.step()``,
``zero_grad(set_to_none=True)``. Inside a logging group the stages are chained in-process (what
stage s sends, stage s+1 receives), exactly as the live pipeline did.

When no replayed stage has a META record for an iteration (it lived on the lost node and never
reached the cold tier), the META of another stage of the same iteration stands in: GPipe and
1F1B run forward and backward in ascending micro-batch order on every stage, so its
``n_microbatches``, scaling and thread count are all that is needed (reported as a warning).

Reading: :class:`~replay.reader.LogReader` reads through any number of record sources (a
``LogStore`` on a node root or on the cold tier alone, or ``replay.remote.HttpRecordSource`` over
a node server). With ``prefetch=N`` a background thread fetches and decodes the records of the
next N iterations while the current one computes; the compute thread waits only for records not
yet there. A failed prefetch is never fatal by itself: the compute thread gets the same error when
it asks for that record.

Parallel replay (``replay.parallel``) drives the same loop through
:class:`~replay.stage.ReplayHooks`: each
worker replays a subset of each iteration's micro-batches, takes every micro-batch's parameter
gradients out after its backward, and reduces them across workers before the (identical) step.

Verification: what the replayed stages send across the group's boundaries is hashed and
compared with the DIGEST records the receivers kept (``Channel.digest(src, dst)``), and
optionally with the sender's own logged records. The report says how many matched, which did
not (``ReplayReport.first_mismatch`` names the first diverging iteration, micro-batch and
channel), and which digests were missing; ``ReplayReport.verified`` is true only when every
regenerated send was checked and matched; ``ReplayReport.raise_for_mismatch`` turns a mismatch
into ``ReplayMismatchError``.

This module holds the loop over the iterations; its parts are modules of their own:
``replay.stage`` (what the loop is given: ``StageState``, ``ReplayHooks``), ``replay.report``
(``ReplayReport``), ``replay._iteration_plan`` (how one iteration ran live), ``replay._iteration``
(one iteration's forwards, backwards and step), ``replay._checks`` (the checks around each step
and of the sends), ``replay.user_code`` (loading the user's factory and loss; naming where they
raised) and ``replay._prefetch`` (the prefetch thread).

What exactness requires of the environment is in ``trainer_client.determinism``; the replay
runs with the live ``torch.get_num_threads()`` (from META) and warns about other differences.

Device: the replay runs where the stages' modules are (:func:`replay_device`): on CPU, or on the
GPU a job trained on, with its ``seed_micro_batch`` seeding the same CUDA generator the live
forward drew dropout masks from (a CPU replay of a GPU run cannot reproduce those). Logged records
are decoded on the host and moved to the device when the loop uses them; regenerated sends are
copied back to the host to be hashed. Parallel replay (gloo) runs on CPU only.

Never: writes to the log store; modifies a checkpoint object (``Checkpoint.apply`` copies);
silently replays over a gap (a missing input raises ``ReplayInputMissingError`` naming the
record); consumes RNG outside the seeded forwards (the prefetch thread only decodes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from logstore import Channel
from replay._checks import check_next_rates
from replay._context import Context
from replay._iteration import IterationReplay
from replay._iteration_plan import plan_iteration
from replay._prefetch import Prefetcher
from replay.errors import ReplayError
from replay.reader import LogReader, RecordSource
from replay.report import ReplayReport
from replay.stage import ReplayHooks, StageState
from replay.user_code import logged_loss
from trainer_client.determinism import num_threads

__all__ = ["locate_logs", "needed_channels", "replay_device", "replay_stage", "replay_stages"]

logger = logging.getLogger(__name__)


def needed_channels(
    first: int,
    last: int,
    num_stages: int,
    *,
    data_source: bool = False,
    verify: bool = True,
    compare_logged: bool = False,
) -> dict[str, list[Channel]]:
    """The channels a replay of stages ``first..last`` reads, by purpose.

    ``inputs``: what the group receives from outside (activations from ``first - 1`` or stage-0
    inputs; gradients from ``last + 1`` or last-stage targets); stage-0 inputs and targets are
    left out when a ``data_source`` provides them. ``meta``: the stages' META records.
    ``verify``: the receivers' digests of the group's boundary sends (and, with
    ``compare_logged``, the sender's own records of them).
    """
    inputs: list[Channel] = []
    if first == 0:
        if not data_source:
            inputs.append(Channel.input(0))
    else:
        inputs.append(Channel.activation(first - 1))
    if last == num_stages - 1:
        if not data_source:
            inputs.append(Channel.target(last))
    else:
        inputs.append(Channel.gradient(last + 1))
    ver: list[Channel] = []
    if verify:
        if last < num_stages - 1:
            ver.append(Channel.digest(last, last + 1))
        if first > 0:
            ver.append(Channel.digest(first, first - 1))
    if compare_logged:
        if last < num_stages - 1:
            ver.append(Channel.activation(last))
        if first > 0:
            ver.append(Channel.gradient(first))
    return {"inputs": inputs, "meta": [Channel.meta(k) for k in range(first, last + 1)], "verify": ver}


def locate_logs(
    reader: LogReader,
    stages: Sequence[int],
    num_stages: int,
    iteration: int,
    *,
    data_source: bool = False,
    verify: bool = True,
    compare_logged: bool = False,
) -> None:
    """Read the META documents of ``stages`` at ``iteration`` and list the channels a replay of them
    reads there (:func:`needed_channels`; the reader caches both and lists a window of iterations at
    once), so that a replay started next finds its first records without opening and listing the
    sources first: set-up work, e.g. while parallel workers wait for each other. Never raises: what
    is missing or unreachable is left for the replay to meet and report."""
    need = needed_channels(
        stages[0], stages[-1], num_stages, data_source=data_source, verify=verify, compare_logged=compare_logged
    )
    try:
        for k in stages:
            reader.meta(k, iteration)
        for c in need["inputs"] + need["verify"]:
            reader.part_keys(c, iteration, 0)
    except Exception as e:  # noqa: BLE001 - the replay meets it again and reports it
        logger.debug("locating the logs of stages %s at iteration %d: %s", list(stages), iteration, e)


# ====================================================================== the replay
def replay_stage(
    state: StageState, logs: LogReader | RecordSource | Sequence[RecordSource], **kwargs: Any
) -> ReplayReport:
    """Replay a single stage; see :func:`replay_stages` for the arguments."""
    return replay_stages([state], logs, **kwargs)


def replay_stages(
    stages: Sequence[StageState],
    logs: LogReader | RecordSource | Sequence[RecordSource],
    *,
    num_stages: int,
    stop_iteration: int,
    start_iteration: int | None = None,
    run_seed: int | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    data_source: Callable[[int], tuple[Any, Any]] | None = None,
    n_microbatches: int | None = None,
    scale_grads: bool | None = None,
    verify: bool = True,
    compare_logged: bool = False,
    keep_sends: bool = False,
    prefetch: int = 0,
    hooks: ReplayHooks | None = None,
    on_iteration: Callable[[int, ReplayReport], None] | None = None,
) -> ReplayReport:
    """Replay consecutive stages (one stage, or a logging group) for ``[start, stop_iteration)``.

    Args:
        stages: the stages' live objects, consecutive and ascending; advanced in place. The replay
            runs on their device (:func:`replay_device`: CPU, or e.g. the CUDA device the factory
            put them on); records are moved there as they are used, sends are hashed on the host.
        logs: where the records are (a LogReader, a record source such as a LogStore, or several).
        num_stages: pipeline size (to know which stage is last).
        stop_iteration: first iteration not replayed (e.g. the survivors' current iteration).
        start_iteration: default: the stages' checkpoint iteration (they must agree).
        run_seed: default: the checkpoint's seed.
        loss_fn: the live loss function, used when the last stage is replayed (default: the one
            its META names, :func:`logged_loss`).
        data_source: deterministic ``iteration -> (inputs, target)``; used for stage-0 inputs and
            last-stage targets instead of the logged ones (required if they were not logged).
        n_microbatches / scale_grads: default: from each iteration's META record (required when
            no stage's META is found).
        verify: compare regenerated boundary sends with the receivers' digests.
        compare_logged: also compare them with the sender's own logged records when present.
        keep_sends: return the regenerated boundary sends in the report.
        prefetch: fetch the records of up to this many iterations ahead in a background thread
            (0: fetch on the compute thread when needed).
        hooks: extension points for parallel replay (:class:`ReplayHooks`).
        on_iteration: called after each replayed iteration with (iteration, report so far).

    Returns the report; mismatches are reported, not raised (see ``raise_for_mismatch``). Raises
    ReplayInputMissingError when a needed record is missing, CorruptRecordError when every copy
    of one is corrupt (both name the key), ReplayError for inconsistent arguments or logs.
    """
    t0 = time.perf_counter()
    reader = logs if isinstance(logs, LogReader) else LogReader(logs)
    hooks = hooks or ReplayHooks()
    states = list(stages)
    if not states:
        raise ReplayError("replay_stages needs at least one stage")
    idx = [s.stage for s in states]
    if idx != list(range(idx[0], idx[0] + len(idx))) or idx[-1] >= num_stages:
        raise ReplayError(f"stages must be consecutive, ascending and < num_stages={num_stages}, got {idx}")
    last = idx[-1]
    ckpts = [s.checkpoint for s in states if s.checkpoint is not None]
    if start_iteration is None:
        its = {c.iteration for c in ckpts}
        if len(ckpts) != len(states) or len(its) != 1:
            raise ReplayError(
                f"start_iteration not given and the stages' checkpoints do not agree on one: {sorted(its)}"
            )
        start_iteration = its.pop()
    if run_seed is None:
        seeds = {c.seed for c in ckpts}
        if len(seeds) != 1:
            raise ReplayError(f"run_seed not given and the checkpoints do not agree on one: {sorted(seeds)}")
        run_seed = seeds.pop()
    if stop_iteration < start_iteration:
        raise ReplayError(f"stop_iteration {stop_iteration} < start_iteration {start_iteration}")
    if (
        last == num_stages - 1 and loss_fn is None and stop_iteration > start_iteration
    ):  # nothing to replay: no loss needed
        loss_fn = logged_loss(reader, last, start_iteration)
    report = ReplayReport(idx, start_iteration, stop_iteration)
    fetched0, fetch_s0 = reader.fetched_records, reader.fetched_seconds
    ctx = Context(
        reader,
        states,
        num_stages,
        run_seed,
        loss_fn,
        data_source,
        n_microbatches,
        scale_grads,
        verify,
        compare_logged,
        keep_sends,
        hooks,
        replay_device(states),
        [(s.stage, n, b) for s in states for n, b in s.module.named_buffers()],
    )
    pf = None
    if prefetch > 0 and stop_iteration > start_iteration:
        reader.start_prefetching()
        pf = Prefetcher(ctx, start_iteration, stop_iteration, prefetch)
    try:
        for it in range(start_iteration, stop_iteration):
            t_it = time.perf_counter()
            if pf is not None:
                pf.advance(it)
            plan = plan_iteration(ctx, it, report)
            with num_threads(plan.threads):
                IterationReplay(ctx, it, plan, report).run()
            report.iterations_done += 1
            report.compute_seconds += time.perf_counter() - t_it
            if pf is not None:
                reader.discard(it)  # records fetched ahead for micro-batches another worker claimed
            if on_iteration is not None:
                on_iteration(it, report)
        if stop_iteration > start_iteration:
            for st in states:
                check_next_rates(st, stop_iteration, reader)
    finally:
        if pf is not None:
            pf.close()
            reader.stop_prefetching()
        report.records_fetched = reader.fetched_records - fetched0
        report.fetch_seconds = reader.fetched_seconds - fetch_s0
        report.seconds = time.perf_counter() - t0
    return report


def replay_device(states: Sequence[StageState]) -> torch.device:
    """The device a replay of ``states`` runs on: that of the stages' parameters and buffers
    (CPU for a stage without any). Raises ReplayError when they are spread over several devices."""
    found = {t.device for st in states for t in (*st.module.parameters(), *st.module.buffers())}
    if len(found) > 1:
        raise ReplayError(
            f"stages {[st.stage for st in states]} have tensors on several devices {sorted(map(str, found))}; "
            "a replay runs on one device",
            hint="move every replayed stage's module to one device before loading the checkpoint",
        )
    return found.pop() if found else torch.device("cpu")
