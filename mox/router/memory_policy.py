"""Memory policies: how the device budget is divided among the models, one class per `policy=`.

A policy is made of pure functions of a frozen `MemoryView` (every model with a pool: its
state, sizes, traffic and expert usage, as the router sees them now). The router builds the
view and applies what comes back as a `MemoryPlan` (expert slots per model, idle models to
park, cold models to load); a policy never touches the router, the pager or the clock.

Interface:
    eviction_policy         the pager's expert eviction policy for every model
    loads_whole_models      a cold start reads every expert too (model-swap, all-resident)
    preload(model, slots)   experts a cold start reads with the dense weights
    streams_cold_starts     a cold model runs before its preload has landed (its steps wait
                            for the experts they need; its steps park on their reads meanwhile)
    pins_models             weights never leave (all-resident): no idle parking
    plans_host_cache        the host cache is shared by request rate
    check_fits(view, name)  refuse, at registration, a model the budget can never run
    admit(view) -> Admitted       cold models with requests that may load now, and the idle
                                  models parked to make room for them
    cold_start(view, name) -> ColdStart   how a request for a cold model would start now
    drain(view) -> model | None   a busy model to finish its running requests and leave, so
                                  a cold model that has waited gets a turn
    plan_slots(view) -> {model: slots}   for every model in the view, within the budget

`rate` plans from traffic (mox.router.planner); `lru`/`lfu` split the expert budget equally
with the planner off; `model-swap` is the serverless baseline (whole models in, whole models
out, LRU); `all-resident` loads everything at start-up and is the upper bound.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from mox.errors import MoxError
from mox.messages import ModelState
from mox.router.planner import ModelDemand, plan_slots, settle

# A miss's read when none has been measured yet: a cold NVMe-class read (DESIGN.md's machine
# facts: 1.5-2.5 GB/s sequential), the pessimistic end.
DEFAULT_READ_BYTES_PER_S = 1.5e9
# What a miss adds beyond its bytes: an I/O thread's hand-off and a wave boundary in the step
# (~0.1-0.3 ms on this machine's 2 cores).
MISS_OVERHEAD_S = 2e-4
# A cold model that has waited this long for room gets a turn: the busy model that has held
# memory longest (at least this long) finishes its running requests, starts no new ones and is
# parked (`drain`). Without turns a model that never idles starves the others: in the bench's
# start burst the most requested model waited 20-37 s behind two models that kept getting
# requests. Admitting the waiter at a smaller size instead squeezes every busy pool (at 15 s
# the bench spiralled into thrashing, TPOT p50 1.7 s). A few requests' worth of decode.
TURN_S = 5.0


@dataclass(frozen=True)
class ModelView:
    """One model with an expert pool, as the router sees it at one moment."""

    name: str
    state: ModelState
    dense_nbytes: int
    expert_nbytes: int
    top_k: int
    max_slots: int                  # every expert of the model resident
    num_slots: int                  # expert slots it is budgeted now
    has_work: bool                  # queued or running requests
    request_rate: float             # requests per second (the planner's value)
    last_active: float              # last step or arrival
    oldest_arrival: float = math.inf        # of its tracked requests
    num_layers: int = 1                     # MoE layers (the working set is top_k per layer)
    hit_rates: np.ndarray | None = None     # [N + 1] H(S) of its pool's recent accesses
    accesses_per_request: float = 0.0       # (layer, expert) accesses one request makes
    run_slots: int = 0                      # its run size (planner.run_slots of its
                                            # curve, built once with the view)
    read_bytes_per_s: float | None = None   # what its expert reads achieved (None: none yet)
    resized_ago_s: float = math.inf         # since its pool's size last changed
    priority: float = 1.0                   # the operator's weight on its value
    pinned: bool = False                    # the operator's: every expert, while registered
    loaded_at: float = -math.inf            # when its last load started (its turn began)
    draining: bool = False                  # finishing its running requests, then parked

    @property
    def miss_cost_s(self) -> float:
        """What one miss costs: reading the expert, plus its share of a step's stall."""
        bandwidth = self.read_bytes_per_s or DEFAULT_READ_BYTES_PER_S
        return self.expert_nbytes / bandwidth + MISS_OVERHEAD_S

    @property
    def holds_device_memory(self) -> bool:
        return self.state in (ModelState.LOADING, ModelState.WARM)

    @property
    def is_idle_warm(self) -> bool:
        """Warm with nothing to do, and not pinned: parking it may make room."""
        return self.state == ModelState.WARM and not self.has_work and not self.pinned


