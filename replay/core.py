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

Reading: :class:`~replay.reader.LogReader` (re-exported here with the errors of
``replay.errors``) reads through any number of record sources (a ``LogStore`` on a node root or on
the cold tier alone, or ``replay.remote.HttpRecordSource`` over a node server). With
``prefetch=N`` a background thread fetches and decodes the records of the next N iterations while
the current one computes; the compute thread waits only for records not yet there. A failed
prefetch is never fatal by itself: the compute thread gets the same error when it asks for that
record.

Parallel replay (``replay.parallel``) drives the same loop through :class:`ReplayHooks`: each
worker replays a subset of each iteration's micro-batches, takes every micro-batch's parameter
gradients out after its backward, and reduces them across workers before the (identical) step.

Verification: what the replayed stages send across the group's boundaries is hashed and
compared with the DIGEST records the receivers kept (``Channel.digest(src, dst)``), and
optionally with the sender's own logged records. The report says how many matched, which did
not (:attr:`ReplayReport.first_mismatch` names the first diverging iteration, micro-batch and
channel), and which digests were missing; :attr:`ReplayReport.verified` is true only when every
regenerated send was checked and matched; :meth:`ReplayReport.raise_for_mismatch` turns a
mismatch into :class:`ReplayMismatchError`.

What exactness requires of the environment is in ``trainer_client.determinism``; the replay
runs with the live ``torch.get_num_threads()`` (from META) and warns about other differences.

Device: the replay runs where the stages' modules are (:func:`replay_device`): on CPU, or on the
GPU a job trained on, with its ``seed_micro_batch`` seeding the same CUDA generator the live
forward drew dropout masks from (a CPU replay of a GPU run cannot reproduce those). Logged records
are decoded on the host and moved to the device when the loop uses them; regenerated sends are
copied back to the host to be hashed. Parallel replay (gloo) runs on CPU only.

Never: writes to the log store; modifies a checkpoint object (``Checkpoint.apply`` copies);
silently replays over a gap (a missing input raises :class:`ReplayInputMissingError` naming the
record); consumes RNG outside the seeded forwards (the prefetch thread only decodes).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from logstore import Channel, RecordKey
from logstore.errors import SwiftlogError
from replay.errors import ReplayError, ReplayInputMissingError, ReplayMismatchError, ReplayOrderError
from replay.reader import LogReader, RecordSource
from trainer_client.checkpoint import Checkpoint
from trainer_client.data import data_inputs, on_device
from trainer_client.determinism import (
    SEED_SCHEME,
    autocast_as,
    environment_differences,
    num_threads,
    seed_micro_batch,
)
from trainer_client.digest import grad_digest_changes, grad_digests, hex_digests, tensor_digest
from trainer_client.meta import decode_meta, hparam_changes, optimizer_hparams

__all__ = [
    "ReplayError",
    "ReplayInputMissingError",
    "ReplayMismatchError",
    "ReplayOrderError",
    "RecordSource",
    "LogReader",
    "StageState",
    "ReplayReport",
    "ReplayHooks",
    "replay_stages",
    "replay_stage",
    "needed_channels",
    "replay_device",
    "load_object",
    "absolute_spec",
    "is_script_spec",
]

logger = logging.getLogger(__name__)

#: schedules whose every stage runs forward and backward in ascending micro-batch order
_ASCENDING_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")


# ====================================================================== inputs and outputs
@dataclass(slots=True)
class StageState:
    """The live objects of one stage being replayed (they are advanced in place).

    Build with :meth:`from_checkpoint` to load a checkpoint into fresh objects.
    """

    stage: int
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any | None = None
    checkpoint: Checkpoint | None = None

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: Checkpoint,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any | None = None,
    ) -> StageState:
        """Load ``checkpoint`` into ``module``/``optimizer``/``lr_scheduler`` (no aliasing)."""
        checkpoint.apply(module, optimizer, lr_scheduler)
        module.train()
        return cls(checkpoint.stage, module, optimizer, lr_scheduler, checkpoint)


def _grad_mismatch_text(g: dict[str, Any]) -> str:
    params = list(g.get("params") or [])
    names = ", ".join(params[:3]) + (f" and {len(params) - 3} more" if len(params) > 3 else "")
    if g.get("at"):
        return (
            f"stage {g['stage']} iteration {g['iteration']}: the gradients {g['at']} differ from the live ones ({names}): the "
            "replacement's stage, its inputs or the loop between the schedule's step and that call differ from the live ones"
        )
    return (
        f"stage {g['stage']} iteration {g['iteration']}: the gradients the optimizer step used differ from the live step's ({names}): "
        "the live loop changed them in a way the replay does not repeat (a collective such as an all_reduce of tied weights or of "
        "data-parallel replicas: sum through client.all_reduce_grads_, which a replay repeats; a write through .data; a gradient "
        "hook outside the stage), or the replacement's stage differs"
    )


def _key_order(text: str) -> tuple[int, int, str, int]:
    k = RecordKey.parse(text)
    return (k.iteration, k.micro_batch, k.channel.name, k.part)


