"""Cold-start time to first token (TTFT) of the bench-size olmoe (8 layers x 64 experts of
3 MiB, top-4: 1.6 GB of experts, 0.2 GB dense) for prompts of 8, 32 and 256 random tokens.

Each trial is cold: the checkpoint's files are evicted from the page cache (fdatasync, then
posix_fadvise DONTNEED; mincore confirms). TTFT = wall time from constructing the model (dense
weights are read then) to the first token (prefill + argmax). Variants, round-robin:
  paging        LLM(expert_memory=every expert's bytes): experts page in as routed (the
                default: no predictive prefetch on CPU). paging+pf: layer L+1's predicted
                experts also prefetch while L computes
  whole-model   LLM(expert_memory=None): every expert read at construction, then the prompt
  lazy-mmap     the pager filling slots from safetensors' mmap-backed tensors (page faults)
  warm          the paging LLM again on the same prompt (page cache warm, 0 misses): compute
Per repeat, disk bandwidth = cold `dd bs=16M` over the shards. Needed bytes = dense + routed
experts (paging's misses: each routed expert misses once) x expert bytes; bound =
needed / bandwidth. Split: construct; "in pager" = time the forward spends inside waves()
and prefetch() (waiting for expert reads); compute = the rest; disk busy = wall time with an
expert read in flight; CPU = the process's user+sys seconds (2 cores: I/O costs CPU too).
Medians over repeats (best in brackets: others' load only ever adds); compare within a run.

    .venv/bin/python -m mox.bench.micro.coldstart [--home DIR] [--lengths 8,32,256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors import safe_open

import mox.pager.model_pool
from mox import LLM
from mox.demo import default_home, ensure_demo_models
from mox.loaders import Checkpoint, page_cache
from mox.loaders.stream import StreamingReader
from mox.models import load_model
from mox.pager import ExpertPager, ModelPool
from mox.pager.expert_loader import FROM_DISK, ExpertLoader, LoadResult

RESULTS_DIR = Path(__file__).parent.parent / "results"
VARIANTS = ("paging", "paging+pf", "whole-model", "lazy-mmap")
SPLIT = ("ttft_s", "construct_s", "pager_s", "compute_s", "disk_busy_s", "cpu_s")
WARM_RUNS = 2          # warm TTFT is the min of these (the first may still grow buffers)
SLACK = 1.2            # the target: paging <= SLACK x bound + warm
TARGETS = ((f"paging TTFT <= {SLACK} x bound + warm TTFT", None, "paging_over_target", 1.0),
           ("paging TTFT <= 0.5 x whole-model load at 8 tokens", (8,), "paging_over_whole", 0.5),
           ("paging never slower than whole-model load", None, "paging_over_whole", 1.0))


def evict(path: str) -> int:
    """Drop the checkpoint from the page cache; returns the bytes still resident."""
    files = [os.path.join(path, f) for f in sorted(os.listdir(path))]
    for name in files:
        page_cache.evict(name)
    return sum(map(page_cache.resident_bytes, files))


def machine_load() -> str:
    """1-minute load average and the share of the last 60 s that some task waited on I/O."""
    with open("/proc/pressure/io") as f:
        io_wait = f.readline().split()[2].split("=")[1]
    return f"load {os.getloadavg()[0]:.1f}, io pressure {io_wait}%"


def dd_gbps(path: str) -> float:
    shards = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    evict(path)
    start = time.perf_counter()
    for shard in shards:
        subprocess.run(["dd", f"if={shard}", "of=/dev/null", "bs=16M"], capture_output=True,
                       check=True)
    return sum(map(os.path.getsize, shards)) / (time.perf_counter() - start) / 1e9


class Probe:
    """Wraps a model pool's waves() and prefetch() and its loader's load() (instance
    attributes, public methods) to time the forward's waits and when an expert read is in
    flight."""

    def __init__(self, pool: ModelPool) -> None:
        self.pager_s, self.reads = 0.0, []      # reads: (start, end) of each expert load
        self._waves, self._prefetch, self._load = pool.waves, pool.prefetch, pool.loader.load
        pool.waves, pool.prefetch, pool.loader.load = self.waves, self.prefetch, self.load

    def _timed(self, fn, *args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        self.pager_s += time.perf_counter() - start
        return result

    def waves(self, *args):
        inner = self._waves(*args)
        while (lease := self._timed(next, inner, None)) is not None:
            yield lease

    def prefetch(self, *args, **kwargs) -> None:
        self._timed(self._prefetch, *args, **kwargs)

    def load(self, *args, **kwargs) -> LoadResult:
        start = time.perf_counter()
        result = self._load(*args, **kwargs)
        self.reads.append((start, time.perf_counter()))
        return result

    def disk_busy_s(self) -> float:
        """Wall time with at least one expert read in flight (union of intervals)."""
        busy, end = 0.0, float("-inf")
        for start, stop in sorted(self.reads):
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
        return busy


class MmapExpertLoader(ExpertLoader):
    """Slots filled from safetensors' mmap-backed tensors: bytes fault in during the copy.
    The StreamingReader only lends its I/O threads (the pager submits loads through it)."""

    def __init__(self) -> None:
        super().__init__(StreamingReader(), None)
        self._handles: dict[str, object] = {}
        self._lock = threading.Lock()

    def _tensor(self, file: str, name: str) -> torch.Tensor:
        with self._lock:                      # one safe_open (one mmap) per shard
            if file not in self._handles:
                self._handles[file] = safe_open(file, "pt")
            return self._handles[file].get_tensor(name)

    def load(self, pool, index, tensors, cache_key, label, *_cuda, **_cuda_kw) -> LoadResult:
        start = time.perf_counter()
        slots = (pool.w13[index, :pool.inter], pool.w13[index, pool.inter:], pool.w2[index])
        for info, slot in zip((tensors.gate, tensors.up, tensors.down), slots):
            slot.copy_(self._tensor(info.file, info.name))
        return LoadResult(FROM_DISK, tensors.nbytes, time.perf_counter() - start)


def run(variant: str, path: str, ids: list[int], budget: int) -> dict:
    """One cold trial, then WARM_RUNS warm ones on the same model."""
    resident = evict(path)
    start, cpu = time.perf_counter(), sum(os.times()[:2])   # user + sys
    if variant == "lazy-mmap":
        # the pager over a loader that faults experts in from safetensors' mmap (not mox's
        # reader): the one variant built outside the router, to swap its loader
        ckpt, device = Checkpoint(path), torch.device("cpu")
        pool = ExpertPager(MmapExpertLoader()).add_model(ckpt.path, ckpt, torch.bfloat16,
                                                         device, budget // ckpt.expert_nbytes)
        model = load_model(ckpt, torch.bfloat16, device, pool)
        first = lambda: int(model.forward(torch.tensor(ids), model.new_cache())[-1].argmax())
    else:
        llm = LLM(path, expert_memory=None if variant == "whole-model" else budget,
                  prefetch=variant == "paging+pf")
        ckpt, pool = llm.checkpoint, llm.pool
        first = lambda: llm.generate(prompt_token_ids=[ids], max_tokens=1, temperature=0.0,
                                     ignore_eos=True)[0].token_ids[0]
    construct = time.perf_counter() - start
    probe = Probe(pool)
    row = {"resident_after_evict": resident, "token": first(),
           "ttft_s": time.perf_counter() - start, "cpu_s": sum(os.times()[:2]) - cpu,
           "construct_s": construct, "pager_s": probe.pager_s,
           "disk_busy_s": probe.disk_busy_s(), "stats": pool.stats()}
    row["compute_s"] = row["ttft_s"] - construct - probe.pager_s
    for _ in range(WARM_RUNS):
        start = time.perf_counter()
        first()
        row["warm_s"] = min(row.get("warm_s", 1e9), time.perf_counter() - start)
    row["warm_misses"] = pool.stats()["misses"] - row["stats"]["misses"]
    pool.loader.reader.close()
    return row


def summarize(n: int, trials: dict[str, list[dict]], gbps: float, dense: int,
              expert_bytes: int) -> dict:
    median = {v: {k: statistics.median(t[k] for t in rows) for k in SPLIT}
              for v, rows in trials.items()}
    assert trials["paging"][0]["stats"]["prefetches"] == 0, "routed experts = paging's misses"
    routed = trials["paging"][0]["stats"]["misses"]
    needed = dense + routed * expert_bytes
    bound = needed / (gbps * 1e9)
    warm = statistics.median(t["warm_s"] for t in trials["paging"])
    paging, whole = median["paging"]["ttft_s"], median["whole-model"]["ttft_s"]
    return {"tokens": n, "routed_experts": routed, "needed_bytes": needed, "bound_s": bound,
            "warm_s": warm, "median": median,
            "best_ttft_s": {v: min(t["ttft_s"] for t in rows) for v, rows in trials.items()},
            "paging_over_target": paging / (SLACK * bound + warm),
            "paging_over_whole": paging / whole,
            "tokens_agree": len({t["token"] for rows in trials.values() for t in rows}) == 1,
            "trials": trials}


def evaluate_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets as (text, lengths it applies to (None: all), ratio, limit)."""
    results = []
    for text, lengths, ratio, limit in TARGETS:
        checked = {r["tokens"]: round(r[ratio], 2) for r in rows
                   if lengths is None or r["tokens"] in lengths}
        met = all(value <= limit for value in checked.values())
        status = "not measured" if not checked else ("met" if met else "NOT met")
        results.append({"target": text, "status": status, "ratio_by_tokens": checked})
    return results


