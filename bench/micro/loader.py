"""Cold-read bandwidth of mox's expert reader against raw sequential reads and safetensors.

Every trial starts cold: the checkpoint's files are evicted from the page cache with
`posix_fadvise(DONTNEED)` (no root needed), and mincore (mox.loaders.page_cache) confirms that
under 1% of their bytes remain. Variants, all over the same bench-size checkpoint, run
round-robin per repeat (the order rotating) so that machine noise hits them alike:
  mox-buffered   StreamingReader(direct=False): every expert one `submit` (its gate, up and
                 down ranges), up to `threads` in flight, into a reused [slots, ...] pool,
                 in the pager's order (layer by layer, expert by expert)
  mox-direct     the same with direct=True (O_DIRECT into a bounce buffer, then a copy)
  dd-buffered    `dd if=SHARD of=/dev/null bs=16M` over every shard, whole files
  dd-direct      the same with iflag=direct
  safetensors    `safetensors.torch.load_file(shard)` (default mmap backend), then one byte
                 of every page touched, in case the tensors are lazy mmap views
  safetensors-pread   the same with backend="pread" (for reference; not a target)
mox reads expert bytes only; dd and safetensors read whole files (dense bytes too), so every
variant is reported in GB/s over the bytes it read, never in seconds. CPU seconds per GB
(this process's threads plus dd's) show what a read costs the 2 cores that also compute.

    .venv/bin/python -m mox.bench.micro.loader [--home DIR] [--repeats 3] [--threads 4]

Other benchmarks read the same demo model from the shared MOX_HOME and refill the cache
mid-trial: on a busy machine pass --home with a private directory (the model is built there).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import mmap
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from mox.demo import default_home, ensure_demo_models
from mox.loaders import Checkpoint
from mox.loaders import stream as stream_module
from mox.loaders.page_cache import evict, resident_bytes
from mox.loaders.stream import StreamingReader
from mox.pager.expert_loader import expert_ranges

RESULTS_DIR = Path(__file__).parent.parent / "results"
PAGE = mmap.PAGESIZE
DD_BLOCK = "16M"              # large enough that dd's per-call cost vanishes
MAX_COLD_RESIDENT = 0.01      # a trial starting with more of its files cached is not cold
COLD_ATTEMPTS = 3             # evictions tried before a trial gives up on being cold
WARMUP_EXPERTS = 8            # thread start-up and bounce-buffer allocation stay untimed
TARGET_VS_RAW, TARGET_VS_SAFETENSORS = 0.9, 1.0   # the targets


@dataclass(frozen=True)
class Trial:
    variant: str
    repeat: int
    nbytes: int
    seconds: float
    cpu_seconds: float        # this process (all threads) plus its children (dd)
    resident_before: float    # fraction of the files' bytes in the page cache at the start
    resident_after: float     # and at the end: the memory a read leaves behind in the cache

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


def resident_fraction(files: list[str]) -> float:
    """Fraction of the files' bytes in the page cache (mincore(2))."""
    return sum(map(resident_bytes, files)) / sum(os.path.getsize(f) for f in files)


def make_pool(ckpt: Checkpoint, num_slots: int) -> list[torch.Tensor]:
    """One [num_slots, ...] tensor per expert weight (gate, up, down), as the pager keeps."""
    first = ckpt.experts[min(ckpt.experts)]
    return [torch.zeros((num_slots, *t.shape), dtype=t.dtype)   # zeros: pages faulted now
            for t in (first.gate, first.up, first.down)]


def read_experts(reader: StreamingReader, ckpt: Checkpoint, pool: list[torch.Tensor],
                 keys: list[tuple[int, int]]) -> int:
    """Each expert one submit into slot i % slots; a slot is reused once its read is done."""
    num_slots = pool[0].shape[0]
    pending: deque = deque()
    for i, (layer, expert) in enumerate(keys):
        if len(pending) == num_slots:
            pending.popleft().result()
        ranges = expert_ranges(ckpt.experts[layer, expert], f"layer {layer} expert {expert}")
        pending.append(reader.submit(ranges, [weight[i % num_slots] for weight in pool]))
    for future in pending:
        future.result()
    return sum(ckpt.experts[key].nbytes for key in keys)


