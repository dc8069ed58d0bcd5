"""A bad number or device on the command line is argparse's one-line error naming the option
(exit 2), and a bad router setting is refused by RouterConfig itself (the offline API too)."""

from __future__ import annotations

import pytest

from mox.cli import build_parser
from mox.demo import DEMO_ARCHITECTURES
from mox.errors import InvalidRequestError
from mox.router import RouterConfig


@pytest.mark.parametrize("argv, option", [
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--port", "-1"], "--port"),
    (["serve", "--device", "gpu"], "--device"),
    (["serve", "--device", "cuda:x"], "--device"),
    (["serve", "--device", "mps"], "--device"),
    (["serve", "--device", "cuda:7"], "--device"),        # no such GPU (none in CI)
    (["serve", "--ray", "--replicas", "0"], "--replicas"),
    (["generate", "p", "--max-tokens", "0"], "--max-tokens"),
    (["bench", "--models", "0"], "--models"),
    (["bench", "--prompt-tokens", "-5"], "--prompt-tokens"),
    (["bench", "--rate", "nan"], "--rate"),
    (["bench", "--duration", "inf"], "--duration"),
    (["bench", "--cv", "0"], "--cv"),
    (["bench", "--alpha", "-1"], "--alpha"),
    (["bench", "--routing-skew", "0", "-1"], "--routing-skew"),
    (["bench", "--ray", "--replicas", "0"], "--replicas"),
    (["serve", "--header-timeout", "0"], "--header-timeout"),
    (["serve", "--body-timeout", "-1"], "--body-timeout"),
    (["serve", "--max-connections", "0"], "--max-connections"),
    (["serve", "--max-body-size", "0"], "--max-body-size"),
    (["serve", "--max-body-size", "lots"], "--max-body-size"),
    (["serve", "--default-max-tokens", "0"], "--default-max-tokens"),
    (["serve", "--max-tokens-cap", "0"], "--max-tokens-cap"),
    (["serve", "--shutdown-grace", "-1"], "--shutdown-grace"),
])
def test_bad_values_are_a_usage_error_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err and "Traceback" not in err


def test_good_values_pass():
    args = build_parser().parse_args(["serve", "--port", "0", "--device", "cpu"])
    assert args.port == 0 and args.device == "cpu"
    args = build_parser().parse_args(["serve", "--max-body-size", "2MiB", "--shutdown-grace", "0"])
    assert args.max_body_size == 2 << 20 and args.shutdown_grace == 0
    assert build_parser().parse_args(["bench", "--models", "2", "--rate", "0.5"]).rate == 0.5
    for arch in DEMO_ARCHITECTURES:         # the load test builds any demo architecture
        assert build_parser().parse_args(["bench", "--arch", arch]).arch == arch


@pytest.mark.parametrize("field, value", [
    ("compute_threads", 0), ("max_waiting", 0), ("max_waiting_per_model", -1),
    ("queue_timeout_s", 0.0), ("dense_idle_s", float("nan")), ("plan_period_s", -1.0),
    ("decode_steps", 0), ("max_batched_tokens", 0), ("kv_memory", 0)])
def test_router_settings_out_of_range_are_refused(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        RouterConfig(**{field: value})
