"""Inspection subcommands: ``ls`` (runs or records), ``stat`` (run summary), ``show`` (one record), ``export``."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from logstore.keys import MAX_ITERATION, MAX_MICRO_BATCH
from server.cli._common import (
    ColdOptionOpt,
    ColdUrlOpt,
    Command,
    JsonOpt,
    OptionalRunOpt,
    RootOpt,
    RunOpt,
    console,
    err_console,
    fail,
    handle_errors,
    human_bytes,
    make_node,
    print_json,
)
from server.errors import EXIT_UNAVAILABLE, EXIT_USAGE
from server.models import KIND_NAMES, RecordDetail, RecordEntry, RecordPage, RunSummary

__all__ = ["register"]

_KINDS = list(KIND_NAMES)


def _it_range(lo: int | None, hi: int | None) -> str:
    return "-" if lo is None else f"{lo}..{hi}"


def _records_table(run: str, records: list[RecordEntry]) -> Table:
    t = Table(title=f"records of {run}", title_justify="left")
    for col, just in (
        ("key", "left"),
        ("tier", "left"),
        ("writer", "left"),
        ("stored", "right"),
        ("raw", "right"),
        ("checksum", "left"),
    ):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for r in records:
        t.add_row(r.key, r.tier, r.writer, human_bytes(r.stored_bytes), human_bytes(r.raw_bytes), r.checksum)
    return t


def ls(
    root: RootOpt,
    run: OptionalRunOpt = None,
    channel: Annotated[str | None, typer.Option("--channel", "-c", help="e.g. act_0_1, grad_2_1, input_0")] = None,
    kind: Annotated[str | None, typer.Option("--kind", "-k", help="/".join(_KINDS))] = None,
    it_lo: Annotated[int, typer.Option("--it-lo", min=0, max=MAX_ITERATION, help="first iteration")] = 0,
    it_hi: Annotated[
        int | None, typer.Option("--it-hi", min=0, max=MAX_ITERATION, help="end iteration (exclusive)")
    ] = None,
    micro_batch: Annotated[int | None, typer.Option("--mb", min=0, max=MAX_MICRO_BATCH, help="micro-batch")] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, max=100_000, help="page size")] = 100,
    cursor: Annotated[str | None, typer.Option("--cursor", help="continue after a previous page")] = None,
    all_pages: Annotated[bool, typer.Option("--all", help="every page, not just the first")] = False,
    cold_url: ColdUrlOpt = None,
    cold_option: ColdOptionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List the runs of the store root, or (with --run) the records of a run.

    With the cold tier unreachable, lists what the hot tier holds, says so, and exits 4."""
    if kind is not None and kind not in _KINDS:
        raise fail(f"unknown kind {kind!r}", hint="use one of " + ", ".join(_KINDS))
    with handle_errors():
        node = make_node(root, cold_url, cold_option)
        if run is None:
            runs = node.runs()
            if json_out:
                print_json(runs)
                return
            if not runs.runs:
                console.print(f"no runs under {root}")
                return
            t = Table(title=f"runs under {root}", title_justify="left")
            t.add_column("run")
            t.add_column("writers")
            for r in runs.runs:
                t.add_row(r.run, ", ".join(r.writers))
            console.print(t)
            return
        records: list[RecordEntry] = []
        cold_error: str | None = None
        first_page = cursor is None
        while True:
            page = node.records(
                run,
                channel=channel,
                kind=kind,
                it_lo=it_lo,
                it_hi=it_hi,
                micro_batch=micro_batch,
                limit=limit,
                cursor=cursor,
            )
            records += page.records
            cold_error = cold_error or page.cold_error
            cursor = page.next_cursor
            if not all_pages or cursor is None:
                break
        if cold_error:
            err_console.print(f"[yellow]cold tier:[/] {cold_error}")
        if json_out:
            print_json(RecordPage(run=run, records=records, next_cursor=cursor, cold_error=cold_error))
        elif not records and first_page:
            filtered = any(x is not None for x in (channel, kind, it_hi, micro_batch)) or it_lo > 0
            _print_no_records(node.summary(run, fresh=True), filtered)
        else:
            console.print(_records_table(run, records))
            if cursor is not None:
                console.print(f"more: --cursor {cursor}  (or --all)")
    if cold_error:  # the hot tier's records are printed; exit 4 says the listing is not the whole run
        raise typer.Exit(EXIT_UNAVAILABLE)


def _print_no_records(s: RunSummary, filtered: bool) -> None:
    """Why ``ls`` lists nothing: what GC collected and by which checkpoints, or that nothing is logged."""
    console.print(f"no records of run {s.run}" + (" match the filters" if filtered else " are left on this node"))
    if s.hot.collected:
        console.print(_collected_line(s), soft_wrap=True)
    if s.watermarks:
        wm = ", ".join(f"stage {w.stage} @ {w.iteration}" for w in s.watermarks)
        console.print(f"checkpoint watermarks: {wm} (what a stage received below its own is garbage)", soft_wrap=True)
    elif not s.hot.collected:
        where = "" if s.cold is not None else " (other nodes' records are in the cold tier: --cold-url)"
        console.print(f"no checkpoint is registered and GC collected nothing: nothing was logged here{where}")


