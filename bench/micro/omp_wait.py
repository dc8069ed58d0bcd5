"""Where issue 18's in-step read-rate gap goes: the MoE kernel (kernels/csrc/moe_experts.c)
reads a bench layer's four experts at the GEMV's rate when called back to back, but at 15-17
GB/s inside a decode step. Between two MoE calls a step does other work, and the kernel's
OpenMP worker thread waits for the next parallel region: spinning for a while, then asleep
(libgomp's default), always spinning (`OMP_WAIT_POLICY=active`) or asleep at once
(`passive`). Waking a sleeping thread on this VM is slow.

Per policy, in a fresh process each (the policy is read when libgomp loads):
- `kernel`: GB/s inside `moe_experts` over bench-shaped slot pools (8 layers x 64 slots,
  cycled past the cache, 4 random slots a call), with 0 or 1000 us of torch work (a small
  matmul on both threads) before each call, median of 5 passes;
- `decode`: batch-1 greedy decode tok/s of the bench olmoe under the offline `LLM` (64 tokens
  after 4, median of 5), which runs the engine on its own thread beside the compute threads.

    .venv/bin/python -m mox.bench.micro.omp_wait --home /tmp/bh-bench [--passes 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).parent.parent / "results"
POLICIES = ("default", "active", "passive")
HIDDEN, INTER, SLOTS, LAYERS, TOP_K = 1024, 512, 64, 8, 4


def kernel_rates() -> dict[int, float]:
    import torch

    from mox.kernels import native

    kernels = native.kernels()
    w13 = [torch.randn(SLOTS, 2 * INTER, HIDDEN, dtype=torch.bfloat16) for _ in range(LAYERS)]
    w2 = [torch.randn(SLOTS, HIDDEN, INTER, dtype=torch.bfloat16) for _ in range(LAYERS)]
    rows = torch.randn(1, HIDDEN, dtype=torch.bfloat16).expand(TOP_K, HIDDEN).contiguous()
    weights = torch.ones(TOP_K)
    scratch = [torch.empty(TOP_K, 2 * INTER), torch.empty(TOP_K, INTER, dtype=torch.bfloat16),
               torch.empty(TOP_K, HIDDEN)]
    work = torch.randn(256, 256)

    def one_pass(gap_us: int) -> float:
        g = torch.Generator().manual_seed(1)
        inside = 0.0
        for _ in range(20):
            for layer in range(LAYERS):
                slots = torch.randperm(SLOTS, generator=g)[:TOP_K].tolist()
                end = time.perf_counter() + gap_us * 1e-6
                while time.perf_counter() < end:
                    work @ work
                start = time.perf_counter()
                kernels.moe_experts(rows, w13[layer], w2[layer], [(s, 1) for s in slots],
                                    weights, scratch)
                inside += time.perf_counter() - start
        return 20 * LAYERS * TOP_K * 3 * HIDDEN * INTER * 2 / inside / 1e9

    return {gap: round(statistics.median(one_pass(gap) for _ in range(5)), 1)
            for gap in (0, 1000)}


def decode_rate(home: str) -> float:
    from mox import LLM

    llm = LLM(os.path.join(home, "models", "olmoe-bench"), dtype="bfloat16")
    prompt = [list(range(100, 116))]

    def seconds(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True)
        return time.perf_counter() - start

    seconds(8)
    return round(statistics.median(64 / (seconds(68) - seconds(4)) for _ in range(5)), 1)


def child(home: str) -> None:
    print(json.dumps({"kernel": kernel_rates(), "decode": decode_rate(home)}), flush=True)


def run_policy(policy: str, home: str) -> dict:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-m", "mox.bench.micro.omp_wait", "--home", home,
                          "--child"], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", default=os.environ.get("MOX_HOME", "~/.cache/mox"))
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    home = os.path.expanduser(args.home)
    if args.child:
        return child(home)
    uptime = open("/proc/loadavg").read().split()[:3]
    passes = [{p: run_policy(p, home) for p in POLICIES} for _ in range(args.passes)]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).parent).stdout.strip()
    lines = ["# OpenMP wait policy vs the MoE kernel's in-step read rate (bf16, CPU, 2 threads)",
             "", f"- command: .venv/bin/python -m mox.bench.micro.omp_wait --home {args.home}"
             f" --passes {args.passes}",
             f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat('T', 'seconds')}",
             f"- git_head: {head}", f"- load average before: {' '.join(uptime)}", "",
             "Policies alternated, one fresh process each; every cell: pass 1 / pass 2 ...", "",
             "| OMP_WAIT_POLICY | kernel GB/s, calls back to back | kernel GB/s, 1 ms of torch "
             "work before each call | batch-1 decode tok/s |", "|---|---|---|---|"]
    def cell(policy: str, get) -> str:
        return " / ".join(str(get(run[policy])) for run in passes)

    for p in POLICIES:
        lines.append(f"| {p} | {cell(p, lambda r: r['kernel']['0'])} | "
                     f"{cell(p, lambda r: r['kernel']['1000'])} | "
                     f"{cell(p, lambda r: r['decode'])} |")
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "omp_wait.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
