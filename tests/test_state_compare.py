"""The state comparisons that the recovery and replay tests trust, shown to find each kind of difference.

A recovery test passes when a comparison reports nothing. So every comparison here is given two
stage states that differ in one place (a bit, a dtype, a key, a learning rate, the scheduler)
and must name that place. States that are the same bit for bit (a NaN where the other has the
same NaN, a non-contiguous copy) must report nothing.

Never: a comparison by value (``torch.equal`` takes -0.0 for 0.0 and a float32 for a bfloat16
of the same values, and a NaN for a difference).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from replay.compare import states_equal
from replay.stage import StageState
from tests._client_mp import state_differences
from tests._replay_helpers import checkpoint_vs_live, state_bytes_differ
from trainer_client import Checkpoint

State = dict[str, Any]


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(mod.parameters(), lr=0.01, betas=(0.9, 0.99), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return mod, opt, sched


def _trained() -> State:
    """A stage's state after two steps: parameters with a 0.0, BatchNorm buffers, AdamW state, a scheduler."""
    mod, opt, sched = _objects()
    for _ in range(2):
        mod(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    s = {
        "model": copy.deepcopy(mod.state_dict()),
        "optimizer": copy.deepcopy(opt.state_dict()),
        "lr_scheduler": copy.deepcopy(sched.state_dict()),
        "iters": 2,
    }
    s["model"]["0.weight"][0, 0] = 0.0
    s["optimizer"]["state"][1]["exp_avg"][0] = 0.0
    return s


def _flip_last_bit(t: torch.Tensor) -> None:
    t.view(torch.int32).view(-1)[1] ^= 1


def _negative_zero(s: State) -> None:
    s["model"]["0.weight"][0, 0] = -0.0


def _other_dtype(s: State) -> None:
    s["model"]["0.bias"] = s["model"]["0.bias"].double()  # the same values


def _other_shape(s: State) -> None:
    s["model"]["0.weight"] = s["model"]["0.weight"].reshape(-1)  # the same bytes


def _param_gone(s: State) -> None:
    del s["model"]["0.bias"]


def _param_added(s: State) -> None:
    s["model"]["extra"] = torch.zeros(1)


def _buffer_count(s: State) -> None:
    s["model"]["1.num_batches_tracked"] += 1


def _opt_negative_zero(s: State) -> None:
    s["optimizer"]["state"][1]["exp_avg"][0] = -0.0


def _opt_state_key_gone(s: State) -> None:
    del s["optimizer"]["state"][0]["exp_avg_sq"]


def _opt_state_gone(s: State) -> None:
    del s["optimizer"]["state"][3]


def _opt_step(s: State) -> None:
    s["optimizer"]["state"][0]["step"] += 1


def _lr(s: State) -> None:
    s["optimizer"]["param_groups"][0]["lr"] *= 1 + 2**-40


def _weight_decay_negative_zero(s: State) -> None:
    s["optimizer"]["param_groups"][0]["weight_decay"] = -0.0  # == 0.0 as a value


def _betas(s: State) -> None:
    s["optimizer"]["param_groups"][0]["betas"] = (0.9, 0.999)


def _group_key_added(s: State) -> None:
    s["optimizer"]["param_groups"][0]["momentum"] = 0.9


def _no_optimizer(s: State) -> None:
    s["optimizer"] = None


def _sched_epoch(s: State) -> None:
    s["lr_scheduler"]["last_epoch"] += 1


def _sched_last_lr(s: State) -> None:
    s["lr_scheduler"]["_last_lr"] = [s["lr_scheduler"]["_last_lr"][0] * 2]


def _bit_of(path: Callable[[State], torch.Tensor]) -> Callable[[State], None]:
    return lambda s: _flip_last_bit(path(s))


#: one difference each: (name, where it is, mutation of one state)
DIFFERENCES: list[tuple[str, str, Callable[[State], None]]] = [
    ("a parameter's last bit", "model", _bit_of(lambda s: s["model"]["0.weight"])),
    ("-0.0 for 0.0 in a parameter", "model", _negative_zero),
    ("a parameter's dtype (same values)", "model", _other_dtype),
    ("a parameter's shape (same bytes)", "model", _other_shape),
    ("a parameter in one only", "model", _param_gone),
    ("a parameter in the other only", "model", _param_added),
    ("a buffer's bit", "model", _bit_of(lambda s: s["model"]["1.running_var"])),
    ("an integer buffer", "model", _buffer_count),
    ("an optimizer moment's bit", "optimizer", _bit_of(lambda s: s["optimizer"]["state"][2]["exp_avg_sq"])),
    ("-0.0 for 0.0 in an optimizer moment", "optimizer", _opt_negative_zero),
    ("an optimizer step count", "optimizer", _opt_step),
    ("an optimizer state key in one only", "optimizer", _opt_state_key_gone),
    ("a parameter's optimizer state in one only", "optimizer", _opt_state_gone),
    ("a learning rate's last bits", "optimizer", _lr),
    ("-0.0 for 0.0 in a param group", "optimizer", _weight_decay_negative_zero),
    ("the betas of a param group", "optimizer", _betas),
    ("a param group key in one only", "optimizer", _group_key_added),
    ("no optimizer state in one", "optimizer", _no_optimizer),
    ("the scheduler's epoch", "lr_scheduler", _sched_epoch),
    ("the scheduler's last rates", "lr_scheduler", _sched_last_lr),
]


def _stage_state(s: State) -> StageState:
    mod, opt, sched = _objects()
    mod.load_state_dict(s["model"])
    opt.load_state_dict(copy.deepcopy(s["optimizer"]))
    sched.load_state_dict(s["lr_scheduler"])
    return StageState(0, mod, opt, sched)


def _checkpoint(s: State) -> Checkpoint:
    return Checkpoint("r", 0, 1, s["iters"], 0, s["model"], s["optimizer"], s["lr_scheduler"])


#: every comparison under test, as f(a, b) -> the differences it names; and the parts it compares
ALL = {"model", "optimizer", "lr_scheduler"}
COMPARISONS: dict[str, tuple[Callable[[State, State], list[str]], set[str]]] = {
    "states_equal": (states_equal, ALL),
    "states_equal, swapped": (lambda a, b: states_equal(b, a), ALL),
    "state_bytes_differ": (
        lambda a, b: state_bytes_differ(a["model"], a["optimizer"], b["model"], b["optimizer"]),
        {"model", "optimizer"},
    ),
    "state_differences": (lambda a, b: state_differences(_stage_state(a), b), ALL),
    "checkpoint_vs_live": (lambda a, b: checkpoint_vs_live(_checkpoint(a), b), ALL),
}

#: (comparison, difference) for every difference in a part the comparison takes (state_bytes_differ takes no scheduler)
CASES = [
    pytest.param(c, what, change, id=f"{c}: {what}")
    for c, (_, parts) in COMPARISONS.items()
    for what, part, change in DIFFERENCES
    if part in parts
]


@pytest.mark.parametrize(("comparison", "what", "change"), CASES)
def test_each_comparison_reports_each_difference(comparison: str, what: str, change: Callable[[State], None]) -> None:
    compare, _ = COMPARISONS[comparison]
    a = _trained()
    b = copy.deepcopy(a)
    change(b)
    assert compare(a, copy.deepcopy(a)) == []
    found = compare(a, b)
    assert found, f"{comparison} found no difference in {what}"


@pytest.mark.parametrize("comparison", COMPARISONS)
def test_states_the_same_bit_for_bit_have_no_difference(comparison: str) -> None:
    """The same NaN on both sides, and a non-contiguous tensor beside a contiguous copy, are the same bytes."""
    compare, _ = COMPARISONS[comparison]
    a = _trained()
    a["model"]["0.weight"][1, 1] = float("nan")
    a["optimizer"]["state"][0]["exp_avg"].view(-1)[0] = float("nan")
    b = copy.deepcopy(a)
    a["model"]["0.weight"] = a["model"]["0.weight"].t().contiguous().t()  # column-major, the same values
    assert not a["model"]["0.weight"].is_contiguous()
    assert compare(a, b) == []


def test_a_difference_is_named_where_it_is() -> None:
    """The report says which tensor or field differs and how, so a failing recovery test points at it."""
    a = _trained()
    b = copy.deepcopy(a)
    _negative_zero(b)
    _other_dtype(b)
    _opt_state_key_gone(b)
    _lr(b)
    _sched_epoch(b)
    found = states_equal(a, b)
    assert len(found) == 5, found
    text = "\n".join(found)
    for where in ("'0.weight'", "'0.bias'", "float32", "float64", "'exp_avg_sq'", "'lr'", "'last_epoch'"):
        assert where in text, (where, found)
