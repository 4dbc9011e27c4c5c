"""``swiftlog replay``: plan and run the recovery of failed stages; write the recovered checkpoints.

Thin: it parses options, calls :func:`replay.plan_recovery` and :func:`replay.replay`, and prints.
The replay package is imported when the command runs, not when the ``swiftlog`` app is built: it
pulls in torch.distributed.pipelining, which no other command needs. :func:`print_plan` prints a
plan for ``swiftlog plan`` too.

Where the logs are (any mix, tried in this order):
``--root DIR`` (repeatable; a node's store root, every writer's hot tier there, plus ``--cold-url``),
``--server URL`` (repeatable; a node's ``swiftlog serve``, with ``--token``), ``--cold-url URL``
alone (the cold tier). The plan is made from the roots and/or the cold tier; with servers only it
is asked from the first server's ``/v1/runs/{run}/recovery-plan`` (then ``--target-iteration`` is
not available).

Exit codes: 0 replayed and verified (or ``--plan-only`` and the plan is possible); 1 the plan is
impossible (the fallback is printed), the replay diverged, or it could not be verified; 2 bad
usage; 3 a needed record is missing or corrupt; 4 a source or server is unavailable.

Never: registers the recovered checkpoint with the store (that would make logs garbage before
the pipeline re-formed); prints a token.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from server.cli._common import (
    Command,
    RankOpt,
    StagesPerRankOpt,
    StageStyleOpt,
    check_cold_url,
    cold_url_param,
    fail,
    failed_ranks,
    parse_cold_options,
    parse_kv,
)
from server.errors import EXIT_NOT_FOUND, EXIT_OK, EXIT_PROBLEMS, EXIT_UNAVAILABLE

__all__ = ["register", "replay_command", "print_plan"]


def replay_command(
    run: Annotated[str, typer.Option("--run", "-r", help="run id")],
    stage: Annotated[
        list[int] | None,
        typer.Option("--stage", "-s", min=0, max=0xFFFF, help="failed stage (repeat for several)", show_default=False),
    ] = None,
    rank: RankOpt = None,
    stages_per_rank: StagesPerRankOpt = 1,
    stage_style: StageStyleOpt = "loop",
    root: Annotated[
        list[Path] | None, typer.Option("--root", envvar="SWIFTLOG_ROOT", help="a node's store root (repeatable)")
    ] = None,
    server: Annotated[
        list[str] | None, typer.Option("--server", help="a node server's URL, e.g. http://10.0.0.5:8080 (repeatable)")
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            envvar="SWIFTLOG_TOKEN",
            help="bearer token of the servers (prefer the env var)",
            show_default=False,
        ),
    ] = None,
    cold_url: Annotated[
        str | None,
        typer.Option(
            "--cold-url",
            envvar="SWIFTLOG_COLD_URL",
            callback=cold_url_param,
            help="cold tier: file:///dir or s3://bucket/prefix",
        ),
    ] = None,
    cold_option: Annotated[
        list[str] | None,
        typer.Option(
            "--cold-option", help="cold tier storage option KEY=VALUE (repeatable; also used for s3 checkpoints)"
        ),
    ] = None,
    output: Annotated[
        str | None, typer.Option("--output", "-o", help="directory or URL for the recovered checkpoints")
    ] = None,
    workers: Annotated[
        int, typer.Option("--workers", "-w", min=1, max=256, help="parallel replay workers per unit")
    ] = 1,
    exact: Annotated[
        bool,
        typer.Option(
            "--exact/--approximate",
            help="parallel gradient reduction in live order (bit-exact) or any order (one all-reduce over gloo, "
            "within a stated bound; on one host the exact one is also the faster: its sums go through shared memory)",
        ),
    ] = True,
    dynamic_share: Annotated[
        bool,
        typer.Option(
            "--dynamic-share/--fixed-share",
            help="parallel workers claim part of an iteration's micro-batches as they go (when a micro-batch takes "
            "20 ms or more), or always split them up front by measured speed",
        ),
    ] = True,
    shared_memory: Annotated[
        bool,
        typer.Option(
            "--shared-memory/--no-shared-memory",
            help="exact parallel replay on one host: form the gradient chain's sums in /dev/shm (else they go over "
            "gloo)",
        ),
    ] = True,
    target_iteration: Annotated[
        int | None,
        typer.Option(
            "--target-iteration",
            "-t",
            min=0,
            help="the survivors' iteration: replay up to it, exclusive (default: the first iteration not completely "
            "logged)",
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="stage factory module:function or path/to/file.py:function, required to replay "
            "(modules of the current directory import, as with python -m)",
            show_default=False,
        ),
    ] = None,
    model_arg: Annotated[
        list[str] | None, typer.Option("--model-arg", help="factory keyword KEY=VALUE (repeatable; JSON values)")
    ] = None,
    loss: Annotated[
        str | None,
        typer.Option(
            "--loss",
            help="loss function module:attr or path/to/file.py:attr (default: the live schedule's, as META names it)",
        ),
    ] = None,
    data_source: Annotated[
        str | None,
        typer.Option(
            "--data-source",
            help="data source factory module:function or path/to/file.py:function, for runs that did not log "
            "inputs/targets",
        ),
    ] = None,
    prefetch: Annotated[
        int | None,
        typer.Option(
            "--prefetch",
            min=0,
            help="iterations fetched ahead (default: 2, or 0 for parallel workers that fill every core and read "
            "local files)",
            show_default=False,
        ),
    ] = None,
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="check regenerated sends against the receivers' digests")
    ] = True,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help="replay on this torch device, e.g. cuda (default: where --model builds the stage; one worker only)",
        ),
    ] = None,
    bandwidth_mbps: Annotated[
        float | None, typer.Option("--bandwidth-mbps", min=0.001, help="fetch rate for the estimate (MB/s)")
    ] = None,
    check_records: Annotated[
        bool, typer.Option("--check-records", help="plan: read every needed record and check its checksums")
    ] = False,
    plan_only: Annotated[bool, typer.Option("--plan-only", help="print the plan and stop")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print machine-readable JSON")] = False,
    commit_store: Annotated[
        str | None,
        typer.Option(
            "--commit-store",
            help="the job's commit store HOST:PORT (a TCPStore): the failed stages' META of the last iterations, "
            "which their logs may not have shipped, and the fetch rates earlier recoveries measured (the estimate)",
        ),
    ] = None,
    commit_prefix: Annotated[
        str | None,
        typer.Option(
            "--commit-prefix",
            help="key prefix in the commit store (default: swiftlog/RUN; a job torchrun restarted commits under "
            "swiftlog/RUN/restartN, see ClientConfig.commit_prefix)",
        ),
    ] = None,
) -> None:
    """Rebuild failed stages from their checkpoints and the logs; write recovered checkpoints."""
    from logstore.errors import (
        CorruptRecordError,
        RecordNotFoundError,
        StoreError,
        SwiftlogError,
    )
    from replay.errors import ReplayInputMissingError
    from trainer_client.errors import CheckpointError

    opts, model, loss, data_source = _checked_options(
        root, server, cold_url, cold_option, output, plan_only, model, loss, data_source
    )
    ranks = failed_ranks(stage, rank, stages_per_rank, stage_style)
    try:
        job_store = _commit_store(commit_store) if commit_store else None
        plan, specs = _plan(
            run,
            list(stage or []),
            root or [],
            server or [],
            token,
            cold_url,
            opts,
            target_iteration,
            bandwidth_mbps,
            workers,
            check_records,
            _rates(job_store, run),
            ranks,
        )
        if plan_only or not plan.possible:
            print_plan(plan, json_out)
            raise typer.Exit(EXIT_OK if plan.possible else EXIT_PROBLEMS)
        from replay.engine import replay
        from replay.job import DYNAMIC_SHARE_MIN_S, jobs_from_plan

        jobs = jobs_from_plan(
            plan,
            sources=specs,
            workers=workers,
            exact=exact,
            dynamic_share_min_s=DYNAMIC_SHARE_MIN_S if dynamic_share else None,
            shared_memory=shared_memory,
            model=model,
            model_args=parse_kv(model_arg, "--model-arg"),
            loss=loss,
            data_source=data_source,
            prefetch=prefetch,
            verify=verify,
            output=output,
            output_options=opts,
            checkpoint_options=opts,
            device=device,
        )
        if job_store is not None:
            jobs = _with_committed_metas(jobs, plan, job_store, commit_store, commit_prefix or f"swiftlog/{run}")
        # the unit with the last stage first: what it alone needs (the loss function) fails before another unit
        # wrote its checkpoints
        jobs.sort(key=lambda j: j.stages[-1] != j.num_stages - 1)
        results = [replay(job, on_progress=_progress_printer(json_out)) for job in jobs]
    except typer.Exit:
        raise
    except (ReplayInputMissingError, RecordNotFoundError, CorruptRecordError) as e:
        raise fail(str(e), code=EXIT_NOT_FOUND) from None
    except StoreError as e:
        raise fail(str(e), code=EXIT_UNAVAILABLE if e.retryable else EXIT_PROBLEMS) from None
    except (SwiftlogError, CheckpointError) as e:
        raise fail(str(e), code=EXIT_PROBLEMS) from None
    except ValueError as e:
        raise fail(str(e)) from None
    ok = all(r.verified for r in results)
    _print_results(plan, results, ok, json_out, output)
    raise typer.Exit(EXIT_OK if ok else EXIT_PROBLEMS)


def _checked_options(
    root: list[Path] | None,
    server: list[str] | None,
    cold_url: str | None,
    cold_option: list[str] | None,
    output: str | None,
    plan_only: bool,
    model: str | None,
    loss: str | None,
    data_source: str | None,
) -> tuple[dict[str, Any], str | None, str | None, str | None]:
    """The options checked before anything runs (a CLI failure, exit 2 or 3, names the first one
    that cannot work); returns the cold tier's options and the factory, loss and data source
    specs, a relative file path made absolute (workers may start elsewhere)."""
    if not (root or server or cold_url):
        raise fail("no log source given", hint="pass --root (a node's store root), --server URL or --cold-url")
    if not plan_only and not model:
        raise fail(
            "--model is required to replay: the stage factory the training used",
            hint="--model module:function or path/to/file.py:function, with --model-arg KEY=VALUE for its "
            "arguments (the example GPT's: --model trainer_client.examples.factories:gpt_stage)",
        )
    if not plan_only and not output:
        raise fail(
            "--output is required to replay",
            hint="a directory or URL for the recovered checkpoints, or pass --plan-only",
        )
    for r in root or []:
        if not r.is_dir():
            raise fail(f"store root {str(r)!r} does not exist", code=EXIT_NOT_FOUND)
    check_cold_url(cold_url)
    opts = parse_cold_options(cold_option)
    from replay.user_code import absolute_spec

    if os.getcwd() not in sys.path and "" not in sys.path:
        # --model mymodule:fn finds ./mymodule.py, as python -m would (workers inherit sys.path)
        sys.path.insert(0, os.getcwd())
    model, loss, data_source = absolute_spec(model) or model, absolute_spec(loss), absolute_spec(data_source)
    if loss is not None:  # named now, not after a replay that may not need it (only the last stage's does)
        from replay.user_code import load_object

        try:
            load_object(loss)
        except ValueError as e:
            raise fail(f"--loss: {e}") from None
    if output and not plan_only:
        _check_writable_output(output)
    return opts, model, loss, data_source


def _progress_printer(json_out: bool) -> Callable[[Any], None]:
    """A job's ``on_progress``: a line on stderr every 2 s and at the end (nothing under ``--json``)."""
    last = [0.0]

    def progress(p: Any) -> None:
        now = time.monotonic()
        if not json_out and (now - last[0] > 2.0 or p.done == p.total):
            last[0] = now
            eta = "-" if p.eta_s is None else f"{p.eta_s:.0f}s"
            typer.echo(
                f"stages {list(p.stages)}: {p.done}/{p.total} iterations, {p.rate:.2f} it/s, eta {eta}",
                err=True,
            )

    return progress


