"""Checkpoint registrations: the small documents that make logs garbage, and their checks.

A registration says that stage k's checkpoint at iteration c is durable. It is a JSON object
with the fields of :class:`CheckpointInfo`, stored under a name that carries (k, c):

- ``ckpt/stage{k:05d}/{c:012d}`` in a writer's hot index (:func:`hot_name`);
- ``{run}/checkpoints/stage{k:05d}/{c:012d}.json`` in the cold tier's documents (:func:`cold_name`).

The name is the key; the content must agree with it. A document whose stage or iteration
differs from its name (a bit flip would otherwise raise a watermark and delete logs) is refused
by :func:`parse_doc` with a CorruptRecordError; the store leaves it out and ``verify`` lists it.
A field this version does not know is ignored (a newer writer may add one) and named, so the
caller can warn once.

``meta`` is free-form, capped by :func:`check_meta`: a JSON object of portable JSON (finite
numbers, valid Unicode), at most :data:`MAX_META_DEPTH` containers deep and
:data:`MAX_META_BYTES` bytes long. A stored document over the caps (written before they
existed) is still read; its meta is replaced by a note saying why.

Never: trusts a document whose content disagrees with its name; fails a read for a field it does
not know; recurses over a document (a deep one would exhaust the stack).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from logstore.errors import CorruptRecordError

__all__ = [
    "CheckpointInfo",
    "MAX_META_DEPTH",
    "MAX_META_BYTES",
    "check_meta",
    "check_portable_json",
    "hot_name",
    "cold_name",
    "parse_hot_name",
    "parse_cold_name",
    "parse_doc",
]

#: containers (objects, arrays) nested in a checkpoint's meta, the meta object itself included
MAX_META_DEPTH = 16
#: a checkpoint's meta as compact UTF-8 JSON
MAX_META_BYTES = 16 * 1024

_FIELDS = ("stage", "iteration", "uri", "registered_at", "meta")
_HOT_RE = re.compile(r"^ckpt/stage(?P<stage>\d{5})/(?P<it>\d{12})$")
_COLD_RE = re.compile(r"^(?:.*/)?checkpoints/stage(?P<stage>\d{5})/(?P<it>\d{12})\.json$")


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One registration: stage ``stage``'s checkpoint at ``iteration`` is durable and readable at
    ``uri``; ``registered_at`` in Unix seconds; ``meta`` free-form (see :func:`check_meta`)."""

    stage: int
    iteration: int
    uri: str | None = None
    registered_at: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)


def check_portable_json(obj: Any) -> None:
    """Raise ValueError unless ``obj`` serialises to JSON that every reader decodes: JSON types,
    finite numbers, valid Unicode (a lone surrogate is stored by ``json.dumps`` but fails as UTF-8)."""
    try:
        json.dumps(obj, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as e:  # UnicodeEncodeError is a ValueError
        raise ValueError(str(e)) from e


def _depth(obj: Any) -> int:
    """How many containers deep ``obj`` is (0 for a scalar), walked without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        cur, d = stack.pop()
        if isinstance(cur, dict):
            children: Any = cur.values()
        elif isinstance(cur, (list, tuple)):
            children = cur
        else:
            continue
        deepest = max(deepest, d)
        if d > MAX_META_DEPTH:  # deep enough to refuse: no need to walk the rest
            return d
        stack.extend((c, d + 1) for c in children)
    return deepest


def check_meta(meta: Any) -> None:
    """Raise ValueError unless ``meta`` is a JSON object a registration may carry: portable JSON
    (:func:`check_portable_json`), at most :data:`MAX_META_DEPTH` containers deep and
    :data:`MAX_META_BYTES` bytes as compact UTF-8 JSON. The message says which limit and by how much."""
    if not isinstance(meta, dict):
        raise ValueError(f"meta must be a JSON object, not {type(meta).__name__}")
    depth = _depth(meta)
    if depth > MAX_META_DEPTH:
        raise ValueError(f"meta is nested more than {MAX_META_DEPTH} levels deep (at least {depth})")
    check_portable_json(meta)
    size = len(json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    if size > MAX_META_BYTES:
        raise ValueError(f"meta is {size} bytes as JSON, more than {MAX_META_BYTES}")


def hot_name(stage: int, iteration: int) -> str:
    """The name of a registration in a hot index."""
    return f"ckpt/stage{stage:05d}/{iteration:012d}"


def cold_name(run: str, stage: int, iteration: int) -> str:
    """The name of a registration among the cold tier's documents."""
    return f"{run}/checkpoints/stage{stage:05d}/{iteration:012d}.json"


def parse_hot_name(name: str) -> tuple[int, int] | None:
    """(stage, iteration) of a hot index's registration name; None for another name."""
    m = _HOT_RE.match(name)
    return None if m is None else (int(m["stage"]), int(m["it"]))


def parse_cold_name(name: str) -> tuple[int, int] | None:
    """(stage, iteration) of a cold registration document's name; None for another name."""
    m = _COLD_RE.match(name)
    return None if m is None else (int(m["stage"]), int(m["it"]))


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_doc(where: str, named: tuple[int, int] | None, doc: Any) -> tuple[CheckpointInfo, list[str]]:
    """The registration ``doc`` stored under a name meaning ``named`` (stage, iteration), and the
    fields it has that this version does not know (ignored). ``where`` names the document in
    errors. Raises CorruptRecordError (key ``where``) for a name that is not a registration's,
    a document that is not an object, a stage or iteration that is not a non-negative integer
    or disagrees with the name, a ``uri`` that is not a string, or a ``registered_at`` that is
    not a number. A ``meta`` that is not an acceptable object (:func:`check_meta`) is replaced
    by ``{"unreadable_meta": why}``: the registration itself stands."""

    def corrupt(why: str) -> CorruptRecordError:
        return CorruptRecordError(
            f"checkpoint registration {where}: {why}; it is left out (no watermark comes from it)",
            key=where,
            hint="register the checkpoint again, or unregister it (swiftlog unregister)",
        )

    if named is None:
        raise corrupt("the name is not a registration's (stage{5 digits}/{12 digits})")
    if not isinstance(doc, dict):
        raise corrupt(f"not a JSON object but {type(doc).__name__}")
    stage, iteration = doc.get("stage"), doc.get("iteration")
    if not _int(stage) or not _int(iteration) or stage < 0 or iteration < 0:
        raise corrupt(f"stage {stage!r} and iteration {iteration!r} must be integers >= 0")
    if (stage, iteration) != named:
        raise corrupt(
            f"its content says stage {stage} iteration {iteration}, its name stage {named[0]} iteration {named[1]}"
        )
    uri = doc.get("uri")
    if uri is not None and not isinstance(uri, str):
        raise corrupt(f"uri {uri!r} is not a string")
    at = doc.get("registered_at", 0.0)
    if not isinstance(at, (int, float)) or isinstance(at, bool):
        raise corrupt(f"registered_at {at!r} is not a number")
    meta = doc.get("meta", {})
    try:
        check_meta(meta)
    except ValueError as e:
        meta = {"unreadable_meta": str(e)}
    return CheckpointInfo(stage, iteration, uri, float(at), meta), sorted(k for k in doc if k not in _FIELDS)
