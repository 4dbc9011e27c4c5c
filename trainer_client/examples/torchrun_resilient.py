"""The example GPT pipeline under plain torchrun: ``torchrun ... -m trainer_client.examples.torchrun_resilient``.

torchrun gives each worker ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (its agent's
store) and, after a restart, ``TORCHELASTIC_RESTART_COUNT``. This wrapper turns them into
``train_resilient``'s arguments (stage = rank // dp_replicate, the agent's store as the job's
store) and passes the rest on. In a restart (``--max-restarts``):

- with ``--snapshot-dir DIR``: the survivors of the failed attempt saved their state in DIR when
  torchrun stopped them; ``replay.recover_on_restart`` resumes them from it and replays only
  the lost rank (or rolls every rank back when that cannot be done);
- without: every rank restarts from the newest checkpoint all stages have (a global rollback,
  what the job loses without swiftlog's snapshots).

``--kill-rank R`` with ``--kill-at IT,MB,PHASE``: fault injection in rank R of the first attempt only.
"""

from __future__ import annotations

import argparse
import os

from trainer_client.config import ENV_RESTART_COUNT

__all__ = ["main", "torchrun_argv"]


def torchrun_argv(argv: list[str], env: dict[str, str]) -> list[str]:
    """``train_resilient``'s arguments for this torchrun worker (``env``: its environment)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-at", default="")
    p.add_argument("--snapshot-dir", default=None)
    p.add_argument("--checkpoint-url", default=None)
    p.add_argument("--run-id", default="example")
    known, rest = p.parse_known_args(argv)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    restart = int(env.get(ENV_RESTART_COUNT, "0") or 0)
    R = known.dp_replicate
    out = [
        "--stage",
        str(rank // R),
        "--replica",
        str(rank % R),
        "--dp-replicate",
        str(R),
        "--num-stages",
        str(world // R),
        "--store-host",
        env["MASTER_ADDR"],
        "--store-port",
        env["MASTER_PORT"],
        "--run-id",
        known.run_id,
        *(["--checkpoint-url", known.checkpoint_url] if known.checkpoint_url else []),
        *rest,
    ]
    if known.kill_at and rank == known.kill_rank and restart == 0:
        out += ["--kill-at", known.kill_at]
    if known.snapshot_dir:
        out += ["--snapshot-dir", known.snapshot_dir]
    elif restart > 0 and known.checkpoint_url:  # the manual restart, in code: everyone from the common checkpoint
        from replay.checkpoints import mesh_common_checkpoint

        c = mesh_common_checkpoint(known.checkpoint_url, world // R, R)
        if c is not None:
            out += ["--resume-from", str(c)]
    return out


def main(argv: list[str] | None = None) -> int:
    import sys

    from trainer_client.examples import train_resilient

    return train_resilient.main(torchrun_argv(list(sys.argv[1:] if argv is None else argv), dict(os.environ)))


if __name__ == "__main__":
    raise SystemExit(main())
