"""The streaming reader returns exactly the file's bytes, buffered and O_DIRECT."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mox.loaders import CheckpointError
from mox.loaders.stream import ByteRange, StreamingReader, coalesce

FILE_BYTES = 3 * 4096 + 123          # not a multiple of the O_DIRECT block


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "data.bin"
    data = os.urandom(FILE_BYTES)
    path.write_bytes(data)
    return str(path), data


@pytest.fixture(scope="module", params=[False, True], ids=["buffered", "direct"])
def reader(request):
    reader = StreamingReader(num_threads=2, direct=request.param)
    yield reader
    reader.close()


ranges_strategy = st.lists(
    st.tuples(st.integers(0, FILE_BYTES - 1), st.integers(0, 5000)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(spans=ranges_strategy)
def test_random_ranges_read_exact_bytes(data_file, reader, spans):
    path, data = data_file
    ranges = [ByteRange(path, off, min(length, FILE_BYTES - off)) for off, length in spans]
    outs = [torch.empty(r.length, dtype=torch.uint8) for r in ranges]
    reader.submit(ranges, outs).result()                  # on an I/O thread
    for r, out in zip(ranges, outs):
        assert bytes(out.numpy()) == data[r.offset:r.end]


def test_adjacent_ranges_coalesce_into_one_run(data_file):
    path, _ = data_file
    ranges = [ByteRange(path, 100, 50), ByteRange(path, 0, 100), ByteRange(path, 400, 10),
              ByteRange(path, 150, 5)]
    assert coalesce(ranges) == [[1, 0, 3], [2]]


def test_reads_into_typed_destinations(data_file, reader):
    path, data = data_file
    out = torch.empty(4, 8, dtype=torch.bfloat16)              # 64 bytes
    reader.read_into([ByteRange(path, 4090, 64)], [out])
    assert bytes(out.view(torch.uint8).reshape(-1).numpy()) == data[4090:4154]


def page_aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    return raw[skip:skip + nbytes]


def test_aligned_run_is_read_straight_into_its_destinations(data_file):
    """An aligned run (an expert-major import read into whole-page slots) needs no bounce
    buffer; the bytes are the file's, scattered across both destinations."""
    path, data = data_file
    reader = StreamingReader(num_threads=1, direct=True)
    try:
        first, second = page_aligned(4096), page_aligned(2 * 4096)
        reader.submit([ByteRange(path, 0, 4096), ByteRange(path, 4096, 2 * 4096)],
                      [first, second]).result()
        assert bytes(first.numpy()) == data[:4096]
        assert bytes(second.numpy()) == data[4096:3 * 4096]
        if path in reader._no_direct:                  # e.g. tmpfs: buffered reads, no bounce
            pytest.skip("the temp folder's filesystem refuses O_DIRECT")
        bounces = reader.submit_call(lambda: getattr(reader._local, "bounce", None)).result()
        assert bounces is None
        # one unaligned destination: the whole run goes through the bounce buffer
        odd = page_aligned(4096 + 1)[1:]
        reader.submit([ByteRange(path, 0, 4096)], [odd]).result()
        assert bytes(odd.numpy()) == data[:4096]
        assert reader.submit_call(lambda: getattr(reader._local, "bounce", None)).result() \
            is not None
    finally:
        reader.close()


def test_direct_io_refused_falls_back_to_buffered(data_file, monkeypatch, caplog):
    path, data = data_file
    real_open = os.open

    def refusing_open(p, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(p, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    reader = StreamingReader(direct=True)
    out = reader.read([ByteRange(path, 10, 5000)])[0]
    assert bytes(out.numpy()) == data[10:5010]
    assert path in reader._no_direct
    reader.read([ByteRange(path, 0, 100)])
    # said once: its reads, counted as disk reads, may come from the page cache
    said = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(said) == 1 and path in said[0].getMessage()


def test_read_past_the_end_names_the_file_and_what(data_file, reader):
    path, _ = data_file
    with pytest.raises(CheckpointError, match=r"data\.bin.*layer 2 expert 5.*truncated"):
        reader.read([ByteRange(path, FILE_BYTES - 10, 20, "layer 2 expert 5")])


def test_missing_file_names_it(tmp_path, reader):
    with pytest.raises(CheckpointError, match=r"gone\.bin.*cannot read.*expert 1"):
        reader.read([ByteRange(str(tmp_path / "gone.bin"), 0, 10, "expert 1")])


def test_the_reader_is_busy_while_a_call_is_queued_or_running():
    reader = StreamingReader(num_threads=1)
    release = threading.Event()
    try:
        assert not reader.busy
        first = reader.submit_call(release.wait, 10)
        second = reader.submit_call(lambda: None)
        assert reader.busy
        second.cancel()                       # queued behind `first`: dropped, still counted
        release.set()
        assert first.result(timeout=10)
        deadline = time.monotonic() + 10
        while reader.busy and time.monotonic() < deadline:    # the count drops just after
            time.sleep(0.01)
        assert not reader.busy
    finally:
        release.set()
        reader.close()
