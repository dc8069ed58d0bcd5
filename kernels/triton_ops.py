"""A GPU decode step's small ops fused in Triton (issue 20): a CUDA graph replays every kernel
of a step back to back, each a few microseconds however small, so at batch 1 their number
bounds the step. torch spends seven kernels on an RMSNorm, about ten on rotating q and k
and storing K/V, and four on a softmax router's choice; here each is one.

- `rms_norm`: `weight * (x / rms(x))` per row, the normalization in fp32 and the scaling in
  the input dtype, as HF does; optionally after adding a residual (`x + r`, rounded to the
  dtype as torch's add is), returning the sum too.
- `softmax_topk`: a softmax router's top-k experts and weights (optionally renormalized and
  scaled), marking the experts chosen.
- `rope_kv`: RoPE on q and k from the rotary tables at each token's position (halves, or
  interleaved pairs listed evens then odds, as mox.models.rotary does; the dims past
  `rotary_dim` kept), then k and v stored at each token's KV slot.

Loads are upcast to fp32 (the interpreter's bf16 arithmetic is wrong; on a GPU it is what
the math wants anyway). Legend: T tokens (rows), N row width, h / h_kv heads, d head dim,
r rotary dims, P table positions, S KV slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_triton import is_interpreter
from .routing import SIGMOID_RENORM_EPS

RENORM_EPS = tl.constexpr(SIGMOID_RENORM_EPS)      # (a jitted function reads constexpr globals)


def takes(x: torch.Tensor) -> bool:
    """Whether the Triton ops serve this tensor's step (a GPU; the CPU tests stand one in
    by patching this under the interpreter)."""
    return x.is_cuda


@triton.jit
def _lowest_max(x, offs, left, SIZE: tl.constexpr):
    """The lowest index among `left` lanes holding their largest value: ties (-inf ones too)
    to the lowest id, as top_k's stable sort, by an explicit min over ids rather than
    argmax's tie rule (which the interpreter ignores)."""
    top = tl.max(tl.where(left, x, float("-inf")), axis=0)
    return tl.min(tl.where(left & (x == top), offs, SIZE), axis=0)


@triton.jit
def _top_k(choice, values, left, K: tl.constexpr, BLOCK_K: tl.constexpr,
           SIZE: tl.constexpr):
    """The K `left` lanes of largest `choice`, largest first (`_lowest_max`): their ids and
    `values`, in `[BLOCK_K]` vectors."""
    offs = tl.arange(0, SIZE)
    slot = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), tl.float32)
    ids = tl.zeros((BLOCK_K,), tl.int32)
    for j in tl.static_range(K):
        best = _lowest_max(choice, offs, left, SIZE)
        weights = tl.where(slot == j, tl.sum(tl.where(offs == best, values, 0.0), axis=0),
                           weights)
        ids = tl.where(slot == j, best.to(tl.int32), ids)
        left = left & (offs != best)
    return weights, ids


@triton.jit
def _store_choice(weights, ids, row, weights_ptr, ids_ptr, mark_ptr, K: tl.constexpr,
                  BLOCK_K: tl.constexpr, MARK: tl.constexpr):
    """A token's k weights and ids, and its experts marked chosen."""
    slot = tl.arange(0, BLOCK_K)
    k_ok = slot < K
    tl.store(weights_ptr + row * K + slot, weights, mask=k_ok)
    tl.store(ids_ptr + row * K + slot, ids, mask=k_ok)
    if MARK:
        tl.store(mark_ptr + ids, tl.full((BLOCK_K,), 1, tl.int32), mask=k_ok)


