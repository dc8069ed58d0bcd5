"""The expert pager: budgets, leases, waves, policies, host tier, prefetch, and faults."""

from __future__ import annotations

import itertools
import os
import shutil
import threading

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mox.errors import MoxError
from mox.loaders import Checkpoint, CheckpointError
from mox.loaders.stream import read_tensor
from mox.pager import ModelPool, paging
from mox.pager.eviction import LFUPolicy, LRUPolicy, RatePolicy
from mox.pager.model_pool import Lease
from tests.pager.pools import CPU, new_pool


def expected_expert(ckpt: Checkpoint, layer: int, expert: int, dtype: torch.dtype):
    t = ckpt.experts[layer, expert]
    gate, up, down = (read_tensor(info).to(dtype) for info in (t.gate, t.up, t.down))
    return torch.cat([gate, up]), down


def assert_slot_holds(pool: ModelPool, ckpt: Checkpoint, key, index: int):
    slots = pool.slot_pool
    moe_layers = [i for i, m in enumerate(ckpt.spec.moe_layers) if m]
    w13, w2 = expected_expert(ckpt, moe_layers[key[0]], key[1], slots.dtype)
    assert torch.equal(slots.w13[index], w13) and torch.equal(slots.w2[index], w2), key


@pytest.fixture()
def ckpt(hf_checkpoints, tmp_path):
    dst = tmp_path / "olmoe"                   # a private copy: fault tests damage it
    shutil.copytree(hf_checkpoints["olmoe"][0], dst)
    return Checkpoint(str(dst))


def test_budget_below_top_k_is_refused(ckpt):
    with pytest.raises(MoxError, match="at least top_k = 2"):
        new_pool(ckpt, num_slots=1)


def test_waves_cover_more_experts_than_slots_exactly_once(ckpt):
    pool = new_pool(ckpt, num_slots=3)
    seen = []
    for lease in pool.waves(1, range(8)):
        assert len(lease.slots) <= 3
        mapped = [e for e, s in enumerate(lease.slot_map.tolist()) if s >= 0]
        seen += mapped
        for expert, index in zip(mapped, lease.slots):
            assert_slot_holds(pool, ckpt, (1, expert), index)
        pool.check_integrity()
    assert sorted(seen) == list(range(8))
    stats = pool.stats()
    assert stats["misses"] == 8 and stats["waves"] >= 3
    assert stats["peak_resident_bytes"] <= stats["budget_bytes"]


def test_leases_carry_the_slots_row_table_the_triton_kernel_reads(ckpt):
    """Each lease's `rows` is its pools' slots (rebuilt when the pools grow), and the Triton
    kernel (interpreted here) reading a wave through it gives what the torch path gives."""
    from mox.kernels import fused_moe, softmax_topk
    pool = new_pool(ckpt, num_slots=3)
    gen = torch.Generator().manual_seed(0)
    hidden = pool.slot_pool.hidden
    x = torch.randn(5, hidden, generator=gen)
    weights, ids = softmax_topk(torch.randn(5, 8, generator=gen), 2, renormalize=True)
    for lease in pool.waves(1, ids.reshape(-1).tolist()):
        assert lease.rows.num_rows == lease.w13.shape[0] == 3
        assert lease.rows.w13.tolist() == [s * lease.w13.stride(0) for s in range(3)]
        args = (x, lease.w13, lease.w2, weights, ids, lease.slot_map)
        torch.testing.assert_close(fused_moe(*args, backend="triton", rows=lease.rows),
                                   fused_moe(*args, backend="torch"), atol=1e-5, rtol=1e-5)
    pool.resize(5)
    with pool.holding() as hold:
        assert hold.rows.num_rows == hold.w13.shape[0] == pool.slot_pool.num_slots


def test_hits_come_first_and_count(ckpt):
    pool = new_pool(ckpt, num_slots=4)
    pool.release(pool.acquire(0, [1, 2]))
    waves = [sorted(e for e, s in enumerate(w.slot_map.tolist()) if s >= 0)
             for w in pool.waves(0, [1, 2, 5])]
    assert waves[0] == [1, 2] and waves[1] == [5]
    assert pool.stats()["hits"] == 2


