"""Moving experts in and out of one model's slots: the state of a model's pool (its slot pool,
eviction policy, usage, loads in flight, counters) and the machinery that fills and empties
slots. Loads run on the pager's I/O threads; evictions pick the policy's victims among
unleased experts; a pool over its budget drains (and, once quiet, compacts). `ModelPool`
(mox.pager.model_pool) builds the callers' operations on this.

Locking: one lock (the pager's, `PagerShared.lock`) guards every pool's tables; methods with a
leading underscore run with it held, except `_load`, which runs on an I/O thread: it writes
the reserved slot's bytes without the lock and commits under it. A failed load frees its slot
and its error reaches whoever waits for it; the tables never show a slot with partial bytes.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from mox.errors import MoxError
from mox.kernels import SILU, MoEWorkspace
from mox.loaders import Checkpoint
from mox.loaders.io_pool import DEMAND, PREFETCH
from mox.pager.eviction import ExpertKey, make_policy
from mox.pager.expert_loader import ExpertLoader, LoadResult
from mox.pager.slot_pool import SlotPool
from mox.pager.stats import PagerStats
from mox.pager.usage import ExpertUsage, MissRatioCurve

# Usage and miss-curve records (a hold's model step, or one layer's wave) wait, with their
# times, until this many have gathered or someone reads the statistics: applied in turn they
# give the same figures, and a batch-1 CPU decode step paid ~0.3 ms for its one record, the
# numpy code evicted from the caches by the step's weight reads; in bulk, the later records
# run warm.
UNRECORDED_STEPS = 8


@dataclass
class PagerShared:
    """What every model's pool shares: the I/O (reader, host cache), the clock, and the one
    lock over all pools' tables with its condition (a slot was freed or committed)."""

    loader: ExpertLoader
    clock: Callable[[], float]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)