@dataclass(frozen=True)
class MemoryView:
    budget_bytes: int | None        # device bytes for dense weights + expert slots
    models: tuple[ModelView, ...]
    now: float = 0.0                # the clock the view's times are on

    def holding(self) -> list[ModelView]:
        return [m for m in self.models if m.holds_device_memory]

    def with_state(self, name: str, state: ModelState) -> MemoryView:
        return self.with_model(dataclasses.replace(_find(self, name), state=state))

    def with_model(self, model: ModelView) -> MemoryView:
        """The view with `model` in place of the model of its name."""
        models = tuple(model if m.name == model.name else m for m in self.models)
        return dataclasses.replace(self, models=models)


@dataclass(frozen=True)
class Admitted:
    """What admission decided, and the view as it will be once the router applies it."""

    view: MemoryView
    park: tuple[str, ...] = ()          # idle warm models whose weights leave now
    load: tuple[str, ...] = ()          # cold models with requests that start loading now


@dataclass(frozen=True)
class MemoryPlan:
    slots: dict[str, int]               # expert slots for every model in the view
    park: tuple[str, ...] = ()
    load: tuple[str, ...] = ()
    preload: dict[str, int] = dataclasses.field(default_factory=dict)  # experts per load


@dataclass(frozen=True)
class ColdStart:
    """How a request for a cold model, arriving now, would start (`MemoryPolicy.cold_start`):
    what a fleet's request router weighs against sending it where the model is warm."""

    waits: bool = False             # for a busy model's turn (TURN_S), which then drains it
    parks: tuple[str, ...] = ()     # idle models it parks, whose next requests read them again
    # idle models whose pools it shrinks -> the share of each pool it takes (their next
    # requests read that share again)
    squeezes: Mapping[str, float] = dataclasses.field(default_factory=dict)


