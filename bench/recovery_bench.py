"""Recovery benchmark: SWIFT in-place recovery vs a global rollback from the same checkpoint.

Setup: the example GPT on 4 stage processes (gloo, CPU), checkpoints every 20 iterations, one
stage SIGKILLed mid-interval (iteration 30 of 40: 10 iterations after the checkpoint at 20).

- SWIFT (``mode="swift"``): survivors keep their state; a replacement replays the failed stage
  alone from its checkpoint (20) to the failed iteration (30) from the neighbours' logs, verifies
  the digests, and the pipeline re-forms. Measured: kill -> every stage joined the new process
  group at iteration 30 (``resumed_s``), split into detect / fetch / replay / rejoin.
- Global rollback (``mode="rollback"``): every stage is killed and restarted from the checkpoint
  at 20 and redoes iterations 20..29 as a whole pipeline. Measured: kill -> the restarted
  pipeline finished iteration 29 again (it stands where it was when the failure hit).

What each includes, honestly: both start processes from a fork server that already imported
torch (milliseconds; on a cluster a rollback restarts every rank's container and imports, a
replacement only one), both form a new gloo group over the same external TCPStore, both load
checkpoints from a local directory. The rollback redoes 10 pipelined iterations on 4 processes
sharing this machine's cores; the replay recomputes one stage alone. ``bit_exact``: every stage's
final parameters, AdamW state and scheduler after the SWIFT run equal a failure-free run's bit for bit (states_equal).

Parallel recovery: by default (``--replay-workers 2``) the scheduler starts one replay helper with
the replacement (same fork server); the replacement is rank 0 of an exact parallel replay. On
this 2-core machine the idle survivors leave the second core to the helper.

``recovery_vs_global_rollback`` is the median SWIFT time over the median rollback time of
``--reps`` repetitions (each a SWIFT run then a rollback run); ``..._per_rep`` lists the paired
ratios, which show how much the shared machine moves it.

Interleaved case (``interleaved`` in the results; ``bench/_interleaved.py``): the same comparison
for a rank that holds two stages of an Interleaved 1F1B pipeline (4 ranks x 2 stages). Rank 1
(stages 1 and 5) is killed at iteration 30; its replacement replays both stages, one after the
other, from the checkpoint at 20 (``replay.recover_rank``); the rollback restarts all 4 ranks.

Writes bench/results/recovery.json. ``python bench/recovery_bench.py [--reps N] [--quick] [--replay-workers K]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._interleaved import recovery_case  # noqa: E402
from replay.compare import states_equal
from replay.launcher import DEFAULT_SCRIPT, KillSpec, resumed_after_rollback, run_with_failures

RESULTS = Path(__file__).resolve().parent / "results" / "recovery.json"


def _args(base: Path, iters: int, ckpt_every: int, model: list[str]) -> list[str]:
    ckpts = ",".join(str(i) for i in range(ckpt_every, iters + 1, ckpt_every))
    return [
        "--schedule",
        "1f1b",
        "--iters",
        str(iters),
        "--ckpt-at",
        ckpts,
        "--seed",
        "1234",
        "--data-source",
        "--segment-iters",
        "4",
        "--cold-url",
        f"file://{base / 'cold'}",
        *model,
    ]


def _run(
    base: Path, args: list[str], kills: list[KillSpec], mode: str, workers: int = 1, script: str = DEFAULT_SCRIPT
) -> Any:
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    r = run_with_failures(
        args,
        run_id="bench",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        kills=kills,
        mode=mode,
        timeout_s=600,
        replay_workers=workers,
        script=script,
    )
    if not r.ok:
        raise SystemExit(f"{mode} run failed:\n{r.describe()}")
    return r


def gpt_case(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """SWIFT vs a global rollback for the example GPT, one stage per rank (the module docstring)."""
    iters, every, fail_it = 40, 20, 30
    model = (
        ["--hidden", "64", "--layers", "1", "--seq", "16", "--n-microbatches", "4"]
        if a.quick
        else ["--hidden", "128", "--layers", "2", "--seq", "32", "--n-microbatches", "8", "--heads", "4"]
    )
    ref = _run(work / "ref", _args(work / "ref", iters, every, model), [], "swift")
    kill = [KillSpec(a.stage, fail_it, 1, "forward")]
    swift, rollback = [], []
    exact = True
    for rep in range(a.reps):
        s = _run(
            work / f"swift{rep}",
            _args(work / f"swift{rep}", iters, every, model),
            kill,
            "swift",
            a.replay_workers,
        )
        diffs = [states_equal(s.results[k], ref.results[k]) for k in range(4)]
        exact = exact and not any(diffs)
        swift.append(s.timings[0])
        g = _run(
            work / f"rollback{rep}",
            _args(work / f"rollback{rep}", iters, every, model),
            kill,
            "rollback",
        )
        rollback.append(
            {
                "resumed_s": resumed_after_rollback(g, fail_it),
                "bit_exact": not any(states_equal(g.results[k], ref.results[k]) for k in range(4)),
            }
        )
    iter_s = statistics.median(
        t2 - t1
        for (_, t1, _), (_, t2, _) in zip(
            ref.results[0]["iteration_end"], ref.results[0]["iteration_end"][1:], strict=False
        )
    )
    med = statistics.median
    rec = med([t["resumed_s"] for t in swift])
    rb = med([r["resumed_s"] for r in rollback])
    out = {
        "recovery_vs_global_rollback": rec / rb,
        "recovery_vs_global_rollback_per_rep": [
            t["resumed_s"] / r["resumed_s"] for t, r in zip(swift, rollback, strict=True)
        ],
        "replay_workers": a.replay_workers,
        "recovery_s": rec,
        "global_rollback_s": rb,
        "detect_s": med([t["detect_s"] for t in swift]),
        "fetch_s": med([t["fetch_s"] for t in swift]),
        "replay_s": med([t["replay_s"] for t in swift]),
        "rejoin_s": med([t["rejoin_s"] for t in swift]),
        "wait_survivors_s": med([t["wait_survivors_s"] for t in swift]),
        "bytes_fetched": swift[0]["bytes_fetched"],
        "records_fetched": swift[0]["records_fetched"],
        "verified": all(t["verified"] for t in swift),
        "bit_exact": exact,
        "rollback_bit_exact": all(r["bit_exact"] for r in rollback),
        "pipeline_iteration_s": iter_s,
        "setup": {
            "stages": 4,
            "failed_stage": a.stage,
            "iterations": iters,
            "checkpoint_every": every,
            "failed_at_iteration": fail_it,
            "iterations_redone_or_replayed": fail_it - every,
            "schedule": "1f1b",
            "model_args": model,
            "reps": a.reps,
            "replay_workers": a.replay_workers,
            "process_start": "fork server with torch preloaded (both modes)",
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "runs": {"swift": swift, "rollback": rollback},
        "notes": (
            "recovery_s: SIGKILL -> every stage in the new process group at the failed iteration "
            "(detect + survivors report + replacement start + checkpoint load + fetch + replay + verify + rejoin). "
            "global_rollback_s: SIGKILL -> restarted pipeline finished the failed iteration - 1 again "
            "(kill all + restart 4 processes + rejoin + checkpoint load + redo). "
            "fetch_s includes the replacement's checkpoint load and stage build; "
            "it overlaps replay_s through prefetching."
        ),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="smaller model (smoke test)")
    p.add_argument("--only", choices=["gpt", "interleaved"], default=None, help="run one case (default: both)")
    p.add_argument(
        "--replay-workers",
        type=int,
        default=2,
        help="replay processes: the replacement plus (K - 1) helpers the scheduler starts with it",
    )
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="swiftlog-recovery-bench-"))
    try:
        old = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
        out = gpt_case(a, work) if a.only != "interleaved" else {k: v for k, v in old.items() if k != "interleaved"}
        out["interleaved"] = recovery_case(work, a.reps, a.quick) if a.only != "gpt" else old.get("interleaved")
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(out, indent=2, default=str))
        shown = {k: v for k, v in out.items() if k != "runs"}
        if isinstance(shown.get("interleaved"), dict):
            shown["interleaved"] = {k: v for k, v in shown["interleaved"].items() if k != "runs"}
        print(json.dumps(shown, indent=2, default=str))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