class PagedPool:
    """One model's pool state and the machinery that fills and empties its slots."""

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
                                  self._valid_num_slots(num_slots), spec.expert_bias,
                                  ckpt.expert_format)
        self.policy = make_policy(policy)
        self.num_experts = spec.num_experts
        self._usage = ExpertUsage(len(self.moe_layers), spec.num_experts, spec.top_k)
        self._miss_curve = MissRatioCurve(self.max_slots)
        self._unrecorded: list[tuple[list[tuple[int, list[int]]], float]] = []
        self.workspace = MoEWorkspace()
        self.counters = PagerStats()
        self._inflight: dict[ExpertKey, Future] = {}
        self._resized_at = -math.inf          # when `resize` last changed the slot count
        self.waiting_on: str | None = None    # what a step waits for now (the watchdog reads)
        # a miss whose bytes sit in the (pinned) host cache is computed from there in place by
        # the Triton kernels while it loads into a slot: GPUs, experts they take (SiLU)
        self.maps_host_experts = (device.type == "cuda" and spec.activation == SILU
                                  and not spec.expert_bias)
        # (GPU) mapped experts' rows, kept alive until the kernels that read them end
        self._mapped_in_flight: list[tuple[torch.cuda.Event, object]] = []
        self._table = None                    # its ExpertTable, made on first use (GPU decode)

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

    @property
    def usage(self) -> ExpertUsage:
        """P(a layer step uses each expert), every record applied (read it under the lock)."""
        self._apply_records()
        return self._usage

    @property
    def miss_curve(self) -> MissRatioCurve:
        """The LRU miss-ratio curve, every record applied (read it under the lock)."""
        self._apply_records()
        return self._miss_curve

    def _record_usage(self, steps: list[tuple[int, list[int]]], now: float) -> None:
        """Layer steps, in order, used these experts (each distinct, sorted; no layer
        twice) at `now`: kept for `usage` and `miss_curve`, applied in bulk."""
        self._unrecorded.append((steps, now))
        if len(self._unrecorded) >= UNRECORDED_STEPS:
            self._apply_records()

    def _apply_records(self) -> None:
        num_experts = self.num_experts
        for steps, now in self._unrecorded:
            self._usage.record(steps, now)
            self._miss_curve.record(np.array([moe_layer * num_experts + expert
                                              for moe_layer, wanted in steps
                                              for expert in wanted], dtype=np.int64),
                                    now, [len(wanted) for _, wanted in steps])
        self._unrecorded.clear()

    def _valid_num_slots(self, num_slots: int | None) -> int:
        """`num_slots` as a slot count: None is every expert, 0 is parked, and otherwise a
        step needs at least top_k."""
        if num_slots is None:
            return self.max_slots
        assert num_slots >= 0, f"{self.name}: {num_slots} slots planned"
        if 0 < num_slots < min(self.top_k, self.max_slots):
            raise MoxError(f"model {self.name!r}: {num_slots} expert slots; a step needs at "
                           f"least top_k = {self.top_k}")
        return min(num_slots, self.max_slots)

    def wait_for_loads(self) -> None:
        """Block until the model's in-flight loads (prefetches included) have landed."""
        with self._lock:
            futures = list(self._inflight.values())
        for future in futures:
            future.exception()                     # waits; a failed prefetch is not an error

    def count_stall(self, seconds: float) -> None:
        """A step waited this long for the model's reads."""
        with self._lock:
            self.counters.stall_seconds += seconds

    # ---- filling and emptying slots (the lock held, except `_load`) --------------------
    def _settle_queued(self, moe_layer: int, wanted: set[int]) -> None:
        """Now that this layer's routing is known: its queued reads that the step wants (a
        prefetch, or a cold start's read-ahead behind other reads) move to demand priority,
        and queued prefetches it does not want are dropped (their slots freed)."""
        reader = self.loader.reader
        for expert in wanted:
            future = self._inflight.get((moe_layer, expert))
            if future is not None:
                reader.promote(future)
        if not self.prefetch_enabled:
            return                              # no prefetches to drop
        pool = self.slot_pool
        for key, future in list(self._inflight.items()):
            if key[0] != moe_layer or key[1] in wanted:
                continue
            index = pool.loading_slot(key)
            if pool.slots[index].prefetched and future.cancel():    # still queued: unread
                del self._inflight[key]
                pool.clear(index)
                self.counters.prefetch_unused += 1

    def _start_loads(self, moe_layer: int, experts: list[int], prefetched: bool,
                     protect: set[int] | None = None, preload: bool = False) -> list[int]:
        """Reserve slots for `experts` and queue their reads: a demand miss's first; a
        prefetch (a prediction, whose use is counted) and a preload (a cold start's
        read-ahead) at the lower priority."""
        pool, stats = self.slot_pool, self.counters
        started = []
        for expert, index in zip(experts, self._claim_slots(len(experts), protect)):
            key = (moe_layer, expert)
            pool.reserve(index, key, prefetched)
            stats.prefetches += prefetched
            stats.preloads += preload
            occupied = pool.num_occupied * pool.expert_nbytes
            stats.peak_resident_bytes = max(stats.peak_resident_bytes, occupied)
            self._inflight[key] = self.loader.reader.submit_call(
                self._load, key, index,
                priority=PREFETCH if prefetched or preload else DEMAND)
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
        in-flight loads and holds; shrinking moves experts, so it waits until nothing is
        pinned or held."""
        pool = self.slot_pool
        if (pool.num_slots < pool.target_slots and not pool.holds
                and not any(s.loading for s in pool.slots)):
            pool.grow()
        if pool.num_slots == pool.target_slots or not pool.is_quiet:
            return
        now = self.clock()
        occupied = [i for i, s in enumerate(pool.slots) if s.key is not None]
        occupied.sort(key=lambda i: self.policy.score(pool.slots[i].key, now), reverse=True)
        for index in occupied[pool.target_slots:]:
            self._evict(pool.slots[index].key)
        pool.compact(occupied[:pool.target_slots])
