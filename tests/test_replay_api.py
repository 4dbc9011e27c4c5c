"""The public API of replay/ is exactly what replay/__init__.py exports (pinned, as httpx does)."""

from __future__ import annotations

import replay

EXPECTED = {
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
}


def test_public_names_are_pinned():
    assert set(replay.__all__) == EXPECTED and len(replay.__all__) == len(EXPECTED)
    for name in replay.__all__:
        assert getattr(replay, name) is not None
    for mod in (
        "core",
        "reader",
        "errors",
        "plan",
        "engine",
        "parallel",
        "remote",
        "stage",
        "report",
        "user_code",
        "_context",
        "_iteration_plan",
        "_iteration",
        "_checks",
        "_prefetch",
    ):
        m = __import__(f"replay.{mod}", fromlist=["__all__"])
        assert all(hasattr(m, n) for n in m.__all__), mod
