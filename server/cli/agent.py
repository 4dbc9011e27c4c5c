"""``swiftlog agent``: one per node, torchrun's flags, survivors kept running (:mod:`replay.agent`).

    swiftlog agent --nnodes 2 --nproc-per-node 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 \\
        --host 10.0.0.1 --run-id job1 --store-root /local/swiftlog --checkpoint-url s3://ckpt/job1 \\
        --out /shared/out -m mypkg.train -- --iters 1000 --cold-url s3://logs/job1

A spare node runs the same command with ``--spare`` instead of ``--node-rank``. The script after
``-m`` is a module whose ``main(argv)`` takes the script contract's arguments (docs/recovery.md).
Exit code: node 0's is 0 when every rank finished, 1 otherwise; the others' 0 once the job is over.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from server.cli._common import fail
from server.errors import EXIT_UNAVAILABLE

__all__ = ["register"]


def agent(
    module: Annotated[str, typer.Option("-m", "--module", help="the training script: a module with main(argv)")],
    nnodes: Annotated[int, typer.Option("--nnodes", min=1, help="regular nodes (not counting spares)")],
    nproc_per_node: Annotated[int, typer.Option("--nproc-per-node", min=1, help="ranks per node")],
    rdzv_endpoint: Annotated[str, typer.Option("--rdzv-endpoint", help="HOST:PORT of the job's store (node 0's)")],
    run_id: Annotated[str, typer.Option("--run-id", help="the job's run id")],
    store_root: Annotated[str, typer.Option("--store-root", help="this node's log store root")],
    checkpoint_url: Annotated[str, typer.Option("--checkpoint-url", help="durable checkpoints (shared dir, s3://)")],
    out: Annotated[str, typer.Option("--out", help="where the ranks write their results")],
    args: Annotated[list[str] | None, typer.Argument(help="the script's own arguments (after --)")] = None,
    node_rank: Annotated[int | None, typer.Option("--node-rank", min=0, help="this node's rank")] = None,
    spare: Annotated[bool, typer.Option("--spare", help="a spare node: takes the ranks of a lost node")] = False,
    host: Annotated[str, typer.Option("--host", help="address this node's servers bind")] = "127.0.0.1",
    dp_replicate: Annotated[int, typer.Option("--dp-replicate", min=1, help="replicas of every stage")] = 1,
    dp_shard: Annotated[int, typer.Option("--dp-shard", min=1, help="ranks sharding every stage (FSDP2)")] = 1,
    replay_workers: Annotated[int, typer.Option("--replay-workers", min=1, help="K: replay helpers + 1")] = 1,
    max_restarts: Annotated[int, typer.Option("--max-restarts", min=0, help="recoveries before giving up")] = 4,
    node_timeout: Annotated[float, typer.Option("--node-timeout", help="seconds without heartbeat: node lost")] = 3.0,
    mode: Annotated[
        str, typer.Option("--mode", help="swift: replace what was lost; rollback: restart every rank (baseline)")
    ] = "swift",
    cold_start: Annotated[
        bool, typer.Option("--cold-start", help="start each process as a fresh interpreter (no warm fork server)")
    ] = False,
    hang_timeout: Annotated[
        list[str] | None,
        typer.Option(
            "--hang-timeout",
            help="SECTION=SECONDS (step, checkpoint, recovery): a rank stalled that long is hung and replaced",
        ),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="every rank starts from the newest common checkpoint (a job restart)")
    ] = False,
    attempt: Annotated[int, typer.Option("--attempt", min=0, help="this job attempt's number (restarts)")] = 0,
    inject_kill: Annotated[
        list[str] | None,
        typer.Option("--inject-kill", help="fault injection: RANK:IT,MB,PHASE (the rank's first process)"),
    ] = None,
    groups: Annotated[
        str | None,
        typer.Option("--groups", help="the script's logging-group sizes, e.g. 2,2 (a failure takes its group)"),
    ] = None,
    group_in_place: Annotated[
        bool, typer.Option("--group-in-place", help="a group's live members replay in place (no kill)")
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log what the agent does")] = False,
) -> None:
    """Run this node's agent: supervise its ranks one by one, replace what dies, keep survivors running."""
    from replay.agent import AgentConfig, JobStoreLostError, run_agent
    from replay.launcher import KillSpec
    from trainer_client.mesh import MeshLayout

    if (node_rank is None) == (not spare):
        raise fail("give exactly one of --node-rank N and --spare", code=2)
    logging.getLogger("replay").setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        world = nnodes * nproc_per_node
        dp = dp_replicate * dp_shard
        layout = MeshLayout(world // dp, dp_replicate, dp_shard) if world % dp == 0 and world // dp else None
        kills = []
        for spec in inject_kill or []:
            rank, _, at = spec.partition(":")
            it, mb, phase = at.split(",")
            if layout is None or not rank.isdigit() or int(rank) >= world:
                raise ValueError(f"--inject-kill {spec!r}: RANK must be a rank of the {world}")
            c = layout.coord(int(rank))
            kills.append(KillSpec(c.stage, int(it), int(mb), phase, replica=c.replica, shard=c.shard))
        cfg = AgentConfig(
            nnodes=nnodes,
            nproc_per_node=nproc_per_node,
            node_rank=node_rank,
            rdzv_endpoint=rdzv_endpoint,
            module=module,
            run_id=run_id,
            store_root=store_root,
            checkpoint_url=checkpoint_url,
            out=out,
            args=tuple(args or ()),
            host=host,
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            replay_workers=replay_workers,
            max_restarts=max_restarts,
            node_timeout_s=node_timeout,
            warm=not cold_start,
            mode=mode,
            kills=tuple(kills),
            resume=resume,
            attempt=attempt,
            hang_timeouts=tuple(_section_seconds(x) for x in hang_timeout or []),
            groups=None if groups is None else _sizes(groups),
            group_recovery="in_place" if group_in_place else "kill",
        )
    except ValueError as e:
        raise fail(str(e), code=2) from None
    try:
        run = run_agent(cfg)
    except JobStoreLostError as e:
        raise fail(
            str(e), code=EXIT_UNAVAILABLE, hint="restart the job: every agent with --resume --attempt N+1"
        ) from None
    if run is not None:
        typer.echo(run.describe())
        if not run.ok:
            raise typer.Exit(1)


def _section_seconds(text: str) -> tuple[str, float]:
    section, _, seconds = text.partition("=")
    try:
        return section, float(seconds)
    except ValueError:
        raise ValueError(f"--hang-timeout {text!r}: SECTION=SECONDS, e.g. step=60") from None


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--groups {text!r} must be comma-separated group sizes, e.g. 2,2") from None


def register(app: typer.Typer) -> None:
    app.command("agent", context_settings={"allow_interspersed_args": False})(agent)
