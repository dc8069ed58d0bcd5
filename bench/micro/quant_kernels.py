"""Which kernel computes a quantized expert fastest on this CPU, per number of rows: one
bench-olmoe expert (H 1024, I 512; gate_up, SiLU, down) for M rows, cycling over more experts
than the last-level cache holds (each call reads its expert from memory), 2 threads:

  bf16             the bf16 expert: the native kernel (M <= 16, as mox routes decode) or
                   torch.mm (prefill)
  int8 native      mox's native kernel (activations quantized to int8 per 64, AVX512-VNNI);
                   its call here also pays the set-up a serving layer shares among k experts
  int8 pack_mm     torch._weight_int8pack_mm (bf16 activations, int8 weights, bf16 scales)
  int8 dequant+mm  dequantize the expert to bf16 (mox.kernels.quant), then torch.mm
  int4 native      mox's native kernel over int4 rows in groups of 128
  int4 dequant+mm  as int8's
  fp8 native       FP8 E4M3 in blocks of 128x128 widened to bf16 in registers (AVX512-BF16)
  fp8 dequant+mm   as int8's (what FP8 experts took before the native kernel)
  mxfp4 native     MXFP4 (groups of 32) looked up as int8 and met by int8 activations
  mxfp4 dequant+mm as int8's

Microseconds per expert call, median of the repeats; each figure from the runs given.

    .venv/bin/python -m mox.bench.micro.quant_kernels [--runs 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mox.kernels import native
from mox.kernels.quant import (
    FP8_BLOCK128,
    INT4_GROUP128,
    INT8_PER_CHANNEL,
    MXFP4_GROUP32,
    ExpertScales,
    dequantize_experts,
)
from mox.kernels.quant import quantize as quantize_weight

HIDDEN, INTER = 1024, 512
NUM_EXPERTS = 192          # 576 MiB of bf16 experts: past the L3, so every call reads memory
ROWS = (1, 4, 16, 64, 256)
CALLS = 48
RESULTS = Path(__file__).parent.parent / "results" / "quant_kernels.md"


def quantized_pool(w13: torch.Tensor, w2: torch.Tensor, fmt) -> tuple:
    inter = w13.shape[1] // 2
    q13 = [(quantize_weight(w[:inter], fmt), quantize_weight(w[inter:], fmt)) for w in w13]
    q2 = [quantize_weight(w, fmt) for w in w2]
    data13 = torch.stack([torch.cat((g[0], u[0])) for g, u in q13])
    scale13 = torch.stack([torch.stack((g[1], u[1])) for g, u in q13])
    return (data13, torch.stack([d for d, _ in q2]),
            ExpertScales(fmt, scale13, torch.stack([s for _, s in q2])))


def native_call(x, w13, w2, slot, scales=None):
    rows = x.clone()
    m = rows.shape[0]
    scratch = [torch.empty(m, 2 * INTER), torch.empty(m, INTER, dtype=torch.bfloat16),
               torch.empty(m, HIDDEN)]
    return native.kernels().moe_experts(rows, w13, w2, [(slot, m)], torch.ones(m), scratch,
                                        scales=scales)


def mm_call(x, w13, w2):
    gate_up = torch.mm(x, w13.t())
    return torch.mm(F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:], w2.t())


def variants(pools: dict) -> dict:
    bf13, bf2 = pools["bf16"]
    d13, d2, s8 = pools["int8"]
    p13, p2 = s8.w13.reshape(NUM_EXPERTS, -1).bfloat16(), s8.w2.reshape(NUM_EXPERTS, -1).bfloat16()
    i13, i2, s4 = pools["int4"]
    f13, f2, s_fp8 = pools["fp8"]
    m13, m2, s_mx = pools["mxfp4"]

    def pack_mm(x, e):
        gate_up = torch._weight_int8pack_mm(x, d13[e], p13[e])
        act = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
        return torch._weight_int8pack_mm(act, d2[e], p2[e])

    def dequant_mm(data13, data2, scales):
        def call(x, e):
            w13, w2 = dequantize_experts(data13, data2, scales, torch.tensor([e]), torch.bfloat16)
            return mm_call(x, w13[0], w2[0])
        return call
    return {
        "bf16": lambda x, e: (native_call(x, bf13, bf2, e) if x.shape[0] <= 16
                              else mm_call(x, bf13[e], bf2[e])),
        "int8 native": lambda x, e: native_call(x, d13, d2, e, s8),
        "int8 pack_mm": pack_mm,
        "int8 dequant+mm": dequant_mm(d13, d2, s8),
        "int4 native": lambda x, e: native_call(x, i13, i2, e, s4),
        "int4 dequant+mm": dequant_mm(i13, i2, s4),
        "fp8 native": lambda x, e: native_call(x, f13, f2, e, s_fp8),
        "fp8 dequant+mm": dequant_mm(f13, f2, s_fp8),
        "mxfp4 native": lambda x, e: native_call(x, m13, m2, e, s_mx),
        "mxfp4 dequant+mm": dequant_mm(m13, m2, s_mx),
    }


def time_per_call(fn, rows: int) -> float:
    x = torch.randn(rows, HIDDEN).bfloat16()
    fn(x, 0)
    start = time.perf_counter()
    for call in range(CALLS):
        fn(x, (call * 37) % NUM_EXPERTS)        # a stride that walks the whole pool
    return (time.perf_counter() - start) / CALLS * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    torch.manual_seed(0)
    w13 = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN) / HIDDEN**0.5).bfloat16()
    w2 = (torch.randn(NUM_EXPERTS, HIDDEN, INTER) / INTER**0.5).bfloat16()
    pools = {"bf16": (w13, w2), "int8": quantized_pool(w13, w2, INT8_PER_CHANNEL),
             "int4": quantized_pool(w13, w2, INT4_GROUP128),
             "fp8": quantized_pool(w13, w2, FP8_BLOCK128),
             "mxfp4": quantized_pool(w13, w2, MXFP4_GROUP32)}
    calls = variants(pools)
    runs = {name: {m: [] for m in ROWS} for name in calls}
    for _ in range(args.runs):
        for m in ROWS:
            for name, fn in calls.items():     # alternating: every variant sees the same load
                runs[name][m].append(time_per_call(fn, m))
    lines = [f"# Quantized expert kernels (one expert, H {HIDDEN}, I {INTER})", "",
             f"`python -m mox.bench.micro.quant_kernels`, {time.strftime('%Y-%m-%dT%H:%M')}, "
             f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads, load "
             f"{os.getloadavg()[0]:.1f}. Microseconds per expert call (runs in order); "
             "ratio: bf16's time / this one's (above 1: faster than bf16).", "",
             "| kernel | " + " | ".join(f"M={m} us | vs bf16" for m in ROWS) + " |",
             "|---" * (1 + 2 * len(ROWS)) + "|"]
    for name, by_rows in runs.items():
        cells = [name]
        for m in ROWS:
            cells.append(" / ".join(f"{v:.0f}" for v in by_rows[m]))
            ratio = statistics.median(runs["bf16"][m]) / statistics.median(by_rows[m])
            cells.append(f"{ratio:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
