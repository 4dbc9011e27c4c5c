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
    RunOpt,
    console,
    deprecated_alias,
    fail,
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
    cold_url: ColdUrlOpt = None,
    cold_option: ColdOptionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Plan the recovery of failed stages from the surviving stages' logs."""
    stages = deprecated_alias(stage, failed, new_flag="--stage/-s", old_flag="--failed/-f")
    if not stages:
        raise fail(
            "missing option '--stage' / '-s'",
            hint="name the failed stage: -s 2 (repeat for several)",
            error_type="usage",
        )
    if len(root) != 1:  # a plain option would keep the last of several silently
        raise fail(
            f"swiftlog plan reads one node's store root, got {len(root)}: {', '.join(map(str, root))}",
            hint="to plan over several nodes' roots: swiftlog replay --plan-only --run RUN -s STAGE --root A --root B",
        )
    with handle_errors():
        node = make_node(root[0], cold_url, cold_option)
        node.planner = planner
        p = node.plan(run, stages, target_iteration=target_iteration, bandwidth_mbps=bandwidth_mbps, workers=workers)
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


def register(app: typer.Typer) -> None:
    app.command("plan", cls=Command)(plan)
