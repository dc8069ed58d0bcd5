"""What the models hold on the device, and the one way to change it: dense weights count by
model state, expert slots live in each model's pool. The router's plans are applied here, in
slots (the unit of every plan and pool).

Invariant kept by `apply`: shrinks land before grows, so the sum of what the pools hold never
passes what the plan allows, even mid-application.
"""

from __future__ import annotations

from collections.abc import Callable

from mox.pager import HostCache
from mox.router.served_model import ServedModel


class Residency:
    def __init__(self, models: dict[str, ServedModel], host_cache: HostCache | None,
                 clock: Callable[[], float]) -> None:
        self.models = models            # the router's table (shared, not copied)
        self.host_cache = host_cache
        self.clock = clock
        # removed while their weights loaded: what they hold is freed when the load lands
        # (the router's thread does not wait for it), and the plans leave it out meanwhile
        self.closing: list[ServedModel] = []

    def used_bytes(self) -> int:
        """Dense weights of the models that hold them + every pool's allocated slots."""
        models = list(self.models.values())
        dense = sum(m.dense_nbytes for m in models if m.holds_device_memory)
        return (dense + sum(m.pool.allocated_bytes() for m in models if m.pool is not None)
                + self.closing_bytes())

    def closing_bytes(self) -> int:
        """What models removed while loading hold until their loads land."""
        return sum(m.dense_nbytes + m.pool.allocated_bytes() for m in self.closing)

    def apply(self, slots: dict[str, int]) -> None:
        """Per-model slot counts: shrinks first (waiting out their in-flight loads, so the
        memory is really free), then grows. A pool that grows while its model's rate rises
        (or from nothing) prefetches its most used experts into the new slots where the pool
        prefetches at all: on a CPU the reads compete with compute for the cores and, after
        a cold start, for the disk (a burst of eight cold models, rate, uniform routing,
        bench-size: the third model's 22-token prefill took 1.9 s with prefetch into grown
        pools, 1.0-1.4 s without; a prefill marks most experts "popular")."""
        pools = {name: self.models[name].pool for name in slots}
        for name in [n for n in slots if slots[n] < pools[n].num_slots]:
            pool = pools[name]
            pool.resize(slots[name])
            if pool.allocated_bytes() > slots[name] * pool.expert_nbytes:
                pool.wait_for_loads()
        for name in [n for n in slots if slots[n] > pools[n].num_slots]:
            pool, before = pools[name], pools[name].num_slots
            pool.resize(slots[name])
            if pool.prefetch_enabled and (
                    before == 0 or self.models[name].traffic.is_rising(self.clock())):
                pool.prefetch_popular(slots[name] - before)

    def share_host_cache(self) -> None:
        """Host cache quotas in proportion to request rates (with no traffic anywhere, no
        quotas): a burst on one model cannot flush the RAM copies of the others."""
        host = self.host_cache
        if host is None:
            return
        now = self.clock()
        rates = {n: m.traffic.request_rate(now) for n, m in self.models.items()
                 if m.pool is not None}
        total = sum(rates.values())
        for name, rate in rates.items():
            host.set_quota(name, None if total <= 0 else int(host.budget_bytes * rate / total))

    def host_cache_bytes(self, name: str) -> int | None:
        return None if self.host_cache is None else self.host_cache.used_by(name)
