"""The expert pager: each model's experts stream from disk (or the host cache) into a budgeted
slot pool on the compute device, on demand, and stay while they are worth their slot.

Design note.
- A MoE layer step asks for the experts its tokens route to through `waves()`. The first wave
  is what is already resident (pinned at once, computed while the misses load on the I/O
  threads); later waves are the misses, loaded into free slots or slots of unleased experts
  the model's eviction policy gives up. When a step needs more experts than the pool holds (a
  long prefill), each wave releases its slots before the next loads: compute, page the next
  group over the finished one, continue. A pool of >= top_k slots always progresses.
- `prefetch()` queues loads without blocking; a prefetched expert counts a prefetch hit on
  first use. It evicts only experts outside the layers the caller protects.
- One lock guards every pool's tables; I/O threads write slot bytes outside it (the slot is
  reserved) and commit under it. A failed load frees its slot and its error reaches the step
  that waits for it; the tables never show a slot with partial bytes.
- Budget: occupied slots x expert bytes stay within the model's budget, except for experts
  leased when the budget shrank, which leave as their leases end.
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
from mox.loaders.stream import DEMAND, PREFETCH, StreamingReader
from mox.pager.eviction import EvictionPolicy, ExpertKey, make_policy
from mox.pager.expert_loader import FROM_HOST, ExpertLoader, LoadResult
from mox.pager.host_cache import HostCache
from mox.pager.slot_pool import SlotPool, expert_nbytes
from mox.pager.usage import ExpertUsage

PageInObserver = Callable[[str, float], None]      # (model, seconds) of each expert read
# Prefetch on a rising rate only experts clearly above uniform use: under near-uniform
# routing the guesses cost reads that demand misses then queue behind (measured on the
# 12-model load test: TPOT p50 1.28 s with them, 0.84 s without).
POPULAR_OVER_UNIFORM = 2.0


@dataclass
class PagerStats:
    hits: int = 0
    misses: int = 0
    prefetch_hits: int = 0
    prefetches: int = 0
    prefetch_unused: int = 0           # prefetched, then cancelled or evicted before any use
    bytes_read_disk: int = 0
    bytes_read_host: int = 0
    read_seconds: float = 0.0          # summed over I/O threads
    stall_seconds: float = 0.0         # steps waiting for experts to arrive
    evictions: int = 0
    waves: int = 0
    peak_resident_bytes: int = 0


@dataclass(frozen=True)
class Lease:
    """Experts of one layer pinned for one wave; `slot_map [E]` maps only them."""

    model: str
    moe_layer: int
    slots: tuple[int, ...]
    slot_map: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None = None      # [S, 2I] expert biases, where the model has them
    b2: torch.Tensor | None = None       # [S, H]


@dataclass
class _Model:
    name: str
    ckpt: Checkpoint
    pool: SlotPool
    policy: EvictionPolicy
    moe_layers: list[int]                  # checkpoint layer index of each MoE layer
    budget_bytes: int
    usage: ExpertUsage
    stats: PagerStats = field(default_factory=PagerStats)
    inflight: dict[ExpertKey, Future] = field(default_factory=dict)
    workspace: MoEWorkspace = field(default_factory=MoEWorkspace)
    resized_at: float = -math.inf          # when set_budget last changed the slot count


class ExpertPager:
    def __init__(self, loader: ExpertLoader, clock: Callable[[], float] = time.monotonic,
                 on_page_in: PageInObserver | None = None):
        self.loader = loader
        self.clock = clock
        self.on_page_in = on_page_in
        self._models: dict[str, _Model] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)   # a slot was freed or committed

    # ---- models and budgets -------------------------------------------------------------
    def add_model(self, name: str, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                  budget_bytes: int | None, policy: str = "rate") -> None:
        spec = ckpt.spec
        moe_layers = [i for i, is_moe in enumerate(spec.moe_layers) if is_moe]
        num_slots = self._slots_for(name, spec, dtype, budget_bytes, len(moe_layers))
        pool = SlotPool(len(moe_layers), spec.num_experts, spec.hidden_size,
                        spec.moe_intermediate_size, dtype, device, num_slots, spec.expert_bias)
        with self._lock:
            self._models[name] = _Model(
                name, ckpt, pool, make_policy(policy), moe_layers, num_slots * pool.expert_nbytes,
                ExpertUsage(len(moe_layers), spec.num_experts, spec.top_k))

    @staticmethod
    def _slots_for(name: str, spec, dtype: torch.dtype, budget_bytes: int | None,
                   num_moe_layers: int) -> int:
        total = num_moe_layers * spec.num_experts
        if budget_bytes is None:
            return total
        if budget_bytes == 0:
            return 0                  # parked: a cold model holds no slots
        per_expert = expert_nbytes(spec.hidden_size, spec.moe_intermediate_size, dtype,
                                   spec.expert_bias)
        slots = min(budget_bytes // per_expert, total)
        if slots < spec.top_k:
            raise MoxError(
                f"model {name!r}: an expert budget of {budget_bytes} bytes holds {slots} "
                f"experts of {per_expert} bytes; a step needs at least top_k = {spec.top_k}")
        return slots

    def set_budget(self, name: str, budget_bytes: int | None) -> None:
        with self._lock:
            m = self._models[name]
            slots = self._slots_for(name, m.ckpt.spec, m.pool.dtype, budget_bytes,
                                    len(m.moe_layers))
            if slots != m.pool.target_slots:
                m.resized_at = self.clock()
            m.pool.target_slots = slots
            m.budget_bytes = slots * m.pool.expert_nbytes
            self._drain(m)

    def remove_model(self, name: str) -> None:
        """Forget a model (no step may be using it): its in-flight loads land, then go."""
        self.wait_for_loads(name)
        with self._lock:
            pool = self._models.pop(name).pool
            assert pool.is_quiet, f"{name} still has leased experts"

    def set_policy(self, name: str, policy: str) -> None:
        with self._lock:
            self._models[name].policy = make_policy(policy)

    def set_rate(self, name: str, requests_per_s: float) -> None:
        with self._lock:
            policy = self._models[name].policy
            if hasattr(policy, "set_rate"):
                policy.set_rate(requests_per_s)

    def workspace(self, name: str) -> MoEWorkspace:
        return self._models[name].workspace

    def num_moe_layers(self, name: str) -> int:
        return len(self._models[name].moe_layers)

    # ---- leases -------------------------------------------------------------------------
    def waves(self, name: str, moe_layer: int, expert_ids: Iterable[int]) -> Iterator[Lease]:
        """Leases covering `expert_ids` of one layer, resident ones first; each lease is
        released when the caller asks for the next (or stops iterating)."""
        m = self._models[name]
        wanted = sorted(set(expert_ids))
        with self._lock:
            if m.pool.target_slots == 0:
                raise MoxError(f"model {name!r} has no expert memory (it is parked)")
            m.usage.record(moe_layer, wanted, self.clock())
            self._settle_prefetches(m, moe_layer, set(wanted))
            ready, pending, missing = self._classify(m, moe_layer, wanted)
            started = self._start_loads(m, moe_layer, missing, prefetched=False)
            pending, missing = pending + started, missing[len(started):]
        while True:
            if ready:
                lease = self._lease(m, moe_layer, ready)
                try:
                    yield lease
                finally:
                    self.release(lease)
            if not pending and not missing:
                return
            ready, gone = self._wait(m, moe_layer, pending)
            with self._lock:
                missing += gone
                while missing and not ready and not self._has_room(m):
                    self._changed.wait()
                # the next group loads while the caller computes `ready`
                pending = self._start_loads(m, moe_layer, missing, prefetched=False)
                missing = missing[len(pending):]

    def acquire(self, name: str, moe_layer: int, expert_ids: Iterable[int]) -> Lease:
        """All of `expert_ids` resident and pinned at once (they must fit the pool)."""
        m = self._models[name]
        wanted = sorted(set(expert_ids))
        if len(wanted) > m.pool.target_slots:
            raise MoxError(f"{len(wanted)} experts do not fit {m.pool.target_slots} slots")
        slots: dict[int, int] = {}
        for lease in self.waves(name, moe_layer, wanted):
            with self._lock:
                for index in lease.slots:
                    m.pool.slots[index].pins += 1          # keep them past this wave
                    slots[m.pool.slots[index].key[1]] = index
        with self._lock:
            return self._make_lease(m, moe_layer, [(moe_layer, e) for e in wanted],
                                    [slots[e] for e in wanted])

    def release(self, lease: Lease) -> None:
        # on CUDA the kernels that read these slots may still be queued: remember when they end
        done = (torch.cuda.current_stream(lease.w13.device).record_event()
                if lease.w13.is_cuda else None)
        with self._lock:
            m = self._models[lease.model]
            for index in lease.slots:
                m.pool.slots[index].pins -= 1
                m.pool.slots[index].last_use = done
            self._drain(m)
            self._changed.notify_all()

    def prefetch(self, name: str, moe_layer: int, expert_ids: Iterable[int],
                 protect_layers: Iterable[int] = ()) -> None:
        """Start loading these experts if a slot is free or held by an unleased expert
        outside `protect_layers`; never blocks, never waits for I/O."""
        m = self._models[name]
        with self._lock:
            _, _, missing = self._classify(m, moe_layer, sorted(set(expert_ids)), count=False)
            self._start_loads(m, moe_layer, missing, prefetched=True,
                              protect={moe_layer, *protect_layers})

    def prefetch_popular(self, name: str, limit: int) -> int:
        """Start loading up to `limit` of the model's popular experts (used at least
        `POPULAR_OVER_UNIFORM` times as often as uniform routing would) that are not resident,
        into free slots only (nothing is evicted for a guess). Returns how many started."""
        m = self._models[name]
        with self._lock:
            if not m.usage.steps.any():
                return 0                          # no history: any guess would be noise
            usage = m.usage.probabilities(self.clock())                         # [L, E]
            popular = POPULAR_OVER_UNIFORM * m.usage.top_k / usage.shape[1]
            free = m.pool.target_slots - m.pool.num_occupied
            started = 0
            for flat in usage.ravel().argsort()[::-1]:
                if started >= min(limit, free) or usage.flat[flat] < popular:
                    break
                key = divmod(int(flat), usage.shape[1])
                if m.pool.lookup(key) == NOT_RESIDENT and key not in m.inflight:
                    started += len(self._start_loads(m, key[0], [key[1]], prefetched=True,
                                                     protect=set(range(len(m.moe_layers)))))
            return started

    def resized_ago(self, name: str) -> float:
        """Seconds since the model's slot count last changed."""
        return self.clock() - self._models[name].resized_at

    def usage(self, name: str) -> ExpertUsage:
        return self._models[name].usage

    def allocated_bytes(self, name: str) -> int:
        """Device bytes the model's pool tensors take now (the budget bounds this once a
        shrink has drained)."""
        with self._lock:
            pool = self._models[name].pool
            return pool.num_slots * pool.expert_nbytes

    def wait_for_loads(self, name: str) -> None:
        """Block until this model's in-flight loads (prefetches included) have landed."""
        with self._lock:
            futures = list(self._models[name].inflight.values())
        for future in futures:
            future.exception()                     # waits; a failed prefetch is not an error

    # ---- internals (called with the lock held unless noted) -----------------------------
    def _classify(self, m: _Model, moe_layer: int, wanted: list[int], count: bool = True):
        """Split into resident (pinned now), already loading, and missing experts."""
        now = self.clock()
        ready, pending, missing = [], [], []
        for expert in wanted:
            key = (moe_layer, expert)
            index = m.pool.lookup(key)
            if index != NOT_RESIDENT:
                if count:
                    slot = m.pool.slots[index]
                    slot.pins += 1
                    m.stats.hits += 1
                    m.stats.prefetch_hits += slot.prefetched
                    slot.prefetched = False
                    m.policy.on_access(key, now)
                ready.append(expert)
            elif key in m.inflight:
                pending.append(expert)
            else:
                missing.append(expert)
        if count:
            m.stats.misses += len(pending) + len(missing)
        return ready, pending, missing

    def _settle_prefetches(self, m: _Model, moe_layer: int, wanted: set[int]) -> None:
        """Now that this layer's routing is known: queued prefetches it does not want are
        dropped (their slots freed), and the ones it wants move ahead of other prefetches."""
        for key, future in list(m.inflight.items()):
            index = m.pool.loading_slot(key)
            if key[0] != moe_layer or not m.pool.slots[index].prefetched:
                continue
            if future.cancel():                        # still queued: nothing was read
                del m.inflight[key]
                m.pool.clear(index)
                if key[1] in wanted:
                    m.pool.reserve(index, key, prefetched=True)
                    m.inflight[key] = self.loader.reader.submit_call(
                        self._load, m, key, index, priority=DEMAND)
                else:
                    m.stats.prefetch_unused += 1

    def _has_room(self, m: _Model) -> bool:
        pool = m.pool
        return bool(pool.free_slots(1)) or any(s.is_evictable for s in pool.slots)

    def _start_loads(self, m: _Model, moe_layer: int, experts: list[int], prefetched: bool,
                     protect: set[int] | None = None) -> list[int]:
        started = []
        for expert, index in zip(experts, self._claim_slots(m, len(experts), protect)):
            key = (moe_layer, expert)
            m.pool.reserve(index, key, prefetched)
            m.stats.prefetches += prefetched
            occupied = m.pool.num_occupied * m.pool.expert_nbytes
            m.stats.peak_resident_bytes = max(m.stats.peak_resident_bytes, occupied)
            m.inflight[key] = self.loader.reader.submit_call(
                self._load, m, key, index, priority=PREFETCH if prefetched else DEMAND)
            started.append(expert)
        return started

    def _claim_slots(self, m: _Model, count: int, protect: set[int] | None) -> list[int]:
        """Up to `count` free slots within the budget, evicting the policy's victims (chosen
        in one pass over the pool) if need be; experts of `protect` layers stay."""
        pool = m.pool
        free = pool.free_slots(count)
        if len(free) == count:
            return free
        candidates = [pool.slots[i].key for i in pool.evictable()]
        if protect is not None:
            candidates = [k for k in candidates if k[0] not in protect]
        for key in m.policy.victims(candidates, count - len(free), self.clock()):
            self._evict(m, key)
        return pool.free_slots(count)

    def _evict(self, m: _Model, key: ExpertKey) -> None:
        index = m.pool.lookup(key)
        m.stats.prefetch_unused += m.pool.slots[index].prefetched
        m.pool.clear(index)
        m.policy.on_evict(key)
        m.stats.evictions += 1

    def _load(self, m: _Model, key: ExpertKey, index: int) -> LoadResult:
        """On an I/O thread, without the lock: fill the reserved slot, then commit it."""
        layer = m.moe_layers[key[0]]
        try:
            result = self.loader.load(m.pool, index, m.ckpt.experts[layer, key[1]],
                                      (m.name, *key), f"layer {layer} expert {key[1]}",
                                      m.pool.slots[index].last_use)
        except BaseException:
            with self._lock:
                m.pool.clear(index)
                del m.inflight[key]
                self._changed.notify_all()
            raise
        with self._lock:
            m.pool.commit(index)
            m.pool.slots[index].pins -= 1     # the reservation ends; waiters pin what they use
            del m.inflight[key]
            m.policy.on_access(key, self.clock())
            stats = m.stats
            if result.source == FROM_HOST:
                stats.bytes_read_host += result.nbytes
            else:
                stats.bytes_read_disk += result.nbytes
            stats.read_seconds += result.seconds
            self._drain(m)
            self._changed.notify_all()
        if self.on_page_in is not None:
            self.on_page_in(m.name, result.seconds)
        return result

    def _wait(self, m: _Model, moe_layer: int, pending: list[int]) -> tuple[list[int], list[int]]:
        """Without the lock: wait for these loads; pin what arrived. Returns (ready, gone):
        `gone` were evicted again between their commit and our pin (rare; retried)."""
        with self._lock:
            futures = [(e, m.inflight.get((moe_layer, e))) for e in pending]
        start = time.perf_counter()
        for _, future in futures:
            if future is not None:
                future.result()                   # a load error propagates to this step
        ready, gone = [], []
        with self._lock:
            m.stats.stall_seconds += time.perf_counter() - start
            for expert in pending:
                index = m.pool.lookup((moe_layer, expert))
                if index == NOT_RESIDENT:
                    gone.append(expert)
                    continue
                slot = m.pool.slots[index]
                slot.pins += 1
                m.stats.prefetch_hits += slot.prefetched
                slot.prefetched = False
                ready.append(expert)
        return ready, gone

    def _lease(self, m: _Model, moe_layer: int, experts: list[int]) -> Lease:
        with self._lock:
            m.stats.waves += 1
            keys = [(moe_layer, e) for e in experts]
            return self._make_lease(m, moe_layer, keys, [m.pool.lookup(k) for k in keys])

    def _make_lease(self, m: _Model, moe_layer: int, keys: list[ExpertKey],
                    slots: list[int]) -> Lease:
        assert all(m.pool.slots[i].pins > 0 for i in slots)
        return Lease(m.name, moe_layer, tuple(slots),
                     m.pool.lease_map(list(zip(keys, slots))), *m.pool.in_use())

    def _drain(self, m: _Model) -> None:
        """Bring the pool back within budget: evict unleased experts past it, and resize the
        tensors once nothing is pinned."""
        pool, now = m.pool, self.clock()
        excess = pool.num_occupied - pool.target_slots
        if excess > 0:
            candidates = [pool.slots[i].key for i in pool.evictable()]
            for key in m.policy.victims(candidates, excess, now):
                self._evict(m, key)
        self._compact_if_quiet(m)

    def _compact_if_quiet(self, m: _Model) -> None:
        """Resize the pool tensors to the budget: growing keeps every slot where it is (leases
        keep reading the old tensors, whose pinned slots stay valid), so it only waits for
        in-flight loads; shrinking moves experts, so it waits until nothing is pinned."""
        pool = m.pool
        if pool.num_slots < pool.target_slots and not any(s.loading for s in pool.slots):
            pool.grow()
        if pool.num_slots == pool.target_slots or not pool.is_quiet:
            return
        now = self.clock()
        occupied = [i for i, s in enumerate(pool.slots) if s.key is not None]
        occupied.sort(key=lambda i: m.policy.score(pool.slots[i].key, now), reverse=True)
        for index in occupied[pool.target_slots:]:
            self._evict(m, pool.slots[index].key)
        pool.compact(occupied[:pool.target_slots])

    # ---- reporting ----------------------------------------------------------------------
    def stats(self, name: str) -> dict:
        with self._lock:
            m = self._models[name]
            s = m.stats
            return {**s.__dict__, "bytes_read": s.bytes_read_disk + s.bytes_read_host,
                    "budget_bytes": m.budget_bytes, "num_slots": m.pool.target_slots,
                    "resident_bytes": m.pool.num_occupied * m.pool.expert_nbytes,
                    "expert_bytes": m.pool.expert_nbytes}

    def check_integrity(self, name: str) -> None:
        with self._lock:
            m = self._models[name]
            m.pool.check_integrity()
            for key in m.inflight:
                assert m.pool.loading_slot(key) != NOT_RESIDENT, key

    def pool(self, name: str) -> SlotPool:
        return self._models[name].pool


def make_pager(device: torch.device, host_memory_bytes: int | None = None,
               direct_io: bool = False, clock: Callable[[], float] = time.monotonic,
               on_page_in: PageInObserver | None = None) -> ExpertPager:
    """A pager with its reader and (if `host_memory_bytes`) a host cache, pinned on CUDA."""
    host = (HostCache(host_memory_bytes, pin_memory=device.type == "cuda")
            if host_memory_bytes else None)
    return ExpertPager(ExpertLoader(StreamingReader(direct=direct_io), host), clock, on_page_in)
