"""Quantized experts against bf16 experts on the bench olmoe (8 layers x 64 experts of 3 MiB
in bf16, top-4; experts are under half of a token's bytes there), or with `--preset experts`
Mixtral's proportions (8 layers x 8 experts of 22 MiB, top-2: three quarters), each format
imported as `mox models import --quantize` writes it (quantized, then repacked expert-major):

  bytes      one expert as stored (weights + scales), and the share of bf16's
  decode     tok/s at 1 and 8 sequences (the prefill timed apart and subtracted), every
             expert resident, bf16 activations; every format loaded at once and timed in
             rounds, each format first in turn, a repeat's figure its rounds' median, so the
             ratios to bf16 come from the same minutes
  cold TTFT  8- and 32-token prompts with the checkpoint evicted from the page cache
             (posix_fadvise DONTNEED, mincore-checked), pool sized for every expert; in
             rounds that take every format back to back, each format first in turn, since
             this VM's disk reads 0.4-1.9 GB/s from one minute to the next: a ratio to bf16
             comes from one round, and a repeat's figure is its rounds' median
  agreement  the demo models (GPT-OSS's fused experts aside), experts int8 vs bf16, over 8
             seeded prompts: share of the first 32 greedy tokens that are equal
             (free-running: one flip changes all after it), int8's top-1 at each of bf16's 32
             positions (teacher-forced), and the largest logit difference over those positions

    .venv/bin/python -m mox.bench.micro.quantized [--home DIR] [--repeats 2] [--out FILE]
        [--preset bench|experts]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from mox import LLM
from mox.bench.micro.coldstart import evict, machine_load
from mox.demo import DEMO_ARCHITECTURES, default_home, ensure_demo_models, ensure_quantized
from mox.kernels.quant import IMPORT_FORMATS
from mox.loaders import Checkpoint

RESULTS = Path(__file__).parent.parent / "results" / "quantized.md"
BF16 = "bf16"
DECODE_TOKENS = 32
TIMED_CALLS = 3       # per figure; this 2-core VM's neighbours add noise, never remove it
BATCHES = (1, 8)
COLD_LENGTHS = (8, 32)
COLD_ROUNDS = 4       # per repeat and prompt length: every format once a round
# per repeat and batch: every format's decode once a round, each first in turn (the memory's
# read rate moves 30-50% from one minute to the next on this VM: formats measured one after
# another, each loaded, timed at every batch and dropped, compared different minutes)
DECODE_ROUNDS = 3
AGREEMENT_TOKENS = 32
AGREEMENT_PROMPTS = 8


def decode_rate(llm: LLM, prompts: list[list[int]]) -> float:
    """Decode tokens/s: the time of DECODE_TOKENS more steps after the prefill (prefill alone
    timed apart and subtracted: quantized prefills dequantize, decode does not)."""
    def run(max_tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, max_tokens=max_tokens, temperature=0.0,
                     ignore_eos=True)
        return time.perf_counter() - start
    prefill = min(run(1) for _ in range(TIMED_CALLS))       # the least disturbed of each
    return len(prompts) * DECODE_TOKENS / (min(run(DECODE_TOKENS + 1)
                                               for _ in range(TIMED_CALLS)) - prefill)


def cold_ttft(path: str, prompt: list[int]) -> float:
    """In a fresh child process each time, as a server starts cold: rounds of LLMs in one
    process once filled this VM's 23 GB (idle I/O threads held each one's pool; fixed in
    loaders/io_pool.py), and nothing of one trial's allocations helps the next."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(_cold_ttft, path, prompt).result()


def _cold_ttft(path: str, prompt: list[int]) -> float:
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    evict(path)
    start = time.perf_counter()
    llm = LLM(path, expert_memory=len(Checkpoint(path).experts) * Checkpoint(path).expert_nbytes)
    llm.generate(prompt_token_ids=[prompt], max_tokens=1, temperature=0.0, ignore_eos=True)
    return time.perf_counter() - start


