"""Overhead of swiftlog's trainer client on pipeline training: iteration time with logging over without.

One 4-stage run of the example GPT (hidden 512 by default) on this machine, one process per stage
(``python -m trainer_client.examples.train_pipeline``, ``torch.set_num_threads(1)`` each), 1F1B,
commit step on. Logging is switched on and off in alternating blocks of iterations inside the
*same* run (``--alternate-logging``), so both configurations see the same machine noise; the
first iteration of every block is discarded (it absorbs the previous block's background work and
the switch). An iteration's time is the slowest stage's (all stages meet at the commit step).

Reported in bench/results/client.json:
- overhead_ratio: median iteration time with logging / median without.
- bytes_per_iteration_raw / _stored: tensor bytes logged per iteration (all stages) and their
  encoded size.
- queue_peak_bytes: the largest writer queue any stage saw.
- enqueue_us_per_mb: training-thread time in the client's capture hooks per MB logged
  (references/copies + queueing + hashing received buffers), and its parts.
- copy_us_per_mb: a plain ``Tensor.clone()`` of tensors of the same shapes, single thread, for
  comparison.
- background_cpu_s_per_iteration: encode + write time of the background threads per logged
  iteration (all stages): the extra CPU load logging puts on the node.

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
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer_client.examples.launch import launch_pipeline, load_stage_result  # noqa: E402


def copy_cost_us_per_mb(shape: tuple[int, ...], repeats: int = 200) -> float:
    """Median time of ``t.clone()`` for a float32 tensor of ``shape``, in microseconds per MB."""
    torch.set_num_threads(1)
    t = torch.randn(*shape)
    mb = t.numel() * 4 / 1e6
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        t.clone()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6 / mb


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--n-microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    p.add_argument("--block", type=int, default=3, help="iterations per on/off block")
    p.add_argument("--blocks", type=int, default=8, help="number of blocks (half with logging)")
    p.add_argument("--encode-threads", type=int, default=1)
    p.add_argument("--codec", default="auto")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "client.json"))
    args = p.parse_args()

    work = tempfile.mkdtemp(prefix="swiftlog-bench-client-")
    iters = args.block * args.blocks
    common = [
        "--run-id", "bench", "--store-root", f"{work}/store", "--schedule", args.schedule, "--iters", str(iters),
        "--hidden", str(args.hidden), "--heads", str(args.heads), "--seq", str(args.seq), "--vocab", str(args.vocab),
        "--micro-batch-size", str(args.micro_batch_size), "--n-microbatches", str(args.n_microbatches), "--layers", "1",
        "--alternate-logging", str(args.block), "--encode-threads", str(args.encode_threads), "--codec", args.codec,
        "--threads", "1",
    ]  # fmt: skip
    t0 = time.time()
    try:
        res = launch_pipeline(common, num_stages=4, out_dir=f"{work}/out", timeout_s=1800, method="subprocess")
        if not res.ok:
            print(res.describe(), file=sys.stderr)
            return 1
        stages = [load_stage_result(f"{work}/out", k) for k in range(4)]
    finally:
        pass
    wall = time.time() - t0
    logged = stages[0]["logged"]
    per_it = [max(s["iter_s"][i] for s in stages) for i in range(iters)]
    on = [per_it[i] for i in range(iters) if logged[i] and i % args.block != 0]
    off = [per_it[i] for i in range(iters) if not logged[i] and i % args.block != 0]
    n_logged_iters = sum(logged)
    w = [s["stats"]["writer"] for s in stages]
    raw = sum(x["bytes_written"] for x in w)
    stored = sum(x["stored_bytes_written"] for x in w)
    submitted_mb = sum(x["bytes_submitted"] for x in w) / 1e6
    submit_s = sum(x["submit_s"] for x in w)
    digest_s = sum(x["digest_s"] for x in w)
    act_shape = (args.micro_batch_size, args.seq, args.hidden)
    copy_us = copy_cost_us_per_mb(act_shape)
    shutil.rmtree(work, ignore_errors=True)
    result = {
        "overhead_ratio": statistics.median(on) / statistics.median(off),
        "iteration_s_logged_median": statistics.median(on),
        "iteration_s_unlogged_median": statistics.median(off),
        "iteration_s_logged": on,
        "iteration_s_unlogged": off,
        "bytes_per_iteration_raw": raw / n_logged_iters,
        "bytes_per_iteration_stored": stored / n_logged_iters,
        "compression_ratio": raw / stored if stored else None,
        "queue_peak_bytes": max(x["queue_peak_bytes"] for x in w),
        "enqueue_us_per_mb": (submit_s + digest_s) * 1e6 / submitted_mb,
        "enqueue_submit_us_per_mb": submit_s * 1e6 / submitted_mb,
        "enqueue_digest_us_per_mb": digest_s * 1e6 / submitted_mb,
        "copy_us_per_mb": copy_us,
        "enqueue_over_copy": (submit_s + digest_s) * 1e6 / submitted_mb / copy_us,
        "background_cpu_s_per_iteration": sum(x["encode_s"] + x["write_s"] for x in w) / n_logged_iters,
        "faults": sum(x["faults"] for x in w),
        "records_dropped": sum(x["records_dropped"] for x in w),
        "overflow_waits": sum(x["overflow_waits"] for x in w),
        "config": {
            "stages": 4, "schedule": args.schedule, "hidden": args.hidden, "heads": args.heads, "seq": args.seq,
            "vocab": args.vocab, "micro_batch_size": args.micro_batch_size, "n_microbatches": args.n_microbatches,
            "iterations": iters, "block": args.block, "encode_threads": args.encode_threads, "codec": args.codec,
            "threads_per_stage": 1,
        },  # fmt: skip
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
