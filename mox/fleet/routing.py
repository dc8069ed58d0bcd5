"""The fleet's request router: Ray Serve's multiplexing sends a model's requests to replicas
that hold it; this goes further and ranks every candidate by how warm the model is there
(dense weights on, share of experts resident, from each replica's routing stats) less the
queue it would wait behind (mox.fleet.warmth): Ray's count of requests sent to the replica,
fresher than the stats' during a burst. A model warm nowhere starts at its home replica."""

from __future__ import annotations

import logging

from ray.serve.request_router import (
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

from mox.fleet.warmth import Candidate, rank

log = logging.getLogger("mox.fleet")


class WarmFirstRouter(MultiplexMixin, RequestRouter):
    """Ray's default matching gives the replica chosen for a request to that request alone.
    (With Ray's FIFOMixin, a replica chosen for a request that another routing task had
    meanwhile placed went to the oldest pending request, of whatever model: in the bench a
    request was ranked to the replica where its model was warm and landed on the other,
    where it parked the hot model; harness-ray-33 at 45 s.)"""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        model = ""
        if pending_request is not None:
            model = pending_request.metadata.multiplexed_model_id
            # when every replica is full, wait before probing again (Ray's multiplex and
            # locality helpers set this; this router uses neither)
            pending_request.routing_context.should_backoff = True
        try:
            candidates = [Candidate(r, r.routing_stats or None,
                                    model in r.multiplexed_model_ids,
                                    len(r.multiplexed_model_ids),
                                    self.replica_queue_len_cache.get(r.replica_id),
                                    r.replica_id.unique_id)
                          for r in candidate_replicas]
            return rank(candidates, model)
        except Exception:  # noqa: BLE001 - Ray would drop the request's routing task
            # (it logs and moves on, and only FIFOMixin's matching would ever place the
            # request after that): any replica beats a request left pending for ever
            log.exception("ranking replicas for %r failed; any replica will do", model)
            return [list(candidate_replicas)]

    def _add_pending_request_to_indices(self, pending_request: PendingRequest) -> None:
        """Ray indexes pending requests by id and by multiplexed model id. The model index
        is read, and emptied, only by FIFOMixin's matching, so without it every request ever
        routed would stay in it: index by id alone."""
        self._pending_requests_by_id.setdefault(pending_request.metadata.internal_request_id,
                                                pending_request)
