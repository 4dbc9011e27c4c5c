"""The public API of each package, pinned: a name added or dropped is a decision, made here."""

from __future__ import annotations

import trainer_client


def test_trainer_client_exports_what_a_training_script_calls():
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
            "CommitReport",
            "CommitResult",
            "FlushReport",
            "Fault",
            "DataSource",
            "ResilientLoop",
            "RecoveryKeys",
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
        ]
    )
    for name in trainer_client.__all__:
        assert getattr(trainer_client, name) is not None
    errors = [getattr(trainer_client, n) for n in trainer_client.__all__ if n.endswith("Error")]
    assert all(e.__module__ == "trainer_client.errors" for e in errors)  # every error class in its errors module
