"""Quantized checkpoints in their published layouts (compressed-tensors int8 / int4 / FP8,
DeepSeek-V3 FP8 blocks), written here from the formats' definitions: they load, page and
generate exactly as a plain checkpoint holding their dequantized weights; bad ones fail
naming the file and tensor."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from mox import LLM
from mox.kernels.quant import FP8, FP8_BLOCK128, INT4_GROUP128, INT8_PER_CHANNEL, WeightFormat
from mox.kernels.quant import dequantize as dequantize_values
from mox.loaders import Checkpoint, CheckpointError
from mox.loaders.quantize import ALL_LINEARS, EXPERTS, quantize_checkpoint
from mox.loaders.stream import read_tensor
from mox.model_import import check_quantized

NUM_TOKENS = 10
LAYOUTS = [pytest.param("olmoe", INT8_PER_CHANNEL, EXPERTS, id="olmoe-int8-compressed"),
           pytest.param("mixtral", INT4_GROUP128, EXPERTS, id="mixtral-int4-packed"),
           pytest.param("qwen3_moe", WeightFormat(FP8), EXPERTS, id="qwen3-fp8-channel"),
           pytest.param("deepseek_v3", FP8_BLOCK128, ALL_LINEARS, id="deepseek-fp8-block")]


def dequantized_copy(quantized: str, dst: str) -> str:
    """The plain fp32 checkpoint holding what `quantized` stores: the reference model."""
    ckpt = Checkpoint(quantized)
    tensors = {}
    for name, weight in ckpt.stored.items():
        data = read_tensor(weight.data)
        tensors[name] = (data if weight.fmt is None else
                         dequantize_values(data, read_tensor(weight.scale), weight.fmt))
    os.makedirs(dst)
    save_file({n: t.float().contiguous() for n, t in tensors.items()},
              os.path.join(dst, "model.safetensors"))
    with open(os.path.join(quantized, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def greedy(llm: LLM) -> list[int]:
    prompt = list(range(3, 19))
    return llm.generate(prompt_token_ids=[prompt], max_tokens=NUM_TOKENS, temperature=0.0,
                        ignore_eos=True)[0].token_ids


@pytest.mark.parametrize("case, fmt, linears", LAYOUTS)
def test_a_published_layout_generates_as_its_dequantized_weights(hf_checkpoints, tmp_path,
                                                                  case, fmt, linears):
    quantized = quantize_checkpoint(hf_checkpoints[case][0], str(tmp_path / "q"), fmt, linears)
    ckpt = Checkpoint(quantized)
    assert ckpt.expert_format == fmt
    reference = dequantized_copy(quantized, str(tmp_path / "reference"))
    expected = greedy(LLM(reference, dtype="float32"))
    llm = LLM(quantized, dtype="float32")
    assert greedy(llm) == expected
    expert_bytes = llm.pager_stats()["expert_bytes"]
    assert expert_bytes == ckpt.expert_nbytes         # the pool holds experts as stored
    plain = LLM(reference, dtype="float32", expert_memory="1GiB").pager_stats()["expert_bytes"]
    assert expert_bytes < plain / 2
    top_k = ckpt.spec.top_k                           # paged through a pool of top_k + 1
    paged = LLM(quantized, dtype="float32", expert_memory=(top_k + 1) * expert_bytes)
    assert greedy(paged) == expected
    stats = paged.pager_stats()
    assert stats["misses"] > 0 and stats["evictions"] > 0
    paged.pool.check_integrity()


@pytest.fixture()
def int8_copy(hf_checkpoints, tmp_path):
    return quantize_checkpoint(hf_checkpoints["olmoe"][0], str(tmp_path / "q"),
                               INT8_PER_CHANNEL)


SCALE = "model.layers.0.mlp.experts.1.up_proj.weight_scale"


def _rewrite(folder: str, change) -> str:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)
    return path


def test_a_scale_of_the_wrong_shape_names_its_file_and_tensor(int8_copy):
    path = _rewrite(int8_copy, lambda t: t.update({SCALE: t[SCALE][:-1]}))
    with pytest.raises(CheckpointError, match=rf"{path}.*{SCALE}.*needs float\[\d+, 1\]"):
        Checkpoint(int8_copy)


def test_a_missing_scale_names_its_weight(int8_copy):
    path = _rewrite(int8_copy, lambda t: t.pop(SCALE))
    with pytest.raises(CheckpointError, match=rf"{path}.*up_proj.weight'.* no scale tensor"):
        Checkpoint(int8_copy)


@pytest.mark.parametrize("change, message", [
    ({"num_bits": 3}, "num_bits 3"),
    ({"strategy": "tensor"}, "strategy 'tensor'"),
    ({"symmetric": False}, "asymmetric"),
    ({"actorder": "group"}, "actorder 'group'"),
    ({"type": "float", "strategy": "block", "block_structure": [0, 128]}, "block_structure"),
    ({"num_bits": 4, "strategy": "group", "group_size": -128}, "group_size")])
def test_an_unsupported_scheme_is_refused(int8_copy, change, message):
    _edit_quantization(int8_copy, lambda q: q["config_groups"]["group_0"]["weights"].update(
        change))
    with pytest.raises(CheckpointError, match=rf"config\.json.*{message}"):
        Checkpoint(int8_copy)


def test_static_activation_order_is_column_order(int8_copy):
    """compressed-tensors' actorder "static" is its alias of "weight"."""
    _edit_quantization(int8_copy, lambda q: q["config_groups"]["group_0"]["weights"].update(
        actorder="static"))
    assert Checkpoint(int8_copy).expert_format == INT8_PER_CHANNEL


