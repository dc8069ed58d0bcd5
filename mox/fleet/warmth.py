"""Where a model is warm: what each replica reports of itself, and how the fleet's request
router ranks replicas for a request (pure functions, tested without Ray).

A replica's report (its Ray Serve routing stats) is a plain dict:

    {"queue": 3, "warmth": {"olmoe-demo": 1.0, "qwen3-moe-demo": 0.62, "mixtral-demo": 0.0},
     "cold_start_cost": {"mixtral-demo": 0.4}}

`warmth` of a model is 0 while its dense weights are off the replica, and 0.5 + half the
share of its experts resident once they are on (a warm model with no expert in a slot still
skips the dense load; every expert resident skips every read). `cold_start_cost` of a cold
model is what a request for it would cost the replica's other models if it started there now
(`cold_start_cost`), in the same unit.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from mox.messages import ModelState

# A wholly warm model is worth this many requests queued ahead on its replica: a cold start of
# a bench model costs seconds of reads, a queued request about a second of decode.
QUEUE_PER_WARMTH = 8.0
# A model's home replica (below) is worth this much warmth: two queued requests. Where the model
# is warm nowhere, its cold start goes home unless the home's queue is much longer.
HOME_WARMTH = 2 / QUEUE_PER_WARMTH
# What a cold start costs the replica's other models, in warmth. Waiting for a busy model's
# turn costs up to TURN_S (5 s) and then drains that model, whose next requests start cold. A
# request sent on from a replica where its model was warm but the queue was longer did that
# in the bench (2 replicas, each half the budget, one bench model's run size nearly filling
# it): the hot model's replica took the spilled request, drained the hot model for it within
# 2.4 s and read it back 1.5 s later (bench/results/harness-ray-29).
WAIT_COST = 1.0
# Parking an idle model, or shrinking its pool, costs the chance that a request for it comes
# within this long, times the share of it evicted (which that request reads again): a model
# at 0.1 req/s parked costs nearly a whole cold start, one asked for once in four minutes an
# eighth. In the bench a model stayed warm on a replica 47 s from load to park (the median of
# 30; a third under 30 s: harness-ray-30 to -32). Priced flat, a park at a quarter, a rare
# model's start parked the second busiest one (harness-ray-32 at 167 s); with parks alone
# priced, the two busiest models shared a replica, each start of one shrinking the other's
# pool, while the other replica served the rest (harness-ray-36: 0.72x of one process).
PARK_HORIZON_S = 30.0


def model_warmth(model: dict) -> float:
    """One model of a router snapshot (mox.router.Router.snapshot) -> its warmth in [0, 1]."""
    if not model.get("dense_resident"):
        return 0.0
    pager = model.get("pager")
    if not pager or not pager.get("max_slots"):
        return 1.0                         # a dense model, or one whose experts are all in
    resident = pager["resident_bytes"] / (pager["max_slots"] * pager["expert_bytes"])
    return 0.5 + 0.5 * min(1.0, resident)


def replica_report(snapshot: dict) -> dict:
    """A router snapshot -> the routing stats a replica reports."""
    models = snapshot["models"]
    return {"queue": sum(m["running"] + m["waiting"] for m in models.values()),
            "warmth": {name: model_warmth(m) for name, m in models.items()},
            "cold_start_cost": {name: cold_start_cost(m["cold_start"], models)
                                for name, m in models.items() if "cold_start" in m}}


def cold_start_cost(start: dict, models: dict) -> float:
    """A cold model's `cold_start` (mox.router.Router.snapshot) -> what starting it now costs
    the replica's other models, in warmth: WAIT_COST if it waits for a busy model's turn,
    else, for each model it parks or whose pool it shrinks, the share of that model it
    evicts times the chance that it is asked for within PARK_HORIZON_S (at most WAIT_COST)."""
    if start["waits"]:
        return WAIT_COST
    evicted = {**dict.fromkeys(start["parks"], 1.0), **start.get("squeezes", {})}
    cost = sum(share * (1.0 - math.exp(-models[name].get("request_rate", 0.0)
                                       * PARK_HORIZON_S))
               for name, share in evicted.items() if name in models)
    return min(WAIT_COST, cost)


@dataclass(frozen=True)
class Candidate:
    replica: Hashable
    report: dict | None            # None: the replica has not reported yet
    holds: bool = False            # the model is in the replica's multiplexed set
    num_held: int = 0              # models in that set
    queue: int | None = None       # requests the caller's router has in flight there (None:
                                   # unknown; the report's queue stands in)
    key: str = ""                  # the replica's id, stable while it lives ("": str(replica))


def home(candidates: Sequence[Candidate], model: str) -> Candidate:
    """The model's home among the replicas: the highest hash of (model, replica), the same
    answer in every router process, and when a replica goes, only its models move.

    A model warm nowhere starts at home. Without a home, its cold start went to the replica
    with the shorter queue, and each replica spent budget on it (bench/results/harness-ray-9-
    unbounded, -10: 4 of 8 models landed on both replicas; the fleet read 1.13x and 1.36x
    what one process read; with a home, -11-home and -12-home, 1.13x and 1.18x)."""
    return max(candidates, key=lambda c: zlib.crc32(f"{model}/{c.key or c.replica}".encode()))


def score(candidate: Candidate, model: str, is_home: bool = False) -> float:
    """Higher is better: the model's warmth there (HOME_WARMTH more at its home), less the
    queue it would wait behind, less what a cold start there would cost the replica's other
    models (`cold_start_cost`). A replica that holds the model but has not reported it yet
    counts half warm; once it reports, its report decides (a replica keeps every model it
    was sent in its set, parked or not)."""
    report = candidate.report or {}
    warmth = report.get("warmth", {}).get(model)
    if warmth is None:
        warmth = 0.5 if candidate.holds else 0.0
    if warmth == 0.0:
        warmth -= report.get("cold_start_cost", {}).get(model, 0.0)
    queue = candidate.queue if candidate.queue is not None else report.get("queue", 0)
    return warmth + (HOME_WARMTH if is_home else 0.0) - queue / QUEUE_PER_WARMTH


def warm_on_another(model: str, reports: dict[str, dict], me: str) -> bool:
    """Whether `model` is warm (its dense weights on) on a replica other than `me`, by the
    replicas' latest reports: a request for it that found it cold on `me` could have found
    it warm there."""
    return any(report.get("warmth", {}).get(model, 0.0) > 0.0
               for replica, report in reports.items() if replica != me)


def rank(candidates: Sequence[Candidate], model: str) -> list[list[Hashable]]:
    """The replicas for a request of `model`, best first, as Ray's `choose_replicas` returns
    them (one rank per replica, so a full replica falls through to the next best). Between
    equals, the replica holding fewer models."""
    if not candidates:
        return []
    own = home(candidates, model)
    order = sorted(range(len(candidates)),
                   key=lambda i: (-score(candidates[i], model, candidates[i] is own),
                                  candidates[i].num_held))
    return [[candidates[i].replica] for i in order]


def fleet_model_states(body: bytes, reports: dict[str, dict]) -> bytes:
    """One replica's `/v1/models` (or `/v1/models/{model}`) answer with each model's state
    as the fleet has it: `warm` where any replica reports its dense weights on. (A model is
    cold on most replicas while warm on one, and the answering replica is any of them.)"""
    answer = json.loads(body)
    warm = {m for report in reports.values()
            for m, warmth in report.get("warmth", {}).items() if warmth > 0.0}
    for card in answer.get("data", [answer]):
        if card.get("id") in warm:
            card["state"] = ModelState.WARM.value
    return json.dumps(answer).encode()
