"""A decode step that reads every expert through the pager's table (issue 20: on a GPU, no
host round-trip in the layers): experts in slots, and misses read in place from the host
cache (plain CPU tensors standing in for pinned host memory; the Triton kernels run under the
interpreter). Its logits equal the paged waves', the experts it used are counted once the
step ends, and the mapped ones load into slots for the steps after."""

from __future__ import annotations

import pytest
import torch

from tests.models.decode_batch import decode_batch


@pytest.fixture()
def model(mapped_mixtral):
    return mapped_mixtral


def _figures(pool) -> dict:
    return {k: v for k, v in pool.stats().items()
            if k in ("hits", "misses", "mapped_reads", "waves")}


def test_the_table_step_equals_the_waves_and_loads_what_it_mapped(model):
    pool = model.experts
    batch = decode_batch(model, torch.Generator().manual_seed(5))
    resident_before = pool.slot_pool.num_occupied
    pool.maps_host_experts = False
    want = model.forward_batch(batch)
    pool.wait_for_loads()
    pool.resize(max(pool.top_k, pool.max_slots // 4))     # back to a quarter in slots
    pool.wait_for_loads()
    before = _figures(pool)
    pool.maps_host_experts = True
    got = model.forward_batch(batch)
    after = _figures(pool)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert pool.slot_pool.holds == 0
    used = after["hits"] - before["hits"] + after["mapped_reads"] - before["mapped_reads"]
    assert after["mapped_reads"] > before["mapped_reads"]          # misses read in place
    assert after["misses"] - before["misses"] == after["mapped_reads"] - before["mapped_reads"]
    assert after["waves"] - before["waves"] == pool.num_moe_layers  # one per layer, no waits
    assert used >= pool.num_moe_layers * pool.top_k
    pool.wait_for_loads()                          # the mapped experts landed in slots
    assert pool.slot_pool.num_occupied >= resident_before
    pool.check_integrity()


def test_an_expert_only_on_disk_sends_the_step_to_the_waves(model):
    """The table cannot address an expert the host cache does not hold: the step pages."""
    pool = model.experts
    batch = decode_batch(model, torch.Generator().manual_seed(5))
    pool.maps_host_experts = False
    want = model.forward_batch(batch)
    pool.loader.host_cache.set_quota(pool.name, 0)       # the host copies go
    pool.resize(pool.top_k)
    pool.wait_for_loads()
    pool.maps_host_experts = True
    before = _figures(pool)
    got = model.forward_batch(batch)
    after = _figures(pool)
    assert after["mapped_reads"] == before["mapped_reads"]
    assert after["misses"] > before["misses"]                # paged in waves instead
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    pool.check_integrity()


def test_with_the_triton_decode_attention_the_whole_step_is_the_gpu_path(model, monkeypatch):
    """Attention too through the Triton kernel that reads the paged store in place, and
    the norms, rotary and KV writes through the fused Triton ops (what a GPU decode step
    runs): the same logits as the gathered attention and the waves."""
    import mox.models.attend as attend
    from mox.kernels import triton_ops
    pool = model.experts
    batch = decode_batch(model, torch.Generator().manual_seed(7))
    pool.maps_host_experts = False
    want = model.forward_batch(batch)
    calls = []
    monkeypatch.setattr(triton_ops, "takes", lambda x: True)
    for module, name in ((attend, "decode_attention_triton"), (triton_ops, "rope_kv"),
                         (triton_ops, "rms_norm")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, kernel=kernel, name=name, **kwargs:
                            calls.append(name) or kernel(*args, **kwargs))
    pool.maps_host_experts = True
    got = model.forward_batch(batch)
    layers = model.spec.num_layers
    assert calls.count("decode_attention_triton") == layers  # every layer, in place
    assert calls.count("rope_kv") == layers
    assert calls.count("rms_norm") >= 2 * layers + 1          # two a layer, and the final one
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
