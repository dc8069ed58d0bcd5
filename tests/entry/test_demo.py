"""Demo checkpoints are real: transformers loads them with no missing or unexpected keys and
computes the same logits as mox; builds are deterministic; routing skew works."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

from mox.cli import main
from mox.demo import (
    DEMO_ARCHITECTURES,
    DEMO_SIZES,
    MAX_SCALED_FREQUENCY,
    build_checkpoint,
    demo_name,
    zipf_frequencies,
    zipf_gate_scales,
)
from tests.conftest import open_tiny


@pytest.mark.parametrize("arch", DEMO_ARCHITECTURES)
def test_transformers_loads_demo_and_agrees(demo_home, arch):
    from transformers import AutoModelForCausalLM

    path = os.path.join(demo_home, "models", demo_name(arch))
    hf_model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model = open_tiny(path)
    ids = torch.arange(3, 19)
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(model.forward(ids, model.new_cache()), expected,
                               atol=2e-4, rtol=1e-4)


def test_demo_sizes_are_tens_of_megabytes(demo_home):
    for arch in DEMO_ARCHITECTURES:
        path = os.path.join(demo_home, "models", demo_name(arch))
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        assert 5e6 < size < 100e6, (arch, size)
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))


def _digest(folder: str) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()


def test_build_is_deterministic_per_seed(tmp_path):
    size = DEMO_SIZES["mixtral"]
    a = build_checkpoint(str(tmp_path / "a"), "mixtral", size, seed=3)
    b = build_checkpoint(str(tmp_path / "b"), "mixtral", size, seed=3)
    c = build_checkpoint(str(tmp_path / "c"), "mixtral", size, seed=4)
    assert _digest(a) == _digest(b) != _digest(c)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".building")]


def test_zipf_scales_fit_the_target_popularity():
    rng = np.random.default_rng(0)
    assert (zipf_gate_scales(16, 2, 0.0, rng) == 1).all()
    scales = zipf_gate_scales(32, 4, 1.2, rng)
    samples = np.random.default_rng(1).standard_normal((20000, 32)) * scales
    chosen = np.argpartition(-samples, 3, axis=1)[:, :4]
    freq = np.sort(np.bincount(chosen.ravel(), minlength=32) / 20000)[::-1]
    target = zipf_frequencies(np.arange(1, 33), 4, 1.2)
    assert target.sum() == pytest.approx(4) and target[0] == MAX_SCALED_FREQUENCY
    assert np.abs(freq - target).max() < 0.03
    assert freq[0] > 5 * freq[-1]


def test_skewed_demo_routes_to_few_experts(tmp_path):
    def routing_counts(skew: float) -> np.ndarray:
        path = build_checkpoint(str(tmp_path / f"skew{skew}"), "olmoe", DEMO_SIZES["olmoe"],
                                routing_skew=skew)
        model = open_tiny(path)
        ids = torch.randint(0, model.spec.vocab_size, (512,),
                            generator=torch.Generator().manual_seed(0))
        h = torch.nn.functional.embedding(ids, model.embed)
        logits = h @ model.layers[0].mlp.router.t()
        top = torch.topk(logits, model.spec.top_k, dim=-1).indices
        return np.sort(np.bincount(top.flatten().numpy(), minlength=model.spec.num_experts))

    uniform, skewed = routing_counts(0.0), routing_counts(1.5)
    top4_share = lambda c: c[-4:].sum() / c.sum()
    assert top4_share(skewed) > 2 * top4_share(uniform)


def test_cli_generates_on_every_demo(demo_home, capsys):
    assert main(["generate", "--demo", "--home", demo_home, "--max-tokens", "5", "Hello"]) == 0
    out = capsys.readouterr().out
    for arch in DEMO_ARCHITECTURES:
        assert f"[{demo_name(arch)}] Hello" in out
    assert out.count("5 tokens") + out.count("finish=stop") >= len(DEMO_ARCHITECTURES)


def test_cli_reports_bad_checkpoint_without_traceback(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "Hello"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_demo_builds_any_of_its_architectures_and_names_the_choices(tmp_path, capsys):
    from mox.cli import main

    home = str(tmp_path / "home")
    assert main(["demo", "--home", home, "--arch", "deepseek_v3"]) == 0
    assert "deepseek-v3-demo" in capsys.readouterr().out
    assert main(["demo", "--home", home, "--arch", "llama"]) == 2
    assert "no demo of llama; choose from mixtral" in capsys.readouterr().err
