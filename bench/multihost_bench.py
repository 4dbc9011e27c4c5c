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
- ``torchrun_*``: plain torchrun (4 workers on one host, ``--max-restarts 1``, checkpoint at 10),
  rank 1 SIGKILLed mid-forward of iteration 10 + N: with survivor snapshots (only rank 1 replays,
  alone or with TORCHRUN_HELPERS survivor sharing it) or without (every rank restarts from the
  checkpoint at 10): kill -> the restarted job finished iteration 10 + N. Every mode pays
  torchrun's restart (every worker stopped and started again, torch imported); only the
  rollback pays the N iterations again, so the ratio depends on N: it is measured at N = 10 (the
  node-loss cases' loss, ``_short``) and N = 60 (the headline: a failure that far into a
  checkpoint interval, the lost work several times the restart's cost, as in production where a
  restart costs minutes and a checkpoint interval tens of minutes). ``torchrun_breakeven_lost_s``:
  the lost work at which the measured costs give 0.5.

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
# torchrun: checkpoint at 10, rank 1 killed in iteration 10 + N (N iterations lost to a rollback)
TORCHRUN_CKPT, TORCHRUN_LOST, TORCHRUN_HELPERS = 10, {"short": 10, "long": 60}, 1
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


def _torchrun(
    base: Path, model: list[str], snapshots: bool, fail_it: int, kill: bool = True, helpers: int = 0
) -> dict[str, Any]:
    """Plain torchrun, 4 workers, --max-restarts 1, rank 1 SIGKILLed mid-forward of ``fail_it``:
    kill -> the restarted job finished that iteration (with or without survivor snapshots, with
    ``helpers`` survivors sharing rank 1's replay); 2 iterations after it, checkpoints at
    TORCHRUN_CKPT and the end."""
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    args = [
        "--iters",
        str(fail_it + 2),
        "--ckpt-at",
        f"{TORCHRUN_CKPT},{fail_it + 2}",
        "--seed",
        "1234",
        "--segment-iters",
        "4",
        "--cold-url",
        f"file://{base / 'cold'}",
        "--data-source",
        *model,
        *(["--kill-rank", "1", "--kill-at", f"{fail_it},1,forward"] if kill else []),
        *(["--snapshot-dir", str(base / "shm"), "--replay-helpers", str(helpers)] if snapshots else []),
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
    done = max(t for res in results.values() for it, t, _ in res["iteration_end"] if it == fail_it)
    starts = {k: res["start"] for k, res in results.items()}
    replay_s = (results[1]["recovered"] or {}).get("timings", {}).get("total_s")  # the lost rank's recovery
    return {"resumed_s": done - t_kill, "starts": starts, "results": results, "replay_total_s": replay_s}


def _iteration_s(results: dict[int, Any]) -> float:
    """A failure-free run's time per iteration (the last stage's, after the first checkpoint)."""
    ends = sorted((it, t) for it, t, _ in results[3]["iteration_end"] if it > TORCHRUN_CKPT)
    return (ends[-1][1] - ends[0][1]) / (ends[-1][0] - ends[0][0])


def breakeven_lost_s(point: dict[str, Any]) -> float | None:
    """The lost work (s) at which snapshots cost half a rollback, from one point's measurements.

    A rollback costs R + L (R: the restart, L: the work lost); snapshots cost R + a + b L, the lost
    rank's replay growing with L (b: its share of the lost time; a: the rest, loading snapshots and
    the store rounds). (R + a + b L) / (R + L) = 0.5 at L = (R + 2a) / (1 - 2b); None when b >= 0.5
    (the replay alone costs half of what it replaces)."""
    R = point["restart_overhead_s"]
    lost = point["rollback_s"] - R
    b = point["lost_rank_recovery_s"] / lost
    a = point["snapshots_s"] - R - point["lost_rank_recovery_s"]
    return None if b >= 0.5 else (R + 2 * a) / (1 - 2 * b)


def _measure_torchrun(a: argparse.Namespace, model: list[str], work: Path) -> dict[str, Any]:
    """Each TORCHRUN_LOST point: a global rollback, survivor snapshots, and snapshots with
    TORCHRUN_HELPERS survivors sharing the lost rank's replay, side by side, ``a.reps`` times."""
    med = statistics.median
    cases = {"rollback": (False, 0), "snapshots_alone": (True, 0), "snapshots": (True, TORCHRUN_HELPERS)}
    out: dict[str, Any] = {"runs": {}, "bit_exact": {}}
    for point, lost in TORCHRUN_LOST.items():
        fail_it = TORCHRUN_CKPT + lost
        ref = _torchrun(work / f"torchrun-ref-{point}", model, False, fail_it, kill=False)
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
        for rep in range(a.reps):
            for case, (snapshots, helpers) in cases.items():
                t = _torchrun(work / f"torchrun-{point}-{case}{rep}", model, snapshots, fail_it, helpers=helpers)
                out["bit_exact"][f"{point}_{case}"] = out["bit_exact"].get(f"{point}_{case}", True) and _exact(t, ref)
                runs[case].append({k: t[k] for k in ("resumed_s", "starts", "replay_total_s")})
                print("torchrun", point, case, rep, f"{t['resumed_s']:.2f} s", flush=True)
        s = {c: med([x["resumed_s"] for x in runs[c]]) for c in cases}
        it_s = _iteration_s(ref["results"])
        # what every mode pays (workers stopped, started again, torch imported, rendezvous): the
        # rollback's time less the iterations it redid (those since the checkpoint, and the failed one)
        restart_s = s["rollback"] - (lost + 1) * it_s
        recovery_s = med([x["replay_total_s"] or 0.0 for x in runs["snapshots"]])
        out[point] = {
            "iterations_lost": lost,
            "vs_global_rollback": s["snapshots"] / s["rollback"],
            "alone_vs_global_rollback": s["snapshots_alone"] / s["rollback"],
            **{f"{c}_s": v for c, v in s.items()},
            "restart_overhead_s": restart_s,
            "lost_rank_recovery_s": recovery_s,
            "lost_rank_recovery_alone_s": med([x["replay_total_s"] or 0.0 for x in runs["snapshots_alone"]]),
            "iteration_s": it_s,
        }
        out[point]["breakeven_lost_s"] = breakeven_lost_s(out[point])
        out["runs"].update({f"{point}_{c}": v for c, v in runs.items()})
    return out


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
    tr = _measure_torchrun(a, model, work)
    med = statistics.median
    s = {case: med([x["resumed_s"] for x in runs[case]]) for case in cases}
    rb = s["rollback"]
    out = {
        "node_loss_recovery_vs_global_rollback": s["node_loss"] / rb,
        "torchrun_restart_with_snapshots_vs_global_rollback": tr["long"]["vs_global_rollback"],
        "torchrun_restart_with_snapshots_vs_global_rollback_short": tr["short"]["vs_global_rollback"],
        "torchrun_restart_overhead_s": tr["long"]["restart_overhead_s"],
        "torchrun_lost_rank_recovery_s": tr["long"]["lost_rank_recovery_s"],
        "torchrun_lost_rank_recovery_alone_s": tr["long"]["lost_rank_recovery_alone_s"],
        "torchrun_breakeven_lost_s": tr["long"]["breakeven_lost_s"],
        "iteration_s": tr["long"]["iteration_s"],
        "node_loss_k2_vs_k1": s["node_loss_k2"] / s["node_loss"],
        "warm_spare_saving_s": s["node_loss_cold_start"] - s["node_loss"],
        "node_loss_recovery_s": s["node_loss"],
        "node_loss_cold_start_recovery_s": s["node_loss_cold_start"],
        "node_loss_k2_recovery_s": s["node_loss_k2"],
        "global_rollback_s": rb,
        **{f"torchrun_{k}": v for k, v in tr.items() if k != "runs"},
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
                "4 workers on one host, --max-restarts 1, checkpoint at 10, rank 1 killed mid-forward of "
                f"iteration 10 + N, N in {sorted(TORCHRUN_LOST.values())}; kill -> that iteration done again; "
                f"the headline at N = {TORCHRUN_LOST['long']} with {TORCHRUN_HELPERS} survivor helper"
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
        "runs": {**runs, **{f"torchrun_{c}": v for c, v in tr["runs"].items()}},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2, default=str))
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
