"""The load generator: replays a workload against a mox server over HTTP with an aiohttp
streaming client (`/v1/completions`, SSE, token-id prompts, `ignore_eos` so each request
generates its `max_tokens` unless it fails), and measures each request as the client sees it.

Per request: time to first token (from sending to the first streamed token), the gaps
between streamed tokens, end-to-end latency, the number of tokens (the server's usage
count), and whether its model was cold at arrival: not warm in a `/v1/models` probe sent
together with the request (either order of the two on the server gives the same answer: a
request to a cold model makes it loading, which counts as cold too); if the probe fails, the
first request to a model since the server started counts as cold.
"""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import msgspec

from mox.bench.loadtest.results_schema import ReplicaResult
from mox.bench.loadtest.workload import RequestSpec
from mox.loaders.page_cache import weights_resident_bytes

REQUEST_TIMEOUT_S = 600.0         # one request, end to end; the harness's deadline is shorter
DATA_PREFIX = b"data: "
DONE = b"[DONE]"
WARM_STATE = "warm"


class _Usage(msgspec.Struct):
    completion_tokens: int


class _Choice(msgspec.Struct):
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict | None = None


class _ModelCard(msgspec.Struct):
    id: str
    state: str = WARM_STATE


class _ModelList(msgspec.Struct):
    data: list[_ModelCard]


class RequestResult(msgspec.Struct, kw_only=True):
    """One request as the client saw it. Times in seconds; `sent_s` from the replay's start."""

    index: int
    model: str
    arrival_s: float                   # scheduled
    sent_s: float                      # actual
    num_prompt_tokens: int
    max_tokens: int
    cold: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = []
    num_output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    ended_s: float | None = None       # from the replay's start: done, or failed

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if not self.is_ok or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def completion_body(spec: RequestSpec) -> bytes:
    return msgspec.json.encode({
        "model": spec.model, "prompt": spec.prompt_token_ids(), "max_tokens": spec.max_tokens,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})


class LoadGenerator:
    """Sends requests to one server; remembers which models it has already sent to."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self._seen_models: set[str] = set()

    async def model_states(self) -> dict[str, str]:
        async with self.session.get(f"{self.base_url}/v1/models") as resp:
            resp.raise_for_status()
            listing = msgspec.json.decode(await resp.read(), type=_ModelList)
        return {card.id: card.state for card in listing.data}

    async def fleet(self) -> list[ReplicaResult]:
        """A Ray app's replicas (its `/fleet`, mox.fleet.ingress): where requests landed."""
        async with self.session.get(f"{self.base_url}/fleet") as resp:
            resp.raise_for_status()
            reports = msgspec.json.decode(await resp.read())
        return [ReplicaResult(r, rep["landed"], rep["landed_warm"], rep["warmth"],
                              rep["landed_held"], rep["landed_warm_elsewhere"])
                for r, rep in sorted(reports.items())]

    async def send(self, spec: RequestSpec, replay_start: float) -> RequestResult:
        first_to_model = spec.model not in self._seen_models
        self._seen_models.add(spec.model)
        # the probe decides; the first-request rule stands in only if the probe fails
        probe = asyncio.create_task(self.model_states())
        sent = time.monotonic()
        result = RequestResult(index=spec.index, model=spec.model, arrival_s=spec.arrival_s,
                               sent_s=sent - replay_start,
                               num_prompt_tokens=spec.num_prompt_tokens,
                               max_tokens=spec.max_tokens, cold=first_to_model)
        try:
            await self._stream(spec, sent, result)
        except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError) as e:
            result.error = f"{type(e).__name__}: {e}"
        except asyncio.CancelledError:
            probe.cancel()
            raise
        result.ended_s = time.monotonic() - replay_start
        try:
            result.cold = (await probe).get(spec.model, WARM_STATE) != WARM_STATE
        except (aiohttp.ClientError, msgspec.DecodeError):
            pass                                 # the first-request rule still applies
        return result

    async def _stream(self, spec: RequestSpec, sent: float, result: RequestResult) -> None:
        token_times: list[float] = []
        async with self.session.post(f"{self.base_url}/v1/completions",
                                     data=completion_body(spec),
                                     headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for line in resp.content:
                if not line.startswith(DATA_PREFIX):
                    continue
                payload = line[len(DATA_PREFIX):].strip()
                if payload == DONE:
                    break
                chunk = msgspec.json.decode(payload, type=_Chunk)
                if chunk.error is not None:
                    result.error = f"stream error: {chunk.error.get('message', chunk.error)}"
                    return
                if chunk.choices:
                    token_times.append(time.monotonic())
                    result.finish_reason = chunk.choices[0].finish_reason or result.finish_reason
                if chunk.usage is not None:
                    result.num_output_tokens = chunk.usage.completion_tokens
        end = time.monotonic()
        if not token_times:
            result.error = "no tokens streamed"
            return
        result.ttft_s = token_times[0] - sent
        result.itl_s = [b - a for a, b in zip(token_times, token_times[1:])]
        result.e2e_s = end - sent
        result.num_output_tokens = result.num_output_tokens or len(token_times)


async def replay(generator: LoadGenerator, requests: list[RequestSpec],
                 deadline_s: float, start: float | None = None) -> list[RequestResult]:
    """Send each request at its arrival time (open loop: never waits for earlier ones), then
    wait for all of them, at most until `deadline_s` after the start; requests still running
    then are cancelled and reported as failed. `start`: the `time.monotonic()` that arrivals
    count from (default now)."""
    start = time.monotonic() if start is None else start
    tasks: list[asyncio.Task[RequestResult]] = []
    for spec in requests:
        if spec.arrival_s >= deadline_s:
            break
        delay = start + spec.arrival_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)            # the arrival schedule itself
        tasks.append(asyncio.create_task(generator.send(spec, start)))
    remaining = max(0.0, start + deadline_s - time.monotonic())
    if tasks:
        await asyncio.wait(tasks, timeout=remaining)
    results = []
    for spec, task in zip(requests, tasks):
        if task.done():
            results.append(task.result())
        else:
            task.cancel()
            results.append(RequestResult(
                index=spec.index, model=spec.model, arrival_s=spec.arrival_s,
                sent_s=spec.arrival_s, num_prompt_tokens=spec.num_prompt_tokens,
                max_tokens=spec.max_tokens, cold=False, ended_s=deadline_s,
                error=f"not finished {deadline_s:g} s after the replay started"))
    for spec in requests[len(tasks):]:
        results.append(RequestResult(
            index=spec.index, model=spec.model, arrival_s=spec.arrival_s, sent_s=spec.arrival_s,
            num_prompt_tokens=spec.num_prompt_tokens, max_tokens=spec.max_tokens, cold=False,
            error="not sent: arrives after the deadline"))
    await asyncio.gather(*[t for t in tasks if t.cancelled() or not t.done()],
                         return_exceptions=True)
    return results


