"""``swiftlog plan``: the recovery plan for failed stages, from the pluggable planner.

Until replay/ lands it says so and exits 4 (unavailable), exactly like the API's 501.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from server.cli._common import ColdOptionOpt, ColdUrlOpt, JsonOpt, RootOpt, RunOpt, console, handle_errors, make_node, print_json
from server.planner import DEFAULT_PLANNER

__all__ = ["register"]


def plan(
    root: RootOpt,
    run: RunOpt,
    failed: Annotated[list[int], typer.Option("--failed", "-f", min=0, max=0xFFFF, help="failed stage (repeat for several)")],
    planner: Annotated[str, typer.Option("--planner", envvar="SWIFTLOG_PLANNER", help="module:function of the planner")] = DEFAULT_PLANNER,
    cold_url: ColdUrlOpt = None,
    cold_option: ColdOptionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Plan the recovery of failed stages from the surviving stages' logs."""
    with handle_errors():
        node = make_node(root, cold_url, cold_option)
        node.planner = planner
        p = node.plan(run, failed)
    if json_out:
        print_json(p)
        return
    console.print(f"recovery plan for run {p.run}, failed stages {p.failed_stages} ({p.planner}):")
    console.print_json(json.dumps(p.plan))


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
