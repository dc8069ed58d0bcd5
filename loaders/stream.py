"""The streaming reader: byte ranges of checkpoint files into caller-owned host buffers, with
`pread` on a small pool of I/O threads.

- Adjacent ranges are coalesced into one `preadv` that scatters into the callers' buffers (an
  expert's gate, up and down weights are usually adjacent on disk: one syscall, no copy).
- O_DIRECT mode bypasses the page cache, as a cold read really is. A run whose file offset,
  buffers and lengths are all 4 KiB-aligned (an expert-major import read into slot pages) is
  read straight into its buffers; any other goes through the aligned superset in a reused
  bounce buffer and is copied out. A file or filesystem that refuses O_DIRECT falls back to
  buffered reads, remembered per file.
- Files are opened per read, not cached: a checkpoint file deleted or replaced while serving
  fails (or recovers) on the next read instead of reading a stale inode.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from .errors import CheckpointError
from .io_pool import DEMAND, IOPool
from .safetensors_format import TensorInfo

log = logging.getLogger("mox.loaders")

DIRECT_IO_ALIGNMENT = 4096        # logical block size O_DIRECT needs for offset, length, address
DEFAULT_IO_THREADS = 4            # NVMe needs a few reads in flight; more only adds contention
T = TypeVar("T")


@dataclass(frozen=True)
class ByteRange:
    file: str
    offset: int
    length: int
    label: str = ""               # what the bytes are, for error messages ("layer 3 expert 7")

    @property
    def end(self) -> int:
        return self.offset + self.length


def coalesce(ranges: Sequence[ByteRange]) -> list[list[int]]:
    """Indices of `ranges` grouped into runs that are contiguous in one file, in file order."""
    order = sorted(range(len(ranges)), key=lambda i: (ranges[i].file, ranges[i].offset))
    runs: list[list[int]] = []
    for i in order:
        prev = ranges[runs[-1][-1]] if runs else None
        if prev is not None and prev.file == ranges[i].file and prev.end == ranges[i].offset:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def byte_view(t: torch.Tensor) -> memoryview:
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


class StreamingReader:
    """Thread-safe; `submit` returns a Future, `read_into` blocks the calling thread."""

    def __init__(self, num_threads: int = DEFAULT_IO_THREADS, direct: bool = False) -> None:
        self.direct = direct
        self._pool = IOPool(num_threads)
        # its threads hold the pool, not the reader: a reader dropped unclosed (an `LLM`
        # that goes out of scope) stops them rather than leaving them to wait forever. Not
        # at exit: threads woken while the interpreter finalizes abort the process
        weakref.finalize(self, self._pool.stop).atexit = False
        self._local = threading.local()            # per-thread aligned bounce buffer
        self._no_direct: set[str] = set()          # files whose filesystem refused O_DIRECT
        self._lock = threading.Lock()

    def submit(self, ranges: Sequence[ByteRange], outs: Sequence[torch.Tensor],
               priority: int = DEMAND) -> Future:
        return self._pool.submit(self.read_into, ranges, outs, priority=priority)

    def num_queued(self) -> int:
        return self._pool.num_queued()

    @property
    def busy(self) -> bool:
        """Reads queued or running: their threads want CPU (a bounce copy, page faults)."""
        return self._pool.busy

    def submit_call(self, fn: Callable[..., T], *args: object, priority: int = DEMAND) -> Future:
        """Run `fn(*args)` on an I/O thread (a load that reads, then copies and commits)."""
        return self._pool.submit(fn, *args, priority=priority)

    def promote(self, future: Future) -> bool:
        """A call submitted at a lower priority that a step now waits on: to demand priority,
        if it is still queued (`IOPool.promote`)."""
        return self._pool.promote(future)

    def read_into(self, ranges: Sequence[ByteRange], outs: Sequence[torch.Tensor]) -> None:
        """Fill each `outs[i]` (contiguous CPU tensor of exactly `ranges[i].length` bytes)."""
        assert len(ranges) == len(outs)
        for r, out in zip(ranges, outs):
            assert out.numel() * out.element_size() == r.length, (r, out.shape)
        for run in coalesce(ranges):
            self._read_run([ranges[i] for i in run],
                           [outs[i].view(torch.uint8).reshape(-1) for i in run])

    def read(self, ranges: Sequence[ByteRange]) -> list[torch.Tensor]:
        outs = [torch.empty(r.length, dtype=torch.uint8) for r in ranges]
        self.read_into(ranges, outs)
        return outs

    def close(self) -> None:
        self._pool.shutdown()

    def _read_run(self, run: list[ByteRange], outs: list[torch.Tensor]) -> None:
        """`outs`: flat uint8 views of the destinations, in file order."""
        path = run[0].file
        if self.direct and path not in self._no_direct:
            try:
                return self._read_direct(run, outs)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise _as_checkpoint_error(run, e) from e
                with self._lock:
                    first = path not in self._no_direct
                    self._no_direct.add(path)      # this filesystem refuses O_DIRECT
                # said once a file: its reads, counted as disk reads, may be page-cache hits
                if first:
                    log.warning("%s: the filesystem refuses O_DIRECT; its reads go through the "
                                "page cache, so its bytes read from disk may be served from "
                                "RAM", path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise _as_checkpoint_error(run, e) from e
        try:
            _preadv_exact(fd, [byte_view(out) for out in outs], run[0].offset, run)
        except OSError as e:
            raise _as_checkpoint_error(run, e) from e
        finally:
            os.close(fd)

    def _read_direct(self, run: list[ByteRange], outs: list[torch.Tensor]) -> None:
        fd = os.open(run[0].file, os.O_RDONLY | os.O_DIRECT)
        try:
            if _aligned(run[0].offset, outs):
                # the device writes straight into the destinations: no bounce, no copy (the
                # copy costs as much CPU as the read on a CPU pool, and competes with compute)
                return _preadv_exact(fd, [byte_view(out) for out in outs], run[0].offset, run)
            self._read_via_bounce(fd, run, outs)
        finally:
            os.close(fd)

    def _read_via_bounce(self, fd: int, run: list[ByteRange], outs: list[torch.Tensor]) -> None:
        """The run's 4 KiB-aligned superset into this thread's bounce buffer, then copied out."""
        start = run[0].offset // DIRECT_IO_ALIGNMENT * DIRECT_IO_ALIGNMENT
        end = -(-run[-1].end // DIRECT_IO_ALIGNMENT) * DIRECT_IO_ALIGNMENT
        bounce = self._bounce(end - start)
        view = byte_view(bounce)
        done = 0
        while done < end - start:
            n = os.preadv(fd, [view[done:]], start + done)
            if n == 0:                           # EOF: the last block is short, which is fine
                break                            # once every requested byte has arrived
            done += n
        if start + done < run[-1].end:
            raise _truncated(run, start + done)
        pos = run[0].offset - start
        for out in outs:                         # torch copies release the GIL
            out.copy_(bounce[pos:pos + out.numel()])
            pos += out.numel()

    def _bounce(self, nbytes: int) -> torch.Tensor:
        """A reused, 4 KiB-aligned buffer of this thread (O_DIRECT needs the alignment)."""
        buf = getattr(self._local, "bounce", None)
        if buf is None or buf.numel() < nbytes:
            raw = torch.empty(nbytes + DIRECT_IO_ALIGNMENT, dtype=torch.uint8)
            skip = -raw.data_ptr() % DIRECT_IO_ALIGNMENT
            buf = self._local.bounce = raw[skip:skip + nbytes]   # the view keeps raw alive
        return buf[:nbytes]


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """One tensor read whole, synchronously, on the calling thread (tools and tests; serving
    goes through `StreamingReader`)."""
    out = torch.empty(info.nbytes, dtype=torch.uint8)
    run = [ByteRange(info.file, info.offset, info.nbytes, f"tensor {info.name!r}")]
    try:
        fd = os.open(info.file, os.O_RDONLY)
    except OSError as e:
        raise _as_checkpoint_error(run, e) from e
    try:
        _preadv_exact(fd, [byte_view(out)], info.offset, run)
    finally:
        os.close(fd)
    return out.view(info.dtype).view(info.shape)


def _aligned(offset: int, outs: list[torch.Tensor]) -> bool:
    """Whether O_DIRECT can read a run at `offset` straight into `outs`: the file offset,
    every buffer's address and every length on the alignment (an expert-major import's
    layout, read into slot pools, whose rows are whole pages)."""
    return offset % DIRECT_IO_ALIGNMENT == 0 and all(
        out.data_ptr() % DIRECT_IO_ALIGNMENT == 0 and out.numel() % DIRECT_IO_ALIGNMENT == 0
        for out in outs)


def _preadv_exact(fd: int, views: list[memoryview], offset: int, run: list[ByteRange]) -> None:
    pending = [v for v in views if len(v)]
    while pending:
        n = os.preadv(fd, pending, offset)
        if n == 0:
            raise _truncated(run, offset)
        offset += n
        while n and pending:                     # drop what was filled, trim the partial one
            if n >= len(pending[0]):
                n -= len(pending.pop(0))
            else:
                pending[0] = pending[0][n:]
                n = 0


def _what(run: list[ByteRange]) -> str:
    labels = [r.label for r in run if r.label]
    return f" ({', '.join(labels)})" if labels else ""


def _truncated(run: list[ByteRange], at: int) -> CheckpointError:
    return CheckpointError(run[0].file, f"file ends at byte {at}, before byte {run[-1].end} "
                           f"of the read{_what(run)} (truncated?)")


def _as_checkpoint_error(run: list[ByteRange], e: OSError) -> CheckpointError:
    return CheckpointError(run[0].file, f"cannot read{_what(run)}: {e.strerror or e}")