def test_leased_experts_are_never_evicted(ckpt):
    pool = new_pool(ckpt, num_slots=3)
    held = pool.acquire(0, [0, 1])
    for lease in pool.waves(1, range(8)):          # only one slot left to cycle
        assert len(lease.slots) == 1
    for expert, index in zip([0, 1], held.slots):
        assert pool.slot_pool.lookup((0, expert)) == index
    pool.release(held)
    pool.check_integrity()


def test_shrinking_budget_evicts_unleased_and_compacts(ckpt):
    pool = new_pool(ckpt, num_slots=6)
    pool.release(pool.acquire(0, range(6)))
    held = pool.acquire(0, [4])
    pool.resize(2)
    assert pool.slot_pool.num_occupied == 2              # the leased one plus one more
    pool.release(held)                                    # quiet: the pool shrinks to fit
    slots = pool.slot_pool
    assert slots.num_slots == 2 and slots.lookup((0, 4)) != -1
    pool.check_integrity()
    assert_slot_holds(pool, ckpt, (0, 4), slots.lookup((0, 4)))
    pool.resize(5)                                         # grows when quiet
    assert slots.num_slots == 5


def test_a_hold_keeps_every_resident_expert_until_it_ends(ckpt):
    """A kernel reading the live table under `holding` sees no expert leave or move: a
    shrink waits for the hold, then drains; what it used counts as hits, as a wave would."""
    pool = new_pool(ckpt, num_slots=6)
    pool.release(pool.acquire(0, range(6)))
    with pool.holding() as hold:
        before = hold.slot_of.tolist()
        pool.resize(2)
        pool.prefetch(1, [0, 1])                   # room for another layer: none evictable
        assert hold.slot_of.tolist() == before and pool.slot_pool.num_occupied == 6
        assert pool.slot_pool.num_slots == 6 and hold.w13.shape[0] == 6
        hits, steps = pool.stats()["hits"], pool.usage.steps[0]
        counts = pool.usage.counts[0].copy()
        hold.used.append((0, [3, 1, 3]))
    assert pool.stats()["hits"] == hits + 2 and pool.usage.steps[0] > steps
    grew = pool.usage.counts[0] > counts
    assert grew[[1, 3]].all() and grew.sum() == 2
    assert pool.slot_pool.num_occupied == 2 and pool.slot_pool.num_slots == 2   # drained
    pool.check_integrity()
    pool.resize(0)
    with pytest.raises(MoxError, match="parked"):
        with pool.holding():
            pass


def test_a_hold_over_several_model_steps_counts_them_as_holds_one_a_step(ckpt):
    """Decode steps run back to back under one hold (a layer that comes again starts the
    next step): the miss-ratio curve and usage are those of one hold a step."""
    steps = [[(0, [1, 2]), (1, [0, 3])], [(0, [2, 5]), (1, [3, 4])], [(0, [1, 5])]]
    pools = [new_pool(ckpt, num_slots=16) for _ in range(2)]    # (fake clocks, both still)
    for pool in pools:
        pool.release(pool.acquire(0, range(8)))
        pool.release(pool.acquire(1, range(8)))
    with pools[0].holding() as hold:
        hold.used += [layer for step in steps for layer in step]
    for step in steps:
        with pools[1].holding() as hold:
            hold.used += step
    assert pools[0].stats()["hits"] == pools[1].stats()["hits"] == 10
    assert pools[0].miss_curve.counts.tolist() == pools[1].miss_curve.counts.tolist()
    assert (pools[0].usage.steps == pools[1].usage.steps).all()


