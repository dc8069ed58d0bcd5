"""One generic MoE decoder for every supported architecture, driven by `ModelSpec`.

Legend: T tokens, H hidden, V vocab.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from mox.kernels import native, triton_ops
from mox.kernels.native_attention import AttentionLayer
from mox.kernels.native_moe import MoELayer
from mox.kernels.native_step import StepLayers, step_layers, step_tail
from mox.loaders.spec import ModelSpec
from mox.models.attention import (
    AttentionWeights,
    attention,
    attention_block,
    native_layer,
    takes_block,
)
from mox.models.decode_graphs import DecodeGraphs, GraphCapture, GraphCaptureError
from mox.models.forward_batch import ForwardBatch
from mox.models.kv_cache import SEQUENCE_BLOCK_SIZE, SequenceKVCache
from mox.models.kv_store import KVStore
from mox.models.layers import MLPWeights, add_rms_norm, linear, rms_norm
from mox.models.mla import MLAWeights, mla_attention
from mox.models.moe import (
    MoEWeights,
    activation,
    moe_block,
    native_moe_layer,
    paged_experts,
    route,
    table_moe_block,
    takes_native,
)
from mox.models.rotary import Rotary
from mox.pager import ModelPool, ReadsPending, run_to_end
from mox.pager.model_pool import Hold

log = logging.getLogger(__name__)

# A step of at most this many tokens (decode, a short prefill) may read experts in place from
# the host cache: a long prefill would read each mapped expert over the link once per block of
# its tokens.
TABLE_STEP_MAX_TOKENS = 64


def new_kv_store(spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 block_size: int) -> KVStore:
    if spec.mla is not None:       # the latent as "key", the shared rope key as "value"
        return KVStore(spec.num_layers, 1, spec.mla.kv_lora_rank, dtype, device, block_size,
                       value_dim=spec.mla.qk_rope_head_dim)
    return KVStore(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype, device, block_size)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor                  # [H]
    post_attention_norm: torch.Tensor         # [H]
    attention: AttentionWeights | MLAWeights
    mlp: MoEWeights | MLPWeights              # MoE block, or a dense MLP layer


class MoEDecoder:
    def __init__(self, spec: ModelSpec, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor,
                 experts: ModelPool) -> None:
        assert len(layers) == spec.num_layers
        self.spec = spec
        self.embed = embed                    # [V, H]
        self.layers = layers
        self.final_norm = final_norm          # [H]
        self.lm_head = lm_head                # [V, H] (the embedding itself when tied)
        self.experts = experts
        self.rotary = Rotary(spec.rope, embed.device)
        self.attention = attention if spec.mla is None else mla_attention
        moe = [layer.mlp for layer in layers if isinstance(layer.mlp, MoEWeights)]
        # each MoE block's successor, whose router predicts what to prefetch
        self.next_moe = {a.moe_layer: b for a, b in zip(moe, moe[1:])}
        self._first_moe = next((i for i, layer in enumerate(layers)
                                if isinstance(layer.mlp, MoEWeights)), None)
        self._native_layers: dict[int, AttentionLayer | None] = {}   # see _native_layer
        self._native_moe_layers: dict[int, MoELayer | None] = {}      # see _native_moe
        self._every_layer_native: bool | None = None                   # see _chains
        self._step: tuple[tuple, StepLayers] | None = None             # see _step_layers
        self._tail = step_tail(final_norm, lm_head, spec.rms_norm_eps)  # see _decode_layers
        self.graphs: DecodeGraphs | None = None                           # see use_graphs

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def new_kv_store(self, block_size: int) -> KVStore:
        return new_kv_store(self.spec, self.dtype, self.device, block_size)

    def new_cache(self) -> SequenceKVCache:
        return SequenceKVCache(self.new_kv_store(SEQUENCE_BLOCK_SIZE))

    def forward(self, input_ids: torch.Tensor, cache: SequenceKVCache) -> torch.Tensor:
        """One sequence: run `input_ids` `[T]` after the cache's tokens; logits `[T, V]` f32."""
        assert input_ids.dim() == 1 and input_ids.numel() > 0
        return self.forward_batch(cache.batch_for(input_ids))

    def forward_batch(self, batch: ForwardBatch) -> torch.Tensor:
        """One forward over a flattened batch of sequences; logits `[S, V]` f32 of the tokens
        in `batch.logits_indices` (all `[T, V]` when it is None)."""
        return run_to_end(self.forward_steps(batch))

    @torch.inference_mode()
    def forward_steps(self, batch: ForwardBatch
                      ) -> Generator[ReadsPending | None, None, torch.Tensor]:
        """`forward_batch` as a generator that yields None after each layer (or each native
        call of several) and the reads a MoE layer waits for, so its driver may step another
        model meanwhile (the engine does)."""
        logits = None

        def keep(step_logits: torch.Tensor) -> None:
            nonlocal logits
            logits = step_logits

        yield from self.decode_steps(batch if batch.ahead is None else replace(batch, ahead=None),
                                     keep)
        return logits

    @torch.inference_mode()
    def decode_steps(self, batch: ForwardBatch,
                     pick: Callable[[torch.Tensor], torch.Tensor | None]
                     ) -> Generator[ReadsPending | None, None, None]:
        """Forward passes of `batch`, each step's logits `[S, V]` f32 handed to `pick`, which
        returns the next step's input ids `[S]` or None to stop: one step, or as many as
        `batch.ahead` plans where a CPU decode chains its layers natively or a GPU decode
        replays its graphs (elsewhere the first step runs and the batch ends there). Yields
        as `forward_steps` does."""
        x = F.embedding(batch.input_ids, self.embed)                                  # [T, H]
        # (every layer's attention has the same shapes and dtype: one answer for the batch)
        native_block = self.spec.mla is None and takes_block(self.layers[0].attention, x, batch)
        native_moe = batch.key_ranges is not None and self._takes_native_moe(x)
        if native_block and native_moe and self._chains():
            yield from self._decode_layers(x, batch, pick)
            return
        if self.experts.maps_host_experts and x.shape[0] <= TABLE_STEP_MAX_TOKENS:
            if self.graphs is not None and self.graphs.serves(batch):
                if self._graph_steps(batch, pick):
                    return
            x = yield from self._table_layers(x, batch)
        else:
            x = yield from self._layer_steps(x, batch, native_block, native_moe)
        pick(self._logits(x, batch))

    def _logits(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The stream after the last layer -> logits `[S, V]` f32 of the sampled rows."""
        if batch.logits_indices is not None:
            x = x[batch.logits_indices]                                               # [S, H]
        if x.shape[0] == 0:           # a prompt's chunk that samples nothing (chunked prefill)
            return x.new_empty((0, self.lm_head.shape[0]), dtype=torch.float32)
        x = rms_norm(x, self.final_norm, self.spec.rms_norm_eps)
        return linear(x, self.lm_head).float()

    def _layer_steps(self, x: torch.Tensor, batch: ForwardBatch, native_block: bool,
                     native_moe: bool) -> Generator[ReadsPending | None, None, torch.Tensor]:
        """The layers one by one: the stream `x [T, H]` through each, natively per half where
        the flags say (CPU decode)."""
        for i, layer in enumerate(self.layers):
            native_layer = self._native_layer(i) if native_block else None
            if native_layer is not None:           # CPU decode: the same steps in one call
                x, h = attention_block(native_layer, i, x, self.rotary, batch)
            else:
                x, h = self._attention_half(i, x, batch)
            if isinstance(layer.mlp, MoEWeights):
                self._prefetch_next(layer.mlp, h)
                x = yield from moe_block(self.spec, layer.mlp, self.experts, h, x,
                                         self._native_moe(i) if native_moe else None)
            else:
                x = x + layer.mlp(h)
            yield None
        return x

    def _attention_half(self, i: int, x: torch.Tensor, batch: ForwardBatch
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's attention half step by step: the stream after it, and its normed rows
        for the MLP half."""
        layer, eps = self.layers[i], self.spec.rms_norm_eps
        out = self.attention(self.spec, layer.attention, i, rms_norm(x, layer.input_norm, eps),
                             self.rotary, batch)
        return add_rms_norm(x, out, layer.post_attention_norm, eps)

    def _decode_layers(self, x: torch.Tensor, batch: ForwardBatch,
                       pick: Callable[[torch.Tensor], torch.Tensor | None]
                       ) -> Generator[ReadsPending | None, None, None]:
        """CPU decode steps, every layer through native calls (csrc/decode_layers.c): one
        call for a whole step while the tokens' experts are resident (the steps back to back
        under one hold on them); a layer that finds one missing pages its experts in waves,
        and the next call takes up after it. The call that runs the last layer also runs the
        tail where it can (every row sampled, and the native norm and GEMV serve the tail's
        shapes); each step's logits go to `pick`, and the tokens it returns are the next
        step's input."""
        kernels, gate, num_layers = native.kernels(), activation(self.spec), len(self.layers)
        h = torch.empty_like(x)
        rows = batch.decode_rows(self.rotary)
        stores = [batch.kv.rows(i) for i in range(num_layers)]
        moe_layers = [layer.mlp.moe_layer for layer in self.layers]
        tail = (self._tail if self._tail is not None and batch.logits_indices is None
                and native.takes(x, self.lm_head) and native.takes_norm(x, self.final_norm)
                else None)
        step, first, going = 0, 0, True

        def finish_step(logits: torch.Tensor | None) -> bool:
            """Step `step` ran its last layer (`logits` None: its tail runs in torch here):
            its tokens picked; whether another step follows (its rows then in `x`, in place:
            the chain's calls read the stream there)."""
            nonlocal step
            next_ids = pick(logits if logits is not None else self._logits(x, batch))
            step += 1
            if next_ids is None or step == rows.num_steps:
                return False
            torch.index_select(self.embed, 0, next_ids, out=x)
            return True

        while going:
            with self.experts.holding() as hold:
                chain = kernels.decode_chain(self._step_layers(stores, hold.slot_of), x, h,
                                             rows, stores[0], hold.w13, hold.w2, hold.scales,
                                             gate, hold.b13, hold.b2, tail)
                while going:                        # steps back to back while resident
                    done, weights, ids, logits = chain(first, step)
                    hold.used += zip(moe_layers[first:done],
                                     ids.numpy().reshape(num_layers, -1)[first:done].tolist())
                    if done < num_layers:
                        break
                    first, going = 0, finish_step(logits)
            if done < num_layers:                   # layer `done` missed: page it, go on after
                x[:] = yield from paged_experts(self.spec, self.layers[done].mlp, self.experts,
                                                h, x, weights[done], ids[done])
                first = done + 1
                if first == num_layers:
                    first, going = 0, finish_step(None)
            yield None

    def _table_layers(self, x: torch.Tensor, batch: ForwardBatch
                      ) -> Generator[ReadsPending | None, None, torch.Tensor]:
        """A GPU step with no host round-trip in its layers: every MoE layer reads its
        experts through the pager's table (in a slot, or in place from the pinned host
        cache: `table_moe_block`), and the experts the step used are read back once, when
        its hold ends. Where some expert's bytes are only on disk, the layers page as usual."""
        with self.experts.holding(table=True) as hold:
            if hold.table.complete:
                used = hold.device_used = torch.zeros(  # (read back even if a layer raises)
                    self.experts.num_moe_layers, self.spec.num_experts, dtype=torch.int32,
                    device=x.device)
                x = self._table_stream(x, batch, hold, used)
        if not hold.table.complete:
            return (yield from self._layer_steps(x, batch, False, False))
        yield None
        return x

    def _table_stream(self, x: torch.Tensor, batch: ForwardBatch, hold: Hold,
                      used: torch.Tensor) -> torch.Tensor:
        """The stream `x [T, H]` through every layer, the experts read through `hold.table`
        (complete) and marked in `used [L, E]`: no host round-trip, so a CUDA graph may
        record it (mox.models.decode_graphs)."""
        for i, layer in enumerate(self.layers):
            x, h = self._attention_half(i, x, batch)
            if isinstance(layer.mlp, MoEWeights):
                x = table_moe_block(self.spec, layer.mlp, hold, h, x, used)
            else:
                x = x + layer.mlp(h)
        return x

    def _graph_steps(self, batch: ForwardBatch,
                     pick: Callable[[torch.Tensor], torch.Tensor | None]) -> bool:
        """The batch's decode steps replayed from their graphs, `batch.ahead`'s back to back
        (each under its own hold: the experts it used counted, the table refreshed for the
        next); False where the first finds some expert's bytes only on disk (nothing ran:
        the caller pages). A later step that finds one ends the run there (the engine's next
        step pages it)."""
        step, ahead, next_ids = batch, batch.ahead, batch.input_ids
        if ahead is not None:
            self.graphs.reserve(ahead.kv_slots.numel(), ahead.max_position)
        for j in range(1 if ahead is None else ahead.positions.shape[0]):
            if j:
                positions = ahead.positions[j]
                step = replace(batch, input_ids=next_ids, positions=positions,
                               slot_mapping=ahead.slot_mapping[j], kv_slots=ahead.kv_slots,
                               key_ranges=(ahead.starts, positions + 1),
                               max_position=ahead.max_position, ahead=None, padded=None,
                               _memo={})
            logits = self._graph_step(step)
            if logits is None:
                return j > 0
            next_ids = pick(logits)
            if next_ids is None:
                break
        return True

    def _graph_step(self, batch: ForwardBatch) -> torch.Tensor | None:
        """One decode step replayed from its CUDA graph: its logits `[S, V]`, or None where
        some expert's bytes are only on disk (the step then pages)."""
        with self.experts.holding(table=True) as hold:
            if not hold.table.complete:
                return None
            try:
                return self.graphs.step(batch, hold)
            except GraphCaptureError:
                # (graphs are an optimisation: serve eagerly rather than fail the requests)
                log.exception("model %s decodes without CUDA graphs from now on",
                              self.experts.name)
                self.use_graphs(None)
                return None

    def _graph_forward(self, batch: ForwardBatch, hold: Hold,
                       used: torch.Tensor) -> torch.Tensor:
        """A decode step through the table from token ids to logits `[T, V]`: what a graph
        records."""
        x = F.embedding(batch.input_ids, self.embed)
        return self._logits(self._table_stream(x, batch, hold, used), batch)

    def use_graphs(self, capture: GraphCapture | None) -> None:
        """Decode steps through the table replayed as graphs captured by `capture` (None:
        run eagerly). Only where the Triton kernels write and read the KV store in place
        (RoPE with the KV write, decode attention): MLA's expansion and GPT-OSS's sinks
        gather keys in shapes set on the host."""
        self.drop_graphs()
        in_place = (self.spec.mla is None and triton_ops.takes_rope(self.rotary.rope.rotary_dim)
                    and all(layer.attention.sinks is None for layer in self.layers))
        self.graphs = (DecodeGraphs(capture, self._graph_forward, self.rotary, self.experts)
                       if capture is not None and in_place else None)

    def drop_graphs(self) -> None:
        """The captured graphs' memory back (parking; the next step captures anew)."""
        if self.graphs is not None:
            self.graphs.drop()

    def _chains(self) -> bool:
        """Whether a CPU decode step may run its layers in one native call: each layer's
        halves take the native blocks (no dense MLP layers, no shared experts) and the pager
        predicts nothing (prefetch routes each next layer from Python)."""
        if self._every_layer_native is None:
            self._every_layer_native = all(
                self._native_layer(i) is not None and isinstance(layer.mlp, MoEWeights)
                and layer.mlp.shared_expert is None and self._native_moe(i) is not None
                for i, layer in enumerate(self.layers))
        return self._every_layer_native and not self.experts.prefetch_enabled

    def _step_layers(self, stores: list[tuple[torch.Tensor, torch.Tensor]],
                     slot_of: torch.Tensor) -> StepLayers:
        """The layers' table for decode_layers.c over these KV stores, rebuilt when a store
        or the residency table moves (the table keeps no store alive: the addresses and
        shape decide)."""
        key = (slot_of.data_ptr(), stores[0][0].shape,
               *(t.data_ptr() for pair in stores for t in pair))
        if self._step is None or self._step[0] != key:
            self._step = key, step_layers(
                [self._native_layer(i) for i in range(len(self.layers))],
                [self._native_moe(i) for i in range(len(self.layers))],
                [layer.mlp.moe_layer for layer in self.layers], stores, slot_of)
        return self._step[1]

    def _native_layer(self, i: int) -> AttentionLayer | None:
        """Layer i's struct for the native attention block, or None where the layer has
        what the block does not do (built on first use)."""
        layer = self.layers[i]
        if i not in self._native_layers:
            self._native_layers[i] = native_layer(self.spec, layer.attention, i,
                                                  layer.input_norm, layer.post_attention_norm,
                                                  self.rotary)
        return self._native_layers[i]

    def _takes_native_moe(self, x: torch.Tensor) -> bool:
        """Whether this decode batch's MoE layers may take the native block (the first
        answers for all: they share shapes, routing and the pool)."""
        first = self._first_moe
        return (first is not None and self._native_moe(first) is not None
                and takes_native(self.layers[first].mlp, self.experts, x))

    def _native_moe(self, i: int) -> MoELayer | None:
        """Layer i's router struct for the native MoE block, or None where its routing is
        one the block does not do (built on first use)."""
        if i not in self._native_moe_layers:
            self._native_moe_layers[i] = native_moe_layer(self.spec, self.layers[i].mlp)
        return self._native_moe_layers[i]

    def _prefetch_next(self, current: MoEWeights, h: torch.Tensor) -> None:
        """The next MoE layer's router applied to this layer's input predicts its experts
        (the residual stream changes little between layers): load them while this layer
        computes."""
        following = self.next_moe.get(current.moe_layer)
        if following is not None and self.experts.prefetch_enabled:
            _, ids = route(self.spec, following, h)
            self.experts.prefetch(following.moe_layer, ids.unique().tolist(),
                                  protect_layers=(current.moe_layer,))
