"""The attention step every attention variant shares: gather each token's visible keys and
values from the batch's KV store and run SDPA, over the flat batch (block-diagonal mask) or
per sequence (padded), optionally with attention sinks.

Legend: T new tokens, K visible keys, h heads, h_kv KV heads, d q/k head dim, dv value dim;
B sequences, Tq / Pk the most new tokens / keys of any one of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mox.kernels import native, triton_ops
from mox.kernels.attention_triton import decode_attention_triton
from mox.models.forward_batch import ForwardBatch, PaddedLayout

# What the KV store holds -> per-head keys `[N, h, d]` and values `[N, h, dv]` (MLA stores a
# latent and expands it here); None: the store holds keys and values themselves.
Expand = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def attend(batch: ForwardBatch, layer: int, q: torch.Tensor, window: int | None,
           scale: float | None = None, sinks: torch.Tensor | None = None,
           expand: Expand | None = None) -> torch.Tensor:
    """q `[T, h, d]` -> `[T, h, dv]`: each token attends to its own sequence's keys at or
    before its position (within `window`). `sinks` `[h]`: per-head logits that join every
    softmax's denominator (GPT-OSS)."""
    if batch.key_ranges is not None and sinks is None and expand is None:
        # decode: the keys read in place from the store, no gathered or padded copies
        # (C on a CPU, Triton on a GPU)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        starts, lengths = batch.key_ranges
        if native.takes_attention(q, batch.kv):
            keys, values = batch.kv.rows(layer)
            return native.kernels().decode_attention(q.contiguous(), keys, values,
                                                     batch.kv_slots, starts, lengths, scale,
                                                     window).to(q.dtype)
        if triton_ops.takes(q):
            keys, values, offsets = batch.kv_rows(layer)
            return decode_attention_triton(q.contiguous(), keys, values, batch.kv_slots,
                                           starts, lengths, scale, window,
                                           kv_offsets=offsets, out_dtype=q.dtype)
    pad = batch.padded_layout()
    if pad is not None:
        return _attend_padded(batch, pad, layer, q, window, scale, sinks, expand)
    keys, values = batch.kv.gather(layer, batch.kv_slots)                 # [K, h_kv, d]
    if expand is not None:
        keys, values = expand(keys, values)                               # [K, h, d|dv]
    out = _sdpa(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                batch.attention_mask(window), scale, sinks)               # [h, T, dv]
    return out.transpose(0, 1)


def _attend_padded(batch: ForwardBatch, pad: PaddedLayout, layer: int, q: torch.Tensor,
                   window: int | None, scale: float | None, sinks: torch.Tensor | None,
                   expand: Expand | None) -> torch.Tensor:
    """Per-sequence attention as one padded batch: cheaper than the flat mask when many
    sequences decode (cost B x Tq x Pk instead of T x K)."""
    num_seqs, max_keys = pad.kv_slots.shape
    keys, values = batch.kv.gather(layer, pad.kv_slots.reshape(-1))        # [B*Pk, h_kv, d]
    if expand is not None:
        keys, values = expand(keys, values)
    keys = keys.view(num_seqs, max_keys, *keys.shape[1:]).transpose(1, 2)   # [B, h_kv, Pk, d]
    values = values.view(num_seqs, max_keys, *values.shape[1:]).transpose(1, 2)
    queries = q[pad.q_index].transpose(1, 2)                                # [B, h, Tq, d]
    out = _sdpa(queries, keys, values, pad.mask(window)[:, None], scale,
                sinks).transpose(1, 2)                                      # [B, Tq, h, dv]
    flat = q.new_empty(*q.shape[:2], out.shape[-1])                         # [T, h, dv]
    flat[pad.q_index[pad.q_valid]] = out[pad.q_valid]
    return flat


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA over `[..., heads, tokens, dim]`; `mask` bool, broadcast over heads."""
    gqa = q.shape[-3] != k.shape[-3]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)
    # A sink is one more key that every query sees, with a zero value: it only adds
    # exp(sink) to the softmax denominator. Its per-head logit rides on one extra q/k dim
    # (q: sink / scale, the sink key: 1, real keys: 0), so the mask stays per token, not per
    # head, and GQA still shares keys.
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    sink_q = (sinks.to(q.dtype) / scale).view(-1, 1, 1).expand(*q.shape[:-1], 1)
    q = torch.cat((q, sink_q), dim=-1)                                     # [.., h, T, d+1]
    k = torch.cat((k, k.new_zeros(*k.shape[:-1], 1)), dim=-1)              # [.., h_kv, K, d+1]
    sink_k = k.new_zeros(*k.shape[:-2], 1, k.shape[-1])
    sink_k[..., -1] = 1
    k = torch.cat((k, sink_k), dim=-2)                                     # [.., h_kv, K+1, d+1]
    v = torch.cat((v, v.new_zeros(*v.shape[:-2], 1, v.shape[-1])), dim=-2)
    if mask is not None:
        mask = torch.cat((mask, mask.new_ones(*mask.shape[:-1], 1)), dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=gqa)
