"""A training script with a bug in one stage (for the launcher's test): stage 1 raises the same
error every time it starts; the others run ``trainer_client.examples.minimal_resilient``."""

from __future__ import annotations

from collections.abc import Sequence

from trainer_client.examples import minimal_resilient


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    if args[args.index("--stage") + 1] == "1":
        raise RuntimeError("a bug in stage 1's own code")
    return minimal_resilient.main(args)
