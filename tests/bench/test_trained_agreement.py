"""The trained-agreement bench's pieces: its chain follows its successor table at the stated
probabilities, and a trained state is written back in the source checkpoint's own layout."""

from __future__ import annotations

import os

import pytest
import torch

from mox.bench.micro.trained_agreement import SUCCESSOR_PROBS, Chain, _write_like
from mox.loaders import Checkpoint
from mox.loaders.stream import read_tensor


def test_the_chain_steps_to_its_successors_at_their_probabilities():
    chain = Chain(seed=3)
    seqs = chain.sample(2000, 32)
    prev, nxt = seqs[:, :-1].ravel(), seqs[:, 1:].ravel()
    rank = (chain.successors[prev] == nxt[:, None])            # [N, successors]
    assert rank.any(axis=1).all()                               # only successors follow
    shares = rank.mean(axis=0)
    assert shares == pytest.approx(SUCCESSOR_PROBS, abs=0.01)


def test_a_state_is_written_under_the_sources_names_and_files(tmp_path, demo_home):
    source = os.path.join(demo_home, "models", "qwen3-moe-demo")
    ckpt = Checkpoint(source)
    state = {n: torch.full(tuple(i.shape), float(k % 7)) for k, (n, i) in
             enumerate(ckpt.tensors.items())}
    out = str(tmp_path / "trained")
    _write_like(source, out, state)
    written = Checkpoint(out)
    assert sorted(written.tensors) == sorted(ckpt.tensors)
    assert sorted(os.listdir(out)) == sorted(os.listdir(source))
    for name, info in written.tensors.items():
        assert info.dtype == torch.bfloat16
        assert torch.equal(read_tensor(info).float(), state[name])
    with pytest.raises(RuntimeError, match="lacks"):
        _write_like(source, str(tmp_path / "partial"), dict(list(state.items())[1:]))