def test_cpu_pools_resize_in_place_and_give_pages_back():
    from mox.pager.slot_pool import SlotPool
    pool = SlotPool(2, 8, 1024, 512, torch.bfloat16, CPU, num_slots=6)
    base = pool.w13.data_ptr()
    for index in range(6):                                 # experts (0, 0..5) in slots 0..5
        pool.reserve(index, (0, index), prefetched=False)
        for part in pool._parts():
            part[index].fill_(index + 1)
        pool.commit(index)
        pool.slots[index].pins -= 1
    for index in (0, 2, 3):
        pool.clear(index)
    pool.target_slots = 3
    pool.compact([1, 4, 5])                       # 1 stays; 4 and 5 move into 0 and 2
    assert pool.w13.data_ptr() == base and pool.num_slots == 3
    assert pool.in_use()[0].shape[0] == 3
    for expert in (1, 4, 5):
        index = pool.lookup((0, expert))
        assert index < 3 and all(bool((part[index] == expert + 1).all())
                                 for part in pool._parts())
    assert not pool.w13[4:6].any()                # the tail's pages went back (read as zero)
    pool.check_integrity()
    pool.target_slots = 8
    pool.grow()
    assert pool.w13.data_ptr() == base and pool.num_slots == 8
    assert all(pool.lookup((0, e)) != -1 for e in (1, 4, 5))


def test_policies_choose_their_victims():
    lru, lfu, rate = LRUPolicy(), LFUPolicy(), RatePolicy(half_life_s=10.0)
    for t, key in enumerate([(0, 1), (0, 2), (0, 1), (0, 1), (0, 3)]):
        for policy in (lru, lfu, rate):
            policy.on_access(key, float(t))
    keys = [(0, 1), (0, 2), (0, 3)]
    assert lru.victims(keys, 1, 5.0) == [(0, 2)]           # least recently used
    assert lru.victims(keys, 2, 5.0) == [(0, 2), (0, 1)]
    assert lfu.victims(keys, 1, 5.0) == [(0, 2)]           # used once, earlier than (0, 3)
    lfu.on_evict((0, 1))
    assert lfu.counts[(0, 1)] == 3                         # counts survive eviction
    assert rate.victims(keys, 1, 5.0) == [(0, 2)]
    assert rate.victims(keys + [(0, 9)], 1, 5.0) == [(0, 9)]       # never used goes first
    # decayed: after a long quiet spell, one fresh use beats three old ones
    rate.on_access((0, 3), 100.0)
    assert rate.victims([(0, 1), (0, 3)], 1, 100.0) == [(0, 1)]
    # the frequency halves every half-life: (0, 1) was used at t = 0, 2, 3
    expected = sum(0.5 ** ((30.0 - t) / 10.0) for t in (0.0, 2.0, 3.0))
    assert rate.frequency((0, 1), 30.0) == pytest.approx(expected)
    assert rate.frequency((0, 7), 30.0) == 0.0


def test_a_steps_hits_at_once_score_as_they_would_one_by_one():
    """on_access_many (a decode step's hits) leaves every policy as on_access in turn does,
    bit for bit, new keys and known ones alike. (The rate policy's on_access is its
    on_access_many of one key; its arithmetic is checked against the decayed frequency in
    test_policies_choose_their_victims.)"""
    steps = [[(0, 1), (0, 2)], [(0, 1), (1, 5), (0, 3)], [(1, 5)], [(0, 2), (0, 9)]]
    for make in (LRUPolicy, LFUPolicy, lambda: RatePolicy(half_life_s=10.0)):
        at_once, in_turn = make(), make()
        for t, keys in enumerate(steps):
            at_once.on_access_many(keys, 3.7 * t)
            for key in keys:
                in_turn.on_access(key, 3.7 * t)
        assert at_once == in_turn


def test_host_tier_serves_evicted_experts(ckpt):
    expert_bytes_disk = ckpt.expert_nbytes
    pool = new_pool(ckpt, num_slots=2, host_memory=8 * expert_bytes_disk)
    for _ in pool.waves(0, range(6)):               # 6 experts through 2 slots
        pass
    before = pool.stats()
    assert before["bytes_read_disk"] == 6 * expert_bytes_disk
    for lease in pool.waves(0, range(6)):
        for expert, index in zip([e for e, s in enumerate(lease.slot_map.tolist()) if s >= 0],
                                 lease.slots):
            assert_slot_holds(pool, ckpt, (0, expert), index)
    after = pool.stats()
    assert after["bytes_read_disk"] == before["bytes_read_disk"]
    assert after["bytes_read_host"] > 0


