"""A training script whose ranks hold several pipeline stages, with in-place recovery.

The template for Interleaved 1F1B, LoopedBFS, interleaved zero-bubble, ZBV zero-bubble and DualPipeV
schedules (``--schedule``; ``--stages-per-rank``). It trains an MLP classifier (``--width``,
``--depth`` blocks per stage) cut into ``num_stages * stages_per_rank`` stages, one SGD optimizer
and step scheduler per stage (the functions under "yours"). The contract is
:mod:`minimal_resilient`'s, per rank instead of per stage:

- a rank: :class:`~trainer_client.MultiStageClient` + :class:`~trainer_client.ResilientLoop`
  (optimizers and schedulers given in the order of ``client.stages``);
- a replacement (``--replacement --generation G``): :func:`replay.recover_rank` rebuilds every
  stage of the lost rank from its checkpoint and the survivors' logs, then the loop joins the next
  generation; a replay that is impossible reports the fallback (exit code 3).

``--stage`` and ``--num-stages`` are the rank's ``pp`` position and the number of ranks (the
launcher's kills are per rank). Kill phases (``--kill-at IT,MB,PHASE``): "forward" (as iteration
IT starts), "backward" (the rank's MB-th backward pass of IT, input-gradient passes included),
"weight" (the rank's MB-th weight-gradient accumulation of IT: a zero-bubble schedule's W pass),
"commit" and "optimizer". Writes ``{out}/stage{k}.pt`` (k: the rank's position) with the final
state of each of its stages.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer_client import (
    CheckpointConfig,
    ClientConfig,
    MultiStageClient,
    RecoveryConfig,
    RecoveryKeys,
    ResilientLoop,
    checkpoint_uri,
    load_checkpoint,
)
from trainer_client.examples.minimal_resilient import CLASSES, loss
from trainer_client.examples.minimal_resilient import build_parser as single_stage_parser
from trainer_client.multi_stage import MULTI_STAGE_SCHEDULES

__all__ = ["build_parser", "factory", "main"]

SEED = 7
PHASES = ("forward", "backward", "weight", "commit", "optimizer")


# ================================================================================ yours
def factory(
    stage: int, num_stages: int, checkpoint: Any = None, *, width: int = 32, depth: int = 1, **_: Any
) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Pipeline stage ``stage`` of ``num_stages`` (all ranks' stages), fresh: ``depth`` blocks of
    Linear-Tanh-Dropout of ``width``, the last stage a classifier head too; SGD with momentum and
    a step schedule. A module-level function: a replay's spawned workers import it."""
    torch.manual_seed(100 + stage)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.1)]
    if stage == num_stages - 1:
        layers.append(nn.Linear(width, CLASSES))
    module = nn.Sequential(*layers)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    return module, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def batch(iteration: int, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The iteration's inputs and targets (every rank makes the same call)."""
    g = torch.Generator().manual_seed(1000 + iteration)
    return torch.randn(size, width, generator=g), torch.randint(0, CLASSES, (size,), generator=g)


def example_io(stage: int, num_stages: int, micro_batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's input and output of the stage, as the pipeline sends them."""
    out = torch.zeros(micro_batch, CLASSES if stage == num_stages - 1 else width, requires_grad=True)
    return torch.zeros(micro_batch, width, requires_grad=stage > 0), out


# ================================================================================ the contract
def build_parser() -> argparse.ArgumentParser:
    p = single_stage_parser()
    p.description = __doc__.split("\n\n")[0]
    a = p.add_argument
    a("--stages-per-rank", type=int, default=2)
    a("--schedule", default="interleaved1f1b", choices=sorted(MULTI_STAGE_SCHEDULES))
    a("--replay-workers", type=int, default=1, help="a replacement replays each unit of stages with K workers")
    a("--replay-concurrent", action="store_true", help="a replacement replays its units at the same time")
    a("--width", type=int, default=32, help="the MLP's width")
    a("--depth", type=int, default=1, help="blocks per stage")
    a("--batch", type=int, default=16, help="samples per iteration")
    a("--n-microbatches", type=int, default=4)
    a("--clip", type=float, default=None, help="clip to this global norm over the whole pipeline")
    return p


def main(argv: list[str] | None = None) -> int:
    from replay import EXIT_FALLBACK, ReplacementFallback, recover_rank, report_fallback, report_ready

    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    style = MULTI_STAGE_SCHEDULES[args.schedule][1]
    k, P, V = args.stage, args.num_stages, args.stages_per_rank
    store = dist.TCPStore(args.store_host, args.store_port, is_master=False, timeout=datetime.timedelta(seconds=120))
    where = {"stage": k, "num_stages": P, "stages_per_rank": V, "stage_style": style}
    config = ClientConfig(
        run_id=args.run_id,
        seed=SEED,
        store_root=args.store_root,
        cold_url=args.cold_url,
        checkpoints=CheckpointConfig(url=args.checkpoint_url),
        **where,
    )
    recovery = RecoveryConfig(
        run_id=args.run_id,
        **where,
        generation=args.generation + 1 if args.replacement else args.generation,
        store_host=args.store_host,
        store_port=args.store_port,
    )
    S = config.num_pipeline_stages
    shape = {"width": args.width, "depth": args.depth}
    start, recovered = 0, None
    if args.replacement:
        try:
            rec = recover_rank(
                store,
                run_id=args.run_id,
                **where,
                generation=args.generation,
                checkpoint_url=config.resolved_checkpoint_url(),
                factory=factory,
                model_args=shape,
                workers=args.replay_workers,
                concurrent=args.replay_concurrent,
            )
        except ReplacementFallback as e:
            report_fallback(store, args.run_id, args.generation, str(e))
            return EXIT_FALLBACK
        recovered = rec.summary()
        report_ready(store, args.run_id, args.generation, config.rank, recovered)
        start = rec.resume
        built = {s: (r.module, r.optimizer, r.lr_scheduler) for s, r in rec.stages.items()}
    else:
        built = {s: factory(s, S, **shape) for s in config.stages}
        if args.resume_from is not None:  # a global rollback
            for s, objs in built.items():
                uri = checkpoint_uri(config.resolved_checkpoint_url(), s, args.resume_from, config.checkpoints.format)
                load_checkpoint(uri).apply(*objs)
            start = args.resume_from
    client = MultiStageClient(config, commit_store=store)
    models = [built[s][0] for s in config.stages]
    optimizers = [built[s][1] for s in config.stages]
    schedulers = [built[s][2] for s in config.stages]

    def rebuild() -> None:  # after every (re)join: the stages and the schedule over the new process group
        stages = []
        for s, model in zip(config.stages, models, strict=True):
            inp, out = example_io(s, S, args.batch // args.n_microbatches, args.width)
            stage = client.pipeline_stage(model, "cpu", stage=s, input_args=inp, output_args=out)
            stages.append(inject_weight_kill(stage) if kill is not None and kill[1] == "weight" else stage)
        client.schedule(stages, args.schedule, n_microbatches=args.n_microbatches, loss_fn=loss)

    kill, kill_n, count = None, 0, {"backward": [-1, 0], "weight": [-1, 0]}
    if args.kill_at:
        it_s, n_s, phase_s = args.kill_at.split(",")
        if phase_s not in PHASES:  # a phase this script does not inject must not pass as a failure-free run
            raise SystemExit(f"--kill-at {args.kill_at}: this script injects the phases {PHASES}, not {phase_s!r}")
        kill, kill_n = (int(it_s), phase_s), int(n_s)

    def die_if(it: int, phase: str) -> None:
        if kill == (it, phase):
            store.set(RecoveryKeys(args.run_id).kill_time(config.rank), repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    def counted(phase: str) -> Any:
        def hook(*_: Any) -> None:  # the kill_n-th pass of the phase in the iteration
            it, n = count[phase]
            if kill is not None and kill == (it, phase) and n == kill_n:
                die_if(it, phase)
            count[phase][1] += 1

        return hook

    def on_output(module: Any, inputs: Any, output: torch.Tensor) -> None:
        # a tensor hook, not a module backward hook: those break torch's split (input-gradient) backward
        if output.requires_grad:
            output.register_hook(counted("backward"))

    for model in models:
        model.register_forward_hook(on_output)

    def inject_weight_kill(stage: Any) -> Any:  # the W pass sets .grad itself: no parameter hook sees it
        run_weight, hook = stage.backward_weight_one_chunk, counted("weight")

        def backward_weight_one_chunk(mb: int, last_backward: bool = False) -> None:
            hook()
            run_weight(mb, last_backward)

        stage.backward_weight_one_chunk = backward_weight_one_chunk
        return stage

    ckpt_at = {int(x) for x in args.ckpt_at.split(",") if x}

    def before(it: int) -> None:
        if it in ckpt_at:
            client.checkpoint(it, models, optimizers, schedulers)

    def forward_backward(it: int) -> None:
        die_if(it, "forward")
        count["backward"][:] = [it, 0]
        count["weight"][:] = [it, 0]
        x, y = batch(it, args.batch, args.width)
        client.step(it, x, target=y)
        if args.clip is not None:  # the whole pipeline's norm: every stage of every rank
            client.clip_grad_norm_(args.clip, group=dist.group.WORLD)
        die_if(it, "commit")

    def apply(it: int) -> None:
        die_if(it, "optimizer")
        for opt, sched in zip(optimizers, schedulers, strict=True):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)

    loop = ResilientLoop(client, store, recovery, rebuild=rebuild, optimizer=optimizers, lr_scheduler=schedulers)
    loop.join()
    if args.replacement:
        store.set(RecoveryKeys(args.run_id).rejoined(args.generation, config.rank), repr(time.time()))
    loop.run(start, args.iters, forward_backward=forward_backward, apply=apply, before=before, joined=True)
    report = client.close()
    dist.destroy_process_group()
    os.makedirs(args.out, exist_ok=True)
    state = {
        s: {"model": m.state_dict(), "optimizer": o.state_dict(), "lr_scheduler": sc.state_dict()}
        for s, m, o, sc in zip(config.stages, models, optimizers, schedulers, strict=True)
    }
    events = [e.to_dict() for e in loop.events]
    out = {
        "position": k,
        "stages": state,
        "events": events,
        "recovered": recovered,
        "iteration_end": loop.iteration_end,
    }
    torch.save({**out, "close_ok": report.ok}, os.path.join(args.out, f"stage{k}.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
