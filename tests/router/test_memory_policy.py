"""Memory policies as pure functions: a frozen view of the models in, a plan out (no router)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mox.errors import MoxError
from mox.messages import ModelState
from mox.router.memory_policy import (
    TURN_S,
    ColdStart,
    MemoryPlan,
    MemoryView,
    ModelView,
    make_memory_policy,
)
from mox.router.planner import run_slots

DENSE, EXPERT, TOP_K, LAYERS, EXPERTS = 1000, 100, 2, 2, 8
ALL = LAYERS * EXPERTS                      # every expert of a model: 16 slots


# H(S) of a model whose accesses reuse TOP_K experts: its run size is TOP_K slots
STEEP = np.minimum(1.0, np.arange(ALL + 1) / TOP_K)
# ... and of one with no locality (uniform accesses): it runs well only with nearly every
# expert (15 of 16: a quarter of an extra miss a token at TOP_K x LAYERS accesses a token)
UNIFORM = np.linspace(0.0, 1.0, ALL + 1)


def model(name: str, state: ModelState = ModelState.WARM, *, busy: bool = False,
          rate: float = 0.0, last_active: float = 0.0, arrival: float = float("inf"),
          slots: int = 0, curve: np.ndarray = STEEP, history: float = 100.0 * ALL,
          loaded_at: float = 0.0) -> ModelView:
    return ModelView(name, state, DENSE, EXPERT, TOP_K, ALL, slots, busy, rate, last_active,
                     arrival, LAYERS, curve, accesses_per_request=10.0,
                     run_slots=run_slots(curve, history, TOP_K * LAYERS),
                     loaded_at=loaded_at)


def view(budget: int | None, *models: ModelView, now: float = 0.0) -> MemoryView:
    return MemoryView(budget, models, now)


def admit_and_plan(policy: str, v: MemoryView) -> MemoryPlan:
    """What the router applies while cold models wait: admission, then the slots of the view
    as admission leaves it."""
    memory = make_memory_policy(policy)
    admitted = memory.admit(v)
    return MemoryPlan(memory.plan_slots(admitted.view), admitted.park, admitted.load)


def plan_bytes(plan, v: MemoryView) -> int:
    """Device bytes the plan holds: dense weights of the models that hold memory after it
    (warm or loading, minus the parked, plus the loads) and every slot."""
    holding = {m.name for m in v.models if m.holds_device_memory} - set(plan.park)
    holding |= set(plan.load)
    return DENSE * len(holding) + EXPERT * sum(plan.slots.values())


def test_rate_admits_a_cold_model_by_parking_the_least_requested_idle_one():
    v = view(2 * DENSE + 10 * EXPERT,
             model("hot", busy=True, rate=2.0, slots=8),
             model("idle-busier", rate=0.5, slots=2, last_active=1.0),
             model("idle-quiet", rate=0.1, slots=2, last_active=5.0),
             model("cold", ModelState.COLD, busy=True, arrival=3.0))
    plan = admit_and_plan("rate", v)
    # two dense models fit beside "hot" only after both idle ones leave: the quiet one first
    assert plan.park == ("idle-quiet", "idle-busier") and plan.load == ("cold",)
    assert plan.slots["idle-quiet"] == plan.slots["idle-busier"] == 0
    assert plan.slots["hot"] >= TOP_K and plan.slots["cold"] >= TOP_K
    assert plan_bytes(plan, v) <= v.budget_bytes


@pytest.mark.parametrize("policy, held", [("rate", 4), ("model-swap", ALL)])
def test_a_cold_model_waits_while_only_busy_models_hold_the_memory(policy, held):
    v = view(2 * (DENSE + held * EXPERT),
             model("a", busy=True, rate=1.0, slots=held),
             model("b", busy=True, rate=1.0, slots=held),
             model("cold", ModelState.COLD, busy=True, arrival=1.0))
    result = admit_and_plan(policy, v)
    assert result.load == () and result.park == () and result.slots["cold"] == 0


def test_rate_admits_a_busy_model_only_at_its_run_size():
    budget = 2 * DENSE + 20 * EXPERT
    busy = model("busy", busy=True, rate=1.0, slots=ALL, curve=UNIFORM)
    for curve, history, admitted in ((STEEP, 100.0 * ALL, True),     # knee at top_k slots
                                     (UNIFORM, 100.0 * ALL, False),  # needs 15 of 16
                                     (STEEP, 1.0, False)):           # unknown yet: all 16
        cold = model("cold", ModelState.COLD, busy=True, arrival=0.0, curve=curve,
                     history=history)
        plan = admit_and_plan("rate", view(budget, busy, cold))
        assert plan.load == (("cold",) if admitted else ())
        # the busy model keeps its run size either way: no slot is taken from under it
        assert plan.slots["busy"] == ALL


def test_rate_drains_the_longest_held_busy_model_for_a_model_that_waited_a_turn():
    budget = 2 * DENSE + 2 * ALL * EXPERT
    busy = [model(name, busy=True, rate=1.0, slots=ALL, curve=UNIFORM, loaded_at=t)
            for name, t in (("first", 0.0), ("second", 2.0))]
    cold = model("cold", ModelState.COLD, busy=True, arrival=3.0, curve=UNIFORM)
    policy = make_memory_policy("rate")
    assert policy.drain(view(budget, *busy, cold, now=3.0 + TURN_S / 2)) is None   # not yet
    assert policy.drain(view(budget, *busy, cold, now=3.0 + TURN_S)) == "first"
    draining = dataclasses.replace(busy[0], draining=True)
    assert policy.drain(view(budget, draining, busy[1], cold, now=10.0)) is None  # one at a time
    fresh = [dataclasses.replace(m, loaded_at=9.0) for m in busy]   # their turns just began
    assert policy.drain(view(budget, *fresh, cold, now=10.0)) is None
    assert make_memory_policy("model-swap").drain(view(budget, *busy, cold, now=60.0)) is None


def test_a_run_size_larger_than_the_budget_runs_in_what_the_budget_holds():
    v = view(DENSE + 10 * EXPERT, model("only", ModelState.COLD, busy=True, arrival=0.0,
                                        curve=UNIFORM))
    plan = admit_and_plan("rate", v)
    assert plan.load == ("only",) and plan.slots["only"] == 10


def test_cold_models_are_admitted_oldest_request_first():
    v = view(2 * DENSE + 4 * EXPERT,
             model("late", ModelState.COLD, busy=True, arrival=9.0),
             model("early", ModelState.COLD, busy=True, arrival=1.0),
             model("idle-cold", ModelState.COLD))
    plan = admit_and_plan("rate", v)
    assert plan.load == ("early", "late") and plan.slots["idle-cold"] == 0
    assert plan_bytes(plan, v) <= v.budget_bytes


def test_model_swap_loads_whole_models_and_parks_the_least_recently_used():
    v = view(2 * (DENSE + ALL * EXPERT),
             model("recent", rate=0.0, last_active=9.0, slots=ALL),
             model("old", rate=5.0, last_active=1.0, slots=ALL),
             model("cold", ModelState.COLD, busy=True, arrival=10.0))
    plan = admit_and_plan("model-swap", v)
    assert plan.park == ("old",) and plan.load == ("cold",)         # LRU, whatever the rate
    assert plan.slots == {"recent": ALL, "old": 0, "cold": ALL}


def test_equal_split_gives_every_model_the_same_share_and_parks_nothing():
    v = view(3 * DENSE + 15 * EXPERT, model("a", busy=True), model("b"),
             model("cold", ModelState.COLD, busy=True, arrival=1.0))
    plan = admit_and_plan("lru", v)
    assert plan.park == () and plan.load == ("cold",)
    assert plan.slots == {"a": 5, "b": 5, "cold": 5}


def test_all_resident_ignores_the_budget():
    v = view(1, model("a"), model("b", ModelState.COLD))
    make_memory_policy("all-resident").check_fits(v, "a")
    assert admit_and_plan("all-resident", v).slots == {"a": ALL, "b": 0}


@pytest.mark.parametrize("policy, budget, match", [
    ("rate", DENSE + EXPERT, "needs 1200 bytes"),
    ("model-swap", DENSE + 10 * EXPERT, "whole checkpoint"),
    ("lru", 2 * DENSE + 3 * EXPERT, "equal split"),
])
def test_a_budget_that_can_never_run_a_model_is_refused(policy, budget, match):
    v = view(budget, model("a"), model("b"))
    with pytest.raises(MoxError, match=match):
        make_memory_policy(policy).check_fits(v, "a")


def test_cold_start_says_whether_a_request_would_wait_and_what_it_would_park():
    # "uniform" runs well only with nearly all 16 experts: one run size fits the budget
    budget = 2 * DENSE + ALL * EXPERT
    cold = model("cold", ModelState.COLD, curve=UNIFORM)
    rate = make_memory_policy("rate")
    assert rate.cold_start(view(budget, cold), "cold") == ColdStart()
    # an idle model at its minimum leaves no room: it is parked (its next request reads it
    # again)
    idle = model("idle", curve=UNIFORM, slots=ALL, rate=1.0)
    assert rate.cold_start(view(budget, idle, cold), "cold") == ColdStart(parks=("idle",))
    # a busy model holds its run size: the request waits for its turn
    busy = dataclasses.replace(idle, has_work=True)
    assert rate.cold_start(view(budget, busy, cold), "cold") == ColdStart(waits=True)
    # ... unless the budget holds both run sizes
    assert rate.cold_start(view(2 * budget, busy, cold), "cold") == ColdStart()
    # room for the idle model's minimum beside the run size, not for its whole pool: the
    # start shrinks that pool by what it takes beyond the free room
    roomier = budget + ALL // 2 * EXPERT
    squeezed = rate.cold_start(view(roomier, idle, cold), "cold")
    need = rate.admission_bytes(dataclasses.replace(cold, has_work=True), roomier)
    short = DENSE + ALL * EXPERT + need - roomier
    assert squeezed == ColdStart(squeezes={"idle": short / (ALL * EXPERT)})
    assert 0 < short < ALL * EXPERT
    # the outlook is admission's: the same view with the request counted admits it or not
    for v in (view(budget, idle, cold), view(budget, busy, cold)):
        waiting = dataclasses.replace(v.models[-1], has_work=True, oldest_arrival=0.0)
        counted = view(budget, *v.models[:-1], waiting)
        assert bool(rate.admit(counted).load) == (not rate.cold_start(v, "cold").waits)
    # ... so a request waits behind a cold model waiting already, though it would fit alone
    small = model("small", ModelState.COLD, curve=STEEP)
    waiter = dataclasses.replace(cold, has_work=True, oldest_arrival=0.0)
    assert rate.cold_start(view(roomier, busy, small), "small") == ColdStart()
    assert rate.cold_start(view(roomier, busy, waiter, small), "small") == ColdStart(waits=True)
