"""A CPU tensor over an anonymous mapping whose pages are backed only where written: the slot
pools' storage on the CPU (mox.pager.slot_pool), sized for every expert of a model but paying
only for the slots in use."""

from __future__ import annotations

import mmap

import torch


class MappedTensor:
    """A CPU tensor over its own anonymous mapping: pages are backed on first write and can
    be handed back (they read as zeros after)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        nbytes = max(1, dtype.itemsize * int(torch.Size(shape).numel()))
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                              | getattr(mmap, "MAP_NORESERVE", 0))
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8).view(dtype).view(shape)
        self.row_nbytes = nbytes // shape[0]

    def release_rows(self, start: int, end: int) -> None:
        """Give back the whole pages inside rows [start, end)."""
        first = -(-start * self.row_nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end * self.row_nbytes // mmap.PAGESIZE * mmap.PAGESIZE
        if last > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def release(self) -> None:
        """Give back every page (the last one too, where the mapping ends inside it)."""
        self._map.madvise(mmap.MADV_DONTNEED)
