"""replay: rebuild lost pipeline stages from their checkpoints and their neighbours' logs (SWIFT).

Public API::

    from replay import plan_recovery, ReplayJob, SourceSpec, replay

    plan = plan_recovery(LogStore.open(root, run, cold_url=cold), failed_stages=[2])
    if plan.possible:
        for job in jobs_from_plan(plan, sources=[SourceSpec.parse("http://node3:8080")], workers=2, output="s3://ckpt/recovered"):
            result = replay(job)              # sequential (workers=1) or parallel (workers=K)
            assert result.verified             # every regenerated send matched a receiver's digest
    else:
        print(plan.reasons, plan.fallback)     # e.g. a gap: roll every stage back instead

Modules: ``plan`` (recovery planning), ``core`` (the replay loop, verification, prefetch),
``reader`` (``LogReader`` over record sources), ``errors``, ``engine`` (jobs, sources, progress,
output checkpoints), ``parallel`` (K workers over gloo, exact or approximate gradient reduction),
``remote`` (reading from node servers over HTTP). The ``swiftlog replay`` command lives in
``server/cli/replay.py``.

Never imported by logstore/ or trainer_client/; imports server/ nowhere.
"""

from replay.core import replay_stage, replay_stages
from replay.engine import replay
from replay.errors import ReplayError, ReplayInputMissingError, ReplayMismatchError, ReplayOrderError
from replay.job import ReplayJob, ReplayProgress, ReplayResult, SourceSpec, jobs_from_plan
from replay.plan import FetchItem, RecoveryPlan, ReplayUnit, plan_recovery
from replay.reader import LogReader, RecordSource
from replay.remote import HttpRecordSource, RemoteLogReader
from replay.report import ReplayReport
from replay.stage import ReplayHooks, StageState

__all__ = [
    "plan_recovery",
    "RecoveryPlan",
    "ReplayUnit",
    "FetchItem",
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
    "ReplayError",
    "ReplayInputMissingError",
    "ReplayMismatchError",
    "ReplayOrderError",
]
