"""What the pager counts per model: hits, misses, prefetches, bytes read by tier, time spent
reading and waiting, and the distribution of single-expert read times (for /metrics)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from mox.pager.expert_loader import FROM_HOST, LoadResult

# Upper bounds (seconds) of the page-in histogram: one expert read takes ~100 us from host
# RAM to ~100 ms for a large expert from a cold disk.
PAGE_IN_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5)


@dataclass
class PagerStats:
    hits: int = 0
    misses: int = 0
    prefetch_hits: int = 0
    prefetches: int = 0
    prefetch_unused: int = 0           # prefetched, then cancelled or evicted before any use
    preloads: int = 0                  # read with a cold start's dense weights (not guesses)
    bytes_read_disk: int = 0
    bytes_read_host: int = 0
    read_seconds: float = 0.0          # summed over I/O threads
    stall_seconds: float = 0.0         # steps waiting for experts to arrive
    evictions: int = 0
    mapped_reads: int = 0              # misses computed in place from the host cache (GPU)
    waves: int = 0
    peak_resident_bytes: int = 0
    # the model's decode steps captured as CUDA graphs (mox.models.decode_graphs): a capture
    # runs when a batch size is first met and again after the pools or the KV store moved
    graph_captures: int = 0
    graph_capture_seconds: float = 0.0
    # reads by duration: [i] counts reads of at most PAGE_IN_BUCKETS[i] s, the last any longer
    page_in_counts: list[int] = field(default_factory=lambda: [0] * (len(PAGE_IN_BUCKETS) + 1))

    def count_read(self, result: LoadResult) -> None:
        if result.source == FROM_HOST:
            self.bytes_read_host += result.nbytes
        else:
            self.bytes_read_disk += result.nbytes
        self.read_seconds += result.seconds
        self.page_in_counts[bisect.bisect_left(PAGE_IN_BUCKETS, result.seconds)] += 1
