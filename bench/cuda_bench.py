"""Capture on a GPU: what logging a pipeline stage's sends costs the training loop on CUDA.

Needs a CUDA device (exits with a message otherwise). One process, one GPU, one *middle*
pipeline stage of a GPT-style model simulated in place: per micro-batch it receives an
activation (a device buffer refilled from a fixed tensor, standing in for the p2p receive),
runs ``--layers`` transformer layers (bf16, dropout on, seeded per micro-batch), sends its
output, receives a gradient, runs the backward and sends the input gradient; then the
optimizer steps. Everything a pipeline stage logs is logged through the client's explicit API
(``log_send`` for both sends, ``log_received`` for both receives' digests): per micro-batch two
device-to-host copies that are compressed and stored, and two that are only hashed.

Configurations, each in the same process on the same model, measured side by side:
- ``off``: logging switched off (``client.set_logging(False)``): the reference.
- ``async-N``: swiftlog's client with N encode threads: pinned copies on a side stream, encoding
  and writing on background threads.
- ``sync-copy``: what a naive logger does: ``t.cpu()`` of every send and receive on the
  training thread (no compression, no I/O: a lower bound of that approach's cost).
Iterations alternate between ``off`` and one other configuration in rounds (``off, X, off, X``)
so that both see the same GPU clocks; ratio = median(X) / median(off) of the iteration times
(``torch.cuda.synchronize()`` at each iteration's end).

Also reported per configuration: the training thread's time inside the capture calls per MB
captured, the log rate the stage produces (GB/s of tensors captured while logging), the stored
bytes, encode CPU seconds per GB, overflow waits (the queue bound was hit and the training
thread waited for the writer: the writer did not keep up), and the pinned memory held. The
store lives under ``--dir`` (default: /dev/shm when it has room, so the disk's speed is not
what is measured; the path is reported).

Writes bench/results/cuda.json. Usage: python bench/cuda_bench.py [--layers 8] [--hidden 4096]
[--seq 2048] [--micro-batch 2] [--n-mb 8] [--rounds 3] [--threads 1,4,8]
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
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer_client import ClientConfig, SwiftlogClient, WriterConfig, seed_micro_batch  # noqa: E402

GB = 1e9
DEVICE = "cuda"  # --device cpu: a dry run of the script's logic on a machine without a GPU (tiny sizes)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [
        torch.nn.TransformerEncoderLayer(
            args.hidden,
            args.hidden // 128,
            4 * args.hidden,
            dropout=0.1,
            batch_first=True,
            norm_first=True,
            device=DEVICE,
            dtype=torch.bfloat16,
        )
        for _ in range(args.layers)
    ]
    return torch.nn.Sequential(*layers).train()


class Stage:
    """One middle stage (1 of 3) with its receive buffers and optimizer."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = _model(args)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=DEVICE == "cuda")
        shape = (args.micro_batch, args.seq, args.hidden)
        g = torch.Generator(device=DEVICE).manual_seed(1)
        self.acts = [torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, generator=g) for _ in range(2)]
        self.grads = [torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, generator=g) * 1e-3 for _ in range(2)]
        self.recv_act = torch.empty(shape, device=DEVICE, dtype=torch.bfloat16)
        self.recv_grad = torch.empty(shape, device=DEVICE, dtype=torch.bfloat16)
        self.mb_bytes = 4 * self.recv_act.numel() * self.recv_act.element_size()  # captured per micro-batch

    def iteration(self, it: int, mode: str, client: SwiftlogClient | None) -> tuple[float, float]:
        """Run one iteration; returns (wall seconds, training-thread seconds inside capture calls)."""
        _sync()
        t0 = time.perf_counter()
        cap = 0.0
        host: list[torch.Tensor] = []

        def capture(t: torch.Tensor, log: Any) -> None:
            """What the configuration does with a send or a receive, timed on the training thread."""
            nonlocal cap
            c0 = time.perf_counter()
            if mode == "sync-copy":
                host.append(t.detach().cpu())
                del host[:-8]
            elif client is not None:
                log()
            cap += time.perf_counter() - c0

        for mb in range(self.args.n_mb):
            self.recv_act.copy_(self.acts[mb % 2])  # the receive
            x = self.recv_act.detach().requires_grad_()
            capture(x, lambda x=x, mb=mb: client.log_received(x, 0, it, mb))
            seed_micro_batch(1, 1, it, mb)  # every configuration seeds, as the client always does
            out = self.model(x)
            capture(out, lambda out=out, mb=mb: client.log_send(out, 2, "activation", it, mb))
            self.recv_grad.copy_(self.grads[mb % 2])
            capture(self.recv_grad, lambda mb=mb: client.log_received(self.recv_grad, 2, it, mb))
            out.backward(self.recv_grad)
            capture(x.grad, lambda x=x, mb=mb: client.log_send(x.grad, 0, "gradient", it, mb))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        _sync()
        return time.perf_counter() - t0, cap


