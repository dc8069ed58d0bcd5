"""GPT-OSS specifics: one expert of a fused `[E, ...]` tensor is one byte range per part,
paged like any other expert; MXFP4 checkpoints dequantize on load to what transformers
computes."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mox import LLM
from mox.kernels.quant import E8M0_BIAS, FP4_E2M1_VALUES
from mox.loaders import Checkpoint, CheckpointError, parse_config
from mox.loaders.experts import DOWN_BIAS, DOWN_T, GATE_UP_BIAS, GATE_UP_T
from mox.loaders.repack import repack_expert_major
from mox.loaders.stream import read_tensor
from mox.model_import import verify_checkpoint
from tests.conftest import open_tiny

LOGIT_ATOL = 1e-4
NUM_TOKENS = 12


def _greedy(llm: LLM, prompt: list[int], num_tokens: int = NUM_TOKENS) -> list[int]:
    return llm.generate(prompt_token_ids=[prompt], max_tokens=num_tokens, temperature=0.0,
                        ignore_eos=True)[0].token_ids


def test_one_expert_of_a_fused_tensor_is_one_range_per_part(hf_checkpoints):
    path, _ = hf_checkpoints["gpt_oss"]
    ckpt = Checkpoint(path)
    spec = ckpt.spec
    assert len(ckpt.experts) == spec.num_layers * spec.num_experts
    fused_names = set()
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for (_, expert), tensors in ckpt.experts.items():
            assert {p.role for p in tensors.parts} == {GATE_UP_T, DOWN_T, GATE_UP_BIAS,
                                                      DOWN_BIAS}
            for part in tensors.parts:
                whole = f.get_tensor(part.info.name)
                assert torch.equal(read_tensor(part.info), whole[expert])
                fused_names.add(part.info.name)
    assert ckpt.expert_nbytes == 4 * (3 * spec.hidden_size * spec.moe_intermediate_size
                                      + 2 * spec.moe_intermediate_size + spec.hidden_size)
    assert not fused_names & {info.name for info in ckpt.dense_tensors()}


def test_host_cache_and_bfloat16_slots(hf_checkpoints):
    path, hf_model = hf_checkpoints["gpt_oss"]
    prompt = list(range(5, 17))
    expected = _greedy(LLM(path, dtype="float32"), prompt)
    llm = LLM(path, dtype="float32", expert_memory="40KiB", host_memory="4MiB")
    assert _greedy(llm, prompt) == _greedy(llm, prompt) == expected   # 2nd run: host hits
    assert llm.pager_stats()["bytes_read_host"] > 0
    ids = torch.tensor(prompt)
    ref, bf16 = open_tiny(path), open_tiny(path, torch.bfloat16)
    got, want = bf16.forward(ids, bf16.new_cache()), ref.forward(ids, ref.new_cache())
    assert (got - want).abs().max() < 0.25


def test_repack_refuses_fused_experts(hf_checkpoints, tmp_path):
    with pytest.raises(CheckpointError, match="stored fused"):
        repack_expert_major(hf_checkpoints["gpt_oss"][0], str(tmp_path / "out"))


def _quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., R, C]` f32 -> blocks `[..., R, C/32, 16]`, scales `[..., R, C/32]` (uint8): a
    power-of-two scale per 32 values, each value rounded to the nearest E2M1 code."""
    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    peak = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)        # |w| / 2^e <= 6
    table = torch.tensor(FP4_E2M1_VALUES)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - table).abs().argmin(-1).to(torch.uint8)   # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + E8M0_BIAS).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(hf_checkpoints, tmp_path_factory):
    """The tiny GPT-OSS with its experts quantized to MXFP4 as published (`*_blocks`,
    `*_scales`, quantization_config), and the transformers model holding the weights those
    bytes decode to (decoded by transformers' own MXFP4 code)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, hf_model = hf_checkpoints["gpt_oss"]
    dst = tmp_path_factory.mktemp("mxfp4") / "gpt_oss"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    model = AutoModelForCausalLM.from_config(hf_model.config, attn_implementation="eager")
    model.load_state_dict(hf_model.state_dict())
    model.eval()
    for layer in range(hf_model.config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = model.model.layers[layer].mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            stored = tensors.pop(f"{prefix}.{name}")                # [E, in, out]
            blocks, scales = _quantize_mxfp4(stored.transpose(1, 2))
            tensors[f"{prefix}.{name}_blocks"], tensors[f"{prefix}.{name}_scales"] = blocks, scales
            with torch.no_grad():
                getattr(experts, name).copy_(convert_moe_packed_tensors(
                    blocks, scales, dtype=torch.float32))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst), model


def test_mxfp4_checkpoint_matches_transformers(mxfp4_checkpoint):
    path, hf_model = mxfp4_checkpoint
    ckpt = Checkpoint(path)
    assert ckpt.spec.expert_storage == "mxfp4"
    spec = ckpt.spec
    weights = 3 * spec.hidden_size * spec.moe_intermediate_size          # 4.25 bits each
    assert ckpt.expert_nbytes == weights // 2 + weights // 32 + 4 * (
        2 * spec.moe_intermediate_size + spec.hidden_size)
    model = open_tiny(path)
    ids = torch.randint(0, hf_model.config.vocab_size, (20,),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(model.forward(ids, model.new_cache()), expected,
                               atol=LOGIT_ATOL, rtol=0)


def test_mxfp4_paged_generation_equals_all_resident(mxfp4_checkpoint):
    path, _ = mxfp4_checkpoint
    prompt = list(range(3, 19))
    expected = _greedy(LLM(path, dtype="float32"), prompt)
    expert_bytes = LLM(path, dtype="float32", expert_memory="1GiB").pager_stats()["expert_bytes"]
    spec = Checkpoint(path).spec
    top_k = spec.top_k
    assert expert_bytes < 3 * spec.hidden_size * spec.moe_intermediate_size   # slots: MXFP4
    llm = LLM(path, dtype="float32", expert_memory=(top_k + 1) * expert_bytes,
              host_memory="1MiB")
    assert _greedy(llm, prompt) == expected
    stats = llm.pager_stats()
    assert stats["misses"] > 0 and stats["evictions"] > 0 and stats["bytes_read_host"] > 0


def test_verify_finds_a_nan_mxfp4_scale(mxfp4_checkpoint, tmp_path):
    """E8M0's 0xFF is NaN: a damaged scale byte fails `verify`, naming its tensor."""
    path = tmp_path / "damaged"
    shutil.copytree(mxfp4_checkpoint[0], path)
    verify_checkpoint(str(path))
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name].view(-1)[5] = 0xFF
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}'.* 1 of \d+ values are NaN"):
        verify_checkpoint(str(path))


