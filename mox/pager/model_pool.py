"""One model's experts as the pager serves them: its slot pool, eviction policy, usage, loads in
flight and statistics. `ExpertPager.add_model` returns it; the model's decoder and the router
hold it (no lookups by name).

Design note.
- A MoE layer step asks for the experts its tokens route to through `waves()`. The first wave
  is what is already resident (pinned at once, computed while the misses load on the I/O
  threads); later waves are the misses, loaded into free slots or slots of unleased experts
  the model's eviction policy gives up. When a step needs more experts than the pool holds (a
  long prefill), each wave releases its slots before the next loads: compute, page the next
  group over the finished one, continue. A pool of >= top_k slots always progresses.
- `prefetch()` queues loads without blocking; a prefetched expert counts a prefetch hit on
  first use. It evicts only experts outside the layers the caller protects.
- One lock (the pager's) guards every pool's tables; I/O threads write slot bytes outside it
  (the slot is reserved) and commit under it. A failed load frees its slot and its error
  reaches the step that waits for it; the tables never show a slot with partial bytes.
- Budget, in slots: occupied slots stay within `num_slots`, except for experts leased when it
  shrank, which leave as their leases end.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from mox.errors import MoxError
from mox.kernels import NOT_RESIDENT, MoEWorkspace
from mox.loaders import Checkpoint
from mox.loaders.stream import DEMAND, PREFETCH
from mox.pager.eviction import ExpertKey, make_policy
from mox.pager.expert_loader import ExpertLoader, LoadResult
from mox.pager.slot_pool import SlotPool
from mox.pager.stats import PAGE_IN_BUCKETS, PagerStats
from mox.pager.usage import ExpertUsage

# Prefetch on a rising rate only experts clearly above uniform use: under near-uniform
# routing the guesses cost reads that demand misses then queue behind (measured on the
# 12-model load test: TPOT p50 1.28 s with them, 0.84 s without).
POPULAR_OVER_UNIFORM = 2.0
@dataclass(frozen=True)
class Lease:
    """Experts of one layer pinned for one wave; `slot_map [E]` maps only them."""

    moe_layer: int
    slots: tuple[int, ...]
    slot_map: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None = None      # [S, 2I] expert biases, where the model has them
    b2: torch.Tensor | None = None       # [S, H]


@dataclass
class PagerShared:
    """What every model's pool shares: the I/O (reader, host cache), the clock, and the one
    lock over all pools' tables with its condition (a slot was freed or committed)."""

    loader: ExpertLoader
    clock: Callable[[], float]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)