def _store_dir(arg: str | None, need: int) -> str:
    if arg:
        return arg
    try:
        if shutil.disk_usage("/dev/shm").free > 2 * need:
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


def run_config(stage: Stage, mode: str, threads: int, args: argparse.Namespace, base_dir: str, it0: int) -> dict:
    root = tempfile.mkdtemp(prefix="swiftlog-cuda-", dir=base_dir)
    client = None
    if mode.startswith("async"):
        client = SwiftlogClient(
            ClientConfig(
                run_id="cudabench",
                stage=1,
                num_stages=3,
                store_root=root,
                seed=1,
                writer=WriterConfig(encode_threads=threads, max_queue_bytes=args.queue_mib << 20),
            )
        )
    off: list[float] = []
    on: list[float] = []
    cap_on: list[float] = []
    clean = [stage.iteration(it0 + i, "off", None)[0] for i in range(2)]  # no writer backlog at all
    it = it0 + 2
    try:
        for _ in range(args.rounds):
            for logged in (False, True, False, True):
                if client is not None:
                    client.set_logging(logged)
                wall, cap = stage.iteration(it, mode if logged else "off", client if logged else None)
                (on if logged else off).append(wall)
                if logged:
                    cap_on.append(cap)
                it += 1
        t_drain = time.perf_counter()
        st = None
        if client is not None:
            assert client.close().ok
            st = client.writer.stats()
        drain_s = time.perf_counter() - t_drain
    finally:
        shutil.rmtree(root, ignore_errors=True)
    captured = stage.mb_bytes * args.n_mb * len(on)
    row = {
        "mode": mode,
        "encode_threads": threads if client is not None else None,
        "iteration_s_off": statistics.median(off),
        "iteration_s_on": statistics.median(on),
        "ratio": statistics.median(on) / statistics.median(off),
        "ratio_vs_clean": statistics.median(on) / min(clean),
        "capture_us_per_mb": 1e6 * sum(cap_on) / (captured / 1e6),
        "log_rate_gbps": stage.mb_bytes * args.n_mb / statistics.median(on) / GB,
        "close_drain_s": drain_s,
    }
    if st is not None:
        row.update(
            {
                "stored_over_raw": st.stored_bytes_written / max(1, st.bytes_written),
                "encode_cpu_s_per_gb": st.encode_cpu_s / max(1e-9, st.bytes_written / GB),
                "overflow_waits": st.overflow_waits,
                "overflow_wait_s": st.overflow_wait_s,
                "queue_peak_mib": st.queue_peak_bytes / 2**20,
                "pinned_mib": st.pinned_bytes / 2**20,
                "faults": st.faults,
                "submit_max_ms": 1e3 * st.submit_max_s,
            }
        )
    return row


def copy_rates(shape: tuple[int, ...]) -> dict:
    """Device-to-host GB/s: pinned non-blocking on a side stream vs pageable ``.cpu()``."""
    t = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    pinned = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
    side = torch.cuda.Stream()
    n = 10
    for _ in range(2):
        t.cpu()
        pinned.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        t.cpu()
    pageable = n * t.numel() * 2 / (time.perf_counter() - t0) / GB
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(side):
        for _ in range(n):
            pinned.copy_(t, non_blocking=True)
    side.synchronize()
    pinned_rate = n * t.numel() * 2 / (time.perf_counter() - t0) / GB
    return {"d2h_pinned_gbps": pinned_rate, "d2h_pageable_gbps": pageable}


