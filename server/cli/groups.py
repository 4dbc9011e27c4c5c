"""``swiftlog profile`` and ``swiftlog plan-groups``: selective logging chosen from measured costs.

``profile`` measures a run's costs from one node's store root (``replay.profile``) and keeps them
as the run's ``profile`` document; ``--model`` (the stage factory, as ``swiftlog replay`` takes it)
makes it replay a few iterations of every stage to measure their replay time. ``plan-groups``
chooses logging groups from that profile within a storage budget (``replay.group_planner``): a
table, or with ``--json`` the document ``ClientConfig.logging_groups`` takes as it is. Exit 2
when no grouping fits the budget (the message names what one needs), 3 when the run has no profile.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from server.cli._common import (
    ColdOptionOpt,
    ColdUrlOpt,
    Command,
    JsonOpt,
    RootOpt,
    RunOpt,
    console,
    fail,
    handle_errors,
    human_bytes,
    make_node,
    parse_kv,
    print_json,
)

__all__ = ["register"]


def _ints(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise fail(f"{what} must be comma-separated integers, got {text!r}", error_type="usage") from None


def profile(
    root: RootOpt,
    run: RunOpt,
    model: Annotated[
        str | None,
        typer.Option("--model", help="stage factory module:function: measure replay times by replaying each stage"),
    ] = None,
    model_arg: Annotated[
        list[str] | None, typer.Option("--model-arg", help="factory keyword KEY=VALUE (repeatable; JSON values)")
    ] = None,
    data_source: Annotated[
        str | None, typer.Option("--data-source", help="data source module:function, for runs that did not log inputs")
    ] = None,
    replay_iterations: Annotated[int, typer.Option("--replay-iterations", min=1, max=1000)] = 2,
    domains: Annotated[
        str | None, typer.Option("--domains", help="failure domain of each stage, e.g. 0,0,1,1 (default: one each)")
    ] = None,
    replicated: Annotated[
        str | None, typer.Option("--replicated", help="1/0 per stage: a replica survives its domain's loss")
    ] = None,
    checkpoint_interval: Annotated[
        int | None, typer.Option("--checkpoint-interval", min=1, help="iterations (default: from the registrations)")
    ] = None,
    restart_s: Annotated[
        float | None, typer.Option("--restart-s", min=0, help="seconds every recovery pays before replaying")
    ] = None,
    cold_url: ColdUrlOpt = None,
    cold_option: ColdOptionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Measure the run's logging costs and keep them as its profile (the group planner's input)."""
    from replay.profile import profile_run, save_profile

    doms, reps = _ints(domains, "--domains"), _ints(replicated, "--replicated")
    with handle_errors():
        node = make_node(root, cold_url, cold_option)
        st = node.store(run)
        p = profile_run(
            st,
            domains=doms,
            replicated=None if reps is None else [bool(x) for x in reps],
            checkpoint_interval=checkpoint_interval,
            restart_s=restart_s,
            replay_iterations=replay_iterations,
            model=model,
            model_args=parse_kv(model_arg, "--model-arg"),
            data_source=data_source,
        )
        save_profile(st, p)
    if json_out:
        print_json(p.to_dict())
        return
    t = Table(title=f"run {run}: costs per iteration (checkpoint every {p.checkpoint_interval} iterations)")
    for col in ("stage", "domain", "replica", "step s", "replay s", "logged at k|k+1 (act + grad)"):
        t.add_column(col, justify="right")
    for k in range(p.num_stages):
        out = human_bytes(int(p.activation_bytes[k] + p.gradient_bytes[k])) if k < p.num_stages - 1 else "-"
        t.add_row(
            str(k),
            str(p.domains[k]),
            "yes" if p.replicated[k] else "no",
            f"{p.step_s[k]:.3f}",
            f"{p.replay_s[k]:.3f}",
            out,
        )
    console.print(t)
    console.print(
        f"fetch {p.fetch_mbps:.0f} MB/s; {human_bytes(int(p.fixed_bytes))} per iteration logged whatever the grouping"
    )
    for field, how in p.sources.items():
        console.print(f"  {field}: {how}")
    console.print(f"saved as the profile of run {run}")


