"""Replay benchmark: how fast a lost stage is rebuilt, sequentially and over K = 2, 4 and 8 workers.

One real 4-stage pipeline run (GPipe, one process per stage, gloo, ``--threads 1`` per stage, the
example GPT with dropout, sized so that compute dominates: hidden 256, 2 blocks per stage, 8
micro-batches of 4 x 64 tokens) logs everything and checkpoints at iteration ``--ckpt``; then,
in the same process and side by side, ``--rounds`` rounds of

- a sequential replay of stage ``--stage`` over the ``--iters`` logged iterations (prefetching),
- a parallel replay with K = 2 workers, exact (ordered) gradient reduction, dynamic shares (the
  workers claim the middle micro-batches of each iteration as they go: the default),
- the same with fixed shares (split up front from the speeds measured in earlier iterations),
- the same (dynamic shares) with the chain's running sums sent over gloo instead of formed in
  shared memory (``shared_memory=False``),
- a parallel replay with K = 2 workers, approximate (all-reduce) reduction,
- parallel replays with K = 4 and K = 8 workers, exact reduction, dynamic shares (``PARALLEL_KS``),

interleaved so that machine noise hits all of them alike. The machine is shared with other work:
each measurement waits for a quiet moment (see below). Before the rounds, one short sequential and
one short parallel replay warm both paths up (first-use costs of the process and the worker fork
server stay out of the rounds). The live pipeline runs
``--live-runs`` times and the fastest run is the one replayed and compared. Replay times are the
replay proper (first replayed iteration to last optimizer step, slowest worker; loading the
checkpoint and starting workers excluded); ``*_end_to_end`` include them.

Every parallel worker is one process with one torch thread, as in the live run.
A K of ``PARALLEL_KS`` above 2 runs only where this process may use at least K cores.
Elsewhere it would oversubscribe the cores and measure the scheduler, not the replay.
Its keys then hold the string "not measured: ..." with the reason.

Results (merged into ``bench/results/replay.json``):

- ``replay_vs_live``: sequential replay time of the N lost iterations of one stage over the time
  the live pipeline took for the same N iterations (that stage's step times, same run). Target
  <= 0.5. Caveat: the live run has 4 stage processes on this machine's cores (see
  ``live_processes_per_core``), so the live time is inflated by sharing cores; on one device per
  stage the live step is about (n + S - 1) / n micro-batch slots of one stage, so expect
  ``replay_vs_live`` near n / (n + S - 1) (= 8 / 11 here) when compute dominates.
- ``parallel_speedup_k2``: sequential replay time over the K = 2 exact parallel replay time
  (target >= 1.6; two workers on two cores, one torch thread each, as the live run used), as the
  median over the rounds of each round's ratio (the two replays of a round run back to back, so
  they share the machine's state of the moment; the median drops a disturbed round whichever
  side it hit). ``parallel_speedup_k2_per_round`` lists the ratios;
  ``parallel_speedup_k2_best_of`` is the fastest sequential replay over the fastest parallel one,
  which favours the single-core variant on a shared machine (it needs one quiet core, the parallel
  one two at once); ``parallel_speedup_k2_median`` the median times' ratio.
  ``parallel_speedup_k2_approximate`` the same as the headline for the approximate reduction,
  ``parallel_speedup_k2_fixed_share`` for the exact one with fixed shares,
  ``parallel_speedup_k2_gloo_chain`` for the exact one whose running sums travel over gloo
  (``k2_chain``: how the headline's travelled).
- ``parallel_speedup_k2_cpu``: the same from CPU time (sequential replay's process CPU seconds over
  the busier worker's): what the wall-clock speedup would be with a core per worker. The machine is
  shared: before each measurement the benchmark waits (up to ``--max-wait-s``) until other
  processes keep at most ``--quiet-cores`` cores busy; ``other_processes_cores_busy`` records the
  last 0.5 s sample before each measurement, which is what separates the two speedups.
- ``two_busy_cores_slowdown`` / ``parallel_speedup_k2_ceiling``: calibration of this machine. The
  same sequential replay runs alone, then twice at once in two processes that share nothing;
  the slower of the two over the lone one is how much two busy cores slow each other down, and
  2 / that is the most any K = 2 replay could gain here before exchanging a single gradient;
  ``parallel_speedup_k2_of_ceiling`` is the headline speedup over that ceiling (the rounds and
  the calibration run minutes apart, so it is an estimate of how much the exchange costs).
- ``parallel_speedup_k4`` / ``parallel_speedup_k8``: the headline's statistic for K = 4 and K = 8.
  Each is the median over the rounds of the round's sequential time over its K-worker time.
  Where the cores are missing, the value is a "not measured: ..." string.
- ``parallel_efficiency``: each K's speedup over K, keyed by K as a string ("1" to "8").
  K = 1 is 1.0 by definition; K = 2 uses ``parallel_speedup_k2``; an unmeasured K is "not measured".
- ``parallel_ks_measured``: the worker counts measured on this machine.
- ``machine``: ``cpus`` (``os.cpu_count()``), ``usable_cpus`` (this process's affinity mask),
  ``platform`` and ``processor``, so that scaling results from different machines can be told apart.
- ``parallel_max_abs_diff``: largest parameter difference between the approximate K = 2 replay
  and the sequential one (the exact ones, every K, are compared bytewise: ``parallel_exact_bit_identical``).
- ``bit_exact``: the sequential replay's parameters, AdamW state and scheduler equal the live
  run's final state byte for byte (and ``verified``: every regenerated send matched its digest).

Run ``python bench/replay_bench.py`` (about 2-4 minutes on 2 shared cores).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # runnable as a plain script from a checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from bench._interleaved import replay_case  # noqa: E402

RESULTS = _ROOT / "bench" / "results" / "replay.json"
NOTES = [
    (
        "headline speedups are medians over rounds of each round's ratio "
        "(sequential and parallel replay run back to back); "
        "_best_of variants divide the fastest times, _median the median times"
    ),
    (
        "two cores shared with other users: see other_processes_cores_busy; parallel replay needs both cores at once, "
        "so any other work stalls one worker and, through the per-iteration gradient exchange, both"
    ),
    (
        "replay_vs_live compares against 4 live stage processes sharing 2 cores; "
        "with one device per stage the live step is about (n+S-1)/n micro-batch slots, "
        "so replay_vs_live would be near ideal_replay_vs_live_one_device_per_stage (0.73) for one worker"
    ),
]
NUM_STAGES = 4
EXACT_KINDS = ("k2_exact", "k2_fixed", "k2_gloo")  # the parallel replays that must equal the sequential one bit for bit
PARALLEL_KS = (1, 2, 4, 8)  # worker counts of the scaling keys (exact reduction, dynamic shares; K = 1: sequential)
SEED = 1234
MODEL = {
    "vocab": 256,
    "hidden": 256,
    "heads": 4,
    "layers": 2,
    "seq": 64,
    "micro_batch_size": 4,
    "n_microbatches": 8,
    "dropout": 0.1,
}


def _state_equal(
    model_a: dict, opt_a: dict | None, model_b: dict, opt_b: dict | None, sched_a: Any = None, sched_b: Any = None
) -> bool:
    """Bit for bit, by the one comparison the tests use (:func:`replay.compare.states_equal`)."""
    from replay.compare import states_equal

    a = {"model": model_a, "optimizer": opt_a, "lr_scheduler": sched_a}
    return states_equal(a, {"model": model_b, "optimizer": opt_b, "lr_scheduler": sched_b}) == []


def _cpu_jiffies() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    try:
        f = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = f[3] + (f[4] if len(f) > 4 else 0.0)
    return (sum(f) - idle) / hz, sum(f) / hz


def _other_load(window_s: float = 0.5) -> float | None:
    """Cores other processes keep busy, sampled over ``window_s`` while this benchmark is idle."""
    a = _cpu_jiffies()
    time.sleep(window_s)
    b = _cpu_jiffies()
    return None if a is None or b is None else (b[0] - a[0]) / window_s


def _wait_quiet(threshold: float, max_wait_s: float) -> float | None:
    """Wait (at most ``max_wait_s``) until other processes keep at most ``threshold`` cores busy;
    returns the last sample (the machine is shared: measurements are only comparable when quiet)."""
    deadline = time.monotonic() + max_wait_s
    while True:
        busy = _other_load()
        if busy is None or busy <= threshold or time.monotonic() > deadline:
            return busy
        time.sleep(1.0)


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def _kind(k: int) -> str:
    """The name of the exact, dynamic-share replay with ``k`` workers (``k`` = 1: the sequential one)."""
    return "seq" if k == 1 else f"k{k}_exact"


def _usable_cpus() -> int:
    """The cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _unmeasured(k: int, cores: int) -> str | None:
    """Why ``k`` workers are not measured on ``cores`` usable cores; None when they are.

    K = 1 and K = 2 always are (the K = 2 variants are the headline). A larger K needs a core per worker.
    """
    if k <= 2 or k <= cores:
        return None
    return f"not measured: {cores} cores"  # K workers on fewer cores would measure the scheduler


