"""Example / reusable training script: one pipeline stage of the GPT in its own process, with swiftlog.

Run one process per stage against a TCPStore hosted outside the training ranks (it carries the
process-group rendezvous and the commit decisions)::

    python -m trainer_client.examples.train_pipeline --stage 0 --num-stages 4 \\
        --store-port 29500 --run-id demo --store-root /tmp/swiftlog --out /tmp/out

or let :func:`trainer_client.examples.launch.launch_pipeline` host the store and start all
stages. Each stage writes ``{out}/stage{k}.pt`` (final model/optimizer/scheduler state, losses,
per-iteration times, the client's stats and close report, and with ``--record-received`` every
tensor it received, keyed ``(iteration, micro_batch, "act" | "grad")``) and prints one JSON line
``RESULT {...}`` on stdout.

The training loop is docs/training-contract.md's plus measurement knobs: ``--no-logging`` (baseline),
``--alternate-logging N`` (blocks of N iterations with logging on, then off, ...: both
configurations in the same run, for a fair overhead measurement on a noisy machine).
``--resilient`` (and ``--replacement``) hand over to ``train_resilient``: the same stage trained
with ``trainer_client.ResilientLoop``, which survives other stages' failures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from trainer_client import IterationAbortedError, SwiftlogClient
from trainer_client.examples.common import (
    build_parser,
    config_from_args,
    gpt_config_from_args,
    step_and_clip,
    tie_embeddings,
)
from trainer_client.examples.gpt import (
    SyntheticTokens,
    build_stage_module,
    example_io,
    loss_fn,
    make_lr_scheduler,
    make_optimizer,
)

__all__ = ["build_parser", "run_stage", "main"]

logger = logging.getLogger(__name__)


def _record_received(stage: Any, client: SwiftlogClient, received: dict) -> None:
    """Wrap the stage's compute entry points to clone what it received (test instrumentation)."""
    fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(mb: int, args: Any, kwargs: Any = None, save_forward_output: bool = True) -> Any:
        if not stage.is_first:
            received[(client.recorder.iteration, mb, "act")] = [
                i.buffer.detach().clone() for i in stage.args_recv_info[mb]
            ]
        return fwd(mb, args, kwargs, save_forward_output)

    def backward_one_chunk(mb: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False) -> Any:
        if not stage.is_last:
            received[(client.recorder.iteration, mb, "grad")] = [
                i.buffer.detach().clone() for i in stage.grad_recv_info[mb] if i.buffer is not None
            ]
        return bwd(mb, loss, full_backward, last_backward)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk


def _probe_copy(stage: Any, client: SwiftlogClient, probe: dict) -> None:
    """Time a plain ``clone()`` of every send the client logs, in the same process and moment
    (benchmark instrumentation: the reference cost the client's enqueue is compared with)."""

    def timed(fn: Any) -> Any:
        def wrapper(mb: int) -> Any:
            ops = fn(mb)
            if client.recorder.enabled:
                for op in ops:
                    t0 = time.perf_counter()
                    op.tensor.clone()
                    probe["s"] += time.perf_counter() - t0
                    probe["bytes"] += op.tensor.numel() * op.tensor.element_size()
            return ops

        return wrapper

    stage.get_fwd_send_ops = timed(stage.get_fwd_send_ops)
    stage.get_bwd_send_ops = timed(stage.get_bwd_send_ops)


