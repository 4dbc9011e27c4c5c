"""``swiftlog plan``: the recovery plan for failed stages, from the pluggable planner
(``replay.plan:plan_recovery`` by default), over one node's store root and the cold tier.

Exit 0 with a possible plan, 1 with an impossible one (its reasons and fallback printed), 4 when
the planner cannot be imported (like the API's 501). To plan over several nodes' roots at once,
``swiftlog replay --plan-only --root A --root B``. ``--stage/-s``, ``--target-iteration/-t`` and
``--workers/-w`` are spelled as in ``swiftlog replay``; ``--failed/-f`` still works (deprecated).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from server.cli._common import (
    ColdOptionOpt,
    ColdUrlOpt,
    Command,
    JsonOpt,
    RankOpt,
    RunOpt,
    StagesPerRankOpt,
    StageStyleOpt,
    console,
    deprecated_alias,
    fail,
    failed_ranks,
    handle_errors,
    make_node,
    print_json,
)
from server.errors import EXIT_PROBLEMS
from server.planner import DEFAULT_PLANNER
from server.settings import ENV_PLANNER, ENV_ROOT

__all__ = ["register"]


def plan(
    root: Annotated[
        list[Path],
        typer.Option(
            "--root",
            envvar=ENV_ROOT,
            help="the node's store root (one; for several: swiftlog replay --plan-only)",
            show_default=False,
        ),
    ],
    run: RunOpt,
    stage: Annotated[
        list[int] | None,
        typer.Option("--stage", "-s", min=0, max=0xFFFF, help="failed stage (repeat for several)", show_default=False),
    ] = None,
    rank: RankOpt = None,
    stages_per_rank: StagesPerRankOpt = 1,
    stage_style: StageStyleOpt = "loop",
    # the old spelling of --stage: hidden, still works, says it is deprecated
    failed: Annotated[list[int] | None, typer.Option("--failed", "-f", min=0, max=0xFFFF, hidden=True)] = None,
    planner: Annotated[
        str, typer.Option("--planner", envvar=ENV_PLANNER, help="module:function of the planner")
    ] = DEFAULT_PLANNER,
    target_iteration: Annotated[
        int | None, typer.Option("--target-iteration", "-t", min=0, help="the iteration the survivors stand at")
    ] = None,
    bandwidth_mbps: Annotated[
        float | None, typer.Option("--bandwidth-mbps", min=0.001, help="fetch bandwidth for the estimate (MB/s)")
    ] = None,
    workers: Annotated[
        int | None, typer.Option("--workers", "-w", min=1, max=1024, help="parallel replay workers for the estimate")
    ] = None,
    dp_replicate: Annotated[
        int, typer.Option("--dp-replicate", min=1, max=4096, help="replicas of every stage (with --node-map)")
    ] = 1,
    node_map_file: Annotated[
        Path | None,
        typer.Option(
            "--node-map",
            help="JSON: the machine of every rank (a list by rank, or an object rank -> machine); "
            "without -s: whether the run needs its logs, what switching them off saves, what a double failure costs",
            show_default=False,
        ),
    ] = None,
    num_stages: Annotated[
        int | None, typer.Option("--num-stages", min=1, help="pipeline stages (default: from the node map)")
    ] = None,
    cold_url: ColdUrlOpt = None,
    cold_option: ColdOptionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Plan the recovery of failed stages from the surviving stages' logs (or, with --node-map,
    whether a run with data-parallel replicas needs its logs at all)."""
    stages = deprecated_alias(stage, failed, new_flag="--stage/-s", old_flag="--failed/-f")
    if node_map_file is not None and not stages:
        _replica_logging(root, run, dp_replicate, node_map_file, num_stages, cold_url, cold_option, json_out)
        return
    ranks = failed_ranks(stages, rank, stages_per_rank, stage_style)
    if len(root) != 1:  # a plain option would keep the last of several silently
        raise fail(
            f"swiftlog plan reads one node's store root, got {len(root)}: {', '.join(map(str, root))}",
            hint="to plan over several nodes' roots: swiftlog replay --plan-only --run RUN -s STAGE --root A --root B",
        )
    with handle_errors():
        node = make_node(root[0], cold_url, cold_option)
        node.planner = planner
        p = node.plan(
            run,
            list(stages or []),
            target_iteration=target_iteration,
            bandwidth_mbps=bandwidth_mbps,
            workers=workers,
            **ranks,
        )
    # the default planner's plan is a model, another planner's a plain JSON object
    doc = p.plan if isinstance(p.plan, dict) else p.plan.model_dump(mode="json")
    impossible = doc.get("possible") is False  # exit 1, as swiftlog replay --plan-only
    if json_out:
        print_json(p)
    else:
        from replay.plan import RecoveryPlan
        from server.cli.replay import print_plan

        try:
            print_plan(RecoveryPlan.from_dict(doc), False)
        except (KeyError, TypeError, AttributeError):  # another planner's document: shown as it is
            console.print(f"recovery plan for run {p.run}, failed stages {p.failed_stages} ({p.planner}):")
            console.print_json(json.dumps(doc))
    if impossible:
        raise typer.Exit(EXIT_PROBLEMS)


