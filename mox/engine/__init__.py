"""The engine: continuous batching across models over one elastic KV pool."""

from mox.engine.engine import Engine
from mox.engine.scheduler import SchedulerConfig
from mox.engine.sequence import FinishReason, Request, RequestOutput

__all__ = ["Engine", "FinishReason", "Request", "RequestOutput", "SchedulerConfig"]
