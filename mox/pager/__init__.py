"""The expert pager: the shared I/O and lock (`pager`); each model's pool of experts, with its
waves, leases, prefetch and budget (`model_pool`) and the loading and eviction under them
(`paging`); the reads a step waits for, handed to its driver (`pending`); the pool's tensors
and residency table (`slot_pool`); moving one expert's bytes (`expert_loader`); the RAM tier
(`host_cache`); eviction policies (`eviction`); per-expert activation frequencies (`usage`);
and the figures it counts (`stats`)."""

from mox.pager.host_cache import HostCache
from mox.pager.model_pool import Lease, ModelPool, PoolDemand
from mox.pager.pager import ExpertPager, make_pager
from mox.pager.pending import ReadsPending, run_to_end
from mox.pager.stats import PagerStats

__all__ = ["ExpertPager", "HostCache", "Lease", "ModelPool", "PagerStats", "PoolDemand",
           "ReadsPending", "make_pager", "run_to_end"]