@pytest.mark.parametrize("block", [[0, 128], [-128, 128], ["128", 128], [128]])
def test_a_bad_fp8_block_size_is_one_error_naming_the_config(int8_copy, block):
    _edit_quantization(int8_copy, lambda q: (q.clear(), q.update(
        quant_method="fp8", fmt="e4m3", weight_block_size=block)))
    with pytest.raises(CheckpointError, match=r"config\.json.*weight_block_size.*positive"):
        Checkpoint(int8_copy)


def test_quantized_weights_without_a_quantization_config_are_refused(int8_copy):
    """Their int8 codes read as values, their scales unread, generated noise."""
    _edit_quantization(int8_copy, lambda q: q.clear())
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*experts\.0\.gate_proj"
                                              r"\.weight' is torch\.int8.*quantization_config"):
        Checkpoint(int8_copy)


def _edit_quantization(checkpoint: str, edit) -> None:
    """Rewrite config.json's quantization_config in place with `edit(config)` (an empty
    one is dropped)."""
    path = os.path.join(checkpoint, "config.json")
    with open(path) as f:
        config = json.load(f)
    edit(config["quantization_config"])
    if not config["quantization_config"]:
        del config["quantization_config"]
    with open(path, "w") as f:
        json.dump(config, f)


def test_an_expert_mixing_formats_is_refused(hf_checkpoints, int8_copy):
    down = "model.layers.0.mlp.experts.2.down_proj.weight"
    plain = load_file(os.path.join(hf_checkpoints["olmoe"][0], "model.safetensors"))[down]
    path = _rewrite(int8_copy, lambda t: (t.pop(down + "_scale"), t.update({down: plain})))
    with pytest.raises(CheckpointError, match=rf"{path}.*expert 2 of layer 0 mixes formats"):
        Checkpoint(int8_copy)


def test_experts_of_two_formats_are_refused_naming_one_of_each(hf_checkpoints, int8_copy):
    prefix = "model.layers.1.mlp.experts.3"
    plain = load_file(os.path.join(hf_checkpoints["olmoe"][0], "model.safetensors"))

    def unquantize(tensors):
        for part in ("gate_proj", "up_proj", "down_proj"):
            name = f"{prefix}.{part}.weight"
            tensors.pop(name + "_scale")
            tensors[name] = plain[name]
    path = _rewrite(int8_copy, unquantize)
    with pytest.raises(CheckpointError, match=rf"{path}.*experts\.0\.gate_proj\.weight' as "
                                              rf"int8.*experts\.3\.gate_proj\.weight' plainly"):
        Checkpoint(int8_copy)


def test_the_import_check_catches_a_changed_byte(hf_checkpoints, int8_copy):
    check_quantized(hf_checkpoints["olmoe"][0], int8_copy)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    _rewrite(int8_copy, lambda t: t[name].view(-1)[7].add_(1))
    with pytest.raises(CheckpointError, match="down_proj.weight"):
        check_quantized(hf_checkpoints["olmoe"][0], int8_copy)


def test_a_nan_expert_is_refused_not_quantized(hf_checkpoints, tmp_path):
    src = str(tmp_path / "nan")
    shutil.copytree(hf_checkpoints["olmoe"][0], src)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors[name].view(-1)[5] = float("nan")
    save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"model.safetensors.*{name}.*NaN or infinite"):
        quantize_checkpoint(src, str(tmp_path / "out"), INT8_PER_CHANNEL)
