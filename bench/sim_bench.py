"""Simulator benchmark: calibrated on a measured job, checked on another, then run at scale.

1. The commit store's request rate: a TCPStore on loopback served to 4 client threads for 2 s
   (``store_requests_per_s``, an input of the commit step's cost at scale).
2. Calibration and prediction (real runs, ``replay.launcher``): the example GPT as a 4-stage 1F1B
   pipeline on this machine, 40 iterations, stage 1 SIGKILLed mid-forward. Configuration A
   checkpoints every 10 iterations and is killed in iteration 27; configuration B checkpoints
   every 20 and is killed in iteration 37. Each runs once with SWIFT recovery (replay) and once
   with global rollback, and A once without a failure.
   - From the failure-free run: the iteration time and a checkpoint's stall.
   - From A: the replay's speed (its measured replay over the iterations it replayed), what a
     replacement costs besides the replay, and what a job restart costs besides the lost work.
   - The simulator, fed these figures and B's checkpoint interval and failure (a trace), predicts
     B's training time (first process start to the last iteration's end; the start-up
     measured on the failure-free run) for each strategy; the error is against B's
     measured time (target 25 %). ``*_waste_error`` compares what the failure cost (kill to the
     killed iteration applied, less what was left of that iteration), a much smaller figure: a
     stricter check.
3. At scale (``replay.sim`` with the measured inputs): the Llama-3-405B-like layout (TP8 x PP16 x
   FSDP128, 16,384 GPUs) and the same with two replicas (FSDP64 x DDP2), every strategy, and a
   sweep of job sizes (1k to 32k GPUs) with a plot.
4. The paper's setting as far as its abstract describes it: SWIFT's total training time against
   an in-memory checkpointing baseline (CheckFreq-like) on a small cluster with replicas, across
   failure rates; the abstract reports "up to 1.16x".

Writes bench/results/sim.json and sim.png. ``python bench/sim_bench.py [--quick]`` (--quick: a
smaller model and fewer simulated runs, for a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replay.launcher import KillSpec, resumed_after_rollback, run_with_failures
from replay.sim import (
    LLAMA3_405B,
    REPLICATED_405B,
    STRATEGIES,
    Layout,
    flips,
    make_plan,
    measured_inputs,
    sweep,
    wasted_series,
)
from replay.sim.engine import run_once
from trainer_client.commit import loopback_store

RESULTS = Path(__file__).resolve().parent / "results" / "sim.json"
ITERS, LOST_STAGE = 40, 1
CONFIGS = {"A": {"every": 10, "kill": 27}, "B": {"every": 20, "kill": 37}}
MODEL = ["--hidden", "512", "--heads", "8", "--layers", "1", "--seq", "64", "--n-microbatches", "4", "--vocab", "4096"]
QUICK = ["--hidden", "64", "--layers", "1", "--seq", "16", "--n-microbatches", "4"]
SIZES = [1024, 2048, 4096, 8192, 16384, 32768]
BY_NAME = {s.name: s for s in STRATEGIES}


def store_rate(seconds: float = 2.0, threads: int = 4) -> float:
    """Requests per second one TCPStore serves to ``threads`` clients on loopback."""
    server = loopback_store()
    count = [0] * threads
    stop = time.monotonic() + seconds

    def client(i: int) -> None:
        from torch.distributed import TCPStore

        c = TCPStore("127.0.0.1", server.port, is_master=False)
        while time.monotonic() < stop:
            c.add(f"k{i}", 1)
            count[i] += 1

    ts = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(count) / (time.monotonic() - t0)


def _run(base: Path, model: list[str], every: int, kill: int | None, mode: str) -> Any:
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    ckpts = ",".join(str(i) for i in range(every, ITERS, every))
    args = ["--schedule", "1f1b", "--iters", str(ITERS), "--ckpt-at", ckpts, "--seed", "7", "--data-source"]
    args += ["--segment-iters", "2", "--cold-url", f"file://{base / 'cold'}", *model]
    r = run_with_failures(
        args,
        run_id="sim",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        kills=[KillSpec(LOST_STAGE, kill, 1, "forward")] if kill is not None else [],
        mode=mode,
        timeout_s=900,
    )
    if not r.ok:
        raise SystemExit(f"{base.name} failed:\n{r.describe()}")
    return r


def _span(run: Any) -> float:
    """Seconds from the first stage's start to the end of the last iteration (slowest stage).
    A rolled-back run's processes are new, so the launcher's first start is the one clock
    every run has; the start-up before iteration 0 is the same in every run."""
    first = min(e["t"] for e in run.timeline if e["what"] == "start")
    last = max(t for r in run.results.values() for it, t, _ in r["iteration_end"] if it == ITERS - 1)
    return last - first


def _startup(run: Any) -> float:
    """A failure-free run's seconds from the first start to the end of iteration 0."""
    first = min(e["t"] for e in run.timeline if e["what"] == "start")
    end0 = max(t for r in run.results.values() for it, t, _ in r["iteration_end"] if it == 0)
    return end0 - first


