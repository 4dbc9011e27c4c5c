"""Kill-matrix launcher: a 4-stage pipeline with injected failures, recovered in place or rolled back.

It plays the cluster scheduler on one machine: hosts the TCPStore (outside the training ranks),
starts one process per stage (each stage's log store root is its own directory, a "node"),
injects SIGKILL into chosen stages at (iteration, micro-batch, phase) through the training
script's ``--kill-at``, notices the death (process exit), marks the generation failed and then

- ``mode="swift"``: names the failed stage in the store and starts its replacement
  (``--replacement --generation G --sources <surviving nodes' roots>``) on a fresh "node"; the
  survivors keep their state and the pipeline re-forms as generation G + 1. If the replacement
  reports that the replay is impossible (exit code 3, fallback key), it falls back to a rollback;
  so does a death while a recovery is under way (before every replacement reported ready: a
  survivor or a replacement lost mid-recovery).
- ``mode="rollback"``: kills every stage and restarts all of them from the newest checkpoint they
  all have (``--resume-from C``) as generation G + 1, on fresh store roots: what a job without
  SWIFT does.

In production the scheduler (a Kubernetes operator, Slurm requeue, torchelastic agent) does the
same: watches the ranks, writes ``failed_stages`` into the store, and starts the training command
with ``--replacement`` on a spare machine; the rest of the protocol lives in the ranks.

Processes start from a fork server that imported torch once (milliseconds; on a real cluster a
replacement also pays container start and imports, and a rollback pays them on every rank).
Timings come from wall-clock stamps the processes write into the store. Never leaves a process
running: on timeout everything still alive is killed and the result says ``timed_out``.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from replay._exits import last_error, script_bug
from replay._timings import recovery_timings
from replay.checkpoints import mesh_common_checkpoint
from replay.errors import EXIT_FALLBACK
from replay.processes import StoreHost, forkserver_context, run_module_main, start_process, stop_all
from trainer_client.config import group_of, logging_group_sizes
from trainer_client.mesh import MeshLayout
from trainer_client.recovery_keys import RecoveryKeys

__all__ = [
    "DEFAULT_SCRIPT",
    "EXIT_FALLBACK",
    "KILL_PHASES",
    "KillSpec",
    "RecoveryRun",
    "resumed_after_rollback",
    "run_with_failures",
    "stage_argv",
]

#: the training script the launcher runs by default (the example GPT pipeline)
DEFAULT_SCRIPT = "trainer_client.examples.train_resilient"
#: where a KillSpec may kill a stage; a script injects some or all of them (``--kill-at IT,MB,PHASE``)
KILL_PHASES = (
    "forward",
    "backward",
    "weight",
    "reduce",
    "commit",
    "optimizer",
    "checkpoint",
    "dcp_save",
    "upload",
    "recovering",
    "hang",
)


@dataclass(frozen=True, slots=True)
class KillSpec:
    """SIGKILL ``stage`` (its ``replica`` and ``shard`` in a data-parallel mesh) at ``iteration`` (micro-batch
    ``micro_batch`` for forward/backward) in ``phase``.

    Phases (:data:`KILL_PHASES`, all of which the example ``train_resilient`` injects): forward,
    backward, reduce (just before the replicas' gradient average, in a mesh), commit, optimizer,
    checkpoint, dcp_save (the DCP save of the checkpoint at ``iteration``, before its
    ``.metadata``: with ``--checkpoint-format dcp``), upload (in the uploader thread), recovering
    (right after reporting as a survivor of the first failure; ``iteration`` unused), hang (the
    training thread stops in the forward of micro-batch ``micro_batch``, for good, while the process
    and its heartbeat live: a hang detector must find it). The template
    ``minimal_resilient`` injects forward and optimizer only (and refuses the others)."""

    stage: int
    iteration: int
    micro_batch: int = 0
    phase: str = "forward"
    replica: int = 0
    shard: int = 0

    def __post_init__(self) -> None:
        for name in ("stage", "iteration", "micro_batch", "replica", "shard"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"KillSpec.{name} must be an int >= 0, got {v!r}")
        if self.phase not in KILL_PHASES:  # else the script refuses it only once its process runs
            raise ValueError(f"KillSpec.phase must be one of {', '.join(KILL_PHASES)}, got {self.phase!r}")

    def arg(self) -> str:
        return f"{self.iteration},{self.micro_batch},{self.phase}"


@dataclass(slots=True)
class RecoveryRun:
    """Outcome of :func:`run_with_failures`.

    ``results``: stage -> the final ``stage{k}.pt`` contents. ``timeline``: events
    (``{"t", "what", ...}``, wall-clock). ``timings``: per failure, ``detect_s`` (kill to first
    survivor noticing), ``fetch_s`` / ``replay_s`` (the replacement's record reading and
    recomputation), ``rejoin_s`` (replacement ready to every stage in the new group), and
    ``resumed_s`` (kill to training running again at the failed iteration). ``fallback``: the
    reason in-place recovery was abandoned, if it was. ``progress``: (iteration, wall time,
    generation) of every iteration the last stage applied, across restarts (from the store).
    """

    ok: bool
    mode: str
    out_dir: str
    wall_s: float
    returncodes: dict[str, int | None]
    outputs: dict[str, str]
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    fallback: str | None = None
    timed_out: bool = False
    t0: float = 0.0
    kill_times: dict[int, float] = field(default_factory=dict)
    progress: list[tuple[int, float, int]] = field(default_factory=list)
    error: str | None = None

    def describe(self) -> str:
        lines = [
            f"ok={self.ok} mode={self.mode} timed_out={self.timed_out} rcs={self.returncodes} fallback={self.fallback}"
            + (f" error={self.error}" if self.error else "")
        ]
        for name, rc in sorted(self.returncodes.items()):
            if (
                self.ok and rc == EXIT_FALLBACK and "-helper" in name
            ):  # a helper that refused (e.g. a buffer the backward changes): its replacement replayed alone
                lines.append(f"--- {name} (rc=3: refused to share the replay; its replacement replayed alone) ---")
            elif rc not in (0, -9):
                lines.append(f"--- {name} (rc={rc}) ---\n" + self.outputs.get(name, "")[-3000:])
        return "\n".join(lines)


def _ctx(script: str) -> Any:
    # everything a stage, a replacement or a replay helper imports before its first step: the
    # training script, the replacement and parallel replay, this module
    return forkserver_context(
        ["torch", "torch.distributed.pipelining", script, "replay.replacement", "replay.parallel", "replay.launcher"]
    )


def _f(v: Any) -> float:
    return float(v.decode() if isinstance(v, bytes) else v)


def run_with_failures(
    args: Sequence[str],
    *,
    run_id: str,
    base_dir: str,
    checkpoint_url: str,
    kills: Sequence[KillSpec] = (),
    mode: str = "swift",
    num_stages: int = 4,
    replay_workers: int = 1,
    timeout_s: float = 180.0,
    max_restarts: int = 4,
    grace_s: float = 3.0,
    groups: Sequence[int] | None = None,
    script: str = DEFAULT_SCRIPT,
    dp_replicate: int = 1,
    group_recovery: str = "kill",
    dp_shard: int = 1,
) -> RecoveryRun:
    """Run the pipeline (``args``: the training script's arguments without --stage/--num-stages/
    --store-port/--out/--store-root/--run-id/--checkpoint-url/--kill-at, which the launcher sets)
    with ``kills`` injected; see the module docstring.

    Stage k's node store root is ``{base_dir}/nodes/stage{k}-g{generation}``; results go to
    ``{base_dir}/out``. Returns when every current stage exited 0, or on a failure that cannot
    be handled, after ``max_restarts`` replacements/rollbacks (a crash loop), or after ``timeout_s``.
    ``groups``: the run's logging-group sizes (the same as its ``--groups``): a failure takes its
    whole group down (the other members are killed, since only the group's boundaries were
    logged they must be replayed with it), and every member is replaced; ``group_recovery=
    "in_place"``: only the failed stage is replaced, the live members replay with it in their own
    processes (the script gets ``--group-in-place``; ``replay.group_recovery``). ``grace_s``: after a
    death, how long the scheduler waits for every other stage to either report as a survivor or
    die too (stages that die together are replaced together). ``replay_workers``:
    K > 1 starts K - 1 replay helpers (``--replay-helper-rank``) together with each replacement;
    the replacement is rank 0 of the parallel replay (:func:`replay.replacement.recover_stage`).
    ``script``: the module whose ``main(argv)`` each process runs; it takes the arguments above
    (``args`` are passed on as given) and writes ``{out}/stage{k}.pt`` when done, e.g.
    ``trainer_client.examples.minimal_resilient``, the template for a script of your own.
    ``dp_replicate``: R > 1 runs a ``pp`` x ``dp_replicate`` mesh of ``num_stages * R`` ranks
    (the script also gets ``--replica r --dp-replicate R``; rank = stage * R + replica, and the
    results are keyed by rank); a lost rank whose stage has a live replica is copied from it.
    ``dp_shard``: D > 1 shards every stage over D ranks (FSDP2; ``--shard s --dp-shard D``; rank =
    (stage * R + replica) * D + shard): a lost shard without a replica is replayed by its shard
    group, the live members in place.
    """
    if mode not in ("swift", "rollback"):
        raise ValueError(f"mode must be 'swift' or 'rollback', got {mode!r}")
    if group_recovery not in ("kill", "in_place"):
        raise ValueError(f"group_recovery must be 'kill' or 'in_place', got {group_recovery!r}")
    if not isinstance(num_stages, int) or num_stages < 2:
        raise ValueError(f"num_stages must be an int >= 2, got {num_stages!r}")
    if not isinstance(replay_workers, int) or replay_workers < 1:
        raise ValueError(f"replay_workers must be an int >= 1 (the replacement itself), got {replay_workers!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    for name, v in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if dp_replicate * dp_shard > 1 and (groups or replay_workers > 1):
        raise ValueError("logging groups and replay helpers with dp_replicate or dp_shard > 1 are not supported")
    if groups:
        logging_group_sizes(groups, num_stages)
    outside = sorted({ks.stage for ks in kills if ks.stage >= num_stages})
    if outside:  # such a kill would never fire: the run would pass as a failure-free one
        raise ValueError(f"kills: stage(s) {outside} outside the pipeline of {num_stages} stages")
    outside = sorted({ks.replica for ks in kills if ks.replica >= dp_replicate})
    if outside:
        raise ValueError(f"kills: replica(s) {outside} outside the {dp_replicate} replica(s) of each stage")
    outside = sorted({ks.shard for ks in kills if ks.shard >= dp_shard})
    if outside:
        raise ValueError(f"kills: shard(s) {outside} outside the {dp_shard} shard(s) of each stage")
    where = [(ks.stage, ks.replica, ks.shard) for ks in kills]
    twice = sorted({ks.stage for ks, w in zip(kills, where, strict=True) if where.count(w) > 1})
    if (
        twice
    ):  # one kill per stage: the stage's first process takes it (a replacement none); the rest were dropped silently
        raise ValueError(
            f"kills: more than one KillSpec for stage(s) {twice}; a stage's first process is killed once "
            "(its replacement is not): give one KillSpec per stage"
        )
    return _Scheduler(
        args,
        run_id=run_id,
        base_dir=base_dir,
        checkpoint_url=checkpoint_url,
        kills=kills,
        mode=mode,
        num_stages=num_stages,
        replay_workers=replay_workers,
        timeout_s=timeout_s,
        max_restarts=max_restarts,
        grace_s=grace_s,
        groups=groups,
        script=script,
        dp_replicate=dp_replicate,
        group_recovery=group_recovery,
        dp_shard=dp_shard,
    ).run()


def stage_argv(
    layout: MeshLayout,
    rank: int,
    *,
    store_host: str,
    store_port: int,
    out: str,
    run_id: str,
    store_root: str,
    checkpoint_url: str,
    args: Sequence[str],
) -> list[str]:
    """The arguments a scheduler gives rank ``rank``'s training script (the script contract of
    ``docs/recovery.md``): its mesh coordinate, the job's store, its node's log store root, where
    checkpoints and results go, then ``args`` (the user's, then the role's)."""
    c = layout.coord(rank)
    mesh = [] if layout.dp_replicate == 1 else ["--replica", str(c.replica), "--dp-replicate", str(layout.dp_replicate)]
    if layout.dp_shard > 1:
        mesh += ["--shard", str(c.shard), "--dp-shard", str(layout.dp_shard)]
    return [
        "--resilient",
        "--stage",
        str(c.stage),
        *mesh,
        "--num-stages",
        str(layout.num_stages),
        "--store-host",
        store_host,
        "--store-port",
        str(store_port),
        "--out",
        out,
        "--run-id",
        run_id,
        "--store-root",
        store_root,
        "--checkpoint-url",
        checkpoint_url,
        *args,
    ]


class _Scheduler:
    """One :func:`run_with_failures`: the processes it started, the generations, the timeline."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        run_id: str,
        base_dir: str,
        checkpoint_url: str,
        kills: Sequence[KillSpec],
        mode: str,
        num_stages: int,
        replay_workers: int,
        timeout_s: float,
        max_restarts: int,
        grace_s: float,
        groups: Sequence[int] | None,
        script: str,
        dp_replicate: int = 1,
        host: Any = None,
        out_dir: str | None = None,
        group_recovery: str = "kill",
        dp_shard: int = 1,
    ) -> None:
        self.args, self.run_id, self.base_dir, self.checkpoint_url = args, run_id, base_dir, checkpoint_url
        self.group_recovery = group_recovery
        self.mode, self.num_stages, self.replay_workers = mode, num_stages, replay_workers
        self.layout = MeshLayout(num_stages, dp_replicate, dp_shard)
        self.world = self.layout.world_size  # the ranks; each "stage process" below is one rank
        self.timeout_s, self.max_restarts, self.grace_s, self.groups, self.script = (
            timeout_s,
            max_restarts,
            grace_s,
            groups,
            script,
        )
        self.host = host or StoreHost()  # the job's store: .store, .port
        self.store = self.host.store
        self.keys = RecoveryKeys(run_id)
        self.out_dir = out_dir or os.path.join(base_dir, "out")
        self.load_results = True  # read every rank's results file at the end (a shared out_dir)
        os.makedirs(self.out_dir, exist_ok=True)
        self.ctx = _ctx(script)
        self.procs: dict[str, Any] = {}
        self.logs: dict[str, str] = {}
        self.current: dict[int, str] = {}  # stage -> name of its live process
        self.roots: dict[int, str] = {}
        self.timeline: list[dict[str, Any]] = []
        self.kill_of = {self.layout.rank(ks.stage, ks.replica, ks.shard): ks for ks in kills}
        self.t0 = time.time()
        self.gen = 0
        self.fallback: str | None = None  # a replacement's (set once: the loop acts on the first)
        self.abandoned: str | None = None  # an in-place recovery given up because of a death during it
        # stage -> {process name: the error it exited with (rc > 0: it raised, no signal)}
        self.raised: dict[int, dict[str, str]] = {}
        self.stage_of: dict[str, int] = {}  # every stage process started (not helpers) -> its stage
        self.exited: set[str] = set()  # those whose exit was looked at
        # why the scheduler gave up on a bug in the script (_exits.script_bug), not a machine failure
        self.error: str | None = None
        # the generation whose in-place recovery is under way (its wake key not yet set)
        self.recovering: int | None = None
        self.timed_out = False

    # -- starting processes ---------------------------------------------------------------
    def name(self, k: int) -> str:
        """Rank ``k``'s process name prefix: ``stage{k}``, or ``stage{s}-dp{i}`` in a data-parallel
        mesh (``i``: its pipeline, ``MeshLayout.dp_index``)."""
        c = self.layout.coord(k)
        return f"stage{k}" if self.layout.dp_size == 1 else f"stage{c.stage}-dp{self.layout.dp_index(k)}"

    def start(self, k: int, g: int, extra: Sequence[str], *, name: str, helper: bool = False) -> None:
        if self.group_recovery == "in_place" and self.groups and not helper:
            extra = [*extra, "--group-in-place"]  # survivors replay with their group, replacements only theirs
        self.procs[name] = self.spawn(k, extra, name=name, helper=helper)
        if helper:  # a replay helper exits on its own once the replay is done; it is not a stage
            self.timeline.append({"t": time.time(), "what": "start_helper", "name": name, "stage": k, "generation": g})
            return
        self.current[k] = name
        self.stage_of[name] = k
        self.timeline.append({"t": time.time(), "what": "start", "name": name, "stage": k, "generation": g})

    def spawn(self, k: int, extra: Sequence[str], *, name: str, helper: bool) -> Any:
        """Start rank ``k``'s process ``name`` (role arguments ``extra``) on this host; its handle."""
        root = os.path.join(self.base_dir, "nodes", f"{'helper-' if helper else ''}{name}")
        if not helper:
            self.roots[k] = root
        argv = stage_argv(
            self.layout,
            k,
            store_host="127.0.0.1",
            store_port=self.host.port,
            out=self.out_dir,
            run_id=self.run_id,
            store_root=root,
            checkpoint_url=self.checkpoint_url,
            args=[*self.args, *extra],
        )
        self.logs[name] = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1]
        return start_process(self.ctx, run_module_main, (argv, self.logs[name], self.script), name)

    def start_replacement(self, j: int, g: int) -> None:
        # no --sources: the replacement reads the store roots the survivors report. Parallel replay:
        # the scheduler starts the replacement's K - 1 helpers with it (from the same fork server:
        # no start-up cost); the replacement is rank 0
        self.start(
            j,
            g + 1,
            ["--replacement", "--generation", str(g), "--replay-helpers", str(self.replay_workers - 1)],
            name=f"{self.name(j)}-g{g + 1}",
        )
        for r in range(1, self.replay_workers):
            self.start(
                j,
                g,
                ["--generation", str(g), "--replay-helper-rank", str(r)],
                name=f"{self.name(j)}-g{g + 1}-helper{r}",
                helper=True,
            )

    def rollback(self, reason: str) -> None:
        """Kill every stage and restart all of them from the newest common checkpoint."""
        self.recovering = None
        for n in self.current.values():
            if self.procs[n].poll() is None:
                self.procs[n].kill()
        for n in self.current.values():
            self.procs[n].wait()
        c = self._common_checkpoint()
        self.timeline.append({"t": time.time(), "what": "rollback", "checkpoint": c, "reason": reason})
        self.store.set(self.keys.failed(self.gen), reason)
        self.gen += 1
        for k in range(self.world):
            extra = ["--generation", str(self.gen)] + (["--resume-from", str(c)] if c is not None else [])
            self.start(k, self.gen, extra, name=f"{self.name(k)}-g{self.gen}")

    def _common_checkpoint(self) -> int | None:
        """The newest checkpoint every rank has (each pipeline's are under ``{url}/dp{i}``)."""
        return mesh_common_checkpoint(self.checkpoint_url, self.num_stages, self.layout.dp_size)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> RecoveryRun:
        try:
            first = self.first_args()
            for k in range(self.world):
                kill = ["--kill-at", self.kill_of[k].arg()] if k in self.kill_of else []
                self.start(k, 0, [*kill, *first], name=f"{self.name(k)}-g0")
            while True:
                if time.time() - self.t0 > self.timeout_s:
                    self.timed_out = True
                    break
                states = {k: self.procs[n].poll() for k, n in self.current.items()}
                if all(rc == 0 for rc in states.values()):
                    break
                dead = [k for k, rc in states.items() if rc not in (None, 0)]
                self._note_exits()
                errors = {k: (n, self.error_of(n)) for k, n in self.current.items() if states[k] not in (None, 0)}
                bug = script_bug(states, errors, self.raised)
                if bug is not None:
                    self.error = bug
                    self.timeline.append({"t": time.time(), "what": "give_up", "reason": self.error})
                    break
                if self.gen > 0 and self.store.check([self.keys.fallback(self.gen - 1)]) and self.fallback is None:
                    self.fallback = _s(self.store.get(self.keys.fallback(self.gen - 1)))
                    self.timeline.append({"t": time.time(), "what": "fallback", "reason": self.fallback})
                    self.rollback(f"in-place recovery impossible: {self.fallback}")
                    continue
                if dead:
                    if not self._on_death(dead, states):
                        break
                    continue
                self.idle()
        finally:
            self.stop_everything()
        return self._result()

    def first_args(self) -> list[str]:
        """Role arguments of every rank's first process (none: a fresh start)."""
        return []

    def idle(self) -> None:
        """The scheduler's poll period, woken at once when a stage process ends (not a protocol wait)."""
        alive = [self.procs[n].sentinel for n in self.current.values() if self.procs[n].poll() is None]
        if alive:
            multiprocessing.connection.wait(alive, timeout=0.02)
        else:
            time.sleep(0.02)

    def stop_everything(self) -> None:
        """Kill and reap every process still running (the end of the run, whatever happened)."""
        stop_all(self.procs.values())

    def error_of(self, name: str) -> str | None:
        """The error process ``name`` (exited) raised, from its log; None if it raised none."""
        return last_error(self.logs[name])

    def output_of(self, name: str) -> str:
        """Process ``name``'s output, its log file removed (the end of the run)."""
        with open(self.logs[name]) as f:
            out = f.read()
        os.unlink(self.logs[name])
        return out

    def _note_exits(self) -> None:
        """Every exit, also those a settle or a rollback took over: the errors a later process may repeat."""
        for n, j in self.stage_of.items():
            if n not in self.exited and (rc_n := self.procs[n].poll()) is not None:
                self.exited.add(n)
                line = self.error_of(n) if rc_n > 0 else None
                if line is not None:
                    self.raised.setdefault(j, {})[n] = line

    def _on_death(self, dead: list[int], states: dict[int, int | None]) -> bool:
        """A stage process died: replace it (and its group), or roll every stage back. False: give up."""
        k = dead[0]
        name, rc = self.current[k], states[k]
        self.timeline.append({"t": time.time(), "what": "exit", "name": name, "stage": k, "rc": rc})
        if self.gen >= self.max_restarts:
            self.timeline.append({"t": time.time(), "what": "give_up", "reason": f"{self.gen} restarts already"})
            return False
        if self.recovering is not None and self.store.check([self.keys.wake(self.recovering)]):
            self.recovering = None
        if self.mode == "rollback" or self.recovering is not None:
            # a death while a recovery is under way: restart from the checkpoint
            if self.recovering is not None and self.abandoned is None:
                # the in-place recovery was abandoned: say why, as for a replacement's fallback
                self.abandoned = f"stage {k} died (rc={rc}) during the recovery of generation {self.recovering}"
            self.rollback(
                f"stage {k} died (rc={rc})"
                + (f" during the recovery of generation {self.recovering}" if self.recovering is not None else "")
            )
        else:
            self._replace(k, rc, dead)
        return True

    def _replace(self, k: int, rc: int | None, dead: list[int]) -> None:
        """In-place recovery of generation ``gen``: the dead stages (and their logging groups) are
        replaced; the survivors keep their state."""
        store, keys, gen = self.store, self.keys, self.gen
        store.set(keys.failed(gen), f"scheduler: stage {k} exited (rc={rc})")  # commit waiters abort now
        # a live member's state depends on the lost stage's unlogged sends: killed and replaced, or
        # (in place) it replays with the replacement in its own process
        members = [] if self.group_recovery == "in_place" else _group_members(self.groups, dead, self.num_stages)
        for j in members:
            if self.procs[self.current[j]].poll() is None:
                self.procs[self.current[j]].kill()
                self.timeline.append({"t": time.time(), "what": "kill_group_member", "stage": j})
        lost = sorted(set(dead) | set(members))
        # the replacements of the stages known lost start now: their process start and
        # set-up overlap the survivors' reports (they wait for the failed-stage list)
        for j in lost:
            self.start_replacement(j, gen)
        failed = _settle(store, keys, gen, self.procs, self.current, lost, self.grace_s)
        store.set(keys.failed_stages(gen), json.dumps(failed))
        self.timeline.append({"t": time.time(), "what": "replace", "stages": failed, "generation": gen})
        for j in failed:
            if j not in lost:  # died while the others reported
                self.start_replacement(j, gen)
        self.recovering = gen
        self.gen += 1

    def _result(self) -> RecoveryRun:
        outputs = {n: self.output_of(n) for n in list(self.logs)}
        rcs = {n: p.returncode for n, p in self.procs.items()}
        ok = not self.timed_out and all(self.procs[n].returncode == 0 for n in self.current.values())
        store, keys = self.store, self.keys
        run = RecoveryRun(
            ok,
            self.mode,
            self.out_dir,
            time.time() - self.t0,
            rcs,
            outputs,
            timeline=self.timeline,
            fallback=self.fallback or self.abandoned,
            timed_out=self.timed_out,
            t0=self.t0,
            error=self.error,
        )
        if store.check([keys.progress()]):
            entries = [e.split(":") for e in _s(store.get(keys.progress())).split(";") if e]
            run.progress = [(int(i), float(t), int(g)) for i, t, g in entries]
        run.kill_times = {
            k: _f(store.get(keys.kill_time(k))) for k in range(self.world) if store.check([keys.kill_time(k)])
        }
        if ok:
            if self.load_results:
                run.results = {
                    k: torch.load(os.path.join(self.out_dir, f"{self.name(k)}.pt"), weights_only=False)
                    for k in range(self.world)
                }
            run.timings = recovery_timings(store, keys, run.timeline, self.world)
        return run


