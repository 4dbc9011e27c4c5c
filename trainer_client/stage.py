"""LoggingPipelineStage: a ``torch.distributed.pipelining.PipelineStage`` that records what SWIFT needs.

The stage overrides four public methods and delegates the bookkeeping to a
:class:`StageRecorder` (owned by :class:`~trainer_client.SwiftlogClient`):

- ``forward_one_chunk(mb)``: records "F mb" in the iteration's order; on the first stage logs the
  micro-batch inputs (copied: the user may reuse the batch); on any other stage logs the step's
  keyword tensor inputs, which torch hands to every stage (JSON constants go to META), and queues
  the received activation buffers (``args_recv_info[mb]``, filled by the receive that the schedule waited on
  before calling it) by reference to be hashed in the background into DIGEST records of the
  sender; then seeds the RNG for (iteration, mb).
- ``clear_runtime_states()`` (called by the schedule at the start of every step, before any
  receive): settles the deferred digests. A receive buffer belongs to one micro-batch index and
  is only overwritten by the next step's receive into it, and nothing in between writes to it
  (activation buffers are autograd leaves; gradient buffers are only read by backward), so
  hashing it any time before the next step sees exactly what was received.
- ``get_fwd_send_ops(mb)``: logs the activations sent to ``stage + 1`` (kept by reference on CPU:
  PipelineStage never mutates a sent output).
- ``backward_weight_one_chunk(mb)`` (zero-bubble schedules): records "W mb", the weight-gradient
  half of a backward whose input-gradient half was "I mb".
- ``backward_one_chunk(mb)``: records "B mb" ("I mb" for an input-gradient half); queues the received gradient buffers
  (``grad_recv_info[mb]``) for hashing likewise.
- ``get_bwd_send_ops(mb)``: logs the gradients sent to ``stage - 1`` (``input.grad``, which the
  stage releases, never mutates, after the send).

Last-stage targets are captured by the loss function wrapper the client installs on the
schedule (the schedules call ``loss_fn(output, target_mb)`` right after ``forward_one_chunk(mb)``).

Part numbers: part ``i`` of an activation / gradient record is the ``i``-th tensor actually sent
(in output / input order), and the digest records use the same numbering on the receiver side.

Never: raises a logging fault into the training step (every hook is guarded and counts its
failures as faults), consumes RNG, or changes what the stage computes or sends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from logstore import Channel
from logstore.errors import ConfigError
from trainer_client.config import ClientConfig
from trainer_client.determinism import autocast_state, seed_micro_batch
from trainer_client.progress import Progress
from trainer_client.writer import AsyncLogWriter

__all__ = ["LoggingPipelineStage", "StageRecorder"]

logger = logging.getLogger(__name__)


class StageRecorder:
    """Per-iteration capture state of one stage; the bridge between a stage and the writer.

    Every public method is safe to call from the training step: failures are counted as
    "hook" faults in the writer and never raised.
    """

    def __init__(self, config: ClientConfig, writer: AsyncLogWriter) -> None:
        self.config = config
        self.writer = writer
        self.stage = config.stage
        self.progress = Progress()  # the training thread's position (the client's, for its heartbeat)
        # with replicas on two or more machines for every stage, a run may log nothing (the config says why)
        self.enabled = config.enabled and config.logging_off_reason is None
        self.log_data = config.log_data
        self.iteration = 0
        self.order: list[tuple[str, int]] = []
        self.split_backward = False
        # names of the stage-0 keyword inputs logged after the positional ones (in META)
        self.input_kwargs: list[str] = []
        # autocast regions of the iteration's forwards (META "autocast")
        self.autocast: list[dict[str, Any]] | None = None
        self.autocast_varies = False  # they differed between forwards of one iteration
        self._cur_fwd_mb: int | None = None
        self._fwd_boundary = config.logs_forward_send()
        self._bwd_boundary = config.logs_backward_send()
        # digests of what a neighbour sent us are kept iff that neighbour's send crosses a boundary
        first, last = config.group_of()
        self._digest_from_prev = not config.is_first and first == self.stage
        self._digest_from_next = not config.is_last and last == self.stage
        self.logged_send_bytes = 0
        self.skipped_send_bytes = 0
        self.skipped_send_records = 0
        self._warned_non_tensor = False
        # the step's keyword inputs that are JSON constants (META "input_consts")
        self.input_consts: dict[str, Any] = {}
        # per received part: does its buffer require grad (META "recv_requires_grad")
        self.recv_requires_grad: list[bool] | None = None
        # inputs / targets logged per iteration (only this stage has them), and what to call once all of an
        # iteration's are queued, after its last forward / loss (the client ships them then, not at the commit)
        self.n_microbatches: int | None = None
        self.on_data_complete: Callable[[], None] | None = None
        self.data_count = 0  # records of inputs / targets logged in the current iteration
        self.data_sealed_at: int | None = None  # data_count when on_data_complete was called
        self._fwd_count = 0
        self._loss_count = 0

    # ------------------------------------------------------------------ iteration state
    def begin(self, iteration: int) -> None:
        """Start recording ``iteration`` (clears the executed order)."""
        self.iteration = iteration
        self.order = []
        self._cur_fwd_mb = None
        self.split_backward = False
        self.input_kwargs = []
        self.autocast = None
        self.autocast_varies = False
        self.input_consts = {}
        self.data_count = 0
        self.data_sealed_at = None
        self._fwd_count = 0
        self._loss_count = 0

    def check_complete(self, iteration: int, n_microbatches: int | None) -> None:
        """An "incomplete_iteration" fault when the schedule step did not run every micro-batch's
        forward and backward (``n_microbatches``: the schedule's; None: not checked)."""
        n_fwd = sum(1 for k, _ in self.order if k == "F")
        n_bwd = sum(1 for k, _ in self.order if k in ("B", "I"))
        if n_microbatches is not None and (n_fwd != n_microbatches or n_bwd != n_microbatches):
            self.writer.note_fault(
                "incomplete_iteration",
                f"iteration {iteration} ran {n_fwd} forwards and {n_bwd} backwards of {n_microbatches} micro-batches",
                iteration=iteration,
            )

    def _check_data_complete(self) -> None:
        """After the iteration's last forward (and, on the last stage, its last loss): the data it
        logged is all queued; call ``on_data_complete`` once."""
        n = self.n_microbatches
        if self.on_data_complete is None or n is None or self.data_sealed_at is not None or not self.data_count:
            return
        if self._fwd_count >= n and (not self.config.is_last or self._loss_count >= n):
            self.data_sealed_at = self.data_count
            self.on_data_complete()

    def seed(self, micro_batch: int) -> int:
        """Seed the RNG for this stage's forward of ``micro_batch`` in the current iteration."""
        return seed_micro_batch(self.config.seed, self.stage, self.iteration, micro_batch)

    # ------------------------------------------------------------------ hooks of the stage
    def on_forward(
        self, stage: PipelineStage, micro_batch: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> None:
        try:
            state = autocast_state()
            if self._cur_fwd_mb is None:  # the iteration's first forward
                self.autocast = state
            elif state != self.autocast:
                self.autocast_varies = True
            self.order.append(("F", micro_batch))
            self._cur_fwd_mb = micro_batch
            if not self.enabled:
                return
            self._fwd_count += 1
            if kwargs:
                self.input_consts.update({k: v for k, v in kwargs.items() if _json_constant(v)})
            if stage.is_first:
                if self.log_data and self.log_inputs(self.iteration, micro_batch, args, kwargs):
                    self.data_count += 1
            else:
                # as declared (input_args): a replay's received leaves must be the same
                if self.recv_requires_grad is None:
                    self.recv_requires_grad = _received_requires_grad(stage, stage.args_recv_info[micro_batch])
                if self._digest_from_prev:
                    bufs = received_buffers(stage.args_recv_info[micro_batch])
                    self.writer.submit_digests(
                        Channel.digest(self.stage - 1, self.stage), self.iteration, micro_batch, bufs, defer=True
                    )
                # the step's keyword inputs reach every stage; only this stage has them: logged like stage 0's
                if kwargs and self.log_inputs(self.iteration, micro_batch, (), kwargs):
                    self.data_count += 1
            self._check_data_complete()
        except Exception as e:
            self._hook_fault("forward", e, micro_batch)

    def on_weight(self, micro_batch: int) -> None:
        """A zero-bubble schedule's weight-gradient pass ("W") of ``micro_batch``: recorded in the
        order, after the input-gradient pass ("I") that split it off."""
        self.order.append(("W", micro_batch))

    def on_fwd_send(self, micro_batch: int, tensors: Sequence[torch.Tensor]) -> None:
        try:
            if not tensors or not self.enabled:
                return
            self.log_send(tensors, self.stage + 1, "activation", self.iteration, micro_batch)
        except Exception as e:
            self._hook_fault("fwd_send", e, micro_batch)

    def on_backward(self, stage: PipelineStage, micro_batch: int, full_backward: bool) -> None:
        try:
            self.order.append(("B" if full_backward else "I", micro_batch))
            if not full_backward:
                self.split_backward = True
            if not self.enabled or stage.is_last or not self._digest_from_next:
                return
            bufs = received_buffers(stage.grad_recv_info[micro_batch])
            if bufs:
                self.writer.submit_digests(
                    Channel.digest(self.stage + 1, self.stage), self.iteration, micro_batch, bufs, defer=True
                )
        except Exception as e:
            self._hook_fault("backward", e, micro_batch)

    def check_declared_sends(self, sent: Sequence[torch.Tensor], declared: Sequence[Any] | None) -> None:
        """Compare what the forward sends with the outputs the stage declared (``output_args``): the
        next stage receives into buffers of the declared dtype and shape and torch's pipelining
        does not convert (it checks only with TORCH_DISTRIBUTED_DEBUG=DETAIL), so a mismatch (e.g.
        a bf16 output under autocast declared float32, a batch that does not split into micro-batches
        of the declared size) corrupts what arrives (or gloo aborts the receiver), and no replay of the
        run can verify. Raises ConfigError before the send (also noted as a "send_mismatch" fault):
        training on corrupted activations is never what was meant."""
        msg = None
        try:
            if declared is None or len(declared) != len(sent):
                return
            for i, (t, meta) in enumerate(zip(sent, declared, strict=True)):
                want_dtype, want_shape = getattr(meta, "dtype", None), getattr(meta, "shape", None)
                if want_dtype is None or want_shape is None:
                    continue
                if t.dtype != want_dtype or tuple(t.shape) != tuple(want_shape):
                    msg = (
                        f"stage {self.stage} sends output {i} as {str(t.dtype).removeprefix('torch.')} "
                        f"{list(t.shape)} but declared {str(want_dtype).removeprefix('torch.')} {list(want_shape)} "
                        "(output_args): the next stage receives into a buffer of the declared type and shape, "
                        "without conversion, so what arrives would not be what was sent"
                    )
                    self.writer.note_fault(
                        "send_mismatch", msg, channel=Channel.activation(self.stage), iteration=self.iteration
                    )
                    break
        except Exception as e:
            self._hook_fault("fwd_send_check", e, None)
        if msg is not None:
            raise ConfigError(
                msg,
                hint="declare output_args as the forward produces them (under autocast: its dtype; per micro-batch: "
                "the batch divided by n_microbatches), and the next stage's input_args alike",
            )

    def on_bwd_send(self, micro_batch: int, tensors: Sequence[torch.Tensor]) -> None:
        try:
            if not tensors or not self.enabled:
                return
            self.log_send(tensors, self.stage - 1, "gradient", self.iteration, micro_batch)
        except Exception as e:
            self._hook_fault("bwd_send", e, micro_batch)

    def settle(self) -> None:
        """Finish the digests of received buffers queued by reference (before they are reused)."""
        try:
            self.writer.settle_digests()
        except Exception as e:
            self._hook_fault("settle", e, None)

    def on_loss(self, target: Any) -> None:
        try:
            if not self.enabled or self._cur_fwd_mb is None:
                return
            self._loss_count += 1
            if self.log_data and target is not None and self.log_target(self.iteration, self._cur_fwd_mb, target):
                self.data_count += 1
            self._check_data_complete()
        except Exception as e:
            self._hook_fault("loss", e, self._cur_fwd_mb)

    # ------------------------------------------------------------------ explicit logging API
    def log_inputs(
        self, iteration: int, micro_batch: int, args: Sequence[Any], kwargs: dict[str, Any] | None = None
    ) -> bool:
        """Log this stage's inputs from outside the pipeline for one micro-batch (tensors only,
        copied): stage 0's positional ones, then the keyword ones in name order (their names go to
        META as ``input_kwargs``, so a replay passes them by name again; JSON constants among the
        keyword inputs go to META as ``input_consts``). Returns False if dropped."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        names = sorted(k for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor))
        n_consts = sum(1 for v in (kwargs or {}).values() if _json_constant(v))
        if (len(tensors) != len(args) or len(names) + n_consts != len(kwargs or {})) and not self._warned_non_tensor:
            self._warned_non_tensor = True
            logger.warning(
                "stage %d: inputs that are neither tensors nor JSON constants are not logged; "
                "a replay must get them elsewhere",
                self.stage,
            )
        if names:
            self.input_kwargs = names
            tensors += [kwargs[k] for k in names]  # type: ignore[index]
        if not tensors:
            return False
        return self.writer.submit(Channel.input(self.stage), iteration, micro_batch, tensors, copy=True)

    def log_target(self, iteration: int, micro_batch: int, target: Any) -> bool:
        """Log the last stage's target of one micro-batch (a tensor or tuple of tensors, copied)."""
        tensors = [target] if isinstance(target, torch.Tensor) else [t for t in target if isinstance(t, torch.Tensor)]
        if not tensors:
            return False
        return self.writer.submit(Channel.target(self.stage), iteration, micro_batch, tensors, copy=True)

    def log_send(
        self,
        tensors: Sequence[torch.Tensor],
        dst_stage: int,
        kind: str,
        iteration: int,
        micro_batch: int,
        *,
        copy: bool = False,
    ) -> bool:
        """Log tensors this stage sends to a neighbour, if the send crosses a logging-group boundary.

        ``kind`` is "activation" (``dst_stage == stage + 1``) or "gradient" (``stage - 1``).
        Returns True if queued; False if the send is inside a logging group (counted as bytes
        saved) or the record was dropped. Raises ValueError for an impossible (kind, dst).
        """
        if kind == "activation":
            if dst_stage != self.stage + 1:
                raise ValueError(f"stage {self.stage} sends activations to {self.stage + 1}, not {dst_stage}")
            channel, boundary = Channel.activation(self.stage), self._fwd_boundary
        elif kind == "gradient":
            if dst_stage != self.stage - 1:
                raise ValueError(f"stage {self.stage} sends gradients to {self.stage - 1}, not {dst_stage}")
            channel, boundary = Channel.gradient(self.stage), self._bwd_boundary
        else:
            raise ValueError(f"kind must be 'activation' or 'gradient', got {kind!r}")
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if not boundary:
            self.skipped_send_bytes += nbytes
            self.skipped_send_records += len(tensors)
            return False
        self.logged_send_bytes += nbytes
        return self.writer.submit(channel, iteration, micro_batch, tensors, copy=copy, nbytes=nbytes)

    def log_received(self, tensors: Sequence[torch.Tensor], src_stage: int, iteration: int, micro_batch: int) -> bool:
        """Record digests of tensors received from neighbour ``src_stage`` (if that send is logged).

        Hashes now (the buffers may be reused as soon as it returns). Returns True if digests
        were queued.
        """
        if src_stage == self.stage - 1:
            keep = self._digest_from_prev
        elif src_stage == self.stage + 1:
            keep = self._digest_from_next
        else:
            raise ValueError(
                f"stage {self.stage} receives only from {self.stage - 1} or {self.stage + 1}, not {src_stage}"
            )
        if not keep or not tensors:
            return False
        self.writer.submit_digests(Channel.digest(src_stage, self.stage), iteration, micro_batch, list(tensors))
        return True

    # ------------------------------------------------------------------ helpers
    def _hook_fault(self, where: str, e: BaseException, micro_batch: int | None) -> None:
        logger.debug("stage %d: %s hook failed", self.stage, where, exc_info=e)
        self.writer.note_fault(
            "hook", f"{where}: {type(e).__name__}: {e}", iteration=self.iteration, micro_batch=micro_batch
        )


def received_buffers(recv_infos: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors a stage received into, from its ``args_recv_info[mb]`` / ``grad_recv_info[mb]``.

    Model inputs (root args) and absent gradients carry no buffer. Written for the layouts of the
    torch releases seen: 2.13's ``_RecvInfo`` marks a root arg with ``is_root_arg`` (buffer None);
    older releases (2.11 on a GPU machine here) put a ``_RootArgPlaceholder`` with no ``buffer``
    and no ``is_root_arg`` in its place, and an ``i.is_root_arg`` there failed every forward's
    hook (the activation digests went missing and no replay could verify)."""
    return [buf for _, buf in _received(recv_infos)]


def _received(recv_infos: Sequence[Any]) -> list[tuple[Any, torch.Tensor]]:
    """(receive info, its buffer) of each part received (see :func:`received_buffers`)."""
    out = []
    for info in recv_infos:
        buf = getattr(info, "buffer", None)
        if isinstance(buf, torch.Tensor) and not getattr(info, "is_root_arg", False):
            out.append((info, buf))
    return out


def _received_requires_grad(stage: PipelineStage, recv_infos: Sequence[Any]) -> list[bool]:
    """Per received part (as :func:`received_buffers` lists them): whether the stage's forward gets
    it as a leaf requiring grad. torch sets that on the buffer only as the forward begins, from the
    part's declared metadata (``tensor_meta.requires_grad``, 2.13) and whether the stage runs a
    backward; releases without that metadata set it on the buffer when they create it."""
    out = []
    for info, buf in _received(recv_infos):
        declared = getattr(getattr(info, "tensor_meta", None), "requires_grad", None)
        out.append(
            bool(declared and getattr(stage, "has_backward", True)) if declared is not None else bool(buf.requires_grad)
        )
    return out


def _declared_outputs(stage: PipelineStage) -> Sequence[Any] | None:
    """The outputs a stage declared (``output_args``), as torch keeps them: ``_stage_meta.outputs``
    (2.13) or ``_outputs_meta`` (older releases); None when neither is there."""
    meta = getattr(getattr(stage, "_stage_meta", None), "outputs", None)
    return meta if meta is not None else getattr(stage, "_outputs_meta", None)


def _json_constant(v: Any) -> bool:
    """A keyword input META can carry as it is (None, bool, int, float, str)."""
    return v is None or isinstance(v, (bool, int, float, str))


class LoggingPipelineStage(PipelineStage):
    """A PipelineStage that logs its sends, the digests of what it receives, and seeds per micro-batch.

    Build it with :meth:`trainer_client.SwiftlogClient.pipeline_stage`; it takes the same
    arguments as ``PipelineStage`` plus the client's recorder. Static metadata (``input_args`` and
    ``output_args``) is recommended: it avoids the extra metadata-inference forward.
    """

    def __init__(
        self,
        submodule: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        *,
        recorder: StageRecorder,
        **kwargs: Any,
    ) -> None:
        super().__init__(submodule, stage_index, num_stages, device, **kwargs)
        self.recorder = recorder

    def clear_runtime_states(self) -> None:
        # every schedule step starts here, before its first receive: the deferred digests of the
        # buffers received in the previous step must be computed before they are overwritten
        self.recorder.settle()
        super().clear_runtime_states()

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ):  # type: ignore[override]
        self.recorder.progress.busy()
        self.recorder.on_forward(self, fwd_chunk_id, args, kwargs)
        self.recorder.seed(fwd_chunk_id)
        out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        self.recorder.progress.waiting()  # next: its sends, then a receive
        return out

    # type: ignore[override]
    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        self.recorder.progress.busy()
        if self.has_backward:
            self.recorder.on_backward(self, bwd_chunk_id, full_backward)
        super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        self.recorder.progress.waiting()

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        self.recorder.progress.busy()
        if self.has_backward:
            self.recorder.on_weight(bwd_chunk_id)
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        self.recorder.progress.waiting()

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[torch.distributed.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if ops:
            sent = [op.tensor for op in ops]
            # every micro-batch: a batch may split unevenly
            self.recorder.check_declared_sends(sent, _declared_outputs(self))
            self.recorder.on_fwd_send(fwd_chunk_id, sent)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[torch.distributed.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        if ops:
            self.recorder.on_bwd_send(bwd_chunk_id, [op.tensor for op in ops])
        return ops
