"""`mox serve --ray`'s options -> Ray Serve's deployment settings (no cluster)."""

from __future__ import annotations

import pytest

from mox.fleet.app import UNBOUNDED, FleetOptions, _scaling, models_per_replica
from mox.router.config import RouterConfig
from mox.serve import ServeOptions


def test_a_fixed_count_or_autoscaling_bounds():
    assert _scaling(FleetOptions(ServeOptions(), replicas=3)) == {"num_replicas": 3}
    scaling = _scaling(FleetOptions(ServeOptions(), min_replicas=1, max_replicas=4))
    assert scaling["autoscaling_config"]["min_replicas"] == 1
    assert scaling["autoscaling_config"]["max_replicas"] == 4
    only_max = _scaling(FleetOptions(ServeOptions(), max_replicas=2))["autoscaling_config"]
    assert (only_max["min_replicas"], only_max["max_replicas"]) == (1, 2)


def test_every_replica_may_hold_every_model_unless_bounded():
    assert models_per_replica(FleetOptions(ServeOptions(), replicas=2)) == UNBOUNDED
    assert models_per_replica(FleetOptions(ServeOptions(), max_replicas=4)) == UNBOUNDED
    assert models_per_replica(FleetOptions(ServeOptions(), models_per_replica=5)) == 5


def test_an_unbounded_set_is_one_ray_serve_takes():
    pytest.importorskip("ray")
    from mox.fleet.replica import replica_class

    assert replica_class(UNBOUNDED).hold is not None      # Ray refuses 0 and other negatives
    with pytest.raises(ValueError):
        replica_class(0)


def test_a_replica_may_use_every_core_of_its_node_unless_given_a_count(monkeypatch):
    pytest.importorskip("ray")
    from mox.fleet import replica

    monkeypatch.setattr(replica, "usable_cores", lambda: 6)
    shared = replica._share_cores(ServeOptions())
    assert (shared.router.compute_threads, shared.router.max_compute_threads) == (None, 6)
    fixed = ServeOptions(router=RouterConfig(compute_threads=1))
    assert replica._share_cores(fixed) == fixed


def test_a_set_bound_below_one_is_refused_before_ray_starts(capsys, tmp_path):
    from mox.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--ray", "--models-per-replica", "0", "--home", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--models-per-replica: must be at least 1" in capsys.readouterr().err
