"""mox: serve many mixture-of-experts LLMs from one machine by paging experts, not models."""

from mox.errors import CheckpointError, MoxError
from mox.llm import LLM, RequestOutput

__all__ = ["LLM", "CheckpointError", "MoxError", "RequestOutput"]
