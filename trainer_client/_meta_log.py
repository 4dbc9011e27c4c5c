"""Building an iteration's META record, and amending it once committed.

The client holds one :class:`MetaLog`. At ``commit`` it assembles the iteration's document
(fields: ``trainer_client.meta``) from what the client's parts saw: the recorder's order and
inputs, the gradient operations, the optimizer and scheduler watched. When the loop then does
something else than the document says, :meth:`MetaLog.amend` writes a second record (micro-batch
1) and replaces the decision store's copy.

Never: changes a committed record (an amendment is a record of its own); keeps any document but the
last committed one.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import torch

from logstore import Channel, LogStore
from trainer_client._shipping import seal_then_set
from trainer_client.commit import CommitCoordinator
from trainer_client.config import ClientConfig
from trainer_client.determinism import SEED_SCHEME, derive_seed, environment_fingerprint
from trainer_client.digest import grad_digests
from trainer_client.meta import META_VERSION, encode_meta
from trainer_client.stage import StageRecorder
from trainer_client.writer import AsyncLogWriter

__all__ = ["MetaLog"]


class MetaLog:
    """The META records of one stage: the last committed document and what was amended in it."""

    def __init__(
        self,
        config: ClientConfig,
        store: LogStore,
        writer: AsyncLogWriter,
        recorder: StageRecorder,
        coordinator: CommitCoordinator | None,
    ) -> None:
        self._config = config
        self._store = store
        self._writer = writer
        self._recorder = recorder
        self._coordinator = coordinator
        self.committed: tuple[int, dict[str, Any]] | None = None  # the last committed iteration and its META
        self._amendment: dict[str, Any] | None = None  # what has been amended in it (its micro-batch 1 record)

    def build(
        self,
        iteration: int,
        *,
        schedule_info: dict[str, Any],
        step_t0: float | None,
        stage_module: torch.nn.Module | None,
        steps: dict[str, Any],
    ) -> dict[str, Any]:
        """The META document of ``iteration``, as the client stands at its commit. ``steps``: the
        fields of the gradient operations and of the optimizer and scheduler watched
        (``GradOps.meta_fields``, ``StepWatcher.meta_fields``)."""
        c = self._config
        rec = self._recorder
        n_mb = schedule_info.get("n_microbatches") or len({mb for _, mb in rec.order})
        env = environment_fingerprint()  # now, not at construction: flags or the GPU may be set up after the client
        return {
            "version": META_VERSION,
            "run_id": c.run_id,  # the mesh's run: a stage's replicas share one META
            "stage": c.stage,
            "num_stages": c.num_stages,
            "iteration": iteration,
            "generation": self._coordinator.generation if self._coordinator is not None else 0,
            **schedule_info,
            "n_microbatches": n_mb,
            "order": [[k, mb] for k, mb in rec.order],
            "split_backward": rec.split_backward,
            "seed": c.seed,
            "seed_scheme": SEED_SCHEME,
            "seeds": [derive_seed(c.seed, c.stage, iteration, mb) for mb in range(n_mb)],
            "data": "logged" if c.log_data else "source",
            "input_kwargs": list(rec.input_kwargs),
            "input_consts": dict(rec.input_consts),
            "recv_requires_grad": rec.recv_requires_grad,
            **steps,
            "grad_digests": grad_digests(stage_module),  # what the coming step should use; a replay checks its own
            "autocast": rec.autocast,
            "autocast_varies": rec.autocast_varies,
            "logging_groups": None if c.logging_groups is None else list(c.logging_groups),
            "env": env,
            "step_s": None if step_t0 is None else time.perf_counter() - step_t0,
            "time": time.time(),
        }

    def queue(
        self, iteration: int, doc: dict[str, Any], own: list[Channel], *, shipping: bool
    ) -> tuple[torch.Tensor, threading.Event | None]:
        """Queue ``iteration``'s META record and write the iteration's records now (overlapping the
        optimizer step); with ``shipping``, have the writer seal it and the stage's own data
        (``own``) once written. Returns the record and the event set once sealed (None without)."""
        meta = encode_meta(doc)
        stage = self._config.stage
        self._writer.submit(Channel.meta(stage), iteration, 0, [meta])
        sealed = None
        if shipping:
            sealed = threading.Event()
            self._writer.mark(functools.partial(seal_then_set, self._store, [*own, Channel.meta(stage)], sealed))
        self._writer.kick()
        return meta, sealed

    def note_committed(self, iteration: int, doc: dict[str, Any]) -> None:
        """``iteration`` committed with META ``doc``: nothing amended in it yet."""
        self.committed, self._amendment = (iteration, doc), None

    def amend(self, iteration: int, doc: dict[str, Any], fields: dict[str, Any]) -> None:
        """Amend committed ``iteration``'s META (``doc``) with ``fields``.

        A second record (micro-batch 1; fields amended before are kept) is shipped like the META,
        and the decision store's copy is replaced with the document so amended. Raises what the
        store client raises."""
        latest = self.committed is not None and self.committed[0] == iteration
        amendment = {**((latest and self._amendment) or {}), **fields, "iteration": iteration}
        if latest:
            self._amendment = amendment
        stage = self._config.stage
        self._writer.submit(Channel.meta(stage), iteration, 1, [encode_meta(amendment)])
        if self._config.commit.ship_data and self._store.cold is not None:  # off the node soon, like the META itself
            self._writer.mark(functools.partial(seal_then_set, self._store, [Channel.meta(stage)], threading.Event()))
        self._writer.kick()
        if self._coordinator is not None:  # the copy a replacement reads says what the steps did
            self._coordinator.amend_meta(iteration, encode_meta({**doc, **amendment}).numpy().tobytes())
