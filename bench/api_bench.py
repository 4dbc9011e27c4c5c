"""Admin API benchmark: summary and listing latency, record download throughput, with a writer running.

Setup (all real processes, loopback only):
- a run with 10,000 small records on one channel (act_0_1, 2500 iterations x 4 micro-batches,
  written and flushed by a writer process) plus, for the download test, 16 activation records of
  16 MiB (bf16 [16, 512, 1024]: one micro-batch of a mid-size model) and 32 of 1 MiB, in a node
  root with a file:// cold tier;
- ``swiftlog serve`` over that root (subprocess);
- a "training process": a writer process that keeps logging two more channels of the same run
  (32-64 KiB tensors, background upload to the cold tier on) during every measurement.

Measured:
- ``summary_p50_ms`` / ``summary_p99_ms``: GET /v1/runs/{run} (the server's summary cache: a few
  seconds stale at most, refreshed in the background); ``summary_uncached_ms`` is one full
  computation (``?fresh=true``) for reference;
- ``list_p99_ms``: GET /v1/runs/{run}/records, one page (the default 100 records) at a random
  position of the 10,000-record channel (cursor-based, as a client pages);
- ``download_vs_direct``: throughput of downloading the 16 MiB records one after the other through
  the raw endpoint (http.client on one keep-alive connection, checksum header verified, as a
  replay fetch would) over that of ``LogStore.get_blob`` on the same records in this process.
  Each round reads every record both ways, back to back, and the reported ratio is the median of
  the per-round ratios (the machine is shared and noisy: pairing cancels slow load swings).
  ``download_vs_direct_1mib`` is the same for 1 MiB records, where the fixed cost of a request
  (about 1.5 ms here) dominates; ``download_vs_direct_4_connections`` fetches the 16 MiB records
  over 4 connections at once (a replay prefetching ahead) against the same sequential direct read.
- ``download_vs_bare_asgi`` (target >= 0.8): rounds that fetch the 16 MiB records from the server
  and from a bare ASGI app (bench/_bare_asgi.py) that serves the same bytes from its memory and
  does nothing else, under the uvicorn configuration ``swiftlog serve`` ships
  (``server.serve.uvicorn_config``: the same HTTP protocol and limits), with the same client, one
  keep-alive connection each; record by record in turn, which of the two goes first alternating
  by round. The ratio is our verified download's rate over the bare app's in a round, the median
  over rounds; ``download_bare_round_mb_s`` and ``bare_asgi_mb_s`` are the two rates. The bare
  app is what HTTP over loopback from Python costs by itself here: the ceiling of any server on
  this stack (``download_ceiling_bare_asgi_vs_direct``, its rate over the direct read's).

Every client connection is kept alive, and reopened when the server closed it while it was idle
(uvicorn's keep-alive timeout: the main thread's connection idles through the large comparisons).

Writes bench/results/api.json. Run: ``python bench/api_bench.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import xxhash  # noqa: E402

from logstore import LogStore  # noqa: E402
from logstore.keys import Channel, RecordKey  # noqa: E402
from server.node import encode_cursor  # noqa: E402
from server.testing import TOKEN, ServerProcess, start_writer, stop_writer, subprocess_env  # noqa: E402

RUN = "bench"
SMALL = Channel.activation(0)  # 10,000 records
BIG = Channel.activation(1)  # download records, 16 MiB raw each
BIG_SHAPE = (16, 512, 1024)
MID = Channel.activation(2)  # download records, 1 MiB raw each
MID_SHAPE = (4, 256, 512)


def _write(
    root: Path, cold_url: str, writer: str, ch: Channel, iterations: int, mbs: int, shape: tuple[int, ...]
) -> None:
    cmd = [
        sys.executable,
        "-m",
        "server.testing",
        "write",
        "--root",
        str(root),
        "--run",
        RUN,
        "--stage",
        "0",
        "--stages",
        "1",
        "--writer",
        writer,
        "--channels",
        ch.name,
        "--iterations",
        str(iterations),
        "--micro-batches",
        str(mbs),
        "--shape",
        ",".join(map(str, shape)),
        "--cold-url",
        cold_url,
        "--flush",
        "--segment-iters",
        "4",
    ]
    subprocess.run(cmd, env=subprocess_env(), check=True, capture_output=True, text=True, timeout=900)


@contextlib.contextmanager
def _bare_server(root: Path, keys: list[RecordKey]) -> Iterator[int]:
    """bench/_bare_asgi.py serving the same records' bytes from memory; yields its port."""
    from logstore.hot import HotTier

    spec = []
    for k in keys:
        hot = HotTier(root / RUN / "stage1", owner=False)
        loc = hot.lookup(k)
        spec.append([str(hot.seg_path(loc.segment.id)), loc.offset, loc.length])
        hot.close()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "_bare_asgi.py"), str(port), f.name], env=subprocess_env()
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if p.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the bare ASGI server did not start") from None
                time.sleep(0.1)
        yield port
    finally:
        p.terminate()
        p.wait(30)
        os.unlink(f.name)