def run_dd(files: list[str], direct: bool) -> int:
    flags = ["iflag=direct"] if direct else []
    for path in files:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={DD_BLOCK}", *flags],
                       check=True, capture_output=True)
    return sum(os.path.getsize(path) for path in files)


def load_safetensors(files: list[str], backend: str) -> int:
    for path in files:
        for tensor in load_file(path, backend=backend).values():
            raw = tensor.reshape(-1).view(torch.uint8)   # [nbytes], maybe mmap-backed
            if raw.numel():                              # touch one byte of every page
                raw[::PAGE].sum().item() + raw[-1].item()
    return sum(os.path.getsize(path) for path in files)


def make_variants(ckpt: Checkpoint, files: list[str],
                  thread_counts: list[int]) -> dict[str, Callable[[], int]]:
    keys = sorted(ckpt.experts)                      # the pager's order: layer by layer
    variants: dict[str, Callable[[], int]] = {}
    for threads in thread_counts:
        pool = make_pool(ckpt, threads)              # up to `threads` loads in flight
        suffix = "" if len(thread_counts) == 1 else f"-t{threads}"
        for mode, direct in (("buffered", False), ("direct", True)):
            reader = StreamingReader(num_threads=threads, direct=direct)
            read_experts(reader, ckpt, pool, keys[:WARMUP_EXPERTS])
            variants[f"mox-{mode}{suffix}"] = (
                lambda r=reader, p=pool: read_experts(r, ckpt, p, keys))
    variants["dd-buffered"] = lambda: run_dd(files, direct=False)
    variants["dd-direct"] = lambda: run_dd(files, direct=True)
    variants["safetensors"] = lambda: load_safetensors(files, "mmap")
    variants["safetensors-pread"] = lambda: load_safetensors(files, "pread")
    return variants


def make_cold(files: list[str]) -> float:
    """Evict the files from the page cache; the fraction of their bytes still cached."""
    for _ in range(COLD_ATTEMPTS):
        for path in files:
            evict(path)
        resident = resident_fraction(files)
        if resident <= MAX_COLD_RESIDENT:
            return resident
        time.sleep(1.0)           # another process is reading them: give it a moment
    raise RuntimeError(f"{resident:.1%} of the checkpoint stays cached after eviction: another "
                       "process is reading it; pass --home with a private copy")


def cpu_seconds() -> float:
    dd = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + dd.ru_utime + dd.ru_stime


def run_trials(variants: dict[str, Callable[[], int]], files: list[str],
               repeats: int) -> list[Trial]:
    names, trials = list(variants), []
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            resident = make_cold(files)
            cpu, start = cpu_seconds(), time.perf_counter()
            nbytes = variants[name]()
            seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
            trials.append(Trial(name, repeat, nbytes, seconds, cpu, resident,
                                resident_fraction(files)))
            print(f"repeat {repeat} {name}: {trials[-1].gbps:.2f} GB/s", file=sys.stderr)
    return trials


def summarize(trials: list[Trial]) -> dict[str, dict]:
    summary = {}
    for name in dict.fromkeys(t.variant for t in trials):
        mine = [t for t in trials if t.variant == name]
        rates = [t.gbps for t in mine]
        cpu = statistics.median(t.cpu_seconds / t.nbytes * 1e9 for t in mine)
        summary[name] = {"nbytes": mine[0].nbytes, "median_gbps": statistics.median(rates),
                         "min_gbps": min(rates), "max_gbps": max(rates), "cpu_s_per_gb": cpu,
                         "cached_after": statistics.median(t.resident_after for t in mine)}
    return summary


