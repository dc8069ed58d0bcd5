"""`mox models import --quantize`: a registered bf16 model's experts repacked quantized,
expert-major (each expert, weights and scales, one range), checked, switched atomically."""

from __future__ import annotations

import os

import pytest

from mox import LLM
from mox.cli import main
from mox.loaders import Checkpoint
from mox.registry import Registry
from tests.loaders.test_quantized import dequantized_copy, greedy


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_import_quantize_repacks_experts_quantized(home, demo_path, tmp_path, capsys, kind):
    assert main(["models", "add", "q", demo_path, "--home", home]) == 0
    before = Registry(home).get("q")
    assert main(["models", "import", "q", "--quantize", kind, "--home", home]) == 0
    assert "expert-major, experts" in capsys.readouterr().out
    after = Registry(home).get("q")
    assert after.path.endswith(f"q.{kind}") and after.repacked
    assert after.expert_bytes < before.expert_bytes / 1.9
    ckpt = Checkpoint(after.path)
    assert ckpt.expert_format.kind == kind
    for tensors in ckpt.experts.values():                 # one expert is one read
        infos = sorted(tensors.infos, key=lambda i: i.offset)
        assert len({i.file for i in infos}) == 1
        assert all(a.end == b.offset for a, b in zip(infos, infos[1:]))
    assert os.path.isdir(demo_path)                         # the original stays
    assert main(["models", "verify", "q", "--home", home]) == 0   # FP8 bytes checked too
    reference = dequantized_copy(after.path, str(tmp_path / "reference"))
    assert greedy(LLM(after.path, dtype="float32")) == greedy(LLM(reference,
                                                                    dtype="float32"))