def _print_results(plan: Any, results: list[Any], ok: bool, json_out: bool, output: str | None) -> None:
    """Each unit's outcome: verified, or why not; where its checkpoints went (JSON under ``--json``)."""
    if json_out:
        print(
            json.dumps({"plan": plan.to_dict(), "results": [r.to_dict() for r in results], "verified": ok}, indent=2),
            flush=True,
        )
        return
    for r in results:
        state = "verified" if r.verified else "NOT verified"
        if r.report.diverged:
            first = f" (first diverging send: {json.dumps(r.first_mismatch)})" if r.first_mismatch else ""
            state = f"DIVERGED: {r.report.unverified_reason}{first}"
        typer.echo(
            f"stages {r.job.stages}: replayed [{r.report.start_iteration}, {r.report.stop_iteration}) with "
            f"{r.job.workers} worker(s) in {r.seconds:.2f} s (replay proper {r.replay_seconds:.2f} s, the rest "
            f"start-up and checkpoints): {state} ({r.report.digests_checked}/{r.report.sends_generated} sends "
            "checked)"
        )
        for k, uri in sorted(r.outputs.items()):
            typer.echo(f"  stage {k}: {uri}")
        if r.report.diverged and output:
            why = (
                "what changed the live gradients is not replayed"
                if r.report.grad_mismatches and not r.first_mismatch
                else "check --model / --model-arg / --loss against the training run"
            )
            typer.echo(f"  nothing written to {output}: the replayed state is wrong ({why})")
        for w in r.report.warnings:
            typer.echo(f"  warning: {w}")


