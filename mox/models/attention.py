"""GQA self-attention with the per-architecture extras (qkv bias, q/k norm, clip_qkv,
sliding window, attention sinks), over the batch's KV store.

Legend: T new tokens, K visible keys, H hidden, h heads, h_kv KV heads, d head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mox.kernels import native
from mox.loaders.spec import QK_NORM_FULL, QK_NORM_PER_HEAD, ModelSpec
from mox.models.attend import attend
from mox.models.forward_batch import ForwardBatch
from mox.models.layers import linear, rms_norm
from mox.models.rotary import Rotary


@dataclass
class AttentionWeights:
    q: torch.Tensor                       # [h*d, H]
    k: torch.Tensor                       # [h_kv*d, H]
    v: torch.Tensor                       # [h_kv*d, H]
    o: torch.Tensor                       # [H, h*d]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None    # [d] per head, or [h*d] full width
    k_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None     # [h] per-head sink logits (GPT-OSS)


def attention(spec: ModelSpec, w: AttentionWeights, layer: int, x: torch.Tensor,
              rotary: Rotary, batch: ForwardBatch) -> torch.Tensor:
    """x `[T, H]` (the batch's new tokens, flattened) -> `[T, H]`; writes their K/V to the
    batch's KV store and attends over each token's own sequence."""
    num_tokens = x.shape[0]
    q = linear(x, w.q, w.q_bias)                          # [T, h*d]
    k = linear(x, w.k, w.k_bias)                          # [T, h_kv*d]
    v = linear(x, w.v, w.v_bias)
    if spec.qk_norm == QK_NORM_FULL:
        q, k = rms_norm(q, w.q_norm, spec.rms_norm_eps), rms_norm(k, w.k_norm, spec.rms_norm_eps)
    if spec.clip_qkv is not None:
        q, k, v = (t.clamp(-spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
    q = q.view(num_tokens, spec.num_heads, spec.head_dim)   # [T, h, d]
    k = k.view(num_tokens, spec.num_kv_heads, spec.head_dim)
    v = v.view(num_tokens, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm == QK_NORM_PER_HEAD:
        q, k = rms_norm(q, w.q_norm, spec.rms_norm_eps), rms_norm(k, w.k_norm, spec.rms_norm_eps)
    q = _rotate_and_store(rotary, batch, layer, q, k, v)
    out = attend(batch, layer, q, spec.sliding_windows[layer], sinks=w.sinks)   # [T, h, d]
    return linear(out.reshape(num_tokens, spec.num_heads * spec.head_dim), w.o, w.o_bias)


def _rotate_and_store(rotary: Rotary, batch: ForwardBatch, layer: int, q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """RoPE on q and k, then k and v into the batch's KV store; returns the rotated q. One
    native call on a CPU (bf16, rotating in place), else the reference rotation and an
    indexed copy."""
    tables = batch.rotary_tables(rotary)
    if native.takes_rope(q, k, v, batch.kv):
        keys, values = batch.kv.rows(layer)
        native.kernels().rope_kv(q, k, v, tables, rotary.rope.rotary_dim,
                                 rotary.rope.interleaved, keys, values, batch.slot_mapping)
        return q
    q, k = rotary.apply(q, k, tables)
    batch.kv.write(layer, batch.slot_mapping, k, v)
    return q
