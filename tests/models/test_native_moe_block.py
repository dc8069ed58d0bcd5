"""The decoder's MoE layers through the native block (kernels/csrc/moe_block.c: routing and
resident experts in one call) give the same bits as the Python block's steps, for every
routing it takes; a layer whose experts are not all resident pages them in waves."""

from __future__ import annotations

import pytest
import torch

import mox.models.decoder as decoder
from mox.kernels import native
from tests.conftest import make_hf_checkpoint, open_tiny
from tests.models.decode_batch import decode_batch

pytestmark = pytest.mark.skipif(native.kernels() is None or not native.kernels().fast,
                                reason="no native vector kernels on this machine")
# the tiny cases' experts where the native kernel takes them (H and I multiples of 32)
WIDE_EXPERTS = {"qwen2_moe": dict(moe_intermediate_size=32),
                "qwen3_moe": dict(moe_intermediate_size=32)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("native_moe")
    cases = ("mixtral", "olmoe", "gpt_oss", "qwen2_moe", "qwen3_moe")
    paths = {case: str(root / case) for case in cases}
    for case, path in paths.items():
        make_hf_checkpoint(path, case, **WIDE_EXPERTS.get(case, {}))
    return paths


def _logits(model, batch, monkeypatch, native_moe: bool) -> tuple[torch.Tensor, list[bool]]:
    """The batch's logits and, per native block call, whether it computed the layer."""
    calls = []
    kernels = native.kernels()
    block = kernels.moe_block
    def counted(*args, **kwargs):
        result = block(*args, **kwargs)
        calls.append(result[2] is not None)
        return result
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "moe_block", counted)
        # the block a layer at a time (a step chains them where it can: test_decode_layers)
        patch.setattr(decoder.MoEDecoder, "_chains", lambda self: False)
        if not native_moe:
            patch.setattr(decoder, "takes_native", lambda *args: False)
        return model.forward_batch(batch), calls


# softmax then top-k, renormalized (Mixtral, Qwen3) or not (OLMoE); a sigmoid-gated shared
# expert beside it (Qwen2-MoE: the residual added in Python); top-k then softmax with router
# and expert biases and the clamped SwiGLU (GPT-OSS)
@pytest.mark.parametrize("case", ["mixtral", "olmoe", "gpt_oss", "qwen2_moe", "qwen3_moe"])
def test_native_moe_block_equals_the_python_block(checkpoints, case, monkeypatch):
    model = open_tiny(checkpoints[case], torch.bfloat16)
    batch = decode_batch(model, torch.Generator().manual_seed(7))
    fused, calls = _logits(model, batch, monkeypatch, native_moe=True)
    steps, no_calls = _logits(model, batch, monkeypatch, native_moe=False)
    assert calls == [True] * model.spec.num_moe_layers and no_calls == []
    assert torch.equal(fused, steps)
    hits = model.experts.stats()["hits"]
    assert hits > 0 and model.experts.stats()["misses"] == 0


def test_misses_page_in_waves_and_agree(checkpoints, monkeypatch):
    """With a quarter of the experts in slots the native block meets misses: it computes
    nothing there and the layer pages in waves; the logits agree with the Python block's
    (waves round their fp32 sums once, so the bits may differ in the last place)."""
    results = {}
    for native_moe in (True, False):
        model = open_tiny(checkpoints["mixtral"], torch.bfloat16)
        pool = model.experts
        pool.resize(pool.max_slots // 4)
        batch = decode_batch(model, torch.Generator().manual_seed(8))
        results[native_moe] = _logits(model, batch, monkeypatch, native_moe)
        pool.check_integrity()
        assert pool.slot_pool.holds == 0 and pool.stats()["misses"] > 0
    (fused, calls), (steps, _) = results[True], results[False]
    assert False in calls
    torch.testing.assert_close(fused, steps, rtol=0, atol=0.05)
    assert torch.equal(fused.argmax(-1), steps.argmax(-1))
