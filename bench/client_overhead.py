"""Overhead of swiftlog's trainer client on pipeline training: iteration time with logging over without.

One 4-stage run of the example GPT (hidden 512 by default) on this machine, one process per stage
(``python -m trainer_client.examples.train_pipeline``, ``torch.set_num_threads(1)`` each), 1F1B,
commit step on. Logging is switched on and off in alternating blocks of iterations inside the
*same* run (``--alternate-logging``; default: every other iteration), so both configurations see
the same machine. An iteration's time is the slowest stage's (all stages meet at the commit step).

Why this method: on a shared 2-core machine the speed available to us flips between states
(e.g. 0.5 s and 0.95 s per iteration) for seconds at a time, which swamps a few-percent effect in
any comparison of two runs or of long blocks. Comparing each unlogged iteration with its two
logged neighbours cancels those flips. Background work of a logged iteration that is still
queued when it ends spills into the next (unlogged) iteration and biases the ratio down; the
spill is measured (``spill_fraction``: queued bytes at the end of a logged iteration / bytes
logged per iteration) and reported.

Reported in bench/results/client.json:
- overhead_ratio: median over unlogged iterations i of (mean time of logged iterations i-1 and
  i+1) / (time of i); overhead_ratio_medians: median logged / median unlogged over the run.
- bytes_per_iteration_raw / _stored: tensor bytes logged per iteration (all stages) and their
  encoded size.
- queue_peak_bytes: the largest writer queue any stage saw.
- enqueue_us_per_mb: training-thread time in the client's capture path per MB logged
  (references/copies and queueing of sends, inputs, targets and META, queueing the received
  buffers by reference and settling their digests at the next step), wall clock (perf_counter),
  and its parts; digests_settled_inline_fraction: the share of digests the training thread had to
  hash itself at settle time because the background had not reached them.
- copy_us_per_mb: time of a plain ``Tensor.clone()`` of every logged send, taken by the stage
  processes themselves right where the client enqueues it (``--probe-copy``; in logged
  iterations only, so it slightly inflates the logged iteration times: conservative), i.e. in the
  same process, moment and contention. copy_quiet_us_per_mb: the same copies timed in this
  process while the pipeline runs (a second opinion).
- background_cpu_s_per_iteration: CPU time of the background encode + write threads per logged
  iteration (all stages): the extra CPU load logging puts on the node (wall time in
  background_wall_s_per_iteration).
- overhead_ratio_ci95: a bootstrap 95 % interval of overhead_ratio (resampling the per-iteration
  ratios): how much of the result is machine noise.

Usage: python bench/client_overhead.py [--hidden 512] [--blocks 8] [--block 3] [--out bench/results/client.json]
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
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer_client.examples.launch import launch_pipeline, load_stage_result  # noqa: E402 (after the path set-up)


def copy_cost_us_per_mb(
    shape: tuple[int, ...], stop: threading.Event, period_s: float = 0.25, burst: int = 16
) -> float:
    """Mean time of ``t.clone()`` of float32 tensors of ``shape`` in microseconds per MB, sampled
    in bursts every ``period_s`` until ``stop`` is set (i.e. while the pipeline runs)."""
    torch.set_num_threads(1)
    src = [torch.randn(*shape) for _ in range(8)]  # several sources: not all cache-resident
    mb = src[0].numel() * 4 / 1e6
    keep: list[torch.Tensor] = []
    total = 0.0
    n = 0
    while not stop.wait(period_s) or n == 0:
        for i in range(burst):
            t0 = time.perf_counter()
            keep.append(src[i % len(src)].clone())  # kept alive like queued records
            total += time.perf_counter() - t0
            if len(keep) > 16:
                keep.pop(0)
        n += burst
    return total * 1e6 / mb / n


def _bootstrap_ci(values: list[float], n: int = 2000) -> list[float]:
    """95 % bootstrap interval of the median of ``values`` (fixed seed: reproducible)."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return [meds[int(0.025 * n)], meds[int(0.975 * n) - 1]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--n-microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    p.add_argument(
        "--block", type=int, default=1, help="iterations per on/off block (if > 1, the first of each is discarded)"
    )
    p.add_argument("--blocks", type=int, default=81, help="number of blocks, odd: logging on in blocks 0, 2, 4, ...")
    p.add_argument("--encode-threads", type=int, default=1)
    p.add_argument("--codec", default="auto")
    p.add_argument("--extra", default="", help="extra arguments for every stage (space-separated)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "client.json"))
    args = p.parse_args()

    work = tempfile.mkdtemp(prefix="swiftlog-bench-client-")
    iters = args.block * args.blocks
    common = [
        "--run-id",
        "bench",
        "--store-root",
        f"{work}/store",
        "--schedule",
        args.schedule,
        "--iters",
        str(iters),
        "--hidden",
        str(args.hidden),
        "--heads",
        str(args.heads),
        "--seq",
        str(args.seq),
        "--vocab",
        str(args.vocab),
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--n-microbatches",
        str(args.n_microbatches),
        "--layers",
        "1",
        "--alternate-logging",
        str(args.block),
        "--encode-threads",
        str(args.encode_threads),
        "--codec",
        args.codec,
        "--threads",
        "1",
        "--probe-copy",
        *args.extra.split(),
    ]
    t0 = time.time()
    box: dict[str, object] = {}
    runner = threading.Thread(
        target=lambda: box.update(
            res=launch_pipeline(common, num_stages=4, out_dir=f"{work}/out", timeout_s=1800, method="subprocess")
        )
    )
    runner.start()
    time.sleep(8.0)  # stage processes import torch and start; sample copies once they train
    stop = threading.Event()
    threading.Thread(target=lambda: (runner.join(), stop.set()), daemon=True).start()
    act_shape = (args.micro_batch_size, args.seq, args.hidden)
    copy_quiet_us = copy_cost_us_per_mb(act_shape, stop)
    runner.join()
    res = box["res"]
    if not res.ok:  # type: ignore[attr-defined]
        print(res.describe(), file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    stages = [load_stage_result(f"{work}/out", k) for k in range(4)]
    wall = time.time() - t0
    logged = stages[0]["logged"]
    per_it = [max(s["iter_s"][i] for s in stages) for i in range(iters)]
    skip = 1 if args.block > 1 else 0  # with blocks, the first iteration of each absorbs the switch
    first = args.block  # the first block warms up (allocations, first segments)
    on = [per_it[i] for i in range(first, iters) if logged[i] and i % args.block >= skip]
    off = [per_it[i] for i in range(first, iters) if not logged[i] and i % args.block >= skip]
    block_mean = [statistics.mean(per_it[b * args.block + skip : (b + 1) * args.block]) for b in range(args.blocks)]
    paired = [
        (block_mean[b - 1] + block_mean[b + 1]) / 2 / block_mean[b]
        for b in range(2, args.blocks - 1)
        if not logged[b * args.block] and logged[(b - 1) * args.block] and logged[(b + 1) * args.block]
    ]
    spill = [sum(s["queue_at_end"][i] for s in stages) for i in range(iters) if logged[i]]
    n_logged_iters = sum(logged)
    w = [s["stats"]["writer"] for s in stages]
    raw = sum(x["bytes_written"] for x in w)
    stored = sum(x["stored_bytes_written"] for x in w)
    submitted_mb = sum(x["bytes_submitted"] for x in w) / 1e6
    probe_mb = sum(s["copy_probe"]["bytes"] for s in stages) / 1e6
    copy_us = sum(s["copy_probe"]["s"] for s in stages) * 1e6 / probe_mb
    submit_s = sum(x["submit_s"] for x in w)
    digest_s = sum(x["digest_s"] for x in w)
    shutil.rmtree(work, ignore_errors=True)
    result = {
        "overhead_ratio": statistics.median(paired),
        "overhead_ratio_ci95": _bootstrap_ci(paired),
        "overhead_ratio_medians": statistics.median(on) / statistics.median(off),
        "overhead_ratio_per_block": paired,
        "spill_fraction": statistics.mean(spill) / (raw / max(1, sum(logged))) if raw else None,
        "iteration_s_logged_median": statistics.median(on),
        "iteration_s_unlogged_median": statistics.median(off),
        "iteration_s_logged": on,
        "iteration_s_unlogged": off,
        "bytes_per_iteration_raw": raw / n_logged_iters,
        "bytes_per_iteration_stored": stored / n_logged_iters,
        "compression_ratio": raw / stored if stored else None,
        "queue_peak_bytes": max(x["queue_peak_bytes"] for x in w),
        # first / last stage with a cold tier: commit waits for the iteration's inputs / targets there
        # (CommitConfig.ship_wait)
        "ship_wait_ms_per_logged_iteration": max(s["stats"]["commit"].get("ship_wait_s", 0.0) for s in stages)
        * 1e3
        / n_logged_iters,
        "enqueue_us_per_mb": (submit_s + digest_s) * 1e6 / submitted_mb,
        "enqueue_submit_us_per_mb": submit_s * 1e6 / submitted_mb,
        "enqueue_digest_us_per_mb": digest_s * 1e6 / submitted_mb,
        "digests_settled_inline_fraction": sum(x["digests_settled_inline"] for x in w)
        / max(1, sum(x["digests_submitted"] for x in w)),
        "copy_us_per_mb": copy_us,
        "copy_quiet_us_per_mb": copy_quiet_us,
        "enqueue_over_copy": (submit_s + digest_s) * 1e6 / submitted_mb / copy_us,
        "background_cpu_s_per_iteration": sum(x["encode_cpu_s"] + x["write_cpu_s"] for x in w) / n_logged_iters,
        "background_encode_cpu_s_per_iteration": sum(x["encode_cpu_s"] for x in w) / n_logged_iters,
        "background_write_cpu_s_per_iteration": sum(x["write_cpu_s"] for x in w) / n_logged_iters,
        "background_wall_s_per_iteration": sum(x["encode_s"] + x["write_s"] for x in w) / n_logged_iters,
        "faults": sum(x["faults"] for x in w),
        "records_dropped": sum(x["records_dropped"] for x in w),
        "overflow_waits": sum(x["overflow_waits"] for x in w),
        "config": {
            "stages": 4,
            "schedule": args.schedule,
            "hidden": args.hidden,
            "heads": args.heads,
            "seq": args.seq,
            "vocab": args.vocab,
            "micro_batch_size": args.micro_batch_size,
            "n_microbatches": args.n_microbatches,
            "iterations": iters,
            "block": args.block,
            "encode_threads": args.encode_threads,
            "codec": args.codec,
            "threads_per_stage": 1,
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "wall_s": wall,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
