"""GPU check of the Triton fused-MoE kernels: compile, correctness against the torch path, and
speed against the machine's measured ceilings. Run by `bench/micro/gpu_kernels.sh` on a GPU.

    python -m mox.bench.micro.gpu_kernels --out DIR [--phase default|tuned|quantized]
    TRITON_INTERPRET=1 python -m mox.bench.micro.gpu_kernels --out DIR --phase quantized \
        --smoke                                                          (no GPU)

Writes `gpu_kernels_<phase>.json` and prints a table per model shape. FLOPs per call are
2*T*k*3*H*I; bytes are the weights of the distinct experts hit plus activations in and out.
The quantized phase times the kernel over int8 / int4 / FP8 / MXFP4 pools (mox.kernels.quant,
dequantized inside the K loop) against the same experts in bf16, and checks each against the
reference over its dequantized weights (the one definition every backend meets); `--smoke`
runs it at toy sizes on the CPU under the Triton interpreter (which triton reads when it is
imported: hence the variable).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from dataclasses import asdict, dataclass

import torch
from triton.testing import do_bench

from mox.bench.micro.quant_kernels import quantized_pool
from mox.kernels import (
    NOT_RESIDENT,
    fused_moe,
    fused_moe_triton,
    reference_fused_moe,
    softmax_topk,
)
from mox.kernels.moe_triton import is_interpreter
from mox.kernels.quant import (
    FP8_BLOCK128,
    INT4_GROUP128,
    INT8_PER_CHANNEL,
    MXFP4_GROUP32,
    dequantize_experts,
)


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    hidden: int
    inter: int
    top_k: int


SHAPES = [Shape("mixtral-8x7b", 8, 4096, 14336, 2), Shape("qwen3-30b-a3b", 128, 2048, 768, 8)]
TOKENS = [1, 16, 64, 256, 1024, 4096]
REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
# issue 19's shapes for the quantized paths; DeepSeek-V3's 256 routed experts are 22.5 GB in
# bf16, so its pool here holds 64 of them (the routing still picks 8 of the 64)
QUANT_SHAPES = [Shape("qwen3-30b-a3b", 128, 2048, 768, 8),
                Shape("deepseek-v3 (64 of 256 experts)", 64, 7168, 2048, 8)]
SMOKE_SHAPES = [Shape("smoke", 8, 256, 128, 2)]
QUANT_TOKENS = [1, 64, 1024]
SMOKE_TOKENS = [1, 19]
QUANT_FORMATS = {"int8": INT8_PER_CHANNEL, "int4": INT4_GROUP128, "fp8": FP8_BLOCK128,
                 "mxfp4": MXFP4_GROUP32}


def ceilings() -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ a, warmup=3, rep=100)
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=3, rep=50)
    return {"bf16_tflops": 2 * 8192**3 / ms / 1e9, "copy_gbps": 2 * src.numel() / copy_ms / 1e6}


def problem(shape: Shape, num_tokens: int, dtype: torch.dtype, w13, w2, num_slots: int,
            num_missing: int = 0, seed: int = 0, device: str = "cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, shape.hidden, device=device, generator=gen).to(dtype)
    logits = torch.randn(num_tokens, shape.experts, device=device, generator=gen)
    weights, ids = softmax_topk(logits, shape.top_k, renormalize=True)
    slot_of = torch.randperm(num_slots, device=device, generator=gen)[:shape.experts]
    slot_of = slot_of.to(torch.int32)
    slot_of[torch.randperm(shape.experts, device=device, generator=gen)[:num_missing]] = \
        NOT_RESIDENT
    return x, w13, w2, weights, ids, slot_of


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


def measure_shape(shape: Shape, ceiling: dict, tokens: list[int]) -> list[dict]:
    dtype = torch.bfloat16
    w13 = (torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device="cuda") /
           shape.hidden**0.5).to(dtype)
    w2 = (torch.randn(shape.experts, shape.hidden, shape.inter, device="cuda") /
          shape.inter**0.5).to(dtype)
    rows = []
    for num_tokens in tokens:
        args = problem(shape, num_tokens, dtype, w13, w2, shape.experts, seed=num_tokens)
        triton_out = fused_moe(*args, backend="triton")
        torch_out = fused_moe(*args, backend="torch")
        err = relative_error(triton_out, torch_out)
        ms = do_bench(lambda a=args: fused_moe(*a, backend="triton"), warmup=5, rep=50)
        torch_ms = do_bench(lambda a=args: fused_moe(*a, backend="torch"), warmup=3, rep=50)
        hit = int(args[4].unique().numel())
        flops = 2 * num_tokens * shape.top_k * 3 * shape.hidden * shape.inter
        nbytes = hit * 3 * shape.hidden * shape.inter * 2 + 2 * num_tokens * shape.hidden * 2
        row = {"shape": shape.name, "T": num_tokens, "triton_ms": ms, "torch_ms": torch_ms,
               "speedup_vs_torch": torch_ms / ms, "rel_err_vs_torch": err,
               "tflops": flops / ms / 1e9, "gbps": nbytes / ms / 1e6,
               "pct_peak_flops": 100 * flops / ms / 1e9 / ceiling["bf16_tflops"],
               "pct_copy_bw": 100 * nbytes / ms / 1e6 / ceiling["copy_gbps"],
               "ok": err < REL_TOL[dtype]}
        rows.append(row)
        print(f"{shape.name:>14} T={num_tokens:>5} triton {ms:8.3f} ms  torch {torch_ms:8.3f} ms"
              f"  x{row['speedup_vs_torch']:6.1f}  {row['tflops']:6.1f} TFLOP/s"
              f" ({row['pct_peak_flops']:4.1f}%)  {row['gbps']:7.0f} GB/s"
              f" ({row['pct_copy_bw']:4.1f}%)  err {err:.1e}", flush=True)
    del w13, w2
    torch.cuda.empty_cache()
    return rows


def wall_ms(fn, repeats: int = 3) -> float:
    """The median wall time of `fn` (the smoke run's timer: no CUDA events on the CPU)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[repeats // 2]


def expected(x, data13, data2, scales, weights, ids, slot_of) -> torch.Tensor:
    """What the kernel must return: the torch path over a bf16 pool; over a quantized one, the
    reference (fp32, token by token) over its dequantized experts."""
    if scales is None:
        return fused_moe(x, data13, data2, weights, ids, slot_of, backend="torch")
    every_slot = torch.arange(data13.shape[0], device=x.device)
    dq13, dq2 = dequantize_experts(data13, data2, scales, every_slot, torch.float32)
    return reference_fused_moe(x.float(), dq13, dq2, weights, ids, slot_of)


def markdown(rows: list[dict]) -> str:
    """The quantized phase's rows as one Markdown table (time, ratio to bf16 at the same
    shape and T, stored bytes of the experts hit per second, error against the reference)."""
    lines = ["| shape | T | format | ms | bf16 ms / ms | GB/s | rel err |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['T']} | {r['format']} | {r['ms']:.3f} | "
              f"{r['vs_bf16']:.2f} | {r['gbps']:.3g} | {r['rel_err']:.1e} |" for r in rows]
    return "\n".join(lines)


def measure_quantized(shapes: list[Shape], tokens: list[int], device: str = "cuda"
                      ) -> list[dict]:
    """Per shape, token count and format: the Triton kernel's time over the quantized pool
    against bf16's over the same experts, the stored bytes of the experts hit, and the
    relative error against the reference over the dequantized pool (bf16: the torch path)."""
    timer = ((lambda fn: do_bench(fn, warmup=5, rep=50)) if device == "cuda" else wall_ms)
    rows = []
    for shape in shapes:
        w13 = (torch.randn(shape.experts, 2 * shape.inter, shape.hidden, device=device) /
               shape.hidden**0.5).to(torch.bfloat16)
        w2 = (torch.randn(shape.experts, shape.hidden, shape.inter, device=device) /
              shape.inter**0.5).to(torch.bfloat16)
        pools = {"bf16": (w13, w2, None)}
        pools.update({name: quantized_pool(w13, w2, fmt) for name, fmt in QUANT_FORMATS.items()})
        for num_tokens in tokens:
            x, _, _, weights, ids, slot_of = problem(shape, num_tokens, torch.bfloat16, w13, w2,
                                                     shape.experts, seed=num_tokens,
                                                     device=device)
            hit = ids.unique()
            bf16_ms = None
            for name, (data13, data2, scales) in pools.items():
                call = functools.partial(fused_moe_triton, x, data13, data2, weights, ids,
                                         slot_of, scales=scales)
                err = relative_error(call(), expected(x, data13, data2, scales, weights, ids,
                                                      slot_of))
                ms = timer(call)
                bf16_ms = bf16_ms or ms
                stored = sum(t[hit].numel() * t.element_size() for t in
                             (data13, data2, *((scales.w13, scales.w2) if scales else ())))
                row = {"shape": shape.name, "T": num_tokens, "format": name, "ms": ms,
                       "vs_bf16": bf16_ms / ms, "gbps": stored / ms / 1e6,
                       "rel_err": err, "ok": err < REL_TOL[torch.bfloat16]}
                rows.append(row)
                print(f"{shape.name:>14} T={num_tokens:>5} {name:>5} {ms:9.3f} ms "
                      f"x{row['vs_bf16']:5.2f} vs bf16  {row['gbps']:7.0f} GB/s  "
                      f"err {err:.1e}", flush=True)
        del w13, w2, pools
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def dtype_and_gap_checks() -> list[dict]:
    """fp16 / fp32 / bf16 at a mid shape, a slot pool larger than E with -1 gaps, against the
    fp32 reference (small T) and the torch path."""
    shape = Shape("mid", 16, 1024, 1536, 4)
    checks = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        num_slots = 24
        w13 = (torch.randn(num_slots, 2 * shape.inter, shape.hidden, device="cuda") /
               shape.hidden**0.5).to(dtype)
        w2 = (torch.randn(num_slots, shape.hidden, shape.inter, device="cuda") /
              shape.inter**0.5).to(dtype)
        for num_tokens in (1, 37, 300):
            args = problem(shape, num_tokens, dtype, w13, w2, num_slots, num_missing=4)
            out = fused_moe(*args, backend="triton")
            ref = (reference_fused_moe(*args) if num_tokens <= 37 else
                   fused_moe(*args, backend="torch"))
            err = relative_error(out, ref)
            checks.append({"dtype": str(dtype), "T": num_tokens, "rel_err": err,
                           "ok": err < REL_TOL[dtype]})
            print(f"check {dtype} T={num_tokens}: rel err {err:.2e}", flush=True)
    return checks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", default="default")
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="quantized phase: toy sizes on the CPU, Triton's interpreter")
    args = parser.parse_args()
    start = time.monotonic()
    if args.smoke and not is_interpreter():
        raise SystemExit("--smoke runs under Triton's interpreter: set TRITON_INTERPRET=1")
    report = {"device": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": __import__("triton").__version__,
              "phase": args.phase}
    if args.phase == "quantized":
        shapes = SMOKE_SHAPES if args.smoke else QUANT_SHAPES
        report["rows"] = measure_quantized(shapes, args.tokens or (
            SMOKE_TOKENS if args.smoke else QUANT_TOKENS), "cpu" if args.smoke else "cuda")
        print(markdown(report["rows"]), flush=True)
    else:
        report["ceilings"] = ceilings()
        print("ceilings:", report["ceilings"], flush=True)
        if args.phase == "default":
            report["checks"] = dtype_and_gap_checks()
        report["rows"] = []
        for shape in SHAPES:
            report["rows"] += measure_shape(shape, report["ceilings"], args.tokens or TOKENS)
        shapes = SHAPES
    report["shapes"] = [asdict(s) for s in shapes]
    report["seconds"] = time.monotonic() - start
    with open(os.path.join(args.out, f"gpu_kernels_{args.phase}.json"), "w") as f:
        json.dump(report, f, indent=2)
    failed = [r for r in report["rows"] + report.get("checks", []) if not r["ok"]]
    print(f"{len(failed)} failed checks; {report['seconds']:.0f}s")


if __name__ == "__main__":
    main()