def agreement(home: str) -> list[dict]:
    """Per demo model, over `AGREEMENT_PROMPTS` seeded 16-token prompts: `agreement_row`."""
    rows = []
    architectures = tuple(a for a in DEMO_ARCHITECTURES if a != "gpt_oss")   # fused experts
    for name, path in ensure_demo_models(home, architectures=architectures).items():
        rng = random.Random(0)
        vocab = Checkpoint(path).spec.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(16)] for _ in range(AGREEMENT_PROMPTS)]
        rows.append(agreement_row(name, path, ensure_quantized(home, path, "int8"), prompts))
    return rows


def agreement_row(name: str, path: str, quantized: str, prompts: list[list[int]]) -> dict:
    """int8 experts (`quantized`) against bf16 (`path`), over `prompts`: free-running greedy
    (share of the first 32 tokens equal, and where they first differ: the median prompt's)
    and teacher-forced (int8's argmax at each of bf16's 32 positions), pooled over the
    prompts; one prompt's 32 positions made the share move 3 points a flip. Beside them, the
    same shares for the model in float32 against bf16 (`control_*`): how far rounding alone,
    with no quantization, moves the model."""
    llms = {BF16: LLM(path), "int8": LLM(quantized), "fp32": LLM(path, dtype="float32")}
    shares = {other: {"equal": [], "firsts": [], "forced": [], "max_diff": 0.0}
              for other in ("int8", "fp32")}
    logit_range = 0.0
    for prompt in prompts:
        tokens = {label: llm.generate(prompt_token_ids=[prompt], max_tokens=AGREEMENT_TOKENS,
                                      temperature=0.0, ignore_eos=True)[0].token_ids
                  for label, llm in llms.items()}
        base = tokens[BF16]
        teacher = torch.tensor(prompt + base)
        logits = {label: llm.model.forward(teacher, llm.model.new_cache())[
            len(prompt) - 1:-1].float() for label, llm in llms.items()}        # [32, V]
        for other, share in shares.items():
            share["equal"].append(sum(a == b for a, b in zip(base, tokens[other])) / len(base))
            share["firsts"].append(next((i for i, (a, b) in enumerate(zip(base, tokens[other]))
                                         if a != b), len(base)))
            share["forced"].append(float((logits[BF16].argmax(-1)
                                          == logits[other].argmax(-1)).float().mean()))
            share["max_diff"] = max(share["max_diff"],
                                    float((logits[BF16] - logits[other]).abs().max()))
        logit_range = max(logit_range, float(logits[BF16].abs().max()))
    quant, control = shares["int8"], shares["fp32"]
    return {"model": name, "equal": statistics.mean(quant["equal"]),
            "first_difference": statistics.median(quant["firsts"]),
            "forced": statistics.mean(quant["forced"]),
            "forced_per_prompt": quant["forced"], "max_logit_diff": quant["max_diff"],
            "logit_range": logit_range,
            "control_equal": statistics.mean(control["equal"]),
            "control_first_difference": statistics.median(control["firsts"]),
            "control_forced": statistics.mean(control["forced"]),
            "control_max_logit_diff": control["max_diff"]}


def measure(home: str, repeats: int, preset: str) -> dict:
    source = next(iter(ensure_demo_models(home, preset, 0.0, ("olmoe",)).values()))
    paths = {BF16: source,
             **{kind: ensure_quantized(home, source, kind) for kind in IMPORT_FORMATS}}
    sizes = {kind: Checkpoint(p).expert_nbytes for kind, p in paths.items()}
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(32)] for _ in range(max(BATCHES))]
    decode = {kind: {b: [] for b in BATCHES} for kind in paths}
    cold = {kind: {n: [] for n in COLD_LENGTHS} for kind in paths}   # [repeat][round]
    loads = []
    kinds = list(paths)
    for repeat in range(repeats):
        loads.append(machine_load())
        llms = {kind: LLM(path) for kind, path in paths.items()}
        for llm in llms.values():
            decode_rate(llm, prompts[:1])                         # warm-up
        for b in BATCHES:
            rounds: dict[str, list[float]] = {kind: [] for kind in kinds}
            for round_ in range(DECODE_ROUNDS):
                first = round_ % len(kinds)
                for kind in kinds[first:] + kinds[:first]:
                    rounds[kind].append(decode_rate(llms[kind], prompts[:b]))
            for kind in kinds:
                decode[kind][b].append(statistics.median(rounds[kind]))
        del llms, llm
        for n in COLD_LENGTHS:
            for kind in kinds:
                cold[kind][n].append([])
            for round_ in range(COLD_ROUNDS):
                first = round_ % len(kinds)
                for kind in kinds[first:] + kinds[:first]:
                    cold[kind][n][-1].append(cold_ttft(paths[kind], prompts[0][:n]))
        print(f"repeat {repeat + 1}/{repeats} done", file=sys.stderr)
    return {"preset": preset, "sizes": sizes, "decode": decode, "cold": cold, "loads": loads,
            "agreement": agreement(home)}


