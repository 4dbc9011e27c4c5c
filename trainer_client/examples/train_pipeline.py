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

The training loop is the README snippet plus measurement knobs: ``--no-logging`` (baseline),
``--alternate-logging N`` (blocks of N iterations with logging on, then off, ...: both
configurations in the same run, for a fair overhead measurement on a noisy machine).
``--resilient`` (and ``--replacement``) hand over to ``train_resilient``: the same stage trained
with ``trainer_client.survivor.ResilientLoop``, which survives other stages' failures.
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

from trainer_client import (
    CheckpointConfig,
    ClientConfig,
    CommitConfig,
    IterationAbortedError,
    StorageConfig,
    SwiftlogClient,
    WriterConfig,
)
from trainer_client.examples.gpt import (
    GPTConfig,
    SyntheticTokens,
    build_stage_module,
    example_io,
    loss_fn,
    make_lr_scheduler,
    make_optimizer,
)

__all__ = ["build_parser", "run_stage", "main"]

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    a = p.add_argument
    a("--stage", type=int, required=True)
    a("--num-stages", type=int, default=4)
    a("--store-host", default="127.0.0.1")
    a("--store-port", type=int, required=True, help="TCPStore (hosted outside the stages) for rendezvous and commit")
    a("--run-id", default="example")
    a("--store-root", required=True, help="log store root of this node")
    a("--cold-url", default=None)
    a("--cold-endpoint", default=None, help="S3 endpoint URL for an s3:// cold tier (loopback test servers)")
    a("--cold-key", default="swiftlog", help="S3 access key for --cold-endpoint")
    a("--cold-secret", default="swiftlog", help="S3 secret for --cold-endpoint")
    a("--checkpoint-url", default=None)
    a("--out", required=True, help="directory for stage{k}.pt results")
    a("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    a("--iters", type=int, default=6)
    a("--ckpt-at", default="", help="comma-separated iterations at which to checkpoint (iterations applied)")
    a("--seed", type=int, default=1234)
    a("--threads", type=int, default=1, help="torch.set_num_threads per stage")
    # model
    a("--vocab", type=int, default=64)
    a("--hidden", type=int, default=32)
    a("--heads", type=int, default=4)
    a("--layers", type=int, default=1, help="blocks per stage")
    a("--seq", type=int, default=16)
    a("--dropout", type=float, default=0.1)
    a("--micro-batch-size", type=int, default=2)
    a("--n-microbatches", type=int, default=4)
    a(
        "--mlp-norm",
        default="layer",
        choices=["layer", "batch"],
        help="norm before each MLP (batch: running statistics in buffers)",
    )
    a("--recompute", action="store_true", help="activation recomputation (torch.utils.checkpoint around each block)")
    a(
        "--clip-grad-norm",
        type=float,
        default=None,
        help="clip gradients to this global norm (over all stages) before each step",
    )
    a(
        "--tie-embeddings",
        choices=["client", "raw"],
        default=None,
        help="tie the first stage's token embedding to the last stage's head weight (equal at the start, "
        "their gradients summed over the two stages each iteration, before the clip): 'client' through "
        "client.all_reduce_grads_ (logged and replayed), 'raw' with a plain dist.all_reduce (not replayable: "
        "a replay of either stage is not verified)",
    )
    a(
        "--autocast",
        default="none",
        choices=["none", "bf16"],
        help="run each schedule step under torch.autocast (bf16 on the stage's device)",
    )
    # logging
    a("--no-logging", action="store_true")
    a("--alternate-logging", type=int, default=0, help="blocks of N iterations: logging on, off, on, ...")
    a("--groups", default="", help="logging group sizes, e.g. 2,2")
    a("--data-source", action="store_true", help="inputs/targets from the deterministic data source (not logged)")
    a("--max-queue-bytes", type=int, default=256 << 20)
    a("--overflow", default="wait", choices=["wait", "gap"])
    a("--max-backlog-bytes", type=int, default=None)
    a("--encode-threads", type=int, default=1)
    a("--codec", default="auto")
    a("--segment-iters", type=int, default=2)
    a(
        "--no-ship-data",
        action="store_true",
        help="inputs/targets/META reach the cold tier only with their segment (CommitConfig.ship_data)",
    )
    a(
        "--no-ship-wait",
        action="store_true",
        help="commit does not wait for the first/last stage's inputs/targets to reach the cold tier "
        "(CommitConfig.ship_wait)",
    )
    a("--no-commit", action="store_true")
    a("--commit-timeout", type=float, default=60.0)
    a("--pg-timeout", type=float, default=60.0)
    a("--record-received", action="store_true", help="save every received tensor (tests)")
    a(
        "--probe-copy",
        action="store_true",
        help="benchmark: in logged iterations also time a plain clone() of every logged send (result 'copy_probe')",
    )
    a(
        "--file-size-limit",
        type=int,
        default=None,
        help="fault injection: cap every file this process writes at N bytes (RLIMIT_FSIZE) during training, "
        "i.e. a full disk as far as the log store is concerned",
    )
    return p


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


def gpt_config_from_args(args: argparse.Namespace) -> GPTConfig:
    """The example model's configuration from this script's arguments (shared with train_resilient)."""
    return GPTConfig(
        vocab=args.vocab,
        hidden=args.hidden,
        heads=args.heads,
        layers_per_stage=args.layers,
        seq=args.seq,
        dropout=args.dropout,
        micro_batch_size=args.micro_batch_size,
        n_microbatches=args.n_microbatches,
        mlp_norm=args.mlp_norm,
        recompute=args.recompute,
    )


def step_and_clip(
    args: argparse.Namespace,
    client: SwiftlogClient,
    model: torch.nn.Module,
    data: SyntheticTokens,
    it: int,
    losses: list,
    tie: tuple[torch.Tensor, Any] | None = None,
) -> None:
    """Iteration ``it``'s schedule step as the example scripts run it (shared with train_resilient):
    under bf16 autocast with ``--autocast bf16``, on the data source's batch or the synthetic one,
    then the tied weight's gradient summed over its two stages (``tie``: the weight and the group,
    see :func:`tie_embeddings`), then with ``--clip-grad-norm`` the clip to the global norm over
    the current process group's stages."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
        if args.data_source:
            client.step(it, losses=losses)
        else:
            x, y = data(it)
            client.step(it, x, target=y, losses=losses)
    if tie is not None:
        weight, group = tie
        if args.tie_embeddings == "client":
            client.all_reduce_grads_([weight], group=group)
        else:
            dist.all_reduce(weight.grad, group=group)
    if args.clip_grad_norm is not None:
        client.clip_grad_norm_(model.parameters(), args.clip_grad_norm, group=dist.group.WORLD)


def tie_embeddings(
    model: torch.nn.Module, stage: int, num_stages: int, *, sync: bool = True
) -> tuple[torch.Tensor, Any] | None:
    """Tie the first stage's token embedding to the last stage's head weight (both vocab x hidden):
    every rank of the current process group creates the two stages' group (a collective: again
    after every re-formation), and with ``sync`` (a fresh start) the head starts from the
    embedding's values. Returns (the weight, the group) on those two stages, None elsewhere."""
    group = dist.new_group([0, num_stages - 1])
    if stage not in (0, num_stages - 1):
        return None
    weight = model.tok.weight if stage == 0 else model.head.weight
    if sync:
        dist.broadcast(weight.detach(), src=0, group=group)
    return weight, group


