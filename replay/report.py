"""What a replay did and whether it reproduced the live run: :class:`ReplayReport`.

The report counts what the replay regenerated and checked: boundary sends against the receivers'
digests (and, optionally, the sender's own records), optimizer steps against the gradient digests
the live stage put into META. :attr:`ReplayReport.verified` is true only when every check ran and
matched; :attr:`ReplayReport.first_mismatch` names the first diverging send;
:meth:`ReplayReport.raise_for_mismatch` turns a mismatch into ``ReplayMismatchError``. Reports of
parallel workers merge (:meth:`ReplayReport.merge`) and travel as JSON (``to_dict`` /
``from_dict``).

Never: calls a replay "verified" when a send went unchecked or a step's gradients differed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from logstore import RecordKey
from replay.errors import ReplayError, ReplayMismatchError

__all__ = ["ReplayReport"]


def _grad_mismatch_text(g: dict[str, Any]) -> str:
    params = list(g.get("params") or [])
    names = ", ".join(params[:3]) + (f" and {len(params) - 3} more" if len(params) > 3 else "")
    if g.get("at"):
        return (
            f"stage {g['stage']} iteration {g['iteration']}: the gradients {g['at']} differ from the live ones "
            f"({names}): the replacement's stage, its inputs or the loop between the schedule's step and that call "
            "differ from the live ones"
        )
    return (
        f"stage {g['stage']} iteration {g['iteration']}: the gradients the optimizer step used differ from the live "
        f"step's ({names}): the live loop changed them in a way the replay does not repeat (a collective such as an "
        "all_reduce of tied weights or of data-parallel replicas: sum through client.all_reduce_grads_, which a "
        "replay repeats; a write through .data; a gradient hook outside the stage), or the replacement's stage differs"
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
    (``{"stage", "iteration", "params"}``: what changed the live gradients is not repeated).
    ``sends``: regenerated boundary sends (``keep_sends=True``).
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
                f"the regenerated send {first['key']} differs from the log: is the replacement's stage factory (and "
                "its arguments) and loss what the training used, and deterministic?"
            )
        if self.sends_generated == 0:
            return (
                "the replay made no boundary send to check (nothing was replayed, or the stage sends nothing "
                "across a logged boundary)"
            )
        if self.digests_missing:
            return (
                f"{len(self.digests_missing)} of its {self.sends_generated} sends have no digest in the logs to check "
                f"them against (first: {self.digests_missing[0]})"
            )
        if self.stop_iteration - 1 in self.unknown_steps:
            return (
                f"its last iteration ({self.stop_iteration - 1}) was replayed with another stage's META: its "
                "optimizer step is unproven"
            )
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
                hint="gradients may change between backward and optimizer step only through client.clip_grad_norm_ "
                "and client.all_reduce_grads_; a collective on them or a write through .data is not replayed",
            )
        if self.digest_mismatches or self.record_mismatches:
            first = self.first_mismatch
            assert first is not None
            raise ReplayMismatchError(
                f"replay of stages {self.stages} regenerated "
                f"{len(self.digest_mismatches) + len(self.record_mismatches)} send(s) that differ from the log; first "
                f"divergence at iteration {first['iteration']} micro-batch {first['micro_batch']} channel "
                f"{first['channel']} ({first['key']})",
                hint=(
                    "every send of the first iteration matched, so most likely the update differs: gradients changed "
                    "between backward and optimizer step outside the client (clip with client.clip_grad_norm_, which "
                    "logs what the replay needs), or an optimizer / lr scheduler other than the live one"
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
