"""The `mox` command line: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import TYPE_CHECKING

from mox.cli_args import byte_size, count, device, non_negative, port, positive, whole
from mox.cli_bench import add_bench_parser
from mox.cli_models import add_models_parser
from mox.console import INTERRUPTED
from mox.errors import MoxError

if TYPE_CHECKING:                  # the router imports torch: `mox --help` should not wait on it
    from mox.router import RouterConfig
    from mox.server.limits import ServerLimits

FLEET_REPLICAS = 2                 # `mox serve --ray` without a count


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
        llm = LLM(path, device=args.device, dtype=args.dtype, home=args.home)
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
    unknown = sorted(set(architectures) - set(DEMO_ARCHITECTURES))
    if unknown:              # (checked here: the list lives beside torch, which --help skips)
        raise MoxError(f"no demo of {', '.join(unknown)}; choose from "
                       f"{', '.join(DEMO_ARCHITECTURES)}")
    models = ensure_demo_models(args.home, args.preset, args.routing_skew, architectures)
    for name, path in models.items():
        print(f"{name}\t{path}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from mox.serve import ServeOptions, serve

    logging.basicConfig(level=logging.INFO, format="mox: %(message)s")
    config = router_config(args)
    tiered = config.one_ram_tier()
    if tiered != config:
        logging.info("on a CPU the host cache is the slots' RAM: --host-memory %s joins the "
                     "expert slots (device budget %s bytes)", args.host_memory,
                     tiered.device_memory)
    config = tiered
    if config.policy == "all-resident" and config.device_memory is not None:
        logging.warning("--policy all-resident holds every model whole: --device-memory %s is "
                        "not a budget it keeps (its models may use more)", args.device_memory)
    options = ServeOptions(args.host, args.port, args.home, args.demo,
                           args.api_key or os.environ.get("MOX_API_KEY") or None, config,
                           server_limits(args))
    if args.ray:
        return _serve_on_ray(args, options)
    return asyncio.run(serve(options))


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The HTTP server's limits from `mox serve`'s options (MoxError if they disagree)."""
    from mox.server.limits import ServerLimits

    # (a cap below the default output limit lowers that default, unless one was given)
    default_max_tokens = (args.default_max_tokens if args.default_max_tokens is not None
                          else min(ServerLimits.default_max_tokens, args.max_tokens_cap))
    try:
        return ServerLimits(
            header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
            max_body_bytes=args.max_body_size, max_connections=args.max_connections,
            default_max_tokens=default_max_tokens, max_tokens_cap=args.max_tokens_cap,
            shutdown_grace_s=args.shutdown_grace)
    except ValueError as e:
        raise MoxError(str(e)) from None


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The router's configuration from `mox serve`'s options."""
    from mox.router import RouterConfig
    from mox.units import parse_size

    return RouterConfig(
        policy=args.policy, device=args.device, dtype=args.dtype,
        device_memory=parse_size(args.device_memory), host_memory=parse_size(args.host_memory),
        kv_memory=parse_size(args.kv_memory), max_waiting_per_model=args.max_waiting_per_model,
        max_waiting=args.max_waiting, queue_timeout_s=args.queue_timeout,
        dense_idle_s=args.idle_timeout,
        tpot_target_s=None if args.tpot_target is None else args.tpot_target / 1000,
        compute_threads=args.compute_threads, step_log=args.step_log,
        direct_io=not args.buffered_io, decode_steps=args.decode_steps)


def _serve_on_ray(args: argparse.Namespace, options) -> int:
    from mox.fleet import require_ray

    require_ray()                  # before anything else, so the message is the first line
    from mox.fleet.app import FleetOptions, run_fleet
    from mox.serve import registered_models

    autoscaling = args.min_replicas is not None or args.max_replicas is not None
    if autoscaling and args.replicas is not None:
        raise MoxError("give --replicas (a fixed count) or --min-replicas / --max-replicas "
                       "(autoscaling), not both")
    registered_models(options)     # --demo: the demo models, registered once for every replica
    return run_fleet(FleetOptions(
        dataclasses.replace(options, demo=False), replicas=args.replicas or FLEET_REPLICAS,
        min_replicas=args.min_replicas, max_replicas=args.max_replicas, address=args.address,
        cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica,
        models_per_replica=args.models_per_replica))


def _add_serve_parser(sub) -> None:
    from mox.engine.scheduler import DEFAULT_DECODE_RUN_S
    from mox.router import ROUTER_POLICIES
    from mox.router.config import DEFAULT_DECODE_STEPS

    serve = sub.add_parser("serve", help="serve the registry's models over an OpenAI API")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    serve.add_argument("--port", type=port, default=8000)
    serve.add_argument("--home", help="MOX_HOME (default ~/.cache/mox)")
    serve.add_argument("--demo", action="store_true",
                       help="build and register the demo models if missing, and serve them")
    serve.add_argument("--device", type=device, default="cpu", help="cpu or cuda")
    serve.add_argument("--dtype", default="bfloat16")
    serve.add_argument("--device-memory", help="bytes for dense weights + experts of all "
                       "models, e.g. 4GiB (default: no limit)")
    serve.add_argument("--host-memory", help="RAM cache of expert bytes (default: off; on a "
                       "CPU it joins the expert slots: one RAM tier)")
    serve.add_argument("--kv-memory", default="1GiB", help="KV cache pool for all models")
    serve.add_argument("--policy", default="rate", choices=ROUTER_POLICIES)
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (also "
                       "MOX_API_KEY)")
    serve.add_argument("--max-waiting-per-model", type=int, default=256)
    serve.add_argument("--max-waiting", type=int, default=1024)
    serve.add_argument("--queue-timeout", type=float, default=120.0,
                       help="seconds a request may wait before it is aborted")
    serve.add_argument("--idle-timeout", type=float, default=300.0,
                       help="seconds idle before a model's weights leave the device")
    serve.add_argument("--tpot-target", type=float, metavar="MS",
                       help="time per output token to keep: a model joins the models that "
                            "run only while their round of steps stays within it, so under "
                            "overload fewer models run at a time (default: all of them)")
    serve.add_argument("--decode-steps", type=int, default=DEFAULT_DECODE_STEPS,
                       help="most decode steps a batch runs back to back while no other "
                            f"request waits (a run also ends after ~{DEFAULT_DECODE_RUN_S} s, "
                            "or when a request arrives; its tokens stream when it ends; 1: off; "
                            f"default {DEFAULT_DECODE_STEPS})")
    serve.add_argument("--compute-threads", type=int,
                       help="torch threads for model steps (default: every core)")
    serve.add_argument("--buffered-io", action="store_true",
                       help="read experts through the page cache (default: O_DIRECT where the "
                       "filesystem allows, so RAM holding weights is only what mox budgets)")
    serve.add_argument("--step-log", help="append a JSON line per engine step to this file "
                       "(model, sequences, tokens, seconds, seconds waiting on expert reads)")
    _add_limit_arguments(serve.add_argument_group("limits"))
    _add_ray_arguments(serve.add_argument_group("scaling out on Ray Serve (pip install "
                                                "'mox[ray]')"))
    serve.set_defaults(func=_serve)


def _add_ray_arguments(group) -> None:
    group.add_argument("--ray", action="store_true",
                       help="serve through Ray Serve: replicas that are each a whole mox "
                       "(with --device-memory each), requests routed to where their model is "
                       "warm; --host/--port are Ray's HTTP proxy")
    group.add_argument("--replicas", type=count,
                       help=f"a fixed count (default {FLEET_REPLICAS}; or autoscale below)")
    group.add_argument("--min-replicas", type=whole,
                       help="autoscale between --min-replicas and --max-replicas")
    group.add_argument("--max-replicas", type=count)
    group.add_argument("--address", help="an existing Ray cluster (e.g. auto, or the head's "
                       "host:6379); default: start a local one")
    group.add_argument("--cpus-per-replica", type=non_negative, default=1.0)
    group.add_argument("--gpus-per-replica", type=non_negative, default=0.0)
    group.add_argument("--models-per-replica", type=count,
                       help="bound each replica's multiplexed set: Ray drops a model from a "
                       "full set to route a new one there, and mox parks it (default: no "
                       "bound; each replica's budget decides what it keeps warm)")


def _add_limit_arguments(group) -> None:
    from mox.server.limits import ServerLimits

    d = ServerLimits()
    group.add_argument("--header-timeout", type=positive, default=d.header_timeout_s,
                       help="seconds from connecting (or the previous response) to a whole "
                       "request's headers; idle keep-alive connections close after it too")
    group.add_argument("--body-timeout", type=positive, default=d.body_timeout_s,
                       help="seconds from the headers to the whole body (408 past it)")
    group.add_argument("--max-body-size", type=byte_size, default=d.max_body_bytes,
                       help="largest request body, e.g. 1MiB (413 past it)")
    group.add_argument("--max-connections", type=count, default=d.max_connections,
                       help="open connections at once (503 and close past it)")
    group.add_argument("--default-max-tokens", type=count,
                       help=f"output limit of a chat request that sets none (default "
                       f"{d.default_max_tokens}, or --max-tokens-cap if lower)")
    group.add_argument("--max-tokens-cap", type=count, default=d.max_tokens_cap,
                       help="the most output tokens one request may ask for (400 past it)")
    group.add_argument("--shutdown-grace", type=non_negative, default=d.shutdown_grace_s,
                       help="seconds from SIGTERM to exit; requests still running 2 s before "
                       "it are ended with an error (streams: error event, then [DONE])")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mox", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt (offline)")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="checkpoint folder")
    gen.add_argument("--demo", action="store_true", help="build (if missing) and use the demos")
    gen.add_argument("--home", help="MOX_HOME (default ~/.cache/mox)")
    gen.add_argument("--device", type=device, default="cpu")
    gen.add_argument("--dtype", default="bfloat16")
    gen.add_argument("--max-tokens", type=count, default=24)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=_generate)

    demo = sub.add_parser("demo", help="build the demo checkpoints into MOX_HOME")
    demo.add_argument("--home")
    demo.add_argument("--preset", choices=("demo", "bench"), default="demo")
    demo.add_argument("--arch", action="append",
                      help="build only these architectures (repeatable; default all eight: "
                      "mixtral, qwen2_moe, qwen3_moe, olmoe, glm4_moe, deepseek_v3, "
                      "deepseek_v2, gpt_oss)")
    demo.add_argument("--routing-skew", type=float, default=0.0,
                      help="Zipf exponent of expert popularity (0 = uniform)")
    demo.set_defaults(func=_demo_build)
    add_models_parser(sub)
    add_bench_parser(sub)
    _add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MoxError as e:
        print(f"mox: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:      # the file system refused (a full disk, a path that is a file)
        print(f"mox: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: each command's `finally` blocks have cleaned up
        print("mox: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
