"""The engine: models, their sequences, one KV pool, and `step()`, which schedules batches of
one model each and runs them in slices until one ends: its tokens sampled, detokenized, its
sequences finished where they end. Not thread-safe: the
router calls it from one thread (the offline `LLM`'s, or `AsyncEngine`'s loop).

A model is registered by its spec (its KV layout) and accepts requests at once; it runs only
once the router hands it its loaded weights (`set_weights`), and its requests wait until then.
Steps run in slices: one whose expert reads are in flight parks while other models step
(mox.engine.in_flight).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import msgspec
import torch

from mox.engine.detokenizer import IncrementalDetokenizer
from mox.engine.in_flight import InFlight, StepInfo
from mox.engine.kv_pool import KVPool
from mox.engine.runner import ModelRunner, SampledToken
from mox.engine.scheduler import Batch, Scheduler, SchedulerConfig
from mox.engine.sequence import Sequence, SequenceStatus
from mox.engine.threads import COMPUTE_THREADS, SharedCores, use_compute_threads
from mox.errors import CheckpointError, InvalidRequestError, ModelNotFoundError, MoxError
from mox.loaders.spec import ModelSpec
from mox.messages import FinishReason, Request, RequestOutput
from mox.models import MoEDecoder
from mox.models.decoder import new_kv_store
from mox.models.kv_store import KVStore
from mox.sampling import NaNLogitsError
from mox.tokenizer import Tokenizer

DEFAULT_BLOCK_SIZE = 16


@dataclass
class _Model:
    spec: ModelSpec
    device: torch.device
    kv: KVStore
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    runner: ModelRunner | None = None          # None until the weights are loaded


@dataclass
class _Live:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None


class Engine:
    def __init__(self, kv_memory_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 config: SchedulerConfig | None = None,
                 compute_threads: int | None = None,
                 max_threads: int | None = None,
                 io_busy: Callable[[], bool] | None = None,
                 interrupt: Callable[[], bool] | None = None) -> None:
        # torch intra-op threads for steps (None: `max_threads`, by default what the process
        # had at start, less the cores other processes keep busy, less one while `io_busy()`)
        ceiling = max_threads or COMPUTE_THREADS
        self.compute_threads = compute_threads or ceiling
        self._shared_cores = None if compute_threads else SharedCores(ceiling)
        self._io_busy = io_busy
        self.kv_pool = KVPool(kv_memory_bytes, block_size)
        self.scheduler = Scheduler(config or SchedulerConfig(), self.kv_pool)
        self.models: dict[str, _Model] = {}
        self._live: dict[str, _Live] = {}
        self._errors: dict[str, Exception] = {}    # why a request aborted; its owner takes it
        # the batch of the step in progress (read from other threads), and of the last one
        self.current_step: StepInfo | None = None
        self.slice_started = 0.0                    # time.monotonic() of its current slice
        self.last_step: StepInfo | None = None
        self._in_flight: dict[str, InFlight] = {}  # model -> its step in flight
        self._carried: list[RequestOutput] = []     # outputs a failed step() left behind
        # whether something waits for the engine's caller (a request, an abort, loaded
        # weights): a run of decode steps then ends after its current step (mox.engine.scheduler)
        self.interrupt: Callable[[], bool] = interrupt or (lambda: False)

    def add_model(self, name: str, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                  tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...]) -> None:
        kv = new_kv_store(spec, dtype, device, self.kv_pool.block_size)
        self.kv_pool.add_model(name, kv)
        self.scheduler.add_model(name)
        self.models[name] = _Model(spec, device, kv, tokenizer, eos_token_ids)

    def remove_model(self, name: str) -> None:
        assert not self.scheduler.queues[name].has_work, f"{name} still has requests"
        del self.models[name]
        self.scheduler.queues.pop(name)
        self.kv_pool.remove_model(name)

    def set_weights(self, name: str, model: MoEDecoder | None) -> None:
        """Loaded weights let the model run; None takes them away (it must run no sequence;
        waiting ones wait for weights again, as a cold model's do)."""
        entry = self.models[name]
        if model is None:
            assert not self.scheduler.queues[name].running, f"{name} still runs sequences"
            entry.runner = None
        else:
            assert model.spec == entry.spec and model.device == entry.device
            entry.runner = ModelRunner(model, entry.kv)
        self.scheduler.set_ready(name, model is not None)

    def set_draining(self, name: str, draining: bool) -> None:
        """The model finishes its running sequences and starts no new one (its waiting
        requests wait for it to run again)."""
        self.scheduler.set_draining(name, draining)

    def add_request(self, request: Request) -> None:
        model = self.models.get(request.model)
        if model is None:
            raise ModelNotFoundError(f"model {request.model!r} is not served")
        if request.request_id in self._live:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        spec = model.spec
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("empty prompt", param="prompt")
        if not _token_ids(prompt, spec.vocab_size):
            raise InvalidRequestError(f"prompt token ids must be integers in "
                                      f"[0, {spec.vocab_size})", param="prompt")
        if not _token_ids(request.params.stop_token_ids, spec.vocab_size):
            raise InvalidRequestError(f"stop_token_ids must be integers in "
                                      f"[0, {spec.vocab_size})", param="stop_token_ids")
        context = spec.max_position_embeddings
        if len(prompt) >= context:
            raise InvalidRequestError(f"prompt has {len(prompt)} tokens; the model's context "
                                      f"is {context}", param="prompt")
        asked = request.params.max_tokens_param
        if asked is not None and len(prompt) + request.params.max_tokens > context:
            raise InvalidRequestError(
                f"the prompt's {len(prompt)} tokens plus {asked}={request.params.max_tokens} "
                f"exceed the model's context of {context} tokens; ask for at most "
                f"{context - len(prompt)}", param=asked)
        needed = self.kv_pool.blocks_needed(len(prompt) + 1) * model.kv.block_nbytes
        if needed > self.kv_pool.budget_bytes:
            raise InvalidRequestError(f"prompt needs {needed} bytes of KV cache; the pool "
                                      f"holds {self.kv_pool.budget_bytes}", param="prompt")
        params = replace(request.params, extra_eos=model.eos_token_ids)
        seq = Sequence(msgspec.structs.replace(request, params=params),
                       params.new_generator(model.device))
        detok = (IncrementalDetokenizer(model.tokenizer, params.stop, prompt)
                 if model.tokenizer is not None else None)
        self._live[request.request_id] = _Live(seq, detok)
        self.scheduler.add(seq)

    def abort(self, request_id: str, error: MoxError | None = None) -> RequestOutput | None:
        """End the request and free its KV: at once, or, if a step in flight runs it (and
        writes its KV), when that step ends; a step left with no live request is dropped.
        With `error`, the output carries its message, and `take_error` gives it to the
        request's owner."""
        live = self._live.get(request_id)
        if live is None:
            return None
        if error is not None:
            self._errors[request_id] = error
        step = self._in_flight.get(live.seq.model)
        running = step is not None and live.seq in step.sequences
        out = self._finish(live, FinishReason.ABORT, [], "", free_kv=not running,
                           error=None if error is None else str(error))
        if running:
            step.aborted.append(live.seq)
            if len(step.aborted) == len(step.sequences):
                step.close()
                self._forget(step)
        return out

    def take_error(self, request_id: str) -> Exception | None:
        """Why the request aborted, if it failed (its owner takes it once)."""
        return self._errors.pop(request_id, None)

    def num_waiting(self, name: str) -> int:
        queue = self.scheduler.queues.get(name)
        return 0 if queue is None else len(queue.waiting)

    def num_running(self, name: str) -> int:
        queue = self.scheduler.queues.get(name)
        return 0 if queue is None else len(queue.running)

    def has_requests(self, name: str) -> bool:
        """Does the model have requests queued or running?"""
        queue = self.scheduler.queues.get(name)
        return queue is not None and queue.has_work

    @property
    def has_work(self) -> bool:
        """Is there a step to run (work of a model whose weights are loaded, or a step in
        flight)?"""
        return self.scheduler.has_work or bool(self._in_flight or self._carried)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def _threads(self) -> int:
        if self._shared_cores is None:
            return self.compute_threads
        threads = self._shared_cores.current()
        # The pager's I/O threads want a core while reads are in flight (page faults, copies),
        # and an OpenMP team waits at every barrier for the member they preempt: one thread
        # fewer then decodes faster and lets the reads land sooner
        # (bench/results/cold_beside_decode.md).
        if self._io_busy is not None and self._io_busy():
            threads = max(1, threads - 1)
        return threads

    def step(self) -> list[RequestOutput]:
        """Run steps slice by slice (a slice ends at a layer boundary or where a layer waits
        for reads) until one ends or nothing can run. Each slice goes to the oldest step in
        flight that can go on; else a new batch starts; else the oldest step parked on reads
        resumes and waits for them."""
        # an I/O thread's one-thread setting leaks into this thread (mox/engine/threads.py)
        use_compute_threads(self._threads())
        self.last_step = None
        outputs, self._carried = self._carried, []
        while True:
            step = next((f for f in self._in_flight.values() if f.resumable), None)
            if step is None:
                batch = self.scheduler.schedule()
                outputs += [self._out_of_kv(self._live[s.request_id])
                            for s in self.scheduler.out_of_kv]
                self.scheduler.out_of_kv.clear()
                if batch is not None:
                    step = self._start(batch)
                elif self._in_flight:
                    step = next(iter(self._in_flight.values()))
                else:
                    return outputs
            try:
                ended = self._run(step)
            except CheckpointError:
                self._carried = outputs         # sequences this call ended: the next call's
                raise
            if ended is not None:
                return outputs + ended

    def _start(self, batch: Batch) -> InFlight:
        runner = self.models[batch.model].runner
        info = StepInfo(batch.model, len(batch.sequences), batch.num_tokens,
                        sum(s.num_new_tokens for s in batch.sequences
                            if s.seq.num_computed_tokens < s.seq.num_prompt_tokens),
                        time.monotonic())
        step = InFlight(batch, runner.steps(batch, self.interrupt), info, runner.model.experts)
        self._in_flight[batch.model] = step            # in start order: oldest first
        self.scheduler.set_in_flight(batch.model, True)
        return step

    def _run(self, step: InFlight) -> list[RequestOutput] | None:
        """One slice of `step`: its outputs if it ended, None if it yielded."""
        self.slice_started = time.monotonic()       # before current_step: the watchdog's read
        self.current_step = step.info
        try:
            sampled = step.advance()
        except CheckpointError:
            self._end(step)
            raise           # the model's files are damaged: its owner fails the whole model
        except Exception as e:  # noqa: BLE001 - a refusal or a bug ends this batch, no other
            self._end(step)
            live = [seq for seq in step.sequences if seq not in step.aborted]
            for seq in live:
                self._errors[seq.request_id] = e
            return [self._finish(self._live[seq.request_id], FinishReason.ABORT, [], "",
                                 error=str(e)) for seq in live]
        finally:
            self.current_step = None
        if sampled is None:
            return None
        self._end(step, len(sampled))
        # one output per token, as steps one at a time give them (a sequence's tokens of
        # every step in turn, up to the first that ends it: the rest are dropped)
        outputs = []
        for tokens in zip(*sampled):
            if tokens[0].seq in step.aborted:
                continue
            live = self._live[tokens[0].seq.request_id]
            for token in tokens:
                outputs.append(self._advance(live, token))
                if outputs[-1].finish_reason is not None:
                    break
        return outputs

    def _end(self, step: InFlight, num_steps: int = 1) -> None:
        self._forget(step)
        info = self.last_step = step.finished_info(num_steps)
        self.scheduler.record_step(info.model, (info.seconds - info.parked_seconds) / num_steps,
                                   decodes_only=info.num_prefill_tokens == 0)

    def _forget(self, step: InFlight) -> None:
        """The step is over: its model may run again, and its aborted sequences' KV goes."""
        self._in_flight.pop(step.info.model, None)
        self.scheduler.set_in_flight(step.info.model, False)
        for seq in step.aborted:
            self.kv_pool.free(seq.model, seq.block_table)
            seq.block_table = []

    def _advance(self, live: _Live, sampled: SampledToken) -> RequestOutput:
        seq, token = live.seq, sampled.token_id
        if sampled.nan:                 # its logits were NaN: it fails, its batch goes on
            error = self._errors[seq.request_id] = NaNLogitsError()
            return self._finish(live, FinishReason.ABORT, [], "", error=str(error))
        seq.output_token_ids.append(token)
        if sampled.logprob is not None:
            seq.output_logprobs.append(sampled.logprob)
        reason = self._finish_reason(seq, token)
        # a stop token's own text is left out, as vLLM's detokenizer leaves it (its id stays
        # in the output's token ids); an end-of-sequence token's text is empty anyway
        shown = [] if reason == FinishReason.STOP else [token]
        delta, reason = _text(live, shown, reason)
        logprobs = [sampled.logprob] if sampled.logprob is not None else None
        if reason is not None:
            return self._finish(live, reason, [token], delta, logprobs)
        return RequestOutput(seq.request_id, [token], delta, logprobs=logprobs)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if seq.params.is_stop_token(token):
            return FinishReason.STOP
        context = self.models[seq.model].spec.max_position_embeddings
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= context:
            return FinishReason.LENGTH
        return None

    def _out_of_kv(self, live: _Live) -> RequestOutput:
        """The KV pool is the sequence's context limit: it ends as at the model's context,
        with the text its detokenizer held back (a split character, a possible stop string's
        start) flushed."""
        delta, reason = _text(live, [], FinishReason.LENGTH)
        return self._finish(live, reason, [], delta)

    def _finish(self, live: _Live, reason: FinishReason, tokens: list[int], delta: str,
                logprobs: list[float] | None = None, error: str | None = None,
                free_kv: bool = True) -> RequestOutput:
        seq = live.seq
        self.scheduler.release(seq, free_kv)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        del self._live[seq.request_id]
        return RequestOutput(seq.request_id, tokens, delta, reason, logprobs, error)


def _text(live: _Live, tokens: list[int], reason: FinishReason | None
          ) -> tuple[str, FinishReason | None]:
    """The text `tokens` complete (with what was held back, where `reason` ends the
    sequence), and the reason it ends: STOP where a stop string turned up."""
    if live.detokenizer is None:
        return "", reason
    delta = live.detokenizer.push(tokens, final=reason is not None)
    return delta, FinishReason.STOP if live.detokenizer.stopped else reason


def _token_ids(ids: Iterable[int], vocab_size: int) -> bool:
    """Every id an int of the vocabulary."""
    return all(isinstance(t, int) and 0 <= t < vocab_size for t in ids)
