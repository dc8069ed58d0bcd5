"""The `mox` command line: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import sys
import time

from mox.cli_models import add_models_parser
from mox.errors import MoxError


def _generate(args: argparse.Namespace) -> int:
    from mox.demo import ensure_demo_models
    from mox.llm import LLM

    if args.demo:
        models = ensure_demo_models(args.home)
    elif args.model:
        models = {args.model: args.model}
    else:
        raise MoxError("give a checkpoint folder with --model, or --demo")
    for name, path in models.items():
        start = time.perf_counter()
        llm = LLM(path, device=args.device, dtype=args.dtype)
        out = llm.generate(args.prompt, max_tokens=args.max_tokens,
                           temperature=args.temperature, top_p=args.top_p, seed=args.seed)[0]
        elapsed = time.perf_counter() - start
        print(f"[{name}] {args.prompt}{out.text}")
        print(f"    ({len(out.token_ids)} tokens, finish={out.finish_reason.value}, "
              f"{elapsed:.2f}s including load)")
    return 0


def _demo_build(args: argparse.Namespace) -> int:
    from mox.demo import DEMO_ARCHITECTURES, ensure_demo_models

    architectures = tuple(args.arch) if args.arch else DEMO_ARCHITECTURES
    models = ensure_demo_models(args.home, args.preset, args.routing_skew, architectures)
    for name, path in models.items():
        print(f"{name}\t{path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mox", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt (offline)")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="checkpoint folder")
    gen.add_argument("--demo", action="store_true", help="build (if missing) and use the demos")
    gen.add_argument("--home", help="MOX_HOME (default ~/.cache/mox)")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="bfloat16")
    gen.add_argument("--max-tokens", type=int, default=24)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_generate)

    demo = sub.add_parser("demo", help="build the demo checkpoints into MOX_HOME")
    demo.add_argument("--home")
    demo.add_argument("--preset", choices=("demo", "bench"), default="demo")
    demo.add_argument("--arch", action="append",
                      choices=("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"),
                      help="build only these architectures (repeatable; default all)")
    demo.add_argument("--routing-skew", type=float, default=0.0,
                      help="Zipf exponent of expert popularity (0 = uniform)")
    demo.set_defaults(func=_demo_build)
    add_models_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MoxError as e:
        print(f"mox: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
