"""CPU microbenchmark of mox's fused-MoE torch path against transformers' own experts block.

For each token count T it times, on the same weights and the same routing:
  mox          mox.kernels.fused_moe(backend="torch"), experts read through a shuffled slot map
  mox-torch-paths  the same with the native CPU kernels off (torch's GEMMs only)
  hf:<impl>    transformers' Qwen3MoeExperts in every experts implementation that runs here
               (selected by `config._experts_implementation`: "eager" = per-expert loop,
               "grouped_mm" = torch.nn.functional.grouped_mm, "batched_mm" = gathered bmm, ...)
  dense        one expert's weights on all T*k rows: x_rep @ W13, SiLU*up, @ W2 (same FLOPs),
               the matmul ceiling. Its 3 MiB of weights stay in cache, while an MoE call that
               touches all E experts streams E times that from memory: at small T "% of dense"
               is bounded by memory bandwidth, not by FLOPs.
Variants run round-robin so that machine noise hits them alike (report ratios from one run);
each T first checks that every HF output agrees with mox's (bf16 tolerance): equal work.

    .venv/bin/python -m mox.bench.micro.kernels [--tokens 1,16,64] [--repeats 20]

Legend: T tokens, k experts per token, E experts, S slots (= E here), H hidden, I intermediate.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from mox.bench.machine import describe
from mox.kernels import MoEWorkspace, fused_moe, moe_torch, native

RESULTS_DIR = Path(__file__).parent.parent / "results"
# A disagreement larger than this fraction of the output's magnitude is a bug, not rounding:
# bf16 keeps 8 bits, and k fp32-accumulated contributions stay within a few ulps.
AGREEMENT_TOLERANCE = 2**-5
# batched_mm gathers a full weight copy per (token, expert) pair: [T*k, 3*I*H]. Above 1 GiB it
# only measures memory traffic and risks the 24 GiB machine, so it is skipped there.
MAX_BATCHED_GATHER_BYTES = 1 << 30
TIME_PER_VARIANT_S = 3.0  # repeats shrink at large T to keep the whole run to a few minutes
MIN_REPEATS = 3
WEIGHT_STD = 0.03  # keeps activations O(1) at H=1024 so the agreement check is meaningful


@dataclass(frozen=True)
class Shape:
    num_experts: int
    hidden: int
    inter: int
    top_k: int

    def flops(self, num_tokens: int) -> int:
        """2*T*k*H*(2I) for gate/up plus 2*T*k*I*H for down."""
        return 2 * num_tokens * self.top_k * self.hidden * 3 * self.inter


@dataclass(frozen=True)
class Weights:
    experts: Qwen3MoeExperts  # HF block: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    w13: torch.Tensor         # [S, 2I, H] mox's copy, expert e in slot slot_of[e]
    w2: torch.Tensor          # [S, H, I]
    slot_of: torch.Tensor     # [E] int32, a permutation


def make_weights(shape: Shape, gen: torch.Generator) -> Weights:
    config = Qwen3MoeConfig(hidden_size=shape.hidden, moe_intermediate_size=shape.inter,
                            num_experts=shape.num_experts, num_experts_per_tok=shape.top_k,
                            hidden_act="silu")
    experts = Qwen3MoeExperts(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for param in (experts.gate_up_proj, experts.down_proj):
            param.copy_(torch.randn(param.shape, generator=gen) * WEIGHT_STD)
    slot_of = torch.randperm(shape.num_experts, generator=gen).to(torch.int32)  # [E]
    w13 = torch.empty_like(experts.gate_up_proj.data)
    w13[slot_of.long()] = experts.gate_up_proj.data
    w2 = torch.empty_like(experts.down_proj.data)
    w2[slot_of.long()] = experts.down_proj.data
    return Weights(experts, w13, w2, slot_of)


def make_routing(num_tokens: int, shape: Shape, gen: torch.Generator):
    """Inputs and softmax top-k routing; weights are rounded to bf16 so that HF (which gets
    bf16 from its router) and mox (float32) see identical values."""
    x = torch.randn(num_tokens, shape.hidden, generator=gen).to(torch.bfloat16)      # [T, H]
    logits = torch.randn(num_tokens, shape.num_experts, generator=gen)               # [T, E]
    weights, ids = torch.topk(logits.softmax(-1), shape.top_k, dim=-1)               # [T, k]
    weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
    return x, weights, ids


def select(experts: Qwen3MoeExperts, impl: str) -> Qwen3MoeExperts:
    experts.config._experts_implementation = impl
    return experts


def available_hf_impls(weights: Weights, shape: Shape) -> tuple[list[str], dict[str, str]]:
    """Every registered experts implementation, tried once on a tiny input."""
    x, topk_weights, topk_ids = make_routing(2, shape, torch.Generator().manual_seed(1))
    usable, unusable = [], {}
    for impl in ["eager", *ALL_EXPERTS_FUNCTIONS.keys()]:
        try:
            select(weights.experts, impl)(x, topk_ids, topk_weights)
            usable.append(impl)
        except Exception as error:  # the reason is reported, not hidden
            reason = str(error).splitlines()[0].replace("`", "'")
            unusable[impl] = f"{type(error).__name__}: {reason}"
    return usable, unusable


def make_variants(weights: Weights, shape: Shape, impls: list[str], num_tokens: int,
                  gen: torch.Generator) -> dict[str, Callable[[], torch.Tensor]]:
    x, topk_weights, topk_ids = make_routing(num_tokens, shape, gen)
    mox_weights, mox_ids = topk_weights.float(), topk_ids.to(torch.int32)
    workspace = MoEWorkspace()   # as a model keeps one across calls
    variants = {"mox": lambda: fused_moe(x, weights.w13, weights.w2, mox_weights, mox_ids,
                                         weights.slot_of, backend="torch",
                                         workspace=workspace)}

    def torch_paths() -> torch.Tensor:      # the native kernels off: where each path wins
        with native.torch_paths():
            return variants["mox"]()
    variants["mox-torch-paths"] = torch_paths
    gather_bytes = num_tokens * shape.top_k * 3 * shape.inter * shape.hidden * 2
    for impl in impls:
        if impl == "batched_mm" and gather_bytes > MAX_BATCHED_GATHER_BYTES:
            continue
        variants[f"hf:{impl}"] = lambda impl=impl: select(weights.experts, impl)(
            x, topk_ids, topk_weights)
    x_rep = x.repeat_interleave(shape.top_k, dim=0)                              # [T*k, H]
    w13_t, w2_t = weights.w13[0].t(), weights.w2[0].t()                          # [H, 2I], [I, H]

    def dense() -> torch.Tensor:
        gate_up = x_rep @ w13_t                                                  # [T*k, 2I]
        return (F.silu(gate_up[:, :shape.inter]) * gate_up[:, shape.inter:]) @ w2_t  # [T*k, H]

    variants["dense"] = dense
    touched = weights.slot_of[topk_ids.unique().long()].tolist()
    probe_h = torch.ones(shape.hidden, dtype=torch.bfloat16)
    probe_i = torch.ones(shape.inter, dtype=torch.bfloat16)

    def floor() -> None:
        """Read every touched expert's weights once (matrix-vector: the least work that
        reads them all). No MoE kernel in bf16 can beat this at small T."""
        for slot in touched:
            torch.mv(weights.w13[slot], probe_h)
            torch.mv(weights.w2[slot], probe_i)

    variants["floor"] = floor
    return variants


def check_agreement(variants: dict[str, Callable[[], torch.Tensor]]) -> dict[str, float]:
    """Max |out - mox| / max |mox| per HF variant; raises if any exceeds the tolerance."""
    reference = variants["mox"]().float()
    scale = reference.abs().max().item()
    errors = {}
    for name, fn in variants.items():
        if name.startswith("hf:"):
            errors[name] = (fn().float() - reference).abs().max().item() / scale
            assert errors[name] <= AGREEMENT_TOLERANCE, (name, errors[name])
    return errors


def time_variants(variants: dict[str, Callable[[], torch.Tensor]],
                  max_repeats: int) -> tuple[dict[str, float], int]:
    """Median ms per variant, run round-robin after one warm-up call each."""
    warm_s = sum(_elapsed_ms(fn) for fn in variants.values()) / 1e3
    repeats = max(MIN_REPEATS, min(max_repeats, int(TIME_PER_VARIANT_S * len(variants) / warm_s)))
    samples = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            samples[name].append(_elapsed_ms(fn))
    return {name: statistics.median(ms) for name, ms in samples.items()}, repeats


def _elapsed_ms(fn: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def bench_tokens(weights: Weights, shape: Shape, impls: list[str], num_tokens: int,
                 max_repeats: int) -> dict:
    variants = make_variants(weights, shape, impls, num_tokens, torch.Generator().manual_seed(2))
    errors = check_agreement(variants)
    ms, repeats = time_variants(variants, max_repeats)
    gflops = shape.flops(num_tokens) / 1e9
    row = {"tokens": num_tokens, "repeats": repeats, "ms": ms, "rel_error": errors,
           "mox_gflops": gflops / (ms["mox"] / 1e3),
           "dense_gflops": gflops / (ms["dense"] / 1e3)}
    row["mox_pct_of_dense"] = 100 * ms["dense"] / ms["mox"]
    # the bound that applies: streaming the weights, or the dense FLOP rate
    row["bound_ms"] = max(ms["floor"], ms["dense"])
    row["mox_x_bound"] = ms["mox"] / row["bound_ms"]
    row["speedup"] = {name: t / ms["mox"] for name, t in ms.items() if name.startswith("hf:")}
    return row


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets; a target with no measured T says so rather than passing."""
    targets = [
        ("mox >= 3x faster than hf:eager for T >= 64",
         lambda r: r["tokens"] >= 64, lambda r: r["speedup"].get("hf:eager", 0) >= 3),
        ("mox at least as fast as hf:grouped_mm at every T",
         lambda r: True, lambda r: r["speedup"].get("hf:grouped_mm", 0) >= 1),
        ("mox >= 60% of dense FLOP rate at T = 256",
         lambda r: r["tokens"] == 256, lambda r: r["mox_pct_of_dense"] >= 60),
        ("mox >= 75% of dense FLOP rate at T >= 1024",
         lambda r: r["tokens"] >= 1024, lambda r: r["mox_pct_of_dense"] >= 75),
    ]
    results = []
    for text, applies, holds in targets:
        checked = [r for r in rows if applies(r)]
        failing = [r["tokens"] for r in checked if not holds(r)]
        status = "not measured" if not checked else ("met" if not failing else "NOT met")
        results.append({"target": text, "status": status, "failing_tokens": failing})
    return results


