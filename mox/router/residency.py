"""What the models hold on the device, and the one way to change it: dense weights count by
model state, expert slots live in the pager's pools. The router's plans are applied here.

Invariant kept by `apply`: shrinks land before grows, so the sum of what the pools hold never
passes what the plan allows, even mid-application.
"""

from __future__ import annotations

from collections.abc import Callable

from mox.pager import ExpertPager
from mox.router.served_model import ServedModel


class Residency:
    def __init__(self, pager: ExpertPager, models: dict[str, ServedModel],
                 clock: Callable[[], float], *, prefetch: bool) -> None:
        self.pager = pager
        self.models = models            # the router's table (shared, not copied)
        self.clock = clock
        # On a CPU the reads compete with compute for the cores and, after a cold start, for
        # the disk: a burst of eight cold models, rate, uniform routing (bench-size): the
        # third model's 22-token prefill took 1.9 s with prefetch into grown pools, 1.0-1.4 s
        # without (a prefill marks most experts "popular").
        self.prefetch = prefetch

    def slot_bytes(self, name: str) -> int:
        return self.pager.pool(name).expert_nbytes

    def slots(self, name: str) -> int:
        return self.pager.pool(name).target_slots

    def used_bytes(self) -> int:
        """Dense weights of the models that hold them + every pool's allocated slots."""
        dense = sum(m.dense_nbytes for m in self.models.values() if m.holds_device_memory)
        experts = sum(self.pager.allocated_bytes(name) for name, m in self.models.items()
                      if m.ckpt is not None)
        return dense + experts

    def apply(self, slots: dict[str, int]) -> None:
        """Per-model slot counts: shrinks first (waiting out their in-flight loads, so the
        memory is really free), then grows; a model that grows while its rate rises (or from
        nothing) prefetches its most used experts into the new slots (if `prefetch`)."""
        shrinking = [n for n in slots if slots[n] < self.slots(n)]
        growing = [n for n in slots if slots[n] > self.slots(n)]
        for name in shrinking:
            self.pager.set_budget(name, slots[name] * self.slot_bytes(name))
            if self.pager.allocated_bytes(name) > slots[name] * self.slot_bytes(name):
                self.pager.wait_for_loads(name)
        for name in growing:
            before = self.slots(name)
            self.pager.set_budget(name, slots[name] * self.slot_bytes(name))
            if self.prefetch and (before == 0
                                  or self.models[name].traffic.is_rising(self.clock())):
                self.pager.prefetch_popular(name, slots[name] - before)

    def share_host_cache(self) -> None:
        """Host cache quotas in proportion to request rates (with no traffic anywhere, no
        quotas): a burst on one model cannot flush the RAM copies of the others."""
        host = self.pager.loader.host_cache
        if host is None:
            return
        now = self.clock()
        rates = {n: m.traffic.request_rate(now) for n, m in self.models.items()
                 if m.ckpt is not None}
        total = sum(rates.values())
        for name, rate in rates.items():
            host.set_quota(name, None if total <= 0 else int(host.budget_bytes * rate / total))

    def host_cache_bytes(self, name: str) -> int | None:
        host = self.pager.loader.host_cache
        return None if host is None else host.used_by(name)
