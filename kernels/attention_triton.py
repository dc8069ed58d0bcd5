"""Decode attention on GPUs (Triton), reading the paged KV store in place: each new token
attends to its own sequence's keys through their flat KV slots, with no gathered or padded
copy of them (the GPU twin of csrc/decode_attention.c; one kernel for one and many sequences,
and no shape that depends on the host, as graph capture needs).

    out[t, hq, :] = sum_j p_j V[s_j, g, :],  p = softmax_j(scale * q[t, hq, :] . K[s_j, g, :])

over the slots s_j = slots[starts[t] .. starts[t] + lengths[t]) (the last `window` of them
when window > 0), g = hq / (h / h_kv) its KV head. A program takes one token and one KV head:
each key and value row is read once for the query heads sharing it, in blocks of BLOCK_N keys
with an online softmax in fp32. Legend: T tokens, h heads, h_kv KV heads, d head dim,
dv value dim, N the store's slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_triton import is_interpreter

# a block's [G, N, D] products stay within this many fp32 values (a program's registers;
# unmeasured on a GPU: the products are summed in registers, not through tl.dot)
REGISTER_VALUES = 8192


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, kv_offsets_ptr, out_ptr, slots_ptr,
                             starts_ptr, lengths_ptr, scale, window, stride_qt, stride_qh,
                             stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh,
                             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                             VALUE_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                             BLOCK_N: tl.constexpr, ANCHORED: tl.constexpr):
    token, kv_head = tl.program_id(0), tl.program_id(1)
    if ANCHORED:                          # the store where it is now, from fixed anchors
        # (multiples of 16 elements, as KVAnchor checks: the loads stay vectorized)
        k_ptr += tl.multiple_of(tl.load(kv_offsets_ptr), 16)
        v_ptr += tl.multiple_of(tl.load(kv_offsets_ptr + 1), 16)
    start = tl.load(starts_ptr + token).to(tl.int64)
    length = tl.load(lengths_ptr + token).to(tl.int64)
    first = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    offs_g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + offs_g
    g_ok = offs_g < GROUP
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    d_ok, dv_ok = offs_d < HEAD_DIM, offs_dv < VALUE_DIM
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)      # [G, D]
    top = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), tl.float32)
    for block in range(first, length, BLOCK_N):
        offs_n = block + tl.arange(0, BLOCK_N)
        n_ok = offs_n < length
        slot = tl.load(slots_ptr + start + offs_n, mask=n_ok, other=0).to(tl.int64)
        k = tl.load(k_ptr + slot[:, None] * stride_kn + kv_head * stride_kh + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)  # [N, D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale             # [G, N]
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=1))
        p = tl.exp(scores - new_top[:, None])
        rescale = tl.exp(top - new_top)
        total = total * rescale + tl.sum(p, axis=1)
        v = tl.load(v_ptr + slot[:, None] * stride_vn + kv_head * stride_vh + offs_dv[None, :],
                    mask=n_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)  # [N, DV]
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        top = new_top
    out = acc / total[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & dv_ok[None, :])


def decode_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            slots: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                            scale: float, window: int | None,
                            block_n: int | None = None,
                            kv_offsets: torch.Tensor | None = None,
                            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q `[T, h, d]`; `keys [N, h_kv, d]`, `values [N, h_kv, dv]`: the layer's store as flat
    slots, rows contiguous per head; token t attends to the keys at
    `slots[starts[t]:starts[t] + lengths[t]]` (their last `window`) -> `[T, h, dv]`.
    `block_n`: keys a block (default: as many as keep a block's [G, N, D] products within
    REGISTER_VALUES). `kv_offsets` (`[2]` int64, on the device): the store is read that many
    elements past `keys` and `values`, which are then anchors laid out as its rows (a CUDA
    graph bakes the anchors' addresses, and the store may move between replays).
    `out_dtype`: the result's, rounded in the kernel (saves a cast kernel)."""
    num_tokens, heads, dim = q.shape
    kv_heads, value_dim = keys.shape[1], values.shape[2]
    assert q.is_cuda or is_interpreter(), "Triton needs CUDA tensors (or TRITON_INTERPRET=1)"
    if heads % kv_heads or keys.shape[2] != dim or keys.shape[0] != values.shape[0]:
        raise ValueError(f"decode attention: h={heads} over h_kv={kv_heads}, q d={dim}, keys "
                         f"{tuple(keys.shape)}, values {tuple(values.shape)}")
    for t in (q, keys, values):
        if t.stride(-1) != 1:
            raise ValueError("decode attention takes rows contiguous per head")
    # (the interpreter truncates to bf16 where a GPU rounds: there, f32 and a torch cast)
    out = torch.empty(num_tokens, heads, value_dim, device=q.device,
                      dtype=torch.float32 if is_interpreter() else out_dtype)
    group = heads // kv_heads
    block_g = max(triton.next_power_of_2(group), 2)
    block_d, block_dv = triton.next_power_of_2(dim), triton.next_power_of_2(value_dim)
    if block_n is None:
        block_n = max(2, min(32, REGISTER_VALUES // (block_g * max(block_d, block_dv))))
    _decode_attention_kernel[(num_tokens, kv_heads)](
        q, keys, values, keys if kv_offsets is None else kv_offsets, out, slots, starts,
        lengths, scale, window or 0,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0),
        values.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=dim, VALUE_DIM=value_dim, BLOCK_G=block_g, BLOCK_D=block_d,
        BLOCK_DV=block_dv, BLOCK_N=triton.next_power_of_2(block_n),
        ANCHORED=kv_offsets is not None)
    return out.to(out_dtype)
