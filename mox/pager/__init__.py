"""The expert pager: per-model slot pools on the compute device, filled from the host cache or
the disk on demand (`pager`), the pools themselves (`slot_pool`), moving one expert's bytes
(`expert_loader`), the RAM tier (`host_cache`), eviction policies (`eviction`) and per-expert
activation frequencies (`usage`)."""

from mox.pager.pager import ExpertPager, Lease, PageInObserver, PagerStats, make_pager

__all__ = ["ExpertPager", "Lease", "PageInObserver", "PagerStats", "make_pager"]
