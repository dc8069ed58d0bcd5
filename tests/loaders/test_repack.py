"""Expert-major repacking: one aligned contiguous range per expert, identical outputs."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from mox import LLM
from mox.loaders import Checkpoint
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
