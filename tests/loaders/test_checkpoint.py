"""Checkpoint folders: the expert index, and each bad input named in the error."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mox import LLM
from mox.loaders import INDEX_FILE, Checkpoint, CheckpointError
from mox.loaders.stream import read_tensor
from tests.conftest import make_hf_checkpoint


@pytest.fixture()
def checkpoint_copy(hf_checkpoints, tmp_path):
    """A private copy of the tiny olmoe checkpoint that a test may damage."""
    dst = tmp_path / "olmoe"
    shutil.copytree(hf_checkpoints["olmoe"][0], dst)
    return dst


def test_expert_index_reads_the_same_bytes_as_safetensors(hf_checkpoints):
    path, hf_model = hf_checkpoints["mixtral"]
    ckpt = Checkpoint(path)
    spec = ckpt.spec
    assert len(ckpt.experts) == spec.num_layers * spec.num_experts
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        for (layer, expert), tensors in ckpt.experts.items():
            prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
            for info, proj in ((tensors.gate, "w1"), (tensors.up, "w3"), (tensors.down, "w2")):
                assert info.name == f"{prefix}.{proj}.weight"
                assert torch.equal(read_tensor(info), f.get_tensor(info.name))
    assert ckpt.expert_nbytes == 3 * spec.hidden_size * spec.moe_intermediate_size * 4


def test_dense_only_layers_have_no_experts(hf_checkpoints):
    ckpt = Checkpoint(hf_checkpoints["qwen2_moe"][0])
    assert ckpt.spec.moe_layers == (True, False, True)
    assert {layer for layer, _ in ckpt.experts} == {0, 2}


def test_missing_folder():
    with pytest.raises(CheckpointError, match="does-not-exist.*does not exist"):
        Checkpoint("/tmp/does-not-exist-mox")


def test_missing_config(checkpoint_copy):
    os.remove(checkpoint_copy / "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json.*missing config\.json"):
        Checkpoint(str(checkpoint_copy))


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unknown_model_type(checkpoint_copy):
    _edit_config(checkpoint_copy, model_type="llama4_moe_x")
    with pytest.raises(CheckpointError, match=r"config\.json.*unsupported model_type "
                                              r"'llama4_moe_x'"):
        Checkpoint(str(checkpoint_copy))


def test_unsupported_rope_scaling(checkpoint_copy):
    _edit_config(checkpoint_copy, rope_parameters=None,
                 rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(CheckpointError, match="unsupported rope_scaling type 'dynamic'"):
        Checkpoint(str(checkpoint_copy))


def test_config_field_missing(checkpoint_copy):
    path = checkpoint_copy / "config.json"
    config = json.loads(path.read_text())
    del config["num_experts"]
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json.*'num_experts'"):
        Checkpoint(str(checkpoint_copy))


def test_missing_expert_tensor(checkpoint_copy):
    path = str(checkpoint_copy / "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match="olmoe.*missing tensor "
                                              "'model.layers.1.mlp.experts.3.up_proj.weight'"):
        Checkpoint(str(checkpoint_copy))


def test_tensor_with_wrong_shape(checkpoint_copy):
    path = str(checkpoint_copy / "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*o_proj.*shape \[3, 3\]"):
        Checkpoint(str(checkpoint_copy))


def test_truncated_shard_fails_at_open(checkpoint_copy):
    path = checkpoint_copy / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*past the end"):
        LLM(str(checkpoint_copy), dtype="float32")


def test_shard_truncated_after_opening_fails_on_read(checkpoint_copy):
    ckpt = Checkpoint(str(checkpoint_copy))
    info = ckpt.experts[1, 7].down
    with open(info.file, "r+b") as f:
        f.truncate(info.offset + 4)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*experts\.7.*truncated"):
        read_tensor(info)


def test_index_names_a_missing_shard(tmp_path):
    path = tmp_path / "sharded"
    make_hf_checkpoint(str(path), "mixtral", max_shard_size="30KB")
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[-1]
    os.remove(path / shard)
    with pytest.raises(CheckpointError, match=f"{shard}.*missing"):
        Checkpoint(str(path))


def test_corrupt_index(tmp_path):
    path = tmp_path / "sharded"
    make_hf_checkpoint(str(path), "mixtral", max_shard_size="30KB")
    (path / INDEX_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json.*corrupt index"):
        Checkpoint(str(path))


def test_no_weights_at_all(checkpoint_copy):
    os.remove(checkpoint_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        Checkpoint(str(checkpoint_copy))


def test_extra_layers_stay_on_disk(hf_checkpoints, tmp_path):
    """Published GLM4-MoE and DeepSeek-V3 carry a multi-token-prediction layer past
    num_hidden_layers: the checkpoint opens, and the dense reader leaves it alone."""
    dst = tmp_path / "glm4_moe"
    shutil.copytree(hf_checkpoints["glm4_moe"][0], dst)
    extra = {"model.layers.3.mlp.experts.0.up_proj.weight": torch.zeros(16, 32),
             "model.layers.3.eh_proj.weight": torch.zeros(32, 64)}
    save_file(extra, str(dst / "model-mtp.safetensors"))
    ckpt = Checkpoint(str(dst))
    assert set(extra) <= set(ckpt.tensors)
    dense = {info.name for info in ckpt.dense_tensors()}
    assert not dense & set(extra) and "model.layers.0.mlp.gate_proj.weight" in dense
    assert all(layer < 3 for layer, _ in ckpt.experts)


def test_unknown_quantization_is_refused(checkpoint_copy):
    _edit_config(checkpoint_copy, quantization_config={"quant_method": "awq"})
    with pytest.raises(CheckpointError, match=r"config\.json.*quant_method 'awq'.*not supported"):
        Checkpoint(str(checkpoint_copy))
