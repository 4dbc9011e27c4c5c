"""Run a whole pipeline on this machine: a TCPStore in this process, one process per stage.

The store is hosted here, outside the training ranks, as the protocol requires (it survives any
stage). Each stage runs ``trainer_client.examples.train_pipeline`` with the common arguments plus
its own overrides; the caller gets return codes, combined output and the paths of the result
files. Only 127.0.0.1 is used.

Two ways to start the stage processes (``method``):

- ``"subprocess"``: ``python -m trainer_client.examples.train_pipeline ...`` (a fresh interpreter
  per stage, exactly what a user runs; pays the torch import, ~4 s of CPU, per stage).
- ``"forkserver"``: children forked from a multiprocessing fork server that imported torch and
  the training script once (started on first use, kept for the life of this process). Real,
  separate processes with their own gloo process group, started in milliseconds: what tests use.

Never leaves a stage process running: on timeout every stage still alive is killed.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer_client.commit import gloo_on_loopback, loopback_store

__all__ = ["LaunchResult", "StoreHost", "launch_pipeline", "load_stage_result"]

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
_FORKSERVER: Any = None


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Start processes inside this block so that they do not re-run the parent's ``__main__``.

    A multiprocessing child (spawn or forkserver) re-executes the parent's main script before
    running its target (CPython 3.11's fork server never preloads it), so a process started from
    the ``swiftlog`` CLI paid ~0.2 s of CLI imports before its first line. Stage and replacement
    targets live in importable modules and never need the parent's ``__main__``, so it is hidden
    (an empty module) while ``Process.start()`` collects the child's preparation data.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _forkserver() -> Any:
    global _FORKSERVER
    if _FORKSERVER is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed.pipelining", "trainer_client.examples.train_pipeline"])
        _FORKSERVER = ctx
    return _FORKSERVER


def _stage_entry(argv: list[str], log_path: str, env: dict[str, str]) -> None:
    """Body of a forkserver stage process: output to ``log_path``, then the training script."""
    import traceback

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(env)
    gloo_on_loopback()
    from trainer_client.examples import train_pipeline

    try:
        rc = train_pipeline.main(argv)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


class _ForkProc:
    """The subset of Popen the launcher uses, over a multiprocessing.Process."""

    def __init__(self, proc: Any) -> None:
        self._p = proc

    def poll(self) -> int | None:
        return None if self._p.is_alive() else self._p.exitcode

    def kill(self) -> None:
        self._p.kill()

    def wait(self) -> int:
        self._p.join()
        return self._p.exitcode

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    @property
    def sentinel(self) -> int:
        """A handle that becomes ready when the process ends (``multiprocessing.connection.wait``)."""
        return self._p.sentinel


class StoreHost:
    """A TCPStore server on 127.0.0.1 (free port) owned by this process."""

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=300)) -> None:
        self.store = loopback_store(
            timeout
        )  # listening on 127.0.0.1 only (torch's own server listens on every interface)
        self.port: int = self.store.port


@dataclass(slots=True)
class LaunchResult:
    """Outcome of :func:`launch_pipeline`: per-stage return code and output, and wall time (s)."""

    returncodes: dict[int, int | None]
    outputs: dict[int, str]
    out_dir: str
    wall_s: float
    timed_out: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes.values())

    def describe(self) -> str:
        """Return codes and the tail of every failing stage's output (for assertion messages)."""
        lines = [f"returncodes={self.returncodes} timed_out={self.timed_out} wall_s={self.wall_s:.1f}"]
        for k, rc in sorted(self.returncodes.items()):
            if rc != 0:
                lines.append(f"--- stage {k} (rc={rc}) ---\n" + self.outputs.get(k, "")[-4000:])
        return "\n".join(lines)


def launch_pipeline(
    args: Sequence[str],
    *,
    num_stages: int = 4,
    out_dir: str,
    per_stage: Mapping[int, Sequence[str]] | None = None,
    store_host: StoreHost | None = None,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    method: str = "subprocess",
) -> LaunchResult:
    """Start ``num_stages`` stage processes with ``args`` (+ ``per_stage[k]``) and wait for them.

    ``args`` must not contain ``--stage``, ``--num-stages``, ``--store-port`` or ``--out``; they
    are added here. A new TCPStore is hosted unless ``store_host`` is given. ``method`` is
    "subprocess" or "forkserver" (module docstring). Returns when every stage exited or
    ``timeout_s`` passed (then the rest are killed).
    """
    if method not in ("subprocess", "forkserver"):
        raise ValueError(f"method must be 'subprocess' or 'forkserver', got {method!r}")
    host = store_host or StoreHost()
    os.makedirs(out_dir, exist_ok=True)
    penv = dict(os.environ)
    penv["PYTHONPATH"] = _REPO_ROOT + (os.pathsep + penv["PYTHONPATH"] if penv.get("PYTHONPATH") else "")
    penv.setdefault("OMP_NUM_THREADS", "1")
    penv.update(env or {})
    procs: dict[int, Any] = {}
    logs: dict[int, Any] = {}
    t0 = time.monotonic()
    try:
        for k in range(num_stages):
            argv = [
                "--stage",
                str(k),
                "--num-stages",
                str(num_stages),
                "--store-port",
                str(host.port),
                "--out",
                out_dir,
                *args,
                *(per_stage or {}).get(k, ()),
            ]
            logs[k] = tempfile.NamedTemporaryFile(mode="w+", prefix=f"stage{k}-", suffix=".log")
            if method == "subprocess":
                cmd = [sys.executable, "-m", "trainer_client.examples.train_pipeline", *argv]
                procs[k] = subprocess.Popen(cmd, stdout=logs[k], stderr=subprocess.STDOUT, cwd=_REPO_ROOT, env=penv)
            else:
                p = _forkserver().Process(
                    target=_stage_entry, args=(argv, logs[k].name, dict(env or {})), name=f"stage{k}"
                )
                with main_module_hidden():
                    p.start()
                procs[k] = _ForkProc(p)
        timed_out = False
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() - t0 > timeout_s:
                timed_out = True
                break
            if any(p.poll() not in (None, 0) for p in procs.values()):
                # one stage failed: give the others a moment to fail on their own, then stop them
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
                    time.sleep(0.05)
                break
            time.sleep(0.05)
    finally:
        stop_all(procs.values())
    outputs = {}
    for k, f in logs.items():
        with open(f.name) as g:
            outputs[k] = g.read()
        f.close()
    return LaunchResult({k: p.returncode for k, p in procs.items()}, outputs, out_dir, time.monotonic() - t0, timed_out)


def stop_all(procs: Any) -> None:
    """SIGKILL every process of ``procs`` still running, then reap them all (subprocess.Popen or
    the fork server's process handles, both expose poll/kill/wait)."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def load_stage_result(out_dir: str, stage: int) -> dict[str, Any]:
    """The ``stage{k}.pt`` a stage wrote (model/optimizer state, losses, stats, received...)."""
    return torch.load(os.path.join(out_dir, f"stage{stage}.pt"), weights_only=False)
