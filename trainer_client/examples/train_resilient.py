"""The example training script in resilient mode: one stage that survives other stages' failures.

``python -m trainer_client.examples.train_pipeline --resilient ...`` (or this module directly)
takes every argument of ``train_pipeline`` plus the recovery ones below, and trains with
:class:`trainer_client.ResilientLoop`: on a peer's failure this stage keeps its state,
waits for the replacement and continues in the next process-group generation.

Roles:
- a normal stage (generation 0, or ``--generation N --resume-from C`` after a global rollback:
  load the checkpoint at C and start there);
- ``--replacement --generation G --sources ROOT,ROOT,...``: the replacement of this stage after
  generation G failed: :func:`replay.recover_stage` replays it from its checkpoint and
  the surviving nodes' stores, then it joins generation G + 1 at the agreed iteration. Exit code 3
  when in-place recovery is impossible (the fallback key tells the scheduler to roll back).

Fault injection (tests, bench, demo): ``--kill-at ITER,MB,PHASE`` SIGKILLs this process at
PHASE = forward | backward (of micro-batch MB) | commit (before reporting done) | optimizer
(after the commit, before the step) | checkpoint (before the checkpoint at ITER is written) |
upload (in the log store's uploader thread, at the first cold-tier segment upload once ITER
started), after writing the kill time into the store.

Writes ``{out}/stage{k}.pt`` like train_pipeline (model, optimizer, lr_scheduler, losses) plus
``iteration_end`` ((iteration, wall time, generation) per applied iteration), ``events``
(recoveries seen) and ``recovered`` (the replacement's summary); prints ``RESULT {...}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from replay.launcher import KILL_PHASES
from trainer_client import (
    CheckpointError,
    RecoveryConfig,
    RecoveryKeys,
    ResilientLoop,
    RestartRequired,
    SwiftlogClient,
    form_mesh,
    load_checkpoint,
)
from trainer_client.config import ENV_RESTART_COUNT, group_of
from trainer_client.examples.common import build_parser as _base_parser
from trainer_client.examples.common import config_from_args, gpt_config_from_args, step_and_clip, tie_embeddings
from trainer_client.examples.gpt import (
    SyntheticTokens,
    build_stage_module,
    example_io,
    loss_fn,
    make_lr_scheduler,
    make_optimizer,
    shard_stage_module,
)
from trainer_client.fsdp import local_state

__all__ = ["build_parser", "main", "run_stage"]

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = _base_parser()
    a = p.add_argument
    a(
        "--resilient",
        action="store_true",
        help="train with the ResilientLoop (implied by this module)",
    )
    a(
        "--generation",
        type=int,
        default=0,
        help="process-group generation to start in (replacement: the one that failed)",
    )
    a(
        "--replacement",
        action="store_true",
        help="replace this stage after --generation failed (replay, then join)",
    )
    a(
        "--sources",
        default="",
        help="replacement: comma-separated sources of the surviving nodes' logs: store roots, "
        "or node-server URLs (http://HOST:PORT) (default: the roots the survivors report)",
    )
    a("--replay-workers", type=int, default=1, help="replacement: spawn this many replay worker processes itself")
    a(
        "--replay-helpers",
        type=int,
        default=0,
        help="replacement: the scheduler started this many replay helpers with it (ranks 1..N); "
        "a torchrun restart with --snapshot-dir: this many survivors share each lost rank's replay",
    )
    a(
        "--group-in-place",
        action="store_true",
        help="logging groups: a failed member's live group members replay with its replacement in place",
    )
    a(
        "--replay-helper-rank",
        type=int,
        default=0,
        help="be replay helper RANK (>= 1) of the replacement of --stage after --generation failed, then exit",
    )
    a(
        "--resume-from",
        type=int,
        default=None,
        help="global rollback: load the checkpoint at this iteration and start there",
    )
    a(
        "--kill-at",
        default="",
        help="fault injection: ITER,MB,PHASE (phase: " + ", ".join(KILL_PHASES) + ")",
    )
    a(
        "--snapshot-dir",
        default=None,
        help="under torchrun: on a failure save this rank's state here (node-local) and exit; the next "
        "attempt resumes from it and only the lost rank replays",
    )
    a("--rejoin-timeout", type=float, default=120.0)
    a(
        "--heartbeat-timeout",
        type=float,
        default=3.0,
        help="seconds; 0 disables the heartbeat monitor",
    )
    return p


def _kill(store: dist.Store, keys: RecoveryKeys, stage: int) -> None:
    t = time.time()
    print(f"KILL {t!r}", flush=True)  # for a reader without the store (torchrun's ends with its agent)
    store.set(keys.kill_time(stage), repr(t))
    os.kill(os.getpid(), signal.SIGKILL)


def _group_of(groups: str, stage: int, num_stages: int) -> list[int]:
    """The stages of ``stage``'s logging group (``--groups 2,2`` -> [0, 1] or [2, 3]); [stage] without groups."""
    return group_of([int(x) for x in groups.split(",")] if groups else None, stage, num_stages)


