"""Intra-op threads of torch on the CPU, for worker threads and compute threads.

I/O and loader threads run torch with one intra-op thread: a copy spread over every core
fights the engine's forward for them (measured: decode steps 6-8x slower while experts page
in, from OpenMP workers spinning on 2 cores). But with torch's OpenMP backend a worker's
`torch.set_num_threads(1)` also lowers the count of every thread that never set its own
(measured: the engine and the offline `LLM` caller fell to one thread, and their matmuls ran
2x slower). So compute threads pin their own count to what the process had when this module
was imported, before any worker existed (or to the count they are given:
`mox serve --compute-threads`).
"""

from __future__ import annotations

import torch

COMPUTE_THREADS = torch.get_num_threads()


def use_one_thread() -> None:
    """For I/O and loader threads, once, as they start."""
    torch.set_num_threads(1)


def use_compute_threads(count: int = COMPUTE_THREADS) -> None:
    """For threads that run model steps; cheap enough to call every step."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
