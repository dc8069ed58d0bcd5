"""The CPU decode kernels of `csrc/` (bf16_gemv.c, moe_experts.c, decode_attention.c,
rms_norm.c, rope_kv.c, attention_block.c, moe_block.c, decode_layers.c), built at first use
(`native_build`) and called through ctypes.

A decode step on a CPU reads every weight it touches once for a few rows of activations; the
GEMMs torch dispatches to for that shape read bf16 weights at about half this machine's rate
(bench/results/read_rate.md). `gemv_bf16(x, w)` reads `w` in place at the full rate;
`moe_experts` reads a MoE layer's experts so, bf16, int8, int4, MXFP4 or FP8 (a half or a
quarter of the bytes).

The shared library is compiled with the system C compiler into a per-user cache, keyed by the
sources' hash; without a compiler or a writable cache, on a CPU without AVX2 + FMA, or with
`MOX_NATIVE_KERNELS=0`, the `takes*` checks say no and callers keep torch's paths. The plain-C
path of the same library (`fast=False`) exists so tests can check the arithmetic anywhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import itertools
import os
import time

import torch

from .activation import Activation
from .native_attention import AttentionLayer, check_step
from .native_build import SOURCE_DIR, build
from .native_moe import (
    C_KINDS,
    K_MULTIPLE,
    QUANT_BLOCK,
    SCORINGS,
    SILU_GATE,
    MoELayer,
    PoolStruct,
    check_experts,
    check_pools,
    gating,
    native_format,
    pool_structs,
)
from .native_step import DecodeChain, DecodeRows, StepLayers, StepTail, check_layers_step
from .quant import FP8, ExpertScales

ISA_NAMES = ("plain", "avx2", "avx512bf16")    # bf16.h's ISA_* codes
# Rows of x up to which each vector path beats torch's GEMMs, for `linear` and per expert
# for `moe_experts`: with AVX512-BF16 torch's oneDNN bf16 GEMM wins beyond a few rows; on an
# AVX2 CPU torch has no fast bf16 GEMM and the native loops won at every size measured
# (bench/results/read_rate_avx2.md: 2-3x at 8-128 rows; kernels_cpu_avx2.md: 2.8x at 1024
# tokens, 64 rows an expert). With AVX512-BF16 (AMD EPYC Zen 4, no AMX) the 4 x 4 tiles
# matched oneDNN's bf16 GEMM at 64 rows and beat it below (1.3x at 16).
GEMV_MAX_ROWS = 1024    # bf16_gemv.c's MAX_GEMV_ROWS
MAX_ROWS = {"avx512bf16": 64, "avx2": GEMV_MAX_ROWS}
MAX_ROWS_PER_EXPERT = {"avx512bf16": 64, "avx2": 1 << 30}
OUT_F32, OUT_BF16 = 0, 1       # mox_gemv_bf16's outputs (csrc/exported.h)
# csrc/timeline.h's phases, in its order
TIMELINE_PHASES = ("qkv", "qk_norm", "rope", "attend", "out", "router", "route", "experts",
                   "combine", "tail", "calls")
# Set by `torch_paths()`: benchmarks compare against the path this module replaces in one run.
_OFF = contextvars.ContextVar("mox_native_off", default=False)


class NativeKernels:
    def __init__(self, path: str) -> None:
        self._lib = ctypes.CDLL(path)
        gemv = self._lib.mox_gemv_bf16
        gemv.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                         ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                         ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        gemv.restype = ctypes.c_int
        self._gemv = gemv
        moe = self._lib.mox_moe_experts_bf16
        moe.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                         ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64,
                         ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3
                        + [ctypes.c_int])
        moe.restype = ctypes.c_int
        self._moe = moe
        self._pools_checked: list = []     # see check_experts
        moe_q = self._lib.mox_moe_experts_quantized
        moe_q.argtypes = ([ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p, ctypes.c_int64] * 4
                          + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int64,
                          ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
                          + [ctypes.c_void_p] * 3 + [ctypes.c_int])
        moe_q.restype = ctypes.c_int
        self._moe_quantized = moe_q
        attend = self._lib.mox_decode_attention_bf16
        attend.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
                           + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3
                           + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64,
                                                     ctypes.c_void_p, ctypes.c_int])
        attend.restype = ctypes.c_int
        self._attend = attend
        norm = self._lib.mox_rms_norm_bf16
        norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
        norm.restype = ctypes.c_int
        self._norm = norm
        rope = self._lib.mox_rope_kv_bf16
        rope.argtypes = ([ctypes.c_void_p, ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2
                         + [ctypes.c_int64] * 7 + [ctypes.c_int] + [ctypes.c_void_p] * 3
                         + [ctypes.c_int64])
        rope.restype = ctypes.c_int
        self._rope = rope
        block = self._lib.mox_attention_block_bf16
        block.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2
                          + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64]
                          + [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 4)
        block.restype = ctypes.c_int
        self._block = block
        moe_block = self._lib.mox_moe_block_bf16
        moe_block.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int64, PoolStruct, PoolStruct] + [ctypes.c_void_p] * 5)
        moe_block.restype = ctypes.c_int
        self._moe_block = moe_block
        layers = self._lib.mox_decode_layers_bf16
        layers.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 2
                           + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
                           + [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 2
                           + [ctypes.c_int64, PoolStruct, PoolStruct] + [ctypes.c_void_p] * 6)
        layers.restype = ctypes.c_int64
        self._decode_layers = layers
        route = self._lib.mox_route_bf16
        route.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
                          + [ctypes.c_float] + [ctypes.c_void_p] * 2)
        route.restype = ctypes.c_int
        self._route = route
        take = self._lib.mox_timeline_take
        take.argtypes = [ctypes.c_void_p, ctypes.c_int]
        take.restype = ctypes.c_int
        self._timeline_take = take
        self._timeline_now = self._lib.mox_timeline_now
        self._timeline_now.restype = ctypes.c_uint64
        self._timeline_hz: float | None = None
        # the vector path `fast` calls take: AVX512-BF16, else AVX2 + FMA (weights widened to
        # float32 in registers; integer experts through AVX512-VNNI where the CPU has it, else
        # AVX2's two-step byte dot)
        self.isa = ISA_NAMES[self._lib.mox_vector_isa()]
        self.fast = self.isa != "plain"
        # AVX512-BF16 GEMVs and experts of 4 rows and more on AMX tiles (csrc/amx_tiles.h;
        # an older build, a bench's base, has no such path)
        has_amx = getattr(self._lib, "mox_has_amx", None)
        self.amx = self.isa == "avx512bf16" and has_amx is not None and bool(has_amx())

    def timeline_take(self) -> dict[str, float] | None:
        """Seconds per phase of the native decode calls since the last take (`calls`: their
        number), then zeroed; None in a library built without the timeline."""
        cycles = (ctypes.c_uint64 * len(TIMELINE_PHASES))()
        if self._timeline_take(cycles, len(cycles)) != len(cycles):
            return None
        if self._timeline_hz is None:          # the TSC's rate, against the wall clock
            start, tsc = time.perf_counter(), self._timeline_now()
            while time.perf_counter() - start < 0.1:
                pass
            self._timeline_hz = (self._timeline_now() - tsc) / (time.perf_counter() - start)
        taken = {phase: n / self._timeline_hz for phase, n in zip(TIMELINE_PHASES, cycles)}
        taken["calls"] = cycles[-1]
        return taken

    def gemv(self, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = torch.float32,
             fast: bool = True) -> torch.Tensor:
        """`x [M, K]` bf16 (M <= GEMV_MAX_ROWS), `w [N, K]` bf16 with unit stride along K ->
        `[M, N]` in `out_dtype` (float32, or bfloat16 rounded once from the fp32 sums)."""
        if (x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.stride(1) != 1
                or w.stride(1) != 1 or w.shape[1] != x.shape[1]
                or out_dtype not in (torch.float32, torch.bfloat16)):
            raise ValueError(f"gemv_bf16 takes bf16 rows with unit stride, got x "
                             f"{tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
        return self._gemv_checked(x, w, out_dtype, fast)

    def _gemv_checked(self, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
                      fast: bool) -> torch.Tensor:
        """`gemv` for arguments already checked (by `gemv`, or by `takes` on the hot path)."""
        (num_rows, k), n = x.shape, w.shape[0]
        out = torch.empty(num_rows, n, dtype=out_dtype)
        status = self._gemv(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0),
                            out.data_ptr(), out.stride(0), num_rows, n, k,
                            OUT_BF16 if out_dtype == torch.bfloat16 else OUT_F32, int(fast))
        if status == -2:
            raise MemoryError("gemv_bf16 could not widen its rows")
        if status != 0:
            raise ValueError(f"gemv_bf16 refused M={num_rows} N={n} K={k} fast={fast}")
        return out

    def moe_experts(self, rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    runs: list[tuple[int, int]], row_weights: torch.Tensor,
                    scratch: list[torch.Tensor], fast: bool = True,
                    scales: ExpertScales | None = None, activation: Activation = SILU_GATE,
                    b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None) -> torch.Tensor:
        """Gated experts for rows grouped by slot: `rows [P, H]` bf16, slot pools
        `w13 [S, 2I, H]`, `w2 [S, H, I]` (contiguous per slot), bf16, or stored as `scales`
        says (int8 per channel, int4 or MXFP4 in groups: met by activations quantized to int8
        in blocks of QUANT_BLOCK; FP8 in blocks: met by the bf16 rows); `activation` SiLU or
        GPT-OSS's clamped SwiGLU, with optional bf16 biases `b13 [S, 2I]`, `b2 [S, H]`;
        `runs`: (slot, number of rows) of each active slot, in row order; `row_weights [P]`
        float32; `scratch`: gate_up `[P, 2I]` f32, act `[P, I]` bf16 and the result
        `[P, H]` f32, each row scaled by its routing weight, which is returned."""
        check_experts(rows, w13, w2, scratch, scales, row_weights, self._pools_checked)
        hidden, inter = rows.shape[1], w13.shape[1] // 2
        slots, counts = zip(*runs) if runs else ((), ())
        if sum(counts) != rows.shape[0] or min(counts, default=0) < 0 or not (
                0 <= min(slots, default=0) and max(slots, default=0) < w13.shape[0]):
            raise ValueError("moe_experts' runs must cover its rows, in slots of its pools")
        gate_up, act, down = scratch
        if not runs:
            return down                                    # no rows: nothing to compute
        gates = gating(activation, b13, b2, w13.shape[0], hidden, inter)
        # slots, first rows, counts: int64 arrays the C code reads (no tensors built per call)
        num_active = len(runs)
        table = (ctypes.c_int64 * (3 * num_active))(
            *slots, *itertools.accumulate(counts[:-1], initial=0), *counts)
        slots_ptr, column = ctypes.addressof(table), ctypes.sizeof(ctypes.c_int64) * num_active
        if row_weights.dtype != torch.float32 or not row_weights.is_contiguous():
            row_weights = row_weights.to(torch.float32).contiguous()
        tail = (gates, slots_ptr, slots_ptr + column, slots_ptr + 2 * column,
                num_active, row_weights.data_ptr(), hidden, inter, gate_up.data_ptr(),
                act.data_ptr(), down.data_ptr(), int(fast))
        if scales is None:
            status = self._moe(rows.data_ptr(), w13.data_ptr(), w13.stride(0), w2.data_ptr(),
                               w2.stride(0), *tail)
        else:
            s13, s2 = scales.w13, scales.w2
            status = self._moe_quantized(
                rows.data_ptr(), C_KINDS[scales.fmt.kind], w13.data_ptr(), w13.stride(0),
                s13.data_ptr(), s13.stride(0), w2.data_ptr(), w2.stride(0), s2.data_ptr(),
                s2.stride(0), scales.fmt.block_cols, scales.fmt.block_rows, *tail)
        if status == -2:
            raise MemoryError("moe_experts could not allocate its quantized activations")
        if status != 0:
            raise ValueError(f"moe_experts refused H={hidden} I={inter} fast={fast}")
        return down

    def moe_block(self, layer: MoELayer, h: torch.Tensor, slot_of: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None = None,
                  activation: Activation = SILU_GATE, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, residual: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A decode MoE layer's routed experts (csrc/moe_block.c) for bf16 rows `h [T, H]`:
        the router's top-k weights `[T, k]` float32 and ids `[T, k]` int32, and, where every
        routed expert is resident (in `slot_of [E]` int32, among the pools' slots),
        `residual + experts(h)` `[T, H]` (the experts alone without `residual`), else None.
        Pools, scales, biases and `activation` as `moe_experts` takes them (callers check
        `takes_experts`)."""
        shape = layer.struct
        num_tokens, hidden, inter = h.shape[0], shape.hidden, shape.inter
        if (h.dim() != 2 or h.shape[1] != hidden or h.dtype != torch.bfloat16
                or not h.is_contiguous() or not 1 <= num_tokens <= GEMV_MAX_ROWS
                or any(t.device.type != "cpu" for t in (h, slot_of, w13, w2))):
            raise ValueError(f"moe_block takes 1 to {GEMV_MAX_ROWS} contiguous bf16 CPU rows "
                             f"of {hidden}, and CPU pools")
        if (slot_of.dtype != torch.int32 or slot_of.shape != (shape.experts,)
                or not slot_of.is_contiguous()):
            raise ValueError(f"moe_block takes a contiguous int32 slot map of {shape.experts}")
        if residual is not None and (residual.shape != h.shape or residual.dtype != h.dtype
                                     or not residual.is_contiguous()):
            raise ValueError("moe_block's residual must be laid out as its rows")
        check_pools(w13, w2, scales, hidden, inter, self._pools_checked)
        gates = gating(activation, b13, b2, w13.shape[0], hidden, inter)
        weights = torch.empty(num_tokens, shape.top_k, dtype=torch.float32)
        ids = torch.empty(num_tokens, shape.top_k, dtype=torch.int32)
        x_out = torch.empty_like(h)
        status = self._moe_block(ctypes.addressof(shape), h.data_ptr(), num_tokens,
                                 slot_of.data_ptr(), w13.shape[0], *pool_structs(w13, w2, scales),
                                 gates, weights.data_ptr(), ids.data_ptr(),
                                 None if residual is None else residual.data_ptr(),
                                 x_out.data_ptr())
        if status == -2:
            raise MemoryError("moe_block could not allocate its intermediates")
        if status < 0:
            raise ValueError(f"moe_block refused T={num_tokens} H={hidden} I={inter}")
        return weights, ids, (x_out if status == 0 else None)

    def decode_chain(self, step: StepLayers, x: torch.Tensor, h: torch.Tensor,
                     rows: DecodeRows, store: tuple[torch.Tensor, torch.Tensor],
                     w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None = None,
                     activation: Activation = SILU_GATE, b13: torch.Tensor | None = None,
                     b2: torch.Tensor | None = None, tail: StepTail | None = None
                     ) -> DecodeChain:
        """A batch's decode steps `rows` over the stream `x [T, H]` bf16, in place (the
        caller writes each next step's input rows into `x`): `chain(first, j)` runs step j's
        layers from `first` on (csrc/decode_layers.c: each layer's `attention_block` then
        `moe_block`) and returns where it stopped: every layer, or the first whose experts
        were not all resident (`x` then its stream after attention, `h [T, H]` its normed
        rows), the routing weights `[L, T, k]` float32 and ids `[L, T, k]` int32 of the
        layers it reached, and with a `tail`, where every layer ran, the logits `[T, V]`
        float32 (bf16 values) of the final norm and lm_head (else None). The attention
        arguments as `attention_block` takes them (`store`: the keys and values of a layer,
        the shape of every layer's, which `step` points to), the pools as `moe_block`."""
        keys, values = store
        num_tokens, num_layers = x.shape[0], len(step.moe)
        rows.check(num_tokens)
        cos, sin, slot_mapping, lengths = rows.step(0)
        check_layers_step(step, x, h, cos, sin, keys, values,
                          [slot_mapping, rows.starts, lengths, rows.kv_slots])
        shape = step.moe[0].struct
        if not 1 <= num_tokens <= GEMV_MAX_ROWS or w13.device.type != "cpu":
            raise ValueError(f"decode_layers takes 1 to {GEMV_MAX_ROWS} rows, and CPU pools")
        check_pools(w13, w2, scales, shape.hidden, shape.inter, self._pools_checked)
        gates = gating(activation, b13, b2, w13.shape[0], shape.hidden, shape.inter)
        weights = torch.empty(num_layers, num_tokens, shape.top_k, dtype=torch.float32)
        ids = torch.empty(num_layers, num_tokens, shape.top_k, dtype=torch.int32)
        residual = torch.empty_like(x)
        if tail is not None and tail.norm.shape[0] != x.shape[1]:
            raise ValueError("decode_layers' tail is for another hidden size")
        logits = (torch.empty(num_tokens, tail.lm_head.shape[0], dtype=torch.float32)
                  if tail is not None else None)
        pools = pool_structs(w13, w2, scales)
        steps = [(x.data_ptr(), h.data_ptr(), num_tokens, cos.data_ptr(), sin.data_ptr(),
                  cos.stride(0), keys.shape[0], slot_mapping.data_ptr(),
                  rows.kv_slots.data_ptr(), rows.kv_slots.shape[0], rows.starts.data_ptr(),
                  lengths.data_ptr(), w13.shape[0], *pools, gates, weights.data_ptr(),
                  ids.data_ptr(), residual.data_ptr(),
                  ctypes.addressof(tail.struct) if tail is not None else None,
                  logits.data_ptr() if logits is not None else None)
                 for cos, sin, slot_mapping, lengths in map(rows.step, range(rows.num_steps))]
        return DecodeChain(self._decode_layers, step.array, steps, (weights, ids, logits),
                           (step, x, h, rows, store, w13, w2, scales, b13, b2, tail, residual))

    def route(self, logits: torch.Tensor, k: int, scoring: str, renormalize: bool,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits `[T, E]` bf16 -> top-k weights `[T, k]` float32 and ids `[T, k]`
        int32, as `scoring` (a key of native_moe.SCORINGS) says: the routing `moe_block` does,
        for the Python block's bf16 routing on a CPU (prefill, prefetch, paged layers)."""
        if (logits.dim() != 2 or logits.dtype != torch.bfloat16 or not logits.is_contiguous()
                or scoring not in SCORINGS or not 0 < k <= logits.shape[1]):
            raise ValueError(f"route takes contiguous bf16 logits [T, E] and k <= E, got "
                             f"{tuple(logits.shape)} {logits.dtype}, k={k}, {scoring!r}")
        weights = torch.empty(logits.shape[0], k, dtype=torch.float32)
        ids = torch.empty(logits.shape[0], k, dtype=torch.int32)
        status = self._route(logits.data_ptr(), logits.shape[0], logits.shape[1], k,
                             SCORINGS[scoring], int(renormalize), scaling, weights.data_ptr(),
                             ids.data_ptr())
        if status == -2:
            raise MemoryError("route could not allocate its scores")
        if status != 0:
            raise ValueError(f"route refused k={k} of {logits.shape[1]} experts")
        return weights, ids

    def decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         slots: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                         scale: float, window: int | None, keys2: torch.Tensor | None = None,
                         fast: bool = True) -> torch.Tensor:
        """q `[T, h, d (+ d2)]` bf16; `keys [N, h_kv, d]`, `values [N, h_kv, dv]` (and
        `keys2 [N, h_kv, d2]`, a key's second part, cached apart: MLA's rotated key): the
        layer's store as flat slots; token t attends to the keys at
        `slots[starts[t]:starts[t] + lengths[t]]` (their last `window`) -> `[T, h, dv]` f32."""
        num_tokens, heads, _ = q.shape
        kv_heads, dim, value_dim = keys.shape[1], keys.shape[2], values.shape[2]
        second = keys if keys2 is None else keys2
        dim2 = 0 if keys2 is None else keys2.shape[2]
        for t in (q, keys, second, values):
            if t.dtype != torch.bfloat16 or t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
                raise ValueError("decode_attention takes bf16 rows contiguous per head")
        if q.shape[2] != dim + dim2:
            raise ValueError(f"q has {q.shape[2]} dims per head; the keys {dim} + {dim2}")
        slots, starts, lengths = (v.to(torch.int64).contiguous() for v in (slots, starts,
                                                                             lengths))
        out = torch.empty(num_tokens, heads, value_dim)
        status = self._attend(q.data_ptr(), q.stride(0), keys.data_ptr(), second.data_ptr(),
                              values.data_ptr(), keys.stride(0), second.stride(0),
                              values.stride(0), slots.data_ptr(), starts.data_ptr(),
                              lengths.data_ptr(), num_tokens, heads, kv_heads, dim, dim2,
                              value_dim, scale, window or 0, out.data_ptr(), int(fast))
        if status != 0:
            raise ValueError(f"decode_attention refused h={heads} h_kv={kv_heads} d={dim}")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of bf16 rows `x [T, D]` (unit stride) with `weight [D]`, as HF computes it
        (fp32 statistics, the normalized row rounded to bf16, then scaled)."""
        if (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.dim() != 2
                or x.stride(1) != 1 or weight.shape != (x.shape[1],) or weight.stride(0) != 1):
            raise ValueError("rms_norm takes bf16 rows with unit stride and a matching weight")
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if self._norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(),
                      out.stride(0), x.shape[0], x.shape[1], eps) != 0:
            raise ValueError(f"rms_norm refused {tuple(x.shape)}")
        return out

    def rope_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                tables: tuple[torch.Tensor, torch.Tensor], rotary_dim: int, interleaved: bool,
                keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Rotate q `[T, h, d]` and k `[T, h_kv, d]` (bf16) in place by their tokens' cos, sin
        `[T, 1, r]` (float32), as `Rotary.rotate` does, then store k and v `[T, h_kv, dv]` at
        flat `slots [T]` of a layer's `keys [N, h_kv, d]`, `values [N, h_kv, dv]`."""
        cos, sin = (t.reshape(t.shape[0], -1).contiguous() for t in tables)
        num_tokens, heads, dim = q.shape
        kv_heads, value_dim = k.shape[1], v.shape[2]
        for t in (q, k, v, keys, values):
            if t.dtype != torch.bfloat16 or t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
                raise ValueError("rope_kv takes bf16 rows contiguous per head")
        if (k.shape != (num_tokens, kv_heads, dim) or v.shape[:2] != (num_tokens, kv_heads)
                or keys.shape[1:] != k.shape[1:] or values.shape[1:] != v.shape[1:]
                or values.shape[0] != keys.shape[0] or not keys.is_contiguous()
                or not values.is_contiguous() or cos.shape != (num_tokens, rotary_dim)
                or sin.shape != cos.shape or cos.dtype != torch.float32
                or sin.dtype != torch.float32 or slots.shape != (num_tokens,)):
            raise ValueError("rope_kv's queries, keys, values, tables and store disagree")
        slots = slots.to(torch.int64).contiguous()
        if self._rope(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                      v.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0), num_tokens,
                      heads, kv_heads, dim, value_dim, rotary_dim, int(interleaved),
                      keys.data_ptr(), values.data_ptr(), slots.data_ptr(),
                      keys.shape[0]) != 0:
            raise ValueError(f"rope_kv refused r={rotary_dim} d={dim} or a slot outside "
                             f"the store's {keys.shape[0]}")

    def attention_block(self, layer: AttentionLayer, x: torch.Tensor,
                        tables: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor,
                        values: torch.Tensor, slot_mapping: torch.Tensor,
                        kv_slots: torch.Tensor, starts: torch.Tensor,
                        lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode layer's attention half (csrc/attention_block.c) for bf16 rows `x [T, H]`
        (T <= GEMV_MAX_ROWS): returns `x + attention(rms_norm(x))` and its post-attention
        norm, both `[T, H]`. `tables`: the tokens' RoPE cos, sin `[T, 1, r]` float32; `keys`,
        `values [N, h_kv, d]`: the layer's store (each token's k, v written at
        `slot_mapping [T]`); token t attends to `kv_slots[starts[t]:starts[t] + lengths[t]]`."""
        cos, sin = (t.reshape(t.shape[0], -1) for t in tables)
        indices = [slot_mapping, starts, lengths, kv_slots]
        check_step(layer, x, cos, sin, keys, values, indices)
        if not 1 <= x.shape[0] <= GEMV_MAX_ROWS:
            raise ValueError(f"attention_block takes 1 to {GEMV_MAX_ROWS} rows")
        x_out, h_out = torch.empty_like(x), torch.empty_like(x)
        status = self._block(ctypes.addressof(layer.struct), x.data_ptr(), x.shape[0],
                             cos.data_ptr(), sin.data_ptr(), cos.stride(0), keys.data_ptr(),
                             values.data_ptr(), keys.shape[0], slot_mapping.data_ptr(),
                             kv_slots.data_ptr(), kv_slots.shape[0], starts.data_ptr(),
                             lengths.data_ptr(), x_out.data_ptr(), h_out.data_ptr())
        if status == -2:
            raise MemoryError("attention_block could not allocate its intermediates")
        if status != 0:
            raise ValueError(f"attention_block refused T={x.shape[0]} (a slot outside the "
                             f"store's {keys.shape[0]}, a key run empty or outside the "
                             f"{kv_slots.shape[0]} keys, or the rotary dim "
                             f"{layer.struct.rotary_dim})")
        return x_out, h_out


@functools.cache
def kernels() -> NativeKernels | None:
    """The loaded library, or None where it cannot be built (or is switched off);
    MOX_NATIVE_TIMELINE=1 builds it with the phase timeline (NativeKernels.timeline_take)."""
    if os.environ.get("MOX_NATIVE_KERNELS", "1") == "0":
        return None
    timeline = os.environ.get("MOX_NATIVE_TIMELINE") == "1"
    path = build(SOURCE_DIR, ("MOX_TIMELINE",) if timeline else ())
    return NativeKernels(path) if path is not None else None


@contextlib.contextmanager
def torch_paths():
    """Within it (this thread or task), `takes*` say no: the previous paths, for comparison."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def _available() -> NativeKernels | None:
    """The library, where it is built and not switched off (`torch_paths`) here."""
    return None if _OFF.get() else kernels()


