"""``swiftlog demo``: pipeline training with an injected failure, recovered in place, vs a global rollback.

What it does, in a temporary directory (or ``--dir``), on the embedded defaults (each stage's
local LMDB store root under ``{dir}/<run>/nodes``, a local directory as the cold tier, checkpoints
in a local directory standing for durable storage):

1. trains the example GPT on 4 stage processes (gloo on CPU) without a failure: the reference;
2. trains it again and SIGKILLs one stage mid-interval between checkpoints; the survivors keep
   their state, the replacement replays the lost stage from its checkpoint and the neighbours'
   logs, verifies every regenerated send against the receivers' digests, and the pipeline
   re-forms and finishes (:mod:`replay.launcher`, ``mode="swift"``);
3. trains it a third time with the same failure handled by a global rollback (every stage
   restarts from the same checkpoint and redoes the lost iterations);
4. prints a report (where the failure hit, the recovery plan, detect / fetch / replay / rejoin,
   bytes fetched, verification, final state of every stage vs the reference bit for bit, the
   rollback's cost) and writes ``report.json``, ``report.md`` and ``progress.png`` (iteration vs
   wall time for both strategies) to the directory;
5. says where the SWIFT run's stores are (node roots, cold tier, checkpoints) and which commands
   to try on them. By default the last checkpoint is at the last iteration, so GC has deleted
   every record by then: ``swiftlog ls`` and ``stat`` say how many, and by which checkpoint.

Options are checked before anything starts: a closed set (``--phase``) is a choice, and a failure
iteration outside the run is refused.

Exit 0 when recovery verified and every stage's final state equals the reference, 1 otherwise.

Never: starts a training with an option it will refuse later.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from server.cli._common import Command, JsonOpt, console, deprecated_alias, fail, handle_errors, human_bytes, print_json
from server.errors import EXIT_PROBLEMS, EXIT_UNAVAILABLE, DemoRunError

__all__ = ["register", "run_demo", "Phase"]

RUN = "demo-run"


class Phase(StrEnum):
    """Where the demo's SIGKILL lands: the example script's kill phases that a failure between two
    checkpoints reaches (``checkpoint`` fires only at a checkpoint iteration, ``recovering`` only
    during a recovery: neither would kill anything here)."""

    forward = "forward"
    backward = "backward"
    commit = "commit"
    optimizer = "optimizer"
    upload = "upload"


def _failure_iteration(iterations: int, checkpoint_every: int) -> int:
    """Where the demo's failure hits: half-way between the first two checkpoints. Raises a usage
    error naming the options when that is not inside the run."""
    it = checkpoint_every + checkpoint_every // 2
    if not 0 < it < iterations:
        raise typer.BadParameter(
            f"--checkpoint-every {checkpoint_every} puts the failure at iteration {it}, "
            f"not before --iterations {iterations}",
            param_hint="'--checkpoint-every'",
        )
    return it


def _progress(run: Any) -> list[tuple[int, float]]:
    """(iteration, seconds since iteration 0 was applied) of every iteration the last stage applied,
    across restarts (a rollback applies some iterations twice)."""
    t_first = run.progress[0][1]
    return [(it, t - t_first) for it, t, _ in run.progress]


def _plot(path: Path, series: dict[str, list[tuple[int, float]]], kill_s: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    styles = {
        "failure-free": ("#999999", ":"),
        "SWIFT in-place recovery": ("#1f77b4", "-"),
        "global rollback": ("#d62728", "--"),
    }
    for name, pts in series.items():
        color, ls = styles.get(name, (None, "-"))
        ax.plot(
            [t for _, t in pts],
            [i + 1 for i, _ in pts],
            ls,
            color=color,
            label=name,
            marker=".",
            markersize=3,
        )
    for name, t in kill_s.items():
        ax.axvline(t, color=styles.get(name, ("k", ""))[0], alpha=0.3)
    ax.set_xlabel("wall time since iteration 0 was applied (s); vertical lines: the SIGKILL")
    ax.set_ylabel("iterations applied (last stage)")
    ax.set_title("Training progress with a stage failure")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_demo(
    workdir: Path,
    *,
    iterations: int = 20,
    checkpoint_every: int = 10,
    fail_stage: int = 2,
    fail_iteration: int | None = None,
    phase: str = "backward",
    replay_workers: int = 1,
    dp: int = 1,
    say: Any = None,
) -> dict[str, Any]:
    """Run the trainings under ``workdir``; return the report (``ok``: recovery verified and
    bit-exact). Writes report.json, report.md and progress.png there. ``dp`` > 1: the pipeline
    runs as ``dp`` data-parallel replicas; one replica of the stage is lost (copied from a live
    one: ``report["replica_recovery"]``), and in the logging run every replica of it is lost at
    once (replayed together from their logs)."""
    from replay.compare import states_equal
    from replay.launcher import KillSpec, resumed_after_rollback, run_with_failures

    say = say or (lambda *_: None)
    phase = str(getattr(phase, "value", phase))
    if phase not in [p.value for p in Phase]:  # a phase this demo never reaches: three trainings for nothing
        raise ValueError(f"phase {phase!r} is not one of {', '.join(p.value for p in Phase)}")
    fail_iteration = fail_iteration if fail_iteration is not None else _failure_iteration(iterations, checkpoint_every)
    if not 0 < fail_iteration < iterations:
        raise typer.BadParameter(f"the failure iteration {fail_iteration} must be inside (0, {iterations})")
    ckpts = ",".join(str(i) for i in range(checkpoint_every, iterations + 1, checkpoint_every))
    kill = KillSpec(fail_stage, fail_iteration, 1, phase)
    lost = [KillSpec(fail_stage, fail_iteration, 1, phase, replica=r) for r in range(dp)]  # every replica
    rank = fail_stage * dp  # the killed stage's replica 0: its rank in the mesh
    world = 4 * dp
    model = ["--hidden", "64", "--layers", "1", "--seq", "32", "--n-microbatches", "4"]

    def launch(name: str, kills: list[KillSpec], mode: str) -> Any:
        base = workdir / name
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        args = [
            "--schedule",
            "1f1b",
            "--iters",
            str(iterations),
            "--ckpt-at",
            ckpts,
            "--seed",
            "1234",
            # with replicas each reads its own data, logged (a data source knows no replica)
            *(["--data-source"] if dp == 1 else []),
            "--segment-iters",
            "2",
            "--cold-url",
            f"file://{(base / 'cold').resolve()}",
            *model,
        ]
        r = run_with_failures(
            args,
            run_id=RUN,
            base_dir=str(base.resolve()),
            checkpoint_url=f"file://{(base / 'ckpt').resolve()}",
            kills=kills,
            mode=mode,
            timeout_s=240,
            replay_workers=replay_workers,
            dp_replicate=dp,
        )
        if not r.ok:
            raise DemoRunError(f"the {name} run did not finish:\n{r.describe()}")
        return r

    t0 = time.perf_counter()
    n = 4 if dp == 1 else 5
    mesh = "4 stages" if dp == 1 else f"4 stages x {dp} replicas ({world} processes)"
    say(f"[bold]1/{n}[/] failure-free reference: {iterations} iterations, {mesh}, 1F1B, checkpoints at {ckpts}")
    ref = launch("reference", [], "swift")
    say(f"    done in {ref.wall_s:.1f} s")
    replica = None
    if dp > 1:
        one = KillSpec(fail_stage, fail_iteration, 1, phase, replica=dp - 1)
        say(
            f"[bold]2/{n}[/] SWIFT, a replica lost: SIGKILL stage {one.stage} replica {one.replica} at iteration "
            f"{one.iteration}, {one.phase}; a live replica's state is copied"
        )
        replica = launch("replica", [one], "swift")
        say(f"    done in {replica.wall_s:.1f} s")
    what = f"stage {kill.stage}" if dp == 1 else f"every replica of stage {kill.stage}"
    say(
        f"[bold]{n - 2}/{n}[/] SWIFT from the logs: SIGKILL {what} at iteration {kill.iteration}, "
        f"micro-batch {kill.micro_batch}, {kill.phase}"
    )
    sw = launch("swift", lost, "swift")
    say(f"    done in {sw.wall_s:.1f} s")
    say(f"[bold]{n - 1}/{n}[/] global rollback: the same failure, every rank restarts from the last checkpoint")
    rb = launch("rollback", lost, "rollback")
    say(f"    done in {rb.wall_s:.1f} s")

    t = sw.timings[0]
    rec = sw.results[rank].get("recovered") or {}
    diffs = {k: states_equal(sw.results[k], ref.results[k]) for k in range(world)}
    rb_diffs = {k: states_equal(rb.results[k], ref.results[k]) for k in range(world)}
    rollback_s = resumed_after_rollback(rb, t["resume"])
    rb_ck = next((e["checkpoint"] for e in rb.timeline if e["what"] == "rollback"), None)
    report: dict[str, Any] = {
        "workdir": str(workdir),
        "run": RUN,
        "failure": {
            "stage": kill.stage,
            "iteration": kill.iteration,
            "micro_batch": kill.micro_batch,
            "phase": kill.phase,
        },
        "replay_workers": replay_workers,
        "plan": {
            "failed_stages": t["failed_stages"],
            "survivors": [k for k in range(world) if k not in t["failed_stages"]],
            "checkpoint_iteration": t["checkpoint_iteration"],
            "resume_iteration": t["resume"],
            "replayed_iterations": [t["checkpoint_iteration"], t["resume"]],
            "sources": "survivors' node stores (hot tier, read directly) + the cold tier",
            "checkpoint": rec.get("checkpoint_uri"),
            "why": rec.get("why"),
        },
        "dp_replicate": dp,
        "timings_s": {
            k: t.get(k)
            for k in (
                "detect_s",
                "all_detected_s",
                "survivors_reported_s",
                "scheduler_s",
                "replacement_start_s",
                "wait_survivors_s",
                "fetch_s",
                "replay_s",
                "rejoin_s",
                "resumed_s",
            )
        },
        "bytes_fetched": t.get("bytes_fetched"),
        "records_fetched": t.get("records_fetched"),
        "verification": {"verified": t.get("verified"), "digests_checked": t.get("digests_checked")},
        "final_state": {"bit_exact": not any(diffs.values()), "per_stage": {str(k): (not v) for k, v in diffs.items()}},
        "global_rollback": {
            "checkpoint_iteration": rb_ck,
            "resumed_s": rollback_s,
            "bit_exact": not any(rb_diffs.values()),
            "iterations_redone": None if rb_ck is None else t["resume"] - rb_ck,
        },
        "recovery_vs_global_rollback": (t["resumed_s"] / rollback_s) if rollback_s else None,
        "wall_s": {
            "reference": ref.wall_s,
            "swift": sw.wall_s,
            "rollback": rb.wall_s,
            "demo": time.perf_counter() - t0,
        },
    }
    report["ok"] = bool(t.get("verified")) and report["final_state"]["bit_exact"]
    if replica is not None:
        report["replica_recovery"] = _replica_report(replica, ref, fail_stage, dp, rollback_s)
        report["ok"] = report["ok"] and report["replica_recovery"]["bit_exact"]
    last_checkpoint = iterations // checkpoint_every * checkpoint_every
    report["stores"] = _stores(workdir / "swift", sw.timeline, last_checkpoint=last_checkpoint)
    report["try"] = _next_commands(report["stores"], kill.stage, workdir, dp)
    logs = "SWIFT in-place recovery" if dp == 1 else "SWIFT: every replica lost, replayed from the logs"
    series = {"failure-free": _progress(ref)}
    # same time base as the series: since the run's iteration 0 was applied
    kills = {}
    if replica is not None:
        series["SWIFT: a replica lost, copied"] = _progress(replica)
        kills["SWIFT: a replica lost, copied"] = min(replica.kill_times.values()) - replica.progress[0][1]
    series[logs] = _progress(sw)
    series["global rollback"] = _progress(rb)
    kills[logs] = min(sw.kill_times.values()) - sw.progress[0][1]
    kills["global rollback"] = min(rb.kill_times.values()) - rb.progress[0][1]
    _plot(workdir / "progress.png", series, kills)
    report["files"] = {
        "json": str(workdir / "report.json"),
        "markdown": str(workdir / "report.md"),
        "plot": str(workdir / "progress.png"),
    }
    report["progress"] = {k: [[i, round(s, 4)] for i, s in v] for k, v in series.items()}
    (workdir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (workdir / "report.md").write_text(_markdown(report))
    return report


def _replica_report(run: Any, ref: Any, stage: int, dp: int, rollback_s: float | None) -> dict[str, Any]:
    """The replica run's recovery: which rank, copied from which, how fast, and the final state."""
    from replay.compare import states_equal

    lost = stage * dp + dp - 1
    t = run.timings[0]
    rec = run.results[lost].get("recovered") or {}
    (got,) = run.results[lost].get("transfers") or [{}]
    return {
        "failed_ranks": t["failed_stages"],
        "path": rec.get("path"),
        "donor": rec.get("donor"),
        "why": rec.get("why"),
        "resume_iteration": t["resume"],
        "resumed_s": t["resumed_s"],
        "replacement_start_s": t.get("replacement_start_s"),
        "state_bytes": got.get("bytes"),
        "transfer_s": got.get("seconds"),
        "gb_per_s": got.get("gb_per_s"),
        "bit_exact": not any(states_equal(run.results[k], ref.results[k]) for k in ref.results),
        "vs_global_rollback": (t["resumed_s"] / rollback_s) if rollback_s else None,
    }