@pytest.mark.parametrize("maps_host", [True, False])
def test_misses_in_the_host_cache_are_read_in_place_while_they_load(ckpt, maps_host):
    """On a GPU (the interpreted Triton kernels here, plain CPU tensors standing in for pinned
    host memory) a miss the host cache holds is computed in the first wave, read where it
    lies, while it loads into a slot for later steps; without mapping it waits for its load."""
    from mox.kernels import reference_fused_moe, softmax_topk
    dtype = ckpt.experts[1, 0].gate.dtype            # cached bytes are read as they are stored
    pool = new_pool(ckpt, num_slots=4, host_memory=16 * ckpt.expert_nbytes, dtype=dtype)
    for _ in pool.waves(1, range(8)):               # every expert through the host cache
        pass
    pool.wait_for_loads()
    slot_of = pool.slot_pool.slot_of[1].tolist()
    resident = [e for e in range(8) if slot_of[e] >= 0]
    cached = [e for e in range(8) if slot_of[e] < 0]
    assert len(resident) == 4 and len(cached) == 4
    pool.maps_host_experts = maps_host
    wanted = [resident[0], cached[0], cached[1]]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, pool.slot_pool.hidden, generator=gen).to(dtype)
    weights, columns = softmax_topk(torch.randn(4, 3, generator=gen), 2, renormalize=True)
    ids = torch.tensor(wanted, dtype=torch.int32)[columns.long()]
    moe_layer_1 = [i for i, m in enumerate(ckpt.spec.moe_layers) if m][1]
    experts = [expected_expert(ckpt, moe_layer_1, e, dtype) for e in range(8)]
    want = reference_fused_moe(x.float(), torch.stack([w13 for w13, _ in experts]).float(),
                               torch.stack([w2 for _, w2 in experts]).float(), weights, ids,
                               torch.arange(8, dtype=torch.int32))
    items, out = _computed_waves(pool, 1, x, weights, ids)
    if maps_host:                   # one wave, no wait: the slot and two mapped experts
        assert items == [sorted(wanted)]
        assert pool.stats()["mapped_reads"] == 2
    else:                           # the resident expert, then the two after their reads
        assert items[0] == [resident[0]] and sorted(sum(items[1:], [])) == cached[:2]
        assert pool.stats()["mapped_reads"] == 0
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    pool.wait_for_loads()                            # and they landed in slots
    assert all(pool.slot_pool.lookup((1, e)) >= 0 for e in wanted)
    pool.check_integrity()


def _computed_waves(pool: ModelPool, moe_layer: int, x, weights, ids):
    """The experts of each wave of `ids`, and their sum `[T, H]` f32, computed as the engine
    does (the Triton kernels where a wave maps host memory)."""
    from mox.kernels import fused_moe
    from mox.pager.pending import ReadsPending
    out, waves = torch.zeros(x.shape, dtype=torch.float32), []
    for lease in pool.wave_steps(moe_layer, ids.reshape(-1).tolist()):
        if isinstance(lease, ReadsPending):
            continue
        backend = "triton" if lease.rows.mapped else "torch"
        out += fused_moe(x, lease.w13, lease.w2, weights, ids, lease.slot_map, backend=backend,
                         rows=lease.rows, out_dtype=torch.float32)
        waves.append([e for e, s in enumerate(lease.slot_map.tolist()) if s >= 0])
    return waves, out


def test_prefetch_loads_ahead_and_counts_hits(ckpt):
    pool = new_pool(ckpt, num_slots=8)
    pool.prefetch(1, [3, 4])
    for _ in pool.waves(1, [3, 4]):
        pass
    stats = pool.stats()
    assert stats["prefetches"] == 2 and stats["prefetch_hits"] == 2


