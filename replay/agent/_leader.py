"""The leading agent's scheduler: the launcher's recovery decisions, with processes on many nodes.

:class:`AgentScheduler` is :class:`replay.launcher._Scheduler` (deaths, settling, replacements,
fallbacks to a global rollback, script bugs told from machine failures) whose processes live on
the nodes' agents: it starts and kills them through commands in the job's store, learns their
exits from the agents' reports, and declares every process of a node whose heartbeat stopped dead
(SIGKILL's code, -9). Placement: a rank's replacement starts on the rank's node while that node
lives (a process failure), else on a spare node (a node loss), else on the survivor node with the
fewest ranks; replay helpers go to survivor nodes with the memory they need, the replacement's
node last.

Never: runs a training process itself (node 0's own processes are its node agent's).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from replay.agent._config import AgentConfig
from replay.agent._keys import AgentKeys
from replay.launcher import _Scheduler
from trainer_client.mesh import MeshLayout

__all__ = ["AgentScheduler", "RemoteProcess", "hang_culprit"]

logger = logging.getLogger(__name__)


class RemoteProcess:
    """A process an agent started, as a scheduler sees it (poll, kill, wait, returncode)."""

    def __init__(self, sched: AgentScheduler, node: int, name: str) -> None:
        self.sched, self.node, self.name = sched, node, name
        self.returncode: int | None = None
        self.error: str | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            raw = self.sched.store.check([self.sched.akeys.exit(self.name)])
            if raw:
                doc = json.loads(self.sched.store.get(self.sched.akeys.exit(self.name)))
                self.returncode, self.error = int(doc["rc"]), doc.get("error")
            elif self.node in self.sched.lost_nodes:
                self.returncode = -9  # its node is gone, and it with it
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            self.sched.command(self.node, {"op": "kill", "name": self.name})

    def wait(self, timeout: float = 60.0) -> int | None:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            self.sched.idle()
        return self.returncode


class AgentScheduler(_Scheduler):
    """The job's scheduler on node 0's agent; see the module docstring."""

    def __init__(self, cfg: AgentConfig, host: Any) -> None:
        self.cfg = cfg
        super().__init__(
            list(cfg.args),
            run_id=cfg.run_id,
            base_dir=cfg.out,
            checkpoint_url=cfg.checkpoint_url,
            kills=list(cfg.kills),
            mode=cfg.mode,
            num_stages=cfg.layout.num_stages,
            replay_workers=cfg.replay_workers,
            timeout_s=cfg.job_timeout_s,
            max_restarts=cfg.max_restarts,
            grace_s=cfg.grace_s,
            groups=cfg.groups,
            script=cfg.module,
            dp_replicate=cfg.dp_replicate,
            dp_shard=cfg.dp_shard,
            host=host,
            out_dir=cfg.out,
            group_recovery=cfg.group_recovery,
        )
        self.load_results = False  # the processes' results are theirs, on whatever storage ``out`` is
        self.akeys = AgentKeys(cfg.run_id)
        self.home = {k: k // cfg.nproc_per_node for k in range(cfg.world_size)}  # rank -> its node
        self.nodes: dict[int, dict[str, Any]] = {}
        self.lost_nodes: set[int] = set()
        self._beats: dict[int, tuple[int, float]] = {}  # node -> (last counter, when it last moved)
        self._sent: dict[int, int] = {}
        self.placement: list[dict[str, Any]] = []
        self._hang_limits = dict(cfg.hang_timeouts)
        self._progress: dict[int, tuple[tuple[Any, ...], float]] = {}  # rank -> (its progress, since when)
        self._hang_checked = 0.0

    # -- nodes -------------------------------------------------------------------------------
    def rendezvous(self) -> None:
        """Wait for every regular node to register (spares may come later)."""
        deadline = time.monotonic() + self.cfg.rdzv_timeout_s
        while True:
            self._refresh_nodes()
            missing = [n for n in range(self.cfg.nnodes) if n not in self.nodes]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"rendezvous: node(s) {missing} did not register in {self.cfg.rdzv_timeout_s} s")
            time.sleep(0.05)

    def _refresh_nodes(self) -> None:
        spares = int(self.store.add(self.akeys.spares(), 0))
        for n in range(self.cfg.nnodes + spares):
            if n not in self.nodes and self.store.check([self.akeys.node(n)]):
                self.nodes[n] = json.loads(self.store.get(self.akeys.node(n)))
                self._beats[n] = (-1, time.monotonic())
        now = time.monotonic()
        # once a survivor saw the generation fail, three missed beats are enough to call a node lost
        failing = self.store.check([self.keys.failed(self.gen)])
        timeout = min(self.cfg.node_timeout_s, 3 * self.cfg.heartbeat_s) if failing else self.cfg.node_timeout_s
        for n in self.nodes:
            if n in self.lost_nodes:
                continue
            count = int(self.store.add(self.akeys.heartbeat(n), 0))
            last, since = self._beats[n]
            if count != last:
                self._beats[n] = (count, now)
            elif now - since > timeout:
                self.lost_nodes.add(n)
                self.store.set(self.akeys.lost(n), f"no heartbeat for {now - since:.1f} s")  # fences it
                self.timeline.append({"t": time.time(), "what": "node_lost", "node": n})
                logger.warning("node %d lost: no heartbeat for %.1f s", n, now - since)

    def alive(self) -> list[int]:
        return [n for n in sorted(self.nodes) if n not in self.lost_nodes]

    def command(self, node: int, cmd: dict[str, Any]) -> None:
        seq = self._sent.get(node, 0) + 1
        self._sent[node] = seq
        self.store.set(self.akeys.command(node, seq), json.dumps(cmd))
        self.store.set(self.akeys.command_count(node), str(seq))

    # -- the launcher's hooks ----------------------------------------------------------------
    def name(self, k: int) -> str:
        base = super().name(k)
        return f"{base}-a{self.cfg.attempt}" if self.cfg.attempt else base

    def first_args(self) -> list[str]:
        if not self.cfg.resume:
            return []
        c = self._common_checkpoint()
        self.timeline.append({"t": time.time(), "what": "resume", "checkpoint": c})
        logger.warning("attempt %d: every rank resumes from checkpoint %s", self.cfg.attempt, c)
        return [] if c is None else ["--resume-from", str(c)]

    def spawn(self, k: int, extra: Sequence[str], *, name: str, helper: bool) -> RemoteProcess:
        node = self._place_helper(k) if helper else self._place(k)
        self.placement.append({"name": name, "rank": k, "node": node, "helper": helper})
        self.timeline.append({"t": time.time(), "what": "place", "name": name, "rank": k, "node": node})
        self.command(node, {"op": "start", "name": name, "rank": k, "extra": list(extra), "helper": helper})
        return RemoteProcess(self, node, name)

    def _place(self, k: int) -> int:
        self._refresh_nodes()
        if self.home[k] not in self.lost_nodes:
            return self.home[k]
        used = set(self.home.values())
        spares = [n for n in self.alive() if self.nodes[n].get("spare") and n not in used]
        if spares:
            lost = self.home[k]
            for j, n in self.home.items():  # the spare takes every rank of the lost node
                if n == lost:
                    self.home[j] = spares[0]
            return spares[0]
        load = {n: sum(1 for m in self.home.values() if m == n) for n in self.alive()}
        self.home[k] = min(load, key=lambda n: (load[n], n))
        return self.home[k]

    def _place_helper(self, k: int) -> int:
        """A survivor node other than the replacement's with the most free memory, if it has enough
        for a copy of the stage (its checkpoint's size, twice); else the replacement's node."""
        own = self.home[k]
        need = 2 * _checkpoint_bytes(self.cfg.checkpoint_url, self.layout, k)
        helpers_on = {p["node"] for p in self.placement if p["helper"] and p["rank"] == k}
        choices = [n for n in self.alive() if n != own and n not in helpers_on and self.nodes[n]["free_memory"] >= need]
        if not choices:
            return own
        return max(choices, key=lambda n: self.nodes[n]["free_memory"])

    def idle(self) -> None:
        self._refresh_nodes()
        if self._hang_limits and time.monotonic() - self._hang_checked > 0.25:
            self._hang_checked = time.monotonic()
            self._check_hangs()
        time.sleep(0.05)

    def _check_hangs(self) -> None:
        """Kill the culprit of a hang: among the ranks whose progress stood still longer than their
        section allows, the busy one (the others wait on it), the earliest stalled if several.
        While only waiting ranks stand still, the hung one may have stopped after them (it ran on
        until it hung, they waited at once): they get twice their limit before the earliest of
        them is taken for the culprit."""
        now, stalled = time.monotonic(), []
        for k, name in self.current.items():
            key = self.keys.heartbeat(self.gen, k)
            if self.procs[name].returncode is not None or not self.store.check([key]):
                continue
            beat = json.loads(self.store.get(key))
            sig = (name, beat["count"], beat["section"], beat["state"])
            prev = self._progress.get(k)
            if prev is None or prev[0] != sig:
                self._progress[k] = (sig, now)
            elif beat["section"] in self._hang_limits and now - prev[1] > self._hang_limits[beat["section"]]:
                stalled.append((k, sig, prev[1]))
        if not stalled:
            return
        if not any(s[1][3] == "busy" for s in stalled) and not any(
            now - since > 2 * self._hang_limits[sig[2]] for _, sig, since in stalled
        ):
            return  # a busy rank may stall next: it is the likelier culprit
        k, (name, _, section, state), since = hang_culprit(stalled)
        why = f"rank {k} ({name}) made no progress for {now - since:.1f} s in {section} ({state})"
        logger.warning("hang: %s; the stalled: %s: killing it", why, [s[0] for s in stalled])
        self.timeline.append({"t": time.time(), "what": "hang", "rank": k, "stalled": [s[0] for s in stalled]})
        self.store.set(self.keys.kill_time(k), repr(time.time()))
        self.procs[name].kill()
        self._progress.clear()

    def stop_everything(self) -> None:
        for p in self.procs.values():
            p.kill()
        self.store.set(self.akeys.done(), "done")

    def error_of(self, name: str) -> str | None:
        p = self.procs[name]
        p.poll()
        return p.error

    def output_of(self, name: str) -> str:
        path = os.path.join(self.cfg.store_root, "agent-logs", f"{name}.log")  # readable where it ran
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


def hang_culprit(stalled: list[tuple[int, tuple[Any, ...], float]]) -> tuple[int, tuple[Any, ...], float]:
    """The rank to kill among the stalled ones, each ``(rank, (name, count, section, state), since)``:
    a busy one (computing or in user code; the waiting ones wait on it), the earliest stalled
    first; when none is busy, the earliest stalled of all. Raises ValueError for an empty list."""
    if not stalled:
        raise ValueError("no stalled rank")
    busy = [s for s in stalled if s[1][3] == "busy"]
    return min(busy or stalled, key=lambda s: (s[2], s[0]))


def _checkpoint_bytes(url: str, layout: MeshLayout, rank: int) -> int:
    """The size of rank ``rank``'s newest local checkpoint file (0 where the URL is not a local path)."""
    c = layout.coord(rank)
    base = url[len("file://") :] if url.startswith("file://") else url
    if layout.dp_size > 1:
        base = os.path.join(base, f"dp{layout.dp_index(rank)}")
    path = os.path.join(base, f"stage{c.stage:05d}")
    if "://" in base or not os.path.isdir(path):
        return 0
    sizes = [e.stat().st_size for e in os.scandir(path) if e.is_file()]
    return max(sizes, default=0)
