"""The planner (pure) and the traffic statistics it plans from."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mox.pager.usage import ExpertUsage
from mox.router.planner import (
    HYSTERESIS,
    RESIZE_MIN_INTERVAL_S,
    RUN_EXTRA_MISSES_PER_TOKEN,
    RUN_SLOWDOWN,
    ModelDemand,
    Plan,
    plan_slots,
    run_extra_misses,
    run_slots,
    settle,
)
from mox.router.rates import DecayedRate, ModelTraffic

NBYTES = 1000


ACCESSES_PER_REQUEST, MISS_COST_S = 10.0, 1e-3


def popularity_curve(layers=2, experts=8, skew=1.0) -> np.ndarray:
    """H(S) of a pool that keeps the S most used experts, with popularity falling as
    rank^-skew within each layer: a concave curve."""
    p = np.sort(np.tile(np.arange(experts, 0, -1) ** skew, layers))[::-1]
    return np.concatenate([[0.0], np.cumsum(p) / p.sum()])


def scan_curve(num_slots=16) -> np.ndarray:
    """A cyclic scan over every expert: nothing hits until everything fits."""
    return np.concatenate([np.zeros(num_slots), [1.0]])


def _demand(name, rate, has_work=True, layers=2, experts=8, top_k=2, current=0, skew=1.0,
            resized_ago_s=float("inf"), curve=None, priority=1.0, pinned=False, run=0):
    curve = popularity_curve(layers, experts, skew) if curve is None else curve
    return ModelDemand(name, rate, has_work, curve, ACCESSES_PER_REQUEST, MISS_COST_S, NBYTES,
                       top_k, layers, current, resized_ago_s, priority, pinned, run)


def test_the_run_size_is_the_knee_of_the_curve_or_everything_while_unknown():
    # 16 slots; a cliff at 10 (H(9) = 0.45, H(10) = 0.96, H(16) = 0.98); 4 accesses a token
    knee = np.concatenate([0.05 * np.arange(10), np.linspace(0.96, 0.98, 7)])
    extra = RUN_EXTRA_MISSES_PER_TOKEN / 4                   # the miss rate that bound allows
    assert 1 - 0.96 < extra < 1 - 0.45
    assert run_slots(knee, 1000.0, 4) == 10                  # the cliff: the rest adds 0.02
    assert run_slots(knee, 5.0, 4) == 16                     # too little history: whole
    # first uses in the window miss at every size short of the whole pool: with 10% of the
    # accesses first uses, the cliff is not enough
    assert run_slots(knee - 0.06, 1000.0, 4) == 16
    assert run_slots(np.zeros(17), 1000.0, 4) == 16          # no reuse: only whole helps
    uniform = np.linspace(0.0, 1.0, 17)
    assert run_slots(uniform, 1000.0, 4) == int(np.ceil(16 * (1 - extra)))
    # the bound is in misses a token: a model whose tokens make more accesses runs bigger
    assert run_slots(uniform, 1000.0, 64) == 16 > run_slots(uniform, 1000.0, 4)


def test_the_run_size_prices_misses_at_what_they_cost_a_token():
    assert run_extra_misses(None, 0.05) == run_extra_misses(0.03, None) \
        == RUN_EXTRA_MISSES_PER_TOKEN                      # nothing measured yet
    # a miss that costs twice a token's time may add a twentieth of a miss a token
    assert run_extra_misses(0.03, 0.06) == pytest.approx(RUN_SLOWDOWN / 2)
    uniform = np.linspace(0.0, 1.0, 17)
    cheap, dear = run_extra_misses(0.03, 0.001), run_extra_misses(0.03, 0.06)
    assert run_slots(uniform, 1000.0, 4, dear) == 16 > run_slots(uniform, 1000.0, 4, cheap)


def test_busy_models_get_their_run_size_as_a_floor_when_it_fits():
    plan = plan_slots([_demand("a", 0.1, run=12), _demand("b", 10.0, skew=3.0)], 20 * NBYTES)
    assert plan.slots["a"] >= 12                  # though b's slots are worth more
    # run sizes that do not fit together: the model holding its run size keeps it, the
    # newcomer gets its working set (4) and what is left
    plan = plan_slots([_demand("a", 0.1, run=12, current=12), _demand("b", 10.0, run=12)],
                      20 * NBYTES)
    assert plan.slots == {"a": 12, "b": 8}
    # ... unless the operator ranks the newcomer higher by more than the hysteresis; by a
    # hair, it does not squeeze the incumbent (the two would trade the room back and forth)
    ranked = lambda priority: plan_slots(
        [_demand("a", 1.0, run=12, current=12),
         _demand("b", 1.0, run=12, current=8, priority=priority)], 20 * NBYTES).slots
    assert ranked(10.0)["b"] >= 12 and ranked(10.0)["a"] >= 4
    assert ranked(1.0 + HYSTERESIS / 2)["a"] == 12


def test_slots_follow_the_rates():
    budget = 20 * NBYTES
    plan = plan_slots([_demand("a", 10.0), _demand("b", 1.0)], budget)
    assert plan.slots["a"] > plan.slots["b"] >= 4          # b keeps its working set
    shifted = plan_slots([_demand("a", 1.0, current=plan.slots["a"]),
                          _demand("b", 10.0, current=plan.slots["b"])], budget)
    assert shifted.slots["b"] > shifted.slots["a"]
    assert sum(shifted.slots.values()) * NBYTES <= budget


def test_hysteresis_keeps_slots_under_small_rate_changes():
    first = plan_slots([_demand("a", 1.0), _demand("b", 1.0)], 20 * NBYTES)
    wobble = 1.0 + HYSTERESIS / 2
    again = plan_slots([_demand("a", 1.0, current=first.slots["a"]),
                        _demand("b", wobble, current=first.slots["b"])], 20 * NBYTES)
    assert again.slots == first.slots


def test_idle_models_get_no_floor_but_may_keep_leftovers():
    plan = plan_slots([_demand("busy", 1.0), _demand("idle", 0.0, has_work=False)],
                      100 * NBYTES)
    assert plan.slots["busy"] == 16                       # every expert: it has all it wants
    assert plan.slots["idle"] == 16                       # leftover memory keeps what it has
    tight = plan_slots([_demand("busy", 1.0), _demand("idle", 0.0, has_work=False)],
                       16 * NBYTES)
    assert tight.slots == {"busy": 16, "idle": 0}


def test_floors_fall_back_to_top_k_when_working_sets_do_not_fit():
    demands = [_demand(str(i), 1.0) for i in range(4)]   # working sets: 4 slots each
    plan = plan_slots(demands, 9 * NBYTES)
    assert all(n >= 2 for n in plan.slots.values()) and sum(plan.slots.values()) <= 9


def test_no_budget_means_every_expert():
    assert plan_slots([_demand("a", 0.0)], None).slots == {"a": 16}


def test_a_hot_model_with_a_steep_curve_fills_before_a_cold_one_grows():
    plan = plan_slots([_demand("hot", 100.0, skew=3.0), _demand("cold", 0.1)], 24 * NBYTES)
    assert plan.slots["hot"] == 16                         # every expert it has
    assert plan.slots["cold"] == 8                         # its working set, then leftovers
    tight = plan_slots([_demand("hot", 100.0, skew=3.0), _demand("cold", 0.1)], 20 * NBYTES)
    assert tight.slots == {"hot": 16, "cold": 4}           # the cold one: its floor only


def test_a_scan_gets_all_of_its_cliff_or_only_its_floor():
    scan = _demand("scan", 5.0, curve=scan_curve())
    other = _demand("other", 1.0)
    # all 16 fit beside the other's working set, and the whole cliff is worth the most
    assert plan_slots([scan, other], 20 * NBYTES).slots == {"scan": 16, "other": 4}
    # part of the cliff saves nothing: the other model's slots are worth more
    plan = plan_slots([scan, other], 18 * NBYTES)
    assert plan.slots["other"] == 14 and plan.slots["scan"] == 4


def test_pinned_models_keep_every_slot_under_any_traffic():
    for rates in ((0.0, 100.0), (100.0, 0.0)):
        plan = plan_slots([_demand("pinned", rates[0], has_work=False, pinned=True),
                           _demand("busy", rates[1])], 20 * NBYTES)
        assert plan.slots["pinned"] == 16 and plan.slots["busy"] == 4


def test_priority_shifts_slots_toward_the_weighted_model():
    even = plan_slots([_demand("a", 1.0), _demand("b", 1.0)], 20 * NBYTES)
    weighted = plan_slots([_demand("a", 1.0), _demand("b", 1.0, priority=4.0)], 20 * NBYTES)
    assert weighted.slots["b"] > even.slots["b"] and weighted.slots["a"] < even.slots["a"]


@settings(max_examples=80, deadline=None)
@given(rates=st.lists(st.floats(0, 100), min_size=1, max_size=5),
       work=st.lists(st.booleans(), min_size=5, max_size=5),
       budget_slots=st.integers(10, 100), current=st.lists(st.integers(0, 16), min_size=5,
                                                              max_size=5),
       scans=st.lists(st.booleans(), min_size=5, max_size=5),
       priorities=st.lists(st.floats(0.1, 10), min_size=5, max_size=5),
       pinned=st.integers(0, 5))
def test_plans_never_exceed_the_budget(rates, work, budget_slots, current, scans, priorities,
                                       pinned):
    demands = [_demand(str(i), r, work[i], current=current[i], priority=priorities[i],
                       curve=scan_curve() if scans[i] else None, pinned=i < pinned)
               for i, r in enumerate(rates)]
    if 16 * sum(d.pinned for d in demands) + 2 * len(demands) > budget_slots:
        return                        # the router refuses such a budget (check_fits)
    plan = plan_slots(demands, budget_slots * NBYTES)
    assert sum(plan.slots.values()) <= budget_slots
    for d in demands:
        assert 0 <= plan.slots[d.name] <= d.max_slots
        assert plan.slots[d.name] == 0 or plan.slots[d.name] >= d.top_k
        if d.has_work:
            assert plan.slots[d.name] >= d.top_k
        if d.pinned:
            assert plan.slots[d.name] == d.max_slots


def test_decayed_rate_estimates_a_steady_rate():
    rng = np.random.default_rng(0)
    rate = DecayedRate(60.0)
    now = 0.0
    for gap in rng.exponential(1 / 5.0, size=5000):       # Poisson at 5 requests/s
        now += gap
        rate.add(now)
    assert rate.rate(now) == pytest.approx(5.0, rel=0.2)
    assert rate.rate(now + 600) < 0.01 * rate.rate(now)   # and forgets


def test_traffic_rises_and_falls():
    traffic = ModelTraffic()
    for i in range(20):
        traffic.on_arrival(1000.0 + i * 0.1)
    assert traffic.is_rising(1002.0)
    assert traffic.request_rate(1002.0) > 1.0
    assert not traffic.is_rising(1300.0)


def test_expert_usage_is_a_decayed_frequency():
    usage = ExpertUsage(num_layers=1, num_experts=4, top_k=1, half_life_s=10.0)
    for t in range(100):
        usage.record([(0, [0])], float(t))
    p = usage.probabilities(100.0)
    assert p[0, 0] > 0.9 and p[0, 1:].max() < 0.1
    for t in range(100, 200):                              # traffic moves to expert 3
        usage.record([(0, [3])], float(t))
    p = usage.probabilities(200.0)
    assert p[0, 3] > 0.9 and p[0, 0] < 0.1
    usage.record([(0, [1])], 1e6)                              # far later: weights rebase
    assert np.isfinite(usage.probabilities(1e6)).all()


def test_small_resizes_are_not_applied_unless_the_budget_needs_them():
    demands = [_demand("a", 1.0, current=12), _demand("b", 1.0, current=8)]
    assert settle(Plan({"a": 12, "b": 8}, 20 * NBYTES), demands) == {"a": 12, "b": 8}
    nudged = Plan({"a": 11, "b": 9}, 20 * NBYTES)
    assert settle(nudged, demands) == {"a": 12, "b": 8}           # +-1: within the band
    tight = Plan({"a": 11, "b": 9}, 19 * NBYTES)            # budget shrank by one
    settled = settle(tight, demands)
    assert sum(settled.values()) <= 19 and settled["a"] == 11
    moved = Plan({"a": 4, "b": 16}, 20 * NBYTES)            # a real shift applies
    assert settle(moved, demands) == {"a": 4, "b": 16}


def test_a_pool_is_not_resized_twice_within_the_interval():
    recent = RESIZE_MIN_INTERVAL_S / 2
    demands = [_demand("a", 1.0, current=12, resized_ago_s=recent),
               _demand("b", 1.0, current=8)]
    moved = Plan({"a": 4, "b": 16}, 20 * NBYTES)
    assert settle(moved, demands) == {"a": 12, "b": 8}     # b can run: its growth waits
    later = [_demand("a", 1.0, current=12, resized_ago_s=2 * RESIZE_MIN_INTERVAL_S),
             _demand("b", 1.0, current=8)]
    assert settle(moved, later) == {"a": 4, "b": 16}
    # a model that cannot run yet gets its floor at once: a's planned shrink applies
    newcomer = [_demand("a", 1.0, current=20, resized_ago_s=recent),
                _demand("b", 1.0, current=0)]
    assert settle(Plan({"a": 16, "b": 4}, 20 * NBYTES), newcomer) == {"a": 16, "b": 4}
    # below its working set (top_k x layers = 4) a pool grows even if resized just now
    small = [_demand("a", 1.0, current=12, resized_ago_s=recent),
             _demand("b", 1.0, current=2, resized_ago_s=recent)]
    assert settle(Plan({"a": 12, "b": 4}, 16 * NBYTES), small) == {"a": 12, "b": 4}


def test_a_pool_below_its_run_floor_grows_however_small_the_step():
    # a uniform curve's run floor is every slot: 15 of 16 held, a miss nearly every token
    for resized_ago_s in (float("inf"), RESIZE_MIN_INTERVAL_S / 2):
        below = [_demand("a", 1.0, current=15, run=16, resized_ago_s=resized_ago_s)]
        assert settle(Plan({"a": 16}, 16 * NBYTES), below) == {"a": 16}
    # at its floor the band still holds it (no churn for a slot's difference)
    at_floor = [_demand("a", 1.0, current=15, run=15)]
    assert settle(Plan({"a": 16}, 16 * NBYTES), at_floor) == {"a": 15}


@settings(max_examples=60, deadline=None)
@given(rates=st.lists(st.floats(0, 100), min_size=1, max_size=5),
       budget_slots=st.integers(10, 100), current=st.lists(st.integers(0, 16), min_size=5,
                                                              max_size=5),
       recent=st.lists(st.booleans(), min_size=5, max_size=5))
def test_settled_plans_never_exceed_the_budget(rates, budget_slots, current, recent):
    demands = [_demand(str(i), r, current=current[i],
                       resized_ago_s=0.0 if recent[i] else float("inf"))
               for i, r in enumerate(rates)]
    settled = settle(plan_slots(demands, budget_slots * NBYTES), demands)
    assert sum(settled.values()) <= budget_slots
    assert all(n == 0 or n >= 2 for n in settled.values())
