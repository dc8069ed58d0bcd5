"""The fleet's routing decisions and messages, without a cluster."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mox.fleet.messages import request_fields
from mox.fleet.warmth import (
    QUEUE_PER_WARMTH,
    WAIT_COST,
    Candidate,
    cold_start_cost,
    fleet_model_states,
    home,
    model_warmth,
    rank,
    replica_report,
    warm_on_another,
)


def _model(dense: bool, resident: int = 0, slots: int = 8, running: int = 0, waiting: int = 0):
    return {"dense_resident": dense, "running": running, "waiting": waiting,
            "pager": {"resident_bytes": resident * 100, "max_slots": slots,
                      "expert_bytes": 100}}


def test_warmth_counts_dense_weights_then_resident_experts():
    assert model_warmth(_model(False, resident=8)) == 0.0        # experts without dense: cold
    assert model_warmth(_model(True, resident=0)) == 0.5
    assert model_warmth(_model(True, resident=4)) == 0.75
    assert model_warmth(_model(True, resident=8)) == 1.0


def test_replica_report_sums_the_queue_over_models():
    snapshot = {"models": {"a": _model(True, 8, running=2, waiting=1),
                           "b": _model(False, waiting=4)}}
    snapshot["models"]["b"]["cold_start"] = {"waits": True, "parks": []}
    assert replica_report(snapshot) == {"queue": 7, "warmth": {"a": 1.0, "b": 0.0},
                                        "cold_start_cost": {"b": WAIT_COST}}


def test_parking_costs_by_the_parked_models_traffic():
    models = {"busy": {"request_rate": 0.1}, "rare": {"request_rate": 1 / 240}, "new": {}}
    assert cold_start_cost({"waits": False, "parks": []}, models) == 0.0
    busy = cold_start_cost({"waits": False, "parks": ["busy"]}, models)
    rare = cold_start_cost({"waits": False, "parks": ["rare"]}, models)
    both = cold_start_cost({"waits": False, "parks": ["busy", "rare", "new"]}, models)
    assert 0.0 < rare < 0.2 < 0.9 < busy < WAIT_COST
    assert both == WAIT_COST                   # at most what waiting for a turn costs
    assert cold_start_cost({"waits": True, "parks": []}, models) == WAIT_COST
    # shrinking a pool by half costs half of parking its model
    half = cold_start_cost({"waits": False, "parks": [], "squeezes": {"busy": 0.5}}, models)
    assert half == pytest.approx(busy / 2)


def _report(queue: int, costs: dict[str, float] | None = None, **warmth: float) -> dict:
    return {"queue": queue, "warmth": warmth, "cold_start_cost": costs or {}}


def test_warm_on_another_looks_past_the_asking_replica():
    reports = {"r0": _report(0, a=1.0, b=0.0), "r1": _report(0, b=0.5, c=0.0)}
    assert warm_on_another("a", reports, "r1") and not warm_on_another("a", reports, "r0")
    assert warm_on_another("b", reports, "r0") and not warm_on_another("b", reports, "r1")
    assert not warm_on_another("c", reports, "r0") and not warm_on_another("z", reports, "r0")
    assert not warm_on_another("a", {}, "r0")


def test_the_replica_where_the_model_is_warm_ranks_first():
    candidates = [Candidate("r0", _report(0, b=1.0)), Candidate("r1", _report(0, a=1.0))]
    assert rank(candidates, "a") == [["r1"], ["r0"]]
    assert rank(candidates, "b") == [["r0"], ["r1"]]


def test_a_long_queue_outweighs_warmth():
    long_queue = int(2 * QUEUE_PER_WARMTH)
    candidates = [Candidate("warm", _report(long_queue, a=1.0)), Candidate("idle", _report(0))]
    assert rank(candidates, "a")[0] == ["idle"]
    candidates = [Candidate("warm", _report(2, a=1.0)), Candidate("idle", _report(0))]
    assert rank(candidates, "a")[0] == ["warm"]


def test_a_model_warm_nowhere_starts_at_its_home_replica():
    candidates = [Candidate("r0", _report(0), num_held=3), Candidate("r1", _report(1)),
                  Candidate("r2", _report(0), num_held=1)]
    homes = {}
    for model in (f"m{i}" for i in range(30)):
        homes[model] = home(candidates, model).replica
        assert rank(candidates, model)[0] == [homes[model]]
        # every router process agrees, whatever order Ray lists the replicas in
        assert home(candidates[::-1], model).replica == homes[model]
    assert set(homes.values()) == {"r0", "r1", "r2"}          # the models spread out
    # a replica that goes takes only its own models' homes with it
    rest = candidates[1:]
    assert all(home(rest, m).replica == r for m, r in homes.items() if r != "r0")


def test_warm_elsewhere_beats_home_and_a_long_home_queue_sends_the_start_elsewhere():
    candidates = [Candidate("r0", _report(0)), Candidate("r1", _report(0))]
    model = next(f"m{i}" for i in range(100) if home(candidates, f"m{i}").replica == "r0")
    warm_away = [Candidate("r0", _report(0)), Candidate("r1", _report(1, **{model: 0.5}))]
    assert rank(warm_away, model)[0] == ["r1"]
    busy_home = [Candidate("r0", _report(int(QUEUE_PER_WARMTH))), Candidate("r1", _report(0))]
    assert rank(busy_home, model)[0] == ["r1"]


def test_a_cold_start_that_would_cost_the_replicas_other_models_ranks_lower():
    # the queue that sends a warm model's request on to an idle replica (whichever is the
    # model's home) ...
    long_queue = int(1.5 * QUEUE_PER_WARMTH)
    for cost, spills in ((0.0, True), (0.1, True), (WAIT_COST, False)):
        candidates = [Candidate("warm", _report(long_queue, a=1.0)),
                      Candidate("other", _report(0, {"a": cost}, a=0.0))]
        # ... does not send it where it would wait for a busy model or park a busy one
        assert (rank(candidates, "a")[0] == ["other"]) == spills, cost
    # a model warm nowhere starts where it costs the others least rather than at a home
    # where it must wait; where both cost alike, at home
    pair = [Candidate("r0", _report(0)), Candidate("r1", _report(0))]
    model = next(f"m{i}" for i in range(100) if home(pair, f"m{i}").replica == "r0")
    for r1, first in ((0.0, "r1"), (0.5, "r1"), (WAIT_COST, "r0")):
        candidates = [Candidate("r0", _report(0, {model: WAIT_COST})),
                      Candidate("r1", _report(0, {model: r1}))]
        assert rank(candidates, model)[0] == [first], r1


def test_a_replica_that_reports_the_model_parked_does_not_count_its_hold():
    # unbounded multiplexed sets keep parked models held: the report, not the hold, decides
    candidates = [Candidate("parked", _report(0, a=0.0), holds=True),
                  Candidate("warm", _report(2, a=0.55), holds=True)]
    assert rank(candidates, "a")[0] == ["warm"]


def test_holding_the_model_counts_before_the_first_report():
    candidates = [Candidate("r0", None), Candidate("r1", None, holds=True, num_held=1)]
    assert rank(candidates, "a")[0] == ["r1"]


@given(st.lists(st.tuples(st.integers(0, 50), st.floats(0, 1), st.booleans(),
                          st.integers(0, 8)), min_size=1, max_size=6))
def test_rank_lists_every_candidate_once(rows):
    candidates = [Candidate(i, _report(q, a=w), holds, held)
                  for i, (q, w, holds, held) in enumerate(rows)]
    ranked = rank(candidates, "a")
    assert sorted(r for [r] in ranked) == list(range(len(rows)))


def test_request_fields_route_by_model_and_stream():
    fields = request_fields(b'{"model": "m", "stream": true, "prompt": "x"}')
    assert (fields.model, fields.stream) == ("m", True)
    assert request_fields(b'{"prompt": "x"}').model == ""
    # a body the replica must refuse still routes (as no model), so it gets the proper 400
    assert request_fields(b"not json").model == ""
    assert request_fields(b'{"model": 3}').model == ""
    assert request_fields(b"[1, 2]").model == ""


def test_the_routers_own_queue_count_is_fresher_than_the_report():
    # the report (a second old) says the warm replica is idle; the router has sent it a burst
    burst = int(2 * QUEUE_PER_WARMTH)
    candidates = [Candidate("warm", _report(0, a=1.0), queue=burst),
                  Candidate("idle", _report(0), queue=0)]
    assert rank(candidates, "a")[0] == ["idle"]


def test_the_fleets_model_list_says_warm_where_any_replica_is():
    answer = {"object": "list", "data": [{"id": "a", "state": "cold"},
                                          {"id": "b", "state": "cold"},
                                          {"id": "c", "state": "failed"}]}
    reports = {"r1": {"warmth": {"a": 0.0, "b": 0.0}}, "r2": {"warmth": {"a": 0.75}}}
    states = json.loads(fleet_model_states(json.dumps(answer).encode(), reports))
    assert [c["state"] for c in states["data"]] == ["warm", "cold", "failed"]
    one = json.loads(fleet_model_states(json.dumps({"id": "a", "state": "loading"}).encode(),
                                        reports))
    assert one == {"id": "a", "state": "warm"}