def test_mxfp4_needs_whole_blocks():
    config = {"model_type": "gpt_oss", "vocab_size": 32, "hidden_size": 48,
              "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
              "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(CheckpointError, match="divisible by 32"):
        parse_config(config)
    with pytest.raises(CheckpointError, match="quant_method 'fp8'"):
        parse_config({**config, "hidden_size": 64, "quantization_config": {"quant_method": "fp8"}})


def test_slot_biases_follow_their_expert_through_grow_and_compact():
    from mox.pager.slot_pool import SlotPool

    pool = SlotPool(1, 4, hidden=8, inter=4, dtype=torch.float32, device=torch.device("cpu"),
                    num_slots=2, has_bias=True)
    assert pool.expert_nbytes == (3 * 8 * 4 + 2 * 4 + 8) * 4
    for slot, expert in enumerate((2, 3)):
        pool.reserve(slot, (0, expert), prefetched=False)
        pool.w13[slot], pool.b13[slot], pool.b2[slot] = expert, 10 * expert, 100 * expert
        pool.commit(slot)
        pool.slots[slot].pins = 0
    pool.target_slots = 3
    pool.grow()
    pool.target_slots = 1
    pool.compact([pool.lookup((0, 3))])
    pool.check_integrity()
    slot = pool.lookup((0, 3))
    assert pool.num_slots == 1 and pool.lookup((0, 2)) == -1
    assert (pool.w13[slot] == 3).all() and (pool.b13[slot] == 30).all()
    assert (pool.b2[slot] == 300).all()
