"""A CPU decode step's layers in one native call (kernels/csrc/decode_layers.c) give the
same bits, and count the same hits, as the layers one call per half; a layer that finds an
expert missing pages in waves and the chain takes up after it (steps back to back through
one chain: tests/engine/test_multi_step.py)."""

from __future__ import annotations

import dataclasses

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
# the native blocks' shapes (the tiny Qwens' I a multiple of 32), and OLMoE's routing and
# full q/k norm without the clipped qkv the attention block does not do
OVERRIDES = {"qwen3_moe": dict(moe_intermediate_size=32), "olmoe": dict(clip_qkv=None),
             "qwen2_moe": dict(moe_intermediate_size=32)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_layers")
    paths = {case: str(root / case) for case in (*CHAINED, "qwen2_moe")}
    for case, path in paths.items():
        make_hf_checkpoint(path, case, **OVERRIDES.get(case, {}))
    return paths


def _watch_calls(patch, seen) -> None:
    """`kernels.decode_chain` patched so that each of its chains' calls reports its first
    layer, where it stopped and its logits to `seen`."""
    kernels = native.kernels()
    decode_chain = kernels.decode_chain

    def watched(*args, **kwargs):
        chain = decode_chain(*args, **kwargs)

        def run(first, j):
            done, weights, ids, logits = chain(first, j)
            seen(first, done, logits)
            return done, weights, ids, logits
        return run
    patch.setattr(kernels, "decode_chain", watched)


def _step(path: str, monkeypatch, chained: bool, slots_share: float = 1.0):
    """A fresh model's decode-batch logits, the decode_layers.c calls' first layers,
    results and whether each ran the tail (final norm and lm_head), and the pager's counters
    after it."""
    model = open_tiny(path, torch.bfloat16)
    pool = model.experts
    pool.resize(max(pool.top_k, int(pool.max_slots * slots_share)))
    batch = decode_batch(model, torch.Generator().manual_seed(11))
    before = pool.stats()
    calls = []
    with monkeypatch.context() as patch:
        _watch_calls(patch, lambda first, done, logits: calls.append((first, done,
                                                                       logits is not None)))
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
    assert calls == [(0, layers, True)] and no_calls == []    # the tail in the same call
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
    for (first, done, _), (following, _, _) in zip(calls, calls[1:]):
        assert first <= done < layers and following == done + 1
    # every layer ran in a call or paged after the call that stopped at it
    stopped = sum(done < layers for _, done, _ in calls)
    assert sum(done - first for first, done, _ in calls) + stopped == layers
    # the tail runs in the call that runs the last layer, and only there
    assert [tail for _, _, tail in calls] == [done == layers for _, done, _ in calls]
    assert counts["misses"] > 0 and counts == by_layer_counts
    assert torch.equal(chained, by_layer)


def test_the_table_follows_a_kv_store_that_grows(checkpoints, monkeypatch):
    """The layers' table points into the KV store without holding it: after the store grows
    (in place, its tensors longer views of their mappings; or past its mappings, into new
    ones) the next step builds it anew, and a table handed another store is refused rather
    than written through."""
    model = open_tiny(checkpoints["mixtral"], torch.bfloat16)
    batch = decode_batch(model, torch.Generator().manual_seed(12))
    first = model.forward_batch(batch)
    blocks = batch.kv.num_blocks                # mapped for 4x as many (decode_batch)
    for size, in_place in ((2 * blocks, True), (8 * blocks, False)):
        table, where = model._step[1], batch.kv.keys[0].data_ptr()
        batch.kv.ensure_blocks(size)
        assert (batch.kv.keys[0].data_ptr() == where) == in_place
        # the same tokens at the same slots: the same K, V and logits, through a new table
        assert torch.equal(model.forward_batch(batch), first) and model._step[1] is not table
    with monkeypatch.context() as patch:
        patch.setattr(decoder.MoEDecoder, "_chains", lambda self: False)
        assert torch.equal(model.forward_batch(batch), first)
    keys, values = batch.kv.rows(0)
    kernels, x = native.kernels(), torch.zeros(3, model.spec.hidden_size, dtype=torch.bfloat16)
    pool = model.experts.slot_pool
    with pytest.raises(ValueError, match="another KV store"):
        kernels.decode_chain(table, x, torch.empty_like(x), batch.decode_rows(model.rotary),
                             (keys, values), pool.w13, pool.w2)


def test_a_chain_refuses_rows_that_are_not_one_per_token_and_step(checkpoints):
    """A chain's per-step pointers are taken from its rows once, so rows of the wrong shape or
    layout are refused when it is made, not read past."""
    model = open_tiny(checkpoints["mixtral"], torch.bfloat16)
    batch = decode_batch(model, torch.Generator().manual_seed(12))
    model.forward_batch(batch)
    rows, pool = batch.decode_rows(model.rotary), model.experts.slot_pool
    x = torch.zeros(batch.num_tokens, model.spec.hidden_size, dtype=torch.bfloat16)
    kernels = native.kernels()
    for bad in (dataclasses.replace(rows, lengths=rows.lengths[:, :-1]),
                dataclasses.replace(rows, cos=rows.cos[:-1], sin=rows.sin[:-1]),
                dataclasses.replace(rows, slot_mapping=rows.slot_mapping.repeat(1, 2)[:, ::2])):
        with pytest.raises(ValueError, match="one per token and step"):
            kernels.decode_chain(model._step[1], x, torch.empty_like(x), bad,
                                 batch.kv.rows(0), pool.w13, pool.w2)
    chain = kernels.decode_chain(model._step[1], x, torch.empty_like(x), rows,
                                 batch.kv.rows(0), pool.w13, pool.w2)
    assert chain.num_tokens == batch.num_tokens and chain.num_layers == model.spec.num_layers


def test_prefetch_keeps_the_layers_apart(checkpoints, monkeypatch):
    """The pager's prefetch routes each next layer from Python: such a model's steps do not
    chain, and give the same logits."""
    chained, _, _, _ = _step(checkpoints["mixtral"], monkeypatch, chained=True)
    model = open_tiny(checkpoints["mixtral"], torch.bfloat16)
    model.experts.prefetch_enabled = True
    batch = decode_batch(model, torch.Generator().manual_seed(11))
    calls = []
    kernels = native.kernels()
    run = kernels.decode_chain
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "decode_chain", lambda *a, **k: calls.append(1) or run(*a, **k))
        logits = model.forward_batch(batch)
    assert calls == [] and torch.equal(logits, chained)


