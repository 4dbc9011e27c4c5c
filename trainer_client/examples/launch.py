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

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from replay.processes import StoreHost, forkserver_context, run_module_main, start_process, stop_all

__all__ = ["LaunchResult", "launch_pipeline", "load_stage_result"]

#: the training script every stage process runs
_SCRIPT = "trainer_client.examples.train_pipeline"


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
    penv = dict(os.environ)  # children find the packages the way this process did
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
                cmd = [sys.executable, "-m", _SCRIPT, *argv]
                procs[k] = subprocess.Popen(cmd, stdout=logs[k], stderr=subprocess.STDOUT, env=penv)
            else:
                ctx = forkserver_context(["torch", "torch.distributed.pipelining", _SCRIPT])
                procs[k] = start_process(
                    ctx, run_module_main, (argv, logs[k].name, _SCRIPT, dict(env or {})), f"stage{k}"
                )
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


def load_stage_result(out_dir: str, stage: int) -> dict[str, Any]:
    """The ``stage{k}.pt`` a stage wrote (model/optimizer state, losses, stats, received...)."""
    return torch.load(os.path.join(out_dir, f"stage{stage}.pt"), weights_only=False)
