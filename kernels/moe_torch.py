"""Fused MoE on CPU (and the fallback anywhere): sort the (token, expert) pairs by slot, run
each slot's contiguous block of rows through its expert, weight the rows, and scatter-add them
into the output once.

Legend: T tokens, k experts per token, P = T*k pairs, E logical experts, S slots,
H hidden, I intermediate.

How the per-slot GEMMs run, picked by how many rows an expert gets on average:
- a few rows each (decode) on a CPU with the native kernels: one call for all of a layer's
  experts and rows (mox.kernels.native.moe_experts; bf16 or quantized pools);
- few rows (decode, short prefills) over a densely used slot range:
  `torch.nn.functional.grouped_mm` over that range at once, where this torch has it on this
  device; one call replaces many Python-level matmuls;
- many rows: one `torch.mm` per slot into preallocated buffers, which on CPU beats grouped_mm
  once each expert has a few hundred rows (measured: bench/results/kernels_cpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import native
from .activation import SILU, Activation
from .moe_reference import NOT_RESIDENT, SILU_ACTIVATION
from .quant import INT8_PER_CHANNEL, ExpertScales, dequantize_experts

# Above this many rows per active expert the per-slot loop wins over grouped_mm on CPU.
GROUPED_MM_MAX_ROWS_PER_EXPERT = 128
# torch's CPU grouped_mm visits every group, empty or not (a few small ops each): it pays only
# when most slots of the range it is given are in use.
GROUPED_MM_MIN_ACTIVE_FRACTION = 0.5
# Int8 experts up to this many rows each go through torch's int8 weight-only GEMM; above it
# dequantizing to bf16 then one GEMM wins (bench/results/quant_kernels.md).
INT8PACK_MAX_ROWS_PER_EXPERT = 128
INT8PACK_K_MULTIPLE = 16
# grouped_mm needs every operand's row stride a multiple of 16 bytes
GROUPED_MM_ALIGN_BYTES = 16


@dataclass
class MoEWorkspace:
    """Reused buffers, grown on demand: fresh multi-MB tensors cost page faults every call
    (~3 GB/s into fresh memory against ~15 GB/s into reused). Owned by one caller, one
    call at a time."""

    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    # the last view handed out per name: decode asks for the same shapes step after step
    views: dict[str, tuple[tuple, torch.Tensor]] = field(default_factory=dict)

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        key = rows, cols, dtype, device
        last = self.views.get(name)
        if last is not None and last[0] == key:
            return last[1]
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < rows * cols or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(rows * cols, 1), dtype=dtype, device=device)
            self.buffers[name] = buf
        view = buf[:rows * cols].view(rows, cols)
        self.views[name] = key, view
        return view


def _has_grouped_mm(x: torch.Tensor, experts: _Experts) -> bool:
    align = GROUPED_MM_ALIGN_BYTES // x.element_size()
    return (hasattr(F, "grouped_mm") and x.device.type == "cpu"
            and x.shape[1] % align == 0 and experts.inter % align == 0)


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, slot_of: torch.Tensor,
                    workspace: MoEWorkspace | None = None,
                    out_dtype: torch.dtype | None = None,
                    activation: Activation = SILU_ACTIVATION, b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None,
                    scales: ExpertScales | None = None) -> torch.Tensor:
    """`out_dtype` (default x's): float32 keeps the fp32 sum unrounded, for a caller that
    adds several calls (waves) and must round once to get the same result as one call.
    `b13 [S, 2I]`, `b2 [S, H]`: expert biases, added before the activation and before the
    routing weight. `scales`: the pool is quantized (mox.kernels.quant); int8 per channel,
    int4 and MXFP4 per group and FP8 per block go through the native kernel for decode, int8
    through torch's int8 GEMM up to a few dozen rows an expert, the rest is dequantized
    first."""
    out_dtype = out_dtype or x.dtype
    experts = _Experts(w13, w2, activation, b13, b2, scales)
    ws = workspace or MoEWorkspace()
    native_experts = native.takes_experts(x, w13, w2, scales, b13, b2)
    if scales is not None and not native_experts and (
            topk_ids.shape[0] == 1 or scales.fmt != INT8_PER_CHANNEL):   # (int8: see below)
        return _dequantized(x, experts, topk_weights, topk_ids, slot_of, ws, out_dtype)
    if topk_ids.shape[0] == 1:
        slot_list = slot_of.tolist()        # (host lists: cheaper than indexing a tensor)
        slots = [slot_list[expert] for expert in topk_ids[0].tolist()]
        if native_experts:
            return _native_one_token(x, experts, topk_weights[0], slots, ws).to(out_dtype)
        return _one_token(x, experts, topk_weights, slots).to(out_dtype)
    num_tokens, k = topk_ids.shape
    num_slots, hidden = w2.shape[:2]
    slots = slot_of[topk_ids.long()].reshape(-1)                          # [P]
    order = torch.argsort(slots, stable=True)                             # [P] NOT_RESIDENT first
    counts = torch.bincount(slots + 1, minlength=num_slots + 1)           # [S+1], [0]: absent
    num_per_slot = counts.tolist()                                        # the one host sync
    order = order[num_per_slot[0]:]                                       # [P'] resident pairs
    counts, num_per_slot = counts[1:], num_per_slot[1:]                   # [S]
    token_of = order // k                                                 # [P']
    num_rows = order.numel()
    rows = ws.get("rows", num_rows, hidden, x.dtype, x.device)
    torch.index_select(x, 0, token_of, out=rows)                          # [P', H] gathered
    active = [slot for slot, n in enumerate(num_per_slot) if n]
    lo, hi = (active[0], active[-1] + 1) if active else (0, 0)
    if native_experts and num_rows <= native.max_rows_per_expert() * len(active):
        contrib = _native_experts(rows, experts, [(s, num_per_slot[s]) for s in active],
                                  topk_weights.reshape(-1)[order], ws)
        out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
        out.index_add_(0, token_of, contrib)
        return out.to(out_dtype)
    if scales is not None:            # prefill rows: the GEMMs' arithmetic dominates
        if not _takes_int8pack(x, experts, num_rows, len(active)):
            return _dequantized(x, experts, topk_weights, topk_ids, slot_of, ws, out_dtype)
        down = _int8pack_experts(rows, experts, [(s, num_per_slot[s]) for s in active], ws)
    elif (_has_grouped_mm(x, experts) and len(active) >= GROUPED_MM_MIN_ACTIVE_FRACTION * (hi - lo)
            and num_rows <= GROUPED_MM_MAX_ROWS_PER_EXPERT * max(len(active), 1)):
        # only the slot range in use: rows are sorted by slot, so its offsets line up
        row_slots = slots[order] if experts.has_bias else None                # [P']
        down = _grouped_experts(rows, experts, lo, hi, counts[lo:hi], row_slots)
    else:
        down = _looped_experts(rows, experts, [(s, num_per_slot[s]) for s in active], ws)
    contrib = ws.get("contrib", num_rows, hidden, torch.float32, x.device)
    # fp32 accumulation: k bf16 contributions summed in bf16 lose ~3 bits each
    torch.mul(down, topk_weights.reshape(-1)[order, None], out=contrib)
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, contrib)
    return out.to(out_dtype)


@dataclass(frozen=True)
class _Experts:
    """The slot pool as one call sees it."""

    w13: torch.Tensor                    # [S, 2I, H]
    w2: torch.Tensor                     # [S, H, I]
    activation: Activation
    b13: torch.Tensor | None = None      # [S, 2I]
    b2: torch.Tensor | None = None       # [S, H]
    scales: ExpertScales | None = None   # w13, w2 stored quantized

    @property
    def has_bias(self) -> bool:
        return self.b13 is not None

    @property
    def inter(self) -> int:
        return self.w13.shape[1] // 2        # (w2's last dim is stored: I / 2 for int4)


def _one_token(x: torch.Tensor, experts: _Experts, topk_weights: torch.Tensor,
               slots: list[int]) -> torch.Tensor:
    """Decode of one sequence: k matrix-vector products, none of the sorting machinery;
    `[1, H]` float32."""
    inter = experts.inter
    out = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)      # [H]
    for slot, weight in zip(slots, topk_weights[0].tolist()):
        if slot == NOT_RESIDENT:
            continue
        gate_up = _mv(experts.w13[slot], x[0])                               # [2I]
        if experts.has_bias:
            gate_up = gate_up + experts.b13[slot]
        act = experts.activation(gate_up[:inter], gate_up[inter:])           # [I]
        down = _mv(experts.w2[slot], act)                                    # [H]
        if experts.has_bias:
            down = down + experts.b2[slot]
        out.add_(down.float(), alpha=weight)
    return out[None]                                                         # [1, H]


def _dequantized(x: torch.Tensor, experts: _Experts, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, slot_of: torch.Tensor, ws: MoEWorkspace,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Quantized experts through the paths above: the slots this call reads, dequantized (by
    the reference definition) into a compact pool of x's dtype, the slot map renumbered."""
    used = slot_of[topk_ids.long()].unique()
    used = used[used != NOT_RESIDENT].long()                              # [A]
    remap = torch.full((experts.w13.shape[0] + 1,), NOT_RESIDENT, dtype=torch.int32,
                       device=x.device)
    remap[used + 1] = torch.arange(used.numel(), dtype=torch.int32, device=x.device)
    w13, w2 = dequantize_experts(experts.w13, experts.w2, experts.scales, used, x.dtype)
    b13, b2 = (None, None) if not experts.has_bias else (experts.b13[used], experts.b2[used])
    return fused_moe_torch(x, w13, w2, topk_weights, topk_ids, remap[slot_of.long() + 1], ws,
                           out_dtype, experts.activation, b13, b2)


def _takes_int8pack(x: torch.Tensor, experts: _Experts, num_rows: int,
                    num_active: int) -> bool:
    """torch's int8 weight-only CPU GEMM serves int8-per-channel experts of a few dozen rows
    each (bench/results/quant_kernels.md: at 64 rows 0.49x bf16's speed, dequantizing 0.37x;
    at 256 dequantizing wins)."""
    return (experts.scales.fmt == INT8_PER_CHANNEL and x.device.type == "cpu"
            and x.dtype == torch.bfloat16 and not experts.has_bias
            and experts.activation.kind == SILU and hasattr(torch, "_weight_int8pack_mm")
            and num_rows <= INT8PACK_MAX_ROWS_PER_EXPERT * num_active
            # (torch 2.13's kernel reads past a row of two or more whose length is not a
            # multiple of 16: the process died of SIGSEGV)
            and experts.w13.shape[2] % INT8PACK_K_MULTIPLE == 0
            and experts.inter % INT8PACK_K_MULTIPLE == 0)


def _int8pack_experts(rows: torch.Tensor, experts: _Experts, runs: list[tuple[int, int]],
                      ws: MoEWorkspace) -> torch.Tensor:
    """`runs`: (slot, number of rows) of each active slot, in row order -> `[P', H]`."""
    num_slots, inter = experts.w13.shape[0], experts.inter
    scale13 = experts.scales.w13.reshape(num_slots, 2 * inter)            # [S, 2I]
    scale2 = experts.scales.w2.reshape(num_slots, -1)                      # [S, H]
    down = ws.get("down", rows.shape[0], scale2.shape[1], rows.dtype, rows.device)
    start = 0
    for slot, length in runs:
        end = start + length
        gate_up = torch._weight_int8pack_mm(rows[start:end], experts.w13[slot],
                                            scale13[slot].to(rows.dtype))
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down[start:end] = torch._weight_int8pack_mm(act, experts.w2[slot],
                                                    scale2[slot].to(rows.dtype))
        start = end
    return down


def _native_one_token(x: torch.Tensor, experts: _Experts, weights: torch.Tensor,
                      slots: list[int], ws: MoEWorkspace) -> torch.Tensor:
    """Decode of one sequence in one native call: its row once per resident expert;
    `[1, H]` float32."""
    # (summed in slot order, as the rows of several tokens are and csrc/moe_block.c sums)
    resident = sorted((j for j, slot in enumerate(slots) if slot != NOT_RESIDENT),
                      key=slots.__getitem__)
    if not resident:
        return torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)
    rows = ws.get("rows", len(resident), x.shape[1], x.dtype, x.device)
    rows.copy_(x.expand(len(resident), x.shape[1]))
    if resident != list(range(len(slots))):
        weights = weights[resident]
    down = _native_experts(rows, experts, [(slots[j], 1) for j in resident], weights, ws)
    return down.sum(0, keepdim=True)