def test_a_shared_expert_keeps_the_layers_apart(checkpoints, monkeypatch):
    """Qwen2-MoE's shared expert is added in Python (and its second layer is a dense MLP):
    its steps call no chain, and the MoE layers still take the native block."""
    kernels, blocks = native.kernels(), []
    block = kernels.moe_block
    monkeypatch.setattr(kernels, "moe_block", lambda *a, **k: blocks.append(1) or block(*a, **k))
    logits, calls, counts, model = _step(checkpoints["qwen2_moe"], monkeypatch, chained=True)
    assert calls == [] and len(blocks) == model.spec.num_moe_layers
    assert counts["hits"] > 0 and torch.isfinite(logits).all()


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


def test_a_batch_that_gathers_its_logits_rows_runs_the_tail_in_torch(checkpoints, monkeypatch):
    """The native tail covers every row; a batch naming the rows it samples (`logits_indices`)
    takes the tail from Python after the chain: no logits from the call, the same values."""
    model = open_tiny(checkpoints["olmoe"], torch.bfloat16)
    batch = decode_batch(model, torch.Generator().manual_seed(11))
    every_row = model.forward_batch(batch)
    model = open_tiny(checkpoints["olmoe"], torch.bfloat16)
    batch = decode_batch(model, torch.Generator().manual_seed(11))
    batch.logits_indices = torch.tensor([2, 0])
    tails = []
    _watch_calls(monkeypatch, lambda first, done, logits: tails.append(logits is not None))
    assert torch.equal(model.forward_batch(batch), every_row[[2, 0]]) and tails == [False]


def test_the_timeline_build_times_each_phase_and_gives_the_same_bits(checkpoints,
                                                                    monkeypatch):
    """MOX_NATIVE_TIMELINE=1 builds the library with csrc/timeline.h's marks: it counts the
    chain's calls and the time of each phase of them (bench/micro/chain_timeline.py), and
    computes the same logits as the library without them, which has no timeline."""
    plain, _, _, _ = _step(checkpoints["olmoe"], monkeypatch, chained=True)
    assert native.kernels().timeline_take() is None
    monkeypatch.setenv("MOX_NATIVE_TIMELINE", "1")
    native.kernels.cache_clear()
    try:
        assert native.kernels().timeline_take()["calls"] == 0
        timed, calls, _, _ = _step(checkpoints["olmoe"], monkeypatch, chained=True)
        phases = native.kernels().timeline_take()
    finally:
        native.kernels.cache_clear()      # (the env var is restored at teardown)
    assert torch.equal(timed, plain)
    assert phases["calls"] == len(calls) == 1
    assert set(phases) == set(native.TIMELINE_PHASES)
    assert all(seconds > 0 for phase, seconds in phases.items() if phase != "calls")
