"""GQA self-attention with the per-architecture extras (qkv bias, q/k norm, clip_qkv,
sliding window, attention sinks), over the batch's KV store.

Legend: T new tokens, K visible keys, H hidden, h heads, h_kv KV heads, d head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mox.kernels import native, triton_ops
from mox.kernels.native_attention import AttentionLayer, attention_layer
from mox.kernels.native_moe import K_MULTIPLE
from mox.loaders.spec import QK_NORM_FULL, QK_NORM_PER_HEAD, ModelSpec
from mox.models.attend import attend
from mox.models.forward_batch import ForwardBatch
from mox.models.layers import linear, rms_norm
from mox.models.rotary import Rotary


@dataclass
class AttentionWeights:
    # q, k and v projections stacked, [(h + 2 h_kv) * d, H]: one GEMM (a decode step's one
    # read of them, one kernel call instead of three)
    qkv: torch.Tensor
    o: torch.Tensor                       # [H, h*d]
    qkv_bias: torch.Tensor | None = None  # [(h + 2 h_kv) * d]
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None    # [d] per head, or [h*d] full width
    k_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None     # [h] per-head sink logits (GPT-OSS)


def attention(spec: ModelSpec, w: AttentionWeights, layer: int, x: torch.Tensor,
              rotary: Rotary, batch: ForwardBatch) -> torch.Tensor:
    """x `[T, H]` (the batch's new tokens, flattened) -> `[T, H]`; writes their K/V to the
    batch's KV store and attends over each token's own sequence."""
    num_tokens, q_width, kv_width = x.shape[0], spec.num_heads * spec.head_dim, \
        spec.num_kv_heads * spec.head_dim
    qkv = linear(x, w.qkv, w.qkv_bias)                    # [T, (h + 2 h_kv) * d]
    q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)   # [T, h*d], [T, h_kv*d] x 2
    if spec.qk_norm == QK_NORM_FULL:
        q, k = rms_norm(q, w.q_norm, spec.rms_norm_eps), rms_norm(k, w.k_norm, spec.rms_norm_eps)
    if spec.clip_qkv is not None:
        q, k, v = (t.clamp(-spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
    q = q.view(num_tokens, spec.num_heads, spec.head_dim)   # [T, h, d]
    k = k.view(num_tokens, spec.num_kv_heads, spec.head_dim)
    v = v.view(num_tokens, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm == QK_NORM_PER_HEAD:      # (as rows of one head: the native norm takes them)
        q, k = (rms_norm(t.reshape(-1, spec.head_dim), norm, spec.rms_norm_eps).view(t.shape)
                for t, norm in ((q, w.q_norm), (k, w.k_norm)))
    q = _rotate_and_store(rotary, batch, layer, q, k, v)
    out = attend(batch, layer, q, spec.sliding_windows[layer], sinks=w.sinks)   # [T, h, d]
    return linear(out.reshape(num_tokens, spec.num_heads * spec.head_dim), w.o, w.o_bias)


def _rotate_and_store(rotary: Rotary, batch: ForwardBatch, layer: int, q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """RoPE on q and k, then k and v into the batch's KV store; returns the rotated q. One
    native call on a CPU (bf16, rotating in place), one Triton kernel on a GPU, else the
    reference rotation and an indexed copy."""
    if triton_ops.takes(q) and triton_ops.takes_rope(rotary.rope.rotary_dim):
        rotary.reserve(batch.max_position + 1)
        keys, values, offsets = batch.kv_rows(layer)
        return triton_ops.rope_kv(q, k, v, rotary.cos, rotary.sin, batch.positions,
                                  rotary.rope.rotary_dim, rotary.rope.interleaved, keys,
                                  values, batch.slot_mapping, kv_offsets=offsets)
    tables = batch.rotary_tables(rotary)
    if native.takes_rope(q, k, v, batch.kv):
        keys, values = batch.kv.rows(layer)
        native.kernels().rope_kv(q, k, v, tables, rotary.rope.rotary_dim,
                                 rotary.rope.interleaved, keys, values, batch.slot_mapping)
        return q
    q, k = rotary.apply(q, k, tables)
    batch.kv.write(layer, batch.slot_mapping, k, v)
    return q


def native_layer(spec: ModelSpec, w: AttentionWeights, layer: int, input_norm: torch.Tensor,
                 post_norm: torch.Tensor, rotary: Rotary) -> AttentionLayer | None:
    """The layer's attention half as the native kernel takes it (csrc/attention_block.c:
    norm, attention, residual and the next norm in one call), or None where the layer has
    what that kernel does not do (attention sinks, clipped qkv) or its weights are not bf16
    on a CPU."""
    if (w.sinks is not None or spec.clip_qkv is not None or w.qkv.dtype != torch.bfloat16
            or w.qkv.device.type != "cpu" or spec.hidden_size % K_MULTIPLE
            or (spec.num_heads * spec.head_dim) % K_MULTIPLE):
        return None
    qk_norm = {QK_NORM_FULL: "full", QK_NORM_PER_HEAD: "per_head"}.get(spec.qk_norm, "none")
    return attention_layer(input_norm, post_norm, w.qkv, w.o, spec.num_heads,
                           spec.num_kv_heads, spec.head_dim, rotary.rope.rotary_dim,
                           rotary.rope.interleaved, spec.sliding_windows[layer],
                           spec.rms_norm_eps, spec.head_dim ** -0.5, w.qkv_bias, w.o_bias,
                           qk_norm, w.q_norm, w.k_norm)


def attention_block(layer: AttentionLayer, index: int, x: torch.Tensor, rotary: Rotary,
                    batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode through `native_layer`'s struct for layer `index`: `x + attention(norm(x))` and
    its post-attention norm, exactly as the steps compute them one by one (callers check
    `takes_block`)."""
    keys, values = batch.kv.rows(index)
    starts, lengths = batch.key_ranges
    return native.kernels().attention_block(layer, x, batch.rotary_tables(rotary), keys,
                                            values, batch.slot_mapping, batch.kv_slots,
                                            starts, lengths)


def takes_block(w: AttentionWeights, x: torch.Tensor, batch: ForwardBatch) -> bool:
    """Whether `attention_block` serves these rows: a decode batch (each token's keys one
    run) on the native GEMV's path."""
    return batch.key_ranges is not None and native.takes(x, w.qkv)