@dataclass(slots=True)
class ReplayReport:
    """What a replay did and whether it reproduced the live sends.

    ``micro_batches``: micro-batches whose backward ran through the replayed stages, counted as
    each one ends (a parallel worker's own; shadow forwards are not counted).
    ``sends_generated``: boundary sends (tensor parts) the replay regenerated.
    ``digests_checked``: regenerated sends compared with a receiver's digest; ``digest_mismatches``
    / ``digests_missing``: record keys (as strings) that differed / had no digest.
    ``records_checked`` / ``record_mismatches``: the same against the sender's own logged records
    (``compare_logged=True``). ``steps_checked`` / ``grad_mismatches``: optimizer steps whose
    gradients were compared with the digests the live stage put into META (``grad_digests``: a
    CPU stage's gradients as its optimizer step used them), and those that differed
    (``{"stage", "iteration", "params"}``: what changed the live gradients is not repeated). ``sends``: regenerated boundary sends (``keep_sends=True``).
    ``losses``: last stage's per-micro-batch losses per iteration, in the order they were
    computed; ``loss_micro_batches`` the matching micro-batch numbers.
    ``fetch_seconds``: time spent reading/decoding records (on the compute thread or the prefetch
    thread); ``compute_seconds``: the iterations' wall time, of which ``reduce_seconds`` went to
    the ``before_step`` hook (parallel replay: the gradient exchange, waits included) and
    ``step_seconds`` to the optimizer and lr-scheduler steps.
    """

    stages: list[int]
    start_iteration: int
    stop_iteration: int
    micro_batches: int = 0
    sends_generated: int = 0
    digests_checked: int = 0
    digest_mismatches: list[str] = field(default_factory=list)
    digests_missing: list[str] = field(default_factory=list)
    records_checked: int = 0
    record_mismatches: list[str] = field(default_factory=list)
    steps_checked: int = 0
    grad_mismatches: list[dict[str, Any]] = field(default_factory=list)
    losses: dict[int, list[float]] = field(default_factory=dict)
    loss_micro_batches: dict[int, list[int]] = field(default_factory=dict)
    sends: dict[RecordKey, torch.Tensor] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    unknown_steps: list[int] = field(
        default_factory=list
    )  # iterations replayed with another stage's META (clip norms, lrs unknown)
    iterations_done: int = 0
    records_fetched: int = 0
    fetch_seconds: float = 0.0
    compute_seconds: float = 0.0
    reduce_seconds: float = 0.0
    step_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No mismatch (of a send or of a step's gradients) and no missing digest."""
        return not (self.digest_mismatches or self.record_mismatches or self.digests_missing or self.grad_mismatches)

    @property
    def verified(self) -> bool:
        """True only if every regenerated boundary send was checked against a digest and matched,
        every optimizer step whose live gradients META describes used the same ones, and the last
        iteration's optimizer step (which no later send checks) was replayed from the
        stage's own META: with another stage's stand-in, its clip norms and rates are unknown. A
        replay of no iteration (the checkpoint is at the target already) is verified: its result is
        the durable checkpoint itself."""
        if self.stop_iteration == self.start_iteration:
            return self.ok
        last_unchecked = self.stop_iteration - 1 in self.unknown_steps
        return (
            self.sends_generated > 0 and self.digests_checked == self.sends_generated and self.ok and not last_unchecked
        )

    @property
    def diverged(self) -> bool:
        """A regenerated send, or the gradients of a replayed optimizer step, differ from the live
        ones: the replayed state is wrong (not merely unproven)."""
        return bool(self.digest_mismatches or self.record_mismatches or self.grad_mismatches)

    @property
    def unverified_reason(self) -> str:
        """Why the replay is not :attr:`verified`, in words (the first reason that applies)."""
        first = self.first_mismatch
        grads = self._leading_grad_mismatch()
        if grads is not None:
            return _grad_mismatch_text(grads)
        if first is not None:
            return (
                f"the regenerated send {first['key']} differs from the log: is the replacement's stage factory (and its arguments) "
                "and loss what the training used, and deterministic?"
            )
        if self.sends_generated == 0:
            return "the replay made no boundary send to check (nothing was replayed, or the stage sends nothing across a logged boundary)"
        if self.digests_missing:
            return (
                f"{len(self.digests_missing)} of its {self.sends_generated} sends have no digest in the logs to check them against "
                f"(first: {self.digests_missing[0]})"
            )
        if self.stop_iteration - 1 in self.unknown_steps:
            return f"its last iteration ({self.stop_iteration - 1}) was replayed with another stage's META: its optimizer step is unproven"
        return f"{self.digests_checked} of its {self.sends_generated} sends were checked"

    def _leading_grad_mismatch(self) -> dict[str, Any] | None:
        """The first step whose gradients differed, when it comes before the first diverging send."""
        grads = self.grad_mismatches[0] if self.grad_mismatches else None
        first = self.first_mismatch
        return grads if grads is not None and (first is None or grads["iteration"] < first["iteration"]) else None

    @property
    def first_mismatch(self) -> dict[str, Any] | None:
        """The first diverging send in (iteration, micro-batch, channel, part) order, or None."""
        bad = self.digest_mismatches + self.record_mismatches
        if not bad:
            return None
        k = RecordKey.parse(min(bad, key=_key_order))
        return {
            "key": str(k),
            "iteration": k.iteration,
            "micro_batch": k.micro_batch,
            "channel": k.channel.name,
            "part": k.part,
        }

    def raise_for_mismatch(self) -> None:
        """Raise ReplayMismatchError if any regenerated send differs from the log, or an optimizer
        step's gradients from the live one's."""
        grads = self._leading_grad_mismatch()
        if grads is not None:
            raise ReplayMismatchError(
                f"replay of stages {self.stages}: {_grad_mismatch_text(grads)}",
                hint="gradients may change between backward and optimizer step only through client.clip_grad_norm_ and client.all_reduce_grads_; "
                "a collective on them or a write through .data is not replayed",
            )
        if self.digest_mismatches or self.record_mismatches:
            first = self.first_mismatch
            assert first is not None
            raise ReplayMismatchError(
                f"replay of stages {self.stages} regenerated {len(self.digest_mismatches) + len(self.record_mismatches)} send(s) that differ "
                f"from the log; first divergence at iteration {first['iteration']} micro-batch {first['micro_batch']} channel {first['channel']} "
                f"({first['key']})",
                hint=(
                    "every send of the first iteration matched, so most likely the update differs: gradients changed between backward and "
                    "optimizer step outside the client (clip with client.clip_grad_norm_, which logs what the replay needs), "
                    "or an optimizer / lr scheduler other than the live one"
                    if first["iteration"] > self.start_iteration
                    else "check trainer_client.determinism: thread count, deterministic kernels, seeds, data source"
                ),
            )

    def merge(self, other: ReplayReport) -> None:
        """Add another worker's report of the same stages and iterations (parallel replay)."""
        if other.stages != self.stages:
            raise ReplayError(f"cannot merge reports of stages {other.stages} into {self.stages}")
        self.micro_batches += other.micro_batches
        self.sends_generated += other.sends_generated
        self.digests_checked += other.digests_checked
        self.records_checked += other.records_checked
        self.steps_checked = max(self.steps_checked, other.steps_checked)  # every worker steps identically
        seen = {(g["stage"], g["iteration"]) for g in self.grad_mismatches}
        self.grad_mismatches.extend(g for g in other.grad_mismatches if (g["stage"], g["iteration"]) not in seen)
        self.grad_mismatches.sort(key=lambda g: (g["iteration"], g["stage"]))
        for mine, theirs in (
            (self.digest_mismatches, other.digest_mismatches),
            (self.digests_missing, other.digests_missing),
            (self.record_mismatches, other.record_mismatches),
        ):
            mine.extend(theirs)
            mine.sort(key=_key_order)
        for it, vals in other.losses.items():
            pairs = list(zip(self.loss_micro_batches.get(it, []), self.losses.get(it, []), strict=True))
            pairs += list(zip(other.loss_micro_batches.get(it, []), vals, strict=True))
            pairs.sort()
            self.loss_micro_batches[it] = [mb for mb, _ in pairs]
            self.losses[it] = [v for _, v in pairs]
        self.sends.update(other.sends)
        self.warnings.extend(w for w in other.warnings if w not in self.warnings)
        self.unknown_steps = sorted({*self.unknown_steps, *other.unknown_steps})
        self.records_fetched += other.records_fetched
        self.fetch_seconds = max(self.fetch_seconds, other.fetch_seconds)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (regenerated tensors are left out)."""
        return {
            "stages": list(self.stages),
            "start_iteration": self.start_iteration,
            "stop_iteration": self.stop_iteration,
            "iterations_done": self.iterations_done,
            "micro_batches": self.micro_batches,
            "verified": self.verified,
            "ok": self.ok,
            "sends_generated": self.sends_generated,
            "digests_checked": self.digests_checked,
            "digest_mismatches": list(self.digest_mismatches),
            "digests_missing": list(self.digests_missing),
            "records_checked": self.records_checked,
            "record_mismatches": list(self.record_mismatches),
            "first_mismatch": self.first_mismatch,
            "steps_checked": self.steps_checked,
            "grad_mismatches": [dict(g) for g in self.grad_mismatches],
            "losses": {str(k): list(v) for k, v in self.losses.items()},
            "loss_micro_batches": {str(k): list(v) for k, v in self.loss_micro_batches.items()},
            "warnings": list(self.warnings),
            "unknown_steps": list(self.unknown_steps),
            "records_fetched": self.records_fetched,
            "fetch_seconds": self.fetch_seconds,
            "compute_seconds": self.compute_seconds,
            "reduce_seconds": self.reduce_seconds,
            "step_seconds": self.step_seconds,
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplayReport:
        """Inverse of :meth:`to_dict` (without ``sends``)."""
        r = cls(list(d["stages"]), int(d["start_iteration"]), int(d["stop_iteration"]))
        for name in (
            "micro_batches",
            "sends_generated",
            "digests_checked",
            "records_checked",
            "iterations_done",
            "records_fetched",
            "steps_checked",
        ):
            setattr(r, name, int(d.get(name, 0)))
        for name in ("fetch_seconds", "compute_seconds", "reduce_seconds", "step_seconds", "seconds"):
            setattr(r, name, float(d.get(name, 0.0)))
        r.digest_mismatches = list(d.get("digest_mismatches", []))
        r.digests_missing = list(d.get("digests_missing", []))
        r.record_mismatches = list(d.get("record_mismatches", []))
        r.grad_mismatches = [dict(g) for g in d.get("grad_mismatches", [])]
        r.losses = {int(k): list(v) for k, v in d.get("losses", {}).items()}
        r.loss_micro_batches = {int(k): list(v) for k, v in d.get("loss_micro_batches", {}).items()}
        r.warnings = list(d.get("warnings", []))
        r.unknown_steps = [int(i) for i in d.get("unknown_steps", [])]
        return r


@dataclass(slots=True)
class ReplayHooks:
    """Extension points of the replay loop (used by parallel replay; all optional).

    select(iteration, backward_order) -> micro-batches this process replays (default: all);
        forward and backward keep the live order restricted to them.
    before_backward(iteration, micro_batch): called just before the micro-batch's backward pass
        (e.g. to arm gradient hooks for the last one).
    after_backward(iteration, micro_batch): called after the micro-batch's backward through every
        replayed stage, before the next one (its parameter gradients are in ``.grad``, summed with
        those of earlier micro-batches unless the hook took them out).
    before_step(iteration, scale): called after the last backward, before gradients are divided
        by ``scale`` and the optimizers step (e.g. to all-reduce the gradients).
    verify(iteration) -> whether to check this iteration's sends (default: all iterations).
    verify_step(iteration) -> whether to check the gradients of this iteration's optimizer step
        against META's ``grad_digests`` (default: as ``verify``; a replay that sums the gradients
        in another order than the live stage says no).
    shadow_forwards(iteration) -> whether this process also runs the forwards of the micro-batches
        ``select`` left out, for their effect on module buffers (BatchNorm's running statistics):
        every forward then runs in the live forward order, so the buffers evolve as in the live
        run; a left-out micro-batch's outputs are discarded (no check, no loss, no backward).
    claim(iteration) -> one more micro-batch to replay here, or None: asked after the passes of
        ``select``'s micro-batches, again after each one it gave (forward, then backward at once),
        until it says None (a dynamic share, e.g. taken from a queue other workers draw from too).
        Never asked in an iteration with shadow forwards; a micro-batch given twice is an error.
    likely(iteration, backward_order) -> micro-batches ``claim`` will probably give: the prefetch
        thread fetches their records ahead with ``select``'s (one it did not is fetched when
        claimed; one fetched but never claimed is dropped when the iteration is over).
    """

    select: Callable[[int, Sequence[int]], Collection[int]] | None = None
    before_backward: Callable[[int, int], None] | None = None
    after_backward: Callable[[int, int], None] | None = None
    before_step: Callable[[int, int], None] | None = None
    verify: Callable[[int], bool] | None = None
    verify_step: Callable[[int], bool] | None = None
    shadow_forwards: Callable[[int], bool] | None = None
    claim: Callable[[int], int | None] | None = None
    likely: Callable[[int, Sequence[int]], Collection[int]] | None = None


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
    ctx = _Context(
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
        pf = _Prefetcher(ctx, start_iteration, stop_iteration, prefetch)
    try:
        for it in range(start_iteration, stop_iteration):
            t_it = time.perf_counter()
            if pf is not None:
                pf.advance(it)
            plan = _plan_iteration(ctx, it, report)
            with num_threads(plan.threads):
                _replay_iteration(ctx, it, plan, report)
            report.iterations_done += 1
            report.compute_seconds += time.perf_counter() - t_it
            if pf is not None:
                reader.discard(it)  # records fetched ahead for micro-batches another worker claimed
            if on_iteration is not None:
                on_iteration(it, report)
        if stop_iteration > start_iteration:
            for st in states:
                _check_next_rates(st, stop_iteration, reader)
    finally:
        if pf is not None:
            pf.close()
            reader.stop_prefetching()
        report.records_fetched = reader.fetched_records - fetched0
        report.fetch_seconds = reader.fetched_seconds - fetch_s0
        report.seconds = time.perf_counter() - t0
    return report


@dataclass(slots=True)
class _Context:
    reader: LogReader
    states: list[StageState]
    num_stages: int
    run_seed: int
    loss_fn: Callable[..., torch.Tensor] | None
    data_source: Callable[[int], tuple[Any, Any]] | None
    n_mb_arg: int | None
    scale_arg: bool | None
    verify: bool
    compare_logged: bool
    keep_sends: bool
    hooks: ReplayHooks
    device: torch.device
    buffers: list[tuple[int, str, torch.Tensor]]  # (stage, name, buffer) of every replayed module

    @property
    def first(self) -> int:
        return self.states[0].stage

    @property
    def last(self) -> int:
        return self.states[-1].stage

    def checks(self, it: int) -> bool:
        """Whether the sends of iteration ``it`` are checked at all (hooks may restrict it)."""
        return self.hooks.verify is None or bool(self.hooks.verify(it))

    def checks_step(self, it: int) -> bool:
        """Whether iteration ``it``'s optimizer step is checked against META's gradient digests."""
        if not self.verify:
            return False
        return self.checks(it) if self.hooks.verify_step is None else bool(self.hooks.verify_step(it))


@dataclass(slots=True)
class _Plan:
    n_mb: int
    fwd_order: list[int]
    bwd_order: list[int]
    scale: int
    threads: int | None
    mine: list[int]  # micro-batches replayed here, in backward order
    input_kwargs: tuple[str, ...] = ()  # stage 0: names of the logged inputs after the positional ones
    shadow: bool = False  # also the forwards of the other micro-batches (module buffers; ReplayHooks.shadow_forwards)
    metas: dict[int, dict[str, Any]] = field(
        default_factory=dict
    )  # stage -> its META record of the iteration (when logged)
    live_order: list[tuple[str, int]] | None = (
        None  # run the passes exactly as the live stage interleaved them (see _passes)
    )

    def logged(self, stage: int, key: str) -> Any:
        """Field ``key`` of ``stage``'s META (None without it): its ``grad_clip`` calls, ``autocast``
        regions, ``lrs``."""
        return self.metas.get(stage, {}).get(key)


def _plan_iteration(ctx: _Context, it: int, report: ReplayReport | None) -> _Plan:
    """How iteration ``it`` ran live (from META), restricted to the micro-batches replayed here.

    ``report`` None (the prefetch thread) records no warnings.
    """
    reader, states = ctx.reader, ctx.states
    metas = {s.stage: reader.meta(s.stage, it) for s in states}
    present = {k: m for k, m in metas.items() if m is not None}
    stand_in: tuple[int, dict[str, Any]] | None = None
    if not present:
        for k in sorted(range(ctx.num_stages), key=lambda k: (abs(k - ctx.first), k)):
            if k in metas:
                continue
            m = reader.meta(k, it)
            if m is not None and m.get("schedule") in _ASCENDING_SCHEDULES and not m.get("split_backward"):
                stand_in = (k, m)
                break
    if not present and stand_in is None:
        if ctx.n_mb_arg is None:
            key = RecordKey(Channel.meta(states[0].stage), it, 0)
            raise ReplayInputMissingError(
                f"iteration {it}: no META record of stages {list(metas)} (nor of another stage) and n_microbatches not given",
                key=key,
                hint="pass n_microbatches (and scale_grads) explicitly, or ship META to the cold tier",
            )
        if report is not None and it == report.start_iteration:
            report.warnings.append(f"no META for stages {list(metas)}: assuming ascending micro-batch order")
        n = ctx.n_mb_arg
        scale = n if ctx.scale_arg in (None, True) else 1
        order = list(range(n))
        return _Plan(n, order, order, scale, None, _select(ctx, it, order), shadow=_shadow(ctx, it))
    if present:
        m0 = next(iter(present.values()))
    else:
        assert stand_in is not None
        k_in, m0 = stand_in
        note = (
            f"iteration {it}: no META of stages {list(metas)}; using stage {k_in}'s ({m0.get('schedule')}: ascending micro-batch order on every stage); "
            "what only a stage's own META says (its autocast regions, clip_grad_norm_ calls, learning rates) is unknown, so a run that "
            "used them does not verify: give the replay the stage's META (a replacement reads it from the commit store)"
        )
        if report is not None:
            if it not in report.unknown_steps:
                report.unknown_steps.append(it)
            if it == report.stop_iteration - 1:
                last = (
                    f"the last iteration ({it}) was replayed with stage {k_in}'s META: no later send checks its optimizer step, "
                    "so the result is not verified"
                )
                if last not in report.warnings:
                    report.warnings.append(last)
            if not any("no META of stages" in w for w in report.warnings):
                report.warnings.append(note)
                logger.warning("replay: %s (further iterations alike are not reported)", note)
    if m0.get("seed_scheme") != SEED_SCHEME:
        raise ReplayError(f"iteration {it}: logged seed scheme {m0.get('seed_scheme')!r} is not {SEED_SCHEME!r}")
    if m0.get("split_backward"):
        raise ReplayError(
            f"iteration {it}: the live schedule split backward into input/weight passes, which this replay cannot reproduce"
        )
    n = ctx.n_mb_arg or int(m0["n_microbatches"])
    if present:
        bwd = {k: [mb for kind, mb in m["order"] if kind == "B"] for k, m in present.items()}
        fwd = [mb for kind, mb in m0["order"] if kind == "F"]
        orders = {tuple(v) for v in bwd.values()}
        if len(orders) != 1:
            raise ReplayError(
                f"iteration {it}: stages {sorted(bwd)} ran backward in different micro-batch orders {orders}; a group replay needs one order"
            )
        bwd_order = list(orders.pop())
        if sorted(bwd_order) != list(range(n)) or sorted(fwd) != list(range(n)):
            raise ReplayError(
                f"iteration {it}: META order {m0['order']} does not cover {n} micro-batches once each (incomplete iteration?)"
            )
    else:
        fwd = bwd_order = list(range(n))
    if ctx.scale_arg is None:
        scale = int(m0.get("grad_scale_factor", n))
    else:
        scale = n if ctx.scale_arg else 1
    env = m0.get("env", {})
    if report is not None and it == report.start_iteration:
        diff = environment_differences(env)
        if (
            env.get("cuda_device") and ctx.device.type != "cuda"
        ):  # its kernels and dropout masks are not reproducible here
            diff["cuda_device"] = (env["cuda_device"], f"replay on {ctx.device}")
        if diff:
            report.warnings.append(f"environment differs from the live run: {diff}")
            logger.warning("replay: environment differs from the live run: %s", diff)
    kw = tuple(present[0].get("input_kwargs") or ()) if 0 in present else ()
    varies = sorted(k for k, m in present.items() if m.get("autocast_varies"))
    if varies:
        raise ReplayError(
            f"iteration {it}: stages {varies} ran their forwards under different autocast settings in one iteration; the replay cannot tell which ran how",
            hint="enter torch.autocast around the whole schedule step (client.step), not around some micro-batches",
        )
    shadow = _shadow(ctx, it)
    live_order = None
    if (
        ctx.buffers
        and all(st.stage in present for st in states)
        and ctx.hooks.select is None
        and ctx.hooks.claim is None
        and not shadow
    ):
        orders = {tuple((str(kind), int(mb)) for kind, mb in present[st.stage]["order"]) for st in states}
        if len(orders) == 1:  # one stage, or a group whose stages ran one order (GPipe)
            live_order = list(orders.pop())
    return _Plan(
        n, fwd, bwd_order, scale, env.get("num_threads"), _select(ctx, it, bwd_order), kw, shadow, present, live_order
    )


def _shadow(ctx: _Context, it: int) -> bool:
    return ctx.hooks.shadow_forwards is not None and bool(ctx.hooks.shadow_forwards(it))


def _select(ctx: _Context, it: int, bwd_order: list[int]) -> list[int]:
    if ctx.hooks.select is None:
        return list(bwd_order)
    chosen = set(ctx.hooks.select(it, bwd_order))
    if not chosen <= set(bwd_order):
        raise ReplayError(f"iteration {it}: selected micro-batches {sorted(chosen - set(bwd_order))} do not exist")
    return [mb for mb in bwd_order if mb in chosen]


def _split(batch: Any, n: int) -> list[tuple[Any, ...]]:
    """Split a whole batch into micro-batches exactly as the schedules do (dim 0, tensor_split)."""
    args = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    chunks, _ = split_args_kwargs_into_chunks(args, None, n)
    return [tuple(c) for c in chunks]


def _stage_kwargs(reader: LogReader, plan: _Plan, stage: int, it: int, mb: int, dev: torch.device) -> dict[str, Any]:
    """The keyword tensor inputs the step gave stage ``stage`` > 0 (logged under ``input_{stage}``,
    named in its META's ``input_kwargs``), for micro-batch ``mb``; {} when it had none."""
    names = plan.logged(stage, "input_kwargs")
    if not names:
        return {}
    parts = on_device(tuple(reader.require_parts(Channel.input(stage), it, mb)), dev)
    if len(parts) != len(names):
        raise ReplayError(
            f"stage {stage} iteration {it} micro-batch {mb}: META names keyword inputs {names} but input_{stage} holds {len(parts)} tensor(s)"
        )
    return dict(zip(names, parts, strict=True))


def _split_inputs(inputs: Any, n: int) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """A data source's stage-0 inputs (positional and keyword, ``trainer_client.data.data_inputs``)
    split into micro-batches as the schedules split a step's arguments."""
    args, kwargs = data_inputs(inputs)
    chunks, kw_chunks = split_args_kwargs_into_chunks(args, kwargs or None, n)
    return [tuple(c) for c in chunks], [dict(k) for k in kw_chunks]


def _passes(plan: _Plan) -> list[tuple[str, int]]:
    """The order this replay runs its micro-batches' passes: ("F", mb), ("B", mb) and ("S", mb).

    Forwards in the live forward order (module buffers such as running statistics are updated in
    that order), backwards in the live backward order (the order of the gradient sums), and each
    backward as soon as its forward has run: with equal orders (GPipe and 1F1B replayed alone)
    F0 B0 F1 B1 ..., so one micro-batch's activations are alive instead of all of them (less
    memory than the live GPipe schedule, warm caches). Only this replay's micro-batches
    (``plan.mine``); with ``plan.shadow`` the others' forwards too ("S": shadow forwards, for the
    buffers only), each at its place in the forward order.

    A stage replayed alone whose module has buffers (or a group whose stages all ran one order)
    runs its passes exactly as the live stage interleaved them (``plan.live_order``, META
    ``order``): a buffer that a backward changes
    (BatchNorm inside activation recomputation updates its statistics again when the backward
    re-runs its forward) ends as it did live only in the live order. Memory is then the live
    schedule's (GPipe: every micro-batch's activations at once).
    """
    if plan.live_order is not None:
        return list(plan.live_order)
    mine = set(plan.mine)
    pending = iter([mb for mb in plan.fwd_order if mb in mine or plan.shadow])
    done: set[int] = set()
    out: list[tuple[str, int]] = []
    for mb in plan.bwd_order:
        if mb not in mine:
            continue
        while mb not in done:
            f = next(pending)
            out.append(("F" if f in mine else "S", f))
            done.add(f)
        out.append(("B", mb))
    out += [("S", f) for f in pending]  # every forward of this replay's own micro-batches has run
    return out


@contextmanager
def _user_code(what: str, stage: int, it: int, mb: int) -> Iterator[None]:
    """An error of the user's model or loss becomes a ReplayError naming where the replay was (the
    original stays chained as its cause, for the traceback)."""
    try:
        yield
    except SwiftlogError:
        raise
    except Exception as e:
        text = str(e).strip().splitlines()
        raise ReplayError(
            f"stage {stage} iteration {it} micro-batch {mb}: the {what} raised {type(e).__name__}: {text[0][:300] if text else ''}",
            hint="is the stage factory (--model, --model-arg) and the loss (--loss) what this run trained with? "
            "The stage must accept exactly what its neighbour sent",
        ) from e


def _replay_iteration(ctx: _Context, it: int, plan: _Plan, report: ReplayReport) -> None:
    reader, states, num_stages, dev = ctx.reader, ctx.states, ctx.num_stages, ctx.device
    first = ctx.first
    is_last = ctx.last == num_stages - 1
    check = ctx.checks(it)
    src_inputs: list[tuple[Any, ...]] | None = None
    src_kwargs: list[dict[str, Any]] | None = None
    src_targets: list[Any] | None = None
    if ctx.data_source is not None and (first == 0 or is_last):
        inputs, target = ctx.data_source(it)
        src_inputs, src_kwargs = _split_inputs(inputs, plan.n_mb)
        src_targets = None if target is None else [c[0] for c in _split(target, plan.n_mb)]
    losses: list[float] = []  # the last stage's, in forward order
    loss_mbs: list[int] = []

    def forward(mb: int, shadow: bool = False) -> list[tuple[tuple[torch.Tensor, ...], Any]]:
        """Micro-batch ``mb`` through the stages: per stage (input leaves, outputs or the loss).
        ``shadow``: only for the modules' buffers (no loss, no check of the sends, not counted)."""
        kw: dict[str, Any] = {}  # stage 0's keyword inputs (the other stages': _stage_kwargs)
        if first == 0:
            if src_inputs is not None and src_kwargs is not None:
                x, kw = on_device(src_inputs[mb], dev), on_device(src_kwargs[mb], dev)
            else:
                x = on_device(tuple(reader.require_parts(Channel.input(0), it, mb)), dev)
                if plan.input_kwargs:
                    n_pos = len(x) - len(plan.input_kwargs)
                    x, kw = x[:n_pos], dict(zip(plan.input_kwargs, x[n_pos:], strict=True))
        else:
            x = _leaves(
                [on_device(t, dev) for t in reader.require_parts(Channel.activation(first - 1), it, mb)],
                plan.logged(first, "recv_requires_grad"),
            )
        per_stage = []
        for i, st in enumerate(states):
            seed_micro_batch(ctx.run_seed, st.stage, it, mb)
            kw_st = {
                **(plan.logged(st.stage, "input_consts") or {}),
                **(kw if st.stage == 0 else _stage_kwargs(reader, plan, st.stage, it, mb, dev)),
            }
            with (
                _user_code("stage's forward", st.stage, it, mb),
                autocast_as(plan.logged(st.stage, "autocast")),
            ):  # the live forward's autocast regions
                out = st.module(*x, **kw_st)
            outs = out if isinstance(out, tuple) else (out,)
            if shadow:
                if i + 1 < len(states):
                    x = _leaves([o.detach() for o in outs], plan.logged(states[i + 1].stage, "recv_requires_grad"))
                continue
            if st.stage == num_stages - 1:
                if src_targets is not None:
                    target = src_targets[mb]
                else:
                    tparts = reader.require_parts(Channel.target(st.stage), it, mb)
                    target = tparts[0] if len(tparts) == 1 else tuple(tparts)
                target = on_device(target, dev)
                with (
                    _user_code("loss function", st.stage, it, mb),
                    autocast_as(plan.logged(st.stage, "autocast")),
                ):  # the schedule computed the loss inside the step too
                    loss = ctx.loss_fn(out, target)  # type: ignore[misc]
                losses.append(float(loss.detach()))
                loss_mbs.append(mb)
                per_stage.append((x, loss))
            else:
                per_stage.append((x, outs))
                if i + 1 < len(states):
                    x = _leaves([o.detach() for o in outs], plan.logged(states[i + 1].stage, "recv_requires_grad"))
                else:
                    _check_sends(
                        ctx,
                        Channel.activation(st.stage),
                        Channel.digest(st.stage, st.stage + 1),
                        it,
                        mb,
                        outs,
                        check,
                        report,
                    )
        return per_stage

    def backward(mb: int, per_stage: list[tuple[tuple[torch.Tensor, ...], Any]]) -> None:
        grads_in: list[torch.Tensor | None] | None = None
        if ctx.hooks.before_backward is not None:
            ctx.hooks.before_backward(it, mb)
        versions = [b._version for _, _, b in ctx.buffers]
        # not in the live order: in the first iteration also compare the bytes (a kernel that updates a buffer in
        # place, e.g. F.batch_norm on the module's own statistics, or an update through .data, leaves the version)
        snapshot = (
            [_bytes_of(b).clone() for _, _, b in ctx.buffers]
            if ctx.buffers and plan.live_order is None and it == report.start_iteration
            else None
        )
        for i in range(len(states) - 1, -1, -1):
            st = states[i]
            x, out = per_stage[i]
            if st.stage == num_stages - 1:
                with _user_code("stage's backward", st.stage, it, mb), autocast_as(plan.logged(st.stage, "autocast")):
                    torch.autograd.backward([out])
            else:
                if grads_in is None:  # last stage of the group, not of the pipeline: logged gradients
                    grads_in = [on_device(g, dev) for g in reader.require_parts(Channel.gradient(st.stage + 1), it, mb)]
                with_grad = [o for o in out if o.requires_grad or o.grad_fn is not None]
                if len(with_grad) != len(grads_in):
                    raise ReplayError(
                        f"stage {st.stage} iteration {it} micro-batch {mb}: {len(with_grad)} outputs need gradients but {len(grads_in)} were received"
                    )
                with _user_code("stage's backward", st.stage, it, mb), autocast_as(plan.logged(st.stage, "autocast")):
                    torch.autograd.backward(with_grad, grad_tensors=grads_in)
            sent = [t.grad for t in x if isinstance(t, torch.Tensor) and t.requires_grad]
            grads_in = sent
            if st.stage > 0 and i == 0:
                _check_sends(
                    ctx,
                    Channel.gradient(st.stage),
                    Channel.digest(st.stage, st.stage - 1),
                    it,
                    mb,
                    [g for g in sent if g is not None],
                    check,
                    report,
                )
        report.micro_batches += 1  # its backward ran through every replayed stage
        changed = [(k, name) for (k, name, b), v in zip(ctx.buffers, versions, strict=True) if b._version != v]
        if snapshot is not None:
            changed += [
                (k, name)
                for (k, name, b), c in zip(ctx.buffers, snapshot, strict=True)
                if (k, name) not in changed and not torch.equal(_bytes_of(b), c)
            ]
        if changed:
            _check_live_interleaving(plan, passes, it, mb, changed)
        if ctx.hooks.after_backward is not None:
            ctx.hooks.after_backward(it, mb)

    forwarded: dict[int, list[tuple[tuple[torch.Tensor, ...], Any]]] = {}  # mb -> forward's per-stage record
    passes = _passes(plan)
    for kind, mb in passes:
        if kind == "F":
            forwarded[mb] = forward(mb)
        elif kind == "S":
            forward(mb, shadow=True)
        else:
            backward(mb, forwarded.pop(mb))
    if ctx.hooks.claim is not None and not plan.shadow:  # a dynamic share: one micro-batch at a time
        while (mb := ctx.hooks.claim(it)) is not None:
            if mb not in plan.bwd_order or mb in plan.mine:
                raise ReplayError(
                    f"iteration {it}: claimed micro-batch {mb} does not exist or was replayed here already"
                )
            plan.mine.append(mb)
            backward(mb, forward(mb))
    t_reduce = time.perf_counter()
    if ctx.hooks.before_step is not None:
        ctx.hooks.before_step(it, plan.scale)
    t_step = time.perf_counter()
    report.reduce_seconds += t_step - t_reduce
    for st in states:
        if plan.scale != 1:
            for p in st.module.parameters():
                if p.grad is not None:
                    p.grad.div_(plan.scale)
        meta = plan.metas.get(st.stage)
        for kind, op in _grad_ops(meta):  # the live clip_grad_norm_ / all_reduce_grads_ calls, in their order
            if kind == "clip":
                _clip_as_logged(st, it, op, dev)
            else:
                _reduce_as_logged(ctx, st, it, op, report)
        _check_hyperparameters(st, it, meta)
        if meta and meta.get("grad_digests") is not None and ctx.checks_step(it):
            _check_grad_digests(st, it, meta["grad_digests"], report)
        sched_steps = _live_steps(st, it, meta)
        st.optimizer.step()
        for _ in range(sched_steps if st.lr_scheduler is not None else 0):
            _step_scheduler(st, it)
        if sched_steps == 1 and st.lr_scheduler is not None and meta and meta.get("sched_next") is not None:
            _check_scheduled_rates(st, it, meta["sched_next"])
        st.optimizer.zero_grad(set_to_none=True)
    report.step_seconds += time.perf_counter() - t_step
    if is_last:
        report.losses[it] = losses
        report.loss_micro_batches[it] = loss_mbs


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (NaN compares equal to itself)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _check_live_interleaving(
    plan: _Plan, passes: list[tuple[str, int]], it: int, mb: int, changed: list[tuple[int, str]]
) -> None:
    """A backward changed module buffers (``changed``: (stage, name)): they end as they did live
    only if this replay ran its forwards and backwards exactly as each live stage interleaved them
    (META ``order``). Raises ReplayOrderError naming the buffers otherwise: a parallel replay (shares of
    the micro-batches, shadow forwards) or a group replay of stages whose live orders differ
    cannot reproduce them, and nothing it sends would show it."""
    stages = sorted({k for k, _ in changed})
    ran = [(k, m) for k, m in passes if k != "S"]
    if all(k in plan.metas and [(str(a), int(b)) for a, b in plan.metas[k]["order"]] == ran for k in stages):
        return
    names = ", ".join(f"stage {k} {n}" for k, n in changed[:4]) + (" ..." if len(changed) > 4 else "")
    how = (
        "its live interleaving of forwards and backwards is unknown (no META of the stage)"
        if any(k not in plan.metas for k in stages)
        else "this replay does not run the forwards and backwards as the live stage interleaved them "
        "(a parallel replay splits the micro-batches over workers; a group replay runs one order for stages whose live orders differ)"
    )
    raise ReplayOrderError(
        f"iteration {it} micro-batch {mb}: the backward changed module buffers ({names}), e.g. a BatchNorm whose forward activation "
        f"recomputation re-runs; their values depend on the order of every forward and backward, and {how}",
        hint="replay the stage alone with one worker: it then follows the live order",
    )


def _check_hyperparameters(st: StageState, it: int, meta: dict[str, Any] | None) -> None:
    """The replay's optimizer is about to step with the learning rates and other hyperparameters
    the live step used (META ``lrs`` and ``hparams``, when the client tracked the optimizer; an
    amended META when the live loop changed them after the commit); raises ReplayError naming the
    first difference otherwise: the live loop changed them in a way the replay does not repeat,
    and every later state would differ."""
    if not meta:
        return
    if meta.get("grads_carried"):
        carried = list(meta["grads_carried"])
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the live loop did not zero the gradients after the previous optimizer step, so this "
            f"iteration's backward added to them ({', '.join(carried[:3])}{', ...' if len(carried) > 3 else ''}); a replay "
            "starts every iteration from no gradients",
            hint="call optimizer.zero_grad() after each optimizer step (a run accumulating across iterations is recovered "
            "from its checkpoint)",
        )
    if meta.get("grads_changed"):
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the live loop changed gradients after the schedule's backward in a way the replay "
            f"does not repeat: {'; '.join(meta.get('changed_after_commit') or [])}",
            hint="clip through client.clip_grad_norm_, sum over ranks through client.all_reduce_grads_; a GradScaler (fp16) or another change of the gradients before the "
            "optimizer step cannot be replayed",
        )
    live_lrs, live_hp = meta.get("lrs"), meta.get("hparams")
    diff = hparam_changes(
        live_lrs,
        live_hp,
        None if live_lrs is None else [float(g["lr"]) for g in st.optimizer.param_groups],
        None if live_hp is None else optimizer_hparams(st.optimizer),
    )
    if not diff:
        return
    after = meta.get("changed_after_commit")
    when = f" (the live step differed from its META as committed: {'; '.join(after)})" if after else ""
    raise ReplayError(
        f"stage {st.stage} iteration {it}: the live optimizer step and the replay's differ: {'; '.join(diff)} (live -> replay){when}",
        hint="the replay steps the lr scheduler once after every optimizer step; a loop that sets the learning rate or another "
        "hyperparameter otherwise (a scheduler stepped per epoch, a hand-set value) or a stage factory whose optimizer / "
        "scheduler differs cannot be replayed",
    )


