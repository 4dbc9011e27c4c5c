"""Test tooling for the admin server and CLI: real writer processes and a real uvicorn server.

- :func:`write_run` starts one OS process per pipeline stage; process ``k`` opens the node's
  store as writer ``stage{k}`` and logs what stage k sends (activations forward, gradients
  backward, stage-0 inputs, last-stage targets, digests, per-iteration meta), as a training run
  would. The tensors are deterministic (:func:`sample_tensor`), so a test can check every byte.
- :func:`start_writer` starts one such process that keeps writing until stopped (a "training
  process" running next to the server).
- :class:`ServerProcess` runs ``swiftlog serve`` in a subprocess on a free loopback port.

Nothing in the server imports this module; tests, benchmarks and ``python -m server.testing``
do.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import torch

from logstore.keys import Channel, Kind, RecordKey
from logstore.testing import free_port

__all__ = [
    "sample_tensor",
    "stage_channels",
    "write_run",
    "start_writer",
    "stop_writer",
    "ServerProcess",
    "subprocess_env",
    "StoreFixture",
    "TOKEN",
    "REPO_ROOT",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-token-0123456789abcdef"  # the token test servers are started with


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child Python process that must import this repository's packages."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def sample_tensor(ch: Channel, iteration: int, micro_batch: int, shape: Sequence[int] = (2, 8, 16)) -> torch.Tensor:
    """The deterministic tensor the test writers log for (channel, iteration, micro-batch)."""
    seed = ((int(ch.kind) * 65536 + ch.src) * 65536 + ch.dst) * 1_000_003 + iteration * 1009 + micro_batch
    g = torch.Generator().manual_seed(seed)
    if ch.kind in (Kind.INPUT, Kind.TARGET):
        return torch.randint(0, 50_000, tuple(shape[:2]), generator=g, dtype=torch.int64)
    if ch.kind is Kind.META:
        return torch.tensor([float(iteration), float(micro_batch), 0.5], dtype=torch.float64)
    if ch.kind is Kind.DIGEST:
        return torch.randint(0, 2**31, (4,), generator=g, dtype=torch.int64)
    t = torch.randn(tuple(shape), generator=g)
    return t.to(torch.bfloat16) if ch.kind is Kind.ACTIVATION else t


def stage_channels(stage: int, stages: int) -> list[Channel]:
    """What stage ``stage`` of ``stages`` sends (and so logs on its node)."""
    out: list[Channel] = []
    if stage == 0:
        out.append(Channel.input(0))
    if stage < stages - 1:
        out += [Channel.activation(stage), Channel.digest(stage, stage + 1)]
    if stage > 0:
        out += [Channel.gradient(stage), Channel.digest(stage, stage - 1)]
    if stage == stages - 1:
        out.append(Channel.target(stage))
    out.append(Channel.meta(stage))
    return out


_STOP = threading.Event()  # set by SIGINT / SIGTERM in a writer process (main)


def _write_stage(args: argparse.Namespace) -> None:
    """Body of one writer process (see :func:`write_run`)."""
    from logstore import LogStore, StoreConfig

    torch.set_num_threads(1)
    # a stage that does not flush never uploads: its sealed segments stay behind however the
    # uploader thread's pace compares with the writes (what a server flush picks up)
    cfg: dict[str, Any] = {"segment_iters": args.segment_iters, "upload": args.flush or args.hot_max_bytes is not None}
    if args.hot_max_bytes is not None:
        cfg["hot_max_bytes"] = args.hot_max_bytes
    store = LogStore(
        StoreConfig(
            root=args.root, run=args.run, writer=args.writer or f"stage{args.stage}", cold_url=args.cold_url, **cfg
        )
    )
    chans = (
        stage_channels(args.stage, args.stages)
        if not args.channels
        else [Channel.parse(c) for c in args.channels.split(",")]
    )
    shape = tuple(int(x) for x in args.shape.split(","))
    deadline = time.monotonic() + args.duration if args.duration else None
    it = args.start
    try:
        while True:
            if deadline is None and it >= args.start + args.iterations:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            items = []
            for ch in chans:
                mbs = 1 if ch.kind is Kind.META else args.micro_batches
                items += [(RecordKey(ch, it, mb), sample_tensor(ch, it, mb, shape)) for mb in range(mbs)]
            store.put_many(items)
            if args.gap_at is not None and it == args.gap_at:
                store.record_gap(chans[0], it, 0, "test: queue overflow")
            it += 1
            if _STOP.wait(args.sleep) if args.sleep else _STOP.is_set():
                break
    finally:
        store.close(flush=args.flush)
    print(f"wrote {it - args.start} iterations", flush=True)


def _writer_cmd(root: Path, run: str, stage: int, stages: int, **kw: Any) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "server.testing",
        "write",
        "--root",
        str(root),
        "--run",
        run,
        "--stage",
        str(stage),
        "--stages",
        str(stages),
    ]
    for k, v in kw.items():
        if v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        cmd += [flag] if v is True else [flag, str(v)]
    return cmd


def write_run(
    root: str | os.PathLike[str],
    run: str,
    *,
    stages: int = 4,
    iterations: int = 8,
    micro_batches: int = 2,
    cold_url: str | None = None,
    flush_stages: Sequence[int] = (),
    evict_stages: Sequence[int] = (),
    gap_at: int | None = None,
    segment_iters: int = 2,
    shape: Sequence[int] = (2, 8, 16),
    timeout: float = 180.0,
) -> None:
    """Write a run with one real process per stage, all at once, and wait for them.

    Stages in ``flush_stages`` upload everything before exiting; the others only seal (their
    segments stay sealed-not-uploaded, what a server flush picks up). Stages in ``evict_stages``
    keep nothing hot once uploaded (reads of their records come from the cold tier).
    ``gap_at`` makes stage 1 record a gap at that iteration.
    """
    procs = []
    for k in range(stages):
        procs.append(
            subprocess.Popen(
                _writer_cmd(
                    Path(root),
                    run,
                    k,
                    stages,
                    iterations=iterations,
                    micro_batches=micro_batches,
                    cold_url=cold_url,
                    flush=k in flush_stages,
                    hot_max_bytes=1 if k in evict_stages else None,
                    gap_at=gap_at if k == 1 else None,
                    segment_iters=segment_iters,
                    shape=",".join(str(s) for s in shape),
                ),
                env=subprocess_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    errors = []
    for k, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        if p.returncode != 0:
            errors.append(f"stage {k} writer exited {p.returncode}: {err[-2000:]}")
    if errors:
        raise RuntimeError("\n".join(errors))


def start_writer(
    root: str | os.PathLike[str],
    run: str,
    *,
    writer: str,
    channels: Sequence[Channel],
    start: int = 0,
    duration: float = 3600.0,
    micro_batches: int = 4,
    shape: Sequence[int] = (4, 64, 256),
    sleep: float = 0.0,
    cold_url: str | None = None,
    segment_iters: int = 4,
) -> subprocess.Popen[str]:
    """Start a writer process that logs ``channels`` from iteration ``start`` on until
    ``duration`` passes or it is sent SIGTERM/SIGINT (stop it with :func:`stop_writer`)."""
    cmd = _writer_cmd(
        Path(root),
        run,
        0,
        1,
        writer=writer,
        channels=",".join(c.name for c in channels),
        start=start,
        duration=duration,
        micro_batches=micro_batches,
        shape=",".join(str(s) for s in shape),
        sleep=sleep or None,
        cold_url=cold_url,
        segment_iters=segment_iters,
        iterations=1 << 62,
    )
    return subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop_writer(p: subprocess.Popen[str], timeout: float = 30.0) -> str:
    """Stop a :func:`start_writer` process cleanly (SIGINT: it seals and closes) and return its stderr."""
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
    return err


@dataclass(frozen=True)
class StoreFixture:
    """A node root and cold tier written by :func:`server.testing.write_run`."""

    root: Path
    cold_dir: Path
    run: str = "run-a"
    stages: int = 4
    iterations: int = 8
    micro_batches: int = 2
    gap_at: int = 3

    @property
    def cold_url(self) -> str:
        return f"file://{self.cold_dir}"

    def keys(self) -> list[RecordKey]:
        """Every record the writers logged, in key order."""
        out = []
        for k in range(self.stages):
            for ch in stage_channels(k, self.stages):
                mbs = 1 if ch.kind is Kind.META else self.micro_batches
                out += [RecordKey(ch, it, mb) for it in range(self.iterations) for mb in range(mbs)]
        return sorted(out)

    def copy(self, dst: Path) -> StoreFixture:
        """A private copy of both tiers under ``dst`` (no writer may be running on the original)."""
        shutil.copytree(self.root, dst / "node")
        shutil.copytree(self.cold_dir, dst / "cold")
        return replace(self, root=dst / "node", cold_dir=dst / "cold")


class ServerProcess:
    """``swiftlog serve`` in a subprocess on a free loopback port; a context manager.

    ``url`` is the base URL once entered (``https://`` when ``args`` give ``--tls-cert``, whose
    certificate the readiness probe then trusts). Extra CLI flags go in ``args``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        token: str | None = None,
        cold_url: str | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        self.root = Path(root)
        self.token = token
        self.cold_url = cold_url
        self.args = list(args)
        self.env = env or {}
        self.startup_timeout = startup_timeout
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"{'https' if '--tls-cert' in self.args else 'http'}://127.0.0.1:{self.port}"

    def _verify(self) -> ssl.SSLContext | bool:
        if "--tls-cert" not in self.args:
            return True
        return ssl.create_default_context(cafile=self.args[self.args.index("--tls-cert") + 1])

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def __enter__(self) -> ServerProcess:
        self.port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "server.cli",
            "serve",
            "--root",
            str(self.root),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *self.args,
        ]
        if self.cold_url:
            cmd += ["--cold-url", self.cold_url]
        env = subprocess_env(self.env)
        env.pop("SWIFTLOG_TOKEN", None)
        if self.token:
            env["SWIFTLOG_TOKEN"] = self.token  # not on the command line, where `ps` shows it
        self._log = open(self.root.parent / f"server-{self.port}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + self.startup_timeout
        verify = self._verify()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()[-3000:]}")
            try:
                if (
                    httpx.get(self.url + "/v1/health", headers=self.headers(), timeout=1.0, verify=verify).status_code
                    == 200
                ):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.__exit__(None, None, None)
        raise RuntimeError(f"server did not answer within {self.startup_timeout} s: {self.log()[-3000:]}")

    def log(self) -> str:
        try:
            return (self.root.parent / f"server-{self.port}.log").read_text()
        except OSError:
            return ""

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m server.testing", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="one writer process (see write_run / start_writer)")
    w.add_argument("--root", required=True)
    w.add_argument("--run", required=True)
    w.add_argument("--stage", type=int, required=True)
    w.add_argument("--stages", type=int, required=True)
    w.add_argument("--writer")
    w.add_argument("--channels", help="comma-separated channel names instead of the stage's own")
    w.add_argument("--start", type=int, default=0)
    w.add_argument("--iterations", type=int, default=8)
    w.add_argument("--duration", type=float, help="write until this many seconds passed (ignores --iterations)")
    w.add_argument("--micro-batches", type=int, default=2)
    w.add_argument("--shape", default="2,8,16")
    w.add_argument("--sleep", type=float, default=0.0, help="pause between iterations")
    w.add_argument("--cold-url")
    w.add_argument("--flush", action="store_true")
    w.add_argument("--hot-max-bytes", type=int)
    w.add_argument("--gap-at", type=int)
    w.add_argument("--segment-iters", type=int, default=2)
    args = ap.parse_args(argv)
    # SIGINT/SIGTERM end the write loop after the current iteration, then the store is sealed and
    # closed. A flag, not KeyboardInterrupt: an exception raised inside the store (holding a lock,
    # mid-transaction) made the close in the finally block hang until the caller's SIGKILL
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: _STOP.set())
    _write_stage(args)


if __name__ == "__main__":
    main()
