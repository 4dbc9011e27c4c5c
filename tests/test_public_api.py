"""The public API of each package, pinned: a name added or dropped is a decision, made here.

One test function per package.
"""

from __future__ import annotations

import importlib

import replay


def test_replay_exports_what_recovery_and_a_replacement_call():
    assert sorted(replay.__all__) == sorted(
        [
            # planning
            "plan_recovery",
            "RecoveryPlan",
            "ReplayUnit",
            "FetchItem",
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
            "report_ready",
            "report_fallback",
            "serve_replay_helper",
            "EXIT_FALLBACK",
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
        ]
    )
    assert len(set(replay.__all__)) == len(replay.__all__)
    for name in replay.__all__:
        assert getattr(replay, name) is not None
    errors = [getattr(replay, n) for n in replay.__all__ if n.endswith(("Error", "Fallback"))]
    assert all(e.__module__ == "replay.errors" for e in errors)  # every error class in its errors module
    # every module's __all__ names what it defines
    for mod in (
        "replay.checkpoints",
        "replay.compare",
        "replay.core",
        "replay.engine",
        "replay.errors",
        "replay.job",
        "replay.launcher",
        "replay.parallel",
        "replay.parallel.bounds",
        "replay.parallel.buffers",
        "replay.parallel.chain",
        "replay.parallel.launch",
        "replay.parallel.reducer",
        "replay.parallel.shares",
        "replay.parallel.worker",
        "replay.plan",
        "replay.plan_types",
        "replay.processes",
        "replay.reader",
        "replay.remote",
        "replay.replacement",
        "replay.helpers",
        "replay.report",
        "replay.stage",
        "replay.states",
        "replay.user_code",
    ):
        m = importlib.import_module(mod)
        assert all(hasattr(m, n) for n in m.__all__), mod