def evaluate_targets(summary: dict[str, dict]) -> list[dict]:
    """Ratios of medians: mox's best mode vs the best raw read, and vs safetensors."""
    median = {name: s["median_gbps"] for name, s in summary.items()}
    mox = max((n for n in median if n.startswith("mox-")), key=median.get)
    raw = max(("dd-buffered", "dd-direct"), key=median.get)
    checks = [(f"{mox} >= {TARGET_VS_RAW}x best raw read ({raw})", median[mox] / median[raw],
               TARGET_VS_RAW),
              (f"{mox} >= {TARGET_VS_SAFETENSORS}x safetensors",
               median[mox] / median["safetensors"], TARGET_VS_SAFETENSORS)]
    return [{"target": text, "ratio": round(ratio, 3), "met": ratio >= goal}
            for text, ratio, goal in checks]


def format_table(summary: dict[str, dict], targets: list[dict]) -> str:
    lines = ["| variant | GB read | median GB/s | min GB/s | max GB/s | CPU s/GB | "
             "file bytes cached after |", "|---|---|---|---|---|---|---|"]
    for name, s in summary.items():
        lines.append(f"| {name} | {s['nbytes'] / 1e9:.2f} | {s['median_gbps']:.2f} | "
                     f"{s['min_gbps']:.2f} | {s['max_gbps']:.2f} | {s['cpu_s_per_gb']:.2f} | "
                     f"{s['cached_after']:.0%} |")
    return "\n".join([*lines, "", *(f"- {'met' if t['met'] else 'NOT met'}: {t['target']} "
                                   f"(ratio {t['ratio']:.2f})" for t in targets)])


def write_results(meta: dict, summary: dict, targets: list[dict], trials: list[Trial],
                  table: str) -> None:
    RESULTS_DIR.mkdir(exist_ok=True)
    report = {**meta, "summary": summary, "targets": targets,
              "trials": [asdict(t) | {"gbps": t.gbps} for t in trials]}
    (RESULTS_DIR / "loader.json").write_text(json.dumps(report, indent=2) + "\n")
    notes = [f"- {key}: {value}" for key, value in meta.items()]
    (RESULTS_DIR / "loader.md").write_text("\n".join(
        ["# Cold expert reads: mox vs raw reads and safetensors", "", *notes, "", table, ""]))


def machine_load() -> str:
    """Other tenants' CPU and disk use skew every trial: record it next to the results."""
    io = Path("/proc/pressure/io")
    pressure = io.read_text().split()[2] if io.exists() else "avg60=?"   # "some" stalls
    return f"load avg 1m {os.getloadavg()[0]:.2f}, io pressure {pressure}%"


def run_metadata(argv: list[str], ckpt: Checkpoint, files: list[str], thread_counts: list[int],
                 load: dict[str, str]) -> dict:
    # the reader is being edited concurrently: pin which version of it was timed
    source = hashlib.sha256(Path(stream_module.__file__).read_bytes()).hexdigest()[:12]
    experts = list(ckpt.experts.values())      # all the same shape
    return {"command": shlex.join([".venv/bin/python", "-m", "mox.bench.micro.loader", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "checkpoint": ckpt.path, "cpus": os.cpu_count(), "reader_threads": thread_counts,
            **load, "stream_py_sha256": source,
            "file_bytes": {os.path.basename(f): os.path.getsize(f) for f in files},
            "experts": f"{len(experts)} x {experts[0].nbytes} bytes"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mox.bench.micro.loader", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", default=default_home(), help="MOX_HOME holding models/ "
                        "(default $MOX_HOME or ~/.cache/mox; the model is built if missing)")
    parser.add_argument("--repeats", type=int, default=3, help="trials per variant")
    parser.add_argument("--threads", default="4", help="reader threads, e.g. 1,2,4,8 to sweep")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    thread_counts = [int(n) for n in args.threads.split(",")]
    (path,) = ensure_demo_models(args.home, "bench", 0.0, ("olmoe",)).values()
    ckpt = Checkpoint(path)
    files = sorted({info.file for info in ckpt.tensors.values()})
    load = {"machine_before": machine_load()}
    trials = run_trials(make_variants(ckpt, files, thread_counts), files, args.repeats)
    load["machine_after"] = machine_load()
    summary = summarize(trials)
    targets = evaluate_targets(summary)
    print(table := format_table(summary, targets))
    write_results(run_metadata(argv, ckpt, files, thread_counts, load), summary, targets, trials,
                  table)


if __name__ == "__main__":
    main()
