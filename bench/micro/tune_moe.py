"""Tune the Triton fused-MoE block sizes on a GPU and write them as JSON configs.

    python -m mox.bench.micro.tune_moe --experts 8 --hidden 4096 --inter 14336 --top-k 2 \
        --tokens 1 16 64 256 1024 4096 --budget-s 120 --out kernels/configs

For each token count, times every candidate config end to end (align + both GEMMs + sum)
with `triton.testing.do_bench` and keeps the fastest. A time budget, split evenly over the
token counts, bounds the sweep; the best found so far is kept when a share runs out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch

from mox.kernels import MoEKernelConfig, fused_moe_triton, softmax_topk
from mox.kernels.moe_config import DTYPE_NAMES, config_file_name

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def candidates(num_tokens: int, num_experts: int, top_k: int) -> list[MoEKernelConfig]:
    rows_per_expert = num_tokens * top_k / num_experts
    block_ms = (16, 32) if rows_per_expert <= 16 else (32, 64, 128)
    configs = []
    for bm, bn, bk, warps, stages in itertools.product(block_ms, (64, 128), (64, 128), (4, 8),
                                                       (3, 4)):
        if bm * bn * 2 > 2 * 128 * 128 or (bm >= 128 and bk >= 128):
            continue          # two fp32 accumulators of this size spill; skip
        configs.append(MoEKernelConfig(bm, bn, bk, 1 if bm <= 32 else 8, warps, stages))
    return configs


def make_problem(num_tokens: int, num_experts: int, hidden: int, inter: int, top_k: int,
                 dtype: torch.dtype, weights: tuple[torch.Tensor, torch.Tensor]):
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype)
    topk_weights, topk_ids = softmax_topk(torch.randn(num_tokens, num_experts, device="cuda"),
                                          top_k, renormalize=True)
    slot_of = torch.randperm(num_experts, device="cuda").to(torch.int32)
    return (x, *weights, topk_weights, topk_ids, slot_of)


def tune(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
         tokens: list[int], budget_s: float) -> dict[int, dict]:
    from triton.testing import do_bench

    weights = ((torch.randn(num_experts, 2 * inter, hidden, device="cuda") * 0.02).to(dtype),
               (torch.randn(num_experts, hidden, inter, device="cuda") * 0.02).to(dtype))
    best: dict[int, dict] = {}
    for num_tokens in tokens:
        deadline = time.monotonic() + budget_s / len(tokens)
        args = make_problem(num_tokens, num_experts, hidden, inter, top_k, dtype, weights)
        results = []
        for config in candidates(num_tokens, num_experts, top_k):
            if time.monotonic() > deadline and results:
                break
            try:
                ms = do_bench(lambda c=config, a=args: fused_moe_triton(*a, config=c), warmup=5,
                              rep=25)
            except Exception as e:   # out of shared memory / registers: not a candidate
                print(f"  skip {config}: {type(e).__name__}")
                continue
            results.append((ms, config))
        ms, config = min(results, key=lambda r: r[0])
        best[num_tokens] = {**config.to_json(), "ms": round(ms, 4)}
        print(f"T={num_tokens}: {ms:.3f} ms with {config} ({len(results)} tried)", flush=True)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--inter", type=int, required=True)
    parser.add_argument("--top-k", type=int, required=True)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..",
                                                      "kernels", "configs"))
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    best = tune(args.experts, args.hidden, args.inter, args.top_k, dtype, args.tokens,
                args.budget_s)
    name = config_file_name(args.experts, args.inter, torch.cuda.get_device_name(), dtype)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
        # the timing is kept beside each config as a record; the loader ignores it
        json.dump({str(m): cfg for m, cfg in best.items()}, f, indent=2)
    print("wrote", os.path.join(args.out, name))


if __name__ == "__main__":
    main()