def _check_writable_output(output: str) -> None:
    """A local ``--output`` must be a directory, or one this process can create, where it can create
    files (checked before a replay that would fail only when it writes: a probe file is created
    and removed in the deepest existing directory of the path; nothing else is created). Remote
    URLs are left to the replay."""
    import tempfile

    from trainer_client.checkpoint import local_path  # where save_checkpoint writes for such a URI

    path = local_path(output)
    if path is None:
        return
    existing = path
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"{existing} is not a directory")
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".swiftlog-probe-"):
            pass
    except OSError as e:
        raise fail(
            f"--output {output!r} is not a directory swiftlog can write in: {e.strerror or e}",
            hint="give a writable directory (or a URL) for the recovered checkpoints",
        ) from None


def _rates(store: Any, run: str) -> dict[str, float]:
    """The fetch rates the job's recoveries measured (``replay.measured_rates``); {} without a store."""
    if store is None:
        return {}
    from replay.replacement import measured_rates

    return measured_rates(store, run)


def _with_committed_metas(jobs: list[Any], plan: Any, store: Any, address: str, prefix: str) -> list[Any]:
    """Each job with the META documents its stages have in the commit store (``store``, at
    ``address``) as its first source."""
    from replay.job import SourceSpec

    out = []
    for job, unit in zip(jobs, plan.units, strict=True):
        metas = SourceSpec.from_commit_store(
            store,
            prefix,
            job.stages,
            range(unit.checkpoint_iteration, job.stop_iteration),
            where=f"the commit store {address}",
        )
        out.append(job if metas is None else job.replace(sources=[metas, *job.sources]))
    return out


