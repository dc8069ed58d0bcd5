"""Demo and benchmark checkpoints, built locally and deterministically from a seed.

Each is a real Hugging Face checkpoint: config.json as published for its architecture, bf16
safetensors shards with the exact tensor names (`loaders.layout`), an index file, a trained
BPE tokenizer.json and tokenizer_config.json. Weights are random; the layout and byte sizes
are what matter. `routing_skew` > 0 scales each expert's router row so that expert
popularity follows a Zipf law with that exponent (trained routers are skewed; random ones
route almost uniformly).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from mox.demo_tokenizer import EOS, build_tokenizer, write_tokenizer
from mox.kernels.quant import IMPORT_FORMATS
from mox.loaders import Checkpoint, parse_config
from mox.loaders.layout import expected_tensors
from mox.loaders.quantize import quantize_checkpoint
from mox.loaders.repack import is_expert_major, repack_expert_major
from mox.loaders.writer import write_json_atomic, write_sharded
from mox.registry import default_home

DEMO_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v3",
                      "deepseek_v2", "gpt_oss")
PRESETS = ("demo", "mid", "bench", "experts")
DEMO_SHARD_BYTES = 16 * 1024**2      # small shards, so demos exercise the index path
BENCH_SHARD_BYTES = 1024**3          # ~ what published checkpoints use
TOKENIZER_VOCAB = 2048               # the BPE trainer stops earlier on the small corpus
CHECKPOINT_DIR_MODE, CHECKPOINT_FILE_MODE = 0o755, 0o644   # readable by a server's own user
CALIBRATION_TOKENS = 8192            # samples to fit the Zipf gate scales
CALIBRATION_STEPS = 60
# Scaling a router row cannot lift an expert above ~1/2 of tokens: its logit is zero-mean, so
# it is negative for half of them. Targets are capped a little below that.
MAX_SCALED_FREQUENCY = 0.45
# Copies of one architecture (`copies=`) differ by seed; a stride far above the architecture
# index keeps every (architecture, copy) seed distinct.
COPY_SEED_STRIDE = 1000
# Sigmoid routers' load-balancing bias: small against the ~0.2 spread of sigmoid scores, so
# a skewed router's popularity stays as calibrated.
CORRECTION_BIAS_SCALE = 0.01


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    moe_intermediate: int
    vocab: int | None = None            # None: the tokenizer's own size


# Demo sizes keep each architecture's flavour (expert counts, top-k) at tens of MB.
DEMO_SIZES = {
    "mixtral": Size(256, 4, 8, 4, 32, experts=8, top_k=2, moe_intermediate=512),
    "qwen2_moe": Size(256, 4, 8, 4, 32, experts=16, top_k=4, moe_intermediate=128),
    "qwen3_moe": Size(256, 4, 8, 4, 64, experts=32, top_k=4, moe_intermediate=128),
    "olmoe": Size(256, 4, 8, 8, 32, experts=32, top_k=4, moe_intermediate=128),
    "glm4_moe": Size(256, 4, 8, 4, 32, experts=32, top_k=4, moe_intermediate=128),
    "deepseek_v3": Size(256, 4, 8, 8, 32, experts=32, top_k=4, moe_intermediate=128),
    "deepseek_v2": Size(256, 4, 8, 8, 32, experts=32, top_k=4, moe_intermediate=128),
    "gpt_oss": Size(256, 4, 8, 4, 32, experts=32, top_k=4, moe_intermediate=128),
}
# GPT-OSS's fused `[E, in, out]` expert weights: their fan-in is the middle dim.
FUSED_TRANSPOSED = ("experts.gate_up_proj", "experts.down_proj")
# Realistic proportions: ~1.6 GB of experts and ~0.2 GB of dense weights in bf16.
BENCH_SIZE = Size(1024, 8, 16, 4, 64, experts=64, top_k=4, moe_intermediate=512, vocab=32000)
# Bench's expert count and top-k at about a quarter of its bytes (~0.38 GiB of experts +
# ~0.07 GiB dense): a dozen of them fit the load test's 10-15 minutes on 2 CPU cores.
MID_SIZE = Size(512, 8, 8, 4, 64, experts=64, top_k=4, moe_intermediate=256, vocab=32000)
# Experts as most of a token's bytes, as in Mixtral (8 experts, top-2, I = 3.5 H): 22 MiB
# experts, ~350 of a token's ~460 MB in bf16 (the bench preset's experts are under half of
# its, which bounds what quantized experts can gain there: mox.bench.micro.quantized).
EXPERTS_SIZE = Size(1024, 8, 16, 4, 64, experts=8, top_k=2, moe_intermediate=3584,
                    vocab=32000)


def demo_name(arch: str, preset: str = "demo", routing_skew: float = 0.0,
              copy: int = 0) -> str:
    """e.g. `olmoe-bench-skew1`; copy i > 0 (another seed) gets the suffix `-i`."""
    skew = f"-skew{routing_skew:g}" if routing_skew else ""
    suffix = f"-{copy}" if copy else ""
    return f"{arch.replace('_', '-')}-{preset}{skew}{suffix}"


def preset_size(arch: str, preset: str) -> Size:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {PRESETS}")
    return {"demo": DEMO_SIZES[arch], "mid": MID_SIZE, "bench": BENCH_SIZE,
            "experts": EXPERTS_SIZE}[preset]


def hf_config(arch: str, size: Size, vocab: int) -> dict:
    """config.json as a published checkpoint of `arch` writes it."""
    common = {
        "model_type": arch, "vocab_size": vocab, "hidden_size": size.hidden,
        "num_hidden_layers": size.layers, "num_attention_heads": size.heads,
        "num_key_value_heads": size.kv_heads, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "num_experts_per_tok": size.top_k, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "eos_token_id": 0, "bos_token_id": 0,
    }
    if arch == "mixtral":
        return {**common, "architectures": ["MixtralForCausalLM"], "sliding_window": None,
                "num_local_experts": size.experts, "intermediate_size": size.moe_intermediate,
                "head_dim": size.head_dim}
    if arch == "olmoe":
        assert size.head_dim * size.heads == size.hidden, "olmoe's k_norm assumes H = h * d"
        return {**common, "architectures": ["OlmoeForCausalLM"], "num_experts": size.experts,
                "intermediate_size": size.moe_intermediate, "norm_topk_prob": False,
                "clip_qkv": None, "attention_bias": False}
    if arch == "glm4_moe":      # GLM-4.5's flavour: one dense layer, a shared expert
        return {**common, "architectures": ["Glm4MoeForCausalLM"], "head_dim": size.head_dim,
                "n_routed_experts": size.experts, "moe_intermediate_size": size.moe_intermediate,
                "intermediate_size": 4 * size.moe_intermediate, "n_shared_experts": 1,
                "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                "routed_scaling_factor": 2.5, "norm_topk_prob": True, "use_qk_norm": True,
                "attention_bias": True, "partial_rotary_factor": 0.5}
    if arch in ("deepseek_v3", "deepseek_v2"):
        return deepseek_config(arch, size, common)
    if arch == "gpt_oss":       # bf16 fused experts (published checkpoints are MXFP4)
        return {**common, "architectures": ["GptOssForCausalLM"], "head_dim": size.head_dim,
                "num_local_experts": size.experts, "intermediate_size": size.moe_intermediate,
                "attention_bias": True, "sliding_window": 16, "swiglu_limit": 7.0,
                "layer_types": ["sliding_attention", "full_attention"] * (size.layers // 2),
                "rope_theta": 150000.0, "max_position_embeddings": 131072,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                                 "truncate": False}}
    qwen = {**common, "num_experts": size.experts, "moe_intermediate_size": size.moe_intermediate,
            "intermediate_size": 4 * size.moe_intermediate, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "use_sliding_window": False, "head_dim": size.head_dim}
    if arch == "qwen2_moe":
        return {**qwen, "architectures": ["Qwen2MoeForCausalLM"], "norm_topk_prob": False,
                "shared_expert_intermediate_size": 4 * size.moe_intermediate, "qkv_bias": True}
    if arch == "qwen3_moe":
        return {**qwen, "architectures": ["Qwen3MoeForCausalLM"], "norm_topk_prob": True,
                "attention_bias": False}
    raise ValueError(f"no demo for architecture {arch!r}")


def deepseek_config(arch: str, size: Size, common: dict) -> dict:
    """DeepSeek-V3's flavour (q LoRA, sigmoid grouped routing) or V2-Lite's (no q LoRA,
    softmax greedy routing): MLA, a dense first layer, shared experts, YaRN as published."""
    yarn = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    config = {**common, "n_routed_experts": size.experts,
              "moe_intermediate_size": size.moe_intermediate,
              "intermediate_size": 4 * size.moe_intermediate, "first_k_dense_replace": 1,
              "kv_lora_rank": 2 * size.head_dim, "qk_nope_head_dim": size.head_dim,
              "qk_rope_head_dim": size.head_dim // 2, "v_head_dim": size.head_dim,
              "max_position_embeddings": 163840, "attention_bias": False}
    if arch == "deepseek_v3":
        return {**config, "architectures": ["DeepseekV3ForCausalLM"],
                "q_lora_rank": size.hidden // 2, "n_shared_experts": 1, "n_group": 4,
                "topk_group": 2, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_scaling": yarn}
    return {**config, "architectures": ["DeepseekV2ForCausalLM"], "q_lora_rank": None,
            "n_shared_experts": 2, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
            "norm_topk_prob": False, "routed_scaling_factor": 1.0,
            "rope_scaling": {**yarn, "mscale": 0.707, "mscale_all_dim": 0.707}}


def zipf_gate_scales(num_experts: int, top_k: int, exponent: float,
                     rng: np.random.Generator) -> np.ndarray:
    """Per-expert router-row scales whose top-k routing frequencies follow Zipf(exponent).

    Router logits of a normalized hidden state against random rows are ~ independent
    N(0, scale_e^2); we fit the scales by fixed-point iteration on such samples. The
    popularity ranks are a random permutation, so each layer has its own hot experts.
    """
    if exponent == 0:
        return np.ones(num_experts)
    ranks = rng.permutation(num_experts) + 1
    target = zipf_frequencies(ranks, top_k, exponent)
    samples = rng.standard_normal((CALIBRATION_TOKENS, num_experts))
    scales = np.ones(num_experts)
    for _ in range(CALIBRATION_STEPS):
        chosen = np.argpartition(-samples * scales, top_k - 1, axis=1)[:, :top_k]
        freq = np.bincount(chosen.ravel(), minlength=num_experts) / CALIBRATION_TOKENS
        scales *= np.sqrt(target / np.maximum(freq, 1.0 / CALIBRATION_TOKENS))
        scales /= scales.max()
    return scales


def zipf_frequencies(ranks: np.ndarray, top_k: int, exponent: float) -> np.ndarray:
    """Fraction of tokens routed to the expert of each rank: Zipf(exponent), summing to top_k,
    capped at MAX_SCALED_FREQUENCY with the excess shared by the others in proportion."""
    weights = ranks ** -float(exponent)
    capped = np.zeros(len(ranks), dtype=bool)
    while True:
        free_mass = top_k - MAX_SCALED_FREQUENCY * capped.sum()
        target = np.where(capped, MAX_SCALED_FREQUENCY,
                          free_mass * weights / weights[~capped].sum())
        over = ~capped & (target > MAX_SCALED_FREQUENCY)
        if not over.any():
            return target
        capped |= over


class _Weights:
    """Deterministic random weights: each tensor seeded by (seed, name), so a tensor's bytes
    do not depend on which other tensors exist or their order."""

    def __init__(self, seed: int, num_experts: int, top_k: int, routing_skew: float) -> None:
        self.seed, self.num_experts, self.top_k = seed, num_experts, top_k
        self.routing_skew = routing_skew

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        name_seed = zlib.crc32(name.encode()) ^ self.seed
        gen = torch.Generator().manual_seed(name_seed)
        if name.endswith("norm.weight"):
            return 1.0 + 0.1 * torch.randn(shape, generator=gen)
        if name.endswith(".bias"):
            return 0.1 * torch.randn(shape, generator=gen)
        if name.endswith("e_score_correction_bias"):    # small: keeps the Zipf calibration
            return CORRECTION_BIAS_SCALE * torch.randn(shape, generator=gen)
        if name == "model.embed_tokens.weight":
            return torch.randn(shape, generator=gen)
        fan_in = shape[-2] if name.endswith(FUSED_TRANSPOSED) else shape[-1]
        weight = torch.randn(shape, generator=gen) / fan_in ** 0.5
        is_router = name.endswith((".gate.weight", ".router.weight"))
        if is_router and shape[0] == self.num_experts:
            rng = np.random.default_rng(name_seed)
            scales = zipf_gate_scales(self.num_experts, self.top_k, self.routing_skew, rng)
            weight *= torch.from_numpy(scales).float()[:, None]
        return weight


def build_checkpoint(out_dir: str, arch: str, size: Size, seed: int = 0,
                     routing_skew: float = 0.0, max_shard_bytes: int = DEMO_SHARD_BYTES) -> str:
    """Write a complete checkpoint into `out_dir` (built aside, then renamed into place, so an
    interrupted build never leaves a half checkpoint). Returns `out_dir`."""
    tokenizer = build_tokenizer(TOKENIZER_VOCAB)
    config = hf_config(arch, size, size.vocab or tokenizer.get_vocab_size())
    config["eos_token_id"] = config["bos_token_id"] = tokenizer.token_to_id(EOS)
    spec = parse_config(config)
    shapes = expected_tensors(spec)
    weights = _Weights(seed, size.experts, size.top_k, routing_skew)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=parent)
    try:
        os.chmod(tmp, CHECKPOINT_DIR_MODE)
        write_json_atomic(os.path.join(tmp, "config.json"), config)
        write_json_atomic(os.path.join(tmp, "generation_config.json"),
                          {"eos_token_id": config["eos_token_id"], "do_sample": True})
        write_tokenizer(tmp, tokenizer)
        write_sharded(tmp, shapes, torch.bfloat16, lambda n: weights(n, shapes[n]),
                      max_shard_bytes)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), CHECKPOINT_FILE_MODE)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def ensure_demo_models(home: str | None = None, preset: str = "demo",
                       routing_skew: float = 0.0,
                       architectures: tuple[str, ...] = DEMO_ARCHITECTURES,
                       copies: int = 1) -> dict[str, str]:
    """Build whichever of these checkpoints are missing under `home`/models; name -> path.
    `copies`: that many models per architecture, each from its own seed (copy 0 is the
    model a single copy gives), for load tests of many distinct models."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {PRESETS}")
    home = home or default_home()
    paths = {}
    for copy in range(copies):
        for arch in architectures:
            name = demo_name(arch, preset, routing_skew, copy)
            path = os.path.join(home, "models", name)
            if not os.path.exists(os.path.join(path, "config.json")):
                shard = DEMO_SHARD_BYTES if preset == "demo" else BENCH_SHARD_BYTES
                seed = DEMO_ARCHITECTURES.index(arch) + copy * COPY_SEED_STRIDE
                build_checkpoint(path, arch, preset_size(arch, preset), seed=seed,
                                 routing_skew=routing_skew, max_shard_bytes=shard)
            paths[name] = path
    return paths


