"""The load-test runner behind `mox bench`: one workload, replayed against each policy on the
same models and budgets, in one run.

Per suite (one routing skew): build the models (mox.demo; N copies of one architecture from
distinct seeds), register exactly them in a registry of the suite's own, size the device
budget (every model's dense bytes + a fraction of all expert bytes), generate the workload,
measure the routing statistics offline. Then per policy:

    evict the checkpoints from the page cache -> start `mox serve` (port 0; the port is read
    from its "serving ... on http://HOST:PORT/v1" line) -> wait for /health (all-resident:
    and for every model to be warm) -> evict again -> replay with a periodic /metrics scrape
    -> last scrape -> SIGTERM (SIGKILL if it does not exit in time)

Everything is bounded: the server's start, the replay (its deadline cancels what still runs),
the stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time

import aiohttp

from mox.bench.loadtest.loadgen import LoadGenerator, MetricsScraper, replay
from mox.bench.loadtest.results_schema import BenchConfig, Results, Suite
from mox.bench.loadtest.routing_stats import measure_routing
from mox.bench.loadtest.summaries import RunRecord, build_results, summarize_suite
from mox.bench.loadtest.workload import (
    SuitePlan,
    SyntheticWorkload,
    TraceWorkload,
)
from mox.demo import ensure_demo_models, ensure_expert_major, ensure_quantized
from mox.loaders.page_cache import evict
from mox.registry import Registry, validate_checkpoint
from mox.router.timeline import replica_step_log

SERVING_LINE = re.compile(r"serving \d+ models on http://(?P<host>[^:/\s]+):(?P<port>\d+)/v1")
STARTUP_TIMEOUT_S = 120.0        # import torch, open every checkpoint's headers
LOAD_TIMEOUT_S = 600.0           # all-resident reads every model before the replay
STOP_TIMEOUT_S = 30.0            # the server gives in-flight requests 10 s, then exits
READY_POLL_S = 0.25              # /health and /v1/models have no push; poll them
DRAIN_FACTOR, DRAIN_MIN_S = 1.0, 15.0   # replay deadline = duration + max(min, factor x dur)
LOG_TAIL_CHARS = 2000


class HarnessError(RuntimeError):
    """A server would not start, or a suite cannot run (a model does not fit the budget)."""


def deadline_s(duration_s: float) -> float:
    return duration_s + max(DRAIN_MIN_S, DRAIN_FACTOR * duration_s)


def evict_page_cache(paths: list[str]) -> None:
    """Make checkpoints honestly cold: write back, then drop every file from the page cache."""
    for folder in paths:
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                evict(path)


def workload_for(config: BenchConfig) -> SyntheticWorkload | TraceWorkload:
    if config.trace:
        return TraceWorkload(config.trace, speedup=config.trace_speedup,
                             duration_s=config.duration_s, seed=config.seed,
                             max_prompt_tokens=config.prompt.maximum,
                             max_output_tokens=config.output.maximum)
    return SyntheticWorkload(config.rate, config.duration_s, config.alpha, config.cv,
                             config.prompt, config.output, config.seed)


def plan_suite(config: BenchConfig, routing_skew: float) -> SuitePlan:
    """Build (if missing) the suite's models and size its budget and workload."""
    copies = ensure_demo_models(config.home, config.preset, routing_skew,
                                (config.architecture,), copies=config.num_models)
    if config.expert_major:
        copies = {name: ensure_expert_major(path) for name, path in copies.items()}
    facts = [validate_checkpoint(path) for path in copies.values()]
    dense = sum(f.dense_bytes for f in facts)
    experts = sum(f.expert_bytes for f in facts)
    # quantized experts are served at the bf16 models' budget: the same bytes hold more
    budget = dense + int(config.device_memory_fraction * experts)
    if config.quantize:
        copies = {name: ensure_quantized(config.home, path, config.quantize)
                  for name, path in copies.items()}
        experts = sum(validate_checkpoint(path).expert_bytes for path in copies.values())
    name = "uniform" if routing_skew == 0 else f"skew{routing_skew:g}"
    requests = workload_for(config).requests(list(copies))
    return SuitePlan(name, routing_skew, copies, dense, experts, budget, requests)


