"""``swiftlog simulate``: a large job's training time under failures, per recovery strategy.

A discrete-event simulation (``replay.sim``) of a job in a stated layout, its inputs measured by
this project's benches where they were (``--results``) and assumed elsewhere, each one's source
printed beside the result. One ``--gpus``: a table of each strategy's total time, wasted fraction
and its breakdown; several: the wasted fraction per job size (``--plot`` draws it). ``--flips``
adds the inputs that, four times smaller or larger, change the best strategy. ``--json`` prints
the whole result. Exit 2 for a layout or an input that makes no sense.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from server.cli._common import Command, JsonOpt, console, fail, parse_kv, print_json

__all__ = ["register"]

_PRESETS = ("llama3-405b", "replicated-405b")


def simulate(
    gpus: Annotated[
        list[int] | None, typer.Option("--gpus", "-n", min=8, help="job size(s); several give a sweep")
    ] = None,
    preset: Annotated[
        str, typer.Option("--preset", help="llama3-405b (TP8 x PP16 x FSDP, no replica) | replicated-405b (x DDP2)")
    ] = "llama3-405b",
    layout: Annotated[
        str | None, typer.Option("--layout", help="TP,PP,SHARD,REPLICATE (overrides the preset), e.g. 8,16,128,1")
    ] = None,
    strategy: Annotated[list[str] | None, typer.Option("--strategy", help="only these strategies (repeatable)")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="an input KEY=VALUE (repeatable), e.g. restart_job_s=300")
    ] = None,
    results: Annotated[
        Path | None, typer.Option("--results", help="bench results directory (default: the project's)")
    ] = None,
    reps: Annotated[int, typer.Option("--reps", min=2, max=10000, help="simulated runs per strategy")] = 20,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    show_flips: Annotated[bool, typer.Option("--flips", help="which inputs change the best strategy")] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="PNG: wasted fraction vs job size")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Simulate a large job's training time under failures, one row per recovery strategy."""
    from replay.sim import flips, sweep

    if preset not in _PRESETS:
        raise fail(f"--preset {preset!r} is not one of {list(_PRESETS)}")
    given = parse_kv(set_, "--set")
    try:
        lay, inputs = _job(preset, layout, results, given)
        sizes = sorted(set(gpus)) if gpus else [lay.gpus]
        runs = sweep(lay, inputs, sizes, strategy, reps=reps, seed=seed)
        flipped = flips(lay.with_gpus(sizes[-1]), inputs, strategy) if show_flips else None
    except (ValueError, TypeError) as e:
        raise fail(f"{e}", error_type="bad_input") from None
    doc: dict[str, Any] = {"sizes": {str(n): r.to_dict() for n, r in runs.items()}}
    if flipped is not None:
        doc["flips"] = flipped
    if plot is not None:
        doc["plot"] = _plot(runs, plot)
    if json_out:
        print_json(doc)
        return
    for r in runs.values():
        _print_run(r)
    if len(runs) > 1:
        _print_sweep(runs)
    if flipped is not None:
        _print_flips(flipped)
    last = runs[sizes[-1]]
    console.print("inputs:")
    for name, how in sorted(last.inputs.sources.items()):
        console.print(f"  {name} = {getattr(last.inputs, name)!r}: {how}")
    console.print("rules:")
    for name, rule in last.assumptions.items():
        console.print(f"  {name}: {rule}")


def _job(preset: str, layout: str | None, results: Path | None, given: dict[str, Any]) -> tuple[Any, Any]:
    """The layout (the preset's, or ``--layout``) and the inputs (measured, then ``--set``)."""
    from replay.sim import LLAMA3_405B, REPLICATED_405B, Layout, measured_inputs

    lay = {"llama3-405b": LLAMA3_405B, "replicated-405b": REPLICATED_405B}[preset]
    if layout is not None:
        parts = [int(v) for v in layout.split(",")]
        if len(parts) != 4:
            raise ValueError(f"--layout needs 4 comma-separated integers, got {layout!r}")
        lay = Layout(*parts)
    inputs = measured_inputs(results)
    return lay, inputs.with_(**given) if given else inputs


def _print_run(r: Any) -> None:
    t = Table(title=f"{r.layout.describe()}: {r.inputs.work_s / 86400:.0f} days of training, {r.reps} runs each")
    cols = ("strategy", "total days", "wasted", "lost work", "ckpt", "restart+detect", "replay+copy", "overhead")
    for c in cols:
        t.add_column(c, justify="right" if c != "strategy" else "left", no_wrap=c == "strategy")
    for row in sorted(r.rows, key=lambda x: x.total_s):
        b = row.breakdown
        t.add_row(
            row.strategy,
            f"{row.total_s / 86400:.2f} ± {row.ci95_s / 86400:.2f}",
            f"{row.wasted_fraction:.2%} ± {row.wasted_ci95:.2%}",
            f"{b['lost_work']:.2%}",
            f"{b['checkpoint']:.2%}",
            f"{b['restart'] + b['detection'] + b['load']:.2%}",
            f"{b['replay'] + b['copy']:.2%}",
            f"{b['logging_overhead']:.2%}",
        )
    console.print(t)
    for row in r.rows:
        mem = f", in memory every {row.memory_s / 60:.1f} min" if row.memory_s else ""
        groups = f", logging groups {row.groups}" if row.groups and any(g > 1 for g in row.groups) else ""
        note = f" ({'; '.join(row.notes)})" if row.notes else ""
        console.print(f"  {row.strategy}: checkpoint every {row.persistent_s / 60:.1f} min{mem}{groups}{note}")
    for name, why in r.skipped.items():
        console.print(f"  {name}: not simulated: {why}")


def _print_sweep(runs: dict[int, Any]) -> None:
    names = sorted({row.strategy for r in runs.values() for row in r.rows})
    t = Table(title="wasted fraction by job size")
    t.add_column("GPUs", justify="right")
    for n in names:
        t.add_column(n, justify="right")
    for size, r in runs.items():
        by = {row.strategy: row.wasted_fraction for row in r.rows}
        t.add_row(str(size), *(f"{by[n]:.2%}" if n in by else "-" for n in names))
    console.print(t)


def _print_flips(f: dict[str, Any]) -> None:
    ranking = ", ".join(f"{n} {w:.2%}" for n, w in f["ranking"])
    console.print(f"first-order ranking: {ranking}")
    if not f["flips"]:
        console.print(f"no input x{f['factors']} changes the best strategy")
    for c in f["flips"]:
        console.print(f"  {c['input']} x{c['factor']:g} ({c['value']:.4g}): {c['best']} becomes the best")


def _plot(runs: dict[int, Any], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise fail("--plot needs matplotlib", hint="pip install 'swiftlog[demo]'", code=4) from None
    from replay.sim import wasted_series

    fig, ax = plt.subplots(figsize=(6, 4))
    for n, (xs, ys) in wasted_series(runs).items():
        ax.plot(xs, [y * 100 for y in ys], marker="o", label=n)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("wasted %")
    ax.set_title(next(iter(runs.values())).layout.describe().split(" (")[0] + " (shard degree grows)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def register(app: typer.Typer) -> None:
    app.command("simulate", cls=Command)(simulate)
