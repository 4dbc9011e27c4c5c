"""The logging-group planner: the exact dynamic program against brute force, the SWIFT greedy
against the exact answer, budgets, replicas, failure domains and the errors a user sees."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.errors import BudgetTooSmallError
from replay.group_planner import GroupCosts, greedy_groups, least_storage, optimal_groups, plan_groups
from replay.profile import JobProfile


def profile(
    S: int = 4,
    act: list[float] | None = None,
    grad: list[float] | None = None,
    replay_s: list[float] | None = None,
    domains: list[int] | None = None,
    replicated: list[bool] | None = None,
    interval: int = 100,
) -> JobProfile:
    return JobProfile(
        run_id="r",
        num_stages=S,
        activation_bytes=act or [1e6] * (S - 1),
        gradient_bytes=grad or [1e6] * (S - 1),
        replay_s=replay_s or [0.1] * S,
        step_s=[0.2] * S,
        iteration_s=0.2,
        checkpoint_interval=interval,
        fetch_mbps=500.0,
        n_microbatches=4,
        domains=domains or list(range(S)),
        replicated=replicated or [False] * S,
    )


def compositions(S: int) -> list[tuple[int, ...]]:
    """Every grouping of S stages (2^(S-1) of them)."""
    out = []
    for cuts in itertools.product([False, True], repeat=S - 1):
        sizes, n = [], 1
        for c in cuts:
            if c:
                sizes.append(n)
                n = 1
            else:
                n += 1
        out.append((*sizes, n))
    return out


@st.composite
def profiles(draw: st.DrawFn) -> JobProfile:
    S = draw(st.integers(2, 7))
    size = st.floats(0, 1e7, allow_nan=False)
    per_domain = draw(st.integers(1, 3))
    return profile(
        S,
        act=draw(st.lists(size, min_size=S - 1, max_size=S - 1)),
        grad=draw(st.lists(size, min_size=S - 1, max_size=S - 1)),
        replay_s=draw(st.lists(st.floats(0.001, 2.0), min_size=S, max_size=S)),
        domains=[k // per_domain for k in range(S)],
        replicated=draw(st.lists(st.booleans(), min_size=S, max_size=S)),
        interval=draw(st.integers(2, 500)),
    )


@settings(max_examples=150, deadline=None)
@given(profiles(), st.floats(0, 1.2), st.sampled_from(["kill", "in_place"]))
def test_the_dynamic_program_finds_what_brute_force_finds(p: JobProfile, fraction: float, mode: str) -> None:
    costs = GroupCosts(p, recovery=mode)
    budget = fraction * costs.evaluate((1,) * p.num_stages)[0]
    feasible = [s for s in compositions(p.num_stages) if len(s) >= 2 and costs.evaluate(s)[0] <= budget]
    got = optimal_groups(costs, budget)
    if not feasible:
        assert got is None
        return
    assert got is not None
    best = min(costs.evaluate(s)[1] for s in feasible)
    stored, cost = costs.evaluate(got)
    assert stored <= budget
    assert cost == pytest.approx(best, rel=1e-9, abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(profiles(), st.floats(0, 1.2))
def test_the_greedy_is_never_better_than_the_exact_answer(p: JobProfile, fraction: float) -> None:
    costs = GroupCosts(p)
    budget = fraction * costs.evaluate((1,) * p.num_stages)[0]
    exact = optimal_groups(costs, budget, min_groups=1)
    greedy = greedy_groups(costs, budget)
    assert exact is not None  # one group logs nothing: always fits
    g_bytes, g_cost = costs.evaluate(greedy)
    assert g_bytes <= budget or len(greedy) == 1
    assert g_cost >= costs.evaluate(exact)[1] * (1 - 1e-9)


def test_the_greedy_can_be_far_worse_and_the_plan_reports_its_gap() -> None:
    # merging the pair with the least added time per byte saved drops the cheap cut after stage 1
    # too early: the greedy ends with one group, the exact answer keeps two cuts within the budget
    sizes = [5e6, 2e6, 9e6, 5e6]
    p = profile(5, act=sizes, grad=sizes, replay_s=[0.5, 0.1, 0.1, 1.0, 1.0], interval=10)
    plan = plan_groups(p, budget_fraction=0.4)
    assert plan.sizes == (2, 2, 1) and plan.stored_bytes <= plan.budget_bytes
    assert plan.greedy["sizes"] == [5] and plan.greedy["gap"] > 1.0
    for f in (0.2, 0.3, 0.5, 0.8):
        other = plan_groups(p, budget_fraction=f)
        assert other.greedy["gap"] >= 0 and other.stored_bytes <= other.budget_bytes
    json.dumps(plan.to_dict(), allow_nan=False)  # what --json prints


def test_more_budget_never_costs_more_recovery() -> None:
    p = profile(6, act=[3e6, 1e6, 2e6, 5e6, 1e6], replay_s=[0.1, 0.3, 0.2, 0.2, 0.4, 0.1])
    costs = [plan_groups(p, budget_fraction=f).expected_recovery_s_per_hour for f in (0.2, 0.4, 0.6, 0.8, 1.0)]
    assert costs == sorted(costs, reverse=True)
    assert plan_groups(p, budget_fraction=1.0).sizes == (1,) * 6  # everything logged: the fastest


def test_a_budget_too_small_for_any_grouping_says_what_it_would_need() -> None:
    p = profile(4, act=[1e6, 2e5, 1e6], grad=[1e6, 2e5, 1e6], interval=50)
    with pytest.raises(BudgetTooSmallError) as e:
        plan_groups(p, budget_bytes=1e6)
    need = 50 * 4e5  # the cheapest cut: after stage 1
    assert e.value.needed_bytes == pytest.approx(need)
    assert "[2, 2]" in str(e.value) and "2e+07" in str(e.value)
    assert plan_groups(p, budget_bytes=need).sizes == (2, 2)


def test_a_recovery_time_cap_needs_more_cuts_and_says_how_much_storage() -> None:
    p = profile(4, replay_s=[1.0] * 4, interval=100)  # one stage replays 50 s, a pair 100 s (kill)
    with pytest.raises(BudgetTooSmallError) as e:
        plan_groups(p, budget_bytes=3e8, max_recovery_s=60)
    assert e.value.needed_bytes == pytest.approx(100 * 2e6 * 3)  # every boundary logged
    assert plan_groups(p, budget_bytes=6e8, max_recovery_s=60).sizes == (1, 1, 1, 1)
    least = least_storage(GroupCosts(p, max_recovery_s=120))
    assert least is not None and least[0] == pytest.approx(100 * 2e6)


def test_stages_with_replicas_need_no_logs_and_cuts_inside_a_domain_are_useless() -> None:
    # stages 0 and 1 replicated: their failures are copies, but a group holding stage 2 would
    # replay them too: the one cut the budget allows goes right before stage 2
    p = profile(4, replay_s=[1.0, 1.0, 0.1, 0.1], replicated=[True, True, False, False])
    plan = plan_groups(p, budget_fraction=0.34)
    assert plan.sizes == (2, 2) and plan.recovery_s[0] > plan.recovery_s[1], plan
    everywhere = profile(4, replicated=[True] * 4)  # every failure is a copy: no grouping costs anything
    assert GroupCosts(everywhere).evaluate((4,)) == (0.0, 0.0)
    # two stages per node: a cut inside a node logs without shortening any node's recovery
    q = profile(4, domains=[0, 0, 1, 1])
    assert plan_groups(q, budget_fraction=0.34).sizes == (2, 2)


def test_in_place_group_recovery_favours_bigger_groups_than_kill_and_replay() -> None:
    p = profile(4, replay_s=[0.5] * 4)
    kill = GroupCosts(p, recovery="kill").recovery_s(0, 3)
    in_place = GroupCosts(p, recovery="in_place").recovery_s(0, 3)
    assert in_place < kill  # (4 + 3) / 4 x 0.5 per iteration vs 4 x 0.5


def test_stages_sharing_a_machine_recover_no_faster_than_its_slots() -> None:
    p = profile(4, replay_s=[0.5] * 4)
    shared = JobProfile.from_dict({**p.to_dict(), "compute_slots": 2})
    lost = p.checkpoint_interval / 2
    own = GroupCosts(p, recovery="in_place").recovery_s(0, 3) - p.restart_s
    assert own == pytest.approx(lost * 0.5 * (4 + 3) / 4)  # the pipeline's bound
    in_place = GroupCosts(shared, recovery="in_place").recovery_s(0, 3) - p.restart_s
    assert in_place == pytest.approx(lost * 4 * 0.5 / 2)  # 4 members' work on 2 slots
    kill = GroupCosts(shared, recovery="kill").recovery_s(0, 3) - p.restart_s
    assert kill == pytest.approx(lost * 4 * 4 * 0.5 / 2)  # 4 replacements, each the whole group
    with pytest.raises(ValueError, match="compute_slots"):
        JobProfile.from_dict({**p.to_dict(), "compute_slots": 0})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one budget"),
        ({"budget_bytes": 1.0, "budget_fraction": 0.5}, "exactly one budget"),
        ({"budget_bytes": -1.0}, "budget_bytes must be >= 0"),
        ({"disk_fraction": 0.5}, "disk_bytes"),
        ({"budget_bytes": 1e9, "recovery": "teleport"}, "recovery must be one of"),
        ({"budget_bytes": 1e9, "failures_per_domain_hour": 0}, "failures_per_domain_hour"),
    ],
)
def test_bad_planner_inputs_name_what_is_wrong(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_groups(profile(), **kwargs)


def test_a_disk_share_is_a_budget_per_domain() -> None:
    p = profile(4, act=[4e6, 1e6, 1e6], grad=[1e6, 1e6, 1e6], interval=100)
    plan = plan_groups(p, disk_fraction=0.01, disk_bytes=1e11)  # 1 GB per domain, 4 GB in all
    assert plan.budget_bytes == pytest.approx(4e9)
    assert plan.sizes == (1, 1, 1, 1) and plan.warnings == []
    tight = plan_groups(p, disk_fraction=0.001, disk_bytes=3e11)  # 300 MB per domain
    assert tight.stored_bytes <= tight.budget_bytes
    over = [d for d, b in tight.domain_bytes.items() if b > 3e8]
    assert len(tight.warnings) == len(over)


def test_profiles_round_trip_and_refuse_bad_documents() -> None:
    from logstore.errors import ConfigError

    p = profile(3)
    assert JobProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    with pytest.raises(ConfigError, match="unknown profile field"):
        JobProfile.from_dict({**p.to_dict(), "bogus": 1})
    with pytest.raises(ConfigError, match="activation_bytes needs 2 entries"):
        JobProfile.from_dict({**p.to_dict(), "activation_bytes": [1.0]})
    with pytest.raises(ConfigError, match="must be numbers >= 0"):
        JobProfile.from_dict({**p.to_dict(), "replay_s": [0.1, -1, 0.1]})
