"""The attention half of a decode layer in one native call (kernels/csrc/attention_block.c)
gives the same bits as the steps run one by one, for every attention variant it takes; the
variants it does not take go the step-by-step way."""

from __future__ import annotations

import pytest
import torch

import mox.models.decoder as decoder
from mox.kernels import native
from mox.models.attention import native_layer
from mox.models.forward_batch import ForwardBatch
from tests.conftest import open_tiny
from tests.models.decode_batch import decode_batch

pytestmark = pytest.mark.skipif(native.kernels() is None or not native.kernels().fast,
                                reason="no native vector kernels on this machine")


def _logits(model, batch: ForwardBatch, monkeypatch, native_block: bool
            ) -> tuple[torch.Tensor, int]:
    """The batch's logits and how many layers ran the native block."""
    calls = []
    block = decoder.attention_block
    with monkeypatch.context() as patch:
        patch.setattr(decoder, "attention_block",
                      lambda *args: calls.append(1) or block(*args))
        # the block a layer at a time (a step chains them where it can: test_decode_layers)
        patch.setattr(decoder.MoEDecoder, "_chains", lambda self: False)
        if not native_block:
            patch.setattr(decoder, "takes_block", lambda *args: False)
        return model.forward_batch(batch), len(calls)


# plain GQA; a sliding window; qkv biases; q/k norm per head; that with partial rotary and
# biases
@pytest.mark.parametrize("case", ["mixtral", "mixtral-sliding", "qwen2_moe", "qwen3_moe",
                                  "glm4_moe"])
def test_native_block_equals_the_steps(hf_checkpoints, case, monkeypatch):
    model = open_tiny(hf_checkpoints[case][0], torch.bfloat16)
    batch = decode_batch(model, torch.Generator().manual_seed(3))
    fused, calls = _logits(model, batch, monkeypatch, native_block=True)
    steps, no_calls = _logits(model, batch, monkeypatch, native_block=False)
    assert calls == model.spec.num_layers and no_calls == 0
    assert torch.equal(fused, steps)


def test_clipped_qkv_goes_step_by_step(hf_checkpoints, monkeypatch):
    """OLMoE's clip_qkv is not in the native block: its layers run the steps."""
    model = open_tiny(hf_checkpoints["olmoe"][0], torch.bfloat16)
    assert model.spec.clip_qkv is not None
    batch = decode_batch(model, torch.Generator().manual_seed(4))
    logits, calls = _logits(model, batch, monkeypatch, native_block=True)
    assert calls == 0 and logits.isfinite().all()


def _first_layer(hf_checkpoints, seed: int):
    """The tiny mixtral, a decode batch of it, and its first layer's native struct."""
    model = open_tiny(hf_checkpoints["mixtral"][0], torch.bfloat16)
    batch = decode_batch(model, torch.Generator().manual_seed(seed))
    first = model.layers[0]
    layer = native_layer(model.spec, first.attention, 0, first.input_norm,
                         first.post_attention_norm, model.rotary)
    return model, batch, layer


def test_native_block_refuses_a_store_of_another_shape(hf_checkpoints):
    """The C code reads what the struct says: a store of the wrong head size is refused
    before it runs, with a clear error."""
    model, batch, layer = _first_layer(hf_checkpoints, seed=5)
    keys, values = batch.kv.rows(0)
    starts, lengths = batch.key_ranges
    with pytest.raises(ValueError, match="keys and values disagree"):
        native.kernels().attention_block(
            layer, torch.zeros(3, model.spec.hidden_size, dtype=torch.bfloat16),
            batch.rotary_tables(model.rotary), keys[:, :, :4].contiguous(),
            values[:, :, :4].contiguous(), batch.slot_mapping, batch.kv_slots, starts, lengths)


def test_native_block_refuses_key_runs_and_slots_out_of_bounds(hf_checkpoints):
    """The index tensors' values are checked in C before any step runs: a key run past the
    batch's keys, or a key slot past the store, is refused and the store is left as it was."""
    model, batch, layer = _first_layer(hf_checkpoints, seed=6)
    keys, values = batch.kv.rows(0)
    before = keys.clone()
    starts, lengths = batch.key_ranges
    x = torch.zeros(3, model.spec.hidden_size, dtype=torch.bfloat16)
    tables = batch.rotary_tables(model.rotary)
    bad_slots = batch.kv_slots.clone()
    bad_slots[-1] = keys.shape[0]
    for kv_slots, runs in ((batch.kv_slots, (starts, lengths + 1)), (bad_slots, (starts, lengths))):
        with pytest.raises(ValueError, match="outside"):
            native.kernels().attention_block(layer, x, tables, keys, values, batch.slot_mapping,
                                             kv_slots, *runs)
    assert torch.equal(keys.view(torch.int16), before.view(torch.int16))   # (bits: NaN != NaN)
