"""Sharded benchmark: FSDP2 / HSDP x pipeline recovering a lost shard, against a global rollback.

Fixed workload: the example GPT of ``bench/hybrid_bench.py`` (hidden 512, 8 heads, one block per
stage, sequence 64, vocabulary 4096, 4 micro-batches of 2, AdamW), every block and every stage ``fully_shard``-ed
(FSDP2, gloo on CPU, one thread per process), DCP checkpoints at 10 and 30 of 30 iterations, the
failure at iteration 20 (10 iterations after the checkpoint), mid-forward of micro-batch 1, in
stage 1.

Side by side in one run, ``--reps`` times each (SWIFT run, then rollback run, paired):
- ``fsdp``: ``dp_shard=2`` x ``pp=2`` (4 processes). Shard 1 of stage 1 is SIGKILLed; it has no
  replica, so its shard group (itself and shard 0, which stays in its process) goes back to the
  checkpoint at 10 and replays together from their pipelines' logs, their all-gathers and
  reduce-scatters repeated; every other rank keeps its state.
- ``hsdp``: ``dp_replicate=2`` x ``dp_shard=2`` x ``pp=2`` (8 processes). The same shard of
  replica 1 is SIGKILLed; its replacement receives the state of the same shard of replica 0 (no
  replay).
- ``rollback``: the same kill in each mesh, every rank restarted from the checkpoint at 10 (what a
  job without SWIFT does).
Measured: kill -> every rank in the new process group at iteration 20 (``resumed_s``), against
kill -> the restarted mesh finished iteration 19 again.

- ``overhead_ratio``: the FSDP mesh, failure-free, 40 iterations with logging on and off in
  alternating blocks of 2 (``bench/_runs.py``): each unlogged iteration's time against its logged
  neighbours', the median over the pairs. Logging to the hot tier.

Every recovered run's ranks (their shards) are compared bit for bit with a failure-free run of
the same mesh (``bit_exact``). Writes bench/results/fsdp.json.
``python bench/fsdp_bench.py [--reps N] [--quick]``.
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

from bench._runs import logging_overhead  # noqa: E402
from replay.compare import states_equal  # noqa: E402
from replay.launcher import KillSpec, RecoveryRun, resumed_after_rollback, run_with_failures  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "fsdp.json"
ITERS, CKPTS, FAIL_IT, CKPT_BEFORE, OVERHEAD_ITERS = 30, "10,30", 20, 10, 40
STAGES = 2
MESHES = {"fsdp": (1, 2), "hsdp": (2, 2)}  # (dp_replicate, dp_shard)
MODEL = ["--hidden", "512", "--heads", "8", "--layers", "1", "--seq", "64", "--n-microbatches", "4", "--vocab", "4096"]
QUICK = ["--hidden", "64", "--layers", "1", "--seq", "16", "--n-microbatches", "4"]


def _run(
    base: Path,
    mesh: str,
    model: list[str],
    kills: list[KillSpec],
    mode: str,
    extra: list[str] = (),  # type: ignore[assignment]
    iters: int = ITERS,
    cold: bool = True,
) -> RecoveryRun:
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    replicas, shards = MESHES[mesh]
    args = ["--iters", str(iters), "--ckpt-at", CKPTS, "--seed", "1234", "--segment-iters", "4"]
    args += ["--checkpoint-format", "dcp", *(["--cold-url", f"file://{base / 'cold'}"] if cold else []), *model, *extra]
    r = run_with_failures(
        args,
        run_id="fsdp",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        kills=kills,
        mode=mode,
        num_stages=STAGES,
        dp_replicate=replicas,
        dp_shard=shards,
        timeout_s=900,
    )
    if not r.ok:
        raise SystemExit(f"{mesh} {mode} run failed:\n{r.describe()}")
    return r


def _exact(r: RecoveryRun, ref: RecoveryRun) -> bool:
    return not any(states_equal(r.results[k], ref.results[k]) for k in ref.results)


def _case(work: Path, mesh: str, model: list[str], reps: int) -> dict[str, Any]:
    """One mesh's SWIFT and rollback runs, paired, and their comparison with a failure-free run."""
    ref = _run(work / f"{mesh}-ref", mesh, model, [], "swift")
    kill = [KillSpec(1, FAIL_IT, 1, "forward", replica=MESHES[mesh][0] - 1, shard=1)]
    swift, rollback = [], []
    exact = {"swift": True, "rollback": True}
    for rep in range(reps):
        s = _run(work / f"{mesh}-swift{rep}", mesh, model, kill, "swift")
        exact["swift"] &= _exact(s, ref)
        lost = next(k for k, v in s.results.items() if v.get("recovered"))
        swift.append({**s.timings[0], "path": s.results[lost]["recovered"]["path"]})
        g = _run(work / f"{mesh}-rollback{rep}", mesh, model, kill, "rollback")
        exact["rollback"] &= _exact(g, ref)
        rollback.append({"resumed_s": resumed_after_rollback(g, FAIL_IT)})
    med = statistics.median
    rec, rb = med([t["resumed_s"] for t in swift]), med([r["resumed_s"] for r in rollback])
    return {
        "recovery_vs_global_rollback": rec / rb,
        "recovery_s": rec,
        "global_rollback_s": rb,
        "path": swift[0]["path"],
        "per_rep": [t["resumed_s"] / r["resumed_s"] for t, r in zip(swift, rollback, strict=True)],
        "bit_exact": exact,
        "runs": {"swift": swift, "rollback": rollback},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a smaller model (smoke test)")
    a = p.parse_args(argv)
    model = QUICK if a.quick else MODEL
    work = Path(tempfile.mkdtemp(prefix="swiftlog-fsdp-bench-"))
    try:
        cases = {mesh: _case(work, mesh, model, a.reps) for mesh in MESHES}
        alternate = ["--alternate-logging", "2"]
        overhead_run = _run(work / "overhead", "fsdp", model, [], "swift", alternate, OVERHEAD_ITERS, cold=False)
        over = logging_overhead(overhead_run, 2)
        out = {
            "fsdp_recovery_vs_global_rollback": cases["fsdp"]["recovery_vs_global_rollback"],
            "hsdp_recovery_vs_global_rollback": cases["hsdp"]["recovery_vs_global_rollback"],
            "overhead_ratio": over["overhead_ratio"],
            "bit_exact": all(all(c["bit_exact"].values()) for c in cases.values()),
            "bit_exact_by_mesh": {mesh: c["bit_exact"] for mesh, c in cases.items()},
            "fsdp": cases["fsdp"],
            "hsdp": cases["hsdp"],
            "overhead": over,
            "setup": {
                "meshes": {
                    "fsdp": f"dp_shard={MESHES['fsdp'][1]} x pp={STAGES}",
                    "hsdp": f"dp_replicate={MESHES['hsdp'][0]} x dp_shard={MESHES['hsdp'][1]} x pp={STAGES}",
                },
                "model_args": model,
                "iterations": ITERS,
                "checkpoints": CKPTS,
                "failed_at_iteration": FAIL_IT,
                "iterations_replayed_or_redone": FAIL_IT - CKPT_BEFORE,
                "reps": a.reps,
                "process_start": "fork server with torch preloaded (every mode)",
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
            },
        }
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(out, indent=2, default=str))
        print(json.dumps({k: v for k, v in out.items() if k not in ("fsdp", "hsdp", "overhead")}, indent=2))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