def _check_grad_digests(st: StageState, it: int, live: list[str | None], report: ReplayReport) -> None:
    """Compare the gradients the replay's optimizer is about to step with (scaled and clipped as
    logged) with the digests of those the live step used (META ``grad_digests``); a difference is
    recorded in ``report.grad_mismatches`` (the replay is then not verified). Gradients on
    another device than the CPU are not hashed (and the client hashed none there)."""
    mine = grad_digests(st.module)
    if mine is None:
        return
    report.steps_checked += 1
    changed = grad_digest_changes([n for n, _ in st.module.named_parameters()], live, mine)
    if changed:
        report.grad_mismatches.append({"stage": st.stage, "iteration": it, "params": changed})


def _check_next_rates(st: StageState, stop: int, reader: LogReader) -> None:
    """After the last replayed step: where the stage's META of iteration ``stop`` is in the logs (a
    replay to a target below the newest logged iteration, or a commit its stage made before dying),
    its learning rates and hyperparameters are what the replay's last scheduler step must have
    produced; raises ReplayError naming the difference otherwise (a stage factory whose scheduler
    computes other rates, e.g. another lambda: no later step of this replay would show it)."""
    key = RecordKey(
        Channel.meta(st.stage), stop, 0
    )  # the document as committed (an amendment says what a later change made)
    try:
        meta = decode_meta(reader.get(key)) if reader.has(key) else None
    except (SwiftlogError, ValueError):
        return
    if not meta or meta.get("lrs") is None:
        return
    live_hp = meta.get("hparams")
    diff = hparam_changes(
        meta.get("lrs"),
        live_hp,
        [float(g["lr"]) for g in st.optimizer.param_groups],
        None if live_hp is None else optimizer_hparams(st.optimizer),
    )
    if diff:
        raise ReplayError(
            f"stage {st.stage}: after the replay's last step, its optimizer has other values than the live one had for "
            f"iteration {stop}: {'; '.join(diff)} (live -> replay)",
            hint="the replacement's lr scheduler computes other learning rates than the live one: build it with the "
            "training's class, arguments and functions (a LambdaLR's lambda)",
        )


