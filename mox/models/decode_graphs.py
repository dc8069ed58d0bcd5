"""Decode steps replayed as CUDA graphs (issue 20): a GPU decode step that reads its experts
through the pager's table (`MoEDecoder._table_stream`) asks the host nothing between its
embedding and its logits, so the whole step is captured once per padded batch size and then
replayed: one launch instead of ~1,000.

- Padding: n sequences run the graph of the smallest capture size B >= n; rows n..B repeat
  row 0 (its token, position, KV slot and key range), so they write the same K/V to the same
  slot and route to the same experts: nothing outside the batch's own rows changes, and the
  experts the step marks used are the batch's.
- Inputs: a replay reads static buffers; before each, the batch's index tensors and the
  expert table's rows (`row_of`, the row offsets) are copied into them (device to device).
- The KV store moves: it grows by doubling and is released while the model has no
  sequence. So the step reads it from fixed anchors plus each layer's offsets to its rows
  (`KVAnchor`, set before each replay), and its moves cost no capture.
- What a graph bakes in besides: the expert pools, the rotary tables and the buffers' sizes
  (`_baked`). A step that finds one moved (the pool was resized, the tables grew) drops
  every graph and captures anew; each capture is counted (`PagerStats.graph_captures`, and
  its seconds in the step's timeline line). Parking the model drops them
  (`MoEDecoder.drop_graphs`).
- `GraphCapture` is the mechanism: `CudaGraphCapture` on a GPU; `EagerCapture` on a CPU, where
  a "replay" runs the step again over the same static buffers, so the CPU suite checks the
  padding, the buffers and the bookkeeping (with the Triton kernels under the interpreter).

Legend: B padded batch size, n sequences, L MoE layers, E experts, R expert-table rows.
"""

from __future__ import annotations

import bisect
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from mox.kernels import ExpertRows
from mox.models.forward_batch import ForwardBatch
from mox.models.kv_store import KVAnchor, KVStore
from mox.models.rotary import Rotary
from mox.pager import ModelPool
from mox.pager.expert_table import ExpertMap
from mox.pager.model_pool import Hold

# Padded batch sizes a graph is captured for (vLLM's are similar): up to the table path's
# largest decode batch (TABLE_STEP_MAX_TOKENS); a size is captured when a batch first needs it.
CAPTURE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
MIN_KV_CAPACITY = 4096            # keys the static slot buffer holds at first (it doubles)

Step = Callable[[], torch.Tensor]
# the model's step through the table: (batch, hold, used [L, E]) -> logits [T, V] f32
TableForward = Callable[[ForwardBatch, Hold, torch.Tensor], torch.Tensor]


class GraphCaptureError(RuntimeError):
    """A step could not be captured (the model then decodes eagerly)."""


def capture_size(num_tokens: int) -> int | None:
    """The graph size a batch of `num_tokens` decode rows runs (None: larger than any)."""
    i = bisect.bisect_left(CAPTURE_SIZES, num_tokens)
    return CAPTURE_SIZES[i] if i < len(CAPTURE_SIZES) else None


class GraphCapture(Protocol):
    def capture(self, step: Step) -> Step:
        """`step` recorded; the returned callable replays it (its result: the step's output
        tensor, rewritten by each replay)."""

    def release(self) -> None:
        """Every captured graph's memory back."""


class EagerCapture:
    """No graphs (CPUs): `capture` runs the step once, as the GPU's warm-up does, and a replay
    runs it again over the same static buffers."""

    def capture(self, step: Step) -> Step:
        step()
        return step

    def release(self) -> None:
        pass