@triton.jit
def _softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, mark_ptr, num_experts, stride_l,
                         scaling, K: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_E: tl.constexpr, RENORM: tl.constexpr, MARK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=ok, other=float("-inf"))
    x = x.to(tl.float32)
    # a NaN logit makes every probability NaN in torch's softmax, and its stable sort then
    # keeps the ids in order: every expert ties here, so the lowest ids are chosen
    nan_row = tl.max(tl.where(ok & (x != x), 1, 0), axis=0) > 0
    x = tl.where(nan_row & ok, float("inf"), x)
    e = tl.where(ok, tl.exp(x - tl.max(x, axis=0)), 0.0)
    weights, ids = _top_k(x, e / tl.sum(e, axis=0), ok, K, BLOCK_K, BLOCK_E)
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    _store_choice(weights * scaling, ids, row, weights_ptr, ids_ptr, mark_ptr, K, BLOCK_K, MARK)


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool, scaling: float = 1.0,
                 mark: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """mox.kernels.routing.softmax_topk (then times `scaling`) in one kernel: weights `[T, k]`
    f32 and ids `[T, k]` int32 from router logits `[T, E]`, the experts chosen by their logits
    (the probabilities' order; equal logits go to the lower id, as top_k's; two logits so
    close that their probabilities round equal go to the larger, where top_k takes the
    lower id). `mark [E]` (int32): set to 1 where some token chose the expert."""
    assert logits.is_cuda or is_interpreter(), "Triton needs CUDA tensors (or TRITON_INTERPRET=1)"
    num_tokens, num_experts = logits.shape
    assert logits.stride(1) == 1 and 0 < k <= num_experts, (logits.shape, k)
    assert mark is None or (mark.shape == (num_experts,) and mark.dtype == torch.int32)
    weights = torch.empty(num_tokens, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        _softmax_topk_kernel[(num_tokens,)](
            logits, weights, ids, ids if mark is None else mark, num_experts, logits.stride(0),
            scaling, K=k, BLOCK_K=triton.next_power_of_2(k),
            BLOCK_E=triton.next_power_of_2(num_experts), RENORM=renormalize,
            MARK=mark is not None)
    return weights, ids


@triton.jit
def _sigmoid_grouped_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, mark_ptr, stride_l,
                            scaling, GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                            KEEP_GROUPS: tl.constexpr, K: tl.constexpr,
                            BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                            RENORM: tl.constexpr, MARK: tl.constexpr):
    num_experts: tl.constexpr = GROUPS * GROUP_SIZE
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, num_experts)
    scores = tl.sigmoid(tl.load(logits_ptr + row * stride_l + offs).to(tl.float32))
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + offs).to(tl.float32)
    # a group's score: its best two choices (ties to the lower id, then the next)
    grouped = tl.reshape(choice, (GROUPS, GROUP_SIZE))
    column = tl.arange(0, GROUP_SIZE)[None, :]
    first = tl.max(grouped, axis=1)
    at = tl.min(tl.where(grouped == first[:, None], column, GROUP_SIZE), axis=1)
    second = tl.max(tl.where(column == at[:, None], float("-inf"), grouped), axis=1)
    group_score = first + second
    group_ids = tl.arange(0, GROUPS)
    left_groups = group_ids >= 0
    kept = group_ids < 0
    for _ in tl.static_range(KEEP_GROUPS):
        best = _lowest_max(group_score, group_ids, left_groups, GROUPS)
        kept = kept | (group_ids == best)
        left_groups = left_groups & (group_ids != best)
    in_kept = tl.reshape(tl.broadcast_to(kept[:, None], (GROUPS, GROUP_SIZE)), (num_experts,))
    weights, ids = _top_k(choice, scores, in_kept, K, BLOCK_K, num_experts)
    if RENORM:
        weights = weights / (tl.sum(weights, axis=0) + RENORM_EPS)
    _store_choice(weights * scaling, ids, row, weights_ptr, ids_ptr, mark_ptr, K, BLOCK_K, MARK)


def takes_sigmoid_grouped(num_experts: int, n_group: int) -> bool:
    """Whether `sigmoid_grouped_topk` takes this grouping (power-of-two groups and sizes)."""
    size = num_experts // n_group
    return (num_experts % n_group == 0 and size >= 2 and size == triton.next_power_of_2(size)
            and n_group == triton.next_power_of_2(n_group))


