"""The memory planner: how many expert slots each model gets out of one device budget.

Design note.
- A slot is worth the miss cost it saves per second. Each model's pool learns its miss-ratio
  curve online (mox.pager.usage.MissRatioCurve: H(S), the hit rate an LRU pool of S slots would
  get on its recent accesses), so its S-th slot saves
      request rate x accesses per request x (H(S) - H(S-1)) x miss cost (seconds)
  per second, times the operator's priority. Slots go to the highest value per byte first.
  A curve with a cliff (a scan: nothing hits until everything fits) is planned on its upper
  concave hull in indivisible blocks, so the planner gives such a model all of the cliff or
  none of it; whole residency of a hot model and nothing for an idle one fall out of this.
- Floors first: a pinned model holds every expert; a model with queued or running requests
  gets its run size (`run_slots`: the smallest pool whose misses would add at most
  `RUN_SLOWDOWN` to a token's time on its curve, at what misses and tokens cost in recent
  decode steps; every expert while the curve has too little history; it holds for the turn:
  mox.router.views), which admission (mox.router.memory_policy) makes room for before the
  model may run. A busy model below it re-reads experts every token and slows every model
  that shares the disk and the cores, so waiting for room, as model-swap does, is better:
  model-swap's behaviour is this rule with run size = every expert. Where the run sizes do
  not fit together (a warm model whose pool shrank while idle, a pinned model), the models
  that hold theirs keep them (unless a model of priority higher by more than `HYSTERESIS`
  needs the room) and the others get working sets (one token's experts in every
  MoE layer: top_k x layers), or top_k, the least a step can run on (in waves).
- Hysteresis: slots a model holds now count `HYSTERESIS` more, so a small wobble in the
  rates does not move slots back and forth (each move costs a disk read).
- Leftover budget goes to models' next slots even at zero value: memory that nobody wants is
  better spent keeping what is loaded.
The planner is a pure function of its inputs: the router applies the plan through the
pools, which evict only unleased experts.

Legend: N expert slots a model can use (MoE layers x experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A held slot is kept unless a challenger is worth 25% more: enough to absorb the noise of
# Poisson arrivals over a one-minute window, small enough to follow a real shift.
HYSTERESIS = 0.25
# A resize costs: on a GPU it reallocates and copies the pool (tens of ms for 100 MiB, on the
# engine's thread); anywhere, a shrink evicts experts that the next growth reads again. So a
# planned change smaller than this share of the pool (or than top_k slots) is not applied,
# unless the budget needs the room it frees.
RESIZE_DEADBAND = 0.125
# ... and a pool resized less than this long ago keeps its size, unless a model below its
# working set needs the room: rates measured over a few arrivals swing whole working sets
# between models (10 mid models starting together: 86 slot-count changes in 160 steps
# without this, 37 with it).
RESIZE_MIN_INTERVAL_S = 5.0
# Sizes at which a miss-ratio curve is read when planning (see `_hull_segments`).
HULL_POINTS = 257
# A busy model runs at the smallest pool whose misses add at most this share to a token's
# time, priced at what a miss and a token cost in recent decode steps (mox.router.timeline
# DecodeCosts). A decode miss costs far more than its read: the step parks until the expert
# lands and resumes after whatever steps ran meanwhile. A fixed bound of a quarter of a miss a
# token (16 ms a miss against a 21 ms token, 8 bench models on an AVX512 CPU) let 30% of the
# decode steps miss on a slower CPU with more models busy, where a miss cost 65 ms against a
# 33 ms token and the steps parked 99 s of 245 (16-model load test, uniform routing,
# bench/results/harness-16-avx2-0.4-e).
RUN_SLOWDOWN = 0.1
# ... and while no decode miss has been measured: the quarter of a miss a token above.
RUN_EXTRA_MISSES_PER_TOKEN = 0.25
# A curve is trusted for the run size once its recent accesses number this many times the
# keys it spans (fewer: a first request's prefill and a few tokens, which see little reuse).
RUN_MIN_HISTORY = 1.0


@dataclass(frozen=True)
class ModelDemand:
    name: str
    request_rate: float            # requests per second
    has_work: bool                 # queued or running requests
    hit_rates: np.ndarray          # [N + 1] H(S): the LRU hit rate at S slots
    accesses_per_request: float    # (layer, expert) accesses one request makes
    miss_cost_s: float             # seconds one miss costs (the read, and the stall on a step)
    expert_nbytes: int
    top_k: int
    num_layers: int                # MoE layers
    current_slots: int = 0
    resized_ago_s: float = float("inf")    # since the pool's size last changed
    priority: float = 1.0          # the operator's weight on this model's value
    pinned: bool = False           # the operator's: every expert, always
    run_slots: int = 0             # its run size (`run_slots()`; 0: its working set)

    @property
    def max_slots(self) -> int:
        return len(self.hit_rates) - 1

    @property
    def working_set(self) -> int:
        return min(self.max_slots, self.top_k * self.num_layers)

    @property
    def run_floor(self) -> int:
        """Below this a busy model's steps miss more than they should."""
        return min(self.max_slots, max(self.working_set, self.run_slots))

    @property
    def value_scale(self) -> float:
        """Seconds saved per second per unit of hit rate."""
        return (self.priority * self.request_rate * self.accesses_per_request
                * self.miss_cost_s)