def _stores(base: Path, timeline: list[dict[str, Any]], *, last_checkpoint: int) -> dict[str, Any]:
    """Where the SWIFT run's data lives: every stage process's node store root (a replacement's
    too), the cold tier and the checkpoints, as the launcher laid them out under ``base``."""
    base = base.resolve()
    roots = {e["name"]: str(base / "nodes" / e["name"]) for e in timeline if e["what"] == "start"}
    return {
        "run": RUN,
        "node_roots": roots,
        "cold_url": f"file://{base / 'cold'}",
        "checkpoints": f"file://{base / 'ckpt'}",
        "last_checkpoint": last_checkpoint,
    }


def _next_commands(stores: dict[str, Any], failed: int, workdir: Path, dp: int = 1) -> list[str]:
    """Commands to try on the demo's stores, with their real paths: over the node root of a
    neighbour of the failed stage (it logged what the failed stage received)."""
    from trainer_client.mesh import replica_run

    k = failed - 1 if failed > 0 else 1
    neighbour = f"stage{k}-g0" if dp == 1 else f"stage{k}-dp0-g0"
    run = replica_run(RUN, 0, dp)  # replica 0's pipeline
    root = shlex.quote(stores["node_roots"][neighbour])
    cold = shlex.quote(stores["cold_url"])
    return [
        f"swiftlog stat --root {root} --run {run} --cold-url {cold}",
        f"swiftlog ls --root {root} --run {run} --cold-url {cold}",
        f"swiftlog serve --root {root} --cold-url {cold}",
        f"swiftlog demo --phase forward --workers 2 --dir {shlex.quote(str(workdir))}",
    ]


