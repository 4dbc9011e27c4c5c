"""META records: one JSON document per (stage, iteration), stored as a uint8 tensor.

The client writes it at ``commit`` (``Channel.meta(stage)``, micro-batch 0). The replay reads from
it the executed forward/backward order, ``n_microbatches``, the gradient scale factor, the seed
scheme and the environment fingerprint (thread count...). "Absent in older records" below means
a replay must read documents without the field.

Fields (version 1):

- ``version``, ``run_id``, ``stage``, ``num_stages``, ``iteration``, ``generation``.
- ``schedule``, ``n_microbatches``, ``scale_grads``, ``grad_scale_factor``.
- ``order``: ``[["F"|"B", mb], ...]`` as executed (a split backward: "I" for its input-gradient
  half, "W" for its weight-gradient half); ``split_backward``.
- ``seed``, ``seed_scheme``, ``seeds`` (per micro-batch).
- ``data``: "logged" or "source".
- ``input_kwargs``: names of the step's keyword tensor inputs this stage logged under
  ``input_{stage}``, in this order; on stage 0 after the positional ones.
- ``input_consts``: the step's keyword inputs that are JSON constants, by name (absent in older
  records).
- ``recv_requires_grad``: per received part, whether the stage's forward got it as a leaf
  requiring grad, as ``input_args`` declared. Null on the first stage. Absent in older records:
  every float part did.
- ``sched_epoch``: the ``last_epoch`` of the lr scheduler the client tracks, at commit; null
  without one.
- ``sched_next``: for a tracked torch lr scheduler (composites of them too), each group's learning
  rate its next step will set, found by stepping it once and putting it back. What no checkpoint
  holds shows there: a LambdaLR's function, a SequentialLR's parts. Null for other schedulers;
  absent in older records.
- ``apply_irregular``: the first iteration after which the client saw other than one optimizer
  and one scheduler step, or null.
- ``grad_clip``: the iteration's ``client.clip_grad_norm_`` calls in order: ``max_norm``,
  ``total_norm`` as used, its ``dtype``, ``foreach``, ``params`` (positions in the module's
  ``parameters()``, or null for all). Absent in older records: no clipping.
- ``grad_reduce``: the iteration's ``client.all_reduce_grads_`` calls in order: ``seq`` (the
  place among them and the ``grad_clip`` calls, which carry one too), ``params`` (positions in
  ``parameters()``), ``average``, ``world``, ``pre`` (the gradients' digests before the
  reduction, on CPU, else null).
- ``replica_average``: the average over the stage's data-parallel replicas that ``step`` ran
  (``dp_replicate > 1``): ``seq``, ``world``, ``bucket_bytes``, ``buckets``, ``ranks`` (the
  participants' global ranks). Nothing is logged: lost replicas repeat it among themselves. No
  digests before it (they differ per replica, and a stage's replicas share one META: ``run_id``
  is the mesh's run). Absent without replicas.
- ``lrs``: each param group's learning rate at commit, the one the coming optimizer step uses, of
  the optimizer the client tracks (given to ``checkpoint`` or ``ResilientLoop``); null before any.
- ``hparams``: each param group's other hyperparameters at commit (:func:`optimizer_hparams`;
  absent in older records).
- ``grads_carried``: the parameters whose gradient the previous optimizer step had used and that
  nothing zeroed before this iteration's schedule step added to it (the loop forgot
  ``zero_grad``). A replay stops there. Absent in older records.
- ``grad_digests``: the xxh3 of each parameter gradient of the stage at the commit, in
  ``parameters()`` order, as 16 hex digits; null for a parameter without one; null as a whole
  when the gradients are not on the CPU. The replay compares its own before each step. Absent in
  older records.
- ``changed_after_commit`` and ``grads_changed``: only in an amended META (see below). What the
  step used that differed from the document as committed, and the parameters whose gradients were
  changed after the schedule's backward other than by ``client.clip_grad_norm_``.
- ``autocast``: the ``torch.autocast`` regions the stage's forwards ran under,
  ``[{"device_type", "dtype", "cache_enabled"}]``, or null. ``autocast_varies``: they differed
  between forwards of the iteration (not replayable).
- ``logging_groups``, ``env`` (``determinism.environment_fingerprint``), ``step_s``, ``time``.
- ``loss``: the schedule's ``loss_fn`` as ``"module:qualname"``, or ``"/path/script.py:qualname"``
  for a script run by path, when another process can import it by that name; else null. Absent
  in older records. ``loss_repr``: what it was, for the error that asks for it.
- ``loss_script``: the ``"/path/script.py:qualname"`` of a function of a script whose top level
  does more than define things. A replay does not load it by itself: the error names it. Else null.

Amendments:

1. An optimizer step is amended when it runs with other learning rates or hyperparameters than
   its iteration's META says (set between ``commit`` and ``optimizer.step()``). It is amended too
   when it runs on gradients changed in place after the schedule's backward other than by
   ``client.clip_grad_norm_``. Version counters show such changes (torch's clip, a manual
   scaling). A GradScaler's step is recognised as such. On CPU, the gradients' digests against
   ``grad_digests`` also show a collective or a ``.data`` write.
2. The client then writes a second record, micro-batch 1 of the same channel and iteration. It
   holds ``lrs``, ``hparams``, ``changed_after_commit`` and ``grads_changed`` as the step found
   them. The decision store's copy is replaced with the document so amended. A replay reads both
   (:func:`amend_meta`) and stops at such a step.
3. From the first iteration followed by other than one optimizer step and one lr-scheduler step
   on, the client also amends every iteration's META with ``apply``:
   ``{"optimizer_steps", "scheduler_steps"}`` made after it. They are counted when the next
   iteration begins, at a checkpoint or at close; null where it tracks no such object. A replay
   repeats the scheduler's count and stops at an iteration without an optimizer step.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from typing import Any

import torch

__all__ = [
    "META_VERSION",
    "encode_meta",
    "decode_meta",
    "amend_meta",
    "optimizer_hparams",
    "hparam_changes",
    "importable_name",
    "script_name",
    "script_defines_only",
]

META_VERSION = 1


def encode_meta(doc: dict[str, Any]) -> torch.Tensor:
    """A META record value: the JSON document as a uint8 tensor."""
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_meta(t: torch.Tensor) -> dict[str, Any]:
    """Inverse of :func:`encode_meta`."""
    return json.loads(bytes(t.numpy().tobytes()).decode())


AMENDED_FIELDS = ("lrs", "hparams", "changed_after_commit", "grads_changed", "apply")


def amend_meta(doc: dict[str, Any], amendment: dict[str, Any] | None) -> dict[str, Any]:
    """``doc`` with the fields of an amendment record (micro-batch 1: what the optimizer step used,
    set after the commit) in place of its own; ``doc`` itself when there is none."""
    if not amendment:
        return doc
    return {**doc, **{k: amendment[k] for k in AMENDED_FIELDS if k in amendment}}


def optimizer_hparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters but its parameters and learning rate (META ``lrs``), as
    JSON values: numbers, booleans, strings, None, lists of numbers (``betas``); a one-element
    tensor as its number; NaN as the string "nan" (so that equal values compare equal). Entries of
    other types are left out. A replay compares them with its own optimizer's before each step:
    an optimizer restored from a checkpoint and stepped by the same scheduler has the same ones."""
    out = []
    for group in optimizer.param_groups:
        d: dict[str, Any] = {}
        for k, v in group.items():
            if k in ("params", "lr"):
                continue
            j = _json_value(v)
            if j is not _SKIP:
                d[str(k)] = j
        out.append(d)
    return out