def markdown_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(row) + " |" for row in [head, ["---"] * len(head), *rows]]


def format_tables(rows: list[dict]) -> str:
    summary = markdown_table(
        ["tokens", "routed experts", "needed MB", "bound s", "warm s",
         *[f"{v} s (best)" for v in VARIANTS], "paging / (1.2 bound + warm)", "paging / whole"],
        [[str(r["tokens"]), f"{r['routed_experts']}/512", f"{r['needed_bytes'] / 1e6:.0f}",
          f"{r['bound_s']:.2f}", f"{r['warm_s']:.2f}",
          *[f"{r['median'][v]['ttft_s']:.2f} ({r['best_ttft_s'][v]:.2f})" for v in VARIANTS],
          f"{r['paging_over_target']:.2f}", f"{r['paging_over_whole']:.2f}"] for r in rows])
    split = markdown_table(
        ["tokens", "variant", "TTFT s", "construct s", "in pager s", "compute s",
         "disk busy s", "CPU s", "disk MB", "prefetch hits", "misses"],
        [[str(r["tokens"]), v, *[f"{r['median'][v][k]:.2f}" for k in SPLIT],
          f"{r['trials'][v][0]['stats']['bytes_read_disk'] / 1e6:.0f}",
          str(r["trials"][v][0]["stats"]["prefetch_hits"]),
          str(r["trials"][v][0]["stats"]["misses"])] for r in rows for v in VARIANTS])
    return "\n".join([*summary, "", *split])