def _print_next(r: dict[str, Any], iterations: int) -> None:
    """Where the SWIFT run's stores are, and what to try on them."""
    st = r["stores"]
    console.print(f"\n[bold]Stores[/] of the SWIFT run (run id {st['run']}):")
    for name, root in st["node_roots"].items():
        console.print(f"  node root    {name:10} {root}", soft_wrap=True, markup=False)
    console.print(f"  cold tier    {st['cold_url']}", soft_wrap=True, markup=False)
    console.print(f"  checkpoints  {st['checkpoints']}", soft_wrap=True, markup=False)
    last = st["last_checkpoint"]
    if last >= iterations:  # what `swiftlog ls` finds: nothing, unless it says why
        console.print(f"  the checkpoint at iteration {last}, the last, made every record garbage: GC deleted them")
    else:
        console.print(f"  records from iteration {last} on are kept: no checkpoint after them made them garbage")
    what = [
        "checkpoints, watermarks, what GC collected",
        "the records left, and what collected the others",
        "the admin API on http://127.0.0.1:8765 (see /docs)",
        "another failure, replayed by 2 processes",
    ]
    console.print("[bold]Try next[/]")
    for cmd, why in zip(r["try"], what, strict=True):
        console.print(f"  {cmd}", soft_wrap=True, markup=False)
        console.print(f"      [dim]# {why}[/]")