def _commit_store(address: str) -> Any:
    """A client of the job's store at ``address``. Raises a CLI failure naming the address when it
    cannot be reached."""
    import datetime

    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise fail(f"--commit-store {address!r} is not HOST:PORT")
    hint = (
        "the job's TCPStore must still run (under torchrun it ends with the job); or drop --commit-store to replay "
        "with the META the logs hold"
    )
    try:  # a plain connection first: torch's store client prints its C++ stack to stderr when it cannot connect
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise fail(
            f"cannot reach the commit store at {address}: {e.strerror or e}", code=EXIT_UNAVAILABLE, hint=hint
        ) from None
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=5))
    except Exception as e:  # DistNetworkError / RuntimeError / TimeoutError from the store client
        raise fail(f"cannot reach the commit store at {address}: {e}", code=EXIT_UNAVAILABLE, hint=hint) from None


def _plan(
    run: str,
    failed: list[int],
    roots: list[Path],
    servers: list[str],
    token: str | None,
    cold_url: str | None,
    opts: dict[str, Any],
    target: int | None,
    bandwidth: float | None,
    workers: int,
    check_records: bool,
    rates: dict[str, float] | None = None,
    ranks: dict[str, Any] | None = None,
) -> tuple[Any, list[Any]]:
    from logstore import LogStore
    from replay.job import SourceSpec
    from replay.plan import cold_only_store, plan_recovery
    from replay.remote import HttpRecordSource

    specs = [SourceSpec(kind="store", location=str(r), cold_url=cold_url, options=opts) for r in roots]
    specs += [SourceSpec(kind="http", location=u, token=token) for u in servers]
    if cold_url and not roots:
        specs.append(SourceSpec(kind="cold", location=cold_url, options=opts))
    # planned over every source the replay reads: roots, node servers (their hot tiers, through the API), the cold tier
    stores: list[Any] = [LogStore.open(r, run, cold_url=cold_url, cold_options=opts) for r in roots]
    try:
        stores += [HttpRecordSource(u, run, token=token) for u in servers]
        if cold_url and not roots:
            stores.append(cold_only_store(cold_url, run, opts))
        return plan_recovery(
            stores,
            failed,
            target_iteration=target,
            bandwidth_mbps=bandwidth,
            workers=workers,
            check_records=check_records,
            rates=rates,
            **(ranks or {}),
        ), specs
    finally:
        for s in stores:
            s.close()