def _replica_logging(
    root: list[Path],
    run: str,
    dp_replicate: int,
    node_map_file: Path,
    num_stages: int | None,
    cold_url: str | None,
    cold_option: list[str] | None,
    json_out: bool,
) -> None:
    """``swiftlog plan --node-map``: :func:`replay.plan_replica_logging` over the replicas' runs
    (``{run}.dp{r}``): this root's (with its cold tier), and the others' in the cold tier."""
    from replay.plan import cold_only_store
    from replay.replica_plan import plan_replica_logging
    from trainer_client.mesh import MeshLayout, replica_run

    try:
        nodes = json.loads(node_map_file.read_text())
    except (OSError, ValueError) as e:
        raise fail(f"--node-map {node_map_file}: {e}", error_type="usage") from None
    count = len(nodes) if isinstance(nodes, (list, dict)) else 0
    stages = num_stages if num_stages is not None else count // dp_replicate
    if stages < 1 or (num_stages is None and count % dp_replicate):
        raise fail(
            f"--node-map {node_map_file} names {count} ranks, not a multiple of --dp-replicate {dp_replicate}",
            hint="give the machine of every rank (rank = stage * dp_replicate + replica)",
            error_type="usage",
        )
    layout = MeshLayout(stages, dp_replicate)
    with handle_errors():
        node = make_node(root[0], cold_url, cold_option)
        runs = list(dict.fromkeys(replica_run(run, r, dp_replicate) for r in range(dp_replicate)))
        local = set(node.run_names())
        # a replica whose writers are on other nodes: its logs as the cold tier holds them
        others = {
            r: cold_only_store(node.cold_url, r, node.cold_options) for r in runs if r not in local and node.cold_url
        }
        present = [r for r in runs if r in local or r in others]
        try:
            p = plan_replica_logging(layout, nodes, [others[r] if r in others else node.store(r) for r in present])
        except ValueError as e:
            raise fail(f"--node-map {node_map_file}: {e}", error_type="usage") from None
        finally:
            for st in others.values():
                st.close()
    doc = {"run": run, "runs_measured": present, **p.to_dict()}
    if json_out:
        print(json.dumps(doc, indent=2, default=str))
        return
    console.print(f"run {run}: {stages} stages x {dp_replicate} replicas")
    for k, machines in p.machines.items():
        mark = "  [red]exposed[/red]" if k in p.exposed else ""
        console.print(f"  stage {k}: replicas on {', '.join(machines)}{mark}")
    console.print(f"logs needed: {'yes' if p.logging_needed else 'no'} ({p.why})")
    if p.stored_bytes_per_iteration is not None:
        console.print(
            f"switching them off saves {p.stored_bytes_per_iteration / 1e6:.2f} MB stored per iteration "
            f"({p.raw_bytes_per_iteration / 1e6:.2f} MB of tensors; measured over {p.iterations_measured} "
            f"iterations of {', '.join(present)})"
        )
    else:
        console.print("no logs of the run on this root to measure what switching them off saves")
    console.print(f"then a double failure costs: {p.double_failure}")


def register(app: typer.Typer) -> None:
    app.command("plan", cls=Command)(plan)
