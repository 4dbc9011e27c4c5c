"""Many-machines benchmark: a node lost under ``swiftlog agent``, recovered in place or rolled back.

Fixed workload: the example GPT (hidden 512, 8 heads, one block per stage, sequence 64, vocabulary
4096, 4 micro-batches of 2, AdamW: ``bench/client_overhead.py``'s model) as a 4-stage pipeline
(1F1B), one stage per node (as when a node's GPUs hold one stage), 4 nodes plus 1 spare node,
each node an agent process in its own namespaced host (``replay.agent.hosts``: network, mount,
IPC and UTS namespaces, a veth link shaped to LINK_RATE both ways; without root: 127.0.0.x hosts,
links not shaped, said in the results), gloo on CPU, one thread per rank, on this machine's cores;
30 iterations, checkpoints at 10 and 30, cold tier ``file://``. Node 1 (stage 1) is SIGKILLed with
its agent as soon as iteration 19 is applied, and its store root deleted.

Side by side in one run, ``--reps`` times each (paired):
- ``node_loss``: the spare's agent starts the replacement (warm: a fork server with torch and
  the script imported); it reads its neighbours' hot tiers over their node servers (HTTP over
  the shaped links), replays from the checkpoint at 10, and the job goes on. Measured: kill ->
  every rank in the new process group at the failed iteration (``resumed_s``), detection (three
  missed heartbeats once a survivor marked the generation failed) included.
- ``node_loss_cold_start``: the same with ``--cold-start`` (each process a fresh interpreter that
  imports torch and the script): ``warm_spare_saving_s`` is the difference.
- ``node_loss_k2``: the same with ``--replay-workers 2`` (one replay helper per replacement,
  placed on a survivor node).
- ``rollback``: the same loss with ``--mode rollback``: every rank restarted from the checkpoint at
  10 (what a job without SWIFT does): kill -> the restarted pipeline finished the failed
  iteration - 1 again.
- ``torchrun_*``: plain torchrun (4 workers on one host, ``--max-restarts 1``), rank 1 SIGKILLed
  mid-forward of iteration 20: with survivor snapshots (only rank 1 replays) or without (every
  rank restarts from the checkpoint at 10): kill -> the restarted job finished iteration 20.

Every run's final states are compared bit for bit with a failure-free run of the same launcher
(``bit_exact``, ``torchrun_bit_exact``).
Writes bench/results/multihost.json. ``python bench/multihost_bench.py [--reps N] [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from replay.agent.hosts import NamespaceHosts, namespaces_available
from replay.agent.local import LocalCluster, torchrun_command
from replay.compare import states_equal
from replay.launcher import RecoveryRun, resumed_after_rollback

RESULTS = Path(__file__).resolve().parent / "results" / "multihost.json"
ITERS, CKPTS, KILL_AFTER, CKPT_BEFORE = 30, "10,30", 19, 10
TORCHRUN_ITERS, TORCHRUN_CKPTS, TORCHRUN_FAIL_IT, TORCHRUN_CKPT_BEFORE = 30, "10,30", 20, 10
LINK_RATE = "1gbit"  # every namespaced host's link, both ways (tc tbf)
LOST_RANKS = (1,)  # node 1's
SCRIPT = "trainer_client.examples.train_resilient"
MODEL = ["--hidden", "512", "--heads", "8", "--layers", "1", "--seq", "64", "--n-microbatches", "4", "--vocab", "4096"]
QUICK = ["--hidden", "64", "--layers", "1", "--seq", "16", "--n-microbatches", "4"]


def _args(base: Path, model: list[str]) -> list[str]:
    return [
        "--iters",
        str(ITERS),
        "--ckpt-at",
        CKPTS,
        "--seed",
        "1234",
        "--segment-iters",
        "4",
        "--cold-url",
        f"file://{base / 'cold'}",
        *model,
    ]


def _run(base: Path, model: list[str], agent_args: list[str], lose: bool, hosts: Any) -> dict[str, Any]:
    shutil.rmtree(base, ignore_errors=True)
    c = LocalCluster(
        base,
        SCRIPT,
        _args(base, model),
        nnodes=4,
        nproc_per_node=1,
        agent_args=["--node-timeout", "1.0", *agent_args],
        hosts=hosts,
    ).start()
    fail_it = None
    if lose:
        fail_it = c.wait_for_iteration(KILL_AFTER, timeout_s=600) + 1
        c.lose_node(1)
    rc = c.wait(timeout_s=900)
    if rc != 0:
        raise SystemExit("\n".join(f"--- {p.log.name}\n{p.output()[-3000:]}" for p in c.nodes))
    doc = json.loads((c.out / "agent-run.json").read_text())
    results = {k: torch.load(c.out / f"stage{k}.pt", weights_only=False) for k in range(4)}
    return {"doc": doc, "results": results, "fail_it": fail_it}


def _torchrun(base: Path, model: list[str], snapshots: bool, kill: bool = True) -> dict[str, Any]:
    """Plain torchrun, 4 workers, --max-restarts 1, rank 1 SIGKILLed mid-forward of TORCHRUN_FAIL_IT:
    kill -> the restarted job finished that iteration (with or without survivor snapshots)."""
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    args = [
        "--iters",
        str(TORCHRUN_ITERS),
        "--ckpt-at",
        TORCHRUN_CKPTS,
        "--seed",
        "1234",
        "--segment-iters",
        "4",
        "--cold-url",
        f"file://{base / 'cold'}",
        "--data-source",
        *model,
        *(["--kill-rank", "1", "--kill-at", f"{TORCHRUN_FAIL_IT},1,forward"] if kill else []),
        *(["--snapshot-dir", str(base / "shm")] if snapshots else []),
    ]
    cmd = torchrun_command(base, "tr", args)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    if r.returncode != 0:
        raise SystemExit(f"torchrun failed:\n{(r.stdout + r.stderr)[-4000:]}")
    results = {k: torch.load(base / "out" / f"stage{k}.pt", weights_only=False) for k in range(4)}
    if not kill:
        return {"results": results}
    t_kill = float(re.search(r"KILL ([0-9.]+)", r.stdout).group(1))  # type: ignore[union-attr]
    done = max(t for res in results.values() for it, t, _ in res["iteration_end"] if it == TORCHRUN_FAIL_IT)
    starts = {k: res["start"] for k, res in results.items()}
    replay_s = (results[1]["recovered"] or {}).get("timings", {}).get("total_s")  # the lost rank's recovery
    return {"resumed_s": done - t_kill, "starts": starts, "results": results, "replay_total_s": replay_s}


def _iteration_s(results: dict[int, Any]) -> float:
    """The failure-free run's time per iteration (the last stage's, iterations 11..29)."""
    ends = {it: t for it, t, _ in results[3]["iteration_end"]}
    return (ends[29] - ends[10]) / 19


def _exact(r: dict[str, Any], ref: dict[str, Any]) -> bool:
    return not any(states_equal(r["results"][k], ref["results"][k]) for k in range(4))


def _swift(r: dict[str, Any]) -> dict[str, Any]:
    t = r["doc"]["timings"][0]
    recovered = {k: r["results"][k]["recovered"] for k in LOST_RANKS}
    read = {}
    for rec in recovered.values():
        for s in rec["sources"]:
            read[s["kind"]] = read.get(s["kind"], 0) + s["bytes"]
    return {**t, "bytes_read_by_source": read, "fail_iteration": r["fail_it"]}


def _rollback(r: dict[str, Any]) -> dict[str, Any]:
    run = RecoveryRun(True, "rollback", "", 0.0, {}, {}, results=r["results"])
    run.kill_times = {int(k): v for k, v in r["doc"]["kill_times"].items()}
    return {"resumed_s": resumed_after_rollback(run, r["fail_it"]), "fail_iteration": r["fail_it"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smaller model (smoke test)")
    a = p.parse_args(argv)
    model = QUICK if a.quick else MODEL
    work = Path(tempfile.mkdtemp(prefix="swiftlog-multihost-bench-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped bench still removes its hosts
    why_not = namespaces_available()
    with contextlib.ExitStack() as stack:
        hosts = None if why_not else stack.enter_context(NamespaceHosts(5, rate=LINK_RATE))
        try:
            return _measure(a, model, work, hosts, why_not)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _measure(a: argparse.Namespace, model: list[str], work: Path, hosts: Any, why_not: str | None) -> int:
    ref = _run(work / "ref", model, [], lose=False, hosts=hosts)
    cases = {
        "node_loss": [],
        "node_loss_cold_start": ["--cold-start"],
        "node_loss_k2": ["--replay-workers", "2"],
        "rollback": ["--mode", "rollback"],
    }
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    exact = dict.fromkeys(cases, True)
    for rep in range(a.reps):
        for case, extra in cases.items():
            r = _run(work / f"{case}{rep}", model, extra, lose=True, hosts=hosts)
            exact[case] &= _exact(r, ref)
            runs[case].append(_rollback(r) if case == "rollback" else _swift(r))
            print(case, rep, json.dumps({k: v for k, v in runs[case][-1].items() if k.endswith("_s")}), flush=True)
    torchrun: dict[str, list[dict[str, Any]]] = {"snapshots": [], "rollback": []}
    torchrun_exact = {"snapshots": True, "rollback": True}
    tref = _torchrun(work / "torchrun-ref", model, False, kill=False)
    for rep in range(a.reps):
        for case in torchrun:
            t = _torchrun(work / f"torchrun-{case}{rep}", model, case == "snapshots")
            torchrun_exact[case] &= _exact(t, tref)
            torchrun[case].append({k: t[k] for k in ("resumed_s", "starts", "replay_total_s")})
            print("torchrun", case, rep, f"{t['resumed_s']:.2f} s", t["starts"], flush=True)
    med = statistics.median
    it_s = _iteration_s(tref["results"])
    s = {case: med([x["resumed_s"] for x in runs[case]]) for case in cases}
    ts = {case: med([x["resumed_s"] for x in torchrun[case]]) for case in torchrun}
    rb = s["rollback"]
    out = {
        "node_loss_recovery_vs_global_rollback": s["node_loss"] / rb,
        "torchrun_restart_with_snapshots_vs_global_rollback": ts["snapshots"] / ts["rollback"],
        "node_loss_k2_vs_k1": s["node_loss_k2"] / s["node_loss"],
        "warm_spare_saving_s": s["node_loss_cold_start"] - s["node_loss"],
        "node_loss_recovery_s": s["node_loss"],
        "node_loss_cold_start_recovery_s": s["node_loss_cold_start"],
        "node_loss_k2_recovery_s": s["node_loss_k2"],
        "global_rollback_s": rb,
        "torchrun_restart_with_snapshots_s": ts["snapshots"],
        "torchrun_restart_global_rollback_s": ts["rollback"],
        "torchrun_bit_exact": torchrun_exact,
        # what both torchrun modes pay (workers stopped, started again, torch imported, rendezvous):
        # the rollback's time less the iterations it redid (those since the checkpoint, and the failed one)
        "torchrun_restart_overhead_s": ts["rollback"] - (TORCHRUN_FAIL_IT - TORCHRUN_CKPT_BEFORE + 1) * it_s,
        "torchrun_lost_rank_recovery_s": med([x["replay_total_s"] or 0.0 for x in torchrun["snapshots"]]),
        "iteration_s": it_s,
        "replay_s": {c: med([x["replay_s"] for x in runs[c]]) for c in cases if c != "rollback"},
        "replacement_start_s": {c: med([x["replacement_start_s"] for x in runs[c]]) for c in cases if c != "rollback"},
        "per_rep": {
            c: [x["resumed_s"] / r["resumed_s"] for x, r in zip(runs[c], runs["rollback"], strict=True)] for c in cases
        },
        "bit_exact": exact,
        "setup": {
            "pipeline": "4 stages (1F1B), one per node, + 1 spare node, one agent per node; node 1 lost",
            "hosts": (
                f"5 namespaced hosts (network, mount, IPC, UTS), veth links shaped to {LINK_RATE} both ways"
                if hosts is not None
                else f"127.0.0.2-6 of this machine, one store root each, links not shaped ({why_not})"
            ),
            "torchrun": (
                f"4 workers, --max-restarts 1, rank 1 killed in it {TORCHRUN_FAIL_IT}, ckpts {TORCHRUN_CKPTS}; "
                f"kill -> it {TORCHRUN_FAIL_IT} done again"
            ),
            "model_args": model,
            "iterations": ITERS,
            "checkpoints": CKPTS,
            "lost_after_iteration": KILL_AFTER,
            "iterations_replayed_or_redone": KILL_AFTER + 1 - CKPT_BEFORE,
            "node_timeout_s": 1.0,
            "reps": a.reps,
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "runs": {**runs, **{f"torchrun_{c}": v for c, v in torchrun.items()}},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2, default=str))
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