def test_a_read_ahead_a_step_waits_on_moves_to_demand_priority(ckpt, monkeypatch):
    """A cold start's read-ahead is queued below demand reads, behind other models' read-
    aheads too: the experts a step then needs must not wait behind all of that."""
    pool = new_pool(ckpt, num_slots=None)
    reader = pool.loader.reader
    promoted = []
    promote = reader.promote
    monkeypatch.setattr(reader, "promote", lambda f: promoted.append(f) or promote(f))
    release = threading.Event()
    blockers = [reader.submit_call(release.wait, 10) for _ in range(8)]    # every I/O thread
    try:
        pool.preload({0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}, wait=False)
        wanted = {e: pool._inflight[(1, e)] for e in (2, 3)}
        steps = pool.wave_steps(1, [2, 3, 5])       # 5 was not read ahead: a demand read
        first = next(steps)
        assert set(promoted) == set(wanted.values())
        release.set()
        for item in itertools.chain([first], steps):
            if not isinstance(item, Lease):
                item.wait()
    finally:
        release.set()
        for b in blockers:
            b.result(timeout=10)
    pool.wait_for_loads()
    for e in (2, 3, 5):
        assert_slot_holds(pool, ckpt, (1, e), pool.slot_pool.lookup((1, e)))


def test_prefetch_never_evicts_protected_layers(ckpt):
    pool = new_pool(ckpt, num_slots=2)
    pool.release(pool.acquire(0, [0, 1]))
    pool.prefetch(1, [5], protect_layers=(0,))
    assert pool.stats()["prefetches"] == 0
    pool.prefetch(1, [5])
    assert pool.stats()["prefetches"] == 1


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_file_fails_the_step_and_recovers(ckpt, damage):
    pool = new_pool(ckpt, num_slots=4)
    shard = ckpt.experts[1, 6].down.file
    saved = shard + ".saved"
    shutil.copy(shard, saved)
    if damage == "truncate":
        os.truncate(shard, ckpt.experts[1, 6].gate.offset)
    else:
        os.remove(shard)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*layer 1 expert 6"):
        for _ in pool.waves(1, [6]):
            pass
    pool.check_integrity()
    assert pool.slot_pool.lookup((1, 6)) == -1 and pool.slot_pool.num_occupied == 0
    os.replace(saved, shard)                               # the file is back
    lease = pool.acquire(1, [6])
    assert_slot_holds(pool, ckpt, (1, 6), lease.slots[0])
    pool.release(lease)


class PagerMachine(RuleBasedStateMachine):
    """Random acquire / release / resize / prefetch, under each eviction policy. Invariants: the
    budget holds (beyond it only experts leased when it shrank), leased experts stay put,
    and every resident slot holds exactly its expert's checkpoint bytes."""

    ckpt: Checkpoint = None   # set by the test

    @initialize(policy=st.sampled_from(["lru", "lfu", "rate"]))
    def open_pool(self, policy):
        self.pool = new_pool(self.ckpt, num_slots=4, dtype=torch.bfloat16, policy=policy)
        self.leases = []

    def _pinned(self) -> int:
        return sum(len(lease.slots) for lease in self.leases)

    @rule(layer=st.integers(0, 1), experts=st.sets(st.integers(0, 7), min_size=1, max_size=3))
    def acquire(self, layer, experts):
        target = self.pool.slot_pool.target_slots
        held = {(lease.moe_layer, e) for lease in self.leases
                for e, s in enumerate(lease.slot_map.tolist()) if s >= 0}
        new = {(layer, e) for e in experts} - held
        if self._pinned() + len(new) > target or new != {(layer, e) for e in experts}:
            return                          # would wait for a lease this test never releases
        self.leases.append(self.pool.acquire(layer, experts))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        lease = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        self.pool.release(lease)

    @rule(slots=st.integers(2, 7))
    def resize(self, slots):
        self.pool.resize(slots)

    @rule(layer=st.integers(0, 1), experts=st.sets(st.integers(0, 7), max_size=4))
    def prefetch(self, layer, experts):
        self.pool.prefetch(layer, experts)
        self.pool.wait_for_loads()      # keep the run deterministic for shrinking

    @invariant()
    def tables_are_consistent(self):
        self.pool.check_integrity()

    @invariant()
    def budget_holds(self):
        stats = self.pool.stats()
        pinned_bytes = self._pinned() * stats["expert_bytes"]
        assert stats["resident_bytes"] <= max(stats["budget_bytes"], pinned_bytes)

    @invariant()
    def leased_experts_stay_and_hold_their_bytes(self):
        pool = self.pool.slot_pool
        for lease in self.leases:
            for expert, s in enumerate(lease.slot_map.tolist()):
                if s >= 0:
                    assert pool.lookup((lease.moe_layer, expert)) == s
                    assert_slot_holds(self.pool, self.ckpt,
                                      (lease.moe_layer, expert), s)

    @invariant()
    def resident_slots_hold_their_bytes(self):
        pool = self.pool.slot_pool
        for index, slot in enumerate(pool.slots):
            if slot.key is not None and not slot.loading:
                assert_slot_holds(self.pool, self.ckpt, slot.key, index)

    def teardown(self):
        for lease in self.leases:
            self.pool.release(lease)


