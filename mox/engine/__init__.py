"""The engine: continuous batching across models over one elastic KV pool."""

from mox.engine.async_engine import AsyncEngine
from mox.engine.engine import Engine
from mox.engine.scheduler import SchedulerConfig
from mox.engine.sequence import FinishReason, Request, RequestOutput

__all__ = ["AsyncEngine", "Engine", "FinishReason", "Request", "RequestOutput", "SchedulerConfig"]
