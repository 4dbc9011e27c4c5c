"""The user's code a replay runs: loading it by name, and naming the replay's place when it raises.

A replay imports the stage factory, the loss function and the data source by name, so that a
spawned worker or a torchrun rank finds the same objects: :func:`load_object` takes
``"package.module:attr"`` or ``"path/to/file.py:attr"`` (:func:`is_script_spec`,
:func:`absolute_spec` for processes started elsewhere). :func:`logged_loss` imports the loss
function the live schedule used, as its META names it. :func:`user_code` turns an exception of the
user's stage or loss into a ReplayError naming the stage, iteration and micro-batch.

Never: runs a script's ``if __name__ == "__main__"`` block; guesses a loss function META does not
name.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from logstore.errors import SwiftlogError
from replay.errors import ReplayError
from replay.reader import LogReader

__all__ = ["absolute_spec", "is_script_spec", "load_object", "logged_loss", "user_code"]

logger = logging.getLogger(__name__)


@contextmanager
def user_code(what: str, stage: int, it: int, mb: int) -> Iterator[None]:
    """An error of the user's model or loss becomes a ReplayError naming where the replay was (the
    original stays chained as its cause, for the traceback)."""
    try:
        yield
    except SwiftlogError:
        raise
    except Exception as e:
        text = str(e).strip().splitlines()
        raise ReplayError(
            f"stage {stage} iteration {it} micro-batch {mb}: the {what} raised {type(e).__name__}: "
            f"{text[0][:300] if text else ''}",
            hint="is the stage factory (--model, --model-arg) and the loss (--loss) what this run trained with? "
            "The stage must accept exactly what its neighbour sent",
        ) from e


def load_object(spec: str) -> Any:
    """The attribute named by ``"package.module:attr"`` (imported) or ``"path/to/file.py:attr"``
    (the file loaded as a module of another name than ``__main__``, so its ``if __name__ ==
    "__main__"`` block does not run, with its directory put first on ``sys.path`` as when it runs
    as a script; loaded once per process). ``attr`` may be dotted. Raises ValueError naming what
    was not found; an error raised while loading a file is re-raised as ValueError naming the file."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"{spec!r} is not 'module:attribute' or 'path/to/file.py:attribute'")
    if is_script_spec(spec):
        obj: Any = _load_script(mod_name, spec)
    else:
        try:
            obj = importlib.import_module(mod_name)
        except ImportError as e:
            raise ValueError(f"cannot import {mod_name!r} (from {spec!r}): {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{mod_name!r} has no attribute {attr!r}") from None
    return obj


def is_script_spec(spec: str) -> bool:
    """Whether ``spec`` names a file (``"dir/train.py:attr"``) rather than a module."""
    path = spec.rpartition(":")[0]
    return path.endswith(".py") or "/" in path


def absolute_spec(spec: str | None) -> str | None:
    """``spec`` with a relative file path made absolute (for processes started elsewhere); module
    names and None unchanged."""
    if spec is None or not is_script_spec(spec):
        return spec
    path, _, attr = spec.rpartition(":")
    return f"{os.path.abspath(path)}:{attr}"


def _load_script(path: str, spec: str) -> Any:
    path = os.path.abspath(path)
    name = "swiftlog_script_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(path):
        raise ValueError(f"no such file {path!r} (from {spec!r})")
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ValueError(f"cannot load {path!r} as Python (from {spec!r})")
    module = importlib.util.module_from_spec(loader_spec)
    directory = os.path.dirname(path)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ValueError(f"loading {path!r} (from {spec!r}) raised {type(e).__name__}: {e}") from e
    return module


def logged_loss(reader: LogReader, stage: int, iteration: int) -> Callable[..., torch.Tensor]:
    """The loss function the live schedule of ``stage`` (the last one) used, imported by the name
    its META of ``iteration`` records (without that META, the one the stage before it names: every
    stage's schedule gets a loss function, and the verified sends show a wrong one). Raises
    ReplayError saying what to pass instead when META names none (the live ``loss_fn`` was a
    lambda, a callable instance, a function of a script run by path; or the record predates the
    field) or the name does not import here. Never guesses another loss function."""
    doc = reader.meta(stage, iteration)
    if (
        doc is None and stage > 0
    ):  # its own META is gone (an offline replay): every stage's schedule got a loss_fn, normally the same one
        doc = reader.meta(stage - 1, iteration)
        if doc is not None and doc.get("loss"):
            logger.warning(
                "stage %d's META of iteration %d is missing: replaying with stage %d's loss function %s",
                stage,
                iteration,
                stage - 1,
                doc["loss"],
            )
    name = doc.get("loss") if doc is not None else None
    if not name:
        what = (
            f"the live schedule's loss_fn ({doc['loss_repr']}) has no importable name"
            if doc is not None and doc.get("loss_repr")
            else f"stage {stage}'s META of iteration {iteration} does not name the live loss function"
        )
        script = doc.get("loss_script") if doc is not None else None
        if script:
            what = (
                f"the live schedule's loss_fn is {script}, in a script whose top level runs more than definitions "
                "(not loaded unasked)"
            )
        raise ReplayError(
            f"replaying the last stage ({stage}) needs its loss function: {what}",
            hint=(
                f"if loading that script runs no training, pass it: --loss {script}"
                if script
                else "pass it: swiftlog replay --loss module:attr (or path/to/file.py:attr), ReplayJob(loss=...) or "
                "loss_fn=... "
                "(or give the schedule a module-level function, which META names)"
            ),
        )
    try:
        return load_object(str(name))
    except ValueError as e:
        raise ReplayError(
            f"replaying the last stage ({stage}): the live loss function {name!r} (named by META) does not import "
            f"here: {e}",
            hint="make its module importable (PYTHONPATH) or pass the function: --loss module:attr",
        ) from e