def headline(rows: list[dict], threads: int) -> dict:
    """The table's figures: the overhead with ``threads`` encode threads (what the client's default
    chooses for a GPU stage on a node with 4 or more cores per GPU; the closest measured count if
    that one was not run), with one thread, and of the naive logger."""
    asyncs = [r for r in rows if r["mode"].startswith("async")]
    pick = min(asyncs, key=lambda r: (abs(r["encode_threads"] - threads), r["encode_threads"]))
    one = next((r for r in asyncs if r["encode_threads"] == 1), None)
    return {
        "overhead_ratio": pick["ratio"],
        "overhead_ratio_vs_clean": pick["ratio_vs_clean"],
        "overhead_ratio_encode_threads": pick["encode_threads"],
        "overhead_ratio_one_encode_thread": None if one is None else one["ratio"],
        "sync_copy_ratio": next(r["ratio"] for r in rows if r["mode"] == "sync-copy"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--n-mb", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,4,8", help="encode-thread counts to try (comma-separated)")
    ap.add_argument(
        "--headline-threads", type=int, default=4, help="encode threads whose row is the headline overhead_ratio"
    )
    ap.add_argument("--queue-mib", type=int, default=256, help="the client's max_queue_bytes in MiB (its default)")
    ap.add_argument("--dir", default=None, help="where the log store goes (default /dev/shm if it has room)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cuda.json"))
    ap.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of this script (use tiny sizes)"
    )
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("cuda_bench: no CUDA device here; this benchmark needs one (nothing written)")
    stage = Stage(args)
    per_iter = stage.mb_bytes * args.n_mb
    base_dir = _store_dir(args.dir, per_iter * 2 * args.rounds)
    for i in range(3):  # warm-up: kernels, allocator, cuBLAS handles
        stage.iteration(i, "off", None)
    rows = []
    it = 10
    modes = [("sync-copy", 0)] + [(f"async-{n}", n) for n in (int(x) for x in args.threads.split(","))]
    for mode, n in modes:
        rows.append(run_config(stage, mode, n, args, base_dir, it))
        it += 4 * args.rounds + 2
    doc = {
        "bench": "cuda",
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "host": platform.node(),
        "store_dir": base_dir,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "dir")},
        "captured_mib_per_micro_batch": stage.mb_bytes / 2**20,
        **(
            copy_rates(tuple(stage.recv_act.shape))
            if DEVICE == "cuda"
            else {"d2h_pinned_gbps": None, "d2h_pageable_gbps": None}
        ),
        "rows": rows,
    }
    doc.update(headline(rows, args.headline_threads))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(
        f"\n{doc['device']}, torch {doc['torch']}, {doc['cpu_count']} CPUs; store in {base_dir}; "
        f"{doc['captured_mib_per_micro_batch']:.1f} MiB captured per micro-batch"
    )
    if doc["d2h_pinned_gbps"] is not None:
        print(
            f"D2H: pinned side stream {doc['d2h_pinned_gbps']:.1f} GB/s, "
            f"pageable .cpu() {doc['d2h_pageable_gbps']:.1f} GB/s\n"
        )
    head = (
        f"| {'mode':10} | {'iter off s':>10} | {'iter on s':>9} | {'ratio':>6} | {'capture us/MB':>13} "
        f"| {'log GB/s':>8} | {'waits':>5} | {'stored/raw':>10} | {'enc cpu s/GB':>12} |"
    )
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        print(
            f"| {r['mode']:10} | {r['iteration_s_off']:10.3f} | {r['iteration_s_on']:9.3f} | {r['ratio']:6.3f} "
            f"| {r['capture_us_per_mb']:13.1f} | {r['log_rate_gbps']:8.2f} | {r.get('overflow_waits', '-')!s:>5} "
            f"| {r.get('stored_over_raw', float('nan')):10.3f} | "
            f"{r.get('encode_cpu_s_per_gb', float('nan')):12.2f} |"
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