def _check_scheduled_rates(st: StageState, it: int, live_next: list[float]) -> None:
    """After the scheduler step that follows iteration ``it``'s optimizer step: the rates must be
    those the live scheduler's formula gave for its next epoch (META ``sched_next``: a LambdaLR's
    or MultiplicativeLR's, whose functions the checkpoint cannot carry); raises ReplayError
    naming them otherwise (a replacement factory with another lambda or other arguments to it,
    which, after the last replayed iteration, nothing else would show)."""
    mine = [float(g["lr"]) for g in st.optimizer.param_groups]
    if mine != [float(x) for x in live_next]:
        raise ReplayError(
            f"stage {st.stage} iteration {it}: after the step, the lr scheduler {type(st.lr_scheduler).__name__} set the learning "
            f"rates {mine} where the live one set {list(live_next)}",
            hint="the replacement's stage factory builds its scheduler with another function or other arguments to it "
            "(e.g. a schedule's length) than the training: pass the training's (--model-arg)",
        )


def _step_scheduler(st: StageState, it: int) -> None:
    """``lr_scheduler.step()`` as the live loop made it; raises ReplayError when the scheduler's step
    needs arguments the replay does not have (``ReduceLROnPlateau`` steps on a metric)."""
    try:
        st.lr_scheduler.step()
    except TypeError as e:
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the lr scheduler {type(st.lr_scheduler).__name__} cannot step without arguments ({e})",
            hint="a scheduler stepped on a metric (ReduceLROnPlateau) or an explicit epoch is not replayed: such a run is "
            "recovered from its checkpoint",
        ) from e


