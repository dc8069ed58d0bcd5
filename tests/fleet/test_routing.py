"""The fleet's request router inside Ray Serve's routing loop (no cluster): fake replicas,
each with a model warm, answer Ray's queue-length probes after random delays, so routing
tasks overlap as they do under a burst."""

from __future__ import annotations

import asyncio
import random

from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve._private.request_router.common import PendingRequest

from mox.fleet.routing import WarmFirstRouter

DEPLOYMENT = DeploymentID(name="MoxReplica", app_name="mox")
PROBE_S = 0.01                     # longest delay of a fake replica's queue-length answer


class FakeReplica:
    """What Ray's router reads of a replica: id, bound, routing stats, multiplexed set, and
    its queue length when probed."""

    def __init__(self, name: str, warm: str, rng: random.Random) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = 1024
        self.routing_stats = {"queue": 0, "warmth": {warm: 1.0}, "cold_start_cost": {}}
        self.multiplexed_model_ids = {warm}
        self.node_id, self.availability_zone = "node", None
        self._rng = rng

    async def get_queue_len(self, *, deadline_s: float) -> int:
        await asyncio.sleep(self._rng.random() * PROBE_S)
        return 0


async def _route_burst(models: str, rng: random.Random) -> tuple[list[tuple[str, str]], int]:
    """Each request of `models` (one letter a model) -> (model, replica it was given), and
    the requests Ray's indices still hold after all were placed."""
    router = WarmFirstRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.update_replicas([FakeReplica("r-a", "a", rng), FakeReplica("r-b", "b", rng)])

    async def one(i: int, model: str) -> tuple[str, str]:
        await asyncio.sleep(rng.random() * 2 * PROBE_S)
        request = PendingRequest([], {}, RequestMetadata(f"req-{i}", f"internal-{i}",
                                                         multiplexed_model_id=model))
        replica = await router._choose_replica_for_request(request)
        return model, replica.replica_id.unique_id

    placed = await asyncio.gather(*(one(i, m) for i, m in enumerate(models)))
    held = (len(router._pending_requests_by_id)
            + sum(len(q) for q in router._pending_requests_by_model_id.values()))
    return placed, held


def test_a_burst_of_two_models_lands_each_request_where_its_model_is_warm():
    # (with Ray's FIFOMixin, a replica chosen for a request another routing task had placed
    # went to the oldest pending request of either model: 14 of these 40 were misplaced)
    placed, held = asyncio.run(_route_burst("ab" * 20, random.Random(0)))
    assert len(placed) == 40
    assert [replica for _, replica in placed] == [f"r-{model}" for model, _ in placed]
    # and Ray's indices of pending requests keep none once all are placed (its per-model
    # index, emptied only by FIFOMixin's matching, had kept all 40)
    assert held == 0