def _fast() -> bool:
    """The fast paths serve here: AVX512-BF16, or AVX2 + FMA (every weight format)."""
    native = _available()
    return native is not None and native.fast


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the fast kernel serves `x @ w.T` here (else torch's GEMM should)."""
    return (_fast() and x.device.type == "cpu"
            and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.dim() == 2
            and 1 <= x.shape[0] <= MAX_ROWS[kernels().isa]
            and x.shape[1] % K_MULTIPLE == 0
            and w.dim() == 2 and w.shape[1] == x.shape[1]
            and x.stride(1) == 1 and w.stride(1) == 1)


def takes_experts(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  scales: ExpertScales | None = None, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None) -> bool:
    """Whether `moe_experts`' fast path serves these experts here (AVX512-BF16 or AVX2 + FMA;
    biases must be bf16)."""
    hidden, inter = rows.shape[1], w13.shape[1] // 2
    integers = scales is not None and scales.fmt.kind != FP8        # activations to int8
    multiple = max(QUANT_BLOCK if integers else K_MULTIPLE,
                   0 if scales is None else scales.fmt.block_cols)
    return (_fast() and rows.device.type == "cpu"
            and rows.dtype == torch.bfloat16 and native_format(scales)
            and all(b is None or b.dtype == torch.bfloat16 for b in (b13, b2))
            and hidden % multiple == 0 and inter % multiple == 0)


def max_rows_per_expert() -> int:
    """Rows an expert up to which `moe_experts` beats torch's GEMMs here (callers check
    `takes_experts` first)."""
    return MAX_ROWS_PER_EXPERT[kernels().isa]


def takes_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` serves these rows here."""
    return (_fast() and x.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16
            and x.dim() == 2 and x.stride(1) == 1 and weight.dim() == 1
            and weight.stride(0) == 1 and weight.shape[0] == x.shape[1])


def takes_routing(logits: torch.Tensor) -> bool:
    """Whether `route` serves these router logits here (plain C: any CPU the library builds
    on)."""
    return (_available() is not None and logits.device.type == "cpu"
            and logits.dtype == torch.bfloat16 and logits.dim() == 2)


def takes_attention(q: torch.Tensor, kv) -> bool:
    """Whether `decode_attention`'s fast path serves these queries over store `kv` here."""
    return (_fast() and q.device.type == "cpu" and q.dtype == torch.bfloat16
            and kv.dtype == torch.bfloat16)


def takes_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv) -> bool:
    """Whether `rope_kv` serves these bf16 heads over store `kv` here (plain C: any CPU the
    library builds on)."""
    return (_available() is not None and q.device.type == "cpu"
            and q.dtype == k.dtype == v.dtype == kv.dtype == torch.bfloat16)


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x [M, K] @ w [N, K].T` in bf16 (fp32 sums, rounded once); callers check `takes`."""
    return kernels()._gemv_checked(x, w, torch.bfloat16, fast=True)