def _fmt(v: Any) -> str:
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def _markdown(r: dict[str, Any]) -> str:
    f, p, tm, g = r["failure"], r["plan"], r["timings_s"], r["global_rollback"]
    lines = [
        "# swiftlog demo: a stage failure, recovered in place",
        "",
        f"- failure: SIGKILL of stage {f['stage']} at iteration {f['iteration']}, "
        f"micro-batch {f['micro_batch']}, {f['phase']}",
        (
            f"- plan: replay stage(s) {p['failed_stages']} from checkpoint {p['checkpoint_iteration']} "
            f"to iteration {p['resume_iteration']} "
            f"from {p['sources']}; survivors {p['survivors']} keep their state"
        ),
        f"- verification: {'verified' if r['verification']['verified'] else 'NOT verified'} "
        f"({r['verification']['digests_checked']} digests)",
        f"- fetched: {r['records_fetched']} records, {r['bytes_fetched']} bytes",
        "- final state vs failure-free run: "
        + ("bit-exact on every stage" if r["final_state"]["bit_exact"] else "DIFFERENT"),
        "",
        "| phase | seconds |",
        "|---|---|",
        *[f"| {k.removesuffix('_s')} | {_fmt(v)} |" for k, v in tm.items()],
        "",
        (
            f"Global rollback from checkpoint {g['checkpoint_iteration']} "
            f"(redoes {g['iterations_redone']} iterations on every stage): "
            f"{_fmt(g['resumed_s'])} s from the failure to standing where it was; SWIFT: {_fmt(tm['resumed_s'])} s "
            f"(ratio {_fmt(r['recovery_vs_global_rollback'])})."
        ),
        "",
        "![progress](progress.png)",
        "",
    ]
    rr = r.get("replica_recovery")
    if rr:
        lines[2:2] = [
            f"- with {r['dp_replicate']} replicas: a replica lost ({rr['failed_ranks']}) is copied from rank "
            f"{rr['donor']} ({_fmt(rr['state_bytes'])} bytes at {_fmt(rr['gb_per_s'])} GB/s): "
            f"{_fmt(rr['resumed_s'])} s from the failure to training again, "
            f"{'bit-exact' if rr['bit_exact'] else 'DIFFERENT'}; the run below loses every replica of the stage",
        ]
    return "\n".join(lines)