def _runs(values: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return " / ".join(fmt.format(v * scale) for v in values)


def markdown(r: dict, argv: list[str]) -> str:
    lines = [f"# Quantized experts vs bf16 ({r['preset']} olmoe)\n\n"
             f"`python -m mox.bench.micro.quantized "
             f"{' '.join(argv)}`, {time.strftime('%Y-%m-%dT%H:%M:%S%z')}, "
             f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; before each "
             f"repeat: {'; '.join(r['loads'])}. Each figure: the repeats in order (cold TTFT: the "
             f"median of {COLD_ROUNDS} rounds, and of the rounds' ratios to bf16).\n",
             "| experts | bytes / expert | of bf16 | " + " | ".join(
                 f"decode tok/s @{b} | vs bf16 @{b}" for b in BATCHES) + " | " + " | ".join(
                 f"cold TTFT {n} tok s | vs bf16" for n in COLD_LENGTHS) + " |",
             "|---" * (3 + 2 * len(BATCHES) + 2 * len(COLD_LENGTHS)) + "|"]
    base = r["sizes"][BF16]
    for kind, size in r["sizes"].items():
        cells = [kind, str(size), f"{size / base:.2f}"]
        for b in BATCHES:
            runs, ref = r["decode"][kind][b], r["decode"][BF16][b]
            cells += [_runs(runs), _runs([v / w for v, w in zip(runs, ref)], fmt="{:.2f}x")]
        for n in COLD_LENGTHS:             # per repeat: the median round
            runs, ref = r["cold"][kind][n], r["cold"][BF16][n]
            cells += [_runs([statistics.median(rounds) for rounds in runs], fmt="{:.2f}"),
                      _runs([statistics.median(v / w for v, w in zip(rounds, base_rounds))
                             for rounds, base_rounds in zip(runs, ref)], fmt="{:.2f}x")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Agreement, int8 experts vs bf16 (demo models, greedy, {AGREEMENT_PROMPTS} "
              "seeded 16-token prompts pooled; first difference: the median prompt's):", "",
              *agreement_lines(r["agreement"])]
    return "\n".join(lines) + "\n"


def agreement_lines(rows: list[dict]) -> list[str]:
    """`agreement_row`s as a markdown table and the shares' mean and lowest."""
    lines = ["| model | free-running: first 32 equal | first difference at | teacher-forced "
             "top-1 equal | max logit diff (forced) | max abs logit | control, float32 vs "
             "bf16: free-running, first difference, teacher-forced, max logit diff |",
             "|---|---|---|---|---|---|---|"]
    for a in rows:
        lines.append(f"| {a['model']} | {a['equal']:.0%} | {a['first_difference']} | "
                     f"{a['forced']:.0%} | {a['max_logit_diff']:.3f} | {a['logit_range']:.2f} | "
                     f"{a['control_equal']:.0%}, {a['control_first_difference']}, "
                     f"{a['control_forced']:.0%}, {a['control_max_logit_diff']:.3f} |")
    for key, label in (("equal", "free-running"), ("forced", "teacher-forced"),
                       ("control_equal", "control free-running"),
                       ("control_forced", "control teacher-forced")):
        shares = [a[key] for a in rows]
        lines.append(f"\n{label}: mean {statistics.mean(shares):.0%}, lowest {min(shares):.0%}.")
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", default=default_home())
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--preset", choices=("bench", "experts"), default="bench")
    args = parser.parse_args(argv)
    result = measure(args.home, args.repeats, args.preset)
    Path(args.out).write_text(markdown(result, argv))
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
