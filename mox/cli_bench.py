"""`mox bench`: the load-test harness (bench/loadtest/harness.py) from the command line.

    mox bench --quick                          # CI: demo models, < 1 minute
    mox bench --out bench/results/harness      # full: 12 mid-size models, uniform + skewed

Unset options take the mode's default (`QUICK` or `FULL`); `--quick` is the same code path
with smaller numbers.
"""

from __future__ import annotations

import argparse
import math

from mox.cli_args import count, non_negative, positive
from mox.demo import DEMO_ARCHITECTURES
from mox.errors import InvalidRequestError
from mox.kernels.quant import IMPORT_FORMATS

# A trace replays whole unless --duration cuts it: its span and this much after its last
# arrival (which a duration of exactly the span would drop).
TRACE_TAIL_S = 1.0
DEFAULT_POLICIES = ("rate", "lru", "model-swap", "all-resident")
# Per mode: models, preset, request rate, duration, lengths (mean, cv, min, max), skews, SLO.
QUICK = dict(num_models=4, preset="demo", rate=4.0, duration_s=5.0, prompt=(24, 0.5, 4, 64),
             output=(12, 0.5, 2, 24), routing_skews=[0.0], slo="ttft:1000 tpot:200",
             routing_sequences=2, scrape_period_s=0.5)
FULL = dict(num_models=12, preset="mid", rate=1.5, duration_s=60.0, prompt=(32, 0.5, 4, 128),
            output=(32, 0.5, 4, 64), routing_skews=[0.0, 1.0], slo="ttft:2000 tpot:250",
            routing_sequences=8, scrape_period_s=1.0)


def parse_slo(text: str | list[str]) -> tuple[float, float]:
    """`ttft:MS tpot:MS` (either order, as one string or separate words) -> (ttft, tpot)."""
    words = text.split() if isinstance(text, str) else [w for t in text for w in t.split()]
    values: dict[str, float] = {}
    for word in words:
        key, _, number = word.partition(":")
        if key not in ("ttft", "tpot") or not number:
            raise InvalidRequestError(f"bad SLO {word!r}: use ttft:MS tpot:MS", param="slo")
        try:
            values[key] = float(number)
        except ValueError as e:
            raise InvalidRequestError(f"bad SLO {word!r}: {number!r} is not a number",
                                      param="slo") from e
        if not (math.isfinite(values[key]) and values[key] > 0):
            raise InvalidRequestError(f"bad SLO {word!r}: milliseconds above 0", param="slo")
    if set(values) != {"ttft", "tpot"}:
        raise InvalidRequestError("the SLO needs both ttft:MS and tpot:MS", param="slo")
    return values["ttft"], values["tpot"]


def _lengths(default: tuple[float, float, int, int], mean: int | None) -> list:
    """(mean, cv, minimum, maximum) of a length distribution at `mean` (None: the mode's): the
    bounds scale with it, so the clipped lengths keep its mean (`--output-tokens 100` against
    the full mode's bound of 64 had averaged 61)."""
    if mean is None:
        return list(default)
    old_mean, cv, low, high = default
    scale = mean / old_mean
    return [mean, cv, max(1, round(low * scale)), max(1, round(high * scale))]


def bench_config(args: argparse.Namespace):
    from mox.bench.loadtest.results_schema import SLO, BenchConfig
    from mox.bench.loadtest.workload import LengthDistribution, read_trace

    mode = QUICK if args.quick else FULL
    pick = lambda value, key: mode[key] if value is None else value
    duration = pick(args.duration, "duration_s")
    if args.trace is not None:
        rows = read_trace(args.trace)   # a bad trace is refused before any model is built
        if args.duration is None:       # the whole trace (its last arrival included)
            duration = (rows[-1][0] - rows[0][0]) / args.trace_speedup + TRACE_TAIL_S
    prompt = _lengths(mode["prompt"], args.prompt_tokens)
    output = _lengths(mode["output"], args.output_tokens)
    ttft, tpot = parse_slo(pick(args.slo, "slo"))
    return BenchConfig(
        quick=args.quick, preset=pick(args.preset, "preset"), architecture=args.arch,
        num_models=pick(args.models, "num_models"), alpha=args.alpha, cv=args.cv,
        rate=pick(args.rate, "rate"), duration_s=duration,
        prompt=LengthDistribution(*prompt), output=LengthDistribution(*output),
        device_memory_fraction=args.device_memory_fraction,
        routing_skews=pick(args.routing_skew, "routing_skews"), policies=args.policies,
        slo=SLO(ttft, tpot), trace=args.trace, trace_speedup=args.trace_speedup,
        seed=args.seed, host_memory=args.host_memory, kv_memory=args.kv_memory,
        scrape_period_s=mode["scrape_period_s"], routing_sequences=mode["routing_sequences"],
        home=args.home, out=args.out, quantize=args.quantize, expert_major=args.expert_major,
        tpot_target=args.tpot_target, ray_replicas=args.replicas if args.ray else 0,
        ray_models_per_replica=args.models_per_replica if args.ray else 0)


