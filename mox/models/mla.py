"""DeepSeek's multi-head latent attention (MLA) over the batch's KV store.

The store caches per token only what MLA compresses keys and values into: the normalized KV
latent `[r]` and the rotated key part shared by all heads `[d_r]` (r + d_r numbers a token,
against 2 x h x d for GQA). Per-head keys and values are expanded from the latent when a
step attends (`kv_b_proj`), as the reference computes them; a decode step on the CPU instead
folds `kv_b_proj` into the query and the output (MLA's "absorbed" form) and attends over the
cached latents in place, in the native kernel.

Legend: T new tokens, N gathered tokens, H hidden, h heads, r kv_lora_rank, r_q q_lora_rank,
d_n qk_nope_head_dim, d_r qk_rope_head_dim, d_q = d_n + d_r, d_v v_head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from mox.kernels import native
from mox.loaders.spec import MLASpec, ModelSpec
from mox.models.attend import attend
from mox.models.forward_batch import ForwardBatch
from mox.models.layers import linear, rms_norm
from mox.models.rotary import Rotary

# The reference builds the latent norms with RMSNorm's default eps, not the config's.
LATENT_NORM_EPS = 1e-6


@dataclass
class MLAWeights:
    kv_a: torch.Tensor                       # [r + d_r, H] (kv_a_proj_with_mqa)
    kv_a_norm: torch.Tensor                  # [r]
    kv_b: torch.Tensor                       # [h*(d_n + d_v), r]
    o: torch.Tensor                          # [H, h*d_v]
    q: torch.Tensor | None = None            # [h*d_q, H], when there is no q LoRA
    q_a: torch.Tensor | None = None          # [r_q, H]
    q_a_norm: torch.Tensor | None = None     # [r_q]
    q_b: torch.Tensor | None = None          # [h*d_q, r_q]
    q_a_bias: torch.Tensor | None = None
    kv_a_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


def mla_attention(spec: ModelSpec, w: MLAWeights, layer: int, x: torch.Tensor,
                  rotary: Rotary, batch: ForwardBatch) -> torch.Tensor:
    """x `[T, H]` -> `[T, H]`; caches the new tokens' latents and attends."""
    mla, heads, num_tokens = spec.mla, spec.num_heads, x.shape[0]
    if w.q is not None:
        q = linear(x, w.q)                                                  # [T, h*d_q]
    else:
        q_latent = rms_norm(linear(x, w.q_a, w.q_a_bias), w.q_a_norm, LATENT_NORM_EPS)
        q = linear(q_latent, w.q_b)
    q_nope, q_rope = q.view(num_tokens, heads, mla.qk_head_dim).split(
        [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)                 # [T, h, d_n|d_r]
    compressed = linear(x, w.kv_a, w.kv_a_bias)                             # [T, r + d_r]
    latent, k_rope = compressed.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    latent = rms_norm(latent, w.kv_a_norm, LATENT_NORM_EPS)                   # [T, r]
    q_rope, k_rope = rotary.apply(q_rope, k_rope[:, None], batch.rotary_tables(rotary))
    batch.kv.write(layer, batch.slot_mapping, latent[:, None], k_rope)       # [T, 1, r|d_r]
    window = spec.sliding_windows[layer]
    if batch.key_ranges is not None and native.takes_attention(q_nope, batch.kv):
        out = absorbed_decode(mla, w.kv_b, layer, q_nope, q_rope, batch, window)
    else:
        query = torch.cat((q_nope, q_rope), dim=-1)                           # [T, h, d_q]
        out = attend(batch, layer, query, window, scale=mla.softmax_scale,
                     expand=partial(_expand, mla, heads, w.kv_b))             # [T, h, d_v]
    return linear(out.reshape(num_tokens, heads * mla.v_head_dim), w.o, w.o_bias)


def absorbed_decode(mla: MLASpec, kv_b: torch.Tensor, layer: int, q_nope: torch.Tensor,
                    q_rope: torch.Tensor, batch: ForwardBatch, window: int | None,
                    fast: bool = True) -> torch.Tensor:
    """Decode attention over the cached latents read in place: q_nope . (W_uk c) is
    (q_nope W_uk) . c, and sum_j p_j W_uv c_j is W_uv sum_j p_j c_j, so no key or value is
    expanded per head. `[T, h, d_v]`; `fast`: the kernel's AVX-512 path (serving takes this
    path only where it runs), else its plain C."""
    heads = q_nope.shape[1]
    w_uk, w_uv = kv_b.view(heads, mla.qk_nope_head_dim + mla.v_head_dim,
                           mla.kv_lora_rank).split([mla.qk_nope_head_dim, mla.v_head_dim],
                                                   dim=1)               # [h, d_n|d_v, r]
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)                # [T, h, r]
    query = torch.cat((q_latent, q_rope), dim=-1).contiguous()           # [T, h, r + d_r]
    latents, rope_keys = batch.kv.rows(layer)                            # [N, 1, r|d_r]
    starts, lengths = batch.key_ranges
    out_latent = native.kernels().decode_attention(
        query, latents, latents, batch.kv_slots, starts, lengths, mla.softmax_scale, window,
        keys2=rope_keys, fast=fast)                                      # [T, h, r] f32
    return torch.einsum("thr,hvr->thv", out_latent.to(q_nope.dtype), w_uv)


def _expand(mla: MLASpec, heads: int, kv_b: torch.Tensor, latents: torch.Tensor,
            rope_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached latents `[N, 1, r]` and rope keys `[N, 1, d_r]` -> keys `[N, h, d_q]`, values
    `[N, h, d_v]`."""
    num = latents.shape[0]
    kv = linear(latents[:, 0], kv_b).view(num, heads, mla.qk_nope_head_dim + mla.v_head_dim)
    k_nope, values = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
    keys = torch.cat((k_nope, rope_keys.expand(num, heads, mla.qk_rope_head_dim)), dim=-1)
    return keys, values
