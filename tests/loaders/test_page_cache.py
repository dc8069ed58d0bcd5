"""Page-cache residency (mincore): what a buffered read leaves in RAM, and that mox's O_DIRECT
reader leaves nothing."""

from __future__ import annotations

import os

import pytest

from mox.loaders import Checkpoint
from mox.loaders.page_cache import evict, resident_bytes, weights_resident_bytes
from mox.loaders.stream import ByteRange, StreamingReader

MiB = 1 << 20
READAHEAD_SLACK = 1 * MiB        # header reads may pull a little of the data in (readahead)


def test_buffered_reads_show_up_and_eviction_clears_them(tmp_path):
    path = str(tmp_path / "blob")
    with open(path, "wb") as f:
        f.write(os.urandom(8 * MiB))
    evict(path)
    if resident_bytes(path) != 0:
        pytest.skip("this filesystem keeps files in memory (tmpfs): nothing to evict")
    with open(path, "rb") as f:
        f.seek(4 * MiB)
        f.read(2 * MiB)
    assert 2 * MiB <= resident_bytes(path) <= 2 * MiB + 2 * READAHEAD_SLACK
    assert resident_bytes(path, start=6 * MiB + READAHEAD_SLACK) == 0
    evict(path)
    assert resident_bytes(path) == 0


def test_the_direct_reader_leaves_the_weights_out_of_the_page_cache(demo_home):
    folder = os.path.join(demo_home, "models", "olmoe-demo")
    ckpt = Checkpoint(folder)                     # headers: buffered, a few KiB each
    for name in os.listdir(folder):
        evict(os.path.join(folder, name))
    infos = list(ckpt.tensors.values())
    reader = StreamingReader(direct=True)
    try:
        reader.read([ByteRange(i.file, i.offset, i.nbytes, i.name) for i in infos])
    finally:
        reader.close()
    assert weights_resident_bytes(folder) <= READAHEAD_SLACK
    buffered = StreamingReader(direct=False)
    try:
        buffered.read([ByteRange(i.file, i.offset, i.nbytes, i.name) for i in infos])
    finally:
        buffered.close()
    assert weights_resident_bytes(folder) >= sum(i.nbytes for i in infos) - READAHEAD_SLACK
