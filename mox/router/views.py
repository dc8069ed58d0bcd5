"""The frozen `MemoryView` a memory policy plans from, built from the router's model table: each
model's state and sizes, its traffic, and what its pool has learned (miss-ratio curve, access
rate), with one read rate for the whole tier.

A busy model's run size holds for its turn (from admission until it goes idle): it may rise
with its curve but not fall. A curve learned over a short history undershoots: long reuse
distances have not been seen yet (uniform routing over a bench model's 512 keys: the knee at
81% of them after 32 tokens, 94% after 64, 98% after 128). A run size that fell with it let
admission give the room to another model, and then the first one stepped below its run size
when its curve caught up: 978 of 1741 decode steps ran at 75-95% of the model's experts, with
misses (16-model load test, bench/results/harness-16-avx2-0.4-a). Between turns the curve has
its whole history, and the next admission reads the run size from it."""

from __future__ import annotations

from collections.abc import Callable

from mox.pager import PoolDemand
from mox.router.memory_policy import MemoryView, ModelView
from mox.router.planner import run_extra_misses, run_slots
from mox.router.served_model import ServedModel
from mox.router.timeline import DecodeCosts

# A minute's request rate below this is no traffic (accesses per request are then unknown).
MIN_RATE = 1e-6


def memory_view(models: dict[str, ServedModel], budget_bytes: int | None,
                has_requests: Callable[[str], bool], oldest_arrival: Callable[[str], float],
                now: float, costs: DecodeCosts) -> MemoryView:
    """Every model with a pool, as the router sees it at `now`; run sizes priced at what
    recent decode steps' tokens and misses cost."""
    extra_misses = run_extra_misses(costs.seconds_per_token, costs.seconds_per_miss)
    pooled = [m for m in models.values() if m.pool is not None]
    demands = {m.name: m.pool.demand() for m in pooled}
    # one read rate for every model: the tier's, not one pool's noisy sample of it (which made
    # equal models' slots differ in value by chance)
    seconds = sum(d.read_seconds for d in demands.values())
    bandwidth = sum(d.bytes_read for d in demands.values()) / seconds if seconds else None
    return MemoryView(budget_bytes, tuple(
        _model_view(m, demands[m.name], bandwidth, has_requests(m.name),
                    oldest_arrival(m.name), now, extra_misses) for m in pooled), now)


def _model_view(m: ServedModel, demand: PoolDemand, read_bytes_per_s: float | None,
                has_work: bool, oldest_arrival: float, now: float,
                extra_misses: float) -> ModelView:
    minute_rate = m.traffic.request_rates(now)[1]
    run = run_slots(demand.hit_rates, demand.recent_accesses,
                    m.pool.top_k * m.pool.num_moe_layers, extra_misses)
    if has_work and m.holds_device_memory:
        run = max(run, m.turn_run_slots)
    return ModelView(
        name=m.name, state=m.state, dense_nbytes=m.dense_nbytes,
        expert_nbytes=m.pool.expert_nbytes, top_k=m.pool.top_k, max_slots=m.pool.max_slots,
        num_slots=m.pool.num_slots, has_work=has_work,
        # valued by max(10 s, minute) rates: the minute's alone was no better in one run
        # (bench/results/harness-honest/README.md)
        request_rate=m.traffic.request_rate(now), last_active=m.last_active,
        oldest_arrival=oldest_arrival, num_layers=m.pool.num_moe_layers,
        hit_rates=demand.hit_rates,
        run_slots=run,
        accesses_per_request=demand.access_rate / minute_rate if minute_rate > MIN_RATE else 0.0,
        read_bytes_per_s=read_bytes_per_s, resized_ago_s=m.pool.resized_ago(),
        priority=m.settings.priority, pinned=m.settings.pin, loaded_at=m.loaded_at,
        draining=m.draining)