def fleet_label(policy: str, replicas: int) -> str:
    """A run's name in the results: the policy, or for a Ray run `rate-ray2`."""
    return f"{policy}-ray{replicas}" if replicas else policy


def _free_port() -> int:
    """Ray's proxy needs its port up front (a plain `mox serve` binds port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`mox serve` as a child process; its stderr is copied to `log_path`. With `replicas`:
    `mox serve --ray`, each replica a mox with its share of the budget and of the cores."""

    def __init__(self, registry_home: str, policy: str, config: BenchConfig, budget: int,
                 log_path: str, replicas: int = 0) -> None:
        per_server = budget // max(1, replicas)
        self.step_log = os.path.splitext(log_path)[0] + ".steps.jsonl"
        self.argv = [sys.executable, "-m", "mox.cli", "serve", "--home", registry_home,
                     "--port", str(_free_port() if replicas else 0), "--policy", policy,
                     "--device-memory", str(per_server), "--kv-memory", config.kv_memory,
                     # the per-step timeline (which model stepped, its ms, what it waited on)
                     "--step-log", self.step_log]
        if config.host_memory:
            self.argv += ["--host-memory", config.host_memory]
        if config.tpot_target:
            self.argv += ["--tpot-target", f"{config.slo.tpot_ms:g}"]
        if replicas:
            cpus = (os.cpu_count() or 1) / replicas
            self.argv += ["--ray", "--replicas", str(replicas), "--cpus-per-replica",
                          f"{cpus:g}"]
            if config.ray_models_per_replica:
                self.argv += ["--models-per-replica", str(config.ray_models_per_replica)]
        self.log_path = log_path
        self.base_url = ""
        self._process: asyncio.subprocess.Process | None = None
        self._copier: asyncio.Task | None = None
        self._serving = asyncio.Event()

    async def __aenter__(self) -> ServerProcess:
        # the server appends to its step log: a log left by an earlier run into the same
        # folder would be summarized as this run's
        for path in [self.step_log, *glob.glob(replica_step_log(self.step_log, "*"))]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        self._process = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
        self._copier = asyncio.create_task(self._copy_log())
        serving = asyncio.create_task(self._serving.wait())
        await asyncio.wait([serving, self._copier], timeout=STARTUP_TIMEOUT_S,
                           return_when=asyncio.FIRST_COMPLETED)
        serving.cancel()
        if not self._serving.is_set():
            await self.stop()
            raise HarnessError(f"mox serve did not start: {self.log_tail()}")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def _copy_log(self) -> None:
        assert self._process is not None and self._process.stderr is not None
        with open(self.log_path, "wb") as log:
            async for line in self._process.stderr:
                log.write(line)
                log.flush()
                match = SERVING_LINE.search(line.decode(errors="replace"))
                if match and not self._serving.is_set():
                    self.base_url = f"http://{match['host']}:{match['port']}"
                    self._serving.set()

    def log_tail(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-LOG_TAIL_CHARS:]

    async def stop(self) -> int | None:
        process = self._process
        if process is None:
            return None
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
            except asyncio.TimeoutError:
                process.kill()
                await process.wait()
        if self._copier is not None:
            await self._copier
        return process.returncode


async def wait_ready(generator: LoadGenerator, all_warm: bool) -> None:
    """/health answers, every model opened (none failed), and with `all_warm` every model
    warm (all-resident loads them all at start-up)."""
    deadline = time.monotonic() + (LOAD_TIMEOUT_S if all_warm else STARTUP_TIMEOUT_S)
    while time.monotonic() < deadline:
        try:
            async with generator.session.get(f"{generator.base_url}/health") as resp:
                healthy = resp.status == 200
            states = await generator.model_states() if healthy else {}
        except aiohttp.ClientError:
            states = {}
        failed = [m for m, s in states.items() if s == "failed"]
        if failed:
            raise HarnessError(f"models failed to load: {failed}")
        if states and (not all_warm or all(s == "warm" for s in states.values())):
            return
        await asyncio.sleep(READY_POLL_S)
    raise HarnessError("the server did not get ready in time")