def _live_steps(st: StageState, it: int, meta: dict[str, Any] | None) -> int:
    """How many times the live loop stepped the stage's lr scheduler after iteration ``it``'s
    optimizer step: once, unless META's ``apply`` (counted by the client before the next
    iteration) says otherwise (a scheduler stepped per epoch). Raises ReplayError when the live
    loop made no optimizer step after ``it`` (gradients accumulated over iterations), when the
    scheduler's step count before this step differs from the live one (``sched_epoch``), and when
    the live loop was seen stepping its scheduler irregularly but the count after ``it`` never
    reached META (the stage died before its next iteration): every later state would differ."""
    if not meta:
        return 1
    apply = meta.get("apply") or {}
    if apply.get("optimizer_steps") == 0:
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the live loop made no optimizer step after this iteration (gradients accumulated "
            "over iterations?); a replay makes one after every iteration",
            hint="accumulate within one schedule step (more micro-batches) instead: such a run is recovered from its checkpoint",
        )
    live_epoch = meta.get("sched_epoch")
    if (
        st.lr_scheduler is not None
        and isinstance(live_epoch, int)
        and getattr(st.lr_scheduler, "last_epoch", live_epoch) != live_epoch
    ):
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the live lr scheduler had made {live_epoch} steps (last_epoch) before this "
            f"iteration's optimizer step, the replay's {st.lr_scheduler.last_epoch}",
            hint="the replay repeats the scheduler steps the client counted; a scheduler stepped outside the loop's apply, or "
            "a stage factory whose scheduler differs from the live one, cannot be replayed",
        )
    n = apply.get("scheduler_steps")
    if isinstance(n, int) and n >= 0:
        return n
    if not apply and meta.get("apply_irregular") is not None:
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the live loop did not make exactly one optimizer and one lr-scheduler step "
            f"after every iteration (first seen after iteration {meta['apply_irregular']}), and what it made after this "
            "iteration is not logged (the stage died before its next iteration began)",
            hint="recover from the checkpoint; a loop that steps both once per iteration needs no count",
        )
    return 1


