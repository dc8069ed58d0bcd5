"""The memory planner: how many expert slots each model gets out of one device budget.

Design note.
- A slot is worth what it saves: (model's request rate) x (probability that a step uses the
  expert it would hold) per byte. Each model's experts are ranked by usage, so its n-th slot
  is worth its n-th most used expert; all models' slots are filled greedily by value.
- A model with queued or running requests first gets its working set: one token's experts
  in every MoE layer (top_k x layers), or just top_k, the least a step can run on (in
  waves), when the working sets of every busy model do not fit together.
- Hysteresis: slots a model holds now count `HYSTERESIS` more, so a small wobble in the
  rates does not move slots back and forth (each move costs a disk read).
- Leftover budget goes to models' next most used experts even at zero rate: memory that
  nobody wants is better spent keeping what is loaded.
The planner is a pure function of its inputs: the router applies the plan through the
pager, which evicts only unleased experts.

Legend: L MoE layers, E experts per layer.
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


@dataclass(frozen=True)
class ModelDemand:
    name: str
    request_rate: float            # requests per second
    has_work: bool                 # queued or running requests
    usage: np.ndarray              # [L, E] P(a step uses the expert)
    expert_nbytes: int
    top_k: int
    current_slots: int = 0
    resized_ago_s: float = float("inf")    # since the pool's size last changed

    @property
    def max_slots(self) -> int:
        return self.usage.size

    @property
    def working_set(self) -> int:
        return min(self.max_slots, self.top_k * self.usage.shape[0])


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
    for name, nbytes in _ranked_slots(demands, slots):
        if nbytes <= left:
            slots[name] += 1
            left -= nbytes
    by_name = {d.name: d for d in demands}
    for name, n in slots.items():          # fewer than top_k slots cannot run a step
        slots[name] = n if n >= min(by_name[name].top_k, by_name[name].max_slots) else 0
    plan = Plan(slots, budget_bytes)
    assert plan.nbytes(by_name) <= budget_bytes, (plan, budget_bytes)
    assert all(0 <= n <= by_name[name].max_slots for name, n in slots.items())
    return plan


def settle(plan: Plan, demands: list[ModelDemand]) -> dict[str, int]:
    """The plan without its small resizes (`RESIZE_DEADBAND`) and without resizing a pool
    twice within `RESIZE_MIN_INTERVAL_S`, except to grow a pool below its working set (its
    steps run in waves). A model with its working set keeps its slots then and waits to grow
    until the room is free; if that is not enough (a model below its working set needs room),
    the planned shrinks apply. The result never needs more than the budget."""
    by_name = {d.name: d for d in demands}
    settled = {}
    for d in demands:
        planned, held = plan.slots[d.name], d.current_slots
        small = abs(planned - held) < max(d.top_k, RESIZE_DEADBAND * held)
        recent = d.resized_ago_s < RESIZE_MIN_INTERVAL_S
        # below its working set a step runs in waves: such a pool may always grow
        hold = small or (recent and (planned < held or held >= d.working_set))
        settled[d.name] = held if hold and planned and held >= d.top_k else planned
    if plan.budget_bytes is None:
        return settled

    def fits(slots: dict[str, int]) -> bool:
        return Plan(slots, None).nbytes(by_name) <= plan.budget_bytes

    if fits(settled):
        return settled
    waiting = {n: min(k, by_name[n].current_slots)
               if by_name[n].current_slots >= by_name[n].working_set else k
               for n, k in settled.items()}                           # growth waits
    if fits(waiting):
        return waiting
    return {n: min(k, plan.slots[n]) for n, k in settled.items()}    # the shrinks apply


def _floors(demands: list[ModelDemand], budget_bytes: int) -> dict[str, int]:
    """Working sets of the busy models if they fit together, else top_k each."""
    busy = [d for d in demands if d.has_work]
    floors = {d.name: d.working_set for d in busy}
    if sum(floors[d.name] * d.expert_nbytes for d in busy) > budget_bytes:
        floors = {d.name: min(d.top_k, d.max_slots) for d in busy}
    assert sum(floors[d.name] * d.expert_nbytes for d in busy) <= budget_bytes, (
        "the budget holds fewer than top_k experts of every busy model; the router checks this")
    return {d.name: floors.get(d.name, 0) for d in demands}


def _ranked_slots(demands: list[ModelDemand],
                  floors: dict[str, int]) -> list[tuple[str, int]]:
    """Every slot beyond the floors as (model, bytes), best value per byte first. Within a
    model values only fall with n, so taking the best first fills each model in order."""
    ranked = []
    for d in demands:
        usage = np.sort(d.usage.ravel())[::-1]                       # [L*E] most used first
        value = d.request_rate * usage / d.expert_nbytes
        held = np.arange(usage.size) < d.current_slots
        value = np.where(held, value * (1.0 + HYSTERESIS), value)
        # ties (zero rate) keep what is held before taking anything new
        ranked += [(float(v), bool(h), d.name, d.expert_nbytes)
                   for v, h in zip(value[floors[d.name]:], held[floors[d.name]:])]
    ranked.sort(key=lambda r: (r[0], r[1]), reverse=True)
    return [(name, nbytes) for _, _, name, nbytes in ranked]