def hparam_changes(
    lrs: list[float] | None,
    hparams: list[dict[str, Any]] | None,
    new_lrs: list[float] | None,
    new_hparams: list[dict[str, Any]] | None,
) -> list[str]:
    """What differs between two snapshots of an optimizer (META ``lrs`` / ``hparams`` and now), as
    ``"lr of param group 0: 0.001 -> 0.0005"``; [] when nothing does. A side given as None is not
    compared."""
    out = []
    if lrs is not None and new_lrs is not None:
        out += [
            f"lr of param group {g}: {a} -> {b}"
            for g, (a, b) in enumerate(zip(lrs, new_lrs, strict=False))
            if float(a) != float(b)
        ]
        if len(lrs) != len(new_lrs):
            out.append(f"param groups: {len(lrs)} -> {len(new_lrs)}")
    if hparams is not None and new_hparams is not None:
        for g, (a, b) in enumerate(zip(hparams, new_hparams, strict=False)):
            out += [
                f"{k} of param group {g}: {a.get(k)} -> {b.get(k)}"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k)
            ]
        if len(hparams) != len(new_hparams) and not any(x.startswith("param groups") for x in out):
            out.append(f"param groups: {len(hparams)} -> {len(new_hparams)}")
    return out


_SKIP = object()


def _json_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            return _SKIP
        v = v.item()
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, (int, float)):
        return "nan" if v != v else v
    if isinstance(v, (tuple, list)):
        items = [_json_value(x) for x in v]
        return _SKIP if any(x is _SKIP for x in items) else items
    return _SKIP


