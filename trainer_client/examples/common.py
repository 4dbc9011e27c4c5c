"""What both example training scripts share: the command line, the configs built from it, and
two steps of the GPT's loop (the clipped schedule step, tied embeddings).

``train_pipeline`` trains a stage with these; ``train_resilient`` adds the recovery arguments.
"""

from __future__ import annotations

import argparse
import datetime
from typing import Any

import torch
import torch.distributed as dist

from trainer_client import (
    CheckpointConfig,
    ClientConfig,
    CommitConfig,
    StorageConfig,
    SwiftlogClient,
    WriterConfig,
)
from trainer_client.examples.gpt import GPTConfig, SyntheticTokens

__all__ = ["build_parser", "config_from_args", "gpt_config_from_args", "step_and_clip", "tie_embeddings"]

_DESCRIPTION = "Example / reusable training script: one pipeline stage of the GPT in its own process, with swiftlog."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=_DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--stage", type=int, required=True)
    a("--num-stages", type=int, default=4)
    a("--replica", type=int, default=0, help="this rank's data-parallel replica (a pp x dp_replicate mesh)")
    a("--dp-replicate", type=int, default=1, help="replicas of every stage; each replica has its own data")
    a("--shard", type=int, default=0, help="this rank's FSDP shard (a pp x dp_replicate x dp_shard mesh)")
    a("--dp-shard", type=int, default=1, help="ranks sharding every stage (FSDP2); each has its own data")
    a("--store-host", default="127.0.0.1")
    a("--store-port", type=int, required=True, help="TCPStore (hosted outside the stages) for rendezvous and commit")
    a("--run-id", default="example")
    a("--store-root", required=True, help="log store root of this node")
    a("--cold-url", default=None)
    a("--cold-endpoint", default=None, help="S3 endpoint URL for an s3:// cold tier (loopback test servers)")
    a("--cold-key", default="swiftlog", help="S3 access key for --cold-endpoint")
    a("--cold-secret", default="swiftlog", help="S3 secret for --cold-endpoint")
    a("--checkpoint-url", default=None)
    a(
        "--checkpoint-format",
        default="torch",
        choices=["torch", "dcp", "dcp-async"],
        help="torch.save files, or torch.distributed.checkpoint directories (dcp-async: async_save)",
    )
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
        # the global norm over the pipeline's stages (with replicas: their gradients are averaged already)
        client.clip_grad_norm_(model.parameters(), args.clip_grad_norm, group=client.pipeline_group)


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
        replica=args.replica,
        dp_replicate=args.dp_replicate,
        shard=args.shard,
        dp_shard=args.dp_shard,
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
        checkpoints=CheckpointConfig(
            url=args.checkpoint_url,
            format="torch" if args.checkpoint_format == "torch" else "dcp",
            async_save=args.checkpoint_format == "dcp-async",
        ),
    )