class KeepAliveConnection:
    """One client's keep-alive connection (http.client), reopened when the server closed it while it
    was idle, as real HTTP clients do: a GET on a reused connection that the server had closed is
    sent again, once, on a new one. A fresh connection that fails raises."""

    def __init__(self, host: str, port: int, timeout: float = 60.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._conn: http.client.HTTPConnection | None = None
        self.reopened = 0

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        """(status, lower-case headers, body) of ``GET path``."""
        reused = self._conn is not None
        try:
            return self._get(path)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            if not reused:
                raise
            self.reopened += 1
            return self._get(path)

    def _get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            self._conn.request("GET", path)
            r = self._conn.getresponse()
            body = r.read()
        except BaseException:
            self.close()  # a connection left mid-request cannot send another
            raise
        if r.will_close:
            self.close()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, body

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="requests per latency measurement")
    ap.add_argument("--rounds", type=int, default=9, help="paired download rounds")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "api.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="swiftlog-api-bench-") as tmp:
        base = Path(tmp)
        root, cold_url = base / "node", f"file://{base / 'cold'}"
        t0 = time.perf_counter()
        _write(root, cold_url, "stage0", SMALL, 2500, 4, (2, 8, 16))
        _write(root, cold_url, "stage1", BIG, 4, 4, BIG_SHAPE)
        _write(root, cold_url, "stage2", MID, 8, 4, MID_SHAPE)
        setup_s = time.perf_counter() - t0
        trainer = start_writer(
            root,
            RUN,
            writer="trainer",
            channels=[Channel.activation(3), Channel.gradient(3)],
            micro_batches=4,
            shape=(4, 64, 64),
            sleep=0.01,
            cold_url=cold_url,
            duration=3600,
        )
        try:
            with (
                ServerProcess(root, token=TOKEN, cold_url=cold_url) as srv,
                httpx.Client(base_url=srv.url, timeout=60) as c,
            ):
                time.sleep(3.0)  # the trainer is up and writing
                assert trainer.poll() is None, stop_writer(trainer)
                load_before = os.getloadavg()[0]
                result = _measure(c, root, cold_url, args)
                result["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
                result["writer_alive_throughout"] = trainer.poll() is None
        finally:
            err = stop_writer(trainer)
        written = len(LogStore.open(root, RUN).keys(Channel.activation(3)))
        if trainer.returncode not in (0, None):
            raise SystemExit(f"writer failed: {err[-2000:]}")
    result.update(
        {
            "writer_records_written": written,
            "setup_s": round(setup_s, 1),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def _measure(c: httpx.Client, root: Path, cold_url: str, args: argparse.Namespace) -> dict:
    # -- summary
    t = time.perf_counter()
    assert c.get(f"/v1/runs/{RUN}", params={"fresh": "true"}).status_code == 200
    uncached_ms = 1000 * (time.perf_counter() - t)
    lat = []
    for _ in range(args.requests):
        t = time.perf_counter()
        r = c.get(f"/v1/runs/{RUN}")
        lat.append(1000 * (time.perf_counter() - t))
        assert r.status_code == 200
    s = r.json()
    small_records = next(ch for ch in s["channels"] if ch["name"] == SMALL.name)["hot"]["records"]

    # -- listing: one page (default size) at random positions of the 10,000-record channel
    store = LogStore.open(root, RUN, cold_url=cold_url)
    keys = store.keys(SMALL)
    assert len(keys) == 10_000, len(keys)
    rng = random.Random(0)
    list_lat = []
    for i in range(args.requests):
        params = {"channel": SMALL.name}
        if i % 4:
            params["cursor"] = encode_cursor(keys[rng.randrange(len(keys) - 200)])
        t = time.perf_counter()
        r = c.get(f"/v1/runs/{RUN}/records", params=params)
        list_lat.append(1000 * (time.perf_counter() - t))
        assert r.status_code == 200 and len(r.json()["records"]) == 100
    whole_lat = []
    for _ in range(20):  # for reference: no channel filter (the whole run, key order)
        t = time.perf_counter()
        assert c.get(f"/v1/runs/{RUN}/records").status_code == 200
        whole_lat.append(1000 * (time.perf_counter() - t))

    # -- download vs direct, vs the bare app
    local = threading.local()
    connections: list[KeepAliveConnection] = []

    def connection(name: str, port: int) -> KeepAliveConnection:
        conn = getattr(local, name, None)
        if conn is None:
            conn = KeepAliveConnection("127.0.0.1", port)
            setattr(local, name, conn)
            connections.append(conn)
        return conn

    def download(k: RecordKey) -> int:
        status, headers, body = connection("conn", c.base_url.port).get(f"/v1/runs/{RUN}/records/{k}/raw")
        if status != 200 or headers.get("x-swiftlog-checksum") != f"{xxhash.xxh3_64_intdigest(body):016x}":
            raise SystemExit(f"bad download of {k}: {status}")
        return len(body)

    def bare_download(port: int, i: int) -> int:
        status, _, body = connection("bare", port).get(f"/{i}")
        if status != 200:
            raise SystemExit(f"bad download from the bare app: {status}")
        xxhash.xxh3_64_intdigest(body)  # the client's side of the work is the same
        return len(body)

    def compare(keys: list[RecordKey], rounds: int, parallel: int = 1) -> dict[str, float]:
        """Rounds of: every record read directly, then downloaded (over ``parallel`` connections at once)."""
        pool = ThreadPoolExecutor(parallel)
        nbytes = sum(len(store.get_blob(k)) for k in keys)  # also warms the page cache for both sides
        for k in keys[:2]:
            download(k)
        ratios, direct, http_ = [], [], []
        for _ in range(rounds):
            t = time.perf_counter()
            for k in keys:
                store.get_blob(k)
            td = time.perf_counter() - t
            t = time.perf_counter()
            got = sum(pool.map(download, keys)) if parallel > 1 else sum(map(download, keys))
            th = time.perf_counter() - t
            assert got == nbytes
            ratios.append(td / th)
            direct.append(nbytes / td / 1e6)
            http_.append(nbytes / th / 1e6)
        pool.shutdown()
        return {
            "vs_direct": statistics.median(ratios),
            "mb_s": statistics.median(http_),
            "direct_mb_s": statistics.median(direct),
            "record_bytes": nbytes // len(keys),
        }

    def compare_bare(keys: list[RecordKey], rounds: int, bare_port: int) -> dict[str, float]:
        """Rounds of: every record read directly, then downloaded from the server and from the bare app,
        record by record in turn (which goes first alternates by round), on one connection each."""
        nbytes = sum(len(store.get_blob(k)) for k in keys)
        for i, k in enumerate(keys[:2]):
            download(k)
            bare_download(bare_port, i)
        vs_bare, vs_direct, ours_mb, bare_mb = [], [], [], []
        for r in range(rounds):
            t = time.perf_counter()
            for k in keys:
                store.get_blob(k)
            td = time.perf_counter() - t
            took, got = [0.0, 0.0], [0, 0]  # ours, the bare app's
            for i, k in enumerate(keys):
                for which in (0, 1) if r % 2 == 0 else (1, 0):
                    t = time.perf_counter()
                    got[which] += download(k) if which == 0 else bare_download(bare_port, i)
                    took[which] += time.perf_counter() - t
            assert got == [nbytes, nbytes], got
            th, tb = took
            vs_bare.append(tb / th)
            vs_direct.append(td / tb)
            ours_mb.append(nbytes / th / 1e6)
            bare_mb.append(nbytes / tb / 1e6)
        return {
            "vs_bare": statistics.median(vs_bare),
            "ceiling": statistics.median(vs_direct),
            "mb_s": statistics.median(ours_mb),
            "bare_mb_s": statistics.median(bare_mb),
        }

    big = [RecordKey(BIG, it, mb) for it in range(4) for mb in range(4)]
    mid = [RecordKey(MID, it, mb) for it in range(8) for mb in range(4)]
    b = compare(big, args.rounds)
    with _bare_server(root, big) as bare_port:
        bb = compare_bare(big, args.rounds, bare_port)
    m = compare(mid, args.rounds)
    par = compare(big, args.rounds, parallel=4)
    store.close()
    reopened = sum(conn.reopened for conn in connections)
    for conn in connections:
        conn.close()
    return {
        "summary_p50_ms": round(_pct(lat, 50), 2),
        "summary_p99_ms": round(_pct(lat, 99), 2),
        "summary_uncached_ms": round(uncached_ms, 1),
        "list_p50_ms": round(_pct(list_lat, 50), 2),
        "list_p99_ms": round(_pct(list_lat, 99), 2),
        "list_page_size": 100,
        "list_run_records": small_records,
        "list_whole_run_first_page_p50_ms": round(_pct(whole_lat, 50), 2),
        "download_vs_bare_asgi": round(bb["vs_bare"], 3),
        "download_bare_round_mb_s": round(bb["mb_s"], 1),
        "bare_asgi_mb_s": round(bb["bare_mb_s"], 1),
        "download_vs_direct": round(b["vs_direct"], 3),
        "download_ceiling_bare_asgi_vs_direct": round(bb["ceiling"], 3),
        "download_mb_s": round(b["mb_s"], 1),
        "direct_mb_s": round(b["direct_mb_s"], 1),
        "download_records": len(big),
        "download_record_stored_bytes": b["record_bytes"],
        "download_record_raw_bytes": 16 * 512 * 1024 * 2,
        "download_vs_direct_1mib": round(m["vs_direct"], 3),
        "download_1mib_mb_s": round(m["mb_s"], 1),
        "direct_1mib_mb_s": round(m["direct_mb_s"], 1),
        "download_1mib_record_stored_bytes": m["record_bytes"],
        "download_vs_direct_4_connections": round(par["vs_direct"], 3),
        "download_4_connections_mb_s": round(par["mb_s"], 1),
        "connections_reopened": reopened,
        "requests_per_latency_measurement": args.requests,
    }


if __name__ == "__main__":
    main()