def _durations(run: Any) -> dict[int, float]:
    """Iteration -> seconds it took (stage 0's stamps, one generation)."""
    ends = sorted((it, t) for it, t, g in run.results[0]["iteration_end"] if g == 0)
    return {it: t - prev for (_, prev), (it, t) in zip(ends, ends[1:], strict=False)}


def _calibrated(it_s: float, stall: float, ratio: float, restart: float, replace: float) -> Any:
    """The simulator's inputs for the measured pipeline (4 stages, 4 micro-batches, one per node)."""
    m = 4
    return measured_inputs().with_(
        params=1.0,
        iteration_s=it_s,
        n_microbatches=m,
        work_s=ITERS * it_s,
        failures_per_node_hour=0.0,
        detect_s=0.0,
        restart_job_s=restart,
        replace_node_s=replace,
        ckpt_sync_s=stall,
        snapshot_bps=1e18,
        ckpt_read_bps=1e18,
        ckpt_write_bps=1e18,
        net_bps=1e18,
        logging_overhead=1.0,  # every run here logs: the overhead is in the iteration time
        replay_efficiency=(m / (m + 3)) / ratio,
        replay_workers=1,
        store_requests_per_s=1e12,
    )


def _calibrate(work: Path, model: list[str]) -> dict[str, Any]:
    A, B = CONFIGS["A"], CONFIGS["B"]
    runs = {
        "free_A": _run(work / "free", model, A["every"], None, "swift"),
        "swift_A": _run(work / "sa", model, A["every"], A["kill"], "swift"),
        "rollback_A": _run(work / "ra", model, A["every"], A["kill"], "rollback"),
        "swift_B": _run(work / "sb", model, B["every"], B["kill"], "swift"),
        "rollback_B": _run(work / "rb", model, B["every"], B["kill"], "rollback"),
    }
    spans = {k: _span(r) for k, r in runs.items()}
    d = _durations(runs["free_A"])
    ckpt_its = set(range(A["every"], ITERS, A["every"]))  # a save starts its iteration: that step carries it
    it_s = statistics.median(v for k, v in d.items() if k not in ckpt_its)
    startup = _startup(runs["free_A"]) - it_s  # before the first iteration: every run pays it
    stall = max(0.0, statistics.median(v for k, v in d.items() if k in ckpt_its) - it_s)
    # what a failure cost: kill -> every stage applied the killed iteration, less the 3/4 of an
    # iteration that was left of it (killed in micro-batch 1 of 4's forward)
    cost = {
        k: resumed_after_rollback(r, CONFIGS[k[-1]]["kill"] + 1) - 0.75 * it_s
        for k, r in runs.items()
        if k[-1] in "AB" and "free" not in k
    }
    lost_a = A["kill"] - A["every"] * (A["kill"] // A["every"])
    replay_s = runs["swift_A"].timings[0]["replay_s"]
    ratio = replay_s / (lost_a * it_s)
    replace = max(0.0, cost["swift_A"] - replay_s - 0.25 * it_s)
    restart = max(0.0, cost["rollback_A"] - (lost_a + 0.25) * it_s)
    layout = Layout(tp=1, pp=4, dp_shard=1, dp_replicate=1, gpus_per_node=1)
    x = _calibrated(it_s, stall, ratio, restart, replace)

    def predict(name: str, cfg: dict[str, int]) -> tuple[float, float]:
        """(training time, what the failure added) of ``name`` under ``cfg``."""
        plan = make_plan(BY_NAME[name], layout, x, persistent_s=cfg["every"] * it_s)
        hit = run_once(plan, random.Random(0), trace=[((cfg["kill"] + 0.25) * it_s, LOST_STAGE)])
        free = run_once(plan, random.Random(0), trace=[])
        return startup + hit.total_s, hit.total_s - free.total_s

    out: dict[str, Any] = {
        "iteration_s": it_s,
        "startup_s": startup,
        "checkpoint_stall_s": stall,
        "replay_vs_live_iteration": ratio,
        "replace_s": replace,
        "restart_s": restart,
        "measured_span_s": spans,
        "measured_failure_cost_s": cost,
    }
    for strategy, key in (("logging", "swift"), ("global_rollback", "rollback")):
        for cfg_name in ("A", "B"):
            pred, pred_cost = predict(strategy, CONFIGS[cfg_name])
            meas, meas_cost = spans[f"{key}_{cfg_name}"], cost[f"{key}_{cfg_name}"]
            out[f"{key}_{cfg_name}_predicted_s"] = pred
            out[f"{key}_{cfg_name}_error"] = abs(pred - meas) / meas
            out[f"{key}_{cfg_name}_predicted_failure_cost_s"] = pred_cost
            out[f"{key}_{cfg_name}_waste_error"] = abs(pred_cost - meas_cost) / meas_cost
    out["prediction_error_B"] = max(out["swift_B_error"], out["rollback_B_error"])
    out["waste_prediction_error_B"] = max(out["swift_B_waste_error"], out["rollback_B_waste_error"])
    return out


def _paper(reps: int) -> dict[str, Any]:
    """SWIFT against in-memory checkpointing on 16 GPUs (PP8 x DDP2, one GPU per node), by MTBF."""
    layout = Layout(tp=1, pp=8, dp_shard=1, dp_replicate=2, gpus_per_node=1)
    x = measured_inputs().with_(
        params=1.3e9,
        iteration_s=1.0,
        n_microbatches=8,
        activation_bytes=1024 * 2048 * 2.0,
        restart_job_s=60.0,
        replace_node_s=20.0,
        detect_s=10.0,
        ckpt_sync_s=1.0,
        work_s=24 * 3600.0,
        correlated_fraction=0.0,
    )
    rows = []
    # snapshot copies: pinned on a side stream as measured, or pageable at PCIe 3 rates (2023's V100 hosts)
    for snapshot in (x.snapshot_bps, 3e9):
        for mtbf_h in (0.5, 1.0, 2.0, 4.0, 8.0):
            xi = x.with_(failures_per_node_hour=1.0 / (mtbf_h * layout.nodes), snapshot_bps=snapshot)
            res = sweep(layout, xi, [layout.gpus], ["in_memory", "replica", "logging", "combined"], reps=reps)
            by = {r.strategy: r.total_s for r in res[layout.gpus].rows}
            best = min(("replica", "logging", "combined"), key=lambda n: by[n])
            rows.append(
                {
                    "job_mtbf_h": mtbf_h,
                    "snapshot_gbps": snapshot / 1e9,
                    "swift_best": best,
                    "speedup_over_in_memory": by["in_memory"] / by[best],
                }
            )
    return {
        "layout": layout.describe(),
        "by_mtbf": rows,
        "max_speedup": max(r["speedup_over_in_memory"] for r in rows),
        "abstract": "up to 1.16x over CheckFreq / Elastic Horovod in total training time",
    }


def _headline(res: Any) -> dict[str, Any]:
    by = {r.strategy: r.wasted_fraction for r in res.rows}
    return {
        "best_16k_no_replica": res.best.strategy,
        "wasted_16k_no_replica_best": by[res.best.strategy],
        "wasted_16k_no_replica_global_rollback": by["global_rollback"],
    }


def _plot(runs: dict[str, dict[int, Any]], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, (title, by_size) in zip(axes, runs.items(), strict=True):
        for n, (xs, ys) in wasted_series(by_size).items():
            ax.plot(xs, [y * 100 for y in ys], marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("wasted % of training time")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    root = RESULTS.parents[2]
    return str(path.resolve().relative_to(root)) if path.resolve().is_relative_to(root) else str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller model, fewer simulated runs (smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the results go")
    a = p.parse_args(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    reps = 4 if a.quick else 20
    rate = store_rate()
    print(f"store: {rate:.0f} requests/s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="swiftlog-sim-bench-"))
    try:
        calib = _calibrate(work, QUICK if a.quick else MODEL)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(calib, indent=2), flush=True)
    x = measured_inputs().with_(store_requests_per_s=rate)
    x = dataclasses.replace(x, sources={**x.sources, "store_requests_per_s": "measured here: one TCPStore, 4 clients"})
    sweeps = {
        "TP8 x PP16 x FSDP (no replica)": sweep(LLAMA3_405B, x, SIZES, reps=reps),
        "TP8 x PP16 x FSDP x DDP2": sweep(REPLICATED_405B, x, SIZES, reps=reps),
    }
    at = {name: by[16384].to_dict() for name, by in sweeps.items()}
    paper = _paper(reps)
    table = {
        name: {str(n): {r.strategy: r.wasted_fraction for r in res.rows} for n, res in by.items()}
        for name, by in sweeps.items()
    }
    out = {
        "store_requests_per_s": rate,
        "calibration": calib,
        "prediction_error": calib["prediction_error_B"],
        "waste_prediction_error": calib["waste_prediction_error_B"],
        **_headline(sweeps["TP8 x PP16 x FSDP (no replica)"][16384]),
        "at_16k": at,
        "wasted_by_size": table,
        "flips_16k_no_replica": flips(LLAMA3_405B, x),
        "flips_16k_replicas": flips(REPLICATED_405B, x),
        "paper_setting": paper,
        "paper_max_speedup": paper["max_speedup"],
        "plot": _plot(sweeps, a.out.with_suffix(".png")),
        "setup": {
            "calibration": "4-stage 1F1B example GPT on this machine; A: checkpoint every 10, kill at 27; "
            "B: every 20, kill at 37; 40 iterations",
            "model_args": QUICK if a.quick else MODEL,
            "reps": reps,
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
        },
    }
    a.out.write_text(json.dumps(out, indent=2, default=str))
    for name, rows in table.items():
        print(name)
        for n, by in rows.items():
            print(f"  {n:>6}", "  ".join(f"{k} {v:.2%}" for k, v in sorted(by.items(), key=lambda t: t[1])))
    print(json.dumps({k: out[k] for k in ("store_requests_per_s", "prediction_error", "plot")}, indent=2))
    print(json.dumps(out["paper_setting"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
