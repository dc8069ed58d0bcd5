"""Decode with a quarter of the experts in slots, with and without the native CPU kernels, in
one run: how much of the kernels' gain survives when misses are read from disk every step.

One bench-size olmoe (bf16, CPU), warm, 16-token seeded prompts at 1 and 8 sequences.
Variants: all experts resident, and 25% of the expert bytes as slots (the rest read on a miss,
O_DIRECT); each with the native kernels on and off (`native.torch_paths()`). Decode tok/s =
n * D / (T(1 + D new tokens) - T(1 new token)); medians of the repeats, variants rotating.

    .venv/bin/python -m mox.bench.micro.paged_decode [--home DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch

from mox import LLM
from mox.demo import default_home, ensure_demo_models
from mox.kernels import native
from mox.loaders import Checkpoint

RESULTS_DIR = Path(__file__).parent.parent / "results"
PROMPT_TOKENS, DECODE, SEED = 16, 24, 0
SLOT_FRACTION = 0.25


def decode_rate(llm: LLM, prompts: list[list[int]], torch_paths: bool) -> float:
    switch = native.torch_paths() if torch_paths else contextlib.nullcontext()
    with switch:
        def run(n: int) -> None:
            llm.generate(prompt_token_ids=prompts, max_tokens=n, temperature=0.0,
                         ignore_eos=True)
        start = time.perf_counter()
        run(1)
        middle = time.perf_counter()
        run(1 + DECODE)
        full = time.perf_counter() - middle
    return len(prompts) * DECODE / max(full - (middle - start), 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = next(iter(ensure_demo_models(args.home or default_home(), "bench", 0.0,
                                        ("olmoe",)).values()))
    ckpt = Checkpoint(path)
    expert_bytes = ckpt.expert_nbytes * len(ckpt.experts)
    models = {"resident": LLM(path, dtype="bfloat16"),
              "25% slots": LLM(path, dtype="bfloat16",
                               expert_memory=int(SLOT_FRACTION * expert_bytes))}
    rng = random.Random(SEED)
    results: dict[str, dict[str, list[float]]] = {}
    with torch.inference_mode():
        for n in (1, 8):
            prompts = [[rng.randrange(1, ckpt.spec.vocab_size) for _ in range(PROMPT_TOKENS)]
                       for _ in range(n)]
            variants = [(m, t) for m in models for t in (False, True)]
            for llm in models.values():                       # warm at this shape
                llm.generate(prompt_token_ids=prompts, max_tokens=3, temperature=0.0)
            for rep in range(args.repeats):
                for model, torch_paths in variants[rep % 4:] + variants[:rep % 4]:
                    key = f"{model}, {'torch paths' if torch_paths else 'native'}"
                    rate = decode_rate(models[model], prompts, torch_paths)
                    results.setdefault(str(n), {}).setdefault(key, []).append(rate)
                    print(f"{n} seqs {key}: {rate:.1f} tok/s", flush=True)
    write(results, args)


def write(results: dict, args: argparse.Namespace) -> None:
    meta = {"command": ".venv/bin/python -m mox.bench.micro.paged_decode"
                       + (f" --home {args.home}" if args.home else "")
                       + f" --repeats {args.repeats}",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
            "git_head": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True,
                                       cwd=Path(__file__).parent).stdout.strip(),
            "threads": torch.get_num_threads()}
    medians = {n: {k: statistics.median(v) for k, v in per.items()}
               for n, per in results.items()}
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "paged_decode.json").write_text(json.dumps(
        {**meta, "tok_s": results, "median_tok_s": medians}, indent=1) + "\n")
    lines = ["# Paged decode with and without the native CPU kernels (bench olmoe, bf16)", "",
             *(f"- {k}: {v}" for k, v in meta.items()), "",
             "| seqs | experts | native tok/s | torch paths tok/s | native / torch paths |",
             "|---|---|---|---|---|"]
    for n, per in medians.items():
        for model in ("resident", "25% slots"):
            on, off = per[f"{model}, native"], per[f"{model}, torch paths"]
            lines.append(f"| {n} | {model} | {on:.1f} | {off:.1f} | {on / off:.2f} |")
    (RESULTS_DIR / "paged_decode.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
