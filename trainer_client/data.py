"""Deterministic data sources: the batch of an iteration, the same every time it is asked for.

A training script may give the client such a source instead of logging stage 0's inputs and the
last stage's targets (``ClientConfig(log_data=False)``); a replay is then given the same source.

Never: copies a tensor that is already on the device asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["DataSource", "data_inputs", "on_device"]

#: A deterministic, iteration-addressable data source: ``source(iteration) -> (inputs, target)``
#: with ``inputs`` the whole batch of stage 0: a tensor, a tuple of tensors (positional inputs), a
#: dict of tensors (keyword inputs), or a tuple whose last item is such a dict (both; see
#: :func:`data_inputs`), and ``target`` the whole batch of targets of the last stage (or None).
#: Same iteration, same tensors, every time.
DataSource = Callable[[int], tuple[Any, Any]]


def data_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A :data:`DataSource` batch's inputs as (positional, keyword): a dict is keyword inputs, a
    tuple / list ending in a dict is positional inputs then keyword ones, anything else positional."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        if inputs and isinstance(inputs[-1], Mapping):
            return tuple(inputs[:-1]), dict(inputs[-1])
        return tuple(inputs), {}
    return (inputs,), {}


def on_device(x: Any, device: torch.device) -> Any:
    """``x`` (a tensor, or a tuple/list/dict of tensors and other values, e.g. a DataSource batch)
    with its tensors on ``device``. Tensors already there are returned as they are (never copied)."""
    if isinstance(x, torch.Tensor):
        return x if x.device == device else x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(on_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: on_device(v, device) for k, v in x.items()}
    return x
