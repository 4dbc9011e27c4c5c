"""What a replacement learns from the survivors and leaves for them, through the job's store.

A replacement first waits for the scheduler's list of failed ranks and every survivor's report
(:func:`wait_for_survivors`); the survivors agree on where training resumes (:func:`agreed_resume`).
Their reports name where their logs are (:func:`sources_from_reports`: store roots, node servers,
cold tiers); the commit store holds the failed stages' committed META (:func:`committed_metas`).
A replay's reads are counted per source (:class:`CountingSource`) and kept as the job's measured
fetch rates (:func:`record_rates`, :func:`measured_rates`). When done, the replacement reports
ready (:func:`report_ready`) or that the job must roll back (:func:`report_fallback`).

Never: decides a recovery (``replay.replacement`` does); waits without a deadline.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from replay.errors import ReplacementFallback
from replay.job import SourceSpec
from trainer_client.config import ENV_NODE
from trainer_client.errors import RecoveryFailedError
from trainer_client.mesh import MeshLayout
from trainer_client.recovery_keys import RecoveryKeys, wait_for_keys

__all__ = [
    "as_text",
    "CountingSource",
    "agreed_resume",
    "committed_metas",
    "measured_rates",
    "record_rates",
    "report_fallback",
    "report_ready",
    "sources_from_reports",
    "survivor_reports",
    "wait_for_survivors",
]

logger = logging.getLogger(__name__)


class CountingSource:
    """A record source that counts what is read through it (decoded tensor bytes) and the time
    its successful reads took (concurrent prefetches each count: a lower bound of the rate)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.bytes = 0
        self.records = 0
        self.seconds = 0.0

    def get(self, key: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        t = self.inner.get(key)
        self.seconds += time.perf_counter() - t0
        self.records += 1
        self.bytes += t.numel() * t.element_size()
        return t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def wait_for_survivors(
    store: dist.Store, keys: RecoveryKeys, g: int, layout: MeshLayout, rank: int, timeout: datetime.timedelta
) -> tuple[list[int], dict[int, dict[str, Any]]]:
    """Step 1: the ranks the scheduler replaces after generation ``g``, and every survivor's report
    (by rank; with one replica the ranks are the stages). Raises RecoveryFailedError when ``rank``
    is not among the replaced."""
    who = f"replacement of {layout.describe(rank)}"
    failed, docs = survivor_reports(store, keys, g, layout, timeout, who=who)
    if rank not in failed:
        raise RecoveryFailedError(f"{who}: the scheduler replaces ranks {failed}, not {rank}")
    return failed, docs


def survivor_reports(
    store: dist.Store, keys: RecoveryKeys, g: int, layout: MeshLayout, timeout: datetime.timedelta, *, who: str
) -> tuple[list[int], dict[int, dict[str, Any]]]:
    """The ranks replaced after generation ``g`` and every survivor's report, by rank (waits at
    most ``timeout`` for each; ``who`` names the waiter in a timeout's message)."""
    v = wait_for_keys(
        store,
        [keys.failed_stages(g)],
        timeout=timeout,
        what=f"{who}: waiting for the failed-rank list",
    )
    failed = sorted(int(x) for x in json.loads(v[keys.failed_stages(g)]))
    survivors = [k for k in range(layout.world_size) if k not in failed]
    reports = wait_for_keys(
        store,
        [keys.survivor(g, k) for k in survivors],
        timeout=timeout,
        what=f"{who}: waiting for the survivors' reports",
    )
    return failed, {k: json.loads(reports[keys.survivor(g, k)]) for k in survivors}


def agreed_resume(docs: dict[int, dict[str, Any]], g: int) -> int:
    """The iteration every survivor resumes at (the commit step makes them agree)."""
    resumes = {k: d["resume"] for k, d in docs.items()}
    if len(set(resumes.values())) > 1:
        raise RecoveryFailedError(
            f"survivors disagree on the resume iteration: {resumes} (was the commit step disabled?)"
        )
    resume = next(iter(resumes.values())) if resumes else None
    if resume is None:
        raise ReplacementFallback(f"no survivor of generation {g}: nothing to replay against")
    return resume


def committed_metas(
    store: dist.Store, keys: RecoveryKeys, stages: Sequence[int], iterations: range, ranks: Sequence[int]
) -> SourceSpec | None:
    """The META documents of ``stages`` over ``iterations`` that the commit step stored (see
    ``trainer_client.commit``), as a source; None when there are none (no commit store, a run
    without META). A store error is logged, never raised: the logs may still hold them."""
    try:
        return SourceSpec.from_commit_store(store, keys.commit_prefix, stages, iterations, ranks=ranks)
    except Exception as e:
        logger.warning("reading the stored META documents of stages %s failed: %s", list(stages), e)
        return None


def as_text(v: Any) -> str:
    """A store value (bytes or str) as text."""
    return v.decode() if isinstance(v, bytes) else str(v)


#: the tier a source kind reads, for the plan's estimate
_TIER = {"store": "hot", "http": "hot", "cold": "cold"}


def record_rates(store: dist.Store, keys: RecoveryKeys, specs: Sequence[SourceSpec], opened: list[Any]) -> None:
    """Add what this replay read, per tier (bytes, seconds), to the job's measured rates. Never raises."""
    try:
        read: dict[str, list[float]] = {}
        for spec, s in zip(specs, opened, strict=True):
            if (tier := _TIER.get(spec.kind)) is not None:
                got = read.setdefault(tier, [0.0, 0.0])
                got[0] += s.bytes
                got[1] += s.seconds
        doc = json.loads(store.get(keys.rates())) if store.check([keys.rates()]) else {}
        for tier, (nbytes, seconds) in read.items():
            if nbytes >= 1 << 20 and seconds > 0:  # under 1 MB says little about a rate
                doc[tier] = {"bytes": nbytes, "seconds": seconds, "mb_per_s": nbytes / seconds / 1e6}
        store.set(keys.rates(), json.dumps(doc))
    except Exception as e:  # noqa: BLE001 - a measurement must not fail a recovery
        logger.warning("recording the fetch rates failed: %s", e)


def measured_rates(store: dist.Store, run_id: str) -> dict[str, float]:
    """The fetch rates (MB/s) per tier (``"hot"``, ``"cold"``) the job's last replays measured:
    what :func:`replay.plan_recovery` takes as ``rates``. Empty when none was measured."""
    keys = RecoveryKeys(run_id)
    if not store.check([keys.rates()]):
        return {}
    doc = json.loads(store.get(keys.rates()))
    return {tier: float(v["mb_per_s"]) for tier, v in doc.items() if isinstance(v, dict) and "mb_per_s" in v}


def sources_from_reports(docs: dict[int, dict[str, Any]]) -> list[SourceSpec]:
    """The survivors' hot tiers, then each cold tier once.

    A survivor on another node (its report names a node, not this process's ``SWIFTLOG_NODE``, and
    a node server) is read over HTTP from that server; one on this node (or one no agent placed)
    from its store root. The same records either way (a hot entry whose segment went to the cold
    tier is found in the cold source), but a cold tier is listed once per key window instead of
    once per survivor.
    """
    here = os.environ.get(ENV_NODE)
    out = []
    for _, d in sorted(docs.items()):
        if d.get("node_url") and d.get("node") != here:
            url = d["node_url"]  # the token (this process's SWIFTLOG_TOKEN) only ever over TLS
            token = os.environ.get("SWIFTLOG_TOKEN") if url.startswith("https://") else None
            out.append(SourceSpec(kind="http", location=url, token=token))
        elif d.get("store_root"):
            out.append(SourceSpec(kind="store", location=d["store_root"]))
    for cold in dict.fromkeys(d["cold_url"] for d in docs.values() if d.get("cold_url")):
        out.append(SourceSpec(kind="cold", location=cold))
    return out


def report_ready(
    store: dist.Store,
    run_id: str,
    generation: int,
    stage: int,
    info: dict[str, Any],
    commit_prefix: str | None = None,
) -> None:
    """Tell the survivors that ``stage`` is recovered (they then join generation + 1).

    The last replacement of the generation to report also sets the generation's wake-up key,
    which the survivors block on (no polling while the replay runs)."""
    keys = RecoveryKeys(run_id, commit_prefix)
    store.set(keys.ready(generation, stage), json.dumps({"t": time.time(), **info}, default=str))
    reported = store.add(keys.ready_count(generation), 1)
    failed = json.loads(as_text(store.get(keys.failed_stages(generation))))
    if reported >= len(failed):
        store.set(keys.wake(generation), "ready")


def report_fallback(
    store: dist.Store,
    run_id: str,
    generation: int,
    reason: str,
    commit_prefix: str | None = None,
) -> None:
    """Tell the survivors and the scheduler that in-place recovery is impossible (global rollback)."""
    keys = RecoveryKeys(run_id, commit_prefix)
    store.set(keys.fallback(generation), reason)
    store.set(keys.wake(generation), "fallback")
