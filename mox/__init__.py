"""mox: serve many mixture-of-experts LLMs from one machine by paging experts, not models.

Top-level names load lazily, so `import mox.kernels` (math only) does not pull in the
serving stack and its dependencies.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"LLM": "mox.llm", "RequestOutput": "mox.llm", "CheckpointError": "mox.errors",
            "MoxError": "mox.errors"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mox' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