def run_stage(args: argparse.Namespace) -> dict[str, Any]:
    """Train (or replace and then train) one stage; returns and saves its results."""
    t_main = time.time()
    torch.set_num_threads(args.threads)
    k, S, r = args.stage, args.num_stages, args.replica
    cfg = gpt_config_from_args(args)
    store = dist.TCPStore(
        args.store_host,
        args.store_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=120),
    )
    keys = RecoveryKeys(args.run_id)
    config = config_from_args(args)
    # each data-parallel pipeline reads its own data (a function of the iteration: its data position)
    data = SyntheticTokens(cfg, seed=args.seed + 7919 * config.dp_index)
    if config.dp_size > 1 and (args.data_source or args.tie_embeddings or args.groups):
        raise SystemExit(
            "--dp-replicate/--dp-shard > 1: --data-source, --tie-embeddings and --groups are not supported"
        )
    if args.dp_shard > 1 and args.checkpoint_format == "torch":
        raise SystemExit("--dp-shard > 1 checkpoints each rank's shards through DCP: --checkpoint-format dcp")
    rank = config.rank  # the mesh coordinate's rank: the recovery protocol's keys

    def make_client() -> SwiftlogClient:
        return SwiftlogClient(config, commit_store=store, data_source=data if args.data_source else None)

    generation, start, recovered = args.generation, 0, None
    if args.replacement:
        # the replacement opens its log client while it replays (off the recovery's critical path)
        opener = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="swiftlog-open")
        opening = opener.submit(make_client)
        opener.shutdown(wait=False)
        from replay import (
            EXIT_FALLBACK,
            ReplacementFallback,
            SourceSpec,
            recover_stage,
            report_fallback,
            report_ready,
        )

        sources: list[SourceSpec] | None = None  # none given: the store roots the survivors report
        if args.sources:
            # a root, or a node server's URL
            sources = [SourceSpec.parse(r, cold_url=args.cold_url) for r in args.sources.split(",") if r]
            if args.cold_url:
                sources.append(SourceSpec(kind="cold", location=args.cold_url))
        t_recover = time.time()
        try:
            rec = recover_stage(
                store,
                run_id=args.run_id,
                stage=k,
                num_stages=S,
                generation=generation,
                checkpoint_url=config.resolved_checkpoint_url(),
                sources=sources,
                model="trainer_client.examples.factories:gpt_stage",
                model_args=cfg.to_dict(),
                data_source="trainer_client.examples.factories:gpt_data" if args.data_source else None,
                n_microbatches=cfg.n_microbatches,
                threads=args.threads,
                workers=args.replay_workers,
                helpers=args.replay_helpers,
                timeout=datetime.timedelta(seconds=args.rejoin_timeout),
                group=_group_of(args.groups, k, S),
                replica=r,
                dp_replicate=args.dp_replicate,
                group_in_place=args.group_in_place,
                shard=args.shard,
                dp_shard=args.dp_shard,
            )
        except ReplacementFallback as e:
            report_fallback(store, args.run_id, generation, str(e))
            print(
                "FALLBACK " + json.dumps({"stage": k, "generation": generation, "reason": str(e)}),
                flush=True,
            )
            opening.result().close(flush=False)
            raise SystemExit(EXIT_FALLBACK) from e
        client = opening.result()  # raises what opening the client raised
        recovered = {**rec.summary(), "t_main": t_main, "t_recover": t_recover}
        report_ready(store, args.run_id, generation, rank, recovered)
        start, generation = rec.resume, generation + 1
        if rec.module is None:  # a shard copied from its replica: built over the next generation's shard group
            form_mesh(store, _recovery_config(args, generation), client)
            model = shard_stage_module(build_stage_module(cfg, k, S, seed=args.seed), client.shard_mesh)
            optimizer = make_optimizer(model)
            lr_scheduler = make_lr_scheduler(optimizer)
        else:
            model, optimizer, lr_scheduler = rec.module, rec.optimizer, rec.lr_scheduler
    else:
        client = make_client()
        model = build_stage_module(cfg, k, S, seed=args.seed)
        if args.dp_shard > 1:  # the first generation forms now: the stage is sharded over its shard group
            form_mesh(store, _recovery_config(args, generation), client)
            model = shard_stage_module(model, client.shard_mesh)
        optimizer = make_optimizer(model)
        lr_scheduler = make_lr_scheduler(optimizer)
        if args.resume_from is not None:
            ck = load_checkpoint(client.checkpoint_uri(args.resume_from))
            ck.apply(model, optimizer, lr_scheduler)
            start = args.resume_from
        elif args.snapshot_dir and os.environ.get(ENV_RESTART_COUNT, "0").strip() not in ("", "0"):
            from replay import recover_on_restart

            decision = recover_on_restart(  # a torchrun restart: survivors' snapshots, the lost rank replays
                store,
                run_id=args.run_id,
                stage=k,
                num_stages=S,
                checkpoint_url=config.resolved_checkpoint_url(),
                snapshot_dir=args.snapshot_dir,
                replica=r,
                dp_replicate=args.dp_replicate,
                model="trainer_client.examples.factories:gpt_stage",
                model_args=cfg.to_dict(),
                data_source="trainer_client.examples.factories:gpt_data" if args.data_source else None,
                n_microbatches=cfg.n_microbatches,
                threads=args.threads,
                replay_helpers=args.replay_helpers,
            )
            start = decision.apply(model, optimizer, lr_scheduler)
            recovered = {
                **(decision.recovered.summary() if decision.recovered is not None else {}),
                "path": decision.how,
                "why": decision.why,
                "resume": start,
            }
    kill: tuple[int, int, str] | None = None
    if args.kill_at:
        it_s, mb_s, phase = args.kill_at.split(",")
        if phase not in KILL_PHASES:
            raise ValueError(f"--kill-at phase must be one of {KILL_PHASES}, got {phase!r}")
        kill = (int(it_s), int(mb_s), phase)
    inp, out = example_io(cfg, k, S)
    armed = [False]
    if kill is not None and kill[2] == "upload":
        if client.store.cold is None:
            raise ValueError("--kill-at ...,upload needs a cold tier (--cold-url)")
        cold = client.store.cold
        put_segment = cold.put_segment

        def put_segment_then_die(*a: Any, **kw: Any) -> Any:
            if armed[0]:
                _kill(store, keys, rank)
            return put_segment(*a, **kw)

        cold.put_segment = put_segment_then_die

    # a failure during recovery: die right after reporting as a survivor
    if kill is not None and kill[2] == "recovering":

        def die_once_reported() -> None:
            watch = dist.TCPStore(
                args.store_host, args.store_port, is_master=False, timeout=datetime.timedelta(seconds=60)
            )
            while not watch.check([keys.survivor(generation, rank)]):
                time.sleep(0.002)
            _kill(watch, keys, rank)

        threading.Thread(target=die_once_reported, name="kill-when-recovering", daemon=True).start()

    tie: list[Any] = [None]  # (weight, group) of the tied embedding, made again in every generation's process group
    built = [False]

    def rebuild() -> None:
        # tied values are made equal once, at a fresh start; later they stay equal (a replay is exact)
        if args.tie_embeddings:
            tie[0] = tie_embeddings(
                model, k, S, sync=not built[0] and start == 0 and generation == 0 and not args.replacement
            )
        built[0] = True
        stage = client.pipeline_stage(model, "cpu", input_args=inp, output_args=out)
        client.schedule(stage, args.schedule, n_microbatches=cfg.n_microbatches, loss_fn=loss_fn)
        if kill is not None and kill[2] == "reduce":  # just before the replicas' gradient average

            def die_before_average(it: int) -> None:
                if it == kill[0]:
                    _kill(store, keys, rank)

            client.before_replica_average = die_before_average
        if kill is not None and kill[2] in ("forward", "backward", "hang"):
            name = "backward_one_chunk" if kill[2] == "backward" else "forward_one_chunk"
            orig = getattr(stage, name)

            def hooked(mb: int, *a: Any, **kw: Any) -> Any:
                if (client.recorder.iteration, mb) == kill[:2]:
                    if kill[2] == "hang":  # stuck in compute: the process and its heartbeat live on
                        client.progress.busy()
                        while True:
                            time.sleep(1)
                    _kill(store, keys, rank)
                return orig(mb, *a, **kw)

            setattr(stage, name, hooked)

    ckpt_at = {int(x) for x in args.ckpt_at.split(",") if x}
    dcp_armed = [False]
    if kill is not None and kill[2] == "dcp_save":  # the DCP save of iteration IT dies before its .metadata
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        finish = FileSystemWriter.finish

        def finish_or_die(self: Any, *a: Any, **kw: Any) -> Any:  # DCP writes .metadata last, here
            if dcp_armed[0]:
                _kill(store, keys, rank)
            return finish(self, *a, **kw)

        FileSystemWriter.finish = finish_or_die  # type: ignore[method-assign]
    ckpts: dict[int, str] = {}
    losses_per_it: dict[int, float] = {}
    losses: list[torch.Tensor] = []

    def before(it: int) -> None:
        if args.alternate_logging:  # measurements: blocks of iterations with logging on, then off
            client.set_logging(not args.no_logging and (it // args.alternate_logging) % 2 == 0)
        if it in ckpt_at:
            if kill is not None and kill[2] == "checkpoint" and kill[0] == it:
                _kill(store, keys, rank)
            dcp_armed[0] = kill is not None and kill[2] == "dcp_save" and kill[0] == it
            ckpts[it] = client.checkpoint(it, model, optimizer, lr_scheduler, extra={"gpt": cfg.to_dict()})

    def forward_backward(it: int) -> None:
        losses.clear()
        armed[0] = kill is not None and it >= kill[0]
        step_and_clip(args, client, model, data, it, losses, tie[0])
        if kill is not None and kill[2] == "commit" and kill[0] == it:
            _kill(store, keys, rank)

    def apply(it: int) -> None:
        if kill is not None and kill[2] == "optimizer" and kill[0] == it:
            _kill(store, keys, rank)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if losses:
            losses_per_it[it] = sum(float(x.detach()) for x in losses) / len(losses)
        if k == S - 1 and r == 0:  # progress of the whole job (survives this process): "iteration:time:generation;"
            store.append(keys.progress(), f"{it}:{time.time()!r}:{loop.generation};")

    rcfg = _recovery_config(args, generation)
    replay_group = None
    if args.group_in_place:  # another member of this stage's logging group failed: replay with it here
        from replay.group_recovery import replay_in_place

        def replay_group(g: int, members: list[int]) -> int:
            timeout = datetime.timedelta(seconds=args.rejoin_timeout)
            return replay_in_place(store, args.run_id, g, k, members, model, optimizer, lr_scheduler, timeout=timeout)

    replay_shards = None
    if args.dp_shard > 1:  # a shard of this stage was lost without a replica: its shard group replays here

        def replay_shards(g: int) -> int:
            from replay import replay_shard_in_place

            timeout = datetime.timedelta(seconds=args.rejoin_timeout)
            return replay_shard_in_place(store, config, g, model, optimizer, lr_scheduler, timeout=timeout)

    loop = ResilientLoop(
        client,
        store,
        rcfg,
        rebuild=rebuild,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        replay_group=replay_group,
        replay_shards=replay_shards,
    )
    t_join = time.time()
    loop.join()
    if args.replacement:
        store.set(keys.rejoined(args.generation, rank), repr(time.time()))
    t_train = time.time()
    loop.run(
        start,
        args.iters,
        forward_backward=forward_backward,
        apply=apply,
        before=before,
        joined=True,
    )
    if args.iters in ckpt_at:
        ckpts[args.iters] = client.checkpoint(args.iters, model, optimizer, lr_scheduler, extra={"gpt": cfg.to_dict()})
    stats = client.stats()  # before close: what the run cost (bench/hybrid_bench.py reads it)
    report = client.close()
    dist.destroy_process_group()
    result = {
        "client_stats": {k: stats[k] for k in ("writer", "commit")},
        "stage": k,
        "replica": r,
        "transfers": [t.to_dict() for t in loop.transfers],
        "iters": args.iters,
        "start": start,
        "generation_end": loop.generation,
        "losses": [losses_per_it[i] for i in sorted(losses_per_it)],
        "losses_by_it": losses_per_it,
        "iteration_end": loop.iteration_end,
        "events": [e.to_dict() for e in loop.events],
        "recovered": recovered,
        "checkpoints": ckpts,
        "t_main": t_main,
        "t_join": t_join,
        "t_train": t_train,
        "close": {
            "ok": report.ok,
            "error": report.error,
            "faults": [f"{f.kind}: {f.message}" for f in report.logging_faults],
        },
    }
    os.makedirs(args.out, exist_ok=True)
    torch.save(
        {
            **result,
            "model": local_state(model.state_dict()),  # sharded: this rank's shards
            "optimizer": local_state(optimizer.state_dict()),
            "lr_scheduler": lr_scheduler.state_dict(),
            "gpt": cfg.to_dict(),
        },
        os.path.join(args.out, f"stage{k}.pt" if config.dp_size == 1 else f"stage{k}-dp{config.dp_index}.pt"),
    )
    return result


def run_replay_helper(args: argparse.Namespace) -> int:
    """Serve as a replay helper of the replacement of ``args.stage`` (no training, no results file)."""
    from replay import serve_replay_helper
    from replay.replacement import prepare_states

    torch.set_num_threads(args.threads)
    # build the stage from its newest checkpoint while the replacement works out the job
    prepared = prepare_states(
        config_from_args(args).resolved_checkpoint_url(),
        run_id=args.run_id,
        stages=_group_of(args.groups, args.stage, args.num_stages),
        num_stages=args.num_stages,
        model="trainer_client.examples.factories:gpt_stage",
        model_args=gpt_config_from_args(args).to_dict(),
    )
    store = dist.TCPStore(args.store_host, args.store_port, is_master=False, timeout=datetime.timedelta(seconds=120))
    from replay import EXIT_FALLBACK, ReplayError

    info: dict[str, Any] = {"stage": args.stage, "rank": args.replay_helper_rank}
    try:
        info["took_part"] = serve_replay_helper(
            store,
            args.run_id,
            args.generation,
            args.stage,
            args.replay_helper_rank,
            timeout=datetime.timedelta(seconds=args.rejoin_timeout),
            prepared=prepared,
        )
    except (ReplayError, CheckpointError) as e:  # the replay is impossible: the replacement reports the fallback
        info |= {"took_part": True, "error": f"{type(e).__name__}: {e}"}
    print("HELPER " + json.dumps(info), flush=True)
    return EXIT_FALLBACK if "error" in info else 0


def _recovery_config(args: argparse.Namespace, generation: int) -> RecoveryConfig:
    """How this rank takes part in in-place recovery, from the script's arguments."""
    return RecoveryConfig(
        run_id=args.run_id,
        stage=args.stage,
        num_stages=args.num_stages,
        replica=args.replica,
        dp_replicate=args.dp_replicate,
        shard=args.shard,
        dp_shard=args.dp_shard,
        generation=generation,
        pg_timeout=datetime.timedelta(seconds=args.pg_timeout),
        rejoin_timeout=datetime.timedelta(seconds=args.rejoin_timeout),
        heartbeat_timeout=datetime.timedelta(seconds=args.heartbeat_timeout) if args.heartbeat_timeout > 0 else None,
        store_host=args.store_host,
        store_port=args.store_port,
        snapshot_dir=args.snapshot_dir,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        format=f"stage{args.stage} %(levelname)s %(name)s: %(message)s",
    )
    if args.replay_helper_rank:
        return run_replay_helper(args)
    try:
        result = run_stage(args)
    except RestartRequired as e:  # under torchrun with --snapshot-dir: the next attempt resumes from it
        print(f"RESTART {e}", flush=True)
        return 1
    print(
        "RESULT "
        + json.dumps(
            {
                k: result[k]
                for k in (
                    "stage",
                    "iters",
                    "start",
                    "generation_end",
                    "events",
                    "recovered",
                    "close",
                )
            },
            default=str,
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
