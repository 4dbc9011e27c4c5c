"""``swiftlog agent``: one per node, like torchrun's, that keeps survivors running.

Every node runs an agent (:func:`run_agent`). Node 0's agent hosts the job's store at the
rendezvous endpoint (outside the training processes) and leads: it runs the launcher's recovery
decisions (:class:`~replay.agent._leader.AgentScheduler`) over every node's processes. Each agent
supervises its own processes one by one (:class:`~replay.agent._node.NodeAgent`): a process's
death stops nothing else. A rank's identity is its mesh coordinate, fixed by the script contract's
arguments; a replacement keeps it wherever it starts.

- a process dies: its replacement starts on the same node and replays; the survivors go on;
- a node is lost (its heartbeat stops): a spare agent takes all its ranks; the replacements read
  the survivors' hot tiers over their node servers and the lost node's own records from the cold tier;
- a replay impossible: every rank restarts from the newest common checkpoint (a global rollback).

Never: restarts survivors; hosts the store inside a training process.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import threading
import time

import torch.distributed as dist

from replay.agent._config import AgentConfig
from replay.agent._keys import AgentKeys
from replay.agent._leader import AgentScheduler, RemoteProcess
from replay.agent._node import NodeAgent
from replay.errors import JobStoreLostError
from replay.launcher import RecoveryRun
from replay.processes import StoreHost

__all__ = ["AgentConfig", "AgentKeys", "AgentScheduler", "JobStoreLostError", "NodeAgent", "RemoteProcess", "run_agent"]

logger = logging.getLogger(__name__)


def _connect(cfg: AgentConfig) -> dist.TCPStore:
    """A client of the job's store, retried until ``rdzv_timeout_s`` (node 0 may start later)."""
    host, port = cfg.store_address
    deadline = time.monotonic() + cfg.rdzv_timeout_s
    while True:
        try:
            return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
        except Exception:  # noqa: BLE001 - torch raises DistNetworkError/RuntimeError alike
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def run_agent(cfg: AgentConfig) -> RecoveryRun | None:
    """Run this node's agent until the job is over. Node 0 returns the job's :class:`RecoveryRun`
    (``ok``: every rank finished); the others return None once node 0 says the job is over."""
    host, port = cfg.store_address
    hosted = StoreHost(host=host, port=port) if cfg.node_rank == 0 else None  # the job's store, outside the ranks
    store = _connect(cfg)
    node = NodeAgent(cfg, store)
    node.register()
    logger.info("node %d registered at %s (%s)", node.node, cfg.host, "spare" if cfg.node_rank is None else "regular")
    if hosted is None:
        node.serve_until_done()
        if node.store_lost is not None:
            raise JobStoreLostError(
                f"node {node.node}: the job's store at {cfg.rdzv_endpoint} is gone ({node.store_lost}); this node "
                "stopped its processes. Restart every agent with --resume and the next --attempt: every rank "
                "then starts from the newest checkpoint they all have"
            )
        return None
    sched = AgentScheduler(cfg, hosted)
    worker = threading.Thread(target=node.serve_until_done, name="swiftlog-agent-node", daemon=True)
    worker.start()
    try:
        sched.rendezvous()
        run = sched.run()
    finally:
        store.set(AgentKeys(cfg.run_id).done(), "done")
        worker.join(timeout=30)
    _write_summary(cfg, run)
    return run


def _write_summary(cfg: AgentConfig, run: RecoveryRun) -> None:
    """``{out}/agent-run.json``: the job's outcome, timeline and recovery timings (no process output)."""
    doc = {k: v for k, v in dataclasses.asdict(run).items() if k not in ("outputs", "results")}
    doc["config"] = {"nnodes": cfg.nnodes, "nproc_per_node": cfg.nproc_per_node, "mode": cfg.mode, "warm": cfg.warm}
    path = os.path.join(cfg.out, "agent-run.json")
    os.makedirs(cfg.out, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, default=str, indent=1)
    os.replace(path + ".tmp", path)
