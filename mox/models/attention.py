"""GQA self-attention with the per-architecture extras (qkv bias, q/k norm, clip_qkv,
sliding window), over one sequence's KV cache.

Legend: T new tokens, P cached + new positions, H hidden, h heads, h_kv KV heads, d head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mox.loaders.spec import QK_NORM_FULL, QK_NORM_PER_HEAD, ModelSpec
from mox.models.kv_cache import SequenceKVCache
from mox.models.layers import Rotary, rms_norm


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
              positions: torch.Tensor, rotary: Rotary, cache: SequenceKVCache) -> torch.Tensor:
    """x `[T, H]` at `positions` `[T]` (consecutive, after the cached ones) -> `[T, H]`."""
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
    q, k = rotary.apply(q, k, positions)
    keys, values = cache.write(layer, int(positions[0]), k, v)   # [P, h_kv, d]
    mask = _attention_mask(positions, keys.shape[0], spec.sliding_windows[layer])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),   # [h, T|P, d]
        attn_mask=mask, enable_gqa=spec.num_heads != spec.num_kv_heads)
    out = out.transpose(0, 1).reshape(num_tokens, spec.num_heads * spec.head_dim)
    return F.linear(out, w.o, w.o_bias)


def _attention_mask(positions: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """`[T, P]` bool, True where query t may attend key p: causal, within the window."""
    key_pos = torch.arange(num_keys, device=positions.device)
    distance = positions[:, None] - key_pos[None, :]         # [T, P]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    return allowed