def importable_name(obj: Any) -> str | None:
    """``"module:qualname"`` under which another process can import ``obj`` again, or None when it
    has no such name: a lambda, a closure, a ``functools.partial``, a callable instance (e.g. an
    ``nn.CrossEntropyLoss()``). A function of a script run by path (``python train.py``, its
    spawned children, torchrun) is named ``"/abs/path/train.py:qualname"`` (``replay.user_code.load_object``
    loads the file under another module name, so its ``if __name__ == "__main__"`` block does not
    run) when importing the script is known to be harmless: it is a multiprocessing child's main
    module (spawn imported it already), or its top level only defines things (:func:`script_defines_only`).
    One run as ``python -m package.module`` is named by its module. Never imports anything: the
    name is checked against the modules already loaded, so it resolves to ``obj`` itself."""
    found = _resolve(obj)
    if found is None:
        return None
    mod, name, qual = found
    if name:
        return f"{name}:{qual}"
    path = _script_path(mod)
    if path is None or not (mod.__name__ == "__mp_main__" or script_defines_only(path)):
        return None
    return f"{path}:{qual}"


def script_name(obj: Any) -> str | None:
    """``"/abs/path/script.py:qualname"`` for a function of a script run by path, whether or not
    importing that script is harmless (for the error that asks to pass it); None for anything else."""
    found = _resolve(obj)
    if found is None or found[1]:
        return None
    path = _script_path(found[0])
    return None if path is None else f"{path}:{found[2]}"


def script_defines_only(path: str) -> bool:
    """Whether the top level of the Python file at ``path`` only imports, defines and assigns, and
    guards the rest with ``if __name__ == "__main__"``: loading it under another name runs no
    training. False for anything else (a call at top level, a loop, a file that does not parse)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return False
    return all(_harmless(node) for node in tree.body)


_DEFINITIONS = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
    ast.Pass,
)


def _harmless(node: ast.stmt) -> bool:
    if isinstance(node, _DEFINITIONS):
        return True
    if isinstance(node, ast.Expr):  # a docstring
        return isinstance(node.value, ast.Constant)
    if isinstance(node, ast.If):
        t = node.test
        names = [ast.unparse(x) for x in ([t.left, *t.comparators] if isinstance(t, ast.Compare) else [])]
        if sorted(names) == ["'__main__'", "__name__"]:
            return all(_harmless(n) for n in node.orelse)  # the guarded body does not run
    if isinstance(node, ast.Try):  # try: import x / except ImportError: x = None
        return all(
            _harmless(n)
            for n in [*node.body, *node.orelse, *node.finalbody, *(s for h in node.handlers for s in h.body)]
        )
    return False


def _resolve(obj: Any) -> tuple[Any, str, str] | None:
    """(its module, the module's importable name or "" for a script run by path, qualname) when
    ``obj`` is found again under its module and qualname; else None."""
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(mod, str) or not isinstance(qual, str) or "<" in qual:
        return None
    module = sys.modules.get(mod)
    if module is None:
        return None
    name = mod
    if mod in ("__main__", "__mp_main__"):
        spec = getattr(module, "__spec__", None)
        name = getattr(spec, "name", None) or ""
        if name in ("__main__", "__mp_main__"):
            name = ""
    found: Any = module
    for part in qual.split("."):
        found = getattr(found, part, None)
    return (module, name, qual) if found is obj else None


def _script_path(module: Any) -> str | None:
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or not path.endswith(".py") or not os.path.isfile(path):
        return None
    return os.path.abspath(path)
