"""Expert-major repacking: one aligned contiguous range per expert, identical outputs."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors import safe_open

from mox import LLM
from mox.kernels.quant import INT8_PER_CHANNEL
from mox.loaders import Checkpoint
from mox.loaders.quantize import quantize_checkpoint
from mox.loaders.repack import ALIGNMENT, repack_expert_major
from mox.loaders.stream import coalesce, read_tensor
from mox.pager.expert_loader import expert_ranges


@pytest.mark.parametrize("case,shard_bytes", [("qwen2_moe", 1 << 30), ("mixtral", 60_000)])
def test_repacked_checkpoint_is_expert_major_and_serves_identically(hf_checkpoints, tmp_path,
                                                                    case, shard_bytes):
    src, _ = hf_checkpoints[case]
    dst = repack_expert_major(src, str(tmp_path / "repacked"), max_shard_bytes=shard_bytes)
    original, repacked = Checkpoint(src), Checkpoint(dst)
    assert set(original.tensors) == set(repacked.tensors)
    aligned = original.expert_nbytes % ALIGNMENT == 0          # else padding would be needed
    assert aligned == (case == "mixtral")
    for key, tensors in repacked.experts.items():
        assert tensors.gate.offset % ALIGNMENT == 0 or not aligned, key
        assert tensors.gate.end == tensors.up.offset and tensors.up.end == tensors.down.offset
        assert len(coalesce(expert_ranges(tensors, ""))) == 1        # one read per expert
    for name, info in repacked.tensors.items():                     # the same bytes
        with safe_open(info.file, "pt") as f:
            assert torch.equal(f.get_tensor(name), read_tensor(original.tensors[name]))
    prompt = list(range(2, 14))
    outs = [LLM(path, dtype="float32", expert_memory="120KiB").generate(
        prompt_token_ids=[prompt], max_tokens=10, temperature=0.0, ignore_eos=True)[0]
        for path in (src, dst)]
    assert outs[0].token_ids == outs[1].token_ids


@pytest.mark.parametrize("write", ["repack", "quantize"])
def test_a_copy_keeps_the_side_files_but_no_other_weights(hf_checkpoints, tmp_path, write):
    """A Hugging Face snapshot's PyTorch and GGUF weights stay behind (tens of GB nobody
    reads); config, licence and the like come along."""
    src = str(tmp_path / "snapshot")
    shutil.copytree(hf_checkpoints["olmoe"][0], src)
    for name in ("pytorch_model.bin", "pytorch_model.bin.index.json", "consolidated.00.pt",
                 "model.gguf"):
        (tmp_path / "snapshot" / name).write_bytes(b"weights")
    (tmp_path / "snapshot" / "LICENSE").write_text("licence")
    dst = str(tmp_path / "copy")
    if write == "repack":
        repack_expert_major(src, dst)
    else:
        quantize_checkpoint(src, dst, INT8_PER_CHANNEL)
    kept = set(os.listdir(dst))
    assert {"config.json", "LICENSE"} <= kept
    assert not kept & {"pytorch_model.bin", "pytorch_model.bin.index.json",
                       "consolidated.00.pt", "model.gguf"}
