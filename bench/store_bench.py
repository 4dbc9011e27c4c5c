"""Log-store benchmark: one function per section, each returning a flat dict of numbers.

Run ``python bench/store_bench.py`` (all sections) or ``--only codec``. Results are printed as a
table and merged into ``bench/results/store.json``: keys of sections not run this time are kept,
``machine`` and ``timestamp`` describe the latest run.

Sections:
- codec: compression ratio and single-core throughput of :mod:`logstore.codec` on real
  activations/gradients (bench/_samples.py), next to plain zstd level 1 and a memcpy of the same
  bytes measured in the same rounds.
- hot: LogStore.put_blobs throughput over appending the same bytes to a plain file, same sync
  policy (durability "process" and "fsync").
- cold: sealed-segment upload over a raw s3fs put of the same file to the same moto server.
- lmdb: hot-tier disk bytes over live bytes under a rolling window with checkpoint-driven GC.

Throughputs are MB/s of raw tensor bytes (1 MB = 1e6 bytes) on one thread, medians over
interleaved rounds, from wall-clock time (``*_mbps_*``) and from the thread's CPU time
(``*_mbps_cpu_*``, robust to a shared machine); ratios are raw bytes / blob bytes (header
included).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # runnable as a plain script from a checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from bench._samples import real_samples  # noqa: E402
from logstore import codec  # noqa: E402

RESULTS = _ROOT / "bench" / "results" / "store.json"
_ROUNDS = 9


def _mbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e6


# Contenders timed in every round, per tensor, one after the other.
_CONTENDERS = ("codec_enc", "memcpy", "zstd1_enc", "codec_dec", "zstd1_dec")


def _codec_one(samples: list[torch.Tensor], tag: str) -> dict[str, Any]:
    raw = sum(x.numel() * x.element_size() for x in samples)
    blobs = [codec.encode_tensor(x) for x in samples]
    z1 = [codec.encode_tensor(x, codec="zstd", level=1) for x in samples]
    for x, b in zip(samples, blobs, strict=True):  # a benchmark of a wrong codec is worthless
        if not torch.equal(codec.decode_tensor(b).view(torch.uint8), x.view(torch.uint8)):
            raise AssertionError(f"codec roundtrip mismatch on {tag}")
    dsts = [torch.empty_like(x) for x in samples]
    jobs = [
        (
            lambda x=x: codec.encode_tensor(x),
            lambda x=x, d=d: d.copy_(x),
            lambda x=x: codec.encode_tensor(x, codec="zstd", level=1),
            lambda b=b: codec.decode_tensor(b),
            lambda zb=zb: codec.decode_tensor(zb),
        )
        for x, d, b, zb in zip(samples, dsts, blobs, z1, strict=True)
    ]
    # wall[c] / cpu[c]: per round, seconds spent by contender c on all samples. Interleaving per
    # tensor means machine noise hits every contender alike; thread CPU time is also kept since
    # it does not count time the thread was descheduled on a shared machine.
    wall: dict[str, list[float]] = {c: [] for c in _CONTENDERS}
    cpu: dict[str, list[float]] = {c: [] for c in _CONTENDERS}
    for _ in range(_ROUNDS):
        w = dict.fromkeys(_CONTENDERS, 0.0)
        u = dict.fromkeys(_CONTENDERS, 0.0)
        for fns in jobs:
            for c, fn in zip(_CONTENDERS, fns, strict=True):
                t0, c0 = time.perf_counter(), time.thread_time()
                fn()
                w[c] += time.perf_counter() - t0
                u[c] += time.thread_time() - c0
        for c in _CONTENDERS:
            wall[c].append(w[c])
            cpu[c].append(u[c])
    vs_memcpy = [m / e for e, m in zip(wall["codec_enc"], wall["memcpy"], strict=True)]
    vs_memcpy_cpu = [m / e for e, m in zip(cpu["codec_enc"], cpu["memcpy"], strict=True)]
    return {
        f"codec_ratio_{tag}": raw / sum(map(len, blobs)),
        f"zstd1_ratio_{tag}": raw / sum(map(len, z1)),
        f"codec_compress_mbps_{tag}": _mbps(raw, wall["codec_enc"]),
        f"codec_decompress_mbps_{tag}": _mbps(raw, wall["codec_dec"]),
        f"zstd1_compress_mbps_{tag}": _mbps(raw, wall["zstd1_enc"]),
        f"zstd1_decompress_mbps_{tag}": _mbps(raw, wall["zstd1_dec"]),
        f"memcpy_mbps_{tag}": _mbps(raw, wall["memcpy"]),
        # codec throughput / memcpy throughput of the same bytes, median of per-round ratios
        f"codec_compress_vs_memcpy_{tag}": statistics.median(vs_memcpy),
        f"codec_compress_mbps_cpu_{tag}": _mbps(raw, cpu["codec_enc"]),
        f"codec_decompress_mbps_cpu_{tag}": _mbps(raw, cpu["codec_dec"]),
        f"zstd1_compress_mbps_cpu_{tag}": _mbps(raw, cpu["zstd1_enc"]),
        f"memcpy_mbps_cpu_{tag}": _mbps(raw, cpu["memcpy"]),
        f"codec_compress_vs_memcpy_cpu_{tag}": statistics.median(vs_memcpy_cpu),
        f"sample_mb_{tag}": raw / 1e6,
        f"sample_tensors_{tag}": len(samples),
    }


def measure_codec() -> dict[str, Any]:
    """Codec ratio and single-core throughput on real bf16 and fp32 activations/gradients."""
    samples = {"bf16": real_samples(torch.bfloat16), "fp32": real_samples(torch.float32)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per-core numbers: the memcpy baseline must not fan out either
    try:
        out: dict[str, Any] = {}
        for tag, xs in samples.items():
            out.update(_codec_one(xs, tag))
    finally:
        torch.set_num_threads(threads)
    out["codec_entropy_coder"] = "huffman-only (zstd cffi)" if codec._use_huf else "zstd fast fallback"
    return out


def _encoded_records() -> list[bytes]:
    """Encoded real bf16 activations/gradients, cut to ~1 MiB records (a typical micro-batch send)."""
    blobs = []
    for x in real_samples(torch.bfloat16):
        flat = x.reshape(-1)
        for chunk in flat.split(512 * 1024):  # 1 MiB of bf16
            blobs.append(codec.encode_tensor(chunk.clone()))
    return blobs


def measure_hot() -> dict[str, Any]:
    """Hot-tier ingest (LogStore.put_encoded of records encoded beforehand, as the client's
    encoder threads do) over writing the same bytes to a
    plain file with the same sync policy, interleaved rounds, both durability modes."""
    import tempfile

    from logstore import Channel, Encoded, LogStore, RecordKey
    from logstore.segment import blob_checksum

    blobs = _encoded_records()[:96]
    # what LogStore.encode returns on the encoder threads; the writer thread then only does I/O
    raw_lens = [codec.read_header(b).raw_len for b in blobs]
    sums = [blob_checksum(b) for b in blobs]
    nbytes = sum(map(len, blobs))
    out: dict[str, Any] = {"hot_ingest_mb": nbytes / 1e6}
    for mode in ("process", "fsync"):
        store_s: list[float] = []
        file_s: list[float] = []
        with tempfile.TemporaryDirectory(dir=_ROOT / "bench") as d:
            s = LogStore.open(Path(d) / "node", "bench", writer="stage0", durability=mode, segment_iters=8)
            it = 0
            for _ in range(_ROUNDS):
                # the store: one batch (= one index transaction) per iteration of 8 micro-batches
                t0 = time.perf_counter()
                for i in range(0, len(blobs), 8):
                    s.put_encoded(
                        [
                            Encoded(RecordKey(Channel.activation(0), it, mb), b, raw_lens[i + mb], sums[i + mb])
                            for mb, b in enumerate(blobs[i : i + 8])
                        ]
                    )
                    it += 1
                t1 = time.perf_counter()
                # the baseline: the same bytes appended to one file, synced per batch in fsync mode
                fd = os.open(Path(d) / f"raw{it}.bin", os.O_WRONLY | os.O_CREAT, 0o644)
                for i in range(0, len(blobs), 8):
                    for b in blobs[i : i + 8]:
                        os.write(fd, b)
                    if mode == "fsync":
                        os.fdatasync(fd)
                os.close(fd)
                t2 = time.perf_counter()
                store_s.append(t1 - t0)
                file_s.append(t2 - t1)
                os.unlink(Path(d) / f"raw{it}.bin")
                s.register_checkpoint(1, it)
                s.gc()
            s.close()
        ratio = statistics.median(f / st for st, f in zip(store_s, file_s, strict=True))
        suffix = "" if mode == "process" else "_fsync"
        out[f"hot_ingest_vs_raw_file{suffix}"] = ratio
        out[f"hot_ingest_mbps{suffix}"] = _mbps(nbytes, store_s)
        out[f"raw_file_mbps{suffix}"] = _mbps(nbytes, file_s)
    return out


def measure_cold() -> dict[str, Any]:
    """Sealed-segment upload (ColdTier.put_segment: object + checksum + commit marker) over a raw
    s3fs put of the same file, to the same moto server on loopback, interleaved rounds."""
    import tempfile

    import fsspec

    from logstore import Channel, LogStore, RecordKey
    from logstore.cold import ColdTier
    from logstore.testing.s3servers import MotoServer

    blobs = _encoded_records()[:32]
    with MotoServer() as server, tempfile.TemporaryDirectory(dir=_ROOT / "bench") as d:
        s = LogStore.open(Path(d) / "node", "bench", writer="stage0", segment_iters=1, segment_max_bytes=1 << 30)
        s.put_blobs([(RecordKey(Channel.activation(0), 0, mb), b) for mb, b in enumerate(blobs)])
        s.flush()  # seals (no cold tier configured: nothing uploaded)
        seg = next(m for m in s.hot.segments())
        path = str(s.hot.seg_path(seg.id))
        size = os.path.getsize(path)
        tier = ColdTier(server.url("tiered"), storage_options=server.storage_options)
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **server.storage_options)
        seg_s: list[float] = []
        raw_s: list[float] = []
        for r in range(_ROUNDS):
            t0 = time.perf_counter()
            tier.put_segment(f"bench/r{r}.seg", path, meta={"round": r})
            t1 = time.perf_counter()
            fs.put_file(path, f"{server.bucket}/raw/r{r}.seg")
            t2 = time.perf_counter()
            seg_s.append(t1 - t0)
            raw_s.append(t2 - t1)
        tier.close()
        s.close()
    return {
        "cold_upload_vs_raw_put": statistics.median(rw / sg for sg, rw in zip(seg_s, raw_s, strict=True)),
        "cold_upload_mbps": _mbps(size, seg_s),
        "raw_s3fs_put_mbps": _mbps(size, raw_s),
        "cold_segment_mb": size / 1e6,
    }


def measure_lmdb() -> dict[str, Any]:
    """Disk used by the hot tier (LMDB files + segment files) over live record bytes under a rolling
    window: 300 iterations, checkpoint (and GC) every 20, records of real encoded activations."""
    import tempfile

    from logstore import Channel, LogStore, RecordKey

    blobs = _encoded_records()[:16]
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(dir=_ROOT / "bench") as d:
        s = LogStore.open(Path(d) / "node", "bench", writer="stage0", segment_iters=4)
        for it in range(300):
            s.put_blobs([(RecordKey(Channel.activation(0), it, mb), blobs[(it + mb) % len(blobs)]) for mb in range(4)])
            if it % 20 == 19:
                s.register_checkpoint(1, it + 1 - 20)  # the previous checkpoint interval stays live
                s.gc()
                if it >= 60:
                    st = s.stats()
                    ratios.append(st["hot"]["disk_bytes"] / st["hot"]["stored_bytes"])
        s.close()
    return {
        "lmdb_size_over_live": max(ratios),
        "lmdb_size_over_live_mean": statistics.fmean(ratios),
        "lmdb_window_iterations": 20,
    }


SECTIONS: dict[str, Callable[[], dict[str, Any]]] = {
    "codec": measure_codec,
    "hot": measure_hot,
    "cold": measure_cold,
    "lmdb": measure_lmdb,
}


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numpy
    import zstandard

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "zstandard": zstandard.__version__,
        "platform": platform.platform(),
    }


def _print_table(title: str, results: dict[str, Any]) -> None:
    rows = [(k, f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in results.items()]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"== {title}")
        for k, v in rows:
            print(f"  {k:36s} {v}")
        return
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)


def _merge(path: Path, results: dict[str, Any], sections: list[str]) -> None:
    data: dict[str, Any] = {}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            data = {}
    data.update(results)
    data["machine"] = _machine()
    data["timestamp"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    data.setdefault("section_timestamps", {}).update({s: data["timestamp"] for s in sections})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", choices=sorted(SECTIONS), help="run only this section (repeatable)")
    p.add_argument("--out", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    args = p.parse_args(argv)
    names = args.only or list(SECTIONS)
    merged: dict[str, Any] = {}
    for name in names:
        res = SECTIONS[name]()
        _print_table(name, res)
        merged.update(res)
    _merge(args.out, merged, names)
    print(f"results merged into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
