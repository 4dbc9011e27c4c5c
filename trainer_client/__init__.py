"""trainer_client: SWIFT logging embedded in pipeline-parallel training (torch.distributed.pipelining).

A few lines in a training script, per stage process::

    from trainer_client import ClientConfig, SwiftlogClient

    client = SwiftlogClient(
        ClientConfig(run_id="gpt-7", stage=rank, num_stages=4, seed=1234,
                     store_root="/local/swiftlog", cold_url="s3://logs/swiftlog"),
        commit_store=tcp_store,            # a TCPStore hosted outside the training ranks
    )
    stage = client.pipeline_stage(model, device, input_args=example_in, output_args=example_out)
    schedule = client.schedule(stage, "1f1b", n_microbatches=8, loss_fn=loss_fn)

    for it in range(start_iteration, num_iterations):
        client.step(it, tokens, target=labels)   # same call on every stage
        client.commit(it)                        # all stages apply `it`, or IterationAbortedError
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if (it + 1) % 100 == 0:
            client.checkpoint(it + 1, model, optimizer, lr_scheduler)
    client.close()

What it does: every activation a stage sends forward and every gradient it sends backward (at
logging-group boundaries), stage-0 inputs, last-stage targets and one META record per iteration
go to the node's log store asynchronously (the training thread only enqueues); the receiver of
each logged send keeps a digest of it; every micro-batch forward is seeded from (seed, stage,
iteration, micro-batch). From a stage's checkpoint and its neighbours' logs,
``replay.replay_stage`` then reproduces that stage's parameters and optimizer state bit for
bit. Stage-0 inputs and last-stage targets can instead come from a deterministic data source
(``SwiftlogClient(..., data_source=fn)`` with ``ClientConfig(log_data=False)``; give the replay
the same ``fn``).

To survive other stages' failures in place, drive the same steps through
:class:`ResilientLoop` (see ``examples/minimal_resilient.py``)::

    loop = ResilientLoop(client, tcp_store, RecoveryConfig(run_id="gpt-7", stage=rank, num_stages=4),
                         rebuild=build_stage_and_schedule, optimizer=optimizer)
    loop.run(start_iteration, num_iterations,
             forward_backward=lambda it: client.step(it, tokens, target=labels),
             apply=lambda it: (optimizer.step(), lr_scheduler.step(), optimizer.zero_grad(set_to_none=True)))

Logging faults (store full, cold tier down, encode errors) never raise into training: they are
counted in ``client.stats()`` and reported by ``commit``/``flush``/``close``.
See ``trainer_client.determinism`` for what exact replay requires of the training script.

The names below are the public API (pinned by ``tests/test_public_api.py``). The modules hold
more: the writer, the commit coordinator, the META codec. Other packages of this project import
those from their modules; a training script needs none of them.
"""

from trainer_client.checkpoint import Checkpoint, checkpoint_uri, load_checkpoint, save_checkpoint
from trainer_client.client import SwiftlogClient
from trainer_client.commit import CommitResult, loopback_store
from trainer_client.config import (
    CheckpointConfig,
    ClientConfig,
    CommitConfig,
    MetricsConfig,
    RecoveryConfig,
    StorageConfig,
    WriterConfig,
)
from trainer_client.data import DataSource
from trainer_client.determinism import derive_seed, seed_micro_batch
from trainer_client.errors import (
    CheckpointError,
    ClientError,
    CommitError,
    CommitStoreError,
    IterationAbortedError,
    RecoveryFailedError,
    RecoveryTimeoutError,
    ReplicaTransferError,
    RestartRequired,
    UnsupportedScheduleError,
)
from trainer_client.mesh import MeshLayout, build_mesh, rank_stages, recovery_paths
from trainer_client.multi_stage import MULTI_STAGE_SCHEDULES, MultiStageClient
from trainer_client.recovery_keys import RecoveryKeys
from trainer_client.reports import CommitReport, FlushReport
from trainer_client.survivor import ResilientLoop, form_mesh
from trainer_client.writer import Fault

__all__ = [
    # configuration
    "ClientConfig",
    "WriterConfig",
    "CommitConfig",
    "StorageConfig",
    "CheckpointConfig",
    "MetricsConfig",
    "RecoveryConfig",
    # the client and what it reports
    "SwiftlogClient",
    "MultiStageClient",
    "MULTI_STAGE_SCHEDULES",
    "CommitReport",
    "CommitResult",
    "FlushReport",
    "Fault",
    "DataSource",
    "loopback_store",
    # in-place recovery
    "ResilientLoop",
    "RecoveryKeys",
    "form_mesh",
    # a data-parallel x pipeline mesh
    "MeshLayout",
    "build_mesh",
    "recovery_paths",
    "rank_stages",
    # checkpoints
    "Checkpoint",
    "checkpoint_uri",
    "save_checkpoint",
    "load_checkpoint",
    # seeding, for hand-written runtimes
    "derive_seed",
    "seed_micro_batch",
    # errors
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
