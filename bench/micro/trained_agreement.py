"""int8 experts against bf16 on demo models trained a little, where the next token is not a
near-tie.

The demo models' weights are random, so their next-token logits are nearly flat: float32
against bf16, with no quantization at all, keeps only ~60% of 32 free-running greedy tokens
(`mox.bench.micro.quantized`'s control), and that share measures the ties, not int8. Here
each demo model is first trained with transformers (the tests' oracle, not a runtime
dependency) on sequences from a fixed random Markov chain over part of its vocabulary whose
next-token probabilities are peaked as a language's are (each token has a few likely
successors), written back in its own layout (config, tokenizer and tensor names as built),
imported int8 as `mox models import --quantize int8` does, and both are served by mox:
`quantized.agreement_row` on prompts drawn from the chain.

    .venv/bin/python -m mox.bench.micro.trained_agreement [--home DIR] [--steps 300]
        [--architectures olmoe ...] [--seed 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from mox.bench.machine import describe
from mox.bench.micro.quantized import AGREEMENT_PROMPTS, agreement_lines, agreement_row
from mox.demo import (
    DEMO_ARCHITECTURES,
    DEMO_SHARD_BYTES,
    default_home,
    ensure_demo_models,
    ensure_quantized,
)
from mox.loaders import Checkpoint
from mox.loaders.writer import write_sharded

RESULTS = Path(__file__).parent.parent / "results" / "trained_agreement.md"
# each token's successors and their probabilities: a top-1 margin of ln(0.55 / 0.2) ~ 1 nat
SUCCESSOR_PROBS = np.array([0.55, 0.2, 0.15, 0.1])
CHAIN_TOKENS = 512          # the chain's vocabulary: the first ids (a model learns it in minutes)
SEQUENCE_TOKENS = 64
BATCH = 16
LEARNING_RATE = 3e-3
PROMPT_TOKENS = 16
SEED = 0
# the quantized bench's demo models (GPT-OSS's fused experts aside)
ARCHITECTURES = tuple(a for a in DEMO_ARCHITECTURES if a != "gpt_oss")
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


class Chain:
    """A first-order Markov chain over ids [0, CHAIN_TOKENS): each id's successors are
    `len(SUCCESSOR_PROBS)` distinct ids drawn once from the seed."""

    def __init__(self, seed: int = SEED) -> None:
        self.rng = np.random.default_rng(seed)
        self.successors = np.stack([self.rng.choice(CHAIN_TOKENS, len(SUCCESSOR_PROBS),
                                                    replace=False)
                                    for _ in range(CHAIN_TOKENS)])

    def sample(self, count: int, length: int) -> np.ndarray:
        """`count` sequences of `length` ids `[count, length]`."""
        out = np.empty((count, length), dtype=np.int64)
        out[:, 0] = self.rng.integers(CHAIN_TOKENS, size=count)
        for t in range(1, length):
            picks = self.rng.choice(len(SUCCESSOR_PROBS), size=count, p=SUCCESSOR_PROBS)
            out[:, t] = self.successors[out[:, t - 1], picks]
        return out


def train(source: str, out: str, chain: Chain, steps: int, seed: int) -> list[float]:
    """Train the checkpoint at `source` on the chain and write it to `out` in its own layout
    (bf16, its tensor names and shards, its config and tokenizer); returns the losses of the
    first and last tenth of the steps (their means)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        ids = torch.from_numpy(chain.sample(BATCH, SEQUENCE_TOKENS))
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with tempfile.TemporaryDirectory() as saved:
        # transformers fuses some layouts' experts in memory; its save writes the checkpoint's
        # own tensor names back
        model.save_pretrained(saved)
        _write_like(source, out, _read_tensors(saved))
    tenth = max(1, steps // 10)
    return [statistics.mean(losses[:tenth]), statistics.mean(losses[-tenth:])]


def _read_tensors(folder: str) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, file)))
    return state


def _write_like(source: str, out: str, state: dict[str, torch.Tensor]) -> None:
    """`state` under `source`'s tensor names and shapes, in `out`, with its other files."""
    tensors = Checkpoint(source).tensors
    missing = sorted(set(tensors) - set(state))
    if missing:
        raise RuntimeError(f"transformers' state lacks {missing[:3]} of {source}")
    shutil.rmtree(out, ignore_errors=True)
    write_sharded(out, {n: tuple(i.shape) for n, i in tensors.items()}, torch.bfloat16,
                  lambda n: state[n], DEMO_SHARD_BYTES)
    for name in COPIED:
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), os.path.join(out, name))


def measure(home: str, architectures: tuple[str, ...], steps: int, seed: int) -> dict:
    chain = Chain(seed)
    prompts = chain.sample(AGREEMENT_PROMPTS, PROMPT_TOKENS).tolist()
    rows, losses = [], {}
    for name, path in ensure_demo_models(home, architectures=architectures).items():
        trained = os.path.join(home, "trained", f"{name}-trained-{seed}")
        start = time.perf_counter()
        losses[name] = train(path, trained, chain, steps, seed)
        print(f"{name}: trained in {time.perf_counter() - start:.0f} s, loss "
              f"{losses[name][0]:.2f} -> {losses[name][1]:.2f}", file=sys.stderr)
        rows.append(agreement_row(name, trained, ensure_quantized(home, trained, "int8"),
                                  prompts))
    entropy = float(-(SUCCESSOR_PROBS * np.log(SUCCESSOR_PROBS)).sum())
    return {"steps": steps, "seed": seed, "losses": losses, "chain_entropy": entropy,
            "agreement": rows}


def markdown(r: dict, argv: list[str]) -> str:
    lines = [f"# int8 experts vs bf16 on trained demo models\n\n"
             f"`python -m mox.bench.micro.trained_agreement {' '.join(argv)}`, "
             f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}, {describe()}. Each model "
             f"trained {r['steps']} steps ({BATCH} x {SEQUENCE_TOKENS} tokens, AdamW "
             f"{LEARNING_RATE:g}, seed {r['seed']}) on a Markov chain over {CHAIN_TOKENS} ids "
             f"with successor probabilities {SUCCESSOR_PROBS.tolist()} (entropy "
             f"{r['chain_entropy']:.2f} nats, the least loss a model can reach); "
             f"{AGREEMENT_PROMPTS} prompts of {PROMPT_TOKENS} ids drawn from the chain.\n",
             "| model | loss, first tenth -> last tenth of the steps |", "|---|---|"]
    lines += [f"| {name} | {a:.2f} -> {b:.2f} |" for name, (a, b) in r["losses"].items()]
    lines += ["", *agreement_lines(r["agreement"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--home", default=default_home())
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--architectures", nargs="+", default=list(ARCHITECTURES))
    parser.add_argument("--seed", type=int, default=SEED,
                        help="the chain's and the training's (a second run: another seed)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    result = measure(args.home, tuple(args.architectures), args.steps, args.seed)
    Path(args.out).write_text(markdown(result, argv))
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(Path(args.out).read_text())


if __name__ == "__main__":
    main()
