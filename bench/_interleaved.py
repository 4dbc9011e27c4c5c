"""The interleaved cases of the replay and recovery benches: a lost rank holding two stages.

The pipeline: ``trainer_client.examples.multi_stage_resilient`` under ``replay.launcher``, 4 ranks
of 2 Interleaved 1F1B stages each (rank r holds stages r and r + 4), an MLP of width 768 with 4
blocks per stage, 8 micro-batches of 32 samples, SGD with momentum; one process per rank, one torch
thread each (gloo, CPU). Rank 1 (stages 1 and 5) is the one lost.

- :func:`replay_case` (``replay.json`` "interleaved"): the rank's two stages replayed from the logs
  of a live run, one unit after the other, with one process (``seq``) and with 2 workers per unit
  (``k2``), in alternating rounds; against the live run's time for the same iterations.
- :func:`recovery_case` (``recovery.json`` "interleaved"): the rank killed at iteration 30, SWIFT
  (its replacement replays both stages from the checkpoint at 20, one after the other, and in a
  second run of each repetition at the same time: ``--replay-concurrent``) against a global
  rollback.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from logstore import LogStore
from replay import jobs_from_plan, plan_recovery, replay
from replay.compare import states_equal
from replay.launcher import KillSpec, resumed_after_rollback, run_with_failures
from replay.states import checkpoint_of

__all__ = ["recovery_case", "replay_case"]

SCRIPT = "trainer_client.examples.multi_stage_resilient"
RANKS, LOST = 4, 1
MODEL = {"width": 768, "depth": 4, "batch": 256, "n_microbatches": 8}
QUICK = {"width": 64, "depth": 1, "batch": 16, "n_microbatches": 4}


def _args(base: Path, model: dict[str, int], iters: int, ckpts: str) -> list[str]:
    shape = [x for k, v in model.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    return ["--iters", str(iters), "--ckpt-at", ckpts, "--schedule", "interleaved1f1b",
            "--cold-url", f"file://{base / 'cold'}", *shape]  # fmt: skip


def _run(
    base: Path,
    model: dict[str, int],
    iters: int,
    ckpts: str,
    kills: list[KillSpec],
    mode: str,
    extra: tuple[str, ...] = (),
) -> Any:
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    r = run_with_failures(
        [*_args(base, model, iters, ckpts), *extra],
        run_id="bench",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        num_stages=RANKS,
        kills=kills,
        mode=mode,
        timeout_s=600,
        script=SCRIPT,
    )
    if not r.ok:
        raise SystemExit(f"interleaved {mode} run failed:\n{r.describe()}")
    return r


def _same_stages(a: Any, b: Any) -> bool:
    """Every stage of every rank bit for bit (``states_equal``)."""
    return not any(
        states_equal(a.results[k]["stages"][s], b.results[k]["stages"][s])
        for k in range(RANKS)
        for s in b.results[k]["stages"]
    )


def replay_case(rounds: int, ckpt: int = 1, iters: int = 8, quick: bool = False) -> dict[str, Any]:
    """The lost rank's stages replayed sequentially and with 2 workers per unit (module docstring)."""
    model = QUICK if quick else MODEL
    shape = {"width": model["width"], "depth": model["depth"]}
    stop = ckpt + iters
    with tempfile.TemporaryDirectory(prefix="swiftlog-interleaved-replay-") as d:
        base = Path(d)
        live = _run(base / "live", model, stop, f"{ckpt},{stop}", [], "swift")
        ends = {it: t for it, t, _ in live.results[LOST]["iteration_end"]}
        live_s = ends[stop - 1] - ends[ckpt - 1]
        roots = sorted((base / "live" / "nodes").iterdir())
        stores = [LogStore.open(p, "bench", cold_url=f"file://{base / 'live' / 'cold'}") for p in roots]
        try:
            plan = plan_recovery(stores, failed_ranks=[LOST], stages_per_rank=2, target_iteration=stop)
            assert plan.possible, plan.reasons
            jobs = jobs_from_plan(plan, sources=stores, model=f"{SCRIPT}:factory", model_args=shape)
            for k in (1, 2):  # warm-up: this process's first replay, the workers' fork server
                replay(jobs[0].replace(workers=k, stop_iteration=ckpt + 1, output=str(base / f"warm{k}")))
            times: dict[str, list[float]] = {"seq": [], "k2": []}
            states: dict[str, dict[int, Any]] = {}
            verified = True
            for r in range(rounds):
                for name, k in (("seq", 1), ("k2", 2)):
                    total = 0.0
                    for job in jobs:
                        res = replay(job.replace(workers=k, output=str(base / f"out-{name}-{r}-{job.stages[0]}")))
                        total += res.replay_seconds
                        verified = verified and res.verified
                        for s in job.stages:
                            ck = checkpoint_of(res, s)
                            states.setdefault(name, {})[s] = {
                                "model": ck.model,
                                "optimizer": ck.optimizer,
                                "lr_scheduler": ck.lr_scheduler,
                            }
                    times[name].append(total)
                    print(f"interleaved round {r} {name}: {total:.3f} s (live {live_s:.3f} s)", flush=True)
        finally:
            for st in stores:
                st.close()
    want = live.results[LOST]["stages"]
    exact = {n: not any(states_equal(st[s], want[s]) for s in want) for n, st in states.items()}
    per_round = [s / k for s, k in zip(times["seq"], times["k2"], strict=True)]
    return {
        "rank_replay_vs_live": min(times["seq"]) / live_s,
        "parallel_speedup_k2": statistics.median(per_round),
        "parallel_speedup_k2_per_round": per_round,
        "live_seconds": live_s,
        "replay_seconds": times,
        "units": [u.stages for u in plan.units],
        "failed_ranks": {str(k): v for k, v in plan.failed_ranks.items()},
        "bit_exact": exact["seq"],
        "parallel_bit_exact": exact["k2"],
        "verified": verified,
        "config": {
            "ranks": RANKS,
            "stages_per_rank": 2,
            "lost_rank": LOST,
            "checkpoint": ckpt,
            "iterations": iters,
            "rounds": rounds,
            "model": model,
            "schedule": "interleaved1f1b",
        },  # fmt: skip
    }