def _print_report(r: dict[str, Any]) -> None:
    from rich.table import Table

    f, p, tm, g = r["failure"], r["plan"], r["timings_s"], r["global_rollback"]
    console.print()
    dp = r.get("dp_replicate", 1)
    who = f"stage {f['stage']}" if dp == 1 else f"every replica of stage {f['stage']}"
    console.print(
        f"[bold]Failure[/]   SIGKILL of {who} at iteration {f['iteration']}, "
        f"micro-batch {f['micro_batch']}, during {f['phase']}"
    )
    console.print(
        f"[bold]Plan[/]      replay {'stage' if dp == 1 else 'rank'}(s) {p['failed_stages']} "
        f"from its checkpoint at iteration {p['checkpoint_iteration']} "
        f"to iteration {p['resume_iteration']} (agreed by the survivors {p['survivors']}, which keep their state)"
    )
    console.print(f"          records from: {p['sources']}")
    tab = Table(title="Time from the failure to training resumed", show_edge=False)
    tab.add_column("phase")
    tab.add_column("seconds", justify="right")
    tab.add_column("what", style="dim")
    what = {
        "detect_s": "kill -> first survivor sees the communication error",
        "all_detected_s": "kill -> last survivor knows",
        "wait_survivors_s": "replacement waits for the survivors' reports",
        "survivors_reported_s": "kill -> every survivor tore down, drained its log writer, reported",
        "scheduler_s": "kill -> scheduler noticed the exit and launched the replacement",
        "replacement_start_s": "replacement process start (fork server, torch preloaded)",
        "fetch_s": "checkpoint load + reading records",
        "replay_s": "recomputing the lost stage (overlaps fetch)",
        "rejoin_s": "replacement ready -> new process group formed",
        "resumed_s": "kill -> every stage training again",
    }
    for k, v in tm.items():
        tab.add_row(k.removesuffix("_s"), _fmt(v), what.get(k, ""))
    console.print(tab)
    v = r["verification"]
    console.print(f"[bold]Fetched[/]   {r['records_fetched']} records, {human_bytes(r['bytes_fetched'])} (decoded)")
    console.print(
        "[bold]Verified[/]  "
        + (
            f"[green]yes[/] ({v['digests_checked']} regenerated sends matched the receivers' digests)"
            if v["verified"]
            else "[red]NO[/]"
        )
    )
    fs = r["final_state"]
    console.print(
        "[bold]Final state[/] vs failure-free run: "
        + ("[green]bit-exact on every stage[/]" if fs["bit_exact"] else f"[red]differs[/] {fs['per_stage']}")
    )
    console.print(
        f"[bold]Global rollback[/] from checkpoint {g['checkpoint_iteration']} "
        f"(redo {g['iterations_redone']} iterations on every rank): "
        f"{_fmt(g['resumed_s'])} s to stand where it was "
        f"(final state {'bit-exact' if g['bit_exact'] else 'DIFFERENT'}); "
        f"SWIFT took {_fmt(tm['resumed_s'])} s: ratio [bold]{_fmt(r['recovery_vs_global_rollback'])}[/]"
    )
    rr = r.get("replica_recovery")
    if rr:
        console.print(
            f"[bold]Replica lost[/] rank(s) {rr['failed_ranks']}: {rr['why']}; "
            f"{human_bytes(rr['state_bytes'] or 0)} at {_fmt(rr['gb_per_s'])} GB/s, "
            f"{_fmt(rr['resumed_s'])} s from the failure to training again "
            f"(final state {'bit-exact' if rr['bit_exact'] else 'DIFFERENT'}): "
            f"ratio to the global rollback [bold]{_fmt(rr['vs_global_rollback'])}[/]"
        )
    console.print(f"[dim]report: {r['files']['json']}, {r['files']['markdown']}, plot: {r['files']['plot']}[/]")


