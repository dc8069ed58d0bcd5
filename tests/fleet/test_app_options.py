"""`mox serve --ray`'s options -> Ray Serve's deployment settings (no cluster)."""

from __future__ import annotations

from mox.fleet.app import FleetOptions, _scaling, models_per_replica
from mox.serve import ServeOptions


def test_a_fixed_count_or_autoscaling_bounds():
    assert _scaling(FleetOptions(ServeOptions(), replicas=3)) == {"num_replicas": 3}
    scaling = _scaling(FleetOptions(ServeOptions(), min_replicas=1, max_replicas=4))
    assert scaling["autoscaling_config"]["min_replicas"] == 1
    assert scaling["autoscaling_config"]["max_replicas"] == 4
    only_max = _scaling(FleetOptions(ServeOptions(), max_replicas=2))["autoscaling_config"]
    assert (only_max["min_replicas"], only_max["max_replicas"]) == (1, 2)


def test_models_per_replica_spreads_the_registry_over_the_replicas():
    assert models_per_replica(FleetOptions(ServeOptions(), replicas=2), 8) == 4
    assert models_per_replica(FleetOptions(ServeOptions(), replicas=3), 8) == 3
    assert models_per_replica(FleetOptions(ServeOptions(), max_replicas=4), 8) == 2
    assert models_per_replica(FleetOptions(ServeOptions(), replicas=2), 0) == 1
    assert models_per_replica(FleetOptions(ServeOptions(), models_per_replica=5), 8) == 5