@dataclass(frozen=True)
class Plan:
    slots: dict[str, int]                   # expert slots per model
    budget_bytes: int | None                # the expert budget planned for (None: no limit)

    def nbytes(self, demands: dict[str, ModelDemand]) -> int:
        return sum(n * demands[name].expert_nbytes for name, n in self.slots.items())


def plan_slots(demands: list[ModelDemand], budget_bytes: int | None) -> Plan:
    if budget_bytes is None:
        return Plan({d.name: d.max_slots for d in demands}, None)
    slots = _floors(demands, budget_bytes)
    left = budget_bytes - sum(slots[d.name] * d.expert_nbytes for d in demands)
    skipped: dict[str, int] = {}          # model -> slots of its first block that did not fit
    for name, count, nbytes in _ranked_blocks(demands, slots):
        if name in skipped:
            continue                      # a model's blocks are taken in order
        if count * nbytes <= left:
            slots[name] += count
            left -= count * nbytes
        else:
            skipped[name] = count
    for name, count in skipped.items():   # leftovers: part of a block beats idle memory
        nbytes = next(d.expert_nbytes for d in demands if d.name == name)
        take = min(count, left // nbytes)
        slots[name] += take
        left -= take * nbytes
    by_name = {d.name: d for d in demands}
    for name, n in slots.items():          # fewer than top_k slots cannot run a step
        slots[name] = n if n >= min(by_name[name].top_k, by_name[name].max_slots) else 0
    plan = Plan(slots, budget_bytes)
    assert plan.nbytes(by_name) <= budget_bytes, (plan, budget_bytes)
    assert all(0 <= n <= by_name[name].max_slots for name, n in slots.items())
    return plan


def run_extra_misses(seconds_per_token: float | None, seconds_per_miss: float | None) -> float:
    """Misses a token may add over a whole pool's: `RUN_SLOWDOWN` of a token's time at the
    measured costs, or `RUN_EXTRA_MISSES_PER_TOKEN` until both are measured."""
    if not seconds_per_token or not seconds_per_miss:
        return RUN_EXTRA_MISSES_PER_TOKEN
    return RUN_SLOWDOWN * seconds_per_token / seconds_per_miss


def run_slots(hit_rates: np.ndarray, recent_accesses: float, accesses_per_token: int,
              extra_misses: float = RUN_EXTRA_MISSES_PER_TOKEN) -> int:
    """The smallest pool whose LRU misses a token (`accesses_per_token` (layer, expert)
    accesses: top_k in every MoE layer) are at most `extra_misses` (`run_extra_misses`) on
    the curve; every slot while the curve has less than `RUN_MIN_HISTORY` accesses per key
    (a model not yet seen runs whole, as model-swap would run it).

    A whole pool never misses, and a key's first use in the curve's window counts as a miss
    at every smaller size: its previous use is older than the window, at a distance the curve
    cannot tell. Measured against the curve's own H(N) instead (which excludes those), a short
    history put the knee far too low: uniform routing over a bench model's 512 keys gave 81%
    of them after 32 tokens, 94% after 64; turns that short left 30% of the decode steps
    missing at run sizes of 88-99% (16-model load test, bench/results/harness-16-avx2-0.4-g)."""
    num_slots = len(hit_rates) - 1
    if recent_accesses < RUN_MIN_HISTORY * num_slots:
        return num_slots
    miss_rate = 1.0 - hit_rates
    miss_rate[-1] = 0.0
    enough = miss_rate <= extra_misses / max(1, accesses_per_token)
    return int(np.argmax(enough))


def settle(plan: Plan, demands: list[ModelDemand]) -> dict[str, int]:
    """The plan without its small resizes (`RESIZE_DEADBAND`) and without resizing a pool
    twice within `RESIZE_MIN_INTERVAL_S`, except to grow a pool below its run floor (its
    steps miss, or run in waves). A model at its floor keeps its slots then and waits to grow
    until the room is free; if that is not enough (a model below its floor needs room), the
    planned shrinks apply. The result never needs more than the budget."""
    by_name = {d.name: d for d in demands}
    settled = {}
    for d in demands:
        planned, held = plan.slots[d.name], d.current_slots
        small = abs(planned - held) < max(d.top_k, RESIZE_DEADBAND * held)
        recent = d.resized_ago_s < RESIZE_MIN_INTERVAL_S
        # below its run floor a step misses (or runs in waves): such a pool may always grow,
        # however little (a uniform curve's floor is nearly every expert: held 7/8 of them,
        # nearly every token missed; 16-model load test, 42a9647)
        may_grow = held < planned and held < d.run_floor
        hold = not may_grow and (small or recent)
        # a pinned model holds every expert: no band keeps it below that
        settled[d.name] = (held if hold and planned and held >= d.top_k and not d.pinned
                           else planned)
    if plan.budget_bytes is None:
        return settled

    def fits(slots: dict[str, int]) -> bool:
        return Plan(slots, None).nbytes(by_name) <= plan.budget_bytes

    if fits(settled):
        return settled
    waiting = {n: min(k, by_name[n].current_slots)
               if by_name[n].current_slots >= by_name[n].run_floor else k
               for n, k in settled.items()}                           # growth waits
    if fits(waiting):
        return waiting
    return {n: min(k, plan.slots[n]) for n, k in settled.items()}    # the shrinks apply


def _floors(demands: list[ModelDemand], budget_bytes: int) -> dict[str, int]:
    """Pinned models whole; then the busy models' working sets (top_k each if those do not
    fit), raised to their run floors one model at a time while they fit: by priority, a model that
    holds its run floor now counting `HYSTERESIS` more (a newcomer does not squeeze a model
    that runs well unless the operator ranks it clearly higher), then by value."""
    floors = {d.name: d.max_slots for d in demands if d.pinned}
    busy = [d for d in demands if d.has_work and not d.pinned]
    working = {d.name: d.working_set for d in busy}
    if _nbytes(floors | working, demands) > budget_bytes:
        working = {d.name: min(d.top_k, d.max_slots) for d in busy}
    if _nbytes(floors | working, demands) > budget_bytes:      # admission keeps this rare
        floors = {d.name: min(d.top_k, d.max_slots) for d in demands if d.pinned}
    floors |= working
    assert _nbytes(floors, demands) <= budget_bytes, (
        "the budget holds every expert of the pinned models and top_k of the busy ones; the "
        "router checks this")
    # incumbency weighs as hysteresis does: a newcomer must outrank a model that runs well
    # at its run size by more than `HYSTERESIS` in priority to squeeze it (by a hair, the two
    # would trade the room back and forth, each trade a reread), as one of higher priority may
    for d in sorted(busy, key=lambda d: (_floor_rank(d), d.value_scale), reverse=True):
        raised = floors | {d.name: max(floors[d.name], d.run_floor)}
        if _nbytes(raised, demands) <= budget_bytes:
            floors = raised
    return {d.name: floors.get(d.name, 0) for d in demands}


def _floor_rank(d: ModelDemand) -> float:
    return d.priority * (1.0 + HYSTERESIS * (d.current_slots >= d.run_floor))


def _nbytes(slots: dict[str, int], demands: list[ModelDemand]) -> int:
    return sum(slots.get(d.name, 0) * d.expert_nbytes for d in demands)


def _ranked_blocks(demands: list[ModelDemand],
                   floors: dict[str, int]) -> list[tuple[str, int, int]]:
    """Every model's slots beyond its floor as blocks (model, slots, bytes per slot), best
    value per byte first: the segments of the upper concave hull of its hit-rate curve, split
    where the slots it holds now end (those count `HYSTERESIS` more). Within a model values
    only fall along the hull, so taking the best first fills each model in order."""
    ranked = []
    for d in demands:
        for start, end, slope in _hull_segments(d.hit_rates, floors[d.name]):
            for lo, hi in _split(start, end, d.current_slots):
                held = hi <= d.current_slots
                value = d.value_scale * slope * (1.0 + HYSTERESIS * held) / d.expert_nbytes
                ranked.append((value, held, d.name, hi - lo, d.expert_nbytes))
    # ties (zero value) keep what is held before taking anything new
    ranked.sort(key=lambda r: (r[0], r[1]), reverse=True)
    return [(name, count, nbytes) for _, _, name, count, nbytes in ranked]


def _hull_segments(hit_rates: np.ndarray, start: int) -> list[tuple[int, int, float]]:
    """(first, end, slope) of the upper concave hull of H(S) over S = start..N: the slots
    first+1..end each add `slope` to the hit rate when the segment is taken whole. The curve
    is read at most `HULL_POINTS` sizes apart evenly (a 48 x 128 model's 6144 sizes cost 5 ms
    a plan in Python; the blocks then cover a few slots each)."""
    n = len(hit_rates) - 1
    sizes = np.unique(np.linspace(start, n, min(n - start + 1, HULL_POINTS)).round().astype(int))
    hull: list[int] = []
    for s in sizes.tolist():
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], s, hit_rates) >= 0:
            hull.pop()
        hull.append(s)
    return [(a, b, (hit_rates[b] - hit_rates[a]) / (b - a)) for a, b in zip(hull, hull[1:])]


def _cross(a: int, b: int, c: int, h: np.ndarray) -> float:
    """> 0 when b lies below the line from a to c (so b is not on the upper hull)."""
    return (h[c] - h[a]) * (b - a) - (h[b] - h[a]) * (c - a)


def _split(start: int, end: int, at: int) -> list[tuple[int, int]]:
    return [(start, at), (at, end)] if start < at < end else [(start, end)]
