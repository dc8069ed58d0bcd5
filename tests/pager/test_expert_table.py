"""The expert table a GPU decode step reads its experts through (mox.pager.expert_table): every
expert's row (its slot, or its bytes in place in the host cache), kept current between steps
as slots change and the host cache evicts, each refresh a new snapshot."""

from __future__ import annotations

import shutil

import pytest
import torch

from mox.kernels import NOT_RESIDENT
from mox.loaders import Checkpoint
from tests.pager.pools import new_pool


@pytest.fixture()
def pool(hf_checkpoints, tmp_path):
    """Tiny OLMoE in its checkpoint's dtype, every expert of every layer read once through
    the host cache, then 6 slots."""
    dst = tmp_path / "olmoe"
    shutil.copytree(hf_checkpoints["olmoe"][0], dst)
    ckpt = Checkpoint(str(dst))
    pool = new_pool(ckpt, num_slots=6, host_memory=64 * ckpt.expert_nbytes,
                    dtype=ckpt.experts[1, 0].gate.dtype)
    for moe_layer in range(pool.num_moe_layers):
        for _ in pool.waves(moe_layer, range(pool.num_experts)):
            pass
    pool.wait_for_loads()
    return pool


def _table(pool):
    with pool._lock:
        return pool._expert_table()


def _address(table, pool, row: int, part: str) -> int:
    offsets, tensor = getattr(table.rows, part), getattr(pool.slot_pool, part)
    return tensor.data_ptr() + int(offsets[row]) * tensor.element_size()


def test_every_expert_has_a_row_through_which_its_bytes_are_read(pool):
    table, slots, num_experts = _table(pool), pool.slot_pool, pool.num_experts
    assert table.complete and torch.equal(table.row_of.cpu(), torch.from_numpy(table.row_of_host))
    for layer in range(pool.num_moe_layers):
        for expert in range(num_experts):
            row, slot = int(table.row_of_host[layer, expert]), slots.lookup((layer, expert))
            if slot != NOT_RESIDENT:
                assert row == table.first_slot_row + slot and not table.is_mapped(layer, expert)
                want = slots.w13[slot].data_ptr()
            else:                                 # the host cache's bytes, in place
                assert row == layer * num_experts + expert and table.is_mapped(layer, expert)
                raw = pool.loader.host_cache.get((pool.name, layer, expert), touch=False)
                want = raw.data_ptr()
            assert _address(table, pool, row, "w13") == want
            w2 = _address(table, pool, row, "w2")
            w13_bytes = slots.w13[0].numel() * slots.w13.element_size()
            assert w2 == (slots.w2[slot].data_ptr() if slot != NOT_RESIDENT else want + w13_bytes)


def test_slot_changes_flip_rows_in_a_new_snapshot(pool):
    first = _table(pool)
    assert _table(pool) is first                                      # nothing changed
    rows_before = first.row_of_host.copy()
    keys = [(layer, e) for layer in range(pool.num_moe_layers) for e in range(pool.num_experts)]
    resident = [key for key in keys if pool.slot_pool.lookup(key) != NOT_RESIDENT]
    pool.resize(3)                                                    # three are evicted
    pool.wait_for_loads()
    second = _table(pool)
    assert second is not first and (first.row_of_host == rows_before).all()   # a snapshot
    evicted = [key for key in resident if pool.slot_pool.lookup(key) == NOT_RESIDENT]
    assert len(evicted) == 3 and second.complete
    for layer, expert in evicted:                 # now read in place from the host cache
        assert second.row_of_host[layer, expert] == layer * pool.num_experts + expert
    layer, expert = evicted[0]
    for _ in pool.waves(layer, [expert]):                            # one comes back
        pass
    third = _table(pool)
    slot = pool.slot_pool.lookup(evicted[0])
    assert third.row_of_host[evicted[0]] == third.first_slot_row + slot


def test_experts_the_host_cache_drops_lose_their_rows(pool):
    assert _table(pool).complete
    pool.loader.host_cache.set_quota(pool.name, 0)                    # every host copy goes
    table = _table(pool)
    assert not table.complete and not table.rows.mapped
    for layer in range(pool.num_moe_layers):
        for expert in range(pool.num_experts):
            resident = pool.slot_pool.lookup((layer, expert)) != NOT_RESIDENT
            assert (table.row_of_host[layer, expert] != NOT_RESIDENT) == resident


def test_loads_that_evict_move_both_rows_between_rebuilds(pool):
    """In a full pool a load evicts another expert: the table follows both changes from the
    pool's change log, with no full rebuild in between."""
    pool.resize(3)
    pool.wait_for_loads()
    _table(pool)                                             # the rebuild after compaction
    slots, num_experts = pool.slot_pool, pool.num_experts
    keys = [(layer, e) for layer in range(pool.num_moe_layers) for e in range(num_experts)]
    for newcomer in [key for key in keys if slots.lookup(key) == NOT_RESIDENT][:2]:
        resident = {key for key in keys if slots.lookup(key) != NOT_RESIDENT}
        for _ in pool.waves(newcomer[0], [newcomer[1]]):
            pass
        pool.wait_for_loads()
        assert slots.num_slots == 3 and resident - {k for k in keys
                                                    if slots.lookup(k) != NOT_RESIDENT}
        table = _table(pool)
        for layer, expert in keys:
            slot = slots.lookup((layer, expert))
            want = (table.first_slot_row + slot if slot != NOT_RESIDENT
                    else layer * num_experts + expert)
            assert table.row_of_host[layer, expert] == want, (layer, expert)