def _collected_line(s: RunSummary) -> str:
    total = sum(c.records for c in s.hot.collected)
    by = ", ".join(f"{c.records} below stage {c.stage}'s checkpoint at iteration {c.below}" for c in s.hot.collected)
    return f"garbage collection deleted {total} record(s) logged here: {by}"


def stat(
    root: RootOpt,
    run: RunOpt,
    cold_url: ColdUrlOpt = None,
    cold_option: ColdOptionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Summary of a run: stages, channels and iteration ranges per tier, bytes, checkpoints, gaps.

    With the cold tier unreachable, prints what this node's hot tier knows, names what is
    incomplete, and exits 4."""
    with handle_errors():
        s = make_node(root, cold_url, cold_option).summary(run, fresh=True)
    if json_out:
        print_json(s)
    else:
        _print_summary(s)
    if s.incomplete:  # printed what the hot tier knows; a script must not take it for the whole picture
        raise typer.Exit(EXIT_UNAVAILABLE)


def _print_summary(s: RunSummary) -> None:
    ratio = f"{s.compression_ratio:.2f}x" if s.compression_ratio else "-"
    console.print(f"[bold]run {s.run}[/]  stages {s.stages}  compression {ratio}")
    tiers = Table(title="tiers", title_justify="left")
    for col in ("tier", "records", "stored", "raw", "iterations", "on disk / objects", "segments"):
        tiers.add_column(col)
    h = s.hot
    seg = h.segments
    tiers.add_row(
        "hot",
        str(h.records),
        human_bytes(h.stored_bytes),
        human_bytes(h.raw_bytes),
        _it_range(h.first_iteration, h.last_iteration),
        human_bytes(h.disk_bytes),
        f"open {seg.open}, sealed {seg.sealed}, uploaded {seg.uploaded}, evicted {seg.evicted}",
    )
    if s.cold is not None:
        c = s.cold
        tiers.add_row(
            "cold",
            str(c.records),
            human_bytes(c.stored_bytes),
            human_bytes(c.raw_bytes),
            _it_range(c.first_iteration, c.last_iteration),
            human_bytes(c.object_bytes),
            str(c.segments),
        )
    else:
        tiers.add_row("cold", "-", "-", "-", "-", "-", "not configured (--cold-url)")
    console.print(tiers)
    if s.cold is not None and s.cold.error:
        err_console.print(f"[yellow]cold tier:[/] {s.cold.error}")
    for w, why in s.hot.unreadable.items():  # its records are counted only where the cold tier has them
        err_console.print(f"[yellow]hot tier {w} left out:[/] {why}")
    ch = Table(title="channels", title_justify="left")
    for col in ("channel", "owner", "hot records", "hot iterations", "cold records", "cold iterations"):
        ch.add_column(col)
    for c in s.channels:
        cells = [c.name, str(c.owner)]
        for t in (c.hot, c.cold):
            cells += [str(t.records), _it_range(t.first_iteration, t.last_iteration)] if t else ["-", "-"]
        ch.add_row(*cells)
    console.print(ch)
    if s.hot.collected:
        console.print(_collected_line(s), soft_wrap=True)
    if s.checkpoints:
        cp = Table(title="checkpoints", title_justify="left")
        for col in ("stage", "iteration", "uri"):
            cp.add_column(col)
        for c in s.checkpoints:
            cp.add_row(str(c.stage), str(c.iteration), c.uri or "-")
        console.print(cp)
        console.print("watermarks: " + ", ".join(f"stage {w.stage} @ {w.iteration}" for w in s.watermarks))
    elif "checkpoints" in s.incomplete:
        console.print("checkpoints: unknown (the cold tier, where they are registered, cannot be read)")
    else:
        console.print("checkpoints: none registered")
    if s.gaps:
        g = Table(title="gaps (records that were not logged)", title_justify="left")
        for col in ("channel", "iteration", "micro-batch", "reason"):
            g.add_column(col)
        for x in s.gaps:
            g.add_row(x.channel, str(x.iteration), str(x.micro_batch), x.reason)
        console.print(g)
    elif "gaps" in s.incomplete:
        console.print("gaps: unknown (the cold tier cannot be read)")
    else:
        console.print(
            "gaps: none (no record was noted as dropped; "
            "`swiftlog verify` or `swiftlog replay --plan-only` find missing ones)"
        )
    if s.incomplete:
        console.print(
            f"[yellow]incomplete:[/] {', '.join(s.incomplete)} as this node's hot tier knows them "
            "(cold tier unreachable)"
        )


def show(
    key: Annotated[str, typer.Argument(help="record key, e.g. act_0_1/it5/mb2/p0")],
    root: RootOpt,
    run: RunOpt,
    stats: Annotated[bool, typer.Option("--stats/--no-stats", help="decode and compute min/max/mean/norm")] = True,
    cold_url: ColdUrlOpt = None,
    cold_option: ColdOptionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """One record: where it lives, dtype, shape, codec, checksums and tensor statistics."""
    with handle_errors():
        d = make_node(root, cold_url, cold_option).record(run, key, with_stats=stats)
    if json_out:
        print_json(d)
        return
    _print_detail(d)


def _print_detail(d: RecordDetail) -> None:
    t = Table(show_header=False, title=d.key, title_justify="left")
    t.add_column("field")
    t.add_column("value")
    rows = [
        ("tier / writer", f"{d.tier} / {d.writer or '-'}"),
        ("dtype", d.dtype),
        ("shape", "x".join(str(x) for x in d.shape) or "scalar"),
        ("codec", d.codec),
        ("raw / stored", f"{human_bytes(d.raw_bytes)} / {human_bytes(d.stored_bytes)}"),
        ("blob checksum", d.checksum),
        ("raw checksum", d.raw_checksum),
    ]
    if d.stats is not None:
        s = d.stats
        fmt = lambda x: "-" if x is None else f"{x:.6g}"  # noqa: E731
        rows += [
            ("min / max", f"{fmt(s.min)} / {fmt(s.max)}"),
            ("mean", fmt(s.mean)),
            ("norm", fmt(s.norm)),
            ("nan / inf", f"{s.nan_count} / {s.inf_count}"),
        ]
    elif d.meta is None:
        rows.append(("stats", d.stats_skipped or "-"))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    if d.meta is not None:
        console.print_json(json.dumps(d.meta))


def export(
    key: Annotated[str, typer.Argument(help="record key, e.g. act_0_1/it5/mb2/p0")],
    root: RootOpt,
    run: RunOpt,
    output: Annotated[Path, typer.Option("--output", "-o", help="file to write: .pt (torch.save) or .npy (numpy)")],
    fmt: Annotated[str | None, typer.Option("--format", help="pt or npy (default: from the file name)")] = None,
    force: Annotated[bool, typer.Option("--force", help="overwrite an existing file")] = False,
    cold_url: ColdUrlOpt = None,
    cold_option: ColdOptionOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Write one record's tensor to a .pt or .npy file (checksum-verified on the way)."""
    if fmt is not None and fmt.lower() not in ("pt", "npy"):
        raise fail(f"--format {fmt!r} is not pt or npy")
    fmt = (fmt or output.suffix.lstrip(".")).lower()
    if fmt not in ("pt", "npy"):
        raise fail(
            f"cannot tell the format of {str(output)!r}", hint="name the file *.pt or *.npy, or pass --format pt|npy"
        )
    if output.exists() and not force:
        raise fail(f"{str(output)!r} exists", hint="pass --force to overwrite it", code=EXIT_USAGE)
    with handle_errors():
        k, t = make_node(root, cold_url, cold_option).tensor(run, key)
    note = None
    out_dir = output.parent if str(output.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{output.name}.", suffix=".tmp")
    except OSError as e:
        raise fail(
            f"cannot write {str(output)!r}: {e.strerror or e}", hint="check that its directory exists and is writable"
        ) from None
    try:
        with os.fdopen(fd, "wb") as f:
            if fmt == "pt":
                import torch

                torch.save(t, f)
            else:
                import numpy as np

                try:
                    arr = t.numpy()
                except TypeError:  # numpy has no bfloat16 / float8: widen, exactly
                    import torch

                    wide = torch.complex64 if t.is_complex() else torch.float32
                    dtype, saved_as = str(t.dtype).removeprefix("torch."), str(wide).removeprefix("torch.")
                    note = f"{dtype} has no numpy dtype; saved as {saved_as} (exact)"
                    arr = t.to(wide).numpy()
                np.save(f, arr, allow_pickle=False)
        os.replace(tmp, output)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, (OSError, RuntimeError)) and not isinstance(
            e, KeyboardInterrupt
        ):  # a full disk, a file size limit (torch says "unexpected pos")
            raise fail(
                f"cannot write {str(output)!r}: {type(e).__name__}: {e}",
                hint="check the free space and the file size limit",
                code=EXIT_UNAVAILABLE,
            ) from None
        raise
    shape = list(t.shape)
    dtype = str(t.dtype).removeprefix("torch.")
    if json_out:
        print_json({"key": str(k), "path": str(output), "format": fmt, "dtype": dtype, "shape": shape, "note": note})
        return
    if note:
        err_console.print(f"[yellow]note:[/] {note}")
    console.print(f"wrote {output} ({fmt}, {dtype}, shape {shape})")


def register(app: typer.Typer) -> None:
    app.command("ls", cls=Command)(ls)
    app.command("stat", cls=Command)(stat)
    app.command("show", cls=Command)(show)
    app.command("export", cls=Command)(export)
