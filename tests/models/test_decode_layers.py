"""A CPU decode step's layers in one native call (kernels/csrc/decode_layers.c) give the
same bits, and count the same hits, as the layers one call per half; a layer that finds an
expert missing pages in waves and the chain takes up after it."""

from __future__ import annotations

import pytest
import torch

import mox.models.decoder as decoder
from mox.kernels import native
from mox.kernels.native_step import step_layers
from tests.conftest import make_hf_checkpoint, open_tiny
from tests.models.decode_batch import decode_batch

pytestmark = pytest.mark.skipif(native.kernels() is None or not native.kernels().fast,
                                reason="no native vector kernels on this machine")
CHAINED = ("mixtral", "mixtral-sliding", "olmoe", "qwen3_moe")
# the native blocks' shapes (the tiny Qwen3's I a multiple of 32), and OLMoE's routing and
# full q/k norm without the clipped qkv the attention block does not do
OVERRIDES = {"qwen3_moe": dict(moe_intermediate_size=32), "olmoe": dict(clip_qkv=None)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_layers")
    paths = {case: str(root / case) for case in (*CHAINED, "qwen2_moe")}
    for case, path in paths.items():
        make_hf_checkpoint(path, case, **OVERRIDES.get(case, {}))
    return paths


def _step(path: str, monkeypatch, chained: bool, slots_share: float = 1.0):
    """A fresh model's decode-batch logits, the `decode_layers` calls' first layers and
    results, and the pager's counters after it."""
    model = open_tiny(path, torch.bfloat16)
    pool = model.experts
    pool.resize(max(pool.top_k, int(pool.max_slots * slots_share)))
    batch = decode_batch(model, torch.Generator().manual_seed(11))
    before = pool.stats()
    kernels, calls = native.kernels(), []
    run = kernels.decode_layers
    def counted(step, first, *args, **kwargs):
        done, weights, ids = run(step, first, *args, **kwargs)
        calls.append((first, done))
        return done, weights, ids
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "decode_layers", counted)
        if not chained:
            patch.setattr(decoder.MoEDecoder, "_chains", lambda self: False)
        logits = model.forward_batch(batch)
    pool.check_integrity()
    assert pool.slot_pool.holds == 0
    after = pool.stats()
    counted_keys = ("hits", "misses", "waves")
    return logits, calls, {k: after[k] - before[k] for k in counted_keys}, model


@pytest.mark.parametrize("case", CHAINED)
def test_one_call_for_every_layer_gives_the_same_bits_and_hits(checkpoints, case,
                                                                monkeypatch):
    chained, calls, counts, model = _step(checkpoints[case], monkeypatch, chained=True)
    by_layer, no_calls, by_layer_counts, _ = _step(checkpoints[case], monkeypatch,
                                                   chained=False)
    layers = model.spec.num_layers
    assert calls == [(0, layers)] and no_calls == []
    assert torch.equal(chained, by_layer)
    assert counts == by_layer_counts and counts["misses"] == 0
    assert counts["waves"] == layers and counts["hits"] >= layers * model.spec.top_k


def test_a_layer_that_misses_pages_in_waves_and_the_chain_goes_on(checkpoints, monkeypatch):
    """A quarter of the experts in slots: the call stops at the first layer that misses, the
    layer pages in waves, and the next call starts after it; same bits as layer by layer
    (the same routing, the same waves)."""
    chained, calls, counts, model = _step(checkpoints["mixtral"], monkeypatch, chained=True,
                                          slots_share=0.25)
    by_layer, _, by_layer_counts, _ = _step(checkpoints["mixtral"], monkeypatch,
                                            chained=False, slots_share=0.25)
    layers = model.spec.num_layers
    assert len(calls) > 1 and calls[0][0] == 0
    for (first, done), (following, _) in zip(calls, calls[1:]):
        assert first <= done < layers and following == done + 1
    assert counts["misses"] > 0 and counts == by_layer_counts
    assert torch.equal(chained, by_layer)


def test_a_shared_expert_keeps_the_layers_apart(checkpoints, monkeypatch):
    """Qwen2-MoE's shared expert is added in Python: its steps call no chain."""
    logits, calls, counts, _ = _step(checkpoints["qwen2_moe"], monkeypatch, chained=True)
    assert calls == [] and counts["hits"] > 0 and torch.isfinite(logits).all()


def test_layers_that_disagree_are_refused(checkpoints):
    model = open_tiny(checkpoints["mixtral"], torch.bfloat16)
    store = model.new_kv_store(block_size=8)
    store.ensure_blocks(1)
    count = model.spec.num_layers
    attention = [model._native_layer(i) for i in range(count)]
    moe = [model._native_moe(i) for i in range(count)]
    rows = [layer.mlp.moe_layer for layer in model.layers]
    stores = [store.rows(i) for i in range(count)]
    slot_of = model.experts.slot_pool.slot_of
    step = step_layers(attention, moe, rows, stores, slot_of)
    assert len(step.array) == count
    with pytest.raises(ValueError, match="residency row"):
        step_layers(attention, moe, rows, stores, slot_of.to(torch.int64))
    with pytest.raises(ValueError, match="residency row"):
        step_layers(attention, moe, rows[:-1] + [slot_of.shape[0]], stores, slot_of)
    keys, values = stores[-1]
    with pytest.raises(ValueError, match="disagree"):
        step_layers(attention, moe, rows, stores[:-1] + [(keys[:-1], values[:-1])], slot_of)