def plan_groups(
    root: RootOpt,
    run: RunOpt,
    budget: Annotated[
        str | None,
        typer.Option("--budget", help="bytes per checkpoint interval (e.g. 2e9, 500MB, 1.5GiB) or N% of logging all"),
    ] = None,
    disk_fraction: Annotated[
        float | None, typer.Option("--disk-fraction", min=0.0, max=1.0, help="fraction of each node's disk")
    ] = None,
    disk_bytes: Annotated[float | None, typer.Option("--disk-bytes", min=1, help="each node's disk size")] = None,
    failures: Annotated[
        float | None, typer.Option("--failures-per-node-hour", min=0.0, help="default: Llama 3's 8-GPU node rate")
    ] = None,
    recovery: Annotated[str, typer.Option("--recovery", help="kill | in_place: how a group recovers")] = "kill",
    max_recovery_s: Annotated[float | None, typer.Option("--max-recovery-s", min=0.0)] = None,
    cold_url: ColdUrlOpt = None,
    cold_option: ColdOptionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Choose logging groups from the run's profile within a storage budget."""
    options: dict[str, Any] = {"recovery": recovery}
    if budget is not None:
        options |= _budget(budget)
    if disk_fraction is not None:
        options |= {"disk_fraction": disk_fraction, "disk_bytes": disk_bytes}
    if failures is not None:
        options["failures_per_domain_hour"] = failures
    if max_recovery_s is not None:
        options["max_recovery_s"] = max_recovery_s
    with handle_errors():
        plan = make_node(root, cold_url, cold_option).plan_groups(run, **options)
    if json_out:
        print_json(plan)
        return
    _print_plan(run, plan)


def _budget(text: str) -> dict[str, float]:
    t = text.strip()
    try:
        if t.endswith("%"):
            return {"budget_fraction": float(t[:-1]) / 100}
        units = {
            "KiB": 1024,
            "MiB": 1024**2,
            "GiB": 1024**3,
            "TiB": 1024**4,
            "KB": 1e3,
            "MB": 1e6,
            "GB": 1e9,
            "TB": 1e12,
        }
        for unit, scale in units.items():
            if t.endswith(unit):
                return {"budget_bytes": float(t[: -len(unit)]) * scale}
        return {"budget_bytes": float(t.removesuffix("B"))}
    except ValueError:
        raise fail(
            f"--budget {text!r} is not a size", hint="e.g. 2e9, 500MB, 1.5GiB or 50%", error_type="usage"
        ) from None


def _print_plan(run: str, plan: dict[str, Any]) -> None:
    t = Table(title=f"run {run}: logging groups within {plan['budget_bytes'] / 1e9:.3g} GB per checkpoint interval")
    for col in ("grouping", "groups", "stored GB / interval", "expected recovery s / hour", "note"):
        t.add_column(col)
    g, a = plan["greedy"], plan["all_logged"]
    rows = [
        ("chosen (exact)", plan["sizes"], plan["stored_bytes"], plan["expected_recovery_s_per_hour"], ""),
        ("SWIFT greedy", g["sizes"], g["stored_bytes"], g["expected_recovery_s_per_hour"], f"gap {g['gap']:.1%}"),
        ("all logged", a["sizes"], a["stored_bytes"], a["expected_recovery_s_per_hour"], "no budget"),
    ]
    for name, sizes, stored, cost, note in rows:
        t.add_row(name, json.dumps(sizes), f"{stored / 1e9:.4g}", f"{cost:.4g}", note)
    console.print(t)
    times = ", ".join(f"{s:.1f} s" for s in plan["recovery_s"])
    console.print(
        f"each group's recovery ({plan['recovery']}): {times}; mean per failure {plan['mean_recovery_s']:.1f} s"
    )
    for w in plan["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {w}")
    console.print(f"use it: ClientConfig(logging_groups={plan['sizes']}) (or the --json document as it is)")


def register(app: typer.Typer) -> None:
    app.command("profile", cls=Command)(profile)
    app.command("plan-groups", cls=Command)(plan_groups)
