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


@pytest.mark.parametrize("argv, message", [
    (["--min-replicas", "3", "--max-replicas", "1"], "--min-replicas 3 is above --max-replicas 1"),
    (["--replicas", "2", "--max-replicas", "3"], "not both"),
])
def test_replica_counts_that_disagree_are_one_clear_error(capsys, tmp_path, argv, message):
    pytest.importorskip("ray")
    from mox.cli import main

    assert main(["serve", "--ray", "--home", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("option, value", [
    ("--min-replicas", "-1"), ("--max-replicas", "0"), ("--cpus-per-replica", "-1"),
    ("--gpus-per-replica", "-1"),
])
def test_negative_fleet_sizes_are_a_usage_error(capsys, tmp_path, option, value):
    from mox.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--ray", option, value, "--home", str(tmp_path)])
    assert exit_.value.code == 2 and f"argument {option}" in capsys.readouterr().err


@pytest.mark.parametrize("fields, message", [
    ({"gpus_per_replica": 1.0}, "--gpus-per-replica 1 need 2 GPUs; this machine's Ray "
                                "cluster has 0"),
    ({"cpus_per_replica": 3.0}, "--cpus-per-replica 3 need 6 CPUs"),
])
def test_replicas_a_local_cluster_cannot_place_are_refused(fields, message):
    from mox.errors import MoxError
    from mox.fleet.app import _check_room

    options = FleetOptions(ServeOptions(), replicas=2, **fields)
    with pytest.raises(MoxError, match=message):
        _check_room(options, {"CPU": 2.0})
    _check_room(FleetOptions(ServeOptions(), replicas=2), {"CPU": 2.0})     # fits
