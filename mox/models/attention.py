"""GQA self-attention with the per-architecture extras (qkv bias, q/k norm, clip_qkv,
sliding window), over one sequence's KV cache.

Legend: T new tokens, K visible keys, H hidden, h heads, h_kv KV heads, d head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mox.loaders.spec import QK_NORM_FULL, QK_NORM_PER_HEAD, ModelSpec
from mox.models.forward_batch import ForwardBatch
from mox.models.layers import rms_norm
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


def attention(spec: ModelSpec, w: AttentionWeights, layer: int, x: torch.Tensor,
              rotary: Rotary, batch: ForwardBatch) -> torch.Tensor:
    """x `[T, H]` (the batch's new tokens, flattened) -> `[T, H]`; writes their K/V to the
    batch's KV store and attends over each token's own sequence."""
    num_tokens = x.shape[0]
    q = F.linear(x, w.q, w.q_bias)                          # [T, h*d]
    k = F.linear(x, w.k, w.k_bias)                          # [T, h_kv*d]
    v = F.linear(x, w.v, w.v_bias)
    if spec.qk_norm == QK_NORM_FULL:
        q, k = rms_norm(q, w.q_norm, spec.rms_norm_eps), rms_norm(k, w.k_norm, spec.rms_norm_eps)
    if spec.clip_qkv is not None:
        q, k, v = (t.clamp(-spec.clip_qkv, spec.clip_qkv) for t in (q, k, v))
    q = q.view(num_tokens, spec.num_heads, spec.head_dim)   # [T, h, d]
    k = k.view(num_tokens, spec.num_kv_heads, spec.head_dim)
    v = v.view(num_tokens, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm == QK_NORM_PER_HEAD:
        q, k = rms_norm(q, w.q_norm, spec.rms_norm_eps), rms_norm(k, w.k_norm, spec.rms_norm_eps)
    q, k = rotary.apply(q, k, batch.rotary_tables(rotary))
    batch.kv.write(layer, batch.slot_mapping, k, v)
    window = spec.sliding_windows[layer]
    if batch.padded is not None:
        out = _padded_attention(spec, layer, q, batch, window)
    else:
        keys, values = batch.kv.gather(layer, batch.kv_slots)              # [K, h_kv, d]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),  # [h, T|K, d]
            attn_mask=batch.attention_mask(window),
            enable_gqa=spec.num_heads != spec.num_kv_heads).transpose(0, 1)
    return F.linear(out.reshape(num_tokens, spec.num_heads * spec.head_dim), w.o, w.o_bias)


def _padded_attention(spec: ModelSpec, layer: int, q: torch.Tensor, batch: ForwardBatch,
                      window: int | None) -> torch.Tensor:
    """Per-sequence attention as one padded batch: q `[T, h, d]` -> `[T, h, d]`.
    Legend: B sequences, Tq / Pk the most new tokens / keys of any of them."""
    pad = batch.padded
    num_seqs, max_keys = pad.kv_slots.shape
    keys, values = batch.kv.gather(layer, pad.kv_slots.reshape(-1))        # [B*Pk, h_kv, d]
    keys = keys.view(num_seqs, max_keys, *keys.shape[1:]).transpose(1, 2)   # [B, h_kv, Pk, d]
    values = values.view(num_seqs, max_keys, *values.shape[1:]).transpose(1, 2)
    queries = q[pad.q_index].transpose(1, 2)                                # [B, h, Tq, d]
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=pad.mask(window)[:, None],
        enable_gqa=spec.num_heads != spec.num_kv_heads).transpose(1, 2)     # [B, Tq, h, d]
    flat = torch.empty_like(q)
    flat[pad.q_index[pad.q_valid]] = out[pad.q_valid]
    return flat