def _group_members(groups: Sequence[int] | None, stages: Sequence[int], num_stages: int) -> list[int]:
    """Every stage in the logging groups of ``stages`` (``stages`` themselves without groups: in a
    mesh they are ranks, which may exceed the stage count)."""
    if not groups:
        return list(stages)
    return sorted({m for k in stages for m in group_of(groups, k, num_stages)})


def _settle(
    store: Any,
    keys: RecoveryKeys,
    g: int,
    procs: dict[str, Any],
    current: dict[int, str],
    dead: list[int],
    grace_s: float,
) -> list[int]:
    """The stages lost in generation ``g``: ``dead`` plus any that die before every other stage has
    reported as a survivor (bounded by ``grace_s``)."""
    failed = set(dead)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        for k, n in current.items():
            if procs[n].poll() not in (None, 0):
                failed.add(k)
        pending = [k for k in current if k not in failed and not store.check([keys.survivor(g, k)])]
        if not pending:
            break
        time.sleep(0.01)  # poll period of the scheduler
    return sorted(failed)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def resumed_after_rollback(run: RecoveryRun, fail_iteration: int) -> float | None:
    """Rollback mode: seconds from the kill to the restarted pipeline finishing ``fail_iteration - 1``
    again (i.e. standing where it was when the failure hit), from the stages' iteration stamps.
    Raises ValueError for a ``fail_iteration`` that is not an int >= 1 (e.g. the resume iteration
    of a run in which no failure happened: None)."""
    if not isinstance(fail_iteration, int) or isinstance(fail_iteration, bool) or fail_iteration < 1:
        raise ValueError(f"fail_iteration must be an int >= 1, got {fail_iteration!r} (did a failure happen?)")
    kill = (
        run.kill_times[min(run.kill_times)]
        if run.kill_times
        else next((e["t"] for e in run.timeline if e["what"] == "exit"), None)
    )
    if kill is None:
        return None
    ends = []
    for r in run.results.values():
        g_max = max(g for _, _, g in r["iteration_end"])
        t = [t for it, t, g in r["iteration_end"] if g == g_max and it == fail_iteration - 1]
        if not t:
            return None
        ends.append(t[0])
    return max(ends) - kill
