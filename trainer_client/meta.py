"""META records: one JSON document per (stage, iteration), stored as a uint8 tensor.

The client writes it at ``commit`` (``Channel.meta(stage)``, micro-batch 0); the replay reads the
executed forward/backward order, ``n_microbatches``, the gradient scale factor, the seed scheme
and the environment fingerprint (thread count...) from it. Fields (version 1): ``version``,
``run_id``, ``stage``, ``num_stages``, ``iteration``, ``generation``, ``schedule``,
``n_microbatches``, ``scale_grads``, ``grad_scale_factor``, ``order`` (``[["F"|"B", mb], ...]``
as executed), ``split_backward``, ``seed``, ``seed_scheme``, ``seeds`` (per micro-batch),
``data`` ("logged" | "source"), ``input_kwargs`` (names of the step's keyword tensor inputs this
stage logged under ``input_{stage}``, in this order; on stage 0 after the positional ones),
``input_consts`` (the step's keyword inputs that are JSON constants, by name; absent in older
records), ``grad_clip`` (the iteration's ``client.clip_grad_norm_`` calls in
order: ``max_norm``, ``total_norm`` as used, its ``dtype``, ``foreach``, ``params``: positions in the
module's ``parameters()`` or null for all; absent in older records: no clipping), ``lrs`` (each param
group's learning rate at commit, i.e. the one the coming optimizer step uses, of the optimizer last
given to ``checkpoint``; null before any), ``autocast`` (the
``torch.autocast`` regions the stage's forwards ran under: ``[{"device_type", "dtype",
"cache_enabled"}]`` or null) and ``autocast_varies`` (they differed between forwards of the
iteration: not replayable), ``logging_groups``,
``env`` (``determinism.environment_fingerprint``), ``step_s``, ``time``, ``loss`` (the schedule's
``loss_fn`` as ``"module:qualname"`` when another process can import it by that name, else null;
absent in older records) and ``loss_repr`` (what it was, for the error that asks for it).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

__all__ = ["META_VERSION", "encode_meta", "decode_meta", "importable_name"]

META_VERSION = 1


def encode_meta(doc: dict[str, Any]) -> torch.Tensor:
    """A META record value: the JSON document as a uint8 tensor."""
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_meta(t: torch.Tensor) -> dict[str, Any]:
    """Inverse of :func:`encode_meta`."""
    return json.loads(bytes(t.numpy().tobytes()).decode())


def importable_name(obj: Any) -> str | None:
    """``"module:qualname"`` under which another process can import ``obj`` again, or None when it
    has no such name: a lambda, a closure, a ``functools.partial``, a callable instance (e.g. an
    ``nn.CrossEntropyLoss()``), or a function of a script run by path (``python train.py``; one run as
    ``python -m package.module`` is named by its module). Never imports anything: the name is checked
    against the modules already loaded, so it resolves to ``obj`` itself."""
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(mod, str) or not isinstance(qual, str) or "<" in qual:
        return None
    module = sys.modules.get(mod)
    name = mod
    if mod in ("__main__", "__mp_main__"):
        spec = getattr(module, "__spec__", None)
        name = getattr(spec, "name", None) or ""
        if not name or name in ("__main__", "__mp_main__"):
            return None
    found: Any = module
    for part in qual.split("."):
        found = getattr(found, part, None)
    return f"{name}:{qual}" if found is obj else None
