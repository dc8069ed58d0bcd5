"""`config.json` -> `ModelSpec`, one parser per `model_type`."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .errors import CheckpointError
from .json_files import read_json_object
from .layout import MXFP4_BLOCK_VALUES
from .quantized import QUANT_METHODS, parse_quantization
from .rope import ROPE_YARN, RopeSpec, parse_rope, yarn_mscale
from .spec import (
    ACTIVATION_CLAMPED_SWIGLU,
    DEEPSEEK_NAMING,
    EXPERTS_FUSED,
    EXPERTS_MXFP4,
    GPT_OSS_NAMING,
    MIXTRAL_NAMING,
    MLP_NAMING,
    QK_NORM_FULL,
    QK_NORM_NONE,
    QK_NORM_PER_HEAD,
    ROUTING_SIGMOID_GROUPED,
    ROUTING_SOFTMAX,
    ROUTING_SOFTMAX_GROUPED,
    ROUTING_TOPK_SOFTMAX,
    MLASpec,
    ModelSpec,
    RouterSpec,
)
from .spec_checks import check_spec
from .windows import (
    every_layer_window,
    gpt_oss_windows,
    qwen2_moe_windows,
    qwen3_moe_windows,
)

# GLM4-MoE configs written before transformers moved it into `rope_parameters` rotate half of
# each head; transformers assumes 0.5 when the field is absent, and so do we.
GLM4_MOE_PARTIAL_ROTARY_FACTOR = 0.5


# What transformers assumes for a field config.json leaves out, where it differs by
# architecture (a missing rope_theta read as 10000 gave a mixtral 4.3 of logit error; the
# fallbacks in the parsers below are the values most architectures share). Fields whose
# absence the tensors' shapes would catch are here too, so the error is not a shape's.
# tests/loaders/test_config_defaults.py drops each field of transformers' own defaults in turn.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072,
                "num_key_value_heads": 8, "bos_token_id": 1, "eos_token_id": 2},
    "qwen2_moe": {"max_position_embeddings": 32768, "sliding_window": 4096,
                  "max_window_layers": 28, "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"max_position_embeddings": 32768, "sliding_window": 4096,
                  "num_key_value_heads": 4},
    "olmoe": {"rms_norm_eps": 1e-5, "eos_token_id": 50279},
    "glm4_moe": {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                 "num_key_value_heads": 8, "n_shared_experts": 1, "first_k_dense_replace": 1},
    "deepseek_v3": {"bos_token_id": 0, "eos_token_id": 1, "num_key_value_heads": 128,
                    "q_lora_rank": 1536, "first_k_dense_replace": 3, "n_shared_experts": 1,
                    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5},
    "deepseek_v2": {"max_position_embeddings": 2048, "n_shared_experts": 2, "q_lora_rank": 1536,
                    "bos_token_id": 1, "eos_token_id": 2},
    "gpt_oss": {"rms_norm_eps": 1e-5, "rope_theta": 150000.0, "sliding_window": 128,
                "max_position_embeddings": 131072, "num_key_value_heads": 8, "head_dim": 64},
}
# GPT-OSS's rope when the config has neither `rope_parameters` nor `rope_scaling` (null or
# missing; an empty `rope_parameters` is plain RoPE), as GptOssConfig fills it.
GPT_OSS_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "truncate": False, "original_max_position_embeddings": 4096}


def load_spec(checkpoint_dir: str) -> ModelSpec:
    path = os.path.join(checkpoint_dir, "config.json")
    config = read_json_object(path)
    if config is None:
        raise CheckpointError(path, "missing config.json: not a Hugging Face checkpoint folder")
    return parse_config(config, path)


def parse_config(config: dict[str, Any], path: str = "config.json") -> ModelSpec:
    model_type = config.get("model_type")
    parser = _PARSERS.get(model_type) if isinstance(model_type, str) else None
    if parser is None:
        raise CheckpointError(path, f"unsupported model_type {model_type!r}; supported: "
                              f"{', '.join(sorted(_PARSERS))}")
    config = {**ARCH_DEFAULTS.get(model_type, {}), **config}
    try:
        spec = parser(config, path)
        check_spec(spec, path)
    except KeyError as e:
        raise CheckpointError(path, f"config.json lacks required field {e.args[0]!r}") from e
    except (TypeError, ValueError, AttributeError, ArithmeticError, IndexError) as e:
        # a field of the wrong type or out of range (a string where a number goes, zero heads)
        raise CheckpointError(path, f"malformed config.json: {type(e).__name__}: {e}") from e
    return spec


def eos_token_ids(config: dict[str, Any], path: str) -> tuple[int, ...]:
    """`eos_token_id` of a config.json or generation_config.json: one id, a list, or none."""
    eos = config.get("eos_token_id")
    ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(path, f"eos_token_id must be token ids, not {eos!r}")
    return ids


def _common(config: dict[str, Any], path: str, quantizations: tuple[str, ...] = (),
            windows: Callable[[dict[str, Any], int], tuple[int | None, ...]] | None = None,
            clips_qkv: bool = False) -> dict[str, Any]:
    """Fields every architecture names alike. `quantizations`: the `quant_method`s this
    architecture's parser handles; any other quantized checkpoint is refused here.
    `windows`: its layers' sliding windows from the config (None: it has none, whatever
    the config says, as its reference attends); `clips_qkv`: it reads `clip_qkv` (OLMoE
    alone; the others' references ignore the field)."""
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(path, f"unsupported hidden_act {config['hidden_act']!r}")
    method = quantization_method(config)
    if method is not None and method not in quantizations + QUANT_METHODS:
        raise CheckpointError(path, f"quantized checkpoint (quant_method {method!r}) is not "
                              f"supported for this architecture; mox reads "
                              f"{', '.join(quantizations + QUANT_METHODS)} or bf16 / fp32")
    num_heads = config["num_attention_heads"]
    num_layers = config["num_hidden_layers"]
    eos_ids = eos_token_ids(config, path)
    return dict(
        model_type=config["model_type"],
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        clip_qkv=config.get("clip_qkv") if clips_qkv else None,
        sliding_windows=(None,) * num_layers if windows is None else windows(config, num_layers),
        top_k=config["num_experts_per_tok"],
        eos_token_ids=eos_ids,
        bos_token_id=config.get("bos_token_id"),
        quant=parse_quantization(config, path),
    )


def quantization_method(config: dict[str, Any]) -> str | None:
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    return str(quantization.get("quant_method", "unknown"))


def _mixtral(config: dict[str, Any], path: str) -> ModelSpec:
    num_layers = config["num_hidden_layers"]
    common = _common(config, path, windows=every_layer_window)
    return ModelSpec(
        **common, rope=parse_rope(config, path, common["head_dim"]), qkv_bias=False,
        o_bias=False, qk_norm=QK_NORM_NONE, num_experts=config["num_local_experts"],
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
    common = _common(config, path, windows=qwen2_moe_windows)
    return ModelSpec(
        **common, rope=parse_rope(config, path, common["head_dim"]),
        qkv_bias=config.get("qkv_bias", True), o_bias=False, qk_norm=QK_NORM_NONE,
        num_experts=config.get("num_experts", config.get("num_local_experts")),
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=config.get("norm_topk_prob", False), moe_layers=_qwen_moe_layers(config),
        dense_intermediate_size=config["intermediate_size"],
        shared_expert_intermediate_size=config.get("shared_expert_intermediate_size", 0),
        naming=MLP_NAMING)


def _qwen3_moe(config: dict[str, Any], path: str) -> ModelSpec:
    bias = config.get("attention_bias", False)
    common = _common(config, path, windows=qwen3_moe_windows)
    return ModelSpec(
        **common, rope=parse_rope(config, path, common["head_dim"]), qkv_bias=bias,
        o_bias=bias, qk_norm=QK_NORM_PER_HEAD,
        num_experts=config.get("num_experts", config.get("num_local_experts")),
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=config.get("norm_topk_prob", False), moe_layers=_qwen_moe_layers(config),
        dense_intermediate_size=config["intermediate_size"],
        shared_expert_intermediate_size=0, naming=MLP_NAMING)


def _olmoe(config: dict[str, Any], path: str) -> ModelSpec:
    bias = config.get("attention_bias", False)
    num_layers = config["num_hidden_layers"]
    common = _common(config, path, clips_qkv=True)
    return ModelSpec(
        **common, rope=parse_rope(config, path, common["head_dim"]), qkv_bias=bias,
        o_bias=bias, qk_norm=QK_NORM_FULL,
        num_experts=config["num_experts"], moe_intermediate_size=config["intermediate_size"],
        norm_topk_prob=config.get("norm_topk_prob", False), moe_layers=(True,) * num_layers,
        dense_intermediate_size=config["intermediate_size"],
        shared_expert_intermediate_size=0, naming=MLP_NAMING)


def _first_k_dense(config: dict[str, Any]) -> tuple[bool, ...]:
    """DeepSeek / GLM4-MoE: the first `first_k_dense_replace` layers are dense, then every
    `moe_layer_freq`-th layer is MoE (1 in every published config)."""
    first = config.get("first_k_dense_replace", 0)
    freq = config.get("moe_layer_freq", 1)
    return tuple(i >= first and i % freq == 0 for i in range(config["num_hidden_layers"]))


def _sigmoid_router(config: dict[str, Any]) -> RouterSpec:
    """DeepSeek-V3 / GLM4-MoE `noaux_tc` routing, computed in fp32 as the reference keeps its
    gate in fp32."""
    return RouterSpec(ROUTING_SIGMOID_GROUPED, n_group=config.get("n_group") or 1,
                      topk_group=config.get("topk_group") or 1,
                      routed_scaling_factor=config.get("routed_scaling_factor", 1.0),
                      correction_bias=True, fp32=True)


def _shared_experts_width(config: dict[str, Any]) -> int:
    return config["moe_intermediate_size"] * (config.get("n_shared_experts") or 0)


def _glm4_moe(config: dict[str, Any], path: str) -> ModelSpec:
    common = _common(config, path)
    qk_norm = QK_NORM_PER_HEAD if config.get("use_qk_norm", False) else QK_NORM_NONE
    rope = parse_rope(config, path, common["head_dim"],
                      default_partial_factor=GLM4_MOE_PARTIAL_ROTARY_FACTOR)
    return ModelSpec(
        **common, rope=rope, qkv_bias=config.get("attention_bias", False), o_bias=False,
        qk_norm=qk_norm, num_experts=config["n_routed_experts"],
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=config.get("norm_topk_prob", True), moe_layers=_first_k_dense(config),
        dense_intermediate_size=config["intermediate_size"],
        shared_expert_intermediate_size=_shared_experts_width(config), naming=DEEPSEEK_NAMING,
        router=_sigmoid_router(config), shared_expert_gated=False)


def _mla(config: dict[str, Any], path: str, interleaved: bool) -> tuple[MLASpec, RopeSpec]:
    """DeepSeek attention: RoPE on the `qk_rope_head_dim` part only; with YaRN the softmax
    scale grows by mscale(factor, mscale_all_dim)^2, as in the reference."""
    nope, rope_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    rope = parse_rope(config, path, rope_dim, interleaved)
    scale = (nope + rope_dim) ** -0.5
    if rope.scaling == ROPE_YARN and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    mla = MLASpec(config.get("q_lora_rank"), config["kv_lora_rank"], nope, rope_dim,
                  config["v_head_dim"], scale)
    return mla, rope


def _deepseek(config: dict[str, Any], path: str, router: RouterSpec, interleaved: bool,
              norm_topk_prob: bool) -> ModelSpec:
    if config.get("mlp_bias", False):
        raise CheckpointError(path, "unsupported mlp_bias: true (DeepSeek MLPs have no bias)")
    mla, rope = _mla(config, path, interleaved)
    bias = config.get("attention_bias", False)
    common = {**_common(config, path), "head_dim": mla.qk_head_dim}
    return ModelSpec(
        **common, rope=rope, qkv_bias=bias, o_bias=bias, qk_norm=QK_NORM_NONE,
        num_experts=config["n_routed_experts"],
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=norm_topk_prob, moe_layers=_first_k_dense(config),
        dense_intermediate_size=config["intermediate_size"],
        shared_expert_intermediate_size=_shared_experts_width(config), naming=DEEPSEEK_NAMING,
        router=router, shared_expert_gated=False, mla=mla)


def _deepseek_v3(config: dict[str, Any], path: str) -> ModelSpec:
    method = config.get("topk_method", "noaux_tc")
    if method != "noaux_tc" or config.get("scoring_func", "sigmoid") != "sigmoid":
        raise CheckpointError(path, f"unsupported DeepSeek-V3 routing topk_method {method!r}, "
                              f"scoring_func {config.get('scoring_func', 'sigmoid')!r}")
    return _deepseek(config, path, _sigmoid_router(config),
                     interleaved=config.get("rope_interleave", True),
                     norm_topk_prob=config.get("norm_topk_prob", True))


def _deepseek_v2(config: dict[str, Any], path: str) -> ModelSpec:
    """Softmax routing, greedy or group-limited; the weights times `routed_scaling_factor`
    unless renormalized (`norm_topk_prob`), as the reference MoEGate does."""
    method = config.get("topk_method", "greedy")
    scoring = {"greedy": ROUTING_SOFTMAX, "group_limited_greedy": ROUTING_SOFTMAX_GROUPED}
    if method not in scoring or config.get("scoring_func", "softmax") != "softmax":
        raise CheckpointError(path, f"unsupported DeepSeek-V2 routing topk_method {method!r}, "
                              f"scoring_func {config.get('scoring_func', 'softmax')!r}")
    scaling = 1.0 if config.get("norm_topk_prob") else config.get("routed_scaling_factor", 1.0)
    router = RouterSpec(scoring[method], n_group=config.get("n_group") or 1,
                        topk_group=config.get("topk_group") or 1,
                        routed_scaling_factor=scaling, fp32=True)
    return _deepseek(config, path, router, interleaved=True,
                     norm_topk_prob=config.get("norm_topk_prob", False))


def _gpt_oss(config: dict[str, Any], path: str) -> ModelSpec:
    """Experts fused `[E, ...]` with biases (MXFP4 blocks and scales as published, kept MXFP4
    in the slots), clamped SwiGLU, a biased router, attention sinks, alternating sliding
    windows."""
    if config.get("rope_parameters") is None and config.get("rope_scaling") is None:
        config = {**config, "rope_parameters": GPT_OSS_DEFAULT_ROPE}
    common = _common(config, path, quantizations=(EXPERTS_MXFP4,), windows=gpt_oss_windows)
    storage = EXPERTS_MXFP4 if quantization_method(config) == EXPERTS_MXFP4 else EXPERTS_FUSED
    if storage == EXPERTS_MXFP4 and (config["hidden_size"] % MXFP4_BLOCK_VALUES
                                     or config["intermediate_size"] % MXFP4_BLOCK_VALUES):
        raise CheckpointError(path, "MXFP4 experts need hidden_size and intermediate_size "
                              f"divisible by {MXFP4_BLOCK_VALUES}")
    bias = config.get("attention_bias", True)
    return ModelSpec(
        **common, rope=parse_rope(config, path, common["head_dim"]), qkv_bias=bias,
        o_bias=bias, qk_norm=QK_NORM_NONE, num_experts=config["num_local_experts"],
        moe_intermediate_size=config["intermediate_size"], norm_topk_prob=True,
        moe_layers=(True,) * config["num_hidden_layers"],
        dense_intermediate_size=config["intermediate_size"], shared_expert_intermediate_size=0,
        naming=GPT_OSS_NAMING, router=RouterSpec(ROUTING_TOPK_SOFTMAX, bias=True),
        expert_storage=storage, expert_bias=True, activation=ACTIVATION_CLAMPED_SWIGLU,
        swiglu_alpha=config.get("swiglu_alpha", 1.702),
        swiglu_limit=config.get("swiglu_limit", 7.0), attention_sinks=True)


_PARSERS: dict[str, Callable[[dict[str, Any], str], ModelSpec]] = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
    "glm4_moe": _glm4_moe,
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
}
