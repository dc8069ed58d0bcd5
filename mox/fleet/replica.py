"""One replica of the fleet: a whole mox (router, engine, pager, its own memory budget) whose
HTTP server listens on loopback; Ray Serve calls `forward` with each request the ingress
routed here, and the request goes through the same handlers as under `mox serve`.

Which models a replica holds is Ray Serve's multiplexed set (`hold`, at most
`models_per_replica`): Ray's routers learn it from there, and when Ray drops a model from the
set to make room, mox releases it (parks it once its running requests finish) rather than
restarting anything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections import Counter
from collections.abc import AsyncGenerator

import aiohttp
import ray
from ray import serve

from mox.engine.threads import usable_cores
from mox.fleet.directory import REPORT_PERIOD_S, directory
from mox.fleet.messages import REPLICA_HEADER, Exchange, ResponseHead, end_to_end
from mox.fleet.warmth import replica_report, warm_on_another
from mox.messages import ModelState
from mox.router.timeline import replica_step_log
from mox.serve import RouterBackend, ServeOptions, start_serving
from mox.server.app import METRICS

log = logging.getLogger("mox.fleet")


class Held:
    """A model in the replica's multiplexed set (`holding`). Ray calls `__del__` when it
    drops the model from the set; Python calls it again when the object is collected, so it
    acts once."""

    def __init__(self, name: str, backend: RouterBackend, holding: set[str]) -> None:
        self.name, self._backend, self._holding, self._released = name, backend, holding, False
        holding.add(name)

    def __del__(self) -> None:
        if self._released:
            return
        self._released = True
        name = self.name
        self._holding.discard(name)
        self._backend.async_engine.call(lambda router: router.release(name))


class MoxReplica:
    async def __init__(self, options: ServeOptions, app_name: str) -> None:
        replica_id = serve.get_replica_context().replica_id
        self.replica_id, self._actor = replica_id.unique_id, replica_id.to_full_id_str()
        self.serving = await start_serving(_share_cores(_own_step_log(options,
                                                                      self.replica_id)))
        self._base = f"http://127.0.0.1:{self.serving.port}"
        # no total timeout: a stream lasts as long as its generation; the mox server's own
        # limits bound each request
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                              connector=aiohttp.TCPConnector(limit=0))
        self._holding: set[str] = set()               # the multiplexed set, as Held keeps it
        self._landed: Counter[str] = Counter()        # requests routed here, per model
        self._landed_warm: Counter[str] = Counter()   # ... that found the model warm
        self._landed_held: Counter[str] = Counter()   # ... that found it in the set
        # ... that found it cold here but warm on another replica (by the others' reports,
        # relayed in the reply to this one's: up to two report periods old): what routing,
        # not the budget, could have saved
        self._landed_warm_elsewhere: Counter[str] = Counter()
        self._fleet: dict[str, dict] = {}             # the directory's last reply
        self._directory = directory(app_name)
        self._reporter = asyncio.create_task(self._report_forever())
        log.info("replica %s serving on %s", self.replica_id, self._base)

    async def forward(self, exchange: Exchange) -> AsyncGenerator[ResponseHead | bytes, None]:
        """The request, answered by this replica's mox: the response head, then body chunks
        as they come (a stream's events one by one)."""
        model = serve.get_multiplexed_model_id()
        served = self.serving.backend.router.models.get(model)
        if served is not None:
            self._count_landing(model, served.state)
            if served.state != ModelState.FAILED:   # (a name mox does not serve evicts nothing)
                await self.hold(model)
        async with self._session.request(exchange.method, self._base + exchange.path,
                                         headers=exchange.headers,
                                         data=exchange.body) as response:
            yield ResponseHead(response.status, [*end_to_end(response.headers.items()),
                                                 (REPLICA_HEADER, self.replica_id)])
            async for chunk in response.content.iter_any():
                yield chunk

    async def hold(self, model: str) -> Held:          # replaced by replica_class
        raise NotImplementedError

    def _held(self, model: str) -> Held:
        return Held(model, self.serving.backend, self._holding)

    def _count_landing(self, model: str, state: ModelState) -> None:
        self._landed[model] += 1
        self._landed_warm[model] += state == ModelState.WARM
        self._landed_held[model] += model in self._holding
        self._landed_warm_elsewhere[model] += (
            state != ModelState.WARM and warm_on_another(model, self._fleet, self.replica_id))

    async def record_routing_stats(self) -> dict:
        """Ray Serve asks every replica for this every second and hands it to the routers
        (mox.fleet.routing)."""
        return replica_report(self.serving.backend.snapshot())

    def report(self) -> dict:
        body, _ = self.serving.runner.app[METRICS].render()
        return {"actor": self._actor, "node": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(),
                "landed": dict(self._landed), "landed_warm": dict(self._landed_warm),
                "landed_held": dict(self._landed_held),
                "landed_warm_elsewhere": dict(self._landed_warm_elsewhere),
                "metrics": body.decode(),
                **replica_report(self.serving.backend.snapshot())}

    async def _report_forever(self) -> None:
        while True:
            try:
                self._fleet = await self._directory.report.remote(self.replica_id,
                                                                  self.report())
            except Exception:  # noqa: BLE001 - reporting must not stop serving
                log.exception("replica %s: report to the fleet directory failed",
                              self.replica_id)
            await asyncio.sleep(REPORT_PERIOD_S)

    async def __del__(self) -> None:
        """Ray Serve's graceful stop: in-flight requests get the shutdown grace (streams cut
        after it end with an error event), then the forwarding session closes."""
        if not hasattr(self, "_reporter"):          # __init__ failed part way
            return
        self._reporter.cancel()
        await self.serving.stop()
        await self._session.close()


def _own_step_log(options: ServeOptions, replica_id: str) -> ServeOptions:
    """`--step-log run.steps.jsonl` -> `run-<replica>.steps.jsonl`: one timeline per engine
    (mox.router.timeline.replica_step_log)."""
    path = options.router.step_log
    if not path:
        return options
    router = dataclasses.replace(options.router, step_log=replica_step_log(path, replica_id))
    return dataclasses.replace(options, router=router)


def _share_cores(options: ServeOptions) -> ServeOptions:
    """Unless `--compute-threads` fixes a count, a replica's engine may use every core of its
    node, less those its neighbours (the other replicas, Ray) keep busy, as one `mox serve`
    does (mox.engine.threads.SharedCores). Ray starts an actor with one OpenMP thread per CPU
    it reserved, so the engine's default ceiling would be that share: with two replicas on two
    cores, a replica stepping alone then left one core idle."""
    if options.router.compute_threads is not None:
        return options
    router = dataclasses.replace(options.router,
                                 max_compute_threads=usable_cores())
    return dataclasses.replace(options, router=router)


def replica_class(models_per_replica: int) -> type[MoxReplica]:
    """MoxReplica with its multiplexed set bounded (the bound is fixed where the method is
    decorated, so each value gets its own subclass)."""

    class Replica(MoxReplica):
        @serve.multiplexed(max_num_models_per_replica=models_per_replica)
        async def hold(self, model: str) -> Held:
            return self._held(model)

    return Replica
