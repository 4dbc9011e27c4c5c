"""replay: rebuild lost pipeline stages from their checkpoints and their neighbours' logs (SWIFT).

Public API::

    from replay import SourceSpec, jobs_from_plan, plan_recovery, replay

    plan = plan_recovery(LogStore.open(root, run, cold_url=cold), failed_stages=[2])
    if plan.possible:
        sources = [SourceSpec.parse("http://node3:8080")]
        for job in jobs_from_plan(plan, sources=sources, model="my_train:build_stage", workers=2, output=out):
            result = replay(job)              # sequential (workers=1) or parallel (workers=K)
            assert result.verified             # every regenerated send matched a receiver's digest
    else:
        print(plan.reasons, plan.fallback)     # e.g. a gap: roll every stage back instead

The replacement side (a training script's ``--replacement`` and replay-helper roles):
:func:`recover_stage`, :func:`report_ready`, :func:`report_fallback` (then exit with
:data:`EXIT_FALLBACK`), :func:`serve_replay_helper`, :class:`ReplacementFallback`. To try a failure
on one machine: :func:`run_with_failures` with :class:`KillSpec`, compared with
:func:`states_equal`.

Selective logging: :func:`profile_run` measures a run's costs (``profile``), :func:`plan_groups`
chooses logging groups from them within a storage budget (``group_planner``).

Modules: ``plan`` (recovery planning; ``plan_types``, ``_plan_index``, ``_plan_fetch``), ``core``
(the replay loop; ``stage``, ``report``, ``_iteration_plan``, ``_iteration``, ``_checks``,
``user_code``, ``_prefetch``), ``reader`` (``LogReader`` over record sources), ``remote``
(reading from node servers over HTTP), ``errors``, ``job`` (jobs, sources, progress, results),
``states`` (building the stages, writing the outputs), ``engine`` (``replay``), ``parallel`` (K
workers over gloo, exact or approximate gradient reduction), ``replacement`` (a failed stage's
replacement), ``survivors`` (what it learns from the survivors and reports to them), ``helpers``
(its replay helpers), ``checkpoints`` (finding checkpoints), ``launcher`` (the scheduler on one
machine), ``processes`` (its process plumbing), ``compare`` (``states_equal``), ``sim`` (a large
job's training time under failures, per recovery strategy). The ``swiftlog replay`` command lives
in ``server/cli/replay.py``.

Never imported by logstore/ or trainer_client/ (its examples excepted); imports server/ nowhere.
"""

from replay.compare import states_equal
from replay.core import replay_stage, replay_stages
from replay.engine import replay
from replay.errors import (
    EXIT_FALLBACK,
    BudgetTooSmallError,
    NodeUnavailableError,
    ReplacementFallback,
    ReplayError,
    ReplayInputMissingError,
    ReplayMismatchError,
    ReplayOrderError,
)
from replay.group_planner import GroupPlan, plan_groups
from replay.helpers import serve_replay_helper
from replay.job import ReplayJob, ReplayProgress, ReplayResult, SourceSpec, jobs_from_plan
from replay.launcher import KillSpec, run_with_failures
from replay.plan import FetchItem, RecoveryPlan, ReplayUnit, plan_recovery
from replay.profile import JobProfile, load_profile, profile_run, save_profile
from replay.rank_recovery import RecoveredRank, plan_rank, recover_rank
from replay.reader import LogReader, RecordSource
from replay.remote import HttpRecordSource, RemoteLogReader
from replay.replacement import measured_rates, recover_stage, report_fallback, report_ready
from replay.replica_plan import ReplicaLoggingPlan, plan_replica_logging
from replay.report import ReplayReport
from replay.restart import RestartDecision, recover_on_restart
from replay.shard_recovery import replay_shard_in_place
from replay.stage import ReplayHooks, StageState

__all__ = [
    # planning
    "plan_recovery",
    "RecoveryPlan",
    "plan_replica_logging",
    "ReplicaLoggingPlan",
    "measured_rates",
    "ReplayUnit",
    "FetchItem",
    # selective logging: measured costs, logging groups chosen within a storage budget
    "profile_run",
    "save_profile",
    "load_profile",
    "JobProfile",
    "plan_groups",
    "GroupPlan",
    # running a replay
    "replay",
    "ReplayJob",
    "SourceSpec",
    "ReplayResult",
    "ReplayProgress",
    "jobs_from_plan",
    "replay_stages",
    "replay_stage",
    "StageState",
    "ReplayReport",
    "ReplayHooks",
    "LogReader",
    "RecordSource",
    "RemoteLogReader",
    "HttpRecordSource",
    # the replacement of a failed stage
    "recover_stage",
    "recover_rank",
    "plan_rank",
    "RecoveredRank",
    "replay_shard_in_place",
    "report_ready",
    "report_fallback",
    "serve_replay_helper",
    "EXIT_FALLBACK",
    # a torchrun restart: survivors' snapshots, only the lost ranks replay
    "recover_on_restart",
    "RestartDecision",
    # trying a failure on one machine
    "run_with_failures",
    "KillSpec",
    "states_equal",
    # errors
    "ReplayError",
    "ReplayInputMissingError",
    "ReplayMismatchError",
    "ReplayOrderError",
    "ReplacementFallback",
    "NodeUnavailableError",
    "BudgetTooSmallError",
]