def test_pager_state_machine(ckpt):
    PagerMachine.ckpt = ckpt
    examples = int(os.environ.get("MOX_STATEFUL_EXAMPLES", "30"))   # raise it to soak
    PagerMachine.TestCase.settings = settings(max_examples=examples, stateful_step_count=25,
                                              deadline=None)
    PagerMachine.TestCase().runTest()


def test_prefetch_popular_takes_only_clearly_popular_experts(ckpt):
    pool = new_pool(ckpt, num_slots=8)
    for _ in range(20):                                    # layer 0 always uses experts 1, 2
        for _lease in pool.waves(0, [1, 2]):
            pass
        for _lease in pool.waves(1, [3, 4]):
            pass
    pool.resize(0)                                         # parked, then back: a cold pool
    pool.resize(8)
    started = pool.prefetch_popular(limit=8)
    pool.wait_for_loads()
    slots = pool.slot_pool
    resident = {slots.slots[i].key for i in range(slots.num_slots) if slots.slots[i].key}
    assert started == 4 and resident == {(0, 1), (0, 2), (1, 3), (1, 4)}
    pool.check_integrity()


def test_prefetch_popular_skips_uniform_usage(ckpt):
    pool = new_pool(ckpt, num_slots=8)
    num_experts = ckpt.spec.num_experts
    for step in range(num_experts):                        # every expert equally often
        for _lease in pool.waves(0, [step, (step + 1) % num_experts]):
            pass
    pool.resize(0)
    pool.resize(8)
    assert pool.prefetch_popular(limit=8) == 0


def test_most_used_picks_the_busiest_experts_within_the_budget(ckpt):
    pool = new_pool(ckpt, num_slots=4)
    for _ in range(5):
        pool.release(pool.acquire(1, [2, 5]))
    pool.release(pool.acquire(0, [7]))
    assert pool.most_used(3) == {0: [7], 1: [2, 5]}
    assert sum(map(len, pool.most_used(100).values())) == 4        # at most the slots



def test_usage_records_wait_and_read_the_same(ckpt, monkeypatch):
    """A step's usage and miss-curve records wait to be applied in bulk; whoever reads the
    statistics gets what records applied at once give, bit for bit, times and order kept."""
    steps = [[(0, [1, 2])], [(0, [2]), (1, [0, 3])], [(1, [3])], [(0, [0, 1, 2, 3])]] * 5
    figures = []
    for wait in (paging.UNRECORDED_STEPS, 1):      # in bulk; then each at once
        monkeypatch.setattr(paging, "UNRECORDED_STEPS", wait)
        pool, seen = new_pool(ckpt, num_slots=None), []
        pool.release(pool.acquire(0, range(4)))
        pool.release(pool.acquire(1, range(4)))
        for i, step in enumerate(steps):
            with pool.holding() as hold:
                hold.used += step
            if i % 7 == 3:                         # a read between steps
                seen.append(pool.demand().hit_rates.copy())
            assert len(pool._unrecorded) < wait
        figures.append((pool.usage.counts, pool.usage.steps, pool.miss_curve.counts,
                        pool.miss_curve.last_use, *seen))
    bulk, at_once = figures
    assert all(np.array_equal(a, b) for a, b in zip(bulk, at_once, strict=True))