def _limit_file_size(nbytes: int | None) -> None:
    """Set (or with None lift) the soft RLIMIT_FSIZE; writes past it fail with EFBIG."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # default action would kill the process
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if nbytes is None else nbytes, hard))


def run_stage(args: argparse.Namespace) -> dict[str, Any]:
    """Train one stage for ``args.iters`` iterations; returns (and saves) its results."""
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    k, S = args.stage, args.num_stages
    cfg = gpt_config_from_args(args)
    store = dist.TCPStore(args.store_host, args.store_port, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"{args.run_id}/pg/gen0", store),
        rank=k,
        world_size=S,
        timeout=datetime.timedelta(seconds=args.pg_timeout),
    )
    t_pg = time.perf_counter()
    data = SyntheticTokens(cfg, seed=args.seed)
    config = config_from_args(args)
    client = SwiftlogClient(
        config, commit_store=None if args.no_commit else store, data_source=data if args.data_source else None
    )
    model = build_stage_module(cfg, k, S, seed=args.seed)
    tie = tie_embeddings(model, k, S) if args.tie_embeddings else None
    optimizer = make_optimizer(model)
    lr_scheduler = make_lr_scheduler(optimizer)
    inp, out = example_io(cfg, k, S)
    if args.autocast == "bf16" and k == S - 1:
        # declare what the forward produces: the head's logits are bf16 under autocast
        # (torch 2.11 checks the last stage's too)
        out = torch.zeros_like(out, dtype=torch.bfloat16, requires_grad=True)
    stage = client.pipeline_stage(model, "cpu", input_args=inp, output_args=out)
    client.schedule(stage, args.schedule, n_microbatches=cfg.n_microbatches, loss_fn=loss_fn)  # client.step drives it
    received: dict = {}
    if args.record_received:
        _record_received(stage, client, received)
    if args.file_size_limit is not None:
        _limit_file_size(args.file_size_limit)
    t_train = time.perf_counter()
    copy_probe = {"bytes": 0, "s": 0.0}
    if args.probe_copy:
        _probe_copy(stage, client, copy_probe)
    ckpt_at = {int(x) for x in args.ckpt_at.split(",") if x}
    losses_per_it: list[float] = []
    iter_s: list[float] = []
    logged: list[bool] = []
    queue_at_end: list[int] = []
    ckpts: dict[int, str] = {}
    for it in range(args.iters):
        if it in ckpt_at:
            ckpts[it] = client.checkpoint(it, model, optimizer, lr_scheduler, extra={"gpt": cfg.to_dict()})
        if args.alternate_logging:
            client.set_logging(not args.no_logging and (it // args.alternate_logging) % 2 == 0)
        logged.append(client.recorder.enabled)
        t0 = time.perf_counter()
        losses: list[torch.Tensor] = []
        step_and_clip(args, client, model, data, it, losses, tie)
        try:
            client.commit(it)
        except IterationAbortedError:
            optimizer.zero_grad(set_to_none=True)
            raise
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        iter_s.append(time.perf_counter() - t0)
        queue_at_end.append(client.writer.stats().queue_bytes)
        if losses:
            losses_per_it.append(sum(float(x.detach()) for x in losses) / len(losses))
    if args.iters in ckpt_at:
        ckpts[args.iters] = client.checkpoint(args.iters, model, optimizer, lr_scheduler, extra={"gpt": cfg.to_dict()})
    t_close = time.perf_counter()
    report = client.close()
    stats = client.stats()
    if args.file_size_limit is not None:
        _limit_file_size(None)
    dist.destroy_process_group()
    t_end = time.perf_counter()
    result = {
        "stage": k,
        "iters": args.iters,
        "losses": losses_per_it,
        "iter_s": iter_s,
        "logged": logged,
        "queue_at_end": queue_at_end,
        "copy_probe": copy_probe,
        "checkpoints": ckpts,
        "stats": stats,
        "close": {
            "ok": report.ok,
            "drained": report.drained,
            "error": report.error,
            "uploaded_segments": report.uploaded_segments,
            "faults": [f"{f.kind}: {f.message}" for f in report.logging_faults],
        },
        "num_threads": torch.get_num_threads(),
        "timing_s": {
            "rendezvous": t_pg - t_start,
            "setup": t_train - t_pg,
            "train": t_close - t_train,
            "close": t_end - t_close,
        },
    }
    os.makedirs(args.out, exist_ok=True)
    torch.save(
        {
            **result,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict(),
            "received": received,
            "gpt": cfg.to_dict(),
        },
        os.path.join(args.out, f"stage{k}.pt"),
    )
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--resilient" in argv or "--replacement" in argv:
        # survives other stages' failures (trainer_client.ResilientLoop); see train_resilient
        from trainer_client.examples import train_resilient

        return train_resilient.main(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"stage{args.stage} %(levelname)s %(name)s: %(message)s")
    result = run_stage(args)
    summary = {k: result[k] for k in ("stage", "iters", "losses", "iter_s", "checkpoints", "close", "timing_s")}
    summary["writer"] = result["stats"]["writer"]
    summary["selective"] = result["stats"]["selective"]
    print("RESULT " + json.dumps(summary, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
