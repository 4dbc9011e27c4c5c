"""The timings of each recovery of a scheduled run, read from the stamps its processes left in the store.

The scheduler (``replay.launcher``) and the training processes write wall-clock stamps into the
job's store: when a stage was killed, when each survivor noticed and reported, when each
replacement was ready and rejoined. :func:`recovery_timings` turns them, with the scheduler's
timeline, into one entry per failed generation (detect, fetch, replay, rejoin, resumed seconds).

Never: writes to the store.
"""

from __future__ import annotations

import json
from typing import Any

from trainer_client.recovery_keys import RecoveryKeys

__all__ = ["recovery_timings"]


def _f(v: Any) -> float:
    return float(v.decode() if isinstance(v, bytes) else v)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def recovery_timings(
    store: Any, keys: RecoveryKeys, timeline: list[dict[str, Any]], num_stages: int
) -> list[dict[str, Any]]:
    """Per failed generation: detect / fetch / replay / rejoin / resumed (seconds), from the store's stamps;
    ``verified``: every replaced stage's replay verified (``verified_by_stage`` has each)."""
    out = []
    kills = {k: _f(store.get(keys.kill_time(k))) for k in range(num_stages) if store.check([keys.kill_time(k)])}
    gens = sorted({e["generation"] for e in timeline if e["what"] == "replace"})
    for g in gens:
        d: dict[str, Any] = {"generation": g}
        reps = [
            json.loads(_s(store.get(keys.survivor(g, k))))
            for k in range(num_stages)
            if store.check([keys.survivor(g, k)])
        ]
        failed = json.loads(_s(store.get(keys.failed_stages(g))))
        ready_by = {k: json.loads(_s(store.get(keys.ready(g, k)))) for k in failed if store.check([keys.ready(g, k)])}
        ready = list(ready_by.values())
        rejoined = [_f(store.get(keys.rejoined(g, k))) for k in range(num_stages) if store.check([keys.rejoined(g, k)])]
        t_kill = min((kills[k] for k in failed if k in kills), default=None)
        d["failed_stages"] = failed
        d["resume"] = reps[0]["resume"] if reps else None
        if t_kill is not None and reps:
            d["detect_s"] = min(r["t_detect"] for r in reps) - t_kill
            d["all_detected_s"] = max(r["t_detect"] for r in reps) - t_kill
            d["survivors_reported_s"] = max(r.get("t_reported", r["t_detect"]) for r in reps) - t_kill
            d["survivor_teardown_s"] = max(r.get("teardown_s", 0.0) for r in reps)
            d["survivor_destroy_s"] = max(r.get("destroy_s", 0.0) for r in reps)
            d["survivor_drain_s"] = max(r.get("drain_s", 0.0) for r in reps)
        if ready:
            tm = ready[0].get("timings", {})
            d["wait_survivors_s"] = tm.get("wait_survivors_s")
            d["fetch_s"] = (tm.get("setup_s") or 0.0) + (tm.get("fetch_s") or 0.0)
            d["replay_s"] = tm.get("replay_s")
            d["replay_workers"] = tm.get("workers")
            d["bytes_fetched"] = ready[0].get("bytes_fetched")
            d["records_fetched"] = ready[0].get("records_fetched")
            d["verified"] = all(r.get("verified") for r in ready)  # every replaced stage's (a group has several)
            d["verified_by_stage"] = {k: r.get("verified") for k, r in ready_by.items()}
            d["digests_checked"] = ready[0].get("digests_checked")
            d["checkpoint_iteration"] = ready[0].get("checkpoint_iteration")
            d["warnings"] = ready[0].get("warnings", [])  # the replay's (e.g. a META it had to stand in for)
            replace_t = next(
                (e["t"] for e in timeline if e["what"] == "replace" and e["generation"] == g),
                None,
            )
            start_t = next(
                (
                    e["t"]
                    for e in timeline
                    if e["what"] == "start" and e["generation"] == g + 1 and e["stage"] in failed
                ),
                None,
            )
            if t_kill is not None and replace_t is not None and start_t is not None:
                d["scheduler_s"] = start_t - t_kill  # death noticed, replacement launched
                d["settle_s"] = replace_t - t_kill  # every other stage reported or died: failed list written
                if "t_main" in ready[0] and "t_recover" in ready[0]:  # (stamps a script may leave out)
                    d["replacement_start_s"] = ready[0]["t_main"] - start_t  # process start (fork server)
                    d["replacement_setup_s"] = (
                        ready[0]["t_recover"] - ready[0]["t_main"]
                    )  # store connection, log client
            if rejoined:
                d["rejoin_s"] = max(rejoined) - max(r["t"] for r in ready)
        if t_kill is not None and rejoined:
            d["resumed_s"] = max(rejoined) - t_kill
        out.append(d)
    return out