def format_table(rows: list[dict], impls: list[str]) -> str:
    hf = [f"hf:{impl}" for impl in impls]
    cols = ["T", "mox ms", "mox-torch-paths ms", *[f"{n} ms" for n in hf], "dense ms",
            "weight-read floor ms", "vs eager", "vs grouped_mm", "mox GFLOP/s", "dense GFLOP/s",
            "mox % dense", "mox / max(floor, dense)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r["tokens"]), f"{r['ms']['mox']:.2f}", f"{r['ms']['mox-torch-paths']:.2f}"]
        cells += [f"{r['ms'][n]:.2f}" if n in r["ms"] else "skip" for n in hf]
        cells += [f"{r['ms']['dense']:.2f}", f"{r['ms']['floor']:.2f}",
                  *[f"{r['speedup'][n]:.2f}x" if n in r["speedup"] else "-"
                    for n in ("hf:eager", "hf:grouped_mm")],
                  f"{r['mox_gflops']:.0f}", f"{r['dense_gflops']:.0f}",
                  f"{r['mox_pct_of_dense']:.0f}%", f"{r['mox_x_bound']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(meta: dict, rows: list[dict], targets: list[dict], table: str,
                  name: str) -> None:
    RESULTS_DIR.mkdir(exist_ok=True)
    report = {**meta, "rows": rows, "targets": targets}
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    notes = [f"- {key}: {value}" for key, value in meta.items()]
    text = "\n".join(["# Fused MoE on CPU: mox vs transformers", "", *notes, "", table, "",
                      "## Targets", "", format_targets(targets), ""])
    (RESULTS_DIR / f"{name}.md").write_text(text)


def format_targets(targets: list[dict]) -> str:
    return "\n".join(f"- {t['status']}: {t['target']}"
                     + (f" (fails at T = {t['failing_tokens']})" if t["failing_tokens"] else "")
                     for t in targets)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mox.bench.micro.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--experts", 64), ("--hidden", 1024), ("--inter", 512), ("--top-k", 4)):
        parser.add_argument(flag, type=int, default=default, help=f"(default {default})")
    parser.add_argument("--tokens", default="1,16,64,256,1024,4096", help="comma-separated T")
    parser.add_argument("--repeats", type=int, default=20, help="max timed repeats per T")
    parser.add_argument("--name", default="kernels_cpu",
                        help="results as bench/results/NAME.json and NAME.md")
    return parser.parse_args(argv)


def run_metadata(argv: list[str] | None, shape: Shape, impls: list[str],
                 unusable: dict[str, str], load_before: float) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    # the torch path is being optimised concurrently: pin which version of it was timed
    source_hash = hashlib.sha256(Path(moe_torch.__file__).read_bytes()).hexdigest()[:12]
    return {"command": shlex.join([".venv/bin/python", "-m", "mox.bench.micro.kernels", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "machine": describe(), "threads": torch.get_num_threads(),
            "load_avg_1m_before": load_before,
            "moe_torch_sha256": source_hash, "shape": asdict(shape), "dtype": "bfloat16",
            "hf_impls": impls, "hf_impls_unavailable": unusable}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shape = Shape(args.experts, args.hidden, args.inter, args.top_k)
    load_before = os.getloadavg()[0]  # other work on the 2 cores skews every timing
    weights = make_weights(shape, torch.Generator().manual_seed(0))
    with torch.inference_mode():
        impls, unusable = available_hf_impls(weights, shape)
        rows = []
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            rows.append(bench_tokens(weights, shape, impls, num_tokens, args.repeats))
            print(f"T={num_tokens}: done ({rows[-1]['repeats']} repeats)", file=sys.stderr)
    meta = run_metadata(argv, shape, impls, unusable, load_before)
    table = format_table(rows, impls)
    targets = evaluate_targets(rows)
    print(table, format_targets(targets), sep="\n\n")
    write_results(meta, rows, targets, table, args.name)


if __name__ == "__main__":
    main()
