"""Fixtures of the entry-point tests: a fresh MOX_HOME and the smallest demo checkpoint."""

from __future__ import annotations

import os

import pytest

DEMO = "qwen2-moe-demo"          # the smallest demo checkpoint (~18 MB)


@pytest.fixture
def home(tmp_path) -> str:
    return str(tmp_path / "home")


@pytest.fixture
def demo_path(demo_home) -> str:
    """Shared by the session: tests only read it."""
    return os.path.join(demo_home, "models", DEMO)
