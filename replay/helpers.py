"""A replacement's replay helpers: the processes that share its replay (SWIFT's parallel recovery).

The scheduler starts K - 1 helper processes together with a replacement. Each builds the stage
ahead and waits for the replacement's job (:func:`serve_replay_helper`); the replacement publishes
the job and is rank 0 of the replay itself (:func:`replay_with_helpers`), keeping the recovered
state in memory. Helpers are always told the outcome: the job, or a cancellation when no replay is
needed or possible (:func:`release_helpers`), so none waits in vain.

Never: waits without a deadline.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from replay.job import ReplayJob, ReplayResult
from replay.parallel import result_of, worker_main
from replay.states import PreparedStates
from trainer_client.recovery_keys import RecoveryKeys, wait_for_keys

__all__ = ["release_helpers", "replay_with_helpers", "serve_replay_helper"]

logger = logging.getLogger(__name__)


def release_helpers(store: dist.Store, key: str) -> None:
    """Tell waiting helpers they are not needed, unless the job was published (never raises)."""
    try:
        if not store.check([key]):
            store.set(key, json.dumps({"cancel": "the replacement replays without helpers"}))
    except Exception as e:  # the store is gone: the helpers time out on their own
        logger.warning("could not release the replay helpers (%s): %s", key, e)


def replay_with_helpers(
    store: dist.Store,
    keys: RecoveryKeys,
    generation: int,
    stage: int,
    job: ReplayJob,
    helpers: int,
    sources: Sequence[Any],
    factory: Callable[..., Any] | None,
    timeout: datetime.timedelta,
    prepared: PreparedStates | None = None,
    loss_fn: Callable[..., Any] | None = None,
) -> ReplayResult:
    """Publish ``job`` for the helpers and replay it as rank 0 of ``helpers + 1`` workers, in process."""
    world = helpers + 1
    job = job.replace(workers=world)
    prefix = keys.replay_rendezvous(generation, stage)
    store.set(keys.replay_job(generation, stage), json.dumps({"job": job.to_dict(), "world": world, "prefix": prefix}))
    t0 = time.perf_counter()
    doc = worker_main(
        0,
        world,
        job,
        store=dist.PrefixStore(prefix, store),
        sources=sources,
        factory=factory,
        loss_fn=loss_fn,
        keep_states=True,
        timeout=timeout,
        prepared=prepared,
    )
    assert doc is not None  # rank 0 always returns the result
    return result_of(job, doc, time.perf_counter() - t0, states=doc["states"])


def serve_replay_helper(
    store: dist.Store,
    run_id: str,
    generation: int,
    stage: int,
    rank: int,
    *,
    factory: Callable[..., Any] | None = None,
    loss_fn: Callable[..., Any] | None = None,
    timeout: datetime.timedelta = datetime.timedelta(seconds=120),
    commit_prefix: str | None = None,
    prepared: PreparedStates | None = None,
) -> bool:
    """Be replay worker ``rank`` (>= 1) for the replacement of ``stage`` after generation ``generation``.

    Waits (at most ``timeout``) for the replacement's job, opens the job's record sources itself,
    replays its share of every iteration and takes part in the gradient exchange; the replacement
    (rank 0) keeps the result. Returns True when it took part, False when the replacement
    cancelled (no replay needed, impossible, or fewer helpers wanted). Raises
    RecoveryTimeoutError when no job comes, and what the replay raises. ``prepared``: the stage
    objects built ahead while the job is awaited (:func:`prepare_states`; used when they match).
    ``factory`` / ``loss_fn``: in-process objects instead of the job's names (as the replacement's).
    """
    if rank < 1:
        raise ValueError(f"helper ranks start at 1 (the replacement is rank 0), got {rank}")
    keys = RecoveryKeys(run_id, commit_prefix)
    key = keys.replay_job(generation, stage)
    # a short poll period: the replacement (rank 0) waits for this helper at the rendezvous
    got = wait_for_keys(
        store,
        [key],
        timeout=timeout,
        what=f"replay helper {rank} of stage {stage}: waiting for the job",
        max_poll_s=0.002,
    )
    doc = json.loads(got[key])
    if "cancel" in doc or rank >= int(doc["world"]):
        logger.info(
            "replay helper %d of stage %d: not needed (%s)", rank, stage, doc.get("cancel", f"world {doc.get('world')}")
        )
        return False
    worker_main(
        rank,
        int(doc["world"]),
        ReplayJob.from_dict(doc["job"]),
        store=dist.PrefixStore(doc["prefix"], store),
        factory=factory,
        loss_fn=loss_fn,
        timeout=timeout,
        prepared=prepared,
    )
    return True
