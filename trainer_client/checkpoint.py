"""Stage checkpoints: written atomically, read back without aliasing.

A checkpoint of stage k "at iteration c" holds the state *before* iteration c (c iterations
applied): model, optimizer and lr-scheduler state dicts, c, and the run seed. No RNG state:
every micro-batch forward is seeded from (seed, stage, iteration, micro-batch), so nothing else
is needed to replay iterations c, c+1, ... (see ``trainer_client.determinism``).

Writing (:func:`save_checkpoint`): the state is serialized with ``torch.save`` into memory, then

- local path or ``file://``: temp file in the target directory, write, fsync, rename over the
  final name, fsync the directory, so the final name only ever holds a complete checkpoint;
- any other fsspec URL (``s3://``...): one ``pipe`` of the bytes (an object PUT is atomic).

Only after that is the checkpoint registered with the log store (by the client), which makes
older logs garbage. A checkpoint counts as durable only where a replacement machine can read it
(shared filesystem or object store), never on the stage's own disk alone.

Reading (:func:`load_checkpoint`) returns a :class:`Checkpoint`; :meth:`Checkpoint.apply` loads it
into live objects with a copy of the optimizer and scheduler state (every tensor cloned), because
``Optimizer.load_state_dict`` keeps references to the tensors it is given.

Identity (:func:`read_identity`): the run, stage and iteration a checkpoint file says it holds, read
from its pickle alone (no tensor data), so a registration can be checked against the file it names.

Never: leaves a partial file under the final name; loads pickled code (``weights_only=True``;
:func:`read_identity` calls nothing a pickle names).
"""

from __future__ import annotations

import copy
import io
import logging
import os
import pickle
import secrets
import time
import warnings
import zipfile
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer_client.errors import CheckpointError

