"""Where a decode step goes, phase by phase, inside the native call that runs a step's layers
(kernels/csrc/decode_layers.c): the library built with its timeline (csrc/timeline.h: TSC
cycles on the calling thread, parallel regions included), one bench olmoe decoding greedily
with every expert resident. Per phase: ms a step, and for the phases that read weights, the
GB/s of the bytes they read; "outside" is what a step spends beyond the native call (the
engine, sampling, the pager's bookkeeping). Beside them, the native GEMV's read rate over
1 GiB the moment before each run (as mox.bench.micro.throughput's bound takes it) and the
step's bound at that rate.

    .venv/bin/python -m mox.bench.micro.chain_timeline [--home DIR] [--seqs 1,8]
        [--tokens 256] [--name chain_timeline]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import time
from pathlib import Path

from mox import LLM
from mox.bench.machine import describe
from mox.bench.micro.throughput import ReadRates
from mox.demo import default_home, ensure_demo_models
from mox.kernels import native
from mox.loaders import Checkpoint

RESULTS_DIR = Path(__file__).parent.parent / "results"
PROMPT_TOKENS = 16
SEED = 0
# the phases that read dense weights, by the checkpoint tensors' names
WEIGHTS = {"qkv": ("q_proj", "k_proj", "v_proj", "qkv_proj"), "out": ("o_proj",),
           "router": (".gate.weight",), "tail": ("lm_head",)}


def phase_bytes(ckpt: Checkpoint, num_seqs: int) -> dict[str, float]:
    """Weight bytes each phase reads in a step of `num_seqs` sequences (the experts: those a
    layer's tokens touch, expected under uniform routing)."""
    expert_names = {t.name for e in ckpt.experts.values() for t in (e.gate, e.up, e.down)}
    out = {phase: float(sum(info.nbytes for name, info in ckpt.tensors.items()
                            if name not in expert_names and any(k in name for k in keys)))
           for phase, keys in WEIGHTS.items()}
    spec = ckpt.spec
    touched = spec.num_experts * (1 - (1 - spec.top_k / spec.num_experts) ** num_seqs)
    out["experts"] = touched * spec.num_moe_layers * ckpt.expert_nbytes
    return out


def measure(llm: LLM, ckpt: Checkpoint, num_seqs: int, tokens: int,
            read_rates: ReadRates) -> dict:
    """One greedy decode of `tokens` tokens for `num_seqs` 16-token prompts, timed by phase."""
    rng = random.Random(SEED)
    prompts = [[rng.randrange(1, ckpt.spec.vocab_size) for _ in range(PROMPT_TOKENS)]
               for _ in range(num_seqs)]
    llm.generate(prompt_token_ids=prompts, max_tokens=4, temperature=0.0, ignore_eos=True)
    gbps = read_rates(3)["native_gbps"]
    runs = []                 # a prompt's first token alone, then with the decode after it:
    for max_tokens in (1, 1 + tokens):          # their difference is the decode
        native.kernels().timeline_take()
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, max_tokens=max_tokens, temperature=0.0,
                     ignore_eos=True)
        runs.append((time.perf_counter() - start, native.kernels().timeline_take()))
    (wall_first, first), (wall, phases) = runs
    wall -= wall_first
    phases = {phase: seconds - first[phase] for phase, seconds in phases.items()}
    steps = phases.pop("calls")
    if steps < tokens:
        raise SystemExit(f"{steps} native decode calls for {tokens} tokens: a layer left the "
                         "chain (an expert not resident?)")
    ms = {phase: seconds / steps * 1e3 for phase, seconds in phases.items()}
    ms["outside"] = wall / steps * 1e3 - sum(ms.values())
    read = phase_bytes(ckpt, num_seqs)
    return {"seqs": num_seqs, "steps": steps, "ms_per_step": wall / steps * 1e3, "ms": ms,
            "gbps": {p: read[p] / ms[p] / 1e6 for p in read if ms[p] > 0},
            "bound_ms": sum(read.values()) / gbps / 1e6, "native_gbps": gbps}


def markdown(rows: list[dict], head: dict) -> str:
    lines = ["# Decode step timeline (bench olmoe, bf16, CPU)\n",
             *(f"- {k}: {v}" for k, v in head.items()), "",
             "ms a step by phase (GB/s of the weights it reads, where it reads weights); "
             "outside: beyond the native call.", ""]
    phases = list(rows[0]["ms"])
    lines += ["| seqs | step ms | bound ms (GB/s) | step / bound | "
              + " | ".join(phases) + " |", "|---" * (len(phases) + 4) + "|"]
    for r in rows:
        cells = [f"{r['ms'][p]:.3f}" + (f" ({r['gbps'][p]:.0f})" if p in r["gbps"] else "")
                 for p in phases]
        lines.append(f"| {r['seqs']} | {r['ms_per_step']:.2f} | {r['bound_ms']:.2f} "
                     f"({r['native_gbps']:.1f}) | {r['ms_per_step'] / r['bound_ms']:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", default=None, help="MOX_HOME (default $MOX_HOME or ~/.cache/mox)")
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--name", default="chain_timeline")
    args = ap.parse_args()
    os.environ["MOX_NATIVE_TIMELINE"] = "1"     # before the library is first built and loaded
    native.kernels.cache_clear()
    if native.kernels() is None or native.kernels().timeline_take() is None:
        raise SystemExit("the native kernels with the timeline could not be built here")
    path = next(iter(ensure_demo_models(args.home or default_home(), "bench", 0.0,
                                        ("olmoe",)).values()))
    ckpt = Checkpoint(path)
    llm = LLM(path, dtype="bfloat16")
    head = {"command": "python -m mox.bench.micro.chain_timeline "
                       + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v is not None),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
            "machine": describe(), "tokens": args.tokens}
    read_rates = ReadRates()
    rows = [measure(llm, ckpt, int(n), args.tokens, read_rates)
            for n in args.seqs.split(",")]
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.name}.json").write_text(json.dumps({**head, "rows": rows},
                                                              indent=1))
    (RESULTS_DIR / f"{args.name}.md").write_text(markdown(rows, head))
    print((RESULTS_DIR / f"{args.name}.md").read_text())


if __name__ == "__main__":
    main()