class ModelPool:
    def __init__(self, shared: PagerShared, name: str, ckpt: Checkpoint, dtype: torch.dtype,
                 device: torch.device, num_slots: int | None, policy: str,
                 prefetch: bool) -> None:
        spec = ckpt.spec
        self.name, self.ckpt, self.top_k = name, ckpt, spec.top_k
        self.moe_layers = [i for i, is_moe in enumerate(spec.moe_layers) if is_moe]
        self.max_slots = len(self.moe_layers) * spec.num_experts     # every expert resident
        # predictive prefetch (the next layer's experts; popular experts into grown pools)
        self.prefetch_enabled = prefetch
        self._shared, self._lock, self._changed = shared, shared.lock, shared.changed
        self.slot_pool = SlotPool(len(self.moe_layers), spec.num_experts, spec.hidden_size,
                                  spec.moe_intermediate_size, dtype, device,
                                  self._checked(num_slots), spec.expert_bias)
        self.policy = make_policy(policy)
        self.usage = ExpertUsage(len(self.moe_layers), spec.num_experts, spec.top_k)
        self.workspace = MoEWorkspace()
        self.counters = PagerStats()
        self._inflight: dict[ExpertKey, Future] = {}
        self._resized_at = -math.inf          # when `resize` last changed the slot count

    @property
    def loader(self) -> ExpertLoader:
        return self._shared.loader

    @property
    def clock(self) -> Callable[[], float]:
        return self._shared.clock

    @property
    def expert_nbytes(self) -> int:
        return self.slot_pool.expert_nbytes

    @property
    def num_slots(self) -> int:
        """The slots the model is budgeted (the pool drains to this after a shrink)."""
        return self.slot_pool.target_slots

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def _checked(self, num_slots: int | None) -> int:
        """`num_slots` as a slot count: None is every expert, 0 is parked, and otherwise a
        step needs at least top_k."""
        if num_slots is None:
            return self.max_slots
        if 0 < num_slots < min(self.top_k, self.max_slots):
            raise MoxError(f"model {self.name!r}: {num_slots} expert slots; a step needs at "
                           f"least top_k = {self.top_k}")
        return min(num_slots, self.max_slots)

    # ---- budget ------------------------------------------------------------------------
    def resize(self, num_slots: int) -> None:
        """Budget the model `num_slots` slots: unleased experts past it leave now, leased ones
        as their leases end; the tensors follow once that is safe."""
        with self._lock:
            slots = self._checked(num_slots)
            if slots != self.slot_pool.target_slots:
                self._resized_at = self.clock()
            self.slot_pool.target_slots = slots
            self._drain()

    def resized_ago(self) -> float:
        """Seconds since the model's slot count last changed."""
        return self.clock() - self._resized_at

    def allocated_bytes(self) -> int:
        """Device bytes the pool tensors take now (the budget bounds this once a shrink has
        drained)."""
        with self._lock:
            return self.slot_pool.num_slots * self.slot_pool.expert_nbytes

    def close(self) -> None:
        """The model leaves (no step may be using it): its in-flight loads land, then go."""
        self.wait_for_loads()
        with self._lock:
            assert self.slot_pool.is_quiet, f"{self.name} still has leased experts"

    # ---- leases ------------------------------------------------------------------------
    def waves(self, moe_layer: int, expert_ids: Iterable[int]) -> Iterator[Lease]:
        """Leases covering `expert_ids` of one layer, resident ones first; each lease is
        released when the caller asks for the next (or stops iterating)."""
        wanted = sorted(set(expert_ids))
        with self._lock:
            if self.slot_pool.target_slots == 0:
                raise MoxError(f"model {self.name!r} has no expert memory (it is parked)")
            self.usage.record(moe_layer, wanted, self.clock())
            self._settle_prefetches(moe_layer, set(wanted))
            ready, pending, missing = self._classify(moe_layer, wanted)
            started = self._start_loads(moe_layer, missing, prefetched=False)
            pending, missing = pending + started, missing[len(started):]
        while True:
            if ready:
                lease = self._lease(moe_layer, ready)
                try:
                    yield lease
                finally:
                    self.release(lease)
            if not pending and not missing:
                return
            ready, gone = self._wait(moe_layer, pending)
            with self._lock:
                missing += gone
                while missing and not ready and not self._has_room():
                    self._changed.wait()
                # the next group loads while the caller computes `ready`
                pending = self._start_loads(moe_layer, missing, prefetched=False)
                missing = missing[len(pending):]

    def acquire(self, moe_layer: int, expert_ids: Iterable[int]) -> Lease:
        """All of `expert_ids` resident and pinned at once (they must fit the pool)."""
        wanted = sorted(set(expert_ids))
        pool = self.slot_pool
        if len(wanted) > pool.target_slots:
            raise MoxError(f"{len(wanted)} experts do not fit {pool.target_slots} slots")
        slots: dict[int, int] = {}
        for lease in self.waves(moe_layer, wanted):
            with self._lock:
                for index in lease.slots:
                    pool.slots[index].pins += 1          # keep them past this wave
                    slots[pool.slots[index].key[1]] = index
        with self._lock:
            return self._make_lease(moe_layer, [(moe_layer, e) for e in wanted],
                                    [slots[e] for e in wanted])

    def release(self, lease: Lease) -> None:
        # on CUDA the kernels that read these slots may still be queued: remember when they end
        done = (torch.cuda.current_stream(lease.w13.device).record_event()
                if lease.w13.is_cuda else None)
        with self._lock:
            for index in lease.slots:
                self.slot_pool.slots[index].pins -= 1
                self.slot_pool.slots[index].last_use = done
            self._drain()
            self._changed.notify_all()

    # ---- prefetch ----------------------------------------------------------------------
    def prefetch(self, moe_layer: int, expert_ids: Iterable[int],
                 protect_layers: Iterable[int] = ()) -> None:
        """Start loading these experts if a slot is free or held by an unleased expert
        outside `protect_layers`; never blocks, never waits for I/O."""
        with self._lock:
            _, _, missing = self._classify(moe_layer, sorted(set(expert_ids)), count=False)
            self._start_loads(moe_layer, missing, prefetched=True,
                              protect={moe_layer, *protect_layers})

    def prefetch_popular(self, limit: int) -> int:
        """Start loading up to `limit` of the model's popular experts (used at least
        `POPULAR_OVER_UNIFORM` times as often as uniform routing would) that are not resident,
        into free slots only (nothing is evicted for a guess). Returns how many started."""
        pool = self.slot_pool
        with self._lock:
            if not self.usage.steps.any():
                return 0                          # no history: any guess would be noise
            usage = self.usage.probabilities(self.clock())                      # [L, E]
            popular = POPULAR_OVER_UNIFORM * self.top_k / usage.shape[1]
            free = pool.target_slots - pool.num_occupied
            started = 0
            for flat in usage.ravel().argsort()[::-1]:
                if started >= min(limit, free) or usage.flat[flat] < popular:
                    break
                key = divmod(int(flat), usage.shape[1])
                if pool.lookup(key) == NOT_RESIDENT and key not in self._inflight:
                    started += len(self._start_loads(key[0], [key[1]], prefetched=True,
                                                     protect=set(range(self.num_moe_layers))))
            return started

    def wait_for_loads(self) -> None:
        """Block until the model's in-flight loads (prefetches included) have landed."""
        with self._lock:
            futures = list(self._inflight.values())
        for future in futures:
            future.exception()                     # waits; a failed prefetch is not an error

    # ---- internals (called with the lock held unless noted) -----------------------------
    def _classify(self, moe_layer: int, wanted: list[int], count: bool = True):
        """Split into resident (pinned now), already loading, and missing experts."""
        now, pool, stats = self.clock(), self.slot_pool, self.counters
        ready, pending, missing = [], [], []
        for expert in wanted:
            key = (moe_layer, expert)
            index = pool.lookup(key)
            if index != NOT_RESIDENT:
                if count:
                    slot = pool.slots[index]
                    slot.pins += 1
                    stats.hits += 1
                    stats.prefetch_hits += slot.prefetched
                    slot.prefetched = False
                    self.policy.on_access(key, now)
                ready.append(expert)
            elif key in self._inflight:
                pending.append(expert)
            else:
                missing.append(expert)
        if count:
            stats.misses += len(pending) + len(missing)
        return ready, pending, missing

    def _settle_prefetches(self, moe_layer: int, wanted: set[int]) -> None:
        """Now that this layer's routing is known: queued prefetches it does not want are
        dropped (their slots freed), and the ones it wants move ahead of other prefetches."""
        pool = self.slot_pool
        for key, future in list(self._inflight.items()):
            index = pool.loading_slot(key)
            if key[0] != moe_layer or not pool.slots[index].prefetched:
                continue
            if future.cancel():                        # still queued: nothing was read
                del self._inflight[key]
                pool.clear(index)
                if key[1] in wanted:
                    pool.reserve(index, key, prefetched=True)
                    self._inflight[key] = self.loader.reader.submit_call(
                        self._load, key, index, priority=DEMAND)
                else:
                    self.counters.prefetch_unused += 1

    def _has_room(self) -> bool:
        pool = self.slot_pool
        return bool(pool.free_slots(1)) or any(s.is_evictable for s in pool.slots)

    def _start_loads(self, moe_layer: int, experts: list[int], prefetched: bool,
                     protect: set[int] | None = None) -> list[int]:
        pool, stats = self.slot_pool, self.counters
        started = []
        for expert, index in zip(experts, self._claim_slots(len(experts), protect)):
            key = (moe_layer, expert)
            pool.reserve(index, key, prefetched)
            stats.prefetches += prefetched
            occupied = pool.num_occupied * pool.expert_nbytes
            stats.peak_resident_bytes = max(stats.peak_resident_bytes, occupied)
            self._inflight[key] = self.loader.reader.submit_call(
                self._load, key, index, priority=PREFETCH if prefetched else DEMAND)
            started.append(expert)
        return started

    def _claim_slots(self, count: int, protect: set[int] | None) -> list[int]:
        """Up to `count` free slots within the budget, evicting the policy's victims (chosen
        in one pass over the pool) if need be; experts of `protect` layers stay."""
        pool = self.slot_pool
        free = pool.free_slots(count)
        if len(free) == count:
            return free
        candidates = [pool.slots[i].key for i in pool.evictable()]
        if protect is not None:
            candidates = [k for k in candidates if k[0] not in protect]
        for key in self.policy.victims(candidates, count - len(free), self.clock()):
            self._evict(key)
        return pool.free_slots(count)

    def _evict(self, key: ExpertKey) -> None:
        index = self.slot_pool.lookup(key)
        self.counters.prefetch_unused += self.slot_pool.slots[index].prefetched
        self.slot_pool.clear(index)
        self.policy.on_evict(key)
        self.counters.evictions += 1

    def _load(self, key: ExpertKey, index: int) -> LoadResult:
        """On an I/O thread, without the lock: fill the reserved slot, then commit it."""
        layer, pool = self.moe_layers[key[0]], self.slot_pool
        try:
            result = self.loader.load(pool, index, self.ckpt.experts[layer, key[1]],
                                      (self.name, *key), f"layer {layer} expert {key[1]}",
                                      pool.slots[index].last_use)
        except BaseException:
            with self._lock:
                pool.clear(index)
                del self._inflight[key]
                self._changed.notify_all()
            raise
        with self._lock:
            pool.commit(index)
            pool.slots[index].pins -= 1     # the reservation ends; waiters pin what they use
            del self._inflight[key]
            self.policy.on_access(key, self.clock())
            self.counters.count_read(result)
            self._drain()
            self._changed.notify_all()
        return result

    def _wait(self, moe_layer: int, pending: list[int]) -> tuple[list[int], list[int]]:
        """Without the lock: wait for these loads; pin what arrived. Returns (ready, gone):
        `gone` were evicted again between their commit and our pin (rare; retried)."""
        with self._lock:
            futures = [self._inflight.get((moe_layer, e)) for e in pending]
        start = time.perf_counter()
        for future in futures:
            if future is not None:
                future.result()                   # a load error propagates to this step
        ready, gone = [], []
        with self._lock:
            self.counters.stall_seconds += time.perf_counter() - start
            for expert in pending:
                index = self.slot_pool.lookup((moe_layer, expert))
                if index == NOT_RESIDENT:
                    gone.append(expert)
                    continue
                slot = self.slot_pool.slots[index]
                slot.pins += 1
                self.counters.prefetch_hits += slot.prefetched
                slot.prefetched = False
                ready.append(expert)
        return ready, gone

    def _lease(self, moe_layer: int, experts: list[int]) -> Lease:
        with self._lock:
            self.counters.waves += 1
            keys = [(moe_layer, e) for e in experts]
            return self._make_lease(moe_layer, keys, [self.slot_pool.lookup(k) for k in keys])

    def _make_lease(self, moe_layer: int, keys: list[ExpertKey], slots: list[int]) -> Lease:
        pool = self.slot_pool
        assert all(pool.slots[i].pins > 0 for i in slots)
        return Lease(moe_layer, tuple(slots), pool.lease_map(list(zip(keys, slots))),
                     *pool.in_use())

    def _drain(self) -> None:
        """Bring the pool back within budget: evict unleased experts past it, and resize the
        tensors once nothing is pinned."""
        pool = self.slot_pool
        excess = pool.num_occupied - pool.target_slots
        if excess > 0:
            candidates = [pool.slots[i].key for i in pool.evictable()]
            for key in self.policy.victims(candidates, excess, self.clock()):
                self._evict(key)
        self._compact_if_quiet()

    def _compact_if_quiet(self) -> None:
        """Resize the pool tensors to the budget: growing keeps every slot where it is (leases
        keep reading the old tensors, whose pinned slots stay valid), so it only waits for
        in-flight loads; shrinking moves experts, so it waits until nothing is pinned."""
        pool = self.slot_pool
        if pool.num_slots < pool.target_slots and not any(s.loading for s in pool.slots):
            pool.grow()
        if pool.num_slots == pool.target_slots or not pool.is_quiet:
            return
        now = self.clock()
        occupied = [i for i, s in enumerate(pool.slots) if s.key is not None]
        occupied.sort(key=lambda i: self.policy.score(pool.slots[i].key, now), reverse=True)
        for index in occupied[pool.target_slots:]:
            self._evict(pool.slots[index].key)
        pool.compact(occupied[:pool.target_slots])

    # ---- reporting ---------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            s, pool = self.counters, self.slot_pool
            return {**s.__dict__, "page_in_counts": list(s.page_in_counts),
                    "page_in_buckets": PAGE_IN_BUCKETS,
                    "bytes_read": s.bytes_read_disk + s.bytes_read_host,
                    "budget_bytes": pool.target_slots * pool.expert_nbytes,
                    "num_slots": pool.target_slots,
                    "resident_bytes": pool.num_occupied * pool.expert_nbytes,
                    "expert_bytes": pool.expert_nbytes}

    def check_integrity(self) -> None:
        with self._lock:
            self.slot_pool.check_integrity()
            for key in self._inflight:
                assert self.slot_pool.loading_slot(key) != NOT_RESIDENT, key