class CudaGraphCapture:
    """torch.cuda graphs sharing one memory pool (a model's graphs run one at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: list[torch.cuda.CUDAGraph] = []
        self._side = torch.cuda.Stream(device)      # (one: the allocator pools per stream)

    def capture(self, step: Step) -> Step:
        # warm-up on a side stream first: Triton compiles, cuBLAS picks its kernels and
        # workspaces, and the caching allocator settles before anything is recorded
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(self._side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the pager's I/O threads keep copying experts in on their own streams
        # (and pinning buffers) while this thread captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = step()
        self._graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay

    def release(self) -> None:
        self._graphs.clear()
        self._pool = torch.cuda.graph_pool_handle()


def default_capture(device: torch.device) -> GraphCapture | None:
    """CUDA graphs on a GPU unless `MOX_CUDA_GRAPHS=0` (the eager path, for comparison)."""
    if device.type != "cuda" or os.environ.get("MOX_CUDA_GRAPHS", "1") == "0":
        return None
    return CudaGraphCapture(device)


@dataclass
class StaticInputs:
    """What a replay reads that changes from step to step, at the largest capture size."""

    per_row: torch.Tensor            # [5, B] int64: the rows below, loaded in one gather
    kv_slots: torch.Tensor           # [capacity]
    table: ExpertMap                 # row_of [L, E] and the row offsets [R], static
    used: torch.Tensor               # [L, E] the experts the step computed (read back)
    kv: KVAnchor                     # the KV store from fixed anchors

    @property
    def input_ids(self) -> torch.Tensor:               # [B]
        return self.per_row[0]

    @property
    def positions(self) -> torch.Tensor:               # [B]
        return self.per_row[1]

    @property
    def slot_mapping(self) -> torch.Tensor:            # [B]
        return self.per_row[2]

    @property
    def starts(self) -> torch.Tensor:                  # [B] each token's keys in `kv_slots`
        return self.per_row[3]

    @property
    def lengths(self) -> torch.Tensor:                 # [B]
        return self.per_row[4]

    @staticmethod
    def allocate(table: ExpertMap, kv: KVStore, kv_capacity: int,
                 device: torch.device) -> StaticInputs:
        rows = table.rows
        static_rows = ExpertRows(*(None if t is None else torch.zeros_like(t)
                                   for t in (rows.w13, rows.w2, rows.s13, rows.s2)),
                                 aligned=rows.aligned)
        static = replace(table, row_of=torch.zeros_like(table.row_of), rows=static_rows)
        return StaticInputs(
            torch.zeros(5, CAPTURE_SIZES[-1], dtype=torch.int64, device=device),
            torch.zeros(kv_capacity, dtype=torch.int64, device=device), static,
            torch.zeros_like(table.row_of), kv.anchor())


class DecodeGraphs:
    """One model's decode graphs, one per capture size it has met (see the module doc)."""

    def __init__(self, capture: GraphCapture, forward: TableForward, rotary: Rotary,
                 pool: ModelPool) -> None:
        self.capture, self.forward, self.rotary, self.pool = capture, forward, rotary, pool
        self._replays: dict[int, Step] = {}
        self._baked: tuple | None = None
        self._inputs: StaticInputs | None = None
        # the live hold with the static table, during a step (an EagerCapture's replay runs
        # the step again; nothing keeps the pools alive between steps)
        self._hold: Hold | None = None
        # the table whose rows the buffers hold (weakly: its mapped host bytes may go)
        self._loaded: weakref.ref[ExpertMap] | None = None
        self._kv_capacity = 0
        self._padding: dict[tuple[int, int], torch.Tensor] = {}   # see _pad_index

    @property
    def sizes(self) -> list[int]:
        """The batch sizes captured now."""
        return sorted(self._replays)

    def serves(self, batch: ForwardBatch) -> bool:
        """Whether `step` takes this batch: decode rows (one new token a sequence, every one
        sampled), few enough for a capture size."""
        return (batch.key_ranges is not None
                and batch.logits_indices is None and capture_size(batch.num_tokens) is not None)

    def reserve(self, num_keys: int, max_position: int) -> None:
        """Room for a run's later steps up front (their keys and positions), so the run does
        not capture again halfway."""
        self.rotary.reserve(max_position + 1)
        if num_keys > self._kv_capacity:
            self._kv_capacity = max(num_keys, 2 * self._kv_capacity, MIN_KV_CAPACITY)

    def step(self, batch: ForwardBatch, hold: Hold) -> torch.Tensor:
        """Logits `[n, V]` f32 of the batch's decode step (callers check `serves`), replayed
        under `hold` (`holding(table=True)`, its table complete); the experts the step used
        are left in `hold.device_used`. The logits are the graph's output buffer: read them
        before the next step."""
        size = capture_size(batch.num_tokens)
        self.reserve(batch.kv_slots.numel(), batch.max_position)   # (not inside a capture)
        baked = _baked(hold, self.rotary, self._kv_capacity)
        if baked != self._baked:
            self.drop()
            self._baked = baked
            self._inputs = StaticInputs.allocate(hold.table, batch.kv, self._kv_capacity,
                                                 batch.input_ids.device)
        self._load(batch, hold.table, size)
        self._hold = replace(hold, table=self._inputs.table, used=[], device_used=None)
        try:
            logits = self._replay(size, batch.kv)()[:batch.num_tokens]
        finally:
            self._hold = None
        hold.device_used = self._inputs.used
        return logits

    def _load(self, batch: ForwardBatch, table: ExpertMap, size: int) -> None:
        """The batch's rows (padded to `size`), keys and KV store, and the table's rows
        where a refresh made a new table, into the static buffers."""
        inputs = self._inputs
        inputs.kv.follow(batch.kv)
        # the rows, padded, in three kernels (a stack, a gather, a copy) rather than ten
        rows = torch.stack((batch.input_ids, batch.positions, batch.slot_mapping,
                            *batch.key_ranges))                                  # [5, n]
        inputs.per_row[:, :size] = rows.index_select(1, self._pad_index(batch.num_tokens,
                                                                         size))
        inputs.kv_slots[:batch.kv_slots.numel()].copy_(batch.kv_slots)
        if self._loaded is None or self._loaded() is not table:
            self._loaded = weakref.ref(table)
            inputs.table.row_of.copy_(table.row_of)
            for dst, src in zip(_offsets(inputs.table.rows), _offsets(table.rows)):
                dst.copy_(src)

    def _replay(self, size: int, kv: KVStore) -> Step:
        """The graph of `size` rows, captured now if this is its first step (counted)."""
        replay = self._replays.get(size)
        if replay is None:
            started = time.perf_counter()
            try:
                replay = self.capture.capture(lambda: self._forward(size, kv))
            except Exception as exc:
                raise GraphCaptureError(f"capturing a decode step of {size} rows: "
                                        f"{type(exc).__name__}: {exc}") from exc
            self._replays[size] = replay
            self.pool.count_graph_capture(time.perf_counter() - started)
        return replay

    def _pad_index(self, num_rows: int, size: int) -> torch.Tensor:
        """`[size]`: 0 .. num_rows - 1, then 0 (the padding rows repeat row 0)."""
        index = self._padding.get((num_rows, size))
        if index is None:
            index = self._padding[num_rows, size] = torch.tensor(
                [*range(num_rows), *[0] * (size - num_rows)], device=self._inputs.kv_slots.device)
        return index

    def _forward(self, size: int, kv: KVStore) -> torch.Tensor:
        """The step over the static buffers at `size` rows: logits `[B, V]` f32 (what a
        graph records; a fresh batch each call, as its memos must be recorded too). The
        store is read through the anchors only (`kv` gives its shapes)."""
        inputs = self._inputs
        none = inputs.input_ids[:0]                  # (q_seq, kv_seq, kv_pos: unread here)
        batch = ForwardBatch(inputs.input_ids[:size], inputs.positions[:size], none,
                             inputs.slot_mapping[:size], inputs.kv_slots, none, none, kv,
                             max_position=self.rotary.num_positions - 1,
                             key_ranges=(inputs.starts[:size], inputs.lengths[:size]),
                             kv_anchor=inputs.kv)
        inputs.used.zero_()
        return self.forward(batch, self._hold, inputs.used)

    def drop(self) -> None:
        """Every graph and its buffers gone (the next step captures anew)."""
        self._replays.clear()
        self.capture.release()
        self._baked = self._inputs = self._hold = self._loaded = None


def _offsets(rows: ExpertRows) -> list[torch.Tensor]:
    return [t for t in (rows.w13, rows.w2, rows.s13, rows.s2) if t is not None]


def _baked(hold: Hold, rotary: Rotary, kv_capacity: int) -> tuple:
    """The addresses and sizes a captured step reads besides its static inputs."""
    rows = hold.table.rows
    return (hold.w13.data_ptr(), hold.w2.data_ptr(),
            None if hold.scales is None else (hold.scales.w13.data_ptr(),
                                              hold.scales.w2.data_ptr()),
            hold.table.row_of.shape, rows.num_rows, rows.aligned, kv_capacity,
            rotary.cos.data_ptr(), rotary.sin.data_ptr())
