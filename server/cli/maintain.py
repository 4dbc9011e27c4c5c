"""Maintenance subcommands: ``verify`` (every checksum), ``gc`` (dry run unless --confirm), ``flush``,
``unregister`` (withdraw a checkpoint registration; a preview unless --confirm)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from server.cli._common import (
    ColdOptionOpt,
    ColdUrlOpt,
    Command,
    JsonOpt,
    RootOpt,
    RunOpt,
    console,
    err_console,
    handle_errors,
    human_bytes,
    make_node,
    print_json,
)
from server.errors import EXIT_PROBLEMS, EXIT_UNAVAILABLE
from server.models import FlushResult, UnregisterRequest, UnregisterResult, VerifyResult

__all__ = ["register"]


def verify(
    root: RootOpt,
    run: Annotated[str | None, typer.Option("--run", "-r", help="run id (default: every run of the root)")] = None,
    cold_url: ColdUrlOpt = None,
    cold_option: ColdOptionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Check every checksum in both tiers. Exits 1 and lists the problems if any record is corrupt (4 when the
    only problem is a cold tier that cannot be listed)."""
    results: list[VerifyResult] = []
    with handle_errors():
        node = make_node(root, cold_url, cold_option)
        runs = [run] if run else node.run_names()
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err_console,
            transient=True,
            disable=json_out or not err_console.is_terminal,
        )
        with progress:
            for r in runs:
                tasks: dict[str, int] = {}

                def cb(tier: str, done: int, total: int, r: str = r, tasks: dict[str, int] = tasks) -> None:
                    if tier not in tasks:
                        tasks[tier] = progress.add_task(f"{r} {tier}", total=total)
                    progress.update(tasks[tier], completed=done, total=total)

                results.append(node.verify(r, progress=cb))
    problems = [(res.run, p) for res in results for p in res.problems]
    if json_out:
        print_json({"ok": not problems, "runs": [r.model_dump(mode="json") for r in results]})
    else:
        for res in results:
            mark = "[green]ok[/]" if res.ok else f"[red]{len(res.problems)} problem(s)[/]"
            console.print(
                f"{res.run}: {mark}  hot records checked {res.hot_checked}, cold records checked "
                f"{res.cold_checked} in {res.cold_segments} segment(s)"
            )
        if not runs:
            console.print(f"no runs under {root}")
        if problems:
            t = Table(title="problems", title_justify="left")
            for col in ("run", "tier", "key", "where", "error"):
                t.add_column(col, overflow="fold")
            for r, p in problems:
                t.add_row(r, p.tier, p.key or "-", p.where, p.error)
            console.print(t)
            err_console.print(
                "[yellow]hint:[/] corrupt records are never returned; replay falls back to another copy "
                "(the cold tier or a peer), and GC removes them once below a checkpoint"
            )
    if problems:
        # the object store down and nothing else wrong: unavailable (4), as for ls / stat, not "problems found"
        unreachable = all(p.tier == "cold" and p.error.startswith("cannot be listed") for _, p in problems)
        raise typer.Exit(EXIT_UNAVAILABLE if unreachable else EXIT_PROBLEMS)


