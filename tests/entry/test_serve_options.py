"""`mox serve`'s options reach the router's configuration."""

from __future__ import annotations

import msgspec
import pytest

from mox.cli import build_parser, router_config, server_limits
from mox.errors import InvalidRequestError, MoxError
from mox.registry import Registry
from mox.serve import in_registration_order


def test_serve_options_reach_the_router_config():
    args = build_parser().parse_args(["serve", "--tpot-target", "250", "--device-memory",
                                      "1GiB", "--policy", "model-swap"])
    config = router_config(args)
    assert config.tpot_target_s == 0.25
    assert config.device_memory == 1 << 30 and config.policy == "model-swap"
    assert router_config(build_parser().parse_args(["serve"])).tpot_target_s is None


@pytest.mark.parametrize("ms", ["0", "-5", "nan"])
def test_a_tpot_target_that_is_not_a_positive_time_is_refused(ms):
    args = build_parser().parse_args(["serve", "--tpot-target", ms])
    with pytest.raises(InvalidRequestError, match="TPOT target"):
        router_config(args)


def test_a_cap_below_the_default_output_limit_lowers_the_default():
    def limits(*argv):
        return server_limits(build_parser().parse_args(["serve", *argv]))

    assert limits("--max-tokens-cap", "100").default_max_tokens == 100
    assert limits().default_max_tokens == 2048 and limits().max_tokens_cap == 16384
    assert limits("--max-tokens-cap", "100", "--default-max-tokens", "50").default_max_tokens == 50
    with pytest.raises(MoxError, match="default_max_tokens 500 is above max_tokens_cap 100"):
        limits("--max-tokens-cap", "100", "--default-max-tokens", "500")
    with pytest.raises(SystemExit):                 # argparse's usage error (test_cli_args)
        limits("--max-tokens-cap", "0")


def test_models_are_served_in_the_order_they_were_added(home, demo_path):
    """Where the budget cannot hold every model, the last added is refused: at start the
    registry's by-name listing had made it the last by name, so a restart failed another."""
    registry = Registry(home)
    for name, added in (("zz-first", "2026-01-01T00:00:00+00:00"),
                        ("aa-second", "2026-01-02T00:00:00+00:00")):
        registry.add(name, demo_path)
        with registry.update() as models:
            models[name] = msgspec.structs.replace(models[name], added=added)
    assert [e.name for e in registry.list()] == ["aa-second", "zz-first"]
    assert [e.name for e in in_registration_order(registry.list())] == ["zz-first", "aa-second"]
