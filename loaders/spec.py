"""`config.json` -> `ModelSpec`: one normalized description of every supported MoE decoder.

Each architecture names the same ideas differently (`num_local_experts` vs `num_experts`,
`qkv_bias` vs `attention_bias`, ...). The parsers below translate them once, so the model code
branches on features (`qk_norm`, `has_shared_expert`), never on `model_type`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError

QK_NORM_NONE, QK_NORM_PER_HEAD, QK_NORM_FULL = "none", "per_head", "full"


@dataclass(frozen=True)
class ExpertNaming:
    """How a checkpoint names layer `l`'s expert `j` tensors, e.g. `mlp.experts.3.up_proj`."""

    moe_module: str                 # "block_sparse_moe" (Mixtral) or "mlp"
    gate: str                       # "w1" or "gate_proj"
    up: str                         # "w3" or "up_proj"
    down: str                       # "w2" or "down_proj"

    def expert_prefix(self, layer: int, expert: int) -> str:
        return f"model.layers.{layer}.{self.moe_module}.experts.{expert}"

    def router(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.moe_module}.gate.weight"


MIXTRAL_NAMING = ExpertNaming("block_sparse_moe", "w1", "w3", "w2")
MLP_NAMING = ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # attention features
    qkv_bias: bool
    o_bias: bool
    qk_norm: str                    # QK_NORM_NONE | QK_NORM_PER_HEAD | QK_NORM_FULL
    clip_qkv: float | None
    sliding_windows: tuple[int | None, ...]   # per layer; None = full causal attention
    # MoE features
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]    # per layer: MoE block (True) or dense MLP (False)
    dense_intermediate_size: int    # width of the dense-MLP layers
    shared_expert_intermediate_size: int   # 0 = no shared expert
    naming: ExpertNaming
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0


def load_spec(checkpoint_dir: str) -> ModelSpec:
    path = os.path.join(checkpoint_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(path, "missing config.json: not a Hugging Face checkpoint folder")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, f"unreadable config.json: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(path, "config.json is not a JSON object")
    return parse_config(config, path)


def parse_config(config: dict[str, Any], path: str = "config.json") -> ModelSpec:
    model_type = config.get("model_type")
    parser = _PARSERS.get(model_type)
    if parser is None:
        raise CheckpointError(path, f"unsupported model_type {model_type!r}; supported: "
                              f"{', '.join(sorted(_PARSERS))}")
    try:
        return parser(config, path)
    except KeyError as e:
        raise CheckpointError(path, f"config.json lacks required field {e.args[0]!r}") from e


def _common(config: dict[str, Any], path: str) -> dict[str, Any]:
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(path, f"unsupported hidden_act {config['hidden_act']!r}")
    num_heads = config["num_attention_heads"]
    num_layers = config["num_hidden_layers"]
    eos = config.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return dict(
        model_type=config["model_type"],
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(config, path),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        clip_qkv=config.get("clip_qkv"),
        sliding_windows=_sliding_windows(config, num_layers),
        top_k=config["num_experts_per_tok"],
        eos_token_ids=eos_ids,
        bos_token_id=config.get("bos_token_id"),
    )


def _rope_theta(config: dict[str, Any], path: str) -> float:
    # transformers 5 writes `rope_parameters`; published checkpoints have `rope_theta` and
    # an optional `rope_scaling`.
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise CheckpointError(path, f"unsupported rope_scaling type {kind!r} (only plain "
                              "RoPE with rope_theta is supported)")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def _sliding_windows(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if config.get("use_sliding_window") is False or not window:
        return (None,) * num_layers
    first = config.get("max_window_layers", 0) if "use_sliding_window" in config else 0
    return tuple(window if i >= first else None for i in range(num_layers))


def _mixtral(config: dict[str, Any], path: str) -> ModelSpec:
    num_layers = config["num_hidden_layers"]
    return ModelSpec(
        **_common(config, path), qkv_bias=False, o_bias=False, qk_norm=QK_NORM_NONE,
        num_experts=config["num_local_experts"],
        moe_intermediate_size=config["intermediate_size"], norm_topk_prob=True,
        moe_layers=(True,) * num_layers, dense_intermediate_size=config["intermediate_size"],
        shared_expert_intermediate_size=0, naming=MIXTRAL_NAMING)


def _qwen_moe_layers(config: dict[str, Any]) -> tuple[bool, ...]:
    step = config.get("decoder_sparse_step", 1)
    mlp_only = set(config.get("mlp_only_layers") or ())
    num_experts = config.get("num_experts", config.get("num_local_experts", 0))
    return tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
                 for i in range(config["num_hidden_layers"]))


def _qwen2_moe(config: dict[str, Any], path: str) -> ModelSpec:
    return ModelSpec(
        **_common(config, path), qkv_bias=config.get("qkv_bias", True), o_bias=False,
        qk_norm=QK_NORM_NONE,
        num_experts=config.get("num_experts", config.get("num_local_experts")),
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=config.get("norm_topk_prob", False), moe_layers=_qwen_moe_layers(config),
        dense_intermediate_size=config["intermediate_size"],
        shared_expert_intermediate_size=config.get("shared_expert_intermediate_size", 0),
        naming=MLP_NAMING)


def _qwen3_moe(config: dict[str, Any], path: str) -> ModelSpec:
    bias = config.get("attention_bias", False)
    return ModelSpec(
        **_common(config, path), qkv_bias=bias, o_bias=bias, qk_norm=QK_NORM_PER_HEAD,
        num_experts=config.get("num_experts", config.get("num_local_experts")),
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=config.get("norm_topk_prob", False), moe_layers=_qwen_moe_layers(config),
        dense_intermediate_size=config["intermediate_size"],
        shared_expert_intermediate_size=0, naming=MLP_NAMING)


def _olmoe(config: dict[str, Any], path: str) -> ModelSpec:
    bias = config.get("attention_bias", False)
    num_layers = config["num_hidden_layers"]
    return ModelSpec(
        **_common(config, path), qkv_bias=bias, o_bias=bias, qk_norm=QK_NORM_FULL,
        num_experts=config["num_experts"], moe_intermediate_size=config["intermediate_size"],
        norm_topk_prob=config.get("norm_topk_prob", False), moe_layers=(True,) * num_layers,
        dense_intermediate_size=config["intermediate_size"],
        shared_expert_intermediate_size=0, naming=MLP_NAMING)


_PARSERS: dict[str, Callable[[dict[str, Any], str], ModelSpec]] = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
}
