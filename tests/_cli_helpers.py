"""Running the ``swiftlog`` CLI as a subprocess in tests, and checking how it ended."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from server.testing import subprocess_env

__all__ = ["swiftlog", "swiftlog_all", "ok", "fails", "json_error"]

Completed = subprocess.CompletedProcess[str]


def swiftlog(*args: str | Path, env: dict[str, str] | None = None, timeout: float = 120) -> Completed:
    """``python -m server.cli ARGS``, without the caller's SWIFTLOG_* variables (``env`` adds some)."""
    base = {k: v for k, v in subprocess_env().items() if not k.startswith("SWIFTLOG_")}
    cmd = [sys.executable, "-m", "server.cli", *map(str, args)]
    env = {**base, **(env or {}), "COLUMNS": "200"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def swiftlog_all(*calls: tuple) -> list[subprocess.CompletedProcess[str]]:
    """Independent invocations, run concurrently (each pays the interpreter and torch start-up).
    A call's last item may be a dict: its environment variables."""

    def one(call: tuple) -> subprocess.CompletedProcess[str]:
        env = call[-1] if call and isinstance(call[-1], dict) else None
        return swiftlog(*(call[:-1] if env is not None else call), env=env)

    with ThreadPoolExecutor(max_workers=3) as pool:
        return list(pool.map(one, calls))


def ok(p: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    """``p`` exited 0 without a traceback."""
    assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr
    return p


def fails(p: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    """``p`` exited ``code`` with ``error: ...`` on stderr holding every needle, and no traceback."""
    assert p.returncode == code, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr and p.stderr.startswith("error: "), p.stderr
    for n in needles:
        assert n in p.stderr, (n, p.stderr)


def json_error(p: subprocess.CompletedProcess[str], code: int, *needles: str) -> dict[str, Any]:
    """``p`` ran with ``--json`` and failed: its stdout is one JSON error object whose exit_code is
    ``code`` (the process's too) and whose message holds every needle; stderr has no plain error."""
    assert p.returncode == code, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr and "error:" not in p.stderr and "Error" not in p.stderr, p.stderr
    doc = json.loads(p.stdout)
    err = doc["error"]
    assert list(doc) == ["error"] and {"type", "message", "hint", "exit_code", "key", "retryable"} <= set(err), doc
    assert err["exit_code"] == code and err["type"] and err["message"], err
    for n in needles:
        assert n in err["message"], (n, err)
    return err
