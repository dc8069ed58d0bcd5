"""The paged KV store's storage: on the CPU it grows as longer views of one mapping per
tensor (no copy, the blocks in use keep their addresses) and hands its pages back on release."""

import torch

from mox.models.kv_store import KVStore

CPU = torch.device("cpu")


def _store() -> KVStore:
    return KVStore(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, device=CPU,
                   block_size=4, value_dim=4)


def _write(store: KVStore, slots: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(len(slots), 2, 8, generator=gen).bfloat16()
    v = torch.randn(len(slots), 2, 4, generator=gen).bfloat16()
    for layer in range(store.num_layers):
        store.write(layer, torch.tensor(slots), k, v)
    return k, v


def test_a_cpu_store_grows_in_place():
    store = _store()
    store.ensure_blocks(1, max_blocks=64)
    k, v = _write(store, [0, 3], seed=0)
    where = [t.data_ptr() for t in (*store.keys, *store.values)]
    store.ensure_blocks(5, max_blocks=64)
    assert store.num_blocks >= 5
    assert [t.data_ptr() for t in (*store.keys, *store.values)] == where
    for layer in range(store.num_layers):
        assert torch.equal(store.gather(layer, torch.tensor([0, 3]))[0], k)
        assert torch.equal(store.gather(layer, torch.tensor([0, 3]))[1], v)
    k2, _ = _write(store, [19], seed=1)                # a slot in the new blocks
    assert torch.equal(store.gather(1, torch.tensor([19]))[0], k2)


def test_a_store_grown_past_its_budget_keeps_its_blocks():
    """The budget that sized the mapping grew: a larger mapping, the blocks copied over."""
    store = _store()
    store.ensure_blocks(2, max_blocks=2)
    k, v = _write(store, [1, 6], seed=2)
    store.ensure_blocks(10, max_blocks=16)
    assert store.num_blocks >= 10
    for layer in range(store.num_layers):
        got_k, got_v = store.gather(layer, torch.tensor([1, 6]))
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_a_released_store_gives_its_pages_back_and_grows_again():
    store = _store()
    store.ensure_blocks(4, max_blocks=8)
    _write(store, [2, 9], seed=3)
    where = store.keys[0].data_ptr()
    store.release()
    assert store.num_blocks == 0 and store.keys == [] and store.values == []
    store.ensure_blocks(4, max_blocks=8)
    assert store.keys[0].data_ptr() == where          # the same mapping, its pages new
    # the pages were handed back (MADV_DONTNEED): they read as zeros, not as the old K/V
    for layer in range(store.num_layers):
        got_k, got_v = store.gather(layer, torch.tensor([2, 9]))
        assert not got_k.any() and not got_v.any()
