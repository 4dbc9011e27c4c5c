"""Per-micro-batch determinism: what makes a lost stage replayable bit for bit, anywhere.

The client seeds the RNG before every micro-batch forward from (run seed, stage, iteration,
micro-batch) with :func:`seed_micro_batch`. A replay seeds the same way, so no RNG state is
ever logged and any subset of micro-batches can be replayed on any machine, in any process.

Seeding alone is not enough. A replay reproduces the live parameters and optimizer state
exactly (``torch.equal``) only if all of the following hold; the client records what it can in
each iteration's META record (:func:`environment_fingerprint`) and the replay checks it:

1. **Same inputs.** Received activations and gradients per (iteration, micro-batch) from the
   log, stage-0 inputs and last-stage targets from the log or from a deterministic,
   iteration-addressable data source.
2. **Same RNG stream per micro-batch.** :func:`seed_micro_batch` before each forward (done by
   ``LoggingPipelineStage.forward_one_chunk``). Anything else that draws random numbers between
   a forward and its loss must draw them identically in the replay.
3. **Same intra-op parallelism.** ``torch.get_num_threads()`` changes how CPU kernels split
   reductions and therefore the rounding; the replay runs with the live value
   (:func:`num_threads`).
4. **Deterministic kernels on GPU.** ``torch.use_deterministic_algorithms(True)`` and
   ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuDNN/cuBLAS otherwise pick atomics-based algorithms),
   the same GPU model, the same TF32 / matmul-precision settings.
5. **Same accumulation order.** Parameter gradients are summed over micro-batches in the order
   their backward ran; the replay runs backward in the live order recorded in META (ascending
   for GPipe and 1F1B).
6. **Same scaling.** The loss per micro-batch is the unscaled ``loss_fn(output, target)``;
   after all backwards the schedule divides gradients by ``n_microbatches``
   (``scale_grads=True``, i.e. ``PipelineStage.scale_grads``). The replay does the same division,
   not a division of the loss.
7. **Optimizer state without aliasing.** ``Optimizer.load_state_dict`` keeps references to the
   tensors of the dict it is given; load a *copy* (tensors cloned) of a checkpoint's optimizer state
   (``trainer_client.checkpoint`` does), or two optimizers end up sharing moments.
8. **Same update sequence.** ``optimizer.step()``, then ``lr_scheduler.step()``, then
   ``optimizer.zero_grad(set_to_none=True)`` once per iteration, after the commit step.

Never: logs or restores RNG state; changes thread settings except inside :func:`num_threads`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "SEED_SCHEME",
    "derive_seed",
    "seed_micro_batch",
    "environment_fingerprint",
    "environment_differences",
    "num_threads",
    "autocast_state",
    "autocast_as",
]

#: device types whose autocast state is recorded (those the stages run on)
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")

#: Name of the seed derivation below; stored in META so a replay refuses a different scheme.
SEED_SCHEME = "blake2b64-v1"

_SEED_PACK = struct.Struct(">QIQI")
_MAX_SEED = 2**64 - 1


def derive_seed(run_seed: int, stage: int, iteration: int, micro_batch: int) -> int:
    """The seed of one micro-batch forward: 63 bits of blake2b over the four numbers.

    A pure function of its arguments (no process, machine or torch state), so that a replay
    anywhere gets the same value. Raises ValueError for negative or oversized arguments.
    """
    for name, v, hi in (
        ("run_seed", run_seed, _MAX_SEED),
        ("stage", stage, 2**32 - 1),
        ("iteration", iteration, _MAX_SEED),
        ("micro_batch", micro_batch, 2**32 - 1),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= hi:
            raise ValueError(f"derive_seed: {name} must be an int in 0..{hi}, got {v!r}")
    digest = hashlib.blake2b(_SEED_PACK.pack(run_seed, stage, iteration, micro_batch), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def seed_micro_batch(run_seed: int, stage: int, iteration: int, micro_batch: int) -> int:
    """Seed torch's default generators (CPU and every CUDA device) for one micro-batch; returns the seed.

    Seeds exactly what ``torch.manual_seed`` seeds (the CPU generator, every CUDA device's, and
    those of any other accelerator backend), so this is correct with or without a GPU, but
    without its per-call cost on machines without those backends (``torch.manual_seed`` queues
    a lazy seeding per backend that is not initialized, capturing a stack trace each time: ~1 ms
    per micro-batch). Generators the user created explicitly are not touched.
    """
    seed = derive_seed(run_seed, stage, iteration, micro_batch)
    if _other_accelerators():
        torch.manual_seed(seed)
        return seed
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)  # immediate once CUDA is initialized, queued before
    return seed


_OTHER: bool | None = None


def _other_accelerators() -> bool:
    """Whether a backend other than CPU and CUDA could hold a default generator (checked once)."""
    global _OTHER
    if _OTHER is None:
        checks = (
            lambda: torch.backends.mps.is_available(),
            lambda: torch.xpu.is_available(),
            lambda: torch.mtia.is_available(),
            lambda: torch._C._get_privateuse1_backend_name() != "privateuseone",
        )
        found = False
        for check in checks:
            try:
                found = found or bool(check())
            except Exception:  # a backend this torch build does not have
                continue
        _OTHER = found
    return _OTHER


def environment_fingerprint() -> dict[str, Any]:
    """Settings that change floating-point results, as JSON-able values (stored in META)."""
    fp: dict[str, Any] = {
        "torch": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "seed_scheme": SEED_SCHEME,
    }
    if torch.cuda.is_available():
        fp["cuda"] = torch.version.cuda
        fp["cudnn_deterministic"] = bool(torch.backends.cudnn.deterministic)
        fp["cudnn_benchmark"] = bool(torch.backends.cudnn.benchmark)
        fp["cublas_workspace_config"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        fp["allow_tf32_matmul"] = bool(torch.backends.cuda.matmul.allow_tf32)
        if torch.cuda.is_initialized():  # a process computing on the GPU: its model (kernels differ between models)
            fp["cuda_device"] = torch.cuda.get_device_name()
    return fp


def environment_differences(
    recorded: dict[str, Any], current: dict[str, Any] | None = None
) -> dict[str, tuple[Any, Any]]:
    """Keys whose value differs between a recorded fingerprint and ``current`` (default: now).

    Returns ``{key: (recorded, current)}``; ``num_threads`` is left out because a replay sets it
    with :func:`num_threads`. Keys missing on either side are ignored.
    """
    cur = environment_fingerprint() if current is None else current
    return {k: (v, cur[k]) for k, v in recorded.items() if k in cur and k != "num_threads" and cur[k] != v}


@contextlib.contextmanager
def num_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)`` (None: leave as is), then restore."""
    if n is None or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def autocast_state() -> list[dict[str, Any]] | None:
    """The autocast regions in force now (``torch.autocast`` around the schedule's step), as JSON:
    one ``{"device_type", "dtype", "cache_enabled"}`` per enabled device type, or None when none is."""
    out = [
        {
            "device_type": d,
            "dtype": str(torch.get_autocast_dtype(d)).removeprefix("torch."),
            "cache_enabled": torch.is_autocast_cache_enabled(),
        }
        for d in AUTOCAST_DEVICE_TYPES
        if torch.is_autocast_enabled(d)
    ]
    return out or None


@contextlib.contextmanager
def autocast_as(state: list[dict[str, Any]] | None) -> Iterator[None]:
    """Run the block under the autocast regions ``state`` describes (:func:`autocast_state`; None:
    as is). Raises ValueError for a state it cannot rebuild (unknown dtype or device type)."""
    if not state:
        yield
        return
    with contextlib.ExitStack() as stack:
        for region in state:
            try:
                dtype = getattr(torch, str(region["dtype"]))
                ctx = torch.autocast(
                    str(region["device_type"]), dtype=dtype, cache_enabled=bool(region.get("cache_enabled", True))
                )
            except (KeyError, AttributeError, RuntimeError, TypeError) as e:
                raise ValueError(f"cannot rebuild the autocast region {region!r}: {e}") from e
            stack.enter_context(ctx)
        yield