# ---- scraping /metrics -------------------------------------------------------------------
_SAMPLE_LINE = re.compile(r"^(?P<name>[^\s{]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class MetricsSample(msgspec.Struct):
    """One scrape: `t_s` from the replay's start; `values[metric][model]` ("" for metrics
    without a model label); `states[model]` the model's state."""

    t_s: float
    values: dict[str, dict[str, float]]
    states: dict[str, str]

    def value(self, metric: str, model: str = "") -> float:
        return self.values.get(metric, {}).get(model, 0.0)

    def total(self, metric: str) -> float:
        return sum(self.values.get(metric, {}).values())


def parse_metrics(text: str, t_s: float) -> MetricsSample:
    """Prometheus text exposition -> a sample (histogram buckets and `_created` dropped; the
    one-hot `mox:model_state` gauge becomes `states`). A Ray app's samples carry a `replica`
    label: the replicas' values add up, and a model warm on any replica is warm."""
    merged: dict[tuple[str, tuple], float] = {}
    states: dict[str, str] = {}
    for line in text.splitlines():
        match = _SAMPLE_LINE.match(line)
        if match is None or line.startswith("#"):
            continue
        name = match["name"]
        if name.endswith(("_bucket", "_created")):
            continue
        labels = dict(_LABEL.findall(match["labels"] or ""))
        labels.pop("replica", None)
        value = float(match["value"])
        model = labels.get("model", "")
        if name == "mox:model_state":
            if value == 1.0 and states.get(model) != "warm":
                states[model] = labels.get("state", "")
            continue
        key = (name, tuple(sorted(labels.items())))
        merged[key] = merged.get(key, 0.0) + value
    values: dict[str, dict[str, float]] = {}
    for (name, labels), value in merged.items():
        values.setdefault(name, {})[dict(labels).get("model", "")] = value
    return MetricsSample(t_s, values, states)


# Not the server's: the harness measures how much of the checkpoints' weights the page cache
# holds (mincore) at each scrape and files it with the sample under this name.
PAGE_CACHE_METRIC = "harness:checkpoint_page_cache_bytes"


class MetricsScraper:
    """Scrapes `/metrics` every `period_s` until stopped; `samples` in order. With
    `checkpoints` (folders), each sample also records how many of their bytes the page cache
    holds (`PAGE_CACHE_METRIC`)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, period_s: float,
                 checkpoints: list[str] = ()) -> None:
        self.session = session
        self.url = f"{base_url.rstrip('/')}/metrics"
        self.period_s = period_s
        self.checkpoints = list(checkpoints)
        self.samples: list[MetricsSample] = []
        self._origin = time.monotonic()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def scrape(self) -> MetricsSample:
        async with self.session.get(self.url) as resp:
            resp.raise_for_status()
            sample = parse_metrics(await resp.text(), time.monotonic() - self._origin)
        if self.checkpoints:
            # mincore over every checkpoint (0.13 s for 14 GiB): off the event loop, which
            # times the streams' tokens and sends the requests meanwhile
            resident = await asyncio.to_thread(
                lambda: sum(weights_resident_bytes(f) for f in self.checkpoints))
            sample.values[PAGE_CACHE_METRIC] = {"": float(resident)}
        self.samples.append(sample)
        return sample

    def start(self, origin: float) -> None:
        self._origin = origin
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                await self.scrape()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass                                  # a missed scrape leaves a gap
            try:
                await asyncio.wait_for(self._stop.wait(), self.period_s)
            except asyncio.TimeoutError:
                pass

    async def stop(self) -> MetricsSample:
        """Stop the loop and take one last scrape (the run's final counters)."""
        self._stop.set()
        if self._task is not None:
            await self._task
        return await self.scrape()