def ensure_expert_major(path: str) -> str:
    """Repack the built checkpoint at `path` expert-major in place (each expert one 4 KiB-aligned
    range, as `mox models import` writes it, which the pager reads straight into a slot), once:
    one model's bytes of extra disk at a time."""
    if is_expert_major(Checkpoint(path)):
        return path
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
        repack_expert_major(path, os.path.join(tmp, "out"))
        os.replace(path, os.path.join(tmp, "original"))       # removed with `tmp`
        os.replace(os.path.join(tmp, "out"), path)
    return path


def ensure_quantized(home: str | None, source: str, kind: str) -> str:
    """`source` (a built checkpoint) with its experts quantized to `kind` (int8 | int4 | fp8)
    and repacked expert-major, as `mox models import --quantize` writes it; built once under
    `home`/quantized."""
    home = home or default_home()
    final = os.path.join(home, "quantized", f"{os.path.basename(source)}.{kind}")
    if not os.path.exists(os.path.join(final, "config.json")):
        os.makedirs(os.path.dirname(final), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=os.path.dirname(final)) as tmp:
            quantize_checkpoint(source, os.path.join(tmp, "quantized"), IMPORT_FORMATS[kind])
            repack_expert_major(os.path.join(tmp, "quantized"), os.path.join(tmp, "out"))
            os.replace(os.path.join(tmp, "out"), final)
    return final
