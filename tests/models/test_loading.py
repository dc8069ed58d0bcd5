"""The dense weights, read in pieces on the I/O threads, are the checkpoint's bytes."""

from __future__ import annotations

import torch

from mox.loaders import Checkpoint
from mox.loaders.stream import StreamingReader, read_tensor
from mox.models import loading


def test_dense_weights_read_in_pieces_equal_whole_reads(hf_checkpoints, monkeypatch):
    path, _ = hf_checkpoints["qwen2_moe"]
    ckpt = Checkpoint(path)
    infos = ckpt.dense_tensors()
    most = 1000                               # splits tensors at offsets no page aligns
    pieces = loading._pieces(infos, {i.name: torch.empty(i.shape, dtype=i.dtype)
                                     for i in infos}, most)
    assert all(sum(r.length for r in ranges) <= most for ranges, _ in pieces)
    assert sum(r.length for ranges, _ in pieces for r in ranges) == sum(i.nbytes for i in infos)
    assert any(i.nbytes > most for i in infos)          # (some tensor is split)
    monkeypatch.setattr(loading, "DENSE_READ_BYTES", most)
    reader = StreamingReader(2, direct=True)
    try:
        dense = loading._DenseReader(ckpt, torch.float32, torch.device("cpu"), reader)
        for info in infos:
            assert torch.equal(dense(info.name, info.dtype), read_tensor(info)), info.name
    finally:
        reader.close()