def _bench(args: argparse.Namespace) -> int:
    from mox.bench.loadtest.harness import run_bench
    from mox.bench.loadtest.report import write_report

    config = bench_config(args)
    results = run_bench(config)
    for path in write_report(results, config.out):
        print(path)
    failed = False
    for suite in results.suites:
        measured = [f"{t.figure} vs {t.baseline} {t.ratio:.2f}x ({t.condition}: {t.verdict})"
                    for t in suite.targets if t.met is not None]
        print(f"[{suite.name}] rate: " + ("; ".join(measured) or "no baseline ran"))
        failed |= any(p.error is not None or not p.counts.ok for p in suite.policies)
    return 1 if failed else 0


def add_bench_parser(sub) -> None:
    from mox.router import ROUTER_POLICIES

    bench = sub.add_parser("bench", help="load-test every policy on one multi-model workload")
    bench.add_argument("--quick", action="store_true",
                       help="4 demo models, a few seconds per policy (CI)")
    bench.add_argument("--out", default="mox-bench-results",
                       help="folder for results.json, results.md, plots and server logs")
    bench.add_argument("--policies", nargs="+", choices=ROUTER_POLICIES,
                       default=list(DEFAULT_POLICIES))
    bench.add_argument("--models", type=count, help="number of models (quick 4, full 12)")
    bench.add_argument("--preset", choices=("demo", "mid", "bench"),
                       help="model size (quick demo, full mid)")
    bench.add_argument("--arch", default="olmoe", choices=DEMO_ARCHITECTURES)
    bench.add_argument("--alpha", type=non_negative, default=1.0,
                       help="Zipf exponent of popularity")
    bench.add_argument("--cv", type=positive, default=2.0,
                       help="coefficient of variation of inter-arrival gaps (1 = Poisson)")
    bench.add_argument("--rate", type=positive, help="total requests/s (quick 4, full 1.5)")
    bench.add_argument("--duration", type=positive, help="seconds of arrivals (quick 5, full 60)")
    bench.add_argument("--prompt-tokens", type=positive, help="mean prompt length")
    bench.add_argument("--output-tokens", type=positive, help="mean output length")
    bench.add_argument("--device-memory-fraction", type=float, default=0.25,
                       help="device budget: all dense bytes + this share of all expert bytes")
    bench.add_argument("--routing-skew", type=non_negative, nargs="+",
                       help="one suite per value (0 = uniform; quick 0, full 0 1)")
    bench.add_argument("--trace", help="CSV with timestamp,model,input_tokens,output_tokens "
                       "(replayed whole unless --duration is given)")
    bench.add_argument("--trace-speedup", type=positive, default=1.0)
    bench.add_argument("--slo", nargs="+", help="ttft:MS tpot:MS (quick ttft:1000 tpot:200, "
                       "full ttft:2000 tpot:250)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--home", help="where the models are built (default MOX_HOME)")
    bench.add_argument("--host-memory", help="RAM cache of expert bytes per server (off)")
    bench.add_argument("--kv-memory", default="512MiB")
    bench.add_argument("--tpot-target", action="store_true",
                       help="tell every server the SLO's TPOT as its target (serve "
                            "--tpot-target): under overload fewer models run at a time")
    bench.add_argument("--ray", action="store_true",
                       help="also run rate through `mox serve --ray`, the budget and the cores "
                       "split between --replicas replicas (pip install 'mox[ray]')")
    bench.add_argument("--replicas", type=count, default=2, help="with --ray (default 2)")
    bench.add_argument("--models-per-replica", type=int, default=0,
                       help="with --ray: bound each replica's multiplexed set (default: `mox "
                            "serve --ray`'s, no bound)")
    bench.add_argument("--quantize", choices=sorted(IMPORT_FORMATS),
                       help="serve the models with their experts quantized (built once under "
                            "--home); the budget stays the bf16 models'")
    bench.add_argument("--expert-major", action="store_true",
                       help="serve the models repacked as `mox models import` leaves them "
                            "(each expert one aligned read, straight into its slot); done "
                            "once, in place under --home")
    bench.set_defaults(func=_bench)
