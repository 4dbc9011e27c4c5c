"""Hybrid benchmark: a data-parallel x pipeline mesh recovering from a replica, from logs, or rolling back.

Fixed workload: the example GPT (hidden 512, 8 heads, one block per stage, sequence 64, vocabulary
4096, 4 micro-batches of 2, AdamW: ``bench/client_overhead.py``'s model) as a mesh of
``dp_replicate=2`` x ``pp=4`` (8 processes, gloo on CPU, one thread each, on this machine's cores),
30 iterations, checkpoints at 10 and 30, the failure at iteration 20 (10 iterations after the
checkpoint), mid-forward of micro-batch 1, in stage 1.

Side by side in one run, ``--reps`` times each (SWIFT run, then rollback run, paired):
- ``replica``: stage 1's replica 1 is SIGKILLed; its replacement receives the state of replica 0
  (no replay). Measured: kill -> every rank in the new process group at iteration 30 and the state
  copied (``resumed_s``); the replacement's process start is reported on its own
  (``replacement_start_s``: the fork server; a cluster adds a container start).
- ``all_replicas_lost``: both replicas of stage 1 are SIGKILLed at once; each replacement replays
  its own pipeline's logs from the checkpoint at 20, and they repeat the live gradient average
  between them.
- ``rollback``: the same kill, every rank restarted from the checkpoint at 20 (what a job without
  SWIFT does): kill -> the restarted mesh finished iteration 29 again.
- ``overhead_ratio``: a failure-free run of 60 iterations with logging switched on and off in
  alternating blocks of 2 iterations (``--alternate-logging 2``); each unlogged iteration's time
  against its logged neighbours' (an iteration's time: the slowest rank's), the median over the
  pairs; ``overhead.ratio_iqr``: their quartiles (how much the shared machine moves it). The
  client's own costs per process come from its stats (``overhead.client``). Logging to the hot
  tier, as ``bench/client_overhead.py`` measures it; ``overhead_ratio_file_cold_tier``: the same
  run with the ``file://`` cold tier on the same disk (every segment copied and fsynced again by
  8 processes on this machine's cores; an object store would take that copy off the node).
- ``transfer``: a state of more than 2 GB (parameters and SGD momentum) streamed from a donor to a
  receiver process over a gloo group on loopback, as a replica heal does (``send_state`` /
  ``receive_state``, digest-checked), in GB/s.

Every recovered run's ranks are compared bit for bit with a failure-free run (``bit_exact``).
Writes bench/results/hybrid.json. ``python bench/hybrid_bench.py [--reps N] [--quick]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from bench._runs import logging_overhead  # noqa: E402
from replay.compare import states_equal
from replay.launcher import KillSpec, RecoveryRun, resumed_after_rollback, run_with_failures
from trainer_client import loopback_store
from trainer_client.commit import gloo_on_loopback
from trainer_client.replicas import receive_state, send_state

RESULTS = Path(__file__).resolve().parent / "results" / "hybrid.json"
ITERS, CKPTS, FAIL_IT, CKPT_BEFORE, OVERHEAD_ITERS = 30, "10,30", 20, 10, 60
STAGES, REPLICAS = 4, 2
MODEL = ["--hidden", "512", "--heads", "8", "--layers", "1", "--seq", "64", "--n-microbatches", "4", "--vocab", "4096"]
QUICK = ["--hidden", "64", "--layers", "1", "--seq", "16", "--n-microbatches", "4"]
TRANSFER_BYTES = 2_200_000_000  # parameters + momentum


def _args(
    base: Path,
    model: list[str],
    extra: list[str] = (),  # type: ignore[assignment]
    iters: int = 0,
    cold: bool = True,
) -> list[str]:
    return [
        "--iters",
        str(iters or ITERS),
        "--ckpt-at",
        CKPTS,
        "--seed",
        "1234",
        "--segment-iters",
        "4",
        *(["--cold-url", f"file://{base / 'cold'}"] if cold else []),
        *model,
        *extra,
    ]


def _run(
    base: Path,
    model: list[str],
    kills: list[KillSpec],
    mode: str,
    extra: list[str] = (),  # type: ignore[assignment]
    iters: int = 0,
    cold: bool = True,
) -> RecoveryRun:
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    r = run_with_failures(
        _args(base, model, list(extra), iters, cold),
        run_id="hybrid",
        base_dir=str(base),
        checkpoint_url=f"file://{base / 'ckpt'}",
        kills=kills,
        mode=mode,
        num_stages=STAGES,
        dp_replicate=REPLICAS,
        timeout_s=900,
    )
    if not r.ok:
        raise SystemExit(f"{mode} run failed:\n{r.describe()}")
    return r


def _exact(r: RecoveryRun, ref: RecoveryRun) -> bool:
    return not any(states_equal(r.results[k], ref.results[k]) for k in ref.results)


# ------------------------------------------------------------------ the state transfer
def _transfer_rank(rank: int, port: int, nbytes: int, q: Any) -> None:
    gloo_on_loopback()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    n_params = nbytes // 8  # float32 parameters, as many momentum values
    width = 8192
    layers = max(1, n_params // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if rank == 0:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        state = {"stage": 0, "model": model.state_dict(), "optimizer": opt.state_dict()}
        dist.barrier()
        rep = send_state(state, 1)
        q.put(("sent", rep.to_dict()))
    else:
        dist.barrier()
        t0 = time.perf_counter()
        # as the heal does: parameters in place, the optimizer's momentum into new memory
        state, rep = receive_state(0, into={f"model/{k}": v for k, v in model.state_dict().items()})
        t1 = time.perf_counter()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        q.put(("received", {**rep.to_dict(), "receive_s": t1 - t0, "load_s": time.perf_counter() - t1}))
    dist.destroy_process_group()


def _transfer(nbytes: int) -> dict[str, Any]:
    gloo_on_loopback()
    store = loopback_store()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_transfer_rank, args=(r, store.port, nbytes, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(120)
    recv = got["received"]
    return {
        "state_bytes": recv["bytes"],
        "tensors": recv["tensors"],
        "gb_per_s": recv["gb_per_s"],
        "data_s": recv["seconds"],
        "receive_s": recv["receive_s"],
        "load_state_dict_s": recv["load_s"],
        "digest_checked": True,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smaller model and transfer (smoke test)")
    a = p.parse_args(argv)
    model = QUICK if a.quick else MODEL
    work = Path(tempfile.mkdtemp(prefix="swiftlog-hybrid-bench-"))
    try:
        ref = _run(work / "ref", model, [], "swift")
        one = [KillSpec(1, FAIL_IT, 1, "forward", replica=1)]
        both = [KillSpec(1, FAIL_IT, 1, "forward", replica=r) for r in range(REPLICAS)]
        replica, lost, rollback = [], [], []
        exact = {"replica": True, "all_replicas_lost": True, "rollback": True}
        for rep in range(a.reps):
            s = _run(work / f"replica{rep}", model, one, "swift")
            exact["replica"] &= _exact(s, ref)
            heal = s.results[3]["transfers"][0]  # rank 3: stage 1, replica 1
            replica.append({**s.timings[0], "transfer": heal})
            s2 = _run(work / f"lost{rep}", model, both, "swift")
            exact["all_replicas_lost"] &= _exact(s2, ref)
            lost.append(s2.timings[0])
            g = _run(work / f"rollback{rep}", model, one, "rollback")
            exact["rollback"] &= _exact(g, ref)
            rollback.append({"resumed_s": resumed_after_rollback(g, FAIL_IT)})
        alternate = ["--alternate-logging", "2"]
        over = logging_overhead(_run(work / "overhead", model, [], "swift", alternate, OVERHEAD_ITERS, cold=False), 2)
        over_cold = logging_overhead(_run(work / "overhead-cold", model, [], "swift", alternate, OVERHEAD_ITERS), 2)
        transfer = _transfer(200_000_000 if a.quick else TRANSFER_BYTES)
        med = statistics.median
        rb = med([r["resumed_s"] for r in rollback])
        rec = med([t["resumed_s"] for t in replica])
        rec_lost = med([t["resumed_s"] for t in lost])
        out = {
            "replica_recovery_vs_global_rollback": rec / rb,
            "all_replicas_lost_recovery_vs_global_rollback": rec_lost / rb,
            "overhead_ratio": over["overhead_ratio"],
            "overhead_ratio_file_cold_tier": over_cold["overhead_ratio"],
            "transfer_gb_per_s": transfer["gb_per_s"],
            "replica_recovery_s": rec,
            "replica_replacement_start_s": med([t["replacement_start_s"] for t in replica]),
            "replica_heal_gb_per_s": med([t["transfer"]["gb_per_s"] for t in replica]),
            "replica_heal_bytes": replica[0]["transfer"]["bytes"],
            "all_replicas_lost_recovery_s": rec_lost,
            "all_replicas_lost_replay_s": med([t["replay_s"] for t in lost]),
            "global_rollback_s": rb,
            "per_rep": {
                "replica": [t["resumed_s"] / r["resumed_s"] for t, r in zip(replica, rollback, strict=True)],
                "all_replicas_lost": [t["resumed_s"] / r["resumed_s"] for t, r in zip(lost, rollback, strict=True)],
            },
            "bit_exact": exact,
            "verified_all_replicas_lost": all(t["verified"] for t in lost),
            "overhead": over,
            "overhead_file_cold_tier": over_cold,
            "transfer": transfer,
            "setup": {
                "mesh": f"dp_replicate={REPLICAS} x pp={STAGES}",
                "model_args": model,
                "iterations": ITERS,
                "checkpoints": CKPTS,
                "failed_at_iteration": FAIL_IT,
                "iterations_redone_or_replayed": FAIL_IT - CKPT_BEFORE,
                "reps": a.reps,
                "process_start": "fork server with torch preloaded (every mode)",
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
            },
            "runs": {"replica": replica, "all_replicas_lost": lost, "rollback": rollback},
        }
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(out, indent=2, default=str))
        print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2, default=str))
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