async def run_policy(config: BenchConfig, plan: SuitePlan, policy: str, registry_home: str,
                     log_dir: str, replicas: int = 0) -> RunRecord:
    """One policy's replay (`replicas`: through `mox serve --ray` with that many)."""
    label = fleet_label(policy, replicas)
    paths = list(plan.models.values())
    evict_page_cache(paths)
    log_path = os.path.join(log_dir, f"{plan.name}-{label}.log")
    started = time.monotonic()
    async with ServerProcess(registry_home, policy, config, plan.device_budget_bytes,
                             log_path, replicas) as server:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=STARTUP_TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            generator = LoadGenerator(session, server.base_url)
            await wait_ready(generator, all_warm=policy == "all-resident")
            startup_s = time.monotonic() - started
            evict_page_cache(paths)
            scraper = MetricsScraper(session, server.base_url, config.scrape_period_s, paths)
            origin = time.monotonic()
            baseline = await scraper.scrape()
            scraper.start(origin)
            results = await replay(generator, plan.requests, deadline_s(config.duration_s),
                                   start=origin)
            final = await scraper.stop()
            load = os.getloadavg()[0]     # the box is shared: say how busy it was
            fleet = await generator.fleet() if replicas else []
        exit_code = await server.stop()
    return RunRecord(label, results, scraper.samples, baseline, final, startup_s, exit_code,
                     load_average_1m=load, replicas=fleet, origin_monotonic_s=origin)


def ram_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def unrunnable(plan: SuitePlan, policy: str, ram: int) -> str | None:
    """Why a policy cannot run this suite on this machine (None: it can): all-resident holds
    every model's weights at once, which must fit in RAM."""
    weights = plan.dense_bytes + plan.expert_bytes
    if policy == "all-resident" and weights > ram:
        return (f"all-resident cannot run here: the {len(plan.models)} models' weights are "
                f"{weights / 2**30:.1f} GiB and this machine has {ram / 2**30:.1f} GiB of RAM")
    return None


async def _run_policy_safely(config: BenchConfig, plan: SuitePlan, policy: str,
                             registry_home: str, log_dir: str, replicas: int) -> RunRecord:
    label = fleet_label(policy, replicas)
    why = unrunnable(plan, policy, ram_bytes())
    if why is not None:
        return RunRecord(label, [], [], None, None, 0.0, None, error=why)
    try:
        return await run_policy(config, plan, policy, registry_home, log_dir, replicas)
    except HarnessError as e:
        return RunRecord(label, [], [], None, None, 0.0, None, error=str(e))


def run_suite(config: BenchConfig, routing_skew: float, log_dir: str,
              progress=print) -> Suite:
    plan = plan_suite(config, routing_skew)
    progress(f"[{plan.name}] {len(plan.models)} models, {len(plan.requests)} requests, "
             f"device budget {plan.device_budget_bytes / 2**20:.0f} MiB")
    routing = measure_routing(next(iter(plan.models.values())), plan.requests,
                              config.routing_sequences)
    registry_home = tempfile.mkdtemp(prefix=f"mox-bench-{plan.name}-")
    try:
        registry = Registry(registry_home)
        for name, path in plan.models.items():
            registry.add(name, path)
        records = []
        # --ray N: rate once more, through N replicas with the budget split between them
        runs = [(p, 0) for p in config.policies] + (
            [("rate", config.ray_replicas)] if config.ray_replicas else [])
        for policy, replicas in runs:
            record = asyncio.run(_run_policy_safely(config, plan, policy, registry_home,
                                                    log_dir, replicas))
            progress(f"[{plan.name}] {record.policy}: {record.headline()}")
            records.append(record)
    finally:
        shutil.rmtree(registry_home, ignore_errors=True)
    return summarize_suite(config, plan, routing, records)


def run_bench(config: BenchConfig, progress=print) -> Results:
    """Every suite (routing skew) x every policy; the results, not yet written."""
    start = time.monotonic()
    log_dir = os.path.join(config.out, "logs")
    os.makedirs(log_dir, exist_ok=True)
    suites = [run_suite(config, skew, log_dir, progress) for skew in config.routing_skews]
    return build_results(config, suites, time.monotonic() - start)
