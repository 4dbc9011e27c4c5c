"""A running job's costs, measured: what the logging-group planner (``replay.group_planner``) needs.

:func:`profile_run` reads a run's log store after a few iterations with every boundary logged:

- the bytes stored per iteration at each boundary, activations and gradients apart (compressed,
  as the store holds them: the record listing's sizes), and what every grouping logs anyway
  (META, digests, inputs);
- each stage's live step time (META ``step_s``) and the micro-batch count;
- each stage's replay time per iteration, measured by replaying ``replay_iterations`` iterations
  of it from its checkpoint when a stage factory is given (``model`` or ``factory``); else
  estimated from the live step time (as ``replay.plan`` does) and said so;
- the fetch rate, measured by reading one iteration's boundary records;
- the checkpoint interval from the checkpoint registrations;
- the failure domains (stage -> node; default one stage per node) and which stages have a live
  replica in another domain (default: all of them when the run has ``dp_replicate`` > 1).

:attr:`JobProfile.sources` says of every figure whether it was measured or assumed, and how.
:func:`save_profile` keeps the profile as the document ``profile`` of the run's store (the cold
tier when there is one, and the local hot tier); :func:`load_profile` reads it back.

Never: writes anything but that document; runs a replay without a stage factory.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from logstore import Channel, LogStore
from logstore.errors import ConfigError
from logstore.keys import Kind

__all__ = ["PROFILE_DOCUMENT", "JobProfile", "load_profile", "profile_run", "save_profile"]

PROFILE_DOCUMENT = "profile"


@dataclass(frozen=True)
class JobProfile:
    """One pipeline's measured costs (per data-parallel pipeline; see the module docstring).

    Per boundary b (between stages b and b + 1): ``activation_bytes`` / ``gradient_bytes`` stored
    per iteration. Per stage: ``replay_s`` (seconds to replay one iteration), ``step_s`` (the live
    step), ``domains`` (failure domain), ``replicated`` (a replica survives its domain's loss).
    ``fixed_bytes``: stored per iteration whatever the grouping. ``fetch_mbps``: MB/s (1e6 bytes)
    a replay reads records at. ``restart_s``: what every recovery pays before it replays
    (detection, replacement start, checkpoint load). ``compute_slots``: the stages share one
    machine that computes this many stages at once (None: every stage has its own device).
    ``sources``: field -> how it was obtained.
    """

    run_id: str
    num_stages: int
    activation_bytes: tuple[float, ...]
    gradient_bytes: tuple[float, ...]
    replay_s: tuple[float, ...]
    step_s: tuple[float, ...]
    iteration_s: float
    checkpoint_interval: int
    fetch_mbps: float
    n_microbatches: int
    domains: tuple[int, ...]
    replicated: tuple[bool, ...]
    restart_s: float = 2.0
    fixed_bytes: float = 0.0
    iterations_profiled: int = 0
    compute_slots: int | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        S = self.num_stages
        if not isinstance(S, int) or S < 1:
            raise ConfigError(f"profile num_stages must be a positive int, got {S!r}")
        for name, n in (
            ("activation_bytes", S - 1),
            ("gradient_bytes", S - 1),
            ("replay_s", S),
            ("step_s", S),
            ("domains", S),
            ("replicated", S),
        ):
            v = getattr(self, name)
            if len(v) != n:
                raise ConfigError(f"profile {name} needs {n} entries for {S} stages, got {len(v)}")
            object.__setattr__(self, name, tuple(v))
        for name in ("activation_bytes", "gradient_bytes", "replay_s", "step_s"):
            bad = [x for x in getattr(self, name) if not isinstance(x, int | float) or not x >= 0]
            if bad:
                raise ConfigError(f"profile {name} must be numbers >= 0, got {bad[0]!r}")
        if not self.checkpoint_interval >= 1:
            raise ConfigError(f"profile checkpoint_interval must be >= 1, got {self.checkpoint_interval!r}")
        if self.compute_slots is not None and not (isinstance(self.compute_slots, int) and self.compute_slots >= 1):
            raise ConfigError(f"profile compute_slots must be None or an int >= 1, got {self.compute_slots!r}")
        if not self.fetch_mbps > 0 or not self.n_microbatches >= 1 or not self.restart_s >= 0:
            raise ConfigError(
                "profile fetch_mbps must be > 0, n_microbatches >= 1 and restart_s >= 0, got "
                f"{self.fetch_mbps!r}, {self.n_microbatches!r}, {self.restart_s!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> JobProfile:
        """The profile of ``to_dict()``; ConfigError naming what is missing or unknown."""
        if not isinstance(doc, dict):
            raise ConfigError(f"a profile is a JSON object, got {type(doc).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(f"unknown profile field(s) {unknown}", hint=f"fields: {sorted(known)}")
        try:
            return cls(**doc)
        except TypeError as e:
            raise ConfigError(f"profile incomplete: {e}") from None


def save_profile(store: LogStore, profile: JobProfile) -> None:
    """Keep ``profile`` as the document ``profile`` of the run's store."""
    store.put_document(PROFILE_DOCUMENT, profile.to_dict())


def load_profile(store: LogStore) -> JobProfile | None:
    """The run's saved profile, or None."""
    doc = store.get_document(PROFILE_DOCUMENT)
    return None if doc is None else JobProfile.from_dict(doc)


def profile_run(
    store: LogStore,
    *,
    num_stages: int | None = None,
    domains: Sequence[int] | None = None,
    replicated: Sequence[bool] | None = None,
    checkpoint_interval: int | None = None,
    restart_s: float | None = None,
    replay_iterations: int = 2,
    model: str | None = None,
    model_args: dict[str, Any] | None = None,
    factory: Callable[..., Any] | None = None,
    data_source: str | None = None,
) -> JobProfile:
    """Measure the run in ``store`` (module docstring). ``num_stages``: default from the channels.

    Raises ConfigError when the store cannot give a figure and no argument does: no iteration with
    every boundary logged (profile a run with ``logging_groups=None``), no META, fewer than two
    checkpoints of a stage without ``checkpoint_interval``.
    """
    sources: dict[str, str] = {}
    chans = store.channels()
    S = num_stages or 1 + max((max(c.src, c.dst) for c in chans), default=0)
    sizes = _record_sizes(store, S)
    its = sorted(it for it, per in sizes.items() if all((Kind.ACTIVATION, b) in per for b in range(S - 1)))
    its = [it for it in its if all((Kind.GRADIENT, b) in sizes[it] for b in range(S - 1))]
    if S > 1 and not its:
        raise ConfigError(
            f"run {store.run!r}: no iteration has every boundary of its {S} stages logged",
            hint="profile a run that logs every boundary (ClientConfig.logging_groups=None)",
        )
    act = tuple(statistics.median(sizes[it][(Kind.ACTIVATION, b)] for it in its) for b in range(S - 1))
    grad = tuple(statistics.median(sizes[it][(Kind.GRADIENT, b)] for it in its) for b in range(S - 1))
    fixed = statistics.median(sizes[it].get(("fixed", 0), 0) for it in its) if its else 0.0
    sources["activation_bytes"] = sources["gradient_bytes"] = f"measured: record sizes, median of {len(its)} iterations"
    metas = _metas(store, S, its[-min(len(its), 8) :] if its else [])
    step = tuple(statistics.median(m) if m else 0.0 for m in (metas[k]["step_s"] for k in range(S)))
    n_mb = max((metas[k]["n_microbatches"] for k in range(S)), default=1) or 1
    sources["step_s"] = "measured: META step_s"
    iteration_s = max(step) if step else 0.0
    interval = checkpoint_interval or _interval(store, S)
    sources["checkpoint_interval"] = "given" if checkpoint_interval else "measured: checkpoint registrations"
    fetch = _fetch_mbps(store, its[-1] if its else None, S)
    sources["fetch_mbps"] = "measured: one iteration's boundary records read from the store" if fetch else "assumed"
    replay = _replay_times(store, S, step, n_mb, replay_iterations, model, model_args, factory, data_source, sources)
    dp = max((metas[k]["dp_replicate"] for k in range(S)), default=1)
    sources["domains"] = "given" if domains is not None else "assumed: one stage per domain"
    sources["replicated"] = (
        "given"
        if replicated is not None
        else f"assumed from dp_replicate={dp}: "
        + ("every stage has replicas in other domains" if dp > 1 else "no replicas")
    )
    sources["restart_s"] = "given" if restart_s is not None else "assumed"
    return JobProfile(
        run_id=store.run,
        num_stages=S,
        activation_bytes=act,
        gradient_bytes=grad,
        replay_s=replay,
        step_s=step,
        iteration_s=iteration_s,
        checkpoint_interval=interval,
        fetch_mbps=fetch or 1000.0,
        n_microbatches=n_mb,
        domains=tuple(domains) if domains is not None else tuple(range(S)),
        replicated=tuple(bool(x) for x in replicated) if replicated is not None else (dp > 1,) * S,
        restart_s=2.0 if restart_s is None else restart_s,
        fixed_bytes=fixed,
        iterations_profiled=len(its),
        sources=sources,
    )


def _record_sizes(store: LogStore, S: int) -> dict[int, dict[tuple[Any, int], float]]:
    """iteration -> {(kind, boundary): stored bytes, ("fixed", 0): the other records' bytes}."""
    out: dict[int, dict[tuple[Any, int], float]] = {}
    after = None
    while True:
        page = store.list_records(after=after, limit=5000)
        if not page:
            return out
        for r in page:
            k = r.key
            per = out.setdefault(k.iteration, {})
            ch = k.channel
            if ch.kind is Kind.ACTIVATION:
                slot: tuple[Any, int] = (Kind.ACTIVATION, ch.src)
            elif ch.kind is Kind.GRADIENT:
                slot = (Kind.GRADIENT, ch.dst)
            else:
                slot = ("fixed", 0)
            per[slot] = per.get(slot, 0.0) + r.stored_bytes
        after = page[-1].key


def _metas(store: LogStore, S: int, its: Sequence[int]) -> dict[int, dict[str, Any]]:
    from trainer_client.meta import decode_meta

    out: dict[int, dict[str, Any]] = {k: {"step_s": [], "n_microbatches": 0, "dp_replicate": 1} for k in range(S)}
    for k in range(S):
        for it in its:
            try:
                doc = decode_meta(store.get(_meta_key(k, it)))
            except Exception:  # a META not there (or unreadable): the next iteration's
                continue
            if doc.get("step_s") is not None:
                out[k]["step_s"].append(float(doc["step_s"]))
            out[k]["n_microbatches"] = int(doc.get("n_microbatches") or out[k]["n_microbatches"])
            out[k]["dp_replicate"] = max(out[k]["dp_replicate"], _replicas(doc))
    if not any(out[k]["step_s"] for k in range(S)):
        raise ConfigError(f"run {store.run!r}: no META record with a step time in the profiled iterations")
    return out


def _replicas(meta: dict[str, Any]) -> int:
    """The data-parallel width a META's replica average names (1 without one)."""
    avg = meta.get("replica_average")
    calls = avg if isinstance(avg, list) else [avg] if isinstance(avg, dict) else []
    return max((int(c.get("world") or 1) for c in calls if isinstance(c, dict)), default=1)


def _meta_key(stage: int, iteration: int) -> Any:
    from logstore import RecordKey

    return RecordKey(Channel(Kind.META, stage, stage), iteration, 0)


def _interval(store: LogStore, S: int) -> int:
    by_stage: dict[int, list[int]] = {}
    for c in store.checkpoints():
        by_stage.setdefault(c.stage, []).append(c.iteration)
    gaps = [b - a for its in by_stage.values() for a, b in zip(sorted(its), sorted(its)[1:], strict=False) if b > a]
    if not gaps:
        raise ConfigError(
            f"run {store.run!r}: fewer than two checkpoints of a stage: the checkpoint interval is unknown",
            hint="pass checkpoint_interval (iterations between checkpoints)",
        )
    return int(statistics.median(gaps))


def _fetch_mbps(store: LogStore, it: int | None, S: int) -> float | None:
    if it is None:
        return None
    keys = [
        r.key
        for kind in (Kind.ACTIVATION, Kind.GRADIENT)
        for r in store.list_records(it_lo=it, it_hi=it + 1, kinds=[kind], limit=5000)
    ]
    t0, n = time.perf_counter(), 0
    for k in keys:
        n += len(store.get_blob(k))
    dt = time.perf_counter() - t0
    return n / dt / 1e6 if n and dt > 0 else None


def _replay_times(
    store: LogStore,
    S: int,
    step: tuple[float, ...],
    n_mb: int,
    iterations: int,
    model: str | None,
    model_args: dict[str, Any] | None,
    factory: Callable[..., Any] | None,
    data_source: str | None,
    sources: dict[str, str],
) -> tuple[float, ...]:
    if model is None and factory is None:
        sources["replay_s"] = "estimated: live step x n / (n + S - 1) (no stage factory given to replay with)"
        return tuple(s * n_mb / (n_mb + S - 1) for s in step)
    from replay.engine import replay
    from replay.job import jobs_from_plan
    from replay.plan import plan_recovery

    out = []
    for k in range(S):
        plan = plan_recovery(store, failed_stages=[k], target_iteration=_replay_target(store, k, iterations))
        unit = plan.units[0] if plan.units else None
        if not plan.possible or unit is None or unit.checkpoint_iteration is None or unit.stop_iteration is None:
            raise ConfigError(
                f"stage {k} cannot be replayed to measure its replay time: {'; '.join(plan.reasons) or 'no unit'}"
            )
        jobs = jobs_from_plan(plan, sources=[store], model=model, model_args=model_args or {}, data_source=data_source)
        compute, done = 0.0, 0
        for job in jobs:  # the iterations' compute, not the replay's set-up (stage build, checkpoint load)
            rep = replay(job, factory=factory).report
            compute, done = compute + rep.compute_seconds, done + rep.iterations_done
        out.append(compute / max(1, done))
    sources["replay_s"] = (
        f"measured: up to {iterations} iterations of each stage replayed from its checkpoint (their compute)"
    )
    return tuple(out)


def _replay_target(store: LogStore, stage: int, iterations: int) -> int:
    """The iteration to replay up to: ``iterations`` past the newest checkpoint of ``stage`` that
    has that many logged iterations after it (the oldest checkpoint when none has)."""
    logged = {r.key.iteration for r in store.list_records(kinds=[Kind.META], limit=100000)}
    cks = sorted(c.iteration for c in store.checkpoints() if c.stage == stage)
    if not cks:
        raise ConfigError(f"stage {stage} has no checkpoint to replay from: its replay time cannot be measured")
    fits = [c for c in cks if all(it in logged for it in range(c, c + iterations))]
    return (fits[-1] if fits else cks[0]) + iterations
