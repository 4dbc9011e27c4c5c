"""The public API of each package, pinned: a name added to or dropped from an ``__all__`` is a
change of the API, made on purpose here too. One test function per package."""

from __future__ import annotations

import importlib


def _exported(package: str) -> set[str]:
    mod = importlib.import_module(package)
    names = set(mod.__all__)
    missing = sorted(n for n in names if not hasattr(mod, n))
    assert not missing, f"{package}.__all__ names what it does not define: {missing}"
    assert len(names) == len(mod.__all__), f"{package}.__all__ lists a name twice"
    return names


def test_logstore_public_api() -> None:
    assert _exported("logstore") == {
        # the store
        "LogStore",
        "StoreConfig",
        "Encoded",
        "list_runs",
        # what it reports
        "CheckpointInfo",
        "GcReport",
        "RecordInfo",
        "UnregisterPreview",
        "VerifyReport",
        # record names
        "Channel",
        "Kind",
        "RecordKey",
        "validate_name",
        "validate_run",
        # errors
        "SwiftlogError",
        "StoreError",
        "RecordNotFoundError",
        "CorruptRecordError",
        "CorruptIndexError",
        "StoreFullError",
        "ColdTierUnavailableError",
        "ColdTierError",
        "SegmentClashError",
        "WriterFencedError",
        "StoreClosedError",
        "CodecError",
        "ConfigError",
        "InvalidKeyError",
        "InvalidNameError",
    }
    from logstore import errors

    # Every error class of the package is in logstore.errors, and every one a caller can meet is exported.
    classes = {n for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    internal = {"ObjectExistsError", "S3ServerError"}  # never raised to a caller of the store (errors' docstring)
    assert classes - internal <= _exported("logstore")
    # The tiers and the store module: what tools and tests import from them.
    assert _exported("logstore.cold") == {
        "ColdTier",
        "SegmentInfo",
        "Source",
        "parse_cold_url",
        "MARKER_SUFFIX",
        "DOCS_PREFIX",
        "MIN_PART_SIZE",
    }
    assert _exported("logstore.hot") == {"HotTier", "SegmentMeta", "Location", "OPEN", "SEALED", "UPLOADED", "EVICTED"}
    assert _exported("logstore.store") == {"LogStore", "Encoded", "list_runs", "writers_under"}


def test_trainer_client_public_api() -> None:
    import trainer_client

    assert sorted(trainer_client.__all__) == sorted(
        [
            "ClientConfig",
            "WriterConfig",
            "CommitConfig",
            "StorageConfig",
            "CheckpointConfig",
            "MetricsConfig",
            "RecoveryConfig",
            "SwiftlogClient",
            "MultiStageClient",
            "MULTI_STAGE_SCHEDULES",
            "rank_stages",
            "CommitReport",
            "CommitResult",
            "FlushReport",
            "Fault",
            "DataSource",
            "loopback_store",
            "ResilientLoop",
            "RecoveryKeys",
            "form_mesh",
            "MeshLayout",
            "build_mesh",
            "recovery_paths",
            "Checkpoint",
            "checkpoint_uri",
            "save_checkpoint",
            "load_checkpoint",
            "derive_seed",
            "seed_micro_batch",
            "ClientError",
            "CommitError",
            "IterationAbortedError",
            "CommitStoreError",
            "CheckpointError",
            "UnsupportedScheduleError",
            "RecoveryFailedError",
            "RecoveryTimeoutError",
            "RestartRequired",
            "ReplicaTransferError",
        ]
    )
    for name in trainer_client.__all__:
        assert getattr(trainer_client, name) is not None
    errors = [getattr(trainer_client, n) for n in trainer_client.__all__ if n.endswith("Error")]
    assert all(e.__module__ == "trainer_client.errors" for e in errors)  # every error class in its errors module


def test_replay_public_api() -> None:
    import replay

    assert sorted(replay.__all__) == sorted(
        [
            # planning
            "plan_recovery",
            "RecoveryPlan",
            "plan_replica_logging",
            "ReplicaLoggingPlan",
            "measured_rates",
            "ReplayUnit",
            "FetchItem",
            # selective logging
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
            # a torchrun restart
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
        "replay.restart",
        "replay.profile",
        "replay.group_planner",
        "replay.agent",
        "replay.agent.hosts",
        "replay.agent.local",
        "replay.stage",
        "replay.states",
        "replay.user_code",
    ):
        m = importlib.import_module(mod)
        assert all(hasattr(m, n) for n in m.__all__), mod


def test_server_public_api() -> None:
    """The admin API (app, settings, serve), the node it serves, the version; the CLI's entry point."""
    assert _exported("server") == {"Settings", "create_app", "Node", "serve", "__version__"}
    assert _exported("server.cli") == {"app", "main"}
    assert _exported("server.errors") == {
        "RunNotFoundError",
        "CheckpointNotFoundError",
        "ProfileNotFoundError",
        "BadRequestError",
        "NoColdTierError",
        "NotAvailableError",
        "AuthError",
        "DemoRunError",
        "Problem",
        "classify",
        "plain_message",
        "EXIT_OK",
        "EXIT_PROBLEMS",
        "EXIT_USAGE",
        "EXIT_NOT_FOUND",
        "EXIT_UNAVAILABLE",
        "EXIT_INTERRUPTED",
    }


def test_one_docstring_draws_every_error_class() -> None:
    """logstore.errors' docstring draws the whole tree: every error class of the four packages."""
    import inspect

    from logstore import errors

    drawn = errors.__doc__ or ""
    for name in ("logstore.errors", "trainer_client.errors", "replay.errors", "server.errors"):
        mod = importlib.import_module(name)
        classes = [
            n
            for n, c in vars(mod).items()
            if inspect.isclass(c) and issubclass(c, BaseException) and c.__module__ == name
        ]
        assert classes, name
        missing = [n for n in classes if n not in drawn]
        assert not missing, f"{name}: {missing} missing from logstore.errors' docstring"
