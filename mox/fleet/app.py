"""`mox serve --ray`: the Ray Serve application (an ingress and N mox replicas) and the
command that runs it on a local or an existing Ray cluster.

    app = build_app(FleetOptions(ServeOptions(...), replicas=2))
    serve.run(app, name="mox", route_prefix="/")
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from dataclasses import dataclass

from mox.errors import MoxError
from mox.fleet import require_ray
from mox.registry import Registry
from mox.serve import ServeOptions

APP_NAME = "mox"
# Ray Serve's bound for "no bound" on a replica's multiplexed set
UNBOUNDED = -1
# Requests a replica takes at once: mox batches and queues them itself (its own admission
# limits answer 429), so Ray should not hold them back at the default of 5.
MAX_ONGOING = 1024
ROUTING_STATS_PERIOD_S = 1.0


@dataclass(frozen=True)
class FleetOptions:
    serve: ServeOptions                 # what each replica runs; host/port: the Ray proxy's
    replicas: int = 2
    min_replicas: int | None = None     # with max_replicas: autoscaling between them
    max_replicas: int | None = None
    address: str | None = None          # an existing cluster ("auto", "ray://..."); None: local
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    models_per_replica: int | None = None   # None: no bound (below)

    def __post_init__(self) -> None:
        low, high = _replica_range(self)
        if low > high:
            raise MoxError(f"--min-replicas {low} is above --max-replicas {high}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None


def models_per_replica(options: FleetOptions) -> int:
    """Ray Serve's bound on a replica's multiplexed set. By default none: every replica may
    hold every model, and its own budget alone decides what it parks, as in one process. With
    the registry's models spread over the replicas (sets of 4 for 8 models on 2), Ray dropped a
    model from a set whenever a fifth arrived there, mox parked it and its next request started
    cold: goodput 0.67x and 0.69x of one process, against 0.95x and 0.80x with every model in
    every set (README, "Scaling out")."""
    return options.models_per_replica if options.models_per_replica is not None else UNBOUNDED


def _replica_range(options: FleetOptions) -> tuple[int, int]:
    """(min, max) replicas when autoscaling; (N, N) for a fixed count."""
    if not options.autoscaling:
        return options.replicas, options.replicas
    low = options.min_replicas if options.min_replicas is not None else 1
    return low, options.max_replicas if options.max_replicas is not None else max(low, 1)


def _scaling(options: FleetOptions) -> dict:
    low, high = _replica_range(options)
    if not options.autoscaling:
        return {"num_replicas": low}
    return {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                   "target_ongoing_requests": 16}}


def build_app(options: FleetOptions, app_name: str = APP_NAME):
    """The ingress bound to the replicas: a Ray Serve application."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from mox.fleet.ingress import MoxIngress
    from mox.fleet.replica import replica_class
    from mox.fleet.routing import WarmFirstRouter

    replica_options = dataclasses.replace(options.serve, host="127.0.0.1", port=0)
    replica = serve.deployment(
        replica_class(models_per_replica(options)), name="MoxReplica",
        max_ongoing_requests=MAX_ONGOING,
        # Ray's drain plus __del__, in which mox gives in-flight requests their grace
        graceful_shutdown_timeout_s=options.serve.limits.shutdown_grace_s + 10.0,
        ray_actor_options={"num_cpus": options.cpus_per_replica,
                           "num_gpus": options.gpus_per_replica},
        request_router_config=RequestRouterConfig(
            request_router_class=WarmFirstRouter,
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S),
        **_scaling(options))
    ingress = serve.deployment(MoxIngress, name="MoxIngress", max_ongoing_requests=MAX_ONGOING,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(replica_options, app_name), app_name)


def run_fleet(options: FleetOptions) -> int:
    """Start (or join) the cluster, deploy the app behind Ray's proxy on host:port, and
    serve until SIGINT/SIGTERM."""
    require_ray()
    import ray
    from ray import serve

    from mox.fleet.directory import NAMESPACE

    ray.init(address=options.address, namespace=NAMESPACE,
             include_dashboard=False, log_to_driver=True)
    if options.address is None:
        try:
            _check_room(options, ray.cluster_resources())
        except MoxError:
            ray.shutdown()
            raise
    serve.start(http_options={"host": options.serve.host, "port": options.serve.port})
    models = len(Registry(options.serve.home).list())
    serve.run(build_app(options), name=APP_NAME, route_prefix="/")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"mox: serving {models} models on http://{options.serve.host}:"
          f"{options.serve.port}/v1 through Ray Serve ({_describe(options)})",
          file=sys.stderr, flush=True)
    stop.wait()
    print("mox: stopping the Ray app", file=sys.stderr, flush=True)
    serve.delete(APP_NAME)
    _kill_directory(APP_NAME)
    ray.shutdown()
    return 0


def _check_room(options: FleetOptions, resources: dict[str, float]) -> None:
    """A local cluster has no autoscaler: replicas its CPUs or GPUs cannot hold would wait
    for resources for ever, so they are refused at once."""
    low, _ = _replica_range(options)
    for kind, per_replica in (("CPU", options.cpus_per_replica),
                              ("GPU", options.gpus_per_replica)):
        have = resources.get(kind, 0.0)
        if low * per_replica > have:
            flag = f"--{kind.lower()}s-per-replica"
            raise MoxError(f"{low} replicas of {flag} {per_replica:g} need "
                           f"{low * per_replica:g} {kind}s; this machine's Ray cluster has "
                           f"{have:g}")


def _kill_directory(app_name: str) -> None:
    import ray

    from mox.fleet.directory import NAMESPACE

    try:
        ray.kill(ray.get_actor(f"fleet-{app_name}", namespace=NAMESPACE))
    except ValueError:
        pass                              # never created


def _describe(options: FleetOptions) -> str:
    low, high = _replica_range(options)
    scaling = f"{low} replicas" if low == high else f"{low}-{high} replicas"
    return (f"{scaling}, {options.cpus_per_replica:g} CPUs and {options.gpus_per_replica:g} "
            f"GPUs each, policy {options.serve.router.policy}")
