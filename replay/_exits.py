"""What a training process's exit says: the error it raised, and whether exits show a script bug.

A scheduler (``replay.launcher``, the agent's leader) must not take a bug in the training script
for a machine failure: a replacement that meets the same error again, or every rank raising alike,
ends the run with the error instead of another recovery.

Never: reads a log still being written (asked of exited processes only).
"""

from __future__ import annotations

import functools

__all__ = ["last_error", "script_bug"]


def script_bug(
    states: dict[int, int | None], errors: dict[int, tuple[str, str | None]], raised: dict[int, dict[str, str]]
) -> str | None:
    """Whether the stages' exits show a bug in the training script rather than a machine failure:
    a stage's process raised the error an earlier process of the same stage raised (its
    replacement, or its restart after a rollback, met it again), or every stage's process exited
    raising an error (none was killed), two of them the same one (machines do not fail alike, all
    at once). ``errors``: stage -> (its current process's name, the error it exited with) for the
    exited ones; ``raised``: stage -> {process name: the error it raised} of earlier exits.
    Returns the reason, or None."""
    lines = {k: errors[k][1] for k, rc in states.items() if rc is not None and rc > 0 and k in errors}
    for k, line in lines.items():
        if line is not None and any(n != errors[k][0] and old == line for n, old in raised.get(k, {}).items()):
            return (
                f"stage {k} raised the same error again after it was restarted ({line}): a bug in the script, not "
                "a machine failure"
            )
    if len(states) > 1 and all(rc is not None and rc > 0 for rc in states.values()):
        seen = [line for line in lines.values() if line is not None]
        for line in seen:
            if seen.count(line) > 1:
                return (
                    f"every stage exited with an error, {seen.count(line)} of them with {line}: a bug in the script, "
                    "not a machine failure (no stage was killed)"
                )
    return None


@functools.lru_cache(maxsize=1024)
def last_error(log_path: str) -> str | None:
    """The last line of a traceback's exception in a stage's log (``Type: message``), or None.
    Asked only of exited processes, whose logs no longer change (cached)."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [ln.rstrip() for ln in f.readlines()[-200:]]
    except OSError:
        return None
    if not any(ln.startswith("Traceback (most recent call last)") for ln in lines):
        return None
    tail = [ln for ln in lines if ln and not ln.startswith((" ", "\t"))]
    return tail[-1][:300] if tail else None
