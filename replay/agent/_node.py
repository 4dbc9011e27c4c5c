"""One node's half of the agent: its processes, each supervised on its own, and its node servers.

A :class:`NodeAgent` registers the node in the job's store, keeps its heartbeat moving, runs the
leader's commands (start a process with the script contract's arguments, kill one) and reports
every exit with the error the process raised. Unlike torchrun's process contexts, one process's
death stops nothing else. Each process's log store root gets its own node server (``swiftlog
serve`` on this node's address), whose URL the process reports as a survivor.

Never: decides anything about the job (the leader does) or touches another node's processes.
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing.forkserver
import os
import socket
import subprocess
import sys
import threading
import time
from importlib.util import find_spec
from typing import Any

import torch.distributed as dist

from replay._exits import last_error
from replay.agent._config import AgentConfig
from replay.agent._keys import AgentKeys
from replay.launcher import stage_argv
from replay.processes import forkserver_context, run_module_main, start_process
from trainer_client.config import ENV_NODE, ENV_NODE_URL

__all__ = ["NodeAgent", "free_memory_bytes"]

logger = logging.getLogger(__name__)

#: how often the node looks at its commands and processes (seconds)
POLL_S = 0.02


def free_memory_bytes() -> int:
    """This host's available memory (``MemAvailable``), 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class NodeAgent:
    """The processes of node ``node`` (a spare's number is assigned when it registers)."""

    def __init__(self, cfg: AgentConfig, store: dist.Store) -> None:
        self.cfg, self.store, self.keys = cfg, store, AgentKeys(cfg.run_id)
        self.node = cfg.node_rank if cfg.node_rank is not None else cfg.nnodes + store.add(self.keys.spares(), 1) - 1
        self.procs: dict[str, Any] = {}
        self.servers: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, str] = {}
        self.reported: set[str] = set()
        self.seen = 0
        self.store_lost: str | None = None
        self.log_dir = os.path.join(cfg.store_root, "agent-logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self._ctx = forkserver_context(["torch", "torch.distributed.pipelining", cfg.module, "replay.replacement"])
        if cfg.warm:  # a warm spare: the fork server imports torch and the script now, not after a failure
            multiprocessing.forkserver.ensure_running()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="swiftlog-agent-heartbeat", daemon=True)

    # -- membership --------------------------------------------------------------------------
    def register(self) -> None:
        doc = {
            "node": self.node,
            "host": self.cfg.host,
            "hostname": socket.gethostname(),
            "spare": self.cfg.node_rank is None,
            "pid": os.getpid(),
            "free_memory": free_memory_bytes(),
        }
        self.store.add(self.keys.heartbeat(self.node), 1)
        self.store.set(self.keys.node(self.node), json.dumps(doc))
        self._beat.start()

    def _heartbeat(self) -> None:
        host, port = self.cfg.store_address
        try:  # its own connection: a store call of the command loop never delays a beat
            store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
            while not self._stop.wait(self.cfg.heartbeat_s):
                store.add(self.keys.heartbeat(self.node), 1)
        except Exception as e:  # noqa: BLE001 - the store is gone: the job is over for this node
            logger.warning("node %d: heartbeat stopped: %s", self.node, e)

    # -- the loop ------------------------------------------------------------------------------
    def serve_until_done(self) -> None:
        """Run commands and report exits until the leader says the job is over (or the store is gone)."""
        try:
            while not self._stop.is_set():
                if self.store.check([self.keys.done()]):
                    break
                if self.store.check([self.keys.lost(self.node)]):  # declared lost (a stall): fenced
                    logger.error("node %d was declared lost: stopping its processes", self.node)
                    break
                self._run_commands()
                self._report_exits()
                time.sleep(POLL_S)
        except Exception as e:  # noqa: BLE001 - the store (the leader's node) is lost
            logger.error("node %d: lost the job's store (%s); stopping its processes", self.node, e)
            self.store_lost = f"{type(e).__name__}: {e}"
        finally:
            self.stop()

    def stop(self) -> None:
        self._stop.set()
        for p in [*self.procs.values(), *self.servers.values()]:
            if p.poll() is None:
                p.kill()
        for p in [*self.procs.values(), *self.servers.values()]:
            p.wait()

    def _run_commands(self) -> None:
        count = self.store.add(self.keys.command_count(self.node), 0)
        while self.seen < count:
            self.seen += 1
            cmd = json.loads(self.store.get(self.keys.command(self.node, self.seen)))
            if cmd["op"] == "start":
                self.start(cmd["name"], cmd["rank"], cmd["extra"], helper=cmd["helper"])
            elif cmd["op"] == "kill" and cmd["name"] in self.procs:
                self.procs[cmd["name"]].kill()

    def _report_exits(self) -> None:
        for name, p in self.procs.items():
            if name in self.reported or (rc := p.poll()) is None:
                continue
            self.reported.add(name)
            error = last_error(self.logs[name]) if rc > 0 else None
            self.store.set(self.keys.exit(name), json.dumps({"rc": rc, "error": error, "node": self.node}))
            logger.info("node %d: %s exited (rc=%s)", self.node, name, rc)

    # -- processes ---------------------------------------------------------------------------
    def start(self, name: str, rank: int, extra: list[str], *, helper: bool) -> None:
        """Start process ``name`` of rank ``rank`` with role arguments ``extra``."""
        cfg = self.cfg
        root = cfg.process_root(name)
        os.makedirs(root, exist_ok=True)
        host, port = cfg.store_address
        argv = stage_argv(
            cfg.layout,
            rank,
            store_host=host,
            store_port=port,
            out=cfg.out,
            run_id=cfg.run_id,
            store_root=root,
            checkpoint_url=cfg.checkpoint_url,
            args=[*cfg.args, *extra],
        )
        env = {
            ENV_NODE: str(self.node),
            "RANK": str(rank),
            "WORLD_SIZE": str(cfg.world_size),
            "GROUP_RANK": str(self.node),
        }
        url = None if helper else self._serve(name, root)
        if url:
            env[ENV_NODE_URL] = url
        self.logs[name] = os.path.join(self.log_dir, f"{name}.log")
        if cfg.warm:
            self.procs[name] = start_process(self._ctx, run_module_main, (argv, self.logs[name], cfg.module, env), name)
        else:
            self.procs[name] = _cold_start(argv, self.logs[name], cfg.module, env)
        logger.info("node %d: started %s (rank %d)%s", self.node, name, rank, f", logs served at {url}" if url else "")

    def _serve(self, name: str, root: str) -> str | None:
        """A node server over ``root`` on this node's address; its URL (None without the server extra)."""
        if not self.cfg.serve_logs or find_spec("uvicorn") is None:
            return None
        port = _free_port(self.cfg.host)
        cmd = [
            sys.executable,
            "-m",
            "server.cli",
            "serve",
            "--root",
            root,
            "--host",
            self.cfg.host,
            "--port",
            str(port),
        ]
        log = open(os.path.join(self.log_dir, f"{name}.server.log"), "wb")  # noqa: SIM115 - the child owns it
        self.servers[name] = subprocess.Popen([*cmd, "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        scheme = "https" if os.environ.get("SWIFTLOG_TLS_CERT") else "http"  # swiftlog serve reads it too
        return f"{scheme}://{self.cfg.host}:{port}"


def _cold_start(argv: list[str], log: str, module: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A fresh interpreter running ``module.main(argv)`` (what a node without a warm spare pays)."""
    code = "import json, sys; from replay.processes import run_module_main; run_module_main(*json.loads(sys.argv[1]))"
    return subprocess.Popen([sys.executable, "-c", code, json.dumps([argv, log, module, env])])


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
