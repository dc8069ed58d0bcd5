"""Memory policies: how the router divides the device budget, one class per `policy=`.

Interface (called on the router's thread):
    eviction_policy         the pager's expert eviction policy for every model
    loads_whole_models      a cold start reads every expert too (model-swap, all-resident)
    pins_models             weights never leave (all-resident): no idle parking
    check_fits(model)       refuse, at registration, a model the budget can never run
    make_room(model) -> bool   park idle models until `model` may start loading
    plan_slots() -> {model: expert slots}   for every model with a pager entry

`rate` plans from traffic (mox.router.planner); `lru`/`lfu` split the expert budget equally with
the planner off; `model-swap` is the serverless baseline (whole models in, whole models out,
LRU); `all-resident` loads everything at start-up and is the upper bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mox.errors import MoxError
from mox.messages import ModelState
from mox.router.planner import ModelDemand, plan_slots, settle
from mox.router.served_model import ServedModel

if TYPE_CHECKING:
    from mox.router import Router


class MemoryPolicy:
    eviction_policy = "rate"
    loads_whole_models = False
    pins_models = False
    plans_host_cache = False
    minimum_is = "its dense weights and top_k experts"

    def __init__(self, router: Router) -> None:
        self.router = router

    @property
    def budget(self) -> int | None:
        return self.router.config.device_memory

    def holding(self) -> list[ServedModel]:
        return [m for m in self.router.models.values() if m.holds_device_memory]

    def paged(self) -> list[ServedModel]:
        """Models with a slot pool (opened without error)."""
        return [m for m in self.router.models.values() if m.ckpt is not None]

    def expert_bytes(self, model: ServedModel, slots: int) -> int:
        return slots * self.router.residency.slot_bytes(model.name)

    def all_slots(self, model: ServedModel) -> int:
        return model.ckpt.spec.num_moe_layers * model.ckpt.spec.num_experts

    def minimum_bytes(self, model: ServedModel) -> int:
        """Device bytes the model needs to run at all once it holds memory."""
        return model.dense_nbytes + self.expert_bytes(model, model.ckpt.spec.top_k)

    def check_fits(self, model: ServedModel) -> None:
        if self.budget is not None and self.minimum_bytes(model) > self.budget:
            raise MoxError(f"model {model.name!r} needs {self.minimum_bytes(model)} bytes of "
                           f"device memory to run ({self.minimum_is}, top_k = "
                           f"{model.ckpt.spec.top_k}); the budget is {self.budget}")

    def make_room(self, model: ServedModel) -> bool:
        """Park idle models (lowest value first) until `model`'s minimum fits beside the
        minimums of the models that hold memory."""
        if self.budget is None:
            return True
        router = self.router
        while True:
            committed = sum(self.minimum_bytes(m) for m in self.holding())
            if committed + self.minimum_bytes(model) <= self.budget:
                return True
            idle = [m for m in self.holding()
                    if m.state == ModelState.WARM and not router.has_requests(m.name)]
            if not idle:
                return False
            router.park(min(idle, key=self.park_order))

    def park_order(self, model: ServedModel) -> tuple:
        now = self.router.clock()
        return (model.traffic.request_rate(now), model.last_active)

    def plan_slots(self) -> dict[str, int]:
        raise NotImplementedError


class PlannedMemory(MemoryPolicy):
    """`rate`: expert slots follow request rates and expert popularity (mox.router.planner); the
    host cache is shared by rate too."""

    plans_host_cache = True

    def plan_slots(self) -> dict[str, int]:
        router, now = self.router, self.router.clock()
        holding = self.holding()
        budget = (None if self.budget is None
                  else self.budget - sum(m.dense_nbytes for m in holding))
        demands = [ModelDemand(m.name, m.traffic.request_rate(now),
                               router.has_requests(m.name),
                               router.pager.usage(m.name).probabilities(now),
                               router.residency.slot_bytes(m.name), m.ckpt.spec.top_k,
                               router.pager.pool(m.name).target_slots,
                               router.pager.resized_ago(m.name))
                   for m in holding]
        slots = settle(plan_slots(demands, budget), demands)
        return {m.name: slots.get(m.name, 0) for m in self.paged()}


class EqualSplitMemory(MemoryPolicy):
    """`lru` / `lfu`: the planner off; every model's dense weights are reserved and the rest
    is split equally, so each warm model's pool has a fixed size."""

    def __init__(self, router: Router, eviction: str) -> None:
        super().__init__(router)
        self.eviction_policy = eviction

    def share_bytes(self) -> int | None:
        paged = self.paged()
        if self.budget is None or not paged:
            return None
        return (self.budget - sum(m.dense_nbytes for m in paged)) // len(paged)

    def check_fits(self, model: ServedModel) -> None:
        share = self.share_bytes()
        if share is not None and share < self.expert_bytes(model, model.ckpt.spec.top_k):
            raise MoxError(f"an equal split of the device budget leaves {share} bytes of "
                           f"experts per model; model {model.name!r} needs top_k experts")

    def make_room(self, model: ServedModel) -> bool:
        return True                      # every model's share is reserved

    def plan_slots(self) -> dict[str, int]:
        share = self.share_bytes()
        slots = {}
        for m in self.paged():
            full = self.all_slots(m)
            fit = full if share is None else share // self.router.residency.slot_bytes(m.name)
            slots[m.name] = min(full, fit) if m.holds_device_memory else 0
        return slots


class ModelSwapMemory(MemoryPolicy):
    """`model-swap`: a model's whole checkpoint loads on its first request (with the same
    reader), and idle whole models leave least recently used first to make room."""

    loads_whole_models = True
    minimum_is = "its whole checkpoint"

    def minimum_bytes(self, model: ServedModel) -> int:
        return model.dense_nbytes + self.expert_bytes(model, self.all_slots(model))

    def park_order(self, model: ServedModel) -> tuple:
        return (model.last_active,)

    def plan_slots(self) -> dict[str, int]:
        return {m.name: self.all_slots(m) if m.holds_device_memory else 0
                for m in self.paged()}


class AllResidentMemory(ModelSwapMemory):
    """`all-resident`: every model whole, from start-up, with no budget."""

    pins_models = True

    @property
    def budget(self) -> int | None:
        return None


def make_memory_policy(name: str, router: Router) -> MemoryPolicy:
    if name == "rate":
        return PlannedMemory(router)
    if name in ("lru", "lfu"):
        return EqualSplitMemory(router, name)
    if name == "model-swap":
        return ModelSwapMemory(router)
    if name == "all-resident":
        return AllResidentMemory(router)
    raise ValueError(f"unknown memory policy {name!r}")