def demo(
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="work here and keep the files (default: ./swiftlog-demo)"),
    ] = None,
    iterations: Annotated[int, typer.Option("--iterations", min=4, max=1000)] = 20,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", min=2)] = 10,
    stage: Annotated[int, typer.Option("--stage", "-s", min=0, max=3, help="the stage to kill")] = 2,
    phase: Annotated[Phase, typer.Option("--phase", help="where the SIGKILL lands")] = Phase.backward,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            "-w",
            min=1,
            max=8,
            show_default="1",
            help="replay processes: the replacement plus helpers started with it",
        ),
    ] = None,
    # the old spelling of --workers: hidden, still works, says it is deprecated
    replay_workers: Annotated[int | None, typer.Option("--replay-workers", min=1, max=8, hidden=True)] = None,
    dp: Annotated[
        int,
        typer.Option(
            "--dp",
            min=1,
            max=4,
            help="data-parallel replicas of the pipeline: a replica lost is copied, every replica lost is replayed",
        ),
    ] = 1,
    json_out: JsonOpt = False,
) -> None:
    """Pipeline training with a stage failure: SWIFT in-place recovery vs a global rollback, a report, a plot."""
    workers = deprecated_alias(workers, replay_workers, new_flag="--workers/-w", old_flag="--replay-workers") or 1
    if dp > 1 and workers > 1:  # refused now, not after the reference run
        raise fail("--dp with --workers > 1: replay helpers of a replica are not supported", error_type="usage")
    _failure_iteration(iterations, checkpoint_every)  # refused now, not after the reference run
    if importlib.util.find_spec("matplotlib") is None:  # the plot is drawn last: say so before three trainings
        raise fail(
            "swiftlog demo draws its progress plot with matplotlib, which is not installed",
            hint="pip install 'swiftlog[demo]'",
            code=EXIT_UNAVAILABLE,
        )
    workdir = (directory or Path("swiftlog-demo")).resolve()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise fail(f"cannot create --dir {str(workdir)!r}: {e.strerror or e}", hint="give a writable one") from None
    say = (lambda *_: None) if json_out else (lambda msg: console.print(msg))
    with handle_errors():
        try:
            report = run_demo(
                workdir,
                iterations=iterations,
                checkpoint_every=checkpoint_every,
                fail_stage=stage,
                phase=phase.value,
                replay_workers=workers,
                dp=dp,
                say=say,
            )
        except DemoRunError as e:
            raise fail(str(e), code=EXIT_PROBLEMS, hint="the failed processes' output ends the message") from None
    if json_out:
        print_json({k: v for k, v in report.items() if k != "progress"})
    else:
        _print_report(report)
        console.print(f"\n[bold]{'recovery verified and bit-exact' if report['ok'] else 'SOME CHECKS FAILED'}[/]")
        _print_next(report, iterations)
    if not report["ok"]:
        raise typer.Exit(EXIT_PROBLEMS)


def register(app: typer.Typer) -> None:
    app.command("demo", cls=Command)(demo)