class MemoryPolicy:
    eviction_policy = "rate"
    loads_whole_models = False
    streams_cold_starts = False
    pins_models = False
    plans_host_cache = False
    minimum_is = "its dense weights and top_k experts"

    def budget(self, view: MemoryView) -> int | None:
        return view.budget_bytes

    def minimum_bytes(self, model: ModelView) -> int:
        """Device bytes the model needs to run at all once it holds memory (a pinned model:
        all of it)."""
        if model.pinned:
            return model.dense_nbytes + model.max_slots * model.expert_nbytes
        return model.dense_nbytes + model.top_k * model.expert_nbytes

    def admission_bytes(self, model: ModelView, budget: int | None) -> int:
        """Device bytes the model holds room for while it has work (admission's unit)."""
        return self.minimum_bytes(model)

    def preload(self, model: ModelView, slots: int) -> int:
        """Experts a load reads with the dense weights, given the slots planned for it: every
        one for whole-model policies and pinned models, none (paged on demand) otherwise."""
        return slots if self.loads_whole_models or model.pinned else 0

    def check_fits(self, view: MemoryView, name: str) -> None:
        """The model's minimum must fit beside every pinned model's."""
        model, budget = _find(view, name), self.budget(view)
        pinned = sum(self.minimum_bytes(m) for m in view.models if m.pinned and m.name != name)
        if budget is not None and pinned + self.minimum_bytes(model) > budget:
            what = "all of it: it is pinned" if model.pinned else self.minimum_is
            beside = f" beside {pinned} bytes of pinned models" if pinned else ""
            raise MoxError(f"model {name!r} needs {self.minimum_bytes(model)} bytes of "
                           f"device memory to run ({what}, top_k = {model.top_k}){beside}; "
                           f"the budget is {budget}")

    def plan(self, admitted: Admitted) -> MemoryPlan:
        """What the router applies after admission: slots for the view as admission leaves
        it, and the experts each load reads with its dense weights."""
        slots = self.plan_slots(admitted.view)
        preload = {m.name: self.preload(m, slots[m.name]) for m in admitted.view.models
                   if m.name in admitted.load}
        return MemoryPlan(slots, admitted.park, admitted.load, preload)

    def admit(self, view: MemoryView) -> Admitted:
        """Admit cold models with requests (and pinned ones), oldest request first, while the
        policy finds room for them (parking idle models where it must); the rest wait for a
        busy model to go idle."""
        park, load = [], []
        cold = [m for m in view.models
                if m.state == ModelState.COLD and (m.has_work or m.pinned)]
        for model in sorted(cold, key=lambda m: m.oldest_arrival):
            room = self.make_room(view, model)
            view, park = room.view, park + list(room.park)
            if not room.load:
                break
            view = view.with_state(model.name, ModelState.LOADING)
            load.append(model.name)
        return Admitted(view, tuple(park), tuple(load))

    def make_room(self, view: MemoryView, model: ModelView) -> Admitted:
        """Park idle models (lowest `park_order` first) until `model`'s admission bytes fit
        beside those of the models that hold memory; `load` is (model,) if it then fits, or if
        only pinned models hold memory then (nothing would free more: it runs in what is left,
        which `check_fits` ensured is at least its minimum)."""
        budget, parked = self.budget(view), []
        while budget is not None:
            committed = sum(self.admission_bytes(m, budget) for m in view.holding())
            if committed + self.admission_bytes(model, budget) <= budget:
                break
            idle = [m for m in view.holding() if m.is_idle_warm]
            if not idle:
                if all(m.pinned for m in view.holding()):
                    break
                return Admitted(view, tuple(parked))
            victim = min(idle, key=self.park_order)
            view = view.with_state(victim.name, ModelState.COLD)
            parked.append(victim.name)
        return Admitted(view, tuple(parked), (model.name,))

    def cold_start(self, view: MemoryView, name: str) -> ColdStart:
        """How a request for the cold model `name` would start if it arrived now: `admit` on
        the view with the request counted, so it waits behind a cold model waiting already.
        Squeezes count idle pools alone, each down to top_k: room a plan would take from
        busy pools above their run sizes goes unpriced."""
        model = dataclasses.replace(_find(view, name), has_work=True, oldest_arrival=view.now)
        admitted = self.admit(view.with_model(model))
        if name not in admitted.load:
            return ColdStart(waits=True)
        return ColdStart(parks=admitted.park, squeezes=self._squeezes(admitted.view, model))

    def _squeezes(self, view: MemoryView, model: ModelView) -> dict[str, float]:
        """The idle pools that would give `model` the room it takes beyond what is free now
        (least valued first, as parking goes), with the share of each pool taken."""
        budget = self.budget(view)
        if budget is None:
            return {}
        holding = [m for m in view.holding() if m.name != model.name]
        used = sum(m.dense_nbytes + m.num_slots * m.expert_nbytes for m in holding)
        short = used + self.admission_bytes(model, budget) - budget
        squeezes = {}
        for m in sorted((m for m in holding if m.is_idle_warm), key=self.park_order):
            if short <= 0:
                break
            taken = min(short, max(0, m.num_slots - m.top_k) * m.expert_nbytes)
            if taken:
                squeezes[m.name] = taken / (m.num_slots * m.expert_nbytes)
                short -= taken
        return squeezes

    def park_order(self, model: ModelView) -> tuple:
        return (model.request_rate, model.last_active)

    def drain(self, view: MemoryView) -> str | None:
        """A busy model to drain so that the cold model waiting longest gets a turn, or
        None (the base policies: a waiter waits for a busy model to go idle)."""
        return None

    def holding_fits(self, view: MemoryView) -> bool:
        """Do the minimums of the models that hold memory fit the budget?"""
        budget = self.budget(view)
        return budget is None or sum(self.minimum_bytes(m) for m in view.holding()) <= budget

    def plan_slots(self, view: MemoryView) -> dict[str, int]:
        """Expert slots for every model in the view; what the models that hold memory then
        take (dense + slots) stays within the budget."""
        slots = self.divide(view)
        budget = self.budget(view)
        if budget is not None:
            used = sum(m.dense_nbytes + slots[m.name] * m.expert_nbytes for m in view.holding())
            assert used <= budget, (used, budget, slots)
        assert all(slots[m.name] == 0 or min(m.top_k, m.max_slots) <= slots[m.name] <= m.max_slots
                   for m in view.models), slots
        return slots

    def divide(self, view: MemoryView) -> dict[str, int]:
        raise NotImplementedError