def gc(
    root: RootOpt,
    run: RunOpt,
    confirm: Annotated[bool, typer.Option("--confirm", help="really delete (default: dry run)")] = False,
    cold_url: ColdUrlOpt = None,
    cold_option: ColdOptionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Garbage-collect records below the checkpoint watermarks, in both tiers. Dry run unless --confirm."""
    with handle_errors():
        rep = make_node(root, cold_url, cold_option).gc(run, confirm=confirm)
    if json_out:
        print_json(rep)
        return
    verb = "would delete" if rep.dry_run else "deleted"
    wm = ", ".join(f"stage {w.stage} @ {w.iteration}" for w in rep.watermarks) or "none (nothing is garbage)"
    console.print(f"watermarks: {wm}")
    console.print(
        f"{verb}: {rep.hot_records} hot record(s), {rep.hot_segments} hot segment(s) ({human_bytes(rep.hot_bytes)}), "
        f"{rep.cold_segments} cold segment(s) ({human_bytes(rep.cold_bytes)})"
    )
    if rep.aborted_uploads:
        console.print(f"aborted {len(rep.aborted_uploads)} stale upload(s)")
    if rep.dry_run:
        console.print("dry run: nothing was deleted; pass --confirm to delete")


def flush(
    root: RootOpt,
    run: RunOpt,
    cold_url: ColdUrlOpt = None,
    cold_option: ColdOptionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Upload the sealed segments of the run's writers on this node to the cold tier.

    Open segments belong to their writer process, which seals them (at a segment boundary, on its
    own flush/close, or when it restarts); they are listed, not touched.
    """
    with handle_errors():
        rep = make_node(root, cold_url, cold_option).flush(run)
    if json_out:
        print_json(rep)
    else:
        _print_flush(rep)
    if rep.skipped_writers:  # a writer whose index was left out shipped nothing: not a complete flush
        raise typer.Exit(EXIT_PROBLEMS)


def unregister(
    root: RootOpt,
    run: RunOpt,
    stage: Annotated[int, typer.Option("--stage", "-s", min=0, help="the checkpoint's stage")],
    iteration: Annotated[int, typer.Option("--iteration", "-i", min=0, help="the checkpoint's iteration")],
    confirm: Annotated[bool, typer.Option("--confirm", help="really withdraw it (default: preview)")] = False,
    cold_url: ColdUrlOpt = None,
    cold_option: ColdOptionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Withdraw a checkpoint registration (one made by mistake). Previews the effect unless --confirm: the watermarks
    with it and without it, and what a GC would delete in each case."""
    with handle_errors():
        req = UnregisterRequest(stage=stage, iteration=iteration, confirm=confirm)
        rep = make_node(root, cold_url, cold_option).unregister_checkpoint(run, req)
    if json_out:
        print_json(rep)
        return
    _print_unregister(rep)


def _print_unregister(rep: UnregisterResult) -> None:
    c = rep.checkpoint
    verb = "would withdraw" if rep.dry_run else "withdrew"
    console.print(f"{verb} the registration of stage {c.stage} at iteration {c.iteration} ({c.uri or 'no uri'})")

    def wm(ws: list) -> str:
        return ", ".join(f"stage {w.stage} @ {w.iteration}" for w in ws) or "none"

    console.print(f"watermarks: {wm(rep.watermarks_before)} -> {wm(rep.watermarks_after)}")
    for label, g in (("GC with it", rep.gc_before), ("GC without it", rep.gc_after)):
        console.print(
            f"{label}: {g.hot_records} hot record(s) ({human_bytes(g.hot_bytes)}), "
            f"{g.cold_segments} cold segment(s) ({human_bytes(g.cold_bytes)})"
        )
    for n in rep.notes:
        err_console.print(f"[yellow]note:[/] {n}")
    if rep.dry_run:
        console.print("preview: nothing was changed; pass --confirm to withdraw it")


def _print_flush(rep: FlushResult) -> None:
    for w, why in rep.skipped_writers.items():
        err_console.print(f"[yellow]skipped writer {w}:[/] {why}")
    console.print(
        f"uploaded {rep.uploaded_segments} segment(s) ({human_bytes(rep.uploaded_bytes)}); "
        f"{rep.already_uploaded} already in the cold tier"
    )
    if rep.open_segments:
        t = Table(title="still open in their writer (not flushable from here)", title_justify="left")
        for col in ("writer", "channel", "iterations", "records", "bytes"):
            t.add_column(col)
        for o in rep.open_segments:
            t.add_row(
                o.writer, o.channel, f"{o.first_iteration}..{o.last_iteration}", str(o.records), human_bytes(o.bytes)
            )
        console.print(t)


def register(app: typer.Typer) -> None:
    app.command("verify", cls=Command)(verify)
    app.command("gc", cls=Command)(gc)
    app.command("flush", cls=Command)(flush)
    app.command("unregister", cls=Command)(unregister)
