"""The smallest complete training script with in-place recovery: a template for your own.

Everything model-specific is in the five functions under "yours" (a 4-layer MLP classifier cut into
``--num-stages`` stages, SGD with momentum, a step schedule); replace them and keep the rest. The
rest is the whole contract of a stage process with swiftlog's in-place recovery, through the public
API only:

- a stage: :class:`~trainer_client.SwiftlogClient` + :class:`~trainer_client.ResilientLoop` (a
  peer's death: keep the state, wait for the replacement, re-form the process group, go on);
- a replacement (``--replacement --generation G``): :func:`replay.recover_stage`
  rebuilds the lost stage from its newest checkpoint and the survivors' logs (the stage factory
  below builds the objects it loads the checkpoint into; the loss function is the one the live
  schedule used, which META names), then :func:`~replay.report_ready` and the loop
  joins the next generation; when a replay is impossible, :func:`~replay.report_fallback`
  and exit code 3 (the scheduler then restarts every stage from a common checkpoint:
  ``--resume-from C``);
- a replay helper (``--replay-helper-rank R``): :func:`replay.serve_replay_helper`.

Who starts which process, with which arguments, is the scheduler's part:
``replay.run_with_failures(args, script="trainer_client.examples.minimal_resilient", ...)``
on one machine (it also injects ``--kill-at IT,MB,PHASE``; this script honours the phases
"forward" (as iteration IT starts), "backward" (in micro-batch MB's backward), "commit" (after the
schedule's step, before the commit) and "optimizer" of iteration IT), a cluster's job controller in production
(``docs/recovery.md``). Arguments: ``--stage --num-stages --run-id --store-host --store-port
--store-root --checkpoint-url --out`` (set by the scheduler), ``--iters N --ckpt-at I,J --cold-url URL``.
The script writes ``{out}/stage{k}.pt`` with its final state.
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
    RecoveryConfig,
    RecoveryKeys,
    ResilientLoop,
    SwiftlogClient,
    checkpoint_uri,
    form_mesh,
    load_checkpoint,
)
from trainer_client.fsdp import local_state

__all__ = ["build_parser", "factory", "loss", "main"]

SEED = 7
WIDTH, CLASSES, BATCH, N_MICROBATCHES = 32, 5, 16, 4


# ================================================================================ yours
def build_stage(stage: int, num_stages: int) -> nn.Module:
    """Stage ``stage``'s module (deterministic: a replay builds it again before loading the checkpoint)."""
    torch.manual_seed(100 + stage)
    layers: list[nn.Module] = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(0.1)]
    if stage == num_stages - 1:
        layers.append(nn.Linear(WIDTH, CLASSES))
    return nn.Sequential(*layers)


def factory(
    stage: int, num_stages: int, checkpoint: Any = None, shard_mesh: Any = None, **_: Any
) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The stage factory of the training and of a replay: (module, optimizer, lr scheduler), fresh.
    With ``shard_mesh`` (FSDP2: ``--dp-shard`` > 1) every linear layer and the stage are
    ``fully_shard``-ed over it before the optimizer is built."""
    module = build_stage(stage, num_stages)
    if shard_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in module:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=shard_mesh)
        fully_shard(module, mesh=shard_mesh)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    return module, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def example_io(stage: int, num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's input and output of the stage, as the pipeline sends them."""
    mb = BATCH // N_MICROBATCHES
    out = torch.zeros(mb, CLASSES if stage == num_stages - 1 else WIDTH, requires_grad=True)
    return torch.zeros(mb, WIDTH, requires_grad=stage > 0), out


def batch(iteration: int, replica: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The iteration's inputs and targets of data-parallel replica ``replica`` (every stage makes
    the same call; only the first and last use them). A function of both: a replica's data
    position is the iteration."""
    g = torch.Generator().manual_seed(1000 + iteration + 7919 * replica)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A module-level function: META names it, so a replay of the last stage finds it."""
    return nn.functional.cross_entropy(output, target)