def sigmoid_grouped_topk(logits: torch.Tensor, k: int, correction_bias: torch.Tensor | None,
                         n_group: int, topk_group: int, renormalize: bool, scaling: float,
                         mark: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """mox.kernels.routing.sigmoid_grouped_topk (DeepSeek-V3 / GLM4-MoE) in one kernel: the
    same experts and weights, in the order chosen (the torch path's order is unspecified);
    ties to the lower id. `mark` as `softmax_topk`'s."""
    assert logits.is_cuda or is_interpreter(), "Triton needs CUDA tensors (or TRITON_INTERPRET=1)"
    num_tokens, num_experts = logits.shape
    assert takes_sigmoid_grouped(num_experts, n_group) and logits.stride(1) == 1
    assert 0 < topk_group <= n_group and 0 < k <= topk_group * (num_experts // n_group)
    weights = torch.empty(num_tokens, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        _sigmoid_grouped_kernel[(num_tokens,)](
            logits, logits if correction_bias is None else correction_bias, weights, ids,
            ids if mark is None else mark, logits.stride(0), scaling, GROUPS=n_group,
            GROUP_SIZE=num_experts // n_group, KEEP_GROUPS=topk_group, K=k,
            BLOCK_K=triton.next_power_of_2(k), HAS_BIAS=correction_bias is not None,
            RENORM=renormalize, MARK=mark is not None)
    return weights, ids


def takes_rope(rotary_dim: int) -> bool:
    """Whether `rope_kv` takes these rotary dims (its halves a power of two wide)."""
    half = rotary_dim // 2
    return rotary_dim % 2 == 0 and half > 0 and half == triton.next_power_of_2(half)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, width, eps, stride_x, stride_r,
                     stride_s, stride_o, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < width
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        x = (x + r).to(sum_ptr.dtype.element_ty)        # rounded as torch's add rounds
        tl.store(sum_ptr + row * stride_s + offs, x, mask=ok)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty),
             mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x `[T, N]` (rows contiguous) -> its RMSNorm `[T, N]`; with `residual`, `(x + residual,
    its RMSNorm)`."""
    assert x.is_cuda or is_interpreter(), "Triton needs CUDA tensors (or TRITON_INTERPRET=1)"
    assert x.dim() == 2 and x.stride(1) == 1 and weight.shape == (x.shape[1],), \
        (x.shape, x.stride(), weight.shape)
    out = torch.empty_like(x)
    summed = out if residual is None else torch.empty_like(x)
    r = x if residual is None else residual
    assert r.shape == x.shape and r.stride(1) == 1
    _rms_norm_kernel[(x.shape[0],)](
        x, r, weight, summed, out, x.shape[1], eps, x.stride(0), r.stride(0), summed.stride(0),
        out.stride(0), RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(x.shape[1]))
    return out if residual is None else (summed, out)


@triton.jit
def _rotate(x_ptr, head, offs, cos, sin, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """A head's rotary dims as (a, b) halves rotated: (a cos - b sin, b cos + a sin), where
    (a, b) are the first and second halves, or the even and odd dims when interleaved."""
    if INTERLEAVED:
        a = tl.load(x_ptr + head + 2 * offs).to(tl.float32)
        b = tl.load(x_ptr + head + 2 * offs + 1).to(tl.float32)
    else:
        a = tl.load(x_ptr + head + offs).to(tl.float32)
        b = tl.load(x_ptr + head + HALF + offs).to(tl.float32)
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr,
                    keys_ptr, values_ptr, kv_offsets_ptr, stride_qt, stride_qh, stride_kt,
                    stride_kh,
                    stride_vt, stride_vh, stride_cos, stride_ot, stride_oh, stride_kn,
                    stride_kg, stride_vn, stride_vg, HEADS: tl.constexpr,
                    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr,
                    HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_REST: tl.constexpr,
                    BLOCK_V: tl.constexpr, ANCHORED: tl.constexpr):
    """One program per (token, head) of the h + h_kv heads: q heads rotate into q_out, key
    heads rotate into the store (their values copied beside them)."""
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if ANCHORED:                          # the store where it is now, from fixed anchors
        keys_ptr += tl.multiple_of(tl.load(kv_offsets_ptr), 16)     # (as KVAnchor checks)
        values_ptr += tl.multiple_of(tl.load(kv_offsets_ptr + 1), 16)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + offs)
    sin = tl.load(sin_ptr + pos * stride_cos + offs)
    rest = 2 * HALF + tl.arange(0, BLOCK_REST)            # dims past the rotary ones
    rest_ok = rest < HEAD_DIM
    if head < HEADS:
        src = q_ptr + token * stride_qt + head * stride_qh
        dst = q_out_ptr + token * stride_ot + head * stride_oh
    else:
        g = head - HEADS
        src = k_ptr + token * stride_kt + g * stride_kh
        slot = tl.load(slot_ptr + token).to(tl.int64)
        dst = keys_ptr + slot * stride_kn + g * stride_kg
        offs_v = tl.arange(0, BLOCK_V)
        v = tl.load(v_ptr + token * stride_vt + g * stride_vh + offs_v,
                    mask=offs_v < VALUE_DIM, other=0.0)
        tl.store(values_ptr + slot * stride_vn + g * stride_vg + offs_v, v,
                 mask=offs_v < VALUE_DIM)
    lo, hi = _rotate(src, 0, offs, cos, sin, HALF, INTERLEAVED)
    tl.store(dst + offs, lo.to(dst.dtype.element_ty))
    tl.store(dst + HALF + offs, hi.to(dst.dtype.element_ty))
    kept = tl.load(src + rest, mask=rest_ok, other=0.0)
    tl.store(dst + rest, kept, mask=rest_ok)


def rope_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, positions: torch.Tensor, rotary_dim: int, interleaved: bool,
            keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
            kv_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """q `[T, h, d]`, k `[T, h_kv, d]`, v `[T, h_kv, dv]` (heads may be views of one qkv row);
    `cos`, `sin` `[P, r]` the rotary tables, read at `positions [T]`. Rotated k and v go to
    `keys [S, h_kv, d]` and `values [S, h_kv, dv]` at `slots [T]`; returns rotated q `[T, h,
    d]` (contiguous). `kv_offsets`: as decode attention's (mox.kernels.attention_triton),
    the store that many elements past `keys` and `values`."""
    assert q.is_cuda or is_interpreter(), "Triton needs CUDA tensors (or TRITON_INTERPRET=1)"
    num_tokens, heads, dim = q.shape
    kv_heads, value_dim = k.shape[1], v.shape[2]
    assert takes_rope(rotary_dim), rotary_dim
    half = rotary_dim // 2
    assert k.shape == (num_tokens, kv_heads, dim) and v.shape[:2] == (num_tokens, kv_heads)
    for t in (q, k, v, keys, values, cos, sin):
        assert t.stride(-1) == 1, "rows contiguous in their last dim"
    assert positions.shape == slots.shape == (num_tokens,)
    q_out = torch.empty(num_tokens, heads, dim, dtype=q.dtype, device=q.device)
    if num_tokens:
        _rope_kv_kernel[(num_tokens, heads + kv_heads)](
            q, k, v, cos, sin, positions, slots, q_out, keys, values,
            keys if kv_offsets is None else kv_offsets,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), q_out.stride(0), q_out.stride(1), keys.stride(0), keys.stride(1),
            values.stride(0), values.stride(1), HEADS=heads, KV_HEADS=kv_heads,
            HEAD_DIM=dim, VALUE_DIM=value_dim, HALF=half, INTERLEAVED=interleaved,
            BLOCK_REST=triton.next_power_of_2(max(dim - rotary_dim, 1)),
            BLOCK_V=triton.next_power_of_2(value_dim), ANCHORED=kv_offsets is not None)
    return q_out