def write_results(meta: dict, rows: list[dict], targets: list[dict], table: str) -> None:
    RESULTS_DIR.mkdir(exist_ok=True)
    report = {**meta, "rows": rows, "targets": targets}
    (RESULTS_DIR / "coldstart.json").write_text(json.dumps(report, indent=2) + "\n")
    notes = [f"- {key}: {value}" for key, value in meta.items()]
    verdicts = [f"- {t['status']}: {t['target']} (ratio by tokens: {t['ratio_by_tokens']})"
                for t in targets]
    text = "\n".join(["# Cold-start TTFT: expert paging vs whole-model load vs lazy mmap", "",
                      *notes, "", table, "", "## Targets", "", *verdicts, ""])
    (RESULTS_DIR / "coldstart.md").write_text(text)
    print(text)


def run_metadata(argv: list[str], path: str, dense: int, budget: int) -> dict:
    """Taken at start-up: mox/ is edited concurrently, so pin the code that was imported."""
    pager_hash = hashlib.sha256(Path(mox.pager.model_pool.__file__).read_bytes()).hexdigest()[:12]
    git = ["git", "-C", str(Path(__file__).parent.parent)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", ":/mox", ":/loaders",
                            ":/kernels"], capture_output=True, text=True).stdout.split("\n")
    return {"command": shlex.join([".venv/bin/python", "-m", "mox.bench.micro.coldstart", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_head": commit, "uncommitted_in_mox": [d.strip() for d in dirty if d],
            "model_pool_py_sha256": pager_hash, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "checkpoint": path, "dense_bytes": dense,
            "expert_bytes_total": budget}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mox.bench.micro.coldstart",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", default=default_home(), help="MOX_HOME (default %(default)s)")
    parser.add_argument("--lengths", default="8,32,256", help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    path = next(iter(ensure_demo_models(args.home, "bench", 0.0, ("olmoe",)).values()))
    ckpt = Checkpoint(path)
    expert_names = {t.name for e in ckpt.experts.values() for t in (e.gate, e.up, e.down)}
    dense = sum(i.nbytes for name, i in ckpt.tensors.items() if name not in expert_names)
    budget = len(ckpt.experts) * ckpt.expert_nbytes          # every expert fits: no evictions
    meta = run_metadata(argv, path, dense, budget)
    rng = random.Random(0)
    lengths = [int(n) for n in args.lengths.split(",")]
    prompts = {n: [rng.randrange(ckpt.spec.vocab_size) for _ in range(n)] for n in lengths}
    run("paging", path, prompts[lengths[0]], budget)      # warm-up: imports, kernel set-up
    trials = {n: {v: [] for v in VARIANTS} for n in lengths}
    bandwidths, load_avgs = [], []
    for repeat in range(args.repeats):
        load_avgs.append(machine_load())      # other work on the machine skews every timing
        bandwidths.append(dd_gbps(path))
        for n in lengths:
            for v in VARIANTS:
                trials[n][v].append(run(v, path, prompts[n], budget))
                gc.collect()                  # the last model's pool goes before the next
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    gbps = statistics.median(bandwidths)
    rows = [summarize(n, trials[n], gbps, dense, ckpt.expert_nbytes) for n in lengths]
    table, targets = format_tables(rows), evaluate_targets(rows)
    whole_s = statistics.median(t["construct_s"] for n in lengths
                                for t in trials[n]["whole-model"])
    meta.update(machine_load_per_repeat=load_avgs, dd_gbps_median=round(gbps, 3),
                dd_gbps_per_repeat=[round(b, 3) for b in bandwidths],
                whole_model_construct_gbps=round((dense + budget) / whole_s / 1e9, 3))
    write_results(meta, rows, targets, table)


if __name__ == "__main__":
    main()
