"""A training script with a bug every stage meets (for the launcher's test): each stage raises the
same error as it starts, as a script that forgot a set-up call would."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    raise RuntimeError("call client.schedule(...) before client.step(...)")
