"""How much of a file the operating system's page cache holds (`mincore(2)` over a private
mapping): RAM that weights occupy outside any budget mox keeps, which an honest benchmark
counts (the weights only: a shard's header, the config and the tokenizer are small and read
through the cache on purpose). Linux only; Python has no binding, so libc's `mincore` is
called through ctypes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os

import numpy as np

from .safetensors_format import HEADER_LENGTH_BYTES

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def resident_bytes(path: str, start: int = 0) -> int:
    """Bytes of `path` from offset `start` on that are in the page cache now (whole pages)."""
    size = os.path.getsize(path)
    if size <= start:
        return 0
    pages = -(-size // mmap.PAGESIZE)
    vector = ctypes.create_string_buffer(pages)
    # a private mapping is writable to ctypes (which needs that to take its address) and
    # never writes the file; mincore reports the page cache for pages it has not copied
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        base = ctypes.c_char.from_buffer(mapped)
        try:
            failed = _libc.mincore(ctypes.addressof(base), size, vector)
        finally:
            del base                                 # release the export before unmapping
    if failed:
        raise OSError(ctypes.get_errno(), f"mincore({path})")
    first = start // mmap.PAGESIZE
    # bit 0 of each byte: the page is resident (a counting loop in Python took ~0.3 s for
    # 16 GB of checkpoints at every scrape)
    resident = int((np.frombuffer(vector.raw, dtype=np.uint8)[first:] & 1).sum())
    return min(size - start, resident * mmap.PAGESIZE)


def weights_resident_bytes(folder: str) -> int:
    """Page-cache bytes of the tensor data (past each header) of a checkpoint's shards."""
    total = 0
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                header = int.from_bytes(f.read(HEADER_LENGTH_BYTES), "little")
            total += resident_bytes(path, HEADER_LENGTH_BYTES + header)
    return total


def evict(path: str) -> None:
    """Write the file back, then drop it from the page cache (no root needed): the next read
    of it comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
