"""What a read into never-touched memory costs: `preadv` of expert-sized chunks from a file in
the page cache into a fresh anonymous mapping (as a CPU slot pool that grows gets) against the
same mapping once every page has been written (a pool whose slots are reused).

A CPU pool hands a shrink's pages back to the OS (`madvise(MADV_DONTNEED)`, mox/slot_pool.py),
so every slot a pool gains is fresh: its first load also pays a page fault per 4 KiB and the
kernel's zeroing, on the cores that compute.

    .venv/bin/python -m mox.bench.micro.fresh_pages [--chunk-mib 3] [--count 200]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time


def read_all(fd: int, view: memoryview, chunk: int, count: int) -> float:
    """Seconds per chunk to read `count` chunks of the file into `view`."""
    start = time.perf_counter()
    for i in range(count):
        os.preadv(fd, [view[i * chunk:(i + 1) * chunk]], i * chunk)
    return (time.perf_counter() - start) / count


def fresh_then_touched(fd: int, chunk: int, count: int) -> tuple[float, float]:
    mapping = mmap.mmap(-1, chunk * count, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(mapping)
    try:
        return read_all(fd, view, chunk, count), read_all(fd, view, chunk, count)
    finally:
        view.release()
        mapping.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-mib", type=float, default=3.0, help="bytes per read (an expert)")
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    chunk = int(args.chunk_mib * 2**20)
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR")) as f:
        block = os.urandom(chunk)
        for _ in range(args.count):
            f.write(block)                            # now in the page cache
        f.flush()
        fd = os.open(f.name, os.O_RDONLY)
        try:
            runs = [fresh_then_touched(fd, chunk, args.count) for _ in range(args.repeats)]
        finally:
            os.close(fd)
    fresh = statistics.median(r[0] for r in runs) * 1e6
    touched = statistics.median(r[1] for r in runs) * 1e6
    print(f"preadv of {args.chunk_mib:g} MiB from the page cache, median of {args.repeats} x "
          f"{args.count}: fresh pages {fresh:.0f} us, touched pages {touched:.0f} us "
          f"({fresh / touched:.2f}x)")


if __name__ == "__main__":
    main()
