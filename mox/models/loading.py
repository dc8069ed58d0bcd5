"""Checkpoint -> `MoEDecoder`: dense weights read whole (and shape-checked against the spec,
so a mismatched file fails here with its name, not later inside a matmul), experts into the
slot pool."""

from __future__ import annotations

import torch

from mox.loaders import Checkpoint, CheckpointError
from mox.loaders.spec import QK_NORM_FULL, QK_NORM_PER_HEAD, ModelSpec
from mox.models.attention import AttentionWeights
from mox.models.decoder import LayerWeights, MoEDecoder
from mox.models.experts import load_all_experts
from mox.models.layers import MLPWeights
from mox.models.moe import MoEWeights


class _DenseReader:
    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device) -> None:
        self.ckpt, self.dtype, self.device = ckpt, dtype, device

    def __call__(self, name: str, *shape: int) -> torch.Tensor:
        info = self.ckpt.info(name)
        if info.shape != shape:
            raise CheckpointError(info.file, f"tensor {name!r} has shape {list(info.shape)}, "
                                  f"config.json implies {list(shape)}")
        return self.ckpt.load(name).to(device=self.device, dtype=self.dtype)

    def optional(self, name: str, *shape: int) -> torch.Tensor | None:
        return self(name, *shape) if self.ckpt.has(name) else None


def load_model(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device) -> MoEDecoder:
    spec = ckpt.spec
    read = _DenseReader(ckpt, dtype, device)
    embed = read("model.embed_tokens.weight", spec.vocab_size, spec.hidden_size)
    if spec.tie_word_embeddings and not ckpt.has("lm_head.weight"):
        lm_head = embed
    else:
        lm_head = read("lm_head.weight", spec.vocab_size, spec.hidden_size)
    layers = []
    moe_layer = 0
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}"
        if spec.moe_layers[i]:
            mlp = _moe_weights(spec, read, i, moe_layer)
            moe_layer += 1
        else:
            mlp = _mlp_weights(read, f"{prefix}.mlp", spec.hidden_size,
                               spec.dense_intermediate_size)
        layers.append(LayerWeights(
            input_norm=read(f"{prefix}.input_layernorm.weight", spec.hidden_size),
            post_attention_norm=read(f"{prefix}.post_attention_layernorm.weight",
                                     spec.hidden_size),
            attention=_attention_weights(spec, read, f"{prefix}.self_attn"),
            mlp=mlp))
    final_norm = read("model.norm.weight", spec.hidden_size)
    experts = load_all_experts(ckpt, dtype, device)
    return MoEDecoder(spec, embed, layers, final_norm, lm_head, experts)


def _attention_weights(spec: ModelSpec, read: _DenseReader, prefix: str) -> AttentionWeights:
    hidden, q_width = spec.hidden_size, spec.num_heads * spec.head_dim
    kv_width = spec.num_kv_heads * spec.head_dim
    w = AttentionWeights(
        q=read(f"{prefix}.q_proj.weight", q_width, hidden),
        k=read(f"{prefix}.k_proj.weight", kv_width, hidden),
        v=read(f"{prefix}.v_proj.weight", kv_width, hidden),
        o=read(f"{prefix}.o_proj.weight", hidden, q_width))
    if spec.qkv_bias:
        w.q_bias = read(f"{prefix}.q_proj.bias", q_width)
        w.k_bias = read(f"{prefix}.k_proj.bias", kv_width)
        w.v_bias = read(f"{prefix}.v_proj.bias", kv_width)
    if spec.o_bias:
        w.o_bias = read(f"{prefix}.o_proj.bias", hidden)
    if spec.qk_norm == QK_NORM_PER_HEAD:
        w.q_norm = read(f"{prefix}.q_norm.weight", spec.head_dim)
        w.k_norm = read(f"{prefix}.k_norm.weight", spec.head_dim)
    elif spec.qk_norm == QK_NORM_FULL:
        w.q_norm = read(f"{prefix}.q_norm.weight", q_width)
        w.k_norm = read(f"{prefix}.k_norm.weight", kv_width)
    return w


def _mlp_weights(read: _DenseReader, prefix: str, hidden: int, inter: int) -> MLPWeights:
    return MLPWeights(gate=read(f"{prefix}.gate_proj.weight", inter, hidden),
                      up=read(f"{prefix}.up_proj.weight", inter, hidden),
                      down=read(f"{prefix}.down_proj.weight", hidden, inter))


def _moe_weights(spec: ModelSpec, read: _DenseReader, layer: int, moe_layer: int) -> MoEWeights:
    w = MoEWeights(router=read(spec.naming.router(layer), spec.num_experts, spec.hidden_size),
                   moe_layer=moe_layer)
    if spec.has_shared_expert:
        prefix = f"model.layers.{layer}.mlp"
        w.shared_expert = _mlp_weights(read, f"{prefix}.shared_expert", spec.hidden_size,
                                       spec.shared_expert_intermediate_size)
        w.shared_expert_gate = read(f"{prefix}.shared_expert_gate.weight", 1, spec.hidden_size)
    return w
