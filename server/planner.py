"""The pluggable recovery planner: found by name, called with the run's store.

The planner is ``"module:function"`` (default ``replay.plan:plan_recovery``), imported on first
use, and called as ``function(store=<logstore.LogStore of the run>, failed_stages=[...])``. It
returns anything JSON-able: a dict, a dataclass, a pydantic model, or an object with
``to_dict()``. Until the module exists, every caller gets :class:`NotAvailableError` saying so
(HTTP 501, CLI exit 4).

Never: installs anything, or hides an import error raised *inside* an existing planner module
(that is a bug in the planner and is reported as one).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from server.errors import NotAvailableError

__all__ = ["DEFAULT_PLANNER", "load_planner", "to_jsonable"]

DEFAULT_PLANNER = "replay.plan:plan_recovery"
NOT_AVAILABLE = "the recovery planner cannot be loaded"


def load_planner(spec: str = DEFAULT_PLANNER) -> Callable[..., Any]:
    """The planner function named by ``spec``; raises NotAvailableError while its module is absent."""
    mod_name, _, fn_name = spec.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing and (mod_name == missing or mod_name.startswith(missing + ".")):
            raise NotAvailableError(
                f"{NOT_AVAILABLE} (module {mod_name!r} is not installed)",
                hint="check --planner / SWIFTLOG_PLANNER "
                "(module:function; the default is replay.plan:plan_recovery, installed with swiftlog)",
            ) from None
        raise
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise NotAvailableError(f"{NOT_AVAILABLE} ({mod_name!r} has no function {fn_name!r})")
    return fn


def to_jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON types (dataclasses, pydantic models, ``to_dict()``, sets, tuples...)."""
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return to_jsonable(obj.to_dict())
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    return str(obj)
