"""One model's experts as the pager serves them: `ExpertPager.add_model` returns a `ModelPool`,
which the model's decoder and the router hold (no lookups by name). The operations callers use
are here; the loading and eviction machinery under them is mox.pager.paging.

Design note.
- A MoE layer step asks for the experts its tokens route to through `waves()`. The first wave
  is what is already resident (pinned at once, computed while the misses load on the I/O
  threads); later waves are the misses, loaded into free slots or slots of unleased experts
  the model's eviction policy gives up. When a step needs more experts than the pool holds (a
  long prefill), each wave releases its slots before the next loads: compute, page the next
  group over the finished one, continue. A pool of >= top_k slots always progresses.
- `prefetch()` queues loads without blocking; a prefetched expert counts a prefetch hit on
  first use. It evicts only experts outside the layers the caller protects.
- Budget, in slots: occupied slots stay within `num_slots`, except for experts leased when it
  shrank, which leave as their leases end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from mox.errors import MoxError
from mox.kernels import NOT_RESIDENT, ExpertRows, ExpertScales, MappedExpert, expert_rows
from mox.pager.eviction import ExpertKey
from mox.pager.expert_table import ExpertMap, ExpertTable
from mox.pager.paging import PagedPool
from mox.pager.pending import ReadsPending
from mox.pager.stats import PAGE_IN_BUCKETS

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
    scales: ExpertScales | None = None   # w13 and w2 are stored quantized
    rows: ExpertRows | None = None       # the rows slot_map indexes: slots, then mapped ones


@dataclass
class Hold:
    """Every resident expert of the model, readable without a lease while the hold lasts:
    `slot_of [L, E]` is the live residency table (int32, NOT_RESIDENT where absent).
    Meanwhile nothing is evicted, moved or grown, so an expert it shows keeps its slot; loads
    that commit only add experts, in slots of these pools (the native blocks still bound them
    by the pools' first dim, as a defence). The holder appends to `used` each layer it
    computed from the slots, with its experts (counted as hits when the hold ends; a layer
    that comes again starts another model step)."""

    slot_of: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    scales: ExpertScales | None = None
    rows: ExpertRows | None = None
    used: list[tuple[int, list[int]]] = field(default_factory=list)
    table: ExpertMap | None = None                 # holding(table=True)
    # [L, E] on the device, nonzero where the holder computed an expert through `table`:
    # read back once when the hold ends (its hits, and mapped experts to load into slots)
    device_used: torch.Tensor | None = None


def _model_steps(layers: list[tuple[int, list[int]]]) -> list[list[tuple[int, list[int]]]]:
    """A hold's layer steps, in order, cut into model steps: a layer that comes again starts
    the next one (a hold may last several decode steps)."""
    steps: list[list[tuple[int, list[int]]]] = []
    seen: set[int] = set()
    for layer in layers:
        if not steps or layer[0] in seen:
            steps.append([])
            seen = set()
        steps[-1].append(layer)
        seen.add(layer[0])
    return steps


@dataclass(frozen=True)
class PoolDemand:
    hit_rates: np.ndarray              # [N + 1] H(S): LRU hit rate of recent accesses at S slots
    access_rate: float                 # (layer, expert) accesses per second, recently
    recent_accesses: float             # the decayed count of accesses behind the curve
    bytes_read: int                    # expert bytes read so far (disk and host)
    read_seconds: float                # ... and the I/O threads' seconds reading them


class ModelPool(PagedPool):
    """Thread-safe: every method takes the pager's lock for what it touches. The decoder
    calls `waves`/`prefetch` from the step thread, the router `resize`/`prefetch_popular`/
    `stats`/`demand` from the same thread between steps, and loads land from the I/O
    threads."""

    # ---- budget ------------------------------------------------------------------------
    def resize(self, num_slots: int) -> None:
        """Budget the model `num_slots` slots: unleased experts past it leave now, leased ones
        as their leases end; the tensors follow once that is safe."""
        with self._lock:
            slots = self._valid_num_slots(num_slots)
            if slots != self.slot_pool.target_slots:
                self._resized_at = self.clock()
            self.slot_pool.target_slots = slots
            self._drain()

    def demand(self) -> PoolDemand:
        """What the planner values this pool's slots by, read under the lock."""
        with self._lock:
            c = self.counters
            now = self.clock()
            return PoolDemand(self.miss_curve.hit_rates(), self.miss_curve.access_rate(now),
                              self.miss_curve.recent_accesses(now),
                              c.bytes_read_disk + c.bytes_read_host, c.read_seconds)

    def step_figures(self) -> tuple[float, int, int, int, float]:
        """(stall seconds, misses, waves, bytes read, graph capture seconds) so far: a step's
        are the difference."""
        with self._lock:
            c = self.counters
            return (c.stall_seconds, c.misses, c.waves, c.bytes_read_disk + c.bytes_read_host,
                    c.graph_capture_seconds)

    def count_graph_capture(self, seconds: float) -> None:
        with self._lock:
            self.counters.graph_captures += 1
            self.counters.graph_capture_seconds += seconds

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
    def wave_steps(self, moe_layer: int,
                   expert_ids: Iterable[int]) -> Iterator[Lease | ReadsPending]:
        """Leases covering `expert_ids` of one layer, resident ones first (with the misses
        the Triton kernels may read in place from the pinned host cache, where
        `maps_host_experts`: they load into slots meanwhile, for later steps); each lease is
        released when the caller asks for the next (or stops iterating). Where a wave must
        wait for reads, a `ReadsPending` comes first: its caller may run other work and ask
        for the next item once it is `done` (asking earlier blocks until it is)."""
        wanted = sorted(set(expert_ids))
        with self._lock:
            self._check_not_parked()
            self._record_access([(moe_layer, wanted)])
            ready, pending, missing = self._classify(moe_layer, wanted)
            mapped = self._map_from_host(moe_layer, pending + missing)
            started = self._start_loads(moe_layer, missing, prefetched=False)
            # mapped misses load into slots for later steps; this one reads them in place
            pending = [e for e in pending + started if e not in mapped]
            missing = [e for e in missing[len(started):] if e not in mapped]
        while True:
            if ready or mapped:
                lease = self._lease(moe_layer, ready, mapped)
                mapped = {}
                try:
                    yield lease
                finally:
                    self.release(lease)
            if not pending and not missing:
                return
            reads = self._reads(moe_layer, pending)
            if not reads.done:
                yield reads
            reads.wait()
            ready, gone = self._pin_arrived(moe_layer, pending)
            with self._lock:
                missing += gone
                while missing and not ready and not self._has_room():
                    self.waiting_on = (f"a slot for {len(missing)} experts of MoE layer "
                                       f"{moe_layer}: all {self.slot_pool.num_slots} are "
                                       "pinned or loading")
                    self._changed.wait()
                self.waiting_on = None
                # the next group loads while the caller computes `ready`
                pending = self._start_loads(moe_layer, missing, prefetched=False)
                missing = missing[len(pending):]

    @contextlib.contextmanager
    def holding(self, table: bool = False) -> Iterator[Hold]:
        """A `Hold` on the model's resident experts for native calls: a decode step that
        finds every expert it routes to resident needs no lease (the native blocks check the
        table themselves); the layers it lists in `hold.used` count as waves of hits would,
        in one lock section when the hold ends. `table` (GPUs, `maps_host_experts`): with
        the expert table's snapshot (`ExpertMap`: every expert in a slot or mapped from the
        host cache); what the holder marks in `hold.device_used` is read back when the hold
        ends, and the mapped experts it used start loading into slots."""
        pool, hold = self.slot_pool, None
        try:
            with self._lock:
                self._check_not_parked()
                hold = Hold(pool.slot_of, *pool.in_use())
                pool.holds += 1
                if table:
                    hold.table = self._expert_table()
            yield hold
        finally:
            if hold is not None:
                # (one read back a step, also after an error: the kernels before it have
                # ended, so the slots and host bytes they read may be reused once it ends)
                used = None
                try:
                    if hold.device_used is not None:
                        used = hold.device_used.nonzero().tolist()
                finally:
                    self._end_hold(hold, used)

    def _end_hold(self, hold: Hold, used: list[list[int]] | None) -> None:
        """The hold's experts counted (its `used` layers, and what the device marked), and
        the pool free to evict, move and grow again once no hold is left."""
        pool = self.slot_pool
        with self._lock:
            pool.holds -= 1
            for step in _model_steps(hold.used):           # the layers in the order they ran
                self._record_hits([(moe_layer, sorted(set(experts)))
                                   for moe_layer, experts in step])
            if used:
                self._record_table_use(hold.table, used)
            if not pool.holds:
                self._drain()                # what waited for the holds (a shrink)
                self._changed.notify_all()

    def _expert_table(self) -> ExpertMap:
        """The model's expert table as it stands (kept up to date between steps)."""
        if self._table is None:
            host_cache = self.loader.host_cache
            self._table = ExpertTable(self.slot_pool, host_cache, self.name, self._map_expert)
        return self._table.refresh()

    def _map_expert(self, key: ExpertKey, touch: bool = False) -> MappedExpert | None:
        """The expert as the Triton kernels may read it in place from the host cache
        (`touch`: a use, in the cache's LRU order)."""
        experts = self.ckpt.experts[self.moe_layers[key[0]], key[1]]
        return self.loader.mapped(self.slot_pool, experts, (self.name, *key), touch)

    def _record_table_use(self, table: ExpertMap, used: list[list[int]]) -> None:
        """A step computed these (layer, expert) pairs through `table`: hits for the
        resident ones; the mapped ones were misses served in place, and load into slots
        now for the steps after (those not loaded or loading meanwhile)."""
        steps: dict[int, list[int]] = {}
        for moe_layer, expert in used:                # (nonzero(): in order, sorted)
            steps.setdefault(moe_layer, []).append(expert)
        self._record_access(list(steps.items()))
        now, pool, stats = self.clock(), self.slot_pool, self.counters
        loads = []                      # (started after every hit is counted: they may evict)
        for moe_layer, experts in steps.items():
            mapped = [e for e in experts if table.is_mapped(moe_layer, e)]
            self._count_hits([(moe_layer, e) for e in experts if e not in mapped], now)
            stats.misses += len(mapped)
            stats.mapped_reads += len(mapped)
            loads.append((moe_layer, [e for e in mapped if pool.lookup((moe_layer, e))
                                      == NOT_RESIDENT and (moe_layer, e) not in self._inflight]))
        for moe_layer, absent in loads:
            self._start_loads(moe_layer, absent, prefetched=False)
        stats.waves += len(steps)

    def waves(self, moe_layer: int, expert_ids: Iterable[int]) -> Iterator[Lease]:
        """`wave_steps` for a caller that blocks where reads are pending."""
        for item in self.wave_steps(moe_layer, expert_ids):
            if isinstance(item, Lease):
                yield item

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
            # host memory the kernels read in place stays allocated until they end
            self._mapped_in_flight = [(event, rows) for event, rows in self._mapped_in_flight
                                      if not event.query()]
            if done is not None and lease.rows.mapped:
                self._mapped_in_flight.append((done, lease.rows))
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

    def preload(self, experts: dict[int, list[int]], wait: bool = True) -> None:
        """Read `{layer: experts}` into free slots: a cold start's read-ahead (counted as
        preloads, not as accesses, misses or predictions; nothing is evicted for it). `wait`:
        until they land, raising what a failed read raised; otherwise the model's steps take
        them as they land (streaming: layer L computes while later layers still load) and a
        failed read fails the step that needs it."""
        every_layer = set(range(self.num_moe_layers))
        futures = []
        with self._lock:
            for moe_layer, expert_ids in experts.items():
                _, _, missing = self._classify(moe_layer, sorted(set(expert_ids)), count=False)
                started = self._start_loads(moe_layer, missing, prefetched=False,
                                            protect=every_layer, preload=True)
                futures += [self._inflight[(moe_layer, e)] for e in started]
        if wait:
            for future in futures:
                future.result()        # a read that failed fails the load (naming the file)

    def most_used(self, count: int) -> dict[int, list[int]]:
        """{layer: experts} of the `count` most used (layer, expert) keys (all of them when
        `count` covers the model), at most the slots the pool is budgeted now."""
        with self._lock:
            count = min(count, self.slot_pool.target_slots)
            usage = self.usage.probabilities(self.clock())                      # [L, E]
        chosen: dict[int, list[int]] = {}
        for flat in usage.ravel().argsort(kind="stable")[::-1][:count]:
            layer, expert = divmod(int(flat), usage.shape[1])
            chosen.setdefault(layer, []).append(expert)
        return {layer: sorted(experts) for layer, experts in sorted(chosen.items())}

    @property
    def has_history(self) -> bool:
        """Has a step used its experts yet (before, which are popular is unknown)?"""
        with self._lock:
            return bool(self.usage.steps.any())

    def prefetch_popular(self, limit: int) -> int:
        """Start loading up to `limit` of the model's popular experts (used at least
        `POPULAR_OVER_UNIFORM` times as often as uniform routing would) that are not resident,
        into free slots only (nothing is evicted for a guess). Returns how many started."""
        pool = self.slot_pool
        if not self.has_history:
            return 0                              # any guess would be noise
        with self._lock:
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

    # ---- internals (called with the lock held unless noted) -----------------------------
    def _check_not_parked(self) -> None:
        if self.slot_pool.target_slots == 0:
            raise MoxError(f"model {self.name!r} has no expert memory (it is parked)")

    def _record_access(self, steps: list[tuple[int, list[int]]]) -> None:
        """Layer steps, in order, route to these experts (each distinct, sorted; no layer
        twice): usage, the miss-ratio curve, and the reads queued for the layers."""
        self._record_usage(steps, self.clock())
        if self._inflight:
            for moe_layer, wanted in steps:
                self._settle_queued(moe_layer, set(wanted))

    def _record_hits(self, steps: list[tuple[int, list[int]]]) -> None:
        """Layer steps, in order, computed these experts (each distinct, sorted, all
        resident) in their slots."""
        self._record_access(steps)
        self._count_hits([(moe_layer, expert) for moe_layer, wanted in steps
                          for expert in wanted], self.clock())
        self.counters.waves += len(steps)

    def _count_hits(self, keys: list[ExpertKey], now: float) -> None:
        """These resident experts were computed from their slots at `now`: hits, in the
        policy at once (a decode step's few dozen)."""
        pool, stats = self.slot_pool, self.counters
        for key in keys:
            index = pool.lookup(key)
            assert index != NOT_RESIDENT, f"{key} was computed but is not resident"
            slot = pool.slots[index]
            stats.prefetch_hits += slot.prefetched
            slot.prefetched = False
        stats.hits += len(keys)
        self.policy.on_access_many(keys, now)

    def _classify(self, moe_layer: int, wanted: list[int], count: bool = True):
        """Split into resident (pinned now), already loading, and missing experts."""
        now, pool, stats = self.clock(), self.slot_pool, self.counters
        ready, pending, missing = [], [], []
        for expert in wanted:
            key = (moe_layer, expert)
            index = pool.lookup(key)
            if index != NOT_RESIDENT:
                if count:
                    pool.slots[index].pins += 1
                ready.append(expert)
            elif key in self._inflight:
                pending.append(expert)
            else:
                missing.append(expert)
        if count:
            self._count_hits([(moe_layer, expert) for expert in ready], now)
            stats.misses += len(pending) + len(missing)
        return ready, pending, missing

    def _has_room(self) -> bool:
        pool = self.slot_pool
        return bool(pool.free_slots(1)) or bool(pool.evictable())

    def _reads(self, moe_layer: int, pending: list[int]) -> ReadsPending:
        with self._lock:
            futures = [self._inflight.get((moe_layer, e)) for e in pending]
        return ReadsPending(self, moe_layer, tuple(pending),
                            tuple(f for f in futures if f is not None))

    def _pin_arrived(self, moe_layer: int, pending: list[int]) -> tuple[list[int], list[int]]:
        """Pin the loads that landed. Returns (ready, gone): `gone` were evicted again
        between their commit and our pin (rare; retried)."""
        ready, gone = [], []
        with self._lock:
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

    def _lease(self, moe_layer: int, experts: list[int],
               mapped: dict[int, MappedExpert] | None = None) -> Lease:
        with self._lock:
            self.counters.waves += 1
            keys = [(moe_layer, e) for e in experts]
            return self._make_lease(moe_layer, keys, [self.slot_pool.lookup(k) for k in keys],
                                    mapped or {})

    def _make_lease(self, moe_layer: int, keys: list[ExpertKey], slots: list[int],
                    mapped: dict[int, MappedExpert] | None = None) -> Lease:
        """A lease of these slots, and of `mapped` experts read in place: rows S + i of the
        pools' row space, past the slots."""
        pool = self.slot_pool
        assert all(pool.slots[i].pins > 0 for i in slots)
        w13, w2, b13, b2, scales, rows = pool.in_use()
        entries = list(zip(keys, slots))
        if mapped:
            entries += [((moe_layer, expert), w13.shape[0] + i)
                        for i, expert in enumerate(mapped)]
            rows = expert_rows(w13, w2, scales, tuple(mapped.values()))
        return Lease(moe_layer, tuple(slots), pool.lease_map(entries), w13, w2, b13, b2,
                     scales, rows)

    def _map_from_host(self, moe_layer: int, missing: list[int]) -> dict[int, MappedExpert]:
        """The missing experts the kernels may read in place from the host cache (GPUs:
        pinned memory mapped into the device's address space), by expert."""
        if not (self.maps_host_experts and missing and self.loader.host_cache is not None):
            return {}
        mapped = {}
        for expert in missing:
            found = self._map_expert((moe_layer, expert), touch=True)
            if found is not None:
                mapped[expert] = found
        self.counters.mapped_reads += len(mapped)
        return mapped

    # ---- reporting ---------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            s, pool = self.counters, self.slot_pool
            return {**s.__dict__, "page_in_counts": list(s.page_in_counts),
                    "page_in_buckets": PAGE_IN_BUCKETS,
                    "bytes_read": s.bytes_read_disk + s.bytes_read_host,
                    "budget_bytes": pool.target_slots * pool.expert_nbytes,
                    "num_slots": pool.target_slots,
                    "held_slots": pool.num_slots,       # allocated (drains or grows to the above)
                    "max_slots": self.max_slots,
                    "resident_bytes": pool.num_occupied * pool.expert_nbytes,
                    "expert_bytes": pool.expert_nbytes}

    def check_integrity(self) -> None:
        with self._lock:
            self.slot_pool.check_integrity()
            for key in self._inflight:
                assert self.slot_pool.loading_slot(key) != NOT_RESIDENT, key