def print_plan(plan: Any, json_out: bool) -> None:
    """Print a :class:`replay.plan.RecoveryPlan` as text (or JSON): what each unit replays and
    fetches, or why it cannot."""
    if json_out:
        print(json.dumps(plan.to_dict(), indent=2), flush=True)
        return
    typer.echo(
        f"recovery of run {plan.run}, failed stages {plan.failed_stages} ({plan.num_stages} stages, logging groups "
        f"{plan.logging_groups}):"
    )
    for r, held in sorted(getattr(plan, "failed_ranks", {}).items()):
        typer.echo(f"  rank {r} held stages {held}")
    for u in plan.units:
        head = f"  stages {u.stages}" + (f" (rolled back with them: {u.rolled_back})" if u.rolled_back else "")
        if u.possible:
            est = u.estimate.get("total_seconds")
            typer.echo(
                f"{head}: replay [{u.checkpoint_iteration}, {u.stop_iteration}) = {u.iterations} iteration(s), "
                f"{u.records} records / {u.bytes} bytes, ~{'?' if est is None else f'{est:.1f}'} s, "
                f"{'verifiable' if u.verifiable else 'NOT verifiable'}"
            )
        else:
            typer.echo(f"{head}: IMPOSSIBLE: {'; '.join(u.reasons)}")
        for f in u.fetch:
            where = f"hot tier of {f.writer}" if f.tier == "hot" else "cold tier"
            typer.echo(
                f"    {f.purpose:6} {f.channel:12} it {f.first_iteration}..{f.last_iteration}: {f.records} records, "
                f"{f.bytes} bytes from {where} (source {f.source})"
            )
        for w in u.warnings:
            typer.echo(f"    warning: {w}")
    a = plan.assumptions or {}
    if a.get("hot_mbps") is not None:
        measured = a.get("rates_measured") or []
        rates = ", ".join(
            f"{t} {a[f'{t}_mbps']:.0f} MB/s ({'measured' if t in measured else 'assumed'})" for t in ("hot", "cold")
        )
        typer.echo(f"  fetch rates: {rates}")
    for w in plan.warnings:
        typer.echo(f"  warning: {w}")
    if not plan.possible:
        fb = plan.fallback
        typer.echo(f"fallback: {fb.get('note')}")


def register(app: typer.Typer) -> None:
    app.command("replay", cls=Command)(replay_command)