class PlannedMemory(MemoryPolicy):
    """`rate`: expert slots follow request rates and expert popularity (mox.router.planner);
    the host cache is shared by rate too. A model with work is admitted at its run size (the
    knee of its miss-ratio curve; every expert until the curve is known), at most the budget."""

    plans_host_cache = True
    streams_cold_starts = True

    def preload(self, model: ModelView, slots: int) -> int:
        """Its run size's most used experts (every one while its curve is unknown, as
        model-swap loads): what its first steps would otherwise miss one wave at a time."""
        return slots if model.pinned else min(slots, model.run_slots)

    def drain(self, view: MemoryView) -> str | None:
        """Once the longest-waiting cold model has waited `TURN_S`: the busy, unpinned warm
        model whose turn began longest ago (at least `TURN_S` ago), if parking it would make
        room; one drain at a time."""
        if any(m.draining for m in view.models):
            return None
        waiting = [m for m in view.models if m.state == ModelState.COLD and m.has_work]
        if not waiting:
            return None
        waiter = min(waiting, key=lambda m: m.oldest_arrival)
        turns = [m for m in view.models if m.state == ModelState.WARM and m.has_work
                 and not m.pinned and view.now - m.loaded_at >= TURN_S]
        if view.now - waiter.oldest_arrival < TURN_S or not turns:
            return None
        victim = min(turns, key=lambda m: m.loaded_at)
        room = self.make_room(view.with_state(victim.name, ModelState.COLD), waiter)
        return victim.name if room.load else None

    def admission_bytes(self, model: ModelView, budget: int | None) -> int:
        if model.pinned or not model.has_work:
            return self.minimum_bytes(model)
        slots = max(model.top_k, model.run_slots)
        if budget is not None:         # at most the budget (check_fits: top_k fits in it)
            slots = min(slots, (budget - model.dense_nbytes) // model.expert_nbytes)
        return model.dense_nbytes + slots * model.expert_nbytes

    def divide(self, view: MemoryView) -> dict[str, int]:
        holding = view.holding()
        budget = self.budget(view)
        if budget is not None:
            budget -= sum(m.dense_nbytes for m in holding)
        demands = [ModelDemand(m.name, m.request_rate, m.has_work, _hit_rates(m),
                               m.accesses_per_request, m.miss_cost_s, m.expert_nbytes, m.top_k,
                               m.num_layers, m.num_slots, m.resized_ago_s, m.priority,
                               m.pinned, m.run_slots) for m in holding]
        slots = settle(plan_slots(demands, budget), demands)
        return {m.name: slots.get(m.name, 0) for m in view.models}


class EqualSplitMemory(MemoryPolicy):
    """`lru` / `lfu`: the planner off; every model's dense weights are reserved and the rest
    is split equally, so each warm model's pool has a fixed size."""

    def __init__(self, eviction: str) -> None:
        self.eviction_policy = eviction

    def share_bytes(self, view: MemoryView) -> int | None:
        """Expert bytes per unpinned model: the budget less every model's dense weights and
        the pinned models' experts, split equally."""
        budget = self.budget(view)
        unpinned = [m for m in view.models if not m.pinned]
        if budget is None or not unpinned:
            return None
        pinned = sum(m.max_slots * m.expert_nbytes for m in view.models if m.pinned)
        return (budget - pinned - sum(m.dense_nbytes for m in view.models)) // len(unpinned)

    def check_fits(self, view: MemoryView, name: str) -> None:
        model, share = _find(view, name), self.share_bytes(view)
        if model.pinned:
            super().check_fits(view, name)
        elif share is not None and share < model.top_k * model.expert_nbytes:
            raise MoxError(f"an equal split of the device budget leaves {share} bytes of "
                           f"experts per model; model {name!r} needs top_k experts")

    def make_room(self, view: MemoryView, model: ModelView) -> Admitted:
        return Admitted(view, (), (model.name,))       # every model's share is reserved

    def divide(self, view: MemoryView) -> dict[str, int]:
        share = self.share_bytes(view)
        slots = {}
        for m in view.models:
            fit = (m.max_slots if share is None or m.pinned
                   else min(m.max_slots, share // m.expert_nbytes))
            # a share below top_k experts cannot run a step (check_fits refused the model)
            slots[m.name] = fit if m.holds_device_memory and fit >= m.top_k else 0
        return slots


class ModelSwapMemory(MemoryPolicy):
    """`model-swap`: a model's whole checkpoint loads on its first request (with the same
    reader), and idle whole models leave least recently used first to make room."""

    loads_whole_models = True
    minimum_is = "its whole checkpoint"

    def minimum_bytes(self, model: ModelView) -> int:
        return model.dense_nbytes + model.max_slots * model.expert_nbytes

    def park_order(self, model: ModelView) -> tuple:
        return (model.last_active,)

    def divide(self, view: MemoryView) -> dict[str, int]:
        return {m.name: m.max_slots if m.holds_device_memory else 0 for m in view.models}


class AllResidentMemory(ModelSwapMemory):
    """`all-resident`: every model whole, from start-up, with no budget."""

    pins_models = True

    def budget(self, view: MemoryView) -> int | None:
        return None


def make_memory_policy(name: str) -> MemoryPolicy:
    if name == "rate":
        return PlannedMemory()
    if name in ("lru", "lfu"):
        return EqualSplitMemory(name)
    if name == "model-swap":
        return ModelSwapMemory()
    if name == "all-resident":
        return AllResidentMemory()
    raise ValueError(f"unknown memory policy {name!r}")


def _hit_rates(model: ModelView) -> np.ndarray:
    """The model's curve, or none yet (no slot saves anything known)."""
    if model.hit_rates is None:
        return np.zeros(model.max_slots + 1)
    return model.hit_rates


def _find(view: MemoryView, name: str) -> ModelView:
    return next(m for m in view.models if m.name == name)
