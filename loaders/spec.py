"""`ModelSpec`: one normalized description of every supported MoE decoder.

Each architecture names the same ideas differently (`num_local_experts` vs `num_experts`,
`qkv_bias` vs `attention_bias`, ...). The parsers (`loaders.config`) translate them once, so
the model code branches on features (`qk_norm`, `has_shared_expert`, `mla`), never on
`model_type`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .quantized import QuantSpec
from .rope import RopeSpec

QK_NORM_NONE, QK_NORM_PER_HEAD, QK_NORM_FULL = "none", "per_head", "full"
# How a router turns logits into (weights, experts); see `mox.kernels.routing`.
ROUTING_SOFTMAX = "softmax"                  # softmax over all E, top-k (Mixtral, Qwen, OLMoE)
ROUTING_SOFTMAX_GROUPED = "softmax_grouped"  # DeepSeek-V2 group_limited_greedy
ROUTING_SIGMOID_GROUPED = "sigmoid_grouped"  # DeepSeek-V3, GLM4-MoE (noaux_tc)
ROUTING_TOPK_SOFTMAX = "topk_softmax"        # GPT-OSS: top-k logits, softmax over those k
# The expert activation, as `mox.kernels.fused_moe` names it.
ACTIVATION_SILU, ACTIVATION_CLAMPED_SWIGLU = "silu", "clamped_swiglu"
# How a checkpoint stores its experts.
EXPERTS_SEPARATE = "separate"    # one tensor per expert and projection
EXPERTS_FUSED = "fused"          # GPT-OSS: `[E, ...]` tensors, gate/up interleaved, biases
EXPERTS_MXFP4 = "mxfp4"          # GPT-OSS as published: fused, MXFP4 `*_blocks` + `*_scales`


@dataclass(frozen=True)
class ExpertNaming:
    """How a checkpoint names layer `l`'s expert `j` tensors, e.g. `mlp.experts.3.up_proj`."""

    moe_module: str                 # "block_sparse_moe" (Mixtral) or "mlp"
    gate: str                       # "w1" or "gate_proj"
    up: str                         # "w3" or "up_proj"
    down: str                       # "w2" or "down_proj"
    shared_expert: str = "shared_expert"   # "shared_experts" (DeepSeek, GLM4-MoE)
    router_module: str = "gate"            # "router" (GPT-OSS)

    def expert_prefix(self, layer: int, expert: int) -> str:
        return f"model.layers.{layer}.{self.moe_module}.experts.{expert}"

    def fused_experts(self, layer: int) -> str:
        """Prefix of a fused checkpoint's `[E, ...]` expert tensors (GPT-OSS)."""
        return f"model.layers.{layer}.{self.moe_module}.experts"

    def router_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.moe_module}.{self.router_module}"

    def router(self, layer: int) -> str:
        return f"{self.router_prefix(layer)}.weight"

    def shared_expert_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.moe_module}.{self.shared_expert}"


MIXTRAL_NAMING = ExpertNaming("block_sparse_moe", "w1", "w3", "w2")
MLP_NAMING = ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj")
DEEPSEEK_NAMING = ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj", "shared_experts")
GPT_OSS_NAMING = ExpertNaming("mlp", "gate_up_proj", "gate_up_proj", "down_proj",
                              router_module="router")


@dataclass(frozen=True)
class RouterSpec:
    scoring: str = ROUTING_SOFTMAX
    n_group: int = 1                     # grouped routing: expert groups ...
    topk_group: int = 1                  # ... of which each token may use this many
    routed_scaling_factor: float = 1.0   # multiplies the routing weights
    correction_bias: bool = False        # `e_score_correction_bias` steers only the choice
    bias: bool = False                   # the router linear has a bias (GPT-OSS)
    fp32: bool = False                   # logits from fp32 weights and input (DeepSeek, GLM)


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek's multi-head latent attention. The KV cache holds, per token, the normalized
    latent `[kv_lora_rank]` and the rotated shared key `[qk_rope_head_dim]`."""

    q_lora_rank: int | None          # None: one `q_proj` (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


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
    rope: RopeSpec
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
    router: RouterSpec = RouterSpec()
    shared_expert_gated: bool = True       # qwen2_moe's sigmoid gate; ungated: DeepSeek, GLM
    expert_storage: str = EXPERTS_SEPARATE
    expert_bias: bool = False              # per-expert gate_up and down biases (GPT-OSS)
    activation: str = ACTIVATION_SILU
    swiglu_alpha: float = 1.702            # ACTIVATION_CLAMPED_SWIGLU's parameters
    swiglu_limit: float = 7.0
    attention_sinks: bool = False          # a learned per-head logit in every softmax
    mla: MLASpec | None = None             # multi-head latent attention instead of GQA
    quant: QuantSpec | None = None         # linear weights stored quantized (loaders.quantized)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0
