"""Intra-op threads of torch on the CPU for the threads that run model steps.

I/O and loader threads run torch with one intra-op thread (loaders/threads.py). But with
torch's OpenMP backend a worker's `torch.set_num_threads(1)` also lowers the count of every
thread that never set its own (measured: the engine and the offline `LLM` caller fell to one
thread, and their matmuls ran 2x slower). So the engine pins its own count on every step: what
the process had when this module was imported (the router and the offline `LLM` import the
engine before any pager exists, so before any I/O thread has run), or the count it is given
(`mox serve --compute-threads`).
"""

from __future__ import annotations

import torch

COMPUTE_THREADS = torch.get_num_threads()


def use_compute_threads(count: int = COMPUTE_THREADS) -> None:
    """For threads that run model steps; cheap enough to call every step."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
