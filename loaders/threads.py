"""Intra-op threads of torch on the CPU for I/O and loader threads: one each. A copy spread over
every core fights the engine's forward for them (measured: decode steps 6-8x slower while
experts page in, from OpenMP workers spinning on 2 cores). The threads that run model steps
pin their own count (mox/engine/threads.py), since this setting leaks into threads that never
set theirs.
"""

from __future__ import annotations

import torch


def use_one_thread() -> None:
    """For I/O and loader threads, once, as they start."""
    torch.set_num_threads(1)
