"""The engine: continuous batching across models over one elastic KV pool."""

from mox.engine.engine import Engine
from mox.engine.in_flight import StepInfo
from mox.engine.scheduler import SchedulerConfig

__all__ = ["Engine", "SchedulerConfig", "StepInfo"]