def _native_experts(rows: torch.Tensor, experts: _Experts, runs: list[tuple[int, int]],
                    row_weights: torch.Tensor, ws: MoEWorkspace) -> torch.Tensor:
    """The native kernel over every active slot at once (`runs`: (slot, number of rows) of
    each, in row order): `[P', H]` f32, rows weighted."""
    num_rows, hidden, inter = rows.shape[0], rows.shape[1], experts.inter
    scratch = [ws.get("gate_up", num_rows, 2 * inter, torch.float32, rows.device),
               ws.get("act", num_rows, inter, torch.bfloat16, rows.device),
               ws.get("contrib", num_rows, hidden, torch.float32, rows.device)]
    return native.kernels().moe_experts(rows, experts.w13, experts.w2, runs, row_weights,
                                        scratch, scales=experts.scales,
                                        activation=experts.activation, b13=experts.b13,
                                        b2=experts.b2)


def _mv(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """w @ v, through the native kernel where it serves (bf16 on a CPU with AVX512-BF16)."""
    if native.takes(v[None], w):
        return native.gemv_bf16(v[None], w)[0]
    return torch.mv(w, v)


def _grouped_experts(rows: torch.Tensor, experts: _Experts, lo: int, hi: int,
                     counts: torch.Tensor, row_slots: torch.Tensor | None) -> torch.Tensor:
    """Slots [lo, hi) in two grouped GEMMs; `row_slots` `[P']`: each row's slot (biases)."""
    inter = experts.inter
    offsets = counts.cumsum(0).to(torch.int32)                            # [S] group ends
    gate_up = F.grouped_mm(rows, experts.w13[lo:hi].transpose(1, 2), offs=offsets)  # [P', 2I]
    if row_slots is not None:
        gate_up += experts.b13[row_slots]
    act = experts.activation(gate_up[:, :inter], gate_up[:, inter:])      # [P', I]
    down = F.grouped_mm(act, experts.w2[lo:hi].transpose(1, 2), offs=offsets)       # [P', H]
    if row_slots is not None:
        down += experts.b2[row_slots]
    return down


def _looped_experts(rows: torch.Tensor, experts: _Experts, runs: list[tuple[int, int]],
                    ws: MoEWorkspace) -> torch.Tensor:
    """`runs`: (slot, number of rows) of each active slot, in row order."""
    w13, w2 = experts.w13, experts.w2
    num_rows, inter, hidden = rows.shape[0], w2.shape[2], w2.shape[1]
    gate_up = ws.get("gate_up", num_rows, 2 * inter, rows.dtype, rows.device)
    act = ws.get("act", num_rows, inter, rows.dtype, rows.device)
    down = ws.get("down", num_rows, hidden, rows.dtype, rows.device)
    start = 0
    for slot, length in runs:
        end = start + length
        torch.mm(rows[start:end], w13[slot].t(), out=gate_up[start:end])
        if experts.has_bias:
            gate_up[start:end] += experts.b13[slot]
        if experts.activation.kind == SILU:
            torch.mul(F.silu(gate_up[start:end, :inter]), gate_up[start:end, inter:],
                      out=act[start:end])
        else:
            act[start:end] = experts.activation(gate_up[start:end, :inter],
                                                gate_up[start:end, inter:])
        torch.mm(act[start:end], w2[slot].t(), out=down[start:end])
        if experts.has_bias:
            down[start:end] += experts.b2[slot]
        start = end
    return down