def _scaling(times: dict[str, list[float]], cores: int) -> dict[str, Any]:
    """The scaling keys, from each kind's replay seconds per round (see the module docstring)."""
    speedup: dict[int, float | str] = {}
    for k in PARALLEL_KS:
        why = _unmeasured(k, cores)
        if why is not None:
            speedup[k] = why
        else:
            speedup[k] = statistics.median(s / t for s, t in zip(times["seq"], times[_kind(k)], strict=True))
    out: dict[str, Any] = {f"parallel_speedup_k{k}": v for k, v in speedup.items() if k > 2}
    out["parallel_efficiency"] = {str(k): "not measured" if isinstance(v, str) else v / k for k, v in speedup.items()}
    out["parallel_ks_measured"] = [k for k, v in speedup.items() if not isinstance(v, str)]
    return out


def _replay_seconds(job_doc: dict[str, Any]) -> float:
    from replay import replay
    from replay.job import ReplayJob

    return replay(ReplayJob.from_dict(job_doc)).replay_seconds


def _two_at_once(job: Any) -> tuple[float, float]:
    """The replay proper of ``job`` in two processes started together (fork server: torch preloaded)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(2, mp_context=ctx) as pool:
        list(pool.map(_noop, range(2)))  # both workers up before the clock starts
        a, b = pool.map(_replay_seconds, [job.to_dict()] * 2)
    return a, b


def _noop(_: int) -> None:
    return None


def live_run(base: Path, ckpt: int, iters: int) -> tuple[dict[int, dict[str, Any]], float]:
    """The live pipeline; returns (every stage's result file, wall seconds)."""
    from trainer_client.examples.launch import launch_pipeline, load_stage_result

    root, cold, out = base / "store", base / "cold", base / "out"
    args = [
        "--run-id",
        "bench",
        "--store-root",
        str(root),
        "--cold-url",
        f"file://{cold}",
        "--schedule",
        "gpipe",
        "--iters",
        str(ckpt + iters),
        "--ckpt-at",
        str(ckpt),
        "--seed",
        str(SEED),
        "--threads",
        "1",
        "--segment-iters",
        "4",
        "--vocab",
        str(MODEL["vocab"]),
        "--hidden",
        str(MODEL["hidden"]),
        "--heads",
        str(MODEL["heads"]),
        "--layers",
        str(MODEL["layers"]),
        "--seq",
        str(MODEL["seq"]),
        "--micro-batch-size",
        str(MODEL["micro_batch_size"]),
        "--n-microbatches",
        str(MODEL["n_microbatches"]),
        "--dropout",
        str(MODEL["dropout"]),
    ]
    res = launch_pipeline(args, num_stages=NUM_STAGES, out_dir=str(out), timeout_s=900, method="forkserver")
    if not res.ok:
        raise SystemExit("live run failed:\n" + res.describe())
    return {k: load_stage_result(str(out), k) for k in range(NUM_STAGES)}, res.wall_s


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from logstore import LogStore
    from replay import jobs_from_plan, plan_recovery, replay
    from replay.states import checkpoint_of

    stage, ckpt, iters = args.stage, args.ckpt, args.iters
    cores = _usable_cpus()
    # K > 2 of PARALLEL_KS: the same as k2_exact, measured only where each worker has a core
    scaling = {_kind(k): k for k in PARALLEL_KS if k > 2 and _unmeasured(k, cores) is None}
    for k in PARALLEL_KS:
        if (why := _unmeasured(k, cores)) is not None:
            print(f"K={k}: {why}", flush=True)
    exact_kinds = EXACT_KINDS + tuple(scaling)
    load_before = _loadavg()
    live_other: float | None = None
    with tempfile.TemporaryDirectory(prefix="swiftlog-replay-bench-") as d:
        base = Path(d)
        # the live pipeline, --live-runs times; the least disturbed run (shortest N iterations) is the one replayed
        lives = []
        for i in range(args.live_runs):
            other = _wait_quiet(args.quiet_cores, args.max_wait_s)
            print(
                f"live run {i}: 4 stages, {ckpt + iters} iterations, checkpoint at {ckpt} "
                f"(others busy: {other} cores) ...",
                flush=True,
            )
            results, wall = live_run(base / f"live{i}", ckpt, iters)
            secs = float(sum(results[stage]["iter_s"][ckpt : ckpt + iters]))
            print(f"  stage {stage}: {secs:.3f} s for iterations [{ckpt}, {ckpt + iters})", flush=True)
            lives.append((secs, i, results, wall, other))
        live_s, best, results, live_wall, live_other = min(lives, key=lambda x: x[0])
        live = results[stage]
        run_dir = base / f"live{best}"
        store = LogStore.open(run_dir / "store", "bench", cold_url=f"file://{run_dir / 'cold'}")
        plan = plan_recovery(store, [stage])
        assert plan.possible and plan.units[0].stop_iteration == ckpt + iters, plan.reasons
        model_args = {
            "vocab": MODEL["vocab"],
            "hidden": MODEL["hidden"],
            "heads": MODEL["heads"],
            "layers_per_stage": MODEL["layers"],
            "seq": MODEL["seq"],
            "micro_batch_size": MODEL["micro_batch_size"],
            "n_microbatches": MODEL["n_microbatches"],
            "dropout": MODEL["dropout"],
        }
        (job,) = jobs_from_plan(
            plan, sources=[store], model="trainer_client.examples.factories:gpt_stage", model_args=model_args
        )  # prefetch: the default
        kinds = {
            "seq": job.replace(workers=1),
            "k2_exact": job.replace(workers=2, exact=True),
            "k2_fixed": job.replace(workers=2, exact=True, dynamic_share_min_s=None),
            "k2_gloo": job.replace(workers=2, exact=True, shared_memory=False),
            "k2_approx": job.replace(workers=2, exact=False),
        }
        # each worker takes the live thread count from META (--threads 1), as in k2_exact; one process per worker
        kinds |= {name: job.replace(workers=k, exact=True) for name, k in scaling.items()}
        chains: dict[str, str | None] = {}  # how each exact kind's running sums travelled
        times: dict[str, list[float]] = {k: [] for k in kinds}
        e2e: dict[str, list[float]] = {k: [] for k in kinds}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}  # slowest worker's CPU seconds during the replay
        others: dict[str, list[float]] = {k: [] for k in kinds}  # cores kept busy by other processes meanwhile
        states: dict[str, Any] = {}
        splits: dict[int, list[list[int]]] = {}  # round -> micro-batches per worker in each iteration (dynamic shares)
        verified: dict[str, bool] = {}
        # warm-up: start the worker fork server (imports torch once) outside the measurements
        first_only = plan.units[0].checkpoint_iteration + 1
        replay(kinds["k2_exact"].replace(stop_iteration=first_only, output=str(base / "warm")))
        replay(
            kinds["seq"].replace(stop_iteration=first_only, output=str(base / "warm-seq"))
        )  # and this process's own first use
        for r in range(args.rounds):
            for name, jb in kinds.items():
                out = base / f"out-{name}-{r}"
                busy = _wait_quiet(args.quiet_cores, args.max_wait_s)
                if busy is not None:
                    others[name].append(busy)
                res = replay(jb.replace(output=str(out)))
                times[name].append(res.replay_seconds)
                e2e[name].append(res.seconds)
                cpu[name].append(max(res.cpu_seconds))
                ck = checkpoint_of(res, stage)
                states[name] = ck
                verified[name] = res.verified
                chains[name] = res.chain
                if name == "k2_exact":
                    splits[r] = [res.split[k] for k in sorted(res.split)]
                print(
                    f"round {r} {name:10s} replay {res.replay_seconds:7.3f} s  cpu {max(res.cpu_seconds):7.3f} s  "
                    f"end-to-end {res.seconds:7.3f} s  "
                    f"other load {others[name][-1] if others[name] else float('nan'):4.2f} cores  "
                    f"verified={res.verified}",
                    flush=True,
                )
        # calibration: the same sequential replay, alone and then two at once in two processes
        # (no exchange, no shared state): how much two busy cores slow each other down here
        pairs = []
        for _ in range(args.pair_rounds):
            _wait_quiet(args.quiet_cores, args.max_wait_s)
            alone = replay(kinds["seq"]).replay_seconds
            _wait_quiet(args.quiet_cores, args.max_wait_s)
            both = _two_at_once(kinds["seq"])
            pairs.append((alone, both))
            print(
                f"calibration: sequential replay alone {alone:7.3f} s, two at once {both[0]:7.3f} / {both[1]:7.3f} s",
                flush=True,
            )
        store.close()
    seq, ap = states["seq"], states["k2_approx"]
    bit_exact = _state_equal(
        seq.model, seq.optimizer, live["model"], live["optimizer"], seq.lr_scheduler, live["lr_scheduler"]
    )
    max_diff = max(float((ap.model[k] - seq.model[k]).abs().max()) for k in seq.model)
    # each round's ratio, then the median over rounds (see the module docstring); best-of and median-of-times alongside
    per_round = {
        k: [s / t for s, t in zip(times["seq"], times[k], strict=True)]
        for k in ("k2_exact", "k2_fixed", "k2_gloo", "k2_approx")
    }
    ceiling = statistics.median(2 * a / max(b) for a, b in pairs) if pairs else None
    best_t = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = lambda d: statistics.median(s / t for s, t in zip(d["seq"], d["k2_exact"], strict=True))  # noqa: E731
    n = MODEL["n_microbatches"]
    config = {
        "stage": stage,
        "checkpoint": ckpt,
        "iterations": iters,
        "rounds": args.rounds,
        "live_runs": args.live_runs,
        "schedule": "gpipe",
        "threads_per_process": 1,
        "parallel_ks": list(PARALLEL_KS),
        "statistic": "speedups: median over rounds of the per-round ratio; replay_vs_live: best of rounds",
    }
    config |= {"model": MODEL, "num_stages": NUM_STAGES}
    return {
        "replay_vs_live": best_t["seq"] / live_s,
        "parallel_speedup_k2": statistics.median(per_round["k2_exact"]),
        "parallel_speedup_k2_per_round": per_round["k2_exact"],
        "parallel_speedup_k2_best_of": best_t["seq"] / best_t["k2_exact"],
        "parallel_speedup_k2_median": med["seq"] / med["k2_exact"],
        "parallel_speedup_k2_approximate": statistics.median(per_round["k2_approx"]),
        "parallel_speedup_k2_fixed_share": statistics.median(per_round["k2_fixed"]),
        "parallel_speedup_k2_fixed_share_per_round": per_round["k2_fixed"],
        "parallel_speedup_k2_gloo_chain": statistics.median(per_round["k2_gloo"]),
        "parallel_speedup_k2_gloo_chain_per_round": per_round["k2_gloo"],
        "k2_chain": chains["k2_exact"],
        "k2_dynamic_share_splits_per_round": [splits[r] for r in sorted(splits)],
        "parallel_speedup_k2_end_to_end": paired(e2e),
        "parallel_speedup_k2_cpu": paired(cpu),
        **_scaling(times, cores),
        "parallel_max_abs_diff": max_diff,
        "two_busy_cores_slowdown": statistics.median(max(b) / a for a, b in pairs) if pairs else None,
        "parallel_speedup_k2_ceiling": ceiling,
        "parallel_speedup_k2_of_ceiling": statistics.median(per_round["k2_exact"]) / ceiling if ceiling else None,
        "calibration_alone_vs_two_at_once_seconds": [[a, list(b)] for a, b in pairs],
        "parallel_exact_bit_identical": all(
            _state_equal(states[k].model, states[k].optimizer, seq.model, seq.optimizer) for k in exact_kinds
        ),
        "bit_exact": bool(bit_exact),
        "verified": verified["seq"] and all(verified[k] for k in exact_kinds),
        "approximate_verified": verified["k2_approx"],
        "live_seconds": live_s,
        "live_seconds_all_runs": [x[0] for x in lives],
        "live_wall_seconds_whole_run": live_wall,
        "live_processes_per_core": NUM_STAGES / (os.cpu_count() or 1),
        "live_other_processes_cores_busy": live_other,
        "replay_seconds": times,
        "replay_end_to_end_seconds": e2e,
        "replay_cpu_seconds": cpu,
        "other_processes_cores_busy": others,
        "ideal_replay_vs_live_one_device_per_stage": n / (n + NUM_STAGES - 1),
        "config": config,
        "replay_seconds_median": med,
        "notes": NOTES,
        "load_average_before": load_before,
        "load_average_after": _loadavg(),
    }


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cpus": os.cpu_count(),
        "usable_cpus": _usable_cpus(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=1, help="the stage that is lost and replayed")
    p.add_argument("--ckpt", type=int, default=1, help="checkpoint iteration (the first iteration is a warm-up)")
    p.add_argument("--iters", type=int, default=8, help="iterations lost after the checkpoint (N)")
    p.add_argument(
        "--rounds", type=int, default=9, help="interleaved measurement rounds (the headline is their median ratio)"
    )
    p.add_argument("--live-runs", type=int, default=2, help="live pipeline runs (the fastest is replayed and compared)")
    p.add_argument(
        "--pair-rounds", type=int, default=3, help="calibration rounds: one sequential replay alone, then two at once"
    )
    p.add_argument(
        "--quiet-cores",
        type=float,
        default=0.3,
        help="before each measurement wait until others use at most this many cores",
    )
    p.add_argument("--max-wait-s", type=float, default=120.0, help="longest wait for a quiet machine per measurement")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--interleaved-rounds", type=int, default=3, help="rounds of the interleaved case")
    p.add_argument("--only", choices=["gpt", "interleaved"], default=None, help="run one case (default: both)")
    args = p.parse_args(argv)
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    res = bench(args) if args.only != "interleaved" else {k: v for k, v in old.items() if k != "interleaved"}
    if args.only != "gpt":
        res["interleaved"] = replay_case(args.interleaved_rounds)
        shown = {k: v for k, v in res["interleaved"].items() if k not in ("config", "replay_seconds")}
        print(json.dumps(shown, indent=2), flush=True)
    else:
        res["interleaved"] = old.get("interleaved")
    if args.only == "interleaved":
        args.out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
        return 0
    res["machine"] = _machine()
    res["timestamp"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    for k in (
        "replay_vs_live",
        "parallel_speedup_k2",
        "parallel_speedup_k2_best_of",
        "parallel_speedup_k2_ceiling",
        "parallel_speedup_k2_of_ceiling",
        "parallel_speedup_k2_cpu",
        "parallel_speedup_k2_approximate",
        "parallel_speedup_k2_end_to_end",
        "parallel_speedup_k4",
        "parallel_speedup_k8",
        "parallel_efficiency",
        "parallel_ks_measured",
        "parallel_max_abs_diff",
        "parallel_exact_bit_identical",
        "bit_exact",
        "verified",
        "live_seconds",
    ):
        print(f"  {k:36s} {res[k]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, args.out)
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