# ================================================================================ the contract
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--stage", type=int, required=True)
    a("--num-stages", type=int, required=True)
    a("--replica", type=int, default=0, help="this rank's data-parallel replica")
    a("--dp-replicate", type=int, default=1, help="replicas of every stage (a pp x dp_replicate mesh)")
    a("--shard", type=int, default=0, help="this rank's FSDP shard")
    a("--dp-shard", type=int, default=1, help="ranks sharding every stage (FSDP2 fully_shard; DCP checkpoints)")
    a("--run-id", required=True)
    a("--store-host", default="127.0.0.1")
    a("--store-port", type=int, required=True)
    a("--store-root", required=True, help="this node's log store root")
    a("--checkpoint-url", required=True, help="durable storage for checkpoints (a shared directory, s3://...)")
    a(
        "--cold-url",
        default=None,
        help="the logs' cold tier (file:///dir, s3://bucket/prefix); "
        "without one a failed first or last stage's own data is lost with it",
    )
    a("--out", required=True, help="where stage{k}.pt (stage{k}-dp{r}.pt with replicas), the final state, goes")
    a("--iters", type=int, default=8)
    a("--ckpt-at", default="0", help="iterations to checkpoint at, comma-separated")
    a("--generation", type=int, default=0)
    a("--replacement", action="store_true")
    a("--replay-helpers", type=int, default=0)
    a("--replay-helper-rank", type=int, default=0)
    a("--resume-from", type=int, default=None)
    a("--kill-at", default="", help="fault injection: IT,MB,PHASE (phase forward, backward, commit or optimizer)")
    a("--resilient", action="store_true", help="(implied)")
    return p