__all__ = [
    "Checkpoint",
    "CheckpointIdentity",
    "save_checkpoint",
    "load_checkpoint",
    "read_identity",
    "checkpoint_uri",
    "scheduler_next_rates",
    "saved_kinds",
    "class_name",
    "FORMAT_VERSION",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass(slots=True)
class Checkpoint:
    """Everything a replay of one stage needs to start from iteration ``iteration``.

    ``model``/``optimizer``/``lr_scheduler`` are state dicts (``optimizer``/``lr_scheduler`` may be
    None). ``classes``: the class names of the optimizer and lr scheduler they were taken from
    (``{"optimizer": "AdamW", "lr_scheduler": "LambdaLR"}``; empty in older checkpoints).
    ``sched_next``: the learning rates the scheduler's next step was to set
    (:func:`scheduler_next_rates`; None for other schedulers and in older checkpoints).
    ``uri`` is where it was read from or written to.
    """

    run_id: str
    stage: int
    num_stages: int
    iteration: int
    seed: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    lr_scheduler: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    uri: str | None = None
    saved_at: float = 0.0
    classes: dict[str, str] = field(default_factory=dict)
    sched_next: list[float] | None = None
    #: a DCP checkpoint's directory (``trainer_client.dcp_checkpoint``): the state is read by
    #: ``apply`` with ``dcp.load``; ``model``/``optimizer``/``lr_scheduler`` are then empty
    dcp: str | None = None

    def apply(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any | None = None,
        *,
        strict: bool = True,
    ) -> None:
        """Load this checkpoint into live objects; never aliases the checkpoint's tensors.

        The model copies values into its parameters; the optimizer and scheduler get copies (every
        tensor cloned), so applying the same Checkpoint twice gives two independent states. Raises
        CheckpointError if the checkpoint lacks a state the caller asks to load, or when a state does
        not fit the object it is loaded into (another model's parameters, another optimizer's
        parameter groups, an optimizer or lr scheduler of another class than the one saved, or a
        scheduler whose state has other fields, or whose next step would set other rates than the
        saved one's, ``sched_next``), naming which. Torch's own loaders take any state dict: a StepLR
        loaded with a LambdaLR's state goes on with the wrong schedule silently. ``strict=False``
        skips the class, field and next-rate checks (resuming on purpose with another schedule);
        a replay never does.
        """
        what = f"checkpoint {self.uri} of stage {self.stage} (iteration {self.iteration})"
        if self.dcp is not None:
            from trainer_client.dcp_checkpoint import apply_dcp

            if optimizer is not None and strict:
                self._check_class("optimizer", optimizer, what)
            if lr_scheduler is not None and strict:
                self._check_class("lr_scheduler", lr_scheduler, what)
            apply_dcp(
                self.dcp,
                model,
                optimizer,
                lr_scheduler,
                what,
                lambda st: self._check_scheduler(lr_scheduler, st, what, strict),
            )
            if lr_scheduler is not None:
                self._check_next_rates(lr_scheduler, what, strict)
            return
        try:
            model.load_state_dict(self.model)
        except RuntimeError as e:  # missing / unexpected keys, shape mismatches
            raise CheckpointError(
                f"{what} does not fit the model {type(model).__name__}: {str(e).strip()}",
                hint="load it into the module the checkpoint was saved from",
            ) from None
        if optimizer is not None:
            if self.optimizer is None:
                raise CheckpointError(f"{what} has no optimizer state")
            if strict:
                self._check_class("optimizer", optimizer, what)
            try:
                optimizer.load_state_dict(_copy_state(self.optimizer))
            except (ValueError, KeyError, RuntimeError) as e:
                raise CheckpointError(
                    f"{what}: its optimizer state does not fit the optimizer {type(optimizer).__name__}: {e}",
                    hint="build the optimizer as the training did (the same parameter groups, in the same order)",
                ) from None
        if lr_scheduler is not None:
            if self.lr_scheduler is None:
                raise CheckpointError(f"{what} has no lr scheduler state")
            if strict:
                self._check_class("lr_scheduler", lr_scheduler, what)
            self._check_scheduler(lr_scheduler, self.lr_scheduler, what, strict)
            try:
                lr_scheduler.load_state_dict(_copy_state(self.lr_scheduler))
            except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as e:
                raise CheckpointError(
                    f"{what}: its lr scheduler state does not load into the lr scheduler {class_name(lr_scheduler)}: "
                    f"{type(e).__name__}: {e}",
                    hint="build the lr scheduler the training used (the same class and arguments)",
                ) from None
            self._check_next_rates(lr_scheduler, what, strict)

    def _check_scheduler(self, lr_scheduler: Any, saved: Any, what: str, strict: bool) -> None:
        """A saved scheduler state with other fields than ``lr_scheduler``'s is refused (strict)."""
        diff = _state_fields_differ(saved, lr_scheduler.state_dict()) if strict else None
        if diff:
            raise CheckpointError(
                f"{what}: its lr scheduler state does not fit the lr scheduler {class_name(lr_scheduler)}: {diff}",
                hint="build the lr scheduler the training used (the same class and arguments)",
            )

    def _check_next_rates(self, lr_scheduler: Any, what: str, strict: bool) -> None:
        """What the state cannot carry: the scheduler's function (a LambdaLR's lambda)."""
        if strict and self.sched_next is not None:
            mine = scheduler_next_rates(lr_scheduler)
            if mine is not None and mine != [float(x) for x in self.sched_next]:
                raise CheckpointError(
                    f"{what}: the lr scheduler {class_name(lr_scheduler)} loaded with its state would set "
                    f"the learning rates {mine} at its next step, the training's set {list(self.sched_next)}",
                    hint="build the scheduler with the training's function and arguments "
                    "(e.g. a LambdaLR's schedule length); "
                    "to resume with another schedule on purpose: apply(..., strict=False)",
                )

    def _check_class(self, what_obj: str, obj: Any, what: str) -> None:
        saved = self.classes.get(what_obj)
        if saved is not None and saved != class_name(obj):
            label = what_obj.replace("_", " ")
            raise CheckpointError(
                f"{what} was saved from a {saved} {label}, not the {class_name(obj)} it is loaded into",
                hint=f"build the {label} the training used (the same class and arguments)",
            )


def _torch_scheduler(sch: Any) -> bool:
    """Whether ``sch`` is one of torch's own lr schedulers (a composite's parts too), whose step
    changes nothing but its state and the optimizer's param groups."""
    if type(sch).__module__ != "torch.optim.lr_scheduler" or not hasattr(sch, "optimizer"):
        return False
    inner = getattr(sch, "_schedulers", None)
    return all(_torch_scheduler(s) for s in inner) if isinstance(inner, (list, tuple)) else True


def scheduler_next_rates(sch: Any) -> list[float] | None:
    """The learning rates ``sch``'s next step will set: it is stepped once and put back as it was
    (its state dict, the param groups' values), warnings silenced. What no state dict holds (a
    LambdaLR's function, a composite's parts) shows in them: the client puts them into META
    (``sched_next``) and checkpoints, and a replay or a checkpoint load compares its own. Only
    torch's own schedulers (composites of them too): a custom class's step may have effects
    beyond its state. None for others, and when the step fails (ReduceLROnPlateau needs a
    metric). Never raises; a failed restore (never seen) is logged as an error."""
    if not _torch_scheduler(sch):
        return None
    try:
        opt = sch.optimizer
        groups = [_copy_state({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups]
        state = _copy_state(sch.state_dict())
    except Exception:  # a state that does not copy: no prediction, nothing touched
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sch.step()
        return [float(g["lr"]) for g in opt.param_groups]
    except Exception:  # a step that needs arguments: not ours to report
        return None
    finally:
        try:
            sch.load_state_dict(state)
            for g, saved in zip(opt.param_groups, groups, strict=True):
                for k, v in saved.items():
                    if isinstance(v, torch.Tensor) and isinstance(g.get(k), torch.Tensor):
                        g[k].copy_(v)
                    else:
                        g[k] = v
        except Exception:
            logger.exception(
                "putting the lr scheduler %s back after predicting its next rates failed: the schedule may have moved",
                type(sch).__name__,
            )


def class_name(obj: Any) -> str:
    """The class name of an optimizer or lr scheduler, with those of a composite scheduler's parts
    (``SequentialLR``, ``ChainedScheduler``): ``"SequentialLR[LinearLR,CosineAnnealingLR]"``."""
    name = type(obj).__name__
    inner = getattr(obj, "_schedulers", None)
    if isinstance(inner, (list, tuple)) and inner:
        name += "[" + ",".join(class_name(s) for s in inner) + "]"
    return name


def _state_fields_differ(saved: Any, mine: Any, where: str = "") -> str | None:
    """Where two scheduler state dicts have other fields (a composite's parts compared in turn), in
    words; None when they have the same."""
    if not (isinstance(saved, dict) and isinstance(mine, dict)):
        return None
    a, b = set(saved), set(mine)
    if a != b:
        return f"fields {sorted(a - b)} only in the checkpoint, {sorted(b - a)} only in the scheduler{where}"
    parts_a, parts_b = saved.get("_schedulers"), mine.get("_schedulers")
    if isinstance(parts_a, (list, tuple)) and isinstance(parts_b, (list, tuple)):
        if len(parts_a) != len(parts_b):
            return f"{len(parts_a)} schedulers chained in the checkpoint, {len(parts_b)} in the scheduler{where}"
        for i, (x, y) in enumerate(zip(parts_a, parts_b, strict=True)):
            d = _state_fields_differ(
                x,
                y,
                f" (its scheduler {i}{where.replace(' (', ', ').rstrip(')')})" if where else f" (its scheduler {i})",
            )
            if d:
                return d
    return None


def _copy_state(obj: Any) -> Any:
    """A copy of a state dict that shares no tensor with ``obj``: tensors cloned (values, dtype, shape
    and strides kept), plain dicts / lists / tuples rebuilt, anything else deep-copied. Faster than
    ``copy.deepcopy`` for the many small tensors of an optimizer state."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone().requires_grad_(obj.requires_grad)
    if type(obj) is dict:
        return {k: _copy_state(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_copy_state(v) for v in obj)
    return copy.deepcopy(obj)


def saved_kinds(optimizer: Any | None, lr_scheduler: Any | None) -> dict[str, Any]:
    """What a checkpoint records of the objects saved besides their state, so that a load can
    refuse others: ``classes`` (their class names) and ``sched_next`` (the rates the scheduler's
    next step sets, :func:`scheduler_next_rates`)."""
    return {
        "classes": {
            name: class_name(obj)
            for name, obj in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler))
            if obj is not None
        },
        "sched_next": None if lr_scheduler is None else scheduler_next_rates(lr_scheduler),
    }


def checkpoint_uri(base: str, stage: int, iteration: int, format: str = "torch") -> str:
    """The name a checkpoint of (stage, iteration) gets under directory/URL ``base``: the file in
    the ``"torch"`` format, the pointer in the ``"dcp"`` one. ValueError for another format."""
    if format == "dcp":
        from trainer_client.dcp_checkpoint import pointer_uri

        return pointer_uri(base, stage, iteration)
    if format != "torch":
        raise ValueError(f"a checkpoint format is 'torch' or 'dcp', got {format!r}")
    return f"{base.rstrip('/')}/stage{stage:05d}/it{iteration:012d}.pt"


def save_checkpoint(
    uri: str,
    *,
    run_id: str,
    stage: int,
    num_stages: int,
    iteration: int,
    seed: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any | None = None,
    extra: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write a checkpoint atomically to ``uri`` (path, ``file://`` or fsspec URL); return its URI.

    The returned URI is absolute (``file:///...`` for local files). ``extra`` must hold plain
    data (tensors, numbers, strings, lists, dicts). Raises CheckpointError (with the cause
    attached) when the bytes cannot be made durable; then the final name is untouched.
    """
    state = {
        "format": FORMAT_VERSION,
        "run_id": run_id,
        "stage": stage,
        "num_stages": num_stages,
        "iteration": iteration,
        "seed": seed,
        "model": model.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
        **saved_kinds(optimizer, lr_scheduler),
        "extra": dict(extra or {}),
        "saved_at": time.time(),
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getbuffer()
    local = _local_path(uri)
    try:
        if local is not None:
            _write_local_atomic(local, data)
            return "file://" + local
        import fsspec

        fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
        parent = path.rsplit("/", 1)[0]
        if parent and not fs.exists(parent):
            fs.makedirs(parent, exist_ok=True)
        fs.pipe_file(path, bytes(data))
        return uri
    except Exception as e:
        raise CheckpointError(
            f"could not write checkpoint of stage {stage} at iteration {iteration} to {uri}: {type(e).__name__}: {e}",
            hint="check space and permissions of the checkpoint location (CheckpointConfig.url)",
        ) from e


def canonical_uri(uri: str) -> str:
    """``uri`` as :func:`save_checkpoint` returns it (``file:///abs/path`` for a local file)."""
    local = _local_path(uri)
    return uri if local is None else "file://" + local


def remove_checkpoint(uri: str, *, storage_options: dict[str, Any] | None = None) -> None:
    """Delete the checkpoint file at ``uri`` (path, ``file://`` or fsspec URL); a missing one is
    success; a DCP checkpoint's pointer goes with its directory when swiftlog wrote it. Raises
    OSError (or the filesystem's error) when it cannot be deleted."""
    if uri.endswith(".dcp.json"):
        from trainer_client.dcp_checkpoint import remove_dcp

        remove_dcp(uri, storage_options)
        return
    local = _local_path(uri)
    if local is not None:
        try:
            os.remove(local)
        except FileNotFoundError:
            pass
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
    if fs.exists(path):
        fs.rm_file(path)


def load_checkpoint(
    uri: str, *, storage_options: dict[str, Any] | None = None, map_location: str | torch.device = "cpu"
) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint`. Every tensor is freshly allocated.

    A DCP checkpoint's pointer (``it*.dcp.json``, :mod:`trainer_client.dcp_checkpoint`) gives a
    Checkpoint whose state ``apply`` reads with ``dcp.load``. Raises CheckpointError if it cannot
    be read or is not a swiftlog checkpoint.
    """
    if uri.endswith(".dcp.json"):
        return _load_pointer(uri, storage_options)
    try:
        local = _local_path(uri)
        if local is not None:
            with open(local, "rb") as f:
                data = f.read()
        else:
            import fsspec

            fs, path = fsspec.core.url_to_fs(uri, **(storage_options or {}))
            data = fs.cat_file(path)
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"could not read checkpoint {uri}: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{uri} is not a swiftlog checkpoint (format {FORMAT_VERSION})")
    return _checkpoint(
        state, uri, model=state["model"], optimizer=state["optimizer"], lr_scheduler=state["lr_scheduler"]
    )


def _checkpoint(doc: dict[str, Any], uri: str, **state: Any) -> Checkpoint:
    """A Checkpoint of what a torch file's state or a DCP pointer says of itself, with ``state``."""
    return Checkpoint(
        run_id=doc["run_id"],
        stage=doc["stage"],
        num_stages=doc["num_stages"],
        iteration=doc["iteration"],
        seed=doc["seed"],
        extra=doc.get("extra") or {},
        uri=uri,
        saved_at=doc.get("saved_at", 0.0),
        classes={str(k): str(v) for k, v in (doc.get("classes") or {}).items()},
        sched_next=doc.get("sched_next"),
        **state,
    )


def _load_pointer(uri: str, storage_options: dict[str, Any] | None) -> Checkpoint:
    """A lazy Checkpoint for the DCP checkpoint the pointer ``uri`` names (its state is read by
    ``apply``). CheckpointError when the pointer or its directory's ``.metadata`` is missing."""
    from trainer_client.dcp_checkpoint import has_metadata, read_pointer

    doc = read_pointer(uri, storage_options)
    if not has_metadata(doc["dcp"], storage_options):
        raise CheckpointError(f"checkpoint {uri}: its DCP directory {doc['dcp']} has no .metadata")
    return _checkpoint(doc, uri, model={}, dcp=doc["dcp"])


@dataclass(frozen=True, slots=True)
class CheckpointIdentity:
    """What a checkpoint file says it is: the run, the stage, the iteration (iterations applied)."""

    run_id: str
    stage: int
    num_stages: int
    iteration: int


class _Opaque:
    """Stands for anything a pickle names (a tensor, a class): built and filled without running any code."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Opaque:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _IdentityUnpickler(pickle.Unpickler):
    """Reads a checkpoint's top-level fields: every global the pickle names becomes an :class:`_Opaque`, every
    tensor storage None, so nothing is imported or called and no tensor data is read."""

    def find_class(self, module: str, name: str) -> Any:
        return _Opaque

    def persistent_load(self, pid: Any) -> None:
        return None


_MAX_IDENTITY_PICKLE = 64 << 20  # the pickle of a checkpoint holds no tensor bytes: a few MiB at most


def read_identity(uri: str, *, storage_options: dict[str, Any] | None = None) -> CheckpointIdentity:
    """The identity of the checkpoint at ``uri`` (path, ``file://`` or fsspec URL), read from the
    pickle of its ``torch.save`` archive: a few ranged reads, no tensor data. Raises
    CheckpointError when it cannot be read or is not a swiftlog checkpoint; the message is the
    same for a missing file and for a file of another kind. A DCP pointer says it in its JSON."""
    if uri.endswith(".dcp.json"):
        from trainer_client.dcp_checkpoint import read_pointer

        try:
            doc = read_pointer(uri, storage_options)
            ident = (doc["run_id"], doc["stage"], doc["num_stages"], doc["iteration"])
        except Exception as e:  # noqa: BLE001 - one answer, as for a file
            raise _not_a_checkpoint(uri) from e
        if not isinstance(ident[0], str) or any(type(v) is not int for v in ident[1:]):
            raise _not_a_checkpoint(uri)
        return CheckpointIdentity(*ident)
    try:
        local = _local_path(uri)
        if local is not None:
            f: Any = open(local, "rb")
        else:
            import fsspec

            f = fsspec.open(uri, "rb", **(storage_options or {})).open()
        with f, zipfile.ZipFile(f) as z:
            member = next(n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1)
            if z.getinfo(member).file_size > _MAX_IDENTITY_PICKLE:
                raise ValueError("its pickle is too large")
            state = _IdentityUnpickler(io.BytesIO(z.read(member))).load()
        fields = (state["format"], state["run_id"], state["stage"], state["num_stages"], state["iteration"])
    except Exception as e:  # noqa: BLE001 - missing, unreadable, not a zip archive, not a checkpoint: one answer
        raise _not_a_checkpoint(uri) from e
    fmt, run_id, stage, num_stages, iteration = fields
    if fmt != FORMAT_VERSION or not isinstance(run_id, str) or any(type(v) is not int for v in fields[2:]):
        raise _not_a_checkpoint(uri)
    return CheckpointIdentity(run_id, stage, num_stages, iteration)


def _not_a_checkpoint(uri: str) -> CheckpointError:
    return CheckpointError(f"{uri} is not a readable swiftlog checkpoint", hint="give the uri save_checkpoint returned")


def _local_path(uri: str) -> str | None:
    if uri.startswith("file://"):
        return os.path.abspath(uri[len("file://") :])
    if "://" not in uri:
        return os.path.abspath(uri)
    return None


local_path = _local_path  # public: the local file a checkpoint URI names (None for a remote one)


def _write_local_atomic(path: str, data: memoryview) -> None:
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f"{os.path.basename(path)}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
