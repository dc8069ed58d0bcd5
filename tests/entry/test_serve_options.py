"""`mox serve`'s options reach the router's configuration."""

from __future__ import annotations

from mox.cli import build_parser, router_config


def test_serve_options_reach_the_router_config():
    args = build_parser().parse_args(["serve", "--tpot-target", "250", "--device-memory",
                                      "1GiB", "--policy", "model-swap"])
    config = router_config(args)
    assert config.tpot_target_s == 0.25
    assert config.device_memory == 1 << 30 and config.policy == "model-swap"
    assert router_config(build_parser().parse_args(["serve"])).tpot_target_s is None