def main(argv: list[str] | None = None) -> int:
    from replay import (
        EXIT_FALLBACK,
        ReplacementFallback,
        recover_stage,
        replay_shard_in_place,
        report_fallback,
        report_ready,
        serve_replay_helper,
    )

    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    k, S, r, R, sh, D = args.stage, args.num_stages, args.replica, args.dp_replicate, args.shard, args.dp_shard
    store = dist.TCPStore(args.store_host, args.store_port, is_master=False, timeout=datetime.timedelta(seconds=120))
    config = ClientConfig(
        run_id=args.run_id,
        stage=k,
        num_stages=S,
        replica=r,
        dp_replicate=R,
        shard=sh,
        dp_shard=D,
        seed=SEED,
        store_root=args.store_root,
        cold_url=args.cold_url,
        # sharded stages checkpoint through DCP: each rank writes and loads its own shard
        checkpoints=CheckpointConfig(url=args.checkpoint_url, format="dcp" if D > 1 else "torch"),
    )
    recovery = RecoveryConfig(
        run_id=args.run_id,
        stage=k,
        num_stages=S,
        replica=r,
        dp_replicate=R,
        shard=sh,
        dp_shard=D,
        generation=args.generation + 1 if args.replacement else args.generation,
        store_host=args.store_host,
        store_port=args.store_port,
    )
    if args.replay_helper_rank:
        from logstore import SwiftlogError

        try:
            serve_replay_helper(store, args.run_id, args.generation, k, args.replay_helper_rank, factory=factory)
        except SwiftlogError as e:  # the replay is impossible (a ReplayError, a CheckpointError)
            # the replacement reports the fallback
            print(f"helper {args.replay_helper_rank}: {e}", flush=True)
            return EXIT_FALLBACK
        return 0
    t_main = time.time()
    start, recovered = 0, None
    if args.replacement:
        t_recover = time.time()
        try:
            rec = recover_stage(
                store,
                run_id=args.run_id,
                stage=k,
                num_stages=S,
                generation=args.generation,
                checkpoint_url=config.resolved_checkpoint_url(),
                sources=None,
                factory=factory,
                helpers=args.replay_helpers,
                replica=r,
                dp_replicate=R,
                shard=sh,
                dp_shard=D,
            )
        except ReplacementFallback as e:
            report_fallback(store, args.run_id, args.generation, str(e))
            return EXIT_FALLBACK
        recovered = {**rec.summary(), "t_main": t_main, "t_recover": t_recover}
        report_ready(store, args.run_id, args.generation, config.rank, recovered)
        start = rec.resume
        client = SwiftlogClient(config, commit_store=store)
        if rec.module is None:  # a shard copied from its replica: built over the next generation's shard group
            form_mesh(store, recovery, client)
            model, optimizer, lr_scheduler = factory(k, S, shard_mesh=client.shard_mesh)
        else:
            model, optimizer, lr_scheduler = rec.module, rec.optimizer, rec.lr_scheduler
    else:
        client = SwiftlogClient(config, commit_store=store)
        # sharded: the first generation's group forms now, so the stage can be sharded over it
        if D > 1:
            form_mesh(store, recovery, client)
        model, optimizer, lr_scheduler = factory(k, S, shard_mesh=client.shard_mesh if D > 1 else None)
        if args.resume_from is not None:  # a global rollback
            ck_uri = checkpoint_uri(config.resolved_checkpoint_url(), k, args.resume_from, config.checkpoints.format)
            load_checkpoint(ck_uri).apply(model, optimizer, lr_scheduler)
            start = args.resume_from
    inp, out = example_io(k, S)

    def rebuild() -> None:  # after every (re)join: a stage and schedule over the new process group
        stage = client.pipeline_stage(model, "cpu", input_args=inp, output_args=out)
        client.schedule(stage, "1f1b", n_microbatches=N_MICROBATCHES, loss_fn=loss)

    kill, kill_mb, backwards = None, 0, [-1, 0]  # backwards: (iteration, count) of the module's backward calls
    if args.kill_at:  # IT,MB,PHASE
        it_s, mb_s, phase_s = args.kill_at.split(",")
        # a phase this script does not inject must not pass as a failure-free run
        if phase_s not in ("forward", "backward", "commit", "optimizer"):
            raise SystemExit(
                f"--kill-at {args.kill_at}: this script injects the phases forward, backward, commit and optimizer, "
                f"not {phase_s!r}"
            )
        kill, kill_mb = (int(it_s), phase_s), int(mb_s)

    def die_if(it: int, phase: str) -> None:
        if kill == (it, phase):
            store.set(RecoveryKeys(args.run_id).kill_time(config.rank), repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    def on_backward(*_: Any) -> None:  # the "backward" phase: in micro-batch kill_mb's backward
        if kill is not None and kill[1] == "backward" and backwards[0] == kill[0]:
            if backwards[1] == kill_mb:
                die_if(kill[0], "backward")
            backwards[1] += 1

    model.register_full_backward_pre_hook(on_backward)

    ckpt_at = {int(x) for x in args.ckpt_at.split(",") if x}

    def before(it: int) -> None:
        if it in ckpt_at:
            client.checkpoint(it, model, optimizer, lr_scheduler)

    def forward_backward(it: int) -> None:
        die_if(it, "forward")
        backwards[:] = [it, 0]
        x, y = batch(it, config.dp_index)  # each data-parallel pipeline its own data
        client.step(it, x, target=y)  # with replicas, it also averages the gradients over them
        die_if(it, "commit")

    def apply(it: int) -> None:
        die_if(it, "optimizer")
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    def replay_shards(g: int) -> int:  # a shard of this stage was lost: the shard group replays
        return replay_shard_in_place(store, config, g, model, optimizer, lr_scheduler)

    loop = ResilientLoop(
        client,
        store,
        recovery,
        rebuild=rebuild,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        replay_shards=replay_shards if D > 1 else None,
    )
    loop.join()
    if args.replacement:
        store.set(RecoveryKeys(args.run_id).rejoined(args.generation, config.rank), repr(time.time()))
    loop.run(start, args.iters, forward_backward=forward_backward, apply=apply, before=before, joined=True)
    report = client.close()
    dist.destroy_process_group()
    os.makedirs(args.out, exist_ok=True)
    torch.save(
        {
            "stage": k,
            "replica": r,
            "transfers": [t.to_dict() for t in loop.transfers],
            "model": local_state(model.state_dict()),  # sharded: this rank's shards
            "optimizer": local_state(optimizer.state_dict()),
            "lr_scheduler": lr_scheduler.state_dict(),
            "events": [e.to_dict() for e in loop.events],
            "recovered": recovered,
            "close_ok": report.ok,
        },
        os.path.join(args.out, f"stage{k}.pt" if R * D == 1 else f"stage{k}-dp{config.dp_index}.pt"),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