def _grad_ops(meta: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """The live loop's ``clip_grad_norm_`` ("clip") and ``all_reduce_grads_`` ("reduce"; with its
    call number as ``"call"``) calls of META, in the order they were made (their ``seq``; records
    without one: the clips in their order)."""
    if not meta:
        return []
    ops: list[tuple[int, int, str, dict[str, Any]]] = []
    for j, c in enumerate(meta.get("grad_clip") or ()):
        ops.append((int(c.get("seq", j)), j, "clip", c))
    for j, r in enumerate(meta.get("grad_reduce") or ()):
        ops.append((int(r.get("seq", 0)), j, "reduce", {**r, "call": j}))
    ops.sort(key=lambda o: (o[0], o[1]))
    return [(kind, op) for _, _, kind, op in ops]


def _reduce_as_logged(ctx: _Context, st: StageState, it: int, op: dict[str, Any], report: ReplayReport) -> None:
    """Repeat one live ``client.all_reduce_grads_`` call: check the replay's own gradients of its
    parameters against the digests taken before the live reduction (META ``pre``, CPU; a difference
    goes into ``report.grad_mismatches``), then put the logged reduced gradients in their place
    (record ``reduced_{stage}`` / iteration / call, a part per parameter). Raises
    ReplayInputMissingError when the record is missing, ReplayError when it does not fit."""
    params = list(st.module.parameters())
    names = [n for n, _ in st.module.named_parameters()]
    call = int(op["call"])
    try:
        chosen = [params[i] for i in op["params"]]
    except (KeyError, IndexError, TypeError) as e:
        raise ReplayError(
            f"stage {st.stage} iteration {it}: META's grad_reduce entry {op!r} does not fit the stage's {len(params)} parameters ({e})"
        ) from e
    for p in chosen:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    pre = op.get("pre")
    mine = hex_digests([p.grad for p in chosen]) if pre is not None and ctx.checks_step(it) else None
    if mine is not None:
        changed = grad_digest_changes([names[i] for i in op["params"]], pre, mine)
        if changed:
            report.grad_mismatches.append(
                {"stage": st.stage, "iteration": it, "params": changed, "at": f"before all_reduce_grads_ call {call}"}
            )
    logged = ctx.reader.require_parts(Channel.reduced(st.stage), it, call)
    if len(logged) != len(chosen) or any(
        t.shape != p.shape or t.dtype != p.grad.dtype for t, p in zip(logged, chosen, strict=False)
    ):
        raise ReplayError(
            f"stage {st.stage} iteration {it}: the logged reduced gradients of all_reduce_grads_ call {call} "
            f"({[(tuple(t.shape), str(t.dtype)) for t in logged]}) do not fit its parameters "
            f"({[(tuple(p.shape), str(p.grad.dtype)) for p in chosen]})"
        )
    with torch.no_grad():
        for p, t in zip(chosen, logged, strict=True):
            p.grad.copy_(t)


def _clip_as_logged(st: StageState, it: int, clip: dict[str, Any], dev: torch.device) -> None:
    """Repeat one live ``client.clip_grad_norm_`` call: the same parameters, max norm and total norm
    (the logged value: the norm may have spanned other stages' gradients), through the same torch
    function, so the clipped gradients are bit-identical."""
    params = list(st.module.parameters())
    idx = clip.get("params")
    try:
        chosen = params if idx is None else [params[i] for i in idx]
        total = torch.tensor(float(clip["total_norm"]), dtype=getattr(torch, str(clip["dtype"])), device=dev)
        max_norm = float(clip["max_norm"])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise ReplayError(
            f"stage {st.stage} iteration {it}: META's grad_clip entry {clip!r} does not fit the stage's {len(params)} parameters ({e})"
        ) from e
    torch.nn.utils.clip_grads_with_norm_(chosen, max_norm, total, clip.get("foreach"))


def load_object(spec: str) -> Any:
    """The attribute named by ``"package.module:attr"`` (imported) or ``"path/to/file.py:attr"``
    (the file loaded as a module of another name than ``__main__``, so its ``if __name__ ==
    "__main__"`` block does not run, with its directory put first on ``sys.path`` as when it runs
    as a script; loaded once per process). ``attr`` may be dotted. Raises ValueError naming what
    was not found; an error raised while loading a file is re-raised as ValueError naming the file."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"{spec!r} is not 'module:attribute' or 'path/to/file.py:attribute'")
    if is_script_spec(spec):
        obj: Any = _load_script(mod_name, spec)
    else:
        try:
            obj = importlib.import_module(mod_name)
        except ImportError as e:
            raise ValueError(f"cannot import {mod_name!r} (from {spec!r}): {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{mod_name!r} has no attribute {attr!r}") from None
    return obj


def is_script_spec(spec: str) -> bool:
    """Whether ``spec`` names a file (``"dir/train.py:attr"``) rather than a module."""
    path = spec.rpartition(":")[0]
    return path.endswith(".py") or "/" in path


def absolute_spec(spec: str | None) -> str | None:
    """``spec`` with a relative file path made absolute (for processes started elsewhere); module
    names and None unchanged."""
    if spec is None or not is_script_spec(spec):
        return spec
    path, _, attr = spec.rpartition(":")
    return f"{os.path.abspath(path)}:{attr}"


def _load_script(path: str, spec: str) -> Any:
    path = os.path.abspath(path)
    name = "swiftlog_script_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(path):
        raise ValueError(f"no such file {path!r} (from {spec!r})")
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ValueError(f"cannot load {path!r} as Python (from {spec!r})")
    module = importlib.util.module_from_spec(loader_spec)
    directory = os.path.dirname(path)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ValueError(f"loading {path!r} (from {spec!r}) raised {type(e).__name__}: {e}") from e
    return module


def logged_loss(reader: LogReader, stage: int, iteration: int) -> Callable[..., torch.Tensor]:
    """The loss function the live schedule of ``stage`` (the last one) used, imported by the name
    its META of ``iteration`` records (without that META, the one the stage before it names: every
    stage's schedule gets a loss function, and the verified sends show a wrong one). Raises
    ReplayError saying what to pass instead when META names none (the live ``loss_fn`` was a
    lambda, a callable instance, a function of a script run by path; or the record predates the
    field) or the name does not import here. Never guesses another loss function."""
    doc = reader.meta(stage, iteration)
    if (
        doc is None and stage > 0
    ):  # its own META is gone (an offline replay): every stage's schedule got a loss_fn, normally the same one
        doc = reader.meta(stage - 1, iteration)
        if doc is not None and doc.get("loss"):
            logger.warning(
                "stage %d's META of iteration %d is missing: replaying with stage %d's loss function %s",
                stage,
                iteration,
                stage - 1,
                doc["loss"],
            )
    name = doc.get("loss") if doc is not None else None
    if not name:
        what = (
            f"the live schedule's loss_fn ({doc['loss_repr']}) has no importable name"
            if doc is not None and doc.get("loss_repr")
            else f"stage {stage}'s META of iteration {iteration} does not name the live loss function"
        )
        script = doc.get("loss_script") if doc is not None else None
        if script:
            what = f"the live schedule's loss_fn is {script}, in a script whose top level runs more than definitions (not loaded unasked)"
        raise ReplayError(
            f"replaying the last stage ({stage}) needs its loss function: {what}",
            hint=(
                f"if loading that script runs no training, pass it: --loss {script}"
                if script
                else "pass it: swiftlog replay --loss module:attr (or path/to/file.py:attr), ReplayJob(loss=...) or loss_fn=... "
                "(or give the schedule a module-level function, which META names)"
            ),
        )
    try:
        return load_object(str(name))
    except ValueError as e:
        raise ReplayError(
            f"replaying the last stage ({stage}): the live loss function {name!r} (named by META) does not import here: {e}",
            hint="make its module importable (PYTHONPATH) or pass the function: --loss module:attr",
        ) from e


def _leaves(received: Sequence[torch.Tensor], requires_grad: Sequence[bool] | None) -> tuple[torch.Tensor, ...]:
    """Received tensors as the live receive buffers were: leaves requiring grad as the receiving
    stage declared them (META ``recv_requires_grad``, from its ``input_args``), else (older
    records) every float one. A float input declared without grad gets none live (its sender
    expects no gradient for it), so it must get none here either."""
    if requires_grad is None or len(requires_grad) != len(received):
        return tuple(t.requires_grad_(t.is_floating_point() or t.is_complex()) for t in received)
    return tuple(
        t.requires_grad_(bool(rg) and (t.is_floating_point() or t.is_complex()))
        for t, rg in zip(received, requires_grad, strict=True)
    )


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


def _check_sends(
    ctx: _Context,
    data_channel: Channel,
    digest_channel: Channel,
    it: int,
    mb: int,
    tensors: Sequence[torch.Tensor],
    check: bool,
    report: ReplayReport,
) -> None:
    reader = ctx.reader
    for part, sent in enumerate(tensors):
        key = RecordKey(data_channel, it, mb, part)
        report.sends_generated += 1
        if not (ctx.keep_sends or (check and (ctx.verify or ctx.compare_logged))):
            continue
        t = sent.detach().cpu()  # digests and logged records are host bytes (no copy on CPU)
        if ctx.keep_sends:
            report.sends[key] = t.clone() if sent.device.type == "cpu" else t
        if ctx.verify and check:
            want = reader.digest(digest_channel.src, digest_channel.dst, it, mb, part)
            if want is None:
                report.digests_missing.append(str(key))
            else:
                report.digests_checked += 1
                if tensor_digest(t) != want:
                    report.digest_mismatches.append(str(key))
        if ctx.compare_logged and check:
            try:
                logged = reader.get(key)
            except ReplayInputMissingError:
                continue
            report.records_checked += 1
            if logged.dtype != t.dtype or logged.shape != t.shape or not torch.equal(logged, t):
                report.record_mismatches.append(str(key))
    if (
        ctx.verify and check
    ):  # a part the live stage sent (its receiver kept a digest) that the replay did not send differs too
        for part in reader.logged_parts(digest_channel, it, mb):
            if part >= len(tensors):
                report.digest_mismatches.append(str(RecordKey(data_channel, it, mb, part)))


# ====================================================================== prefetching
class _Prefetcher:
    """Background thread that fetches the records of iterations ``[current, current + depth]``."""

    def __init__(self, ctx: _Context, start: int, stop: int, depth: int) -> None:
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
        plan = _plan_iteration(ctx, it, None)
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
        for kind, mb in _passes(plan) + [p for m in likely for p in (("F", m), ("B", m))]:
            for c in fwd if kind == "F" else shadow if kind == "S" else bwd:
                keys += ctx.reader.part_keys(c, it, mb)
        return keys