def config_from_args(args: argparse.Namespace) -> ClientConfig:
    """The trainer client's configuration from this script's arguments (shared with train_resilient)."""
    cold_options = {}
    if args.cold_endpoint:
        cold_options = {
            "key": args.cold_key,
            "secret": args.cold_secret,
            "client_kwargs": {"endpoint_url": args.cold_endpoint},
        }
    return ClientConfig(
        run_id=args.run_id,
        stage=args.stage,
        num_stages=args.num_stages,
        store_root=args.store_root,
        cold_url=args.cold_url,
        seed=args.seed,
        logging_groups=[int(x) for x in args.groups.split(",")] if args.groups else None,
        log_data=not args.data_source,
        enabled=not args.no_logging,
        writer=WriterConfig(
            max_queue_bytes=args.max_queue_bytes,
            overflow=args.overflow,
            encode_threads=args.encode_threads,
            codec=args.codec,
        ),
        commit=CommitConfig(
            timeout=datetime.timedelta(seconds=args.commit_timeout),
            ship_data=not args.no_ship_data,
            **({"ship_wait": None} if args.no_ship_wait else {}),
        ),
        storage=StorageConfig(
            cold_options=cold_options,
            segment_iters=args.segment_iters,
            max_backlog_bytes=args.max_backlog_bytes,
        ),
        checkpoints=CheckpointConfig(url=args.checkpoint_url),
    )


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
        # survives other stages' failures (trainer_client.survivor.ResilientLoop); see train_resilient
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
