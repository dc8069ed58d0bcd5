"""A/B of whole decode steps, a git revision (`--base`) against the working tree, in
alternated processes on the same bench olmoe: what a step spends outside the native calls
(the engine, the runner, the pager's bookkeeping, sampling: Python that the kernels' weight
reads have pushed out of the caches) is a few percent of a step, below this VM's drift from
one run to the next (30-50% in read rate), so only alternated passes measure a change to it.

Each pass is a fresh process that decodes `--tokens` tokens greedily for `--seqs` sequences
of 16-token prompts (after a warm-up), timing the steps and the time inside the native
library's calls (`decode_layers`, `gemv`, `rms_norm`, `route`), through the public API both
trees share.
Figures per pass: ms a step, ms in native calls, the rest ("outside"), and the median gap
between two decode_layers calls (a step's own Python inside a run of steps); then the medians
and new / base.

    .venv/bin/python -m mox.bench.micro.step_ab --base REV [--seqs 1,8] [--pairs 3]
        [--home DIR] [--name NAME]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mox.bench.machine import describe
from mox.demo import default_home

RESULTS_DIR = Path(__file__).parent.parent / "results"
FIGURES = ("step_ms", "native_ms", "outside_ms", "between_ms")
REPO = Path(__file__).resolve().parent.parent.parent

# Run in a child as `python -c CHILD ROOT HOME SEQS TOKENS`: imports mox from ROOT (the
# editable install's finder dropped), so the same code measures either tree.
CHILD = r'''
import json, random, sys, time
root, home, seqs, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, root)
import torch
from mox import LLM
from mox.demo import ensure_demo_models
from mox.kernels import native
path = next(iter(ensure_demo_models(home, "bench", 0.0, ("olmoe",)).values()))
llm = LLM(path, dtype="bfloat16", max_batched_tokens=1024)
kernels, inside, gaps, last = native.kernels(), [0.0], [], [None]
def timed(call, chained):
    def wrapper(*args):
        start = time.perf_counter()
        if chained and last[0] is not None:       # since the previous decode_layers call
            gaps.append(start - last[0])
        try:
            return call(*args)
        finally:
            inside[0] += time.perf_counter() - start
            if chained:
                last[0] = time.perf_counter()
    return wrapper
for name in ("_decode_layers", "_gemv", "_norm", "_route"):
    setattr(kernels, name, timed(getattr(kernels, name), name == "_decode_layers"))
rng = random.Random(0)
prompts = [[rng.randrange(1, 30000) for _ in range(16)] for _ in range(seqs)]
def run(n):
    inside[0], start = 0.0, time.perf_counter()
    gaps.clear()
    last[0] = None
    llm.generate(prompt_token_ids=prompts, max_tokens=n, temperature=0.0, ignore_eos=True)
    return time.perf_counter() - start, inside[0]
with torch.inference_mode():
    run(3)
    (t1, n1), (t2, n2) = run(1), run(1 + tokens)      # the decode steps: the difference
step, native_s = (t2 - t1) / tokens, (n2 - n1) / tokens
gaps.sort()
print(json.dumps({"step_ms": step * 1e3, "native_ms": native_s * 1e3,
                  "outside_ms": (step - native_s) * 1e3,
                  "between_ms": gaps[len(gaps) // 2] * 1e3 if gaps else float("nan")}))
'''


def measure(root: str, home: str, seqs: int, tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, root, home, str(seqs), str(tokens)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against")
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--home", default=None, help="MOX_HOME (default $MOX_HOME or ~/.cache/mox)")
    ap.add_argument("--name", default="step_ab")
    args = ap.parse_args(argv)
    home = args.home or default_home()
    git = ["git", "-C", str(REPO)]
    def git_out(*words: str) -> str:
        return subprocess.run([*git, *words], check=True, capture_output=True,
                              text=True).stdout.strip()

    rev, uptime = git_out("rev-parse", "--short", args.base), subprocess.run(
        ["uptime"], capture_output=True, text=True).stdout.strip()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    command = " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"# Decode steps A/B: the working tree against {rev}", "",
             f"- command: .venv/bin/python -m mox.bench.micro.step_ab {command}",
             f"- date: {date}",
             f"- uptime: {uptime}", f"- machine: {describe()}",
             f"- tree: {git_out('rev-parse', '--short', 'HEAD')} and its uncommitted changes",
             f"- decode tokens per pass: {args.tokens}", "",
             "Passes alternate base, new (then new, base), each a fresh process. Cells: ms a "
             "step, pass by pass: the whole step, inside the native calls, outside them; and "
             "the median time from the end of one decode_layers call to the start of the next "
             "(within a run of decode steps, the Python of one step: picking its tokens, "
             "counting the hold's experts, the next call's arguments).", ""]
    with tempfile.TemporaryDirectory() as scratch:
        base = os.path.join(scratch, "base")
        subprocess.run([*git, "worktree", "add", "--detach", "-q", base, rev], check=True)
        try:
            for seqs in (int(s) for s in args.seqs.split(",")):
                passes = {"base": [], "new": []}
                for i in range(2 * args.pairs):
                    order = ("base", "new") if (i // 2) % 2 == 0 else ("new", "base")
                    which = order[i % 2]
                    passes[which].append(measure(base if which == "base" else str(REPO),
                                                 home, seqs, args.tokens))
                    print(seqs, which, passes[which][-1], flush=True)
                lines += [f"## {seqs} sequence{'s' if seqs > 1 else ''}", "",
                          "| | step | native calls | outside | between chained calls |",
                          "|---|---|---|---|---|"]
                for which, runs in passes.items():
                    cells = [" / ".join(f"{r[k]:.2f}" for r in runs) for k in FIGURES]
                    lines.append(f"| {which} | " + " | ".join(cells) + " |")
                medians = {w: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                           for w, runs in passes.items()}
                lines.append("| new / base (medians) | " + " | ".join(
                    f"{medians['new'][k] / medians['base'][k]:.2f}" for k in FIGURES) + " |")
                lines.append("")
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", base], check=True)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