def recovery_case(work: Path, reps: int, quick: bool) -> dict[str, Any]:
    """SWIFT vs a global rollback when the rank is killed at iteration 30 (module docstring)."""
    model = QUICK if quick else MODEL
    iters, fail_it, ckpts = 40, 30, "20,40"
    ref = _run(work / "multi-ref", model, iters, ckpts, [], "swift")
    kill = [KillSpec(LOST, fail_it, 1, "forward")]
    swift, together, rollback, bit_exact = [], [], [], True
    for rep in range(reps):
        s = _run(work / f"multi-swift{rep}", model, iters, ckpts, kill, "swift")
        bit_exact = bit_exact and _same_stages(s, ref)
        swift.append({**s.timings[0], "units": s.results[LOST]["recovered"]["units"]})
        c = _run(work / f"multi-concurrent{rep}", model, iters, ckpts, kill, "swift", ("--replay-concurrent",))
        bit_exact = bit_exact and _same_stages(c, ref)
        together.append(c.timings[0])
        g = _run(work / f"multi-rollback{rep}", model, iters, ckpts, kill, "rollback")
        rollback.append({"resumed_s": resumed_after_rollback(g, fail_it), "bit_exact": _same_stages(g, ref)})
    med = statistics.median
    rec, rb = med([t["resumed_s"] for t in swift]), med([r["resumed_s"] for r in rollback])
    conc = med([t["resumed_s"] for t in together])
    return {
        "recovery_vs_global_rollback": rec / rb,
        "recovery_vs_global_rollback_per_rep": [
            t["resumed_s"] / r["resumed_s"] for t, r in zip(swift, rollback, strict=True)
        ],
        "concurrent_recovery_vs_global_rollback": conc / rb,
        "concurrent_recovery_vs_global_rollback_per_rep": [
            t["resumed_s"] / r["resumed_s"] for t, r in zip(together, rollback, strict=True)
        ],
        "concurrent_recovery_s": conc,
        "concurrent_replay_s": med([t["replay_s"] for t in together]),
        "recovery_s": rec,
        "global_rollback_s": rb,
        **{k: med([t[k] for t in swift]) for k in ("detect_s", "fetch_s", "replay_s", "rejoin_s")},
        "replayed_units": [u["stages"] for u in swift[0]["units"]],
        "verified": all(t["verified"] for t in swift),
        "bit_exact": bit_exact,
        "rollback_bit_exact": all(r["bit_exact"] for r in rollback),
        "setup": {
            "ranks": RANKS,
            "stages_per_rank": 2,
            "schedule": "interleaved1f1b",
            "lost_rank": LOST,
            "failed_at_iteration": fail_it,
            "checkpoint": 20,
            "model": model,
            "reps": reps,
        },  # fmt: skip
        "runs": {"swift": swift, "concurrent": together, "rollback": rollback},
    }
