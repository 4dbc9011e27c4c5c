"""Helpers of the in-place recovery tests: one pipeline run with injected failures, compared bitwise.

Every run is real: a TCPStore hosted in the test process, one process per stage (gloo on CPU,
the example GPT with dropout), each stage's log store in its own directory ("node"), SIGKILL
injected by the training script, the replacement started by :mod:`replay.launcher`.

A recovered run is compared with a failure-free run of the same script and arguments
(:class:`References`). Each such reference runs once per session and is kept on disk, keyed by
its arguments and by a fingerprint of everything that decides its numbers.

Never: a reference used for other arguments, other source code or another torch build than it
came from.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replay.compare import states_equal
from replay.launcher import DEFAULT_SCRIPT, KillSpec, RecoveryRun, run_with_failures

__all__ = [
    "CKPTS",
    "ITERS",
    "NUM_STAGES",
    "PG_TIMEOUT_S",
    "Reference",
    "References",
    "assert_same_as",
    "pipeline_args",
    "run",
]

ITERS = 6
CKPTS = "2,4"
NUM_STAGES = 4
PG_TIMEOUT_S = 60  # the stages' process-group and rejoin timeouts
_ROOT = Path(__file__).resolve().parents[1]
_CODE = ("logstore", "trainer_client", "replay")  # the packages a run executes
_STATE_PARTS = ("model", "optimizer", "lr_scheduler")


def pipeline_args(base: Path, schedule: str, extra: Sequence[str] = ()) -> list[str]:
    return [
        "--schedule",
        schedule,
        "--iters",
        str(ITERS),
        "--ckpt-at",
        CKPTS,
        "--seed",
        "1234",
        "--segment-iters",
        "2",
        "--cold-url",
        f"file://{base / 'cold'}",
        "--pg-timeout",
        str(PG_TIMEOUT_S),
        "--rejoin-timeout",
        str(PG_TIMEOUT_S),
        *extra,
    ]


def run(
    base: Path,
    schedule: str,
    kills: Sequence[KillSpec] = (),
    *,
    mode: str = "swift",
    extra: Sequence[str] = ("--data-source",),
    replay_workers: int = 1,
    timeout_s: float = 150.0,
    groups: Sequence[int] | None = None,
    group_recovery: str = "kill",
) -> RecoveryRun:
    """One pipeline run under ``base`` (recreated); asserts that it finished."""
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    r = run_with_failures(
        pipeline_args(base, schedule, extra),
        run_id="rec",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        kills=kills,
        mode=mode,
        num_stages=NUM_STAGES,
        replay_workers=replay_workers,
        timeout_s=timeout_s,
        groups=groups,
        group_recovery=group_recovery,
    )
    assert r.ok, r.describe()
    return r


@dataclass(frozen=True)
class Reference:
    """A failure-free run's final states (stage -> model, optimizer and lr scheduler state dicts; a rank
    holding several stages: under "stages", by stage)."""

    results: dict[int, dict[str, Any]]


class References:
    """Failure-free runs, each run once per (script, arguments) and kept for the session and on disk.

    ``work``: where the runs run. ``cache``: where finished references are kept between sessions
    (None: for this session only). A cached reference is used only for the same script, arguments,
    stage count and logging groups, and the same fingerprint: the source of the packages a run
    executes, Python's and torch's versions and torch's CPU capability. A cache file that cannot be
    read is run again.
    """

    def __init__(self, work: Path, cache: Path | None) -> None:
        self.work, self.cache = work, cache
        self._runs: dict[str, Reference] = {}
        self._fingerprint: str | None = None
        self.ran: list[str] = []  # the keys run in this session (the rest came from memory or disk)

    def get(
        self, schedule: str = "1f1b", *, extra: Sequence[str] = ("--data-source",), groups: Sequence[int] | None = None
    ) -> Reference:
        """The failure-free :func:`run` of ``schedule`` with ``extra`` arguments."""
        args = lambda base: pipeline_args(base, schedule, extra)  # noqa: E731
        return self.failure_free(args, run_id="rec", num_stages=NUM_STAGES, groups=groups)

    def failure_free(
        self,
        args: Callable[[Path], Sequence[str]],
        *,
        run_id: str,
        num_stages: int,
        script: str = DEFAULT_SCRIPT,
        groups: Sequence[int] | None = None,
        timeout_s: float = 150.0,
        dp_replicate: int = 1,
        dp_shard: int = 1,
    ) -> Reference:
        """The failure-free run of ``script`` with ``args(base)`` (``base``: the run's directory);
        with ``dp_replicate`` or ``dp_shard`` > 1 a mesh, its results keyed by rank."""
        key = self._key(list(args(Path("/BASE"))), run_id, num_stages, script, groups, dp_replicate, dp_shard)
        if key in self._runs:
            return self._runs[key]
        ref = self._load(key)
        if ref is None:
            base = self.work / key
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir(parents=True)
            r = run_with_failures(
                list(args(base)),
                run_id=run_id,
                base_dir=str(base),
                checkpoint_url=f"file://{base / 'ckpt'}",
                num_stages=num_stages,
                timeout_s=timeout_s,
                groups=groups,
                script=script,
                dp_replicate=dp_replicate,
                dp_shard=dp_shard,
            )
            assert r.ok, r.describe()
            kept = (*_STATE_PARTS, "stages")  # "stages": a multi-stage rank's states, by stage
            ref = Reference({k: {p: res.get(p) for p in kept} for k, res in r.results.items()})
            self.ran.append(key)
            self._save(key, ref)
        self._runs[key] = ref
        return ref

    def _key(
        self,
        args: list[str],
        run_id: str,
        num_stages: int,
        script: str,
        groups: Sequence[int] | None,
        dp_replicate: int = 1,
        dp_shard: int = 1,
    ) -> str:
        what = {
            **({"dp_replicate": dp_replicate} if dp_replicate > 1 else {}),
            **({"dp_shard": dp_shard} if dp_shard > 1 else {}),
            "args": args,
            "run_id": run_id,
            "num_stages": num_stages,
            "script": script,
            "groups": None if groups is None else list(groups),
            "fingerprint": self.fingerprint(),
        }
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]

    def fingerprint(self) -> str:
        """A digest of what decides a run's numbers besides its arguments."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            cpu = torch.backends.cpu.get_cpu_capability()
            h.update(f"{sys.version}|{torch.__version__}|{cpu}|{platform.machine()}".encode())
            for pkg in _CODE:
                for f in sorted((_ROOT / pkg).rglob("*.py")):
                    h.update(str(f.relative_to(_ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def _load(self, key: str) -> Reference | None:
        if self.cache is None or not (self.cache / f"{key}.pt").is_file():
            return None
        try:
            return Reference(torch.load(self.cache / f"{key}.pt", weights_only=True))
        except Exception:  # noqa: BLE001 - a damaged or foreign file: run it again
            return None

    def _save(self, key: str, ref: Reference) -> None:
        if self.cache is None:
            return
        self.cache.mkdir(parents=True, exist_ok=True)
        tmp = self.cache / f"{key}.pt.partial-{os.getpid()}"
        torch.save(ref.results, tmp)
        os.replace(tmp, self.cache / f"{key}.pt")


def assert_same_as(run_: RecoveryRun | Reference, reference: RecoveryRun | Reference) -> None:
    """Every stage's final parameters, optimizer state and scheduler equal the reference bitwise."""
    diffs = {k: states_equal(run_.results[k], reference.results[k]) for k in range(NUM_STAGES)}
    assert not any(diffs.values()), {k: v[:5] for k, v in diffs.items() if v}
