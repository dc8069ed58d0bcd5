"""One model the router serves: its checkpoint, tokenizer and state (cold -> loading -> warm,
or failed), and the job that loads its weights off the engine thread.

A model that cannot be opened (missing folder, corrupt header, bad tokenizer) is registered
as failed with the error that names the file: the router keeps serving the others.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from mox.errors import InvalidRequestError, MoxError
from mox.loaders import Checkpoint
from mox.loaders.config import eos_token_ids as eos_token_ids_of
from mox.loaders.json_files import read_json_object
from mox.loaders.threads import use_one_thread
from mox.messages import ModelSettings, ModelState
from mox.models import MoEDecoder
from mox.models.loading import load_model
from mox.pager import ModelPool
from mox.router.rates import ModelTraffic
from mox.sampling import generation_defaults, unapplied_generation_fields
from mox.tokenizer import Tokenizer

GENERATION_CONFIG_FILE = "generation_config.json"
log = logging.getLogger("mox.router")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass
class ServedModel:
    name: str
    path: str
    state: ModelState
    ckpt: Checkpoint | None = None
    tokenizer: Tokenizer | None = None
    eos_token_ids: tuple[int, ...] = ()
    dense_nbytes: int = 0                    # in the serving dtype
    # a request's temperature / top_p / top_k where it gives none (generation_config.json)
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)
    error: str | None = None
    decoder: MoEDecoder | None = None
    pool: ModelPool | None = None            # its experts in the pager (once registered)
    settings: ModelSettings = ModelSettings()    # the operator's: pin, priority, keep-alive
    traffic: ModelTraffic = field(default_factory=ModelTraffic)
    last_active: float = -math.inf           # last step or arrival (idle drop, LRU swap)
    num_loads: int = 0                       # times its weights were read (cold starts)
    loaded_at: float = -math.inf             # when its last load started (its turn began)
    draining: bool = False                   # finishing its running requests, then parked
    turn_run_slots: int = 0                  # its run size this turn (0: not busy): it
                                             # only rises until the model goes idle

    @property
    def holds_device_memory(self) -> bool:
        return self.state in (ModelState.LOADING, ModelState.WARM)


def open_served(name: str, path: str, dtype: torch.dtype) -> ServedModel:
    """Open the checkpoint and tokenizer (headers only, no weights); a failure is recorded."""
    try:
        ckpt = Checkpoint(path)
        tokenizer = Tokenizer.from_checkpoint(ckpt.path)
        generation_path = os.path.join(ckpt.path, GENERATION_CONFIG_FILE)
        generation = read_json_object(generation_path) or {}
        eos = eos_token_ids(ckpt, tokenizer, generation, generation_path)
    except MoxError as e:
        return ServedModel(name, path, ModelState.FAILED, error=str(e))
    except Exception as e:  # noqa: BLE001 - one bad checkpoint must not stop the others
        log.exception("model %s: opening %s failed", name, path)
        return ServedModel(name, path, ModelState.FAILED,
                           error=f"{path}: cannot open: {type(e).__name__}: {e}")
    unapplied = unapplied_generation_fields(generation)
    if unapplied:
        log.warning("model %s: %s sets %s, which mox does not apply (vLLM would)", name,
                    generation_path, unapplied)
    return ServedModel(name, ckpt.path, ModelState.COLD, ckpt, tokenizer, eos,
                       dense_nbytes(ckpt, dtype), sampling_defaults=generation_defaults(generation))


def dense_nbytes(ckpt: Checkpoint, dtype: torch.dtype) -> int:
    return ckpt.dense_numel() * dtype.itemsize


def load_weights(model: ServedModel, dtype: torch.dtype, device: torch.device,
                 preload: int, stream: bool) -> MoEDecoder:
    """On a loader thread: the dense weights, then `preload` experts (every one, or the most
    used; at most the pool's slots), queued as one read-ahead rather than met as misses one
    wave at a time inside the model's first steps. `stream`: the model is ready once its
    dense weights are (its steps take the experts as they land, parked on their reads while
    other models step: mox.engine.in_flight); otherwise once every expert has landed (a
    whole model, as model-swap serves it)."""
    assert model.ckpt is not None and model.pool is not None
    decoder = load_model(model.ckpt, dtype, device, model.pool)
    model.pool.preload(model.pool.most_used(preload), wait=not stream)
    return decoder


class WeightLoader:
    """One loader thread: `start()` queues a model's `load_weights`; results wait in `landed`
    for the router's thread to take (`take_landed`), and `wake` is set when one lands."""

    def __init__(self, wake: threading.Event) -> None:
        self.wake = wake
        # one intra-op thread, as on the I/O threads (loaders/threads.py): a load must not
        # take the cores of the models that keep decoding meanwhile
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mox-load",
                                        initializer=use_one_thread)
        self._landed: list[tuple[str, MoEDecoder | BaseException]] = []
        self._lock = threading.Lock()

    def start(self, model: ServedModel, dtype: torch.dtype, device: torch.device,
              preload: int, stream: bool) -> None:
        future = self._pool.submit(load_weights, model, dtype, device, preload, stream)
        future.add_done_callback(lambda f, name=model.name: self._land(name, f))

    def _land(self, name: str, future: Future) -> None:
        result = future.exception() or future.result()
        with self._lock:
            self._landed.append((name, result))
        self.wake.set()

    @property
    def has_landed(self) -> bool:
        with self._lock:
            return bool(self._landed)

    def take_landed(self) -> list[tuple[str, MoEDecoder | BaseException]]:
        with self._lock:
            landed, self._landed = self._landed, []
        return landed

    def drain(self) -> None:
        """Wait until every queued load has run (its result is then in `landed`)."""
        self._pool.submit(lambda: None).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def resolve_device(device: str | torch.device) -> torch.device:
    """"cuda" -> "cuda:N" (the current device): tensors report an indexed device, and a
    model's parts are compared by device. mox runs on cpu or cuda (InvalidRequestError else)."""
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise InvalidRequestError(f"not a device: {device!r} (cpu, cuda, cuda:N)") from e
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidRequestError(f"mox runs on cpu or cuda, not {device!r}")
    if resolved.type == "cuda" and (not torch.cuda.is_available()
                                    or (resolved.index or 0) >= torch.cuda.device_count()):
        raise InvalidRequestError(f"no such CUDA device here: {device!r}")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    resolved = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPES.values():
        raise InvalidRequestError(f"unsupported dtype {dtype!r}; choose from {sorted(DTYPES)}")
    if resolved == torch.float16 and device.type == "cpu":
        # measured: fp16 matmul on this class of CPU is ~1000x slower than bf16
        raise InvalidRequestError("float16 on CPU is unusably slow; use bfloat16 or float32")
    return resolved


def eos_token_ids(ckpt: Checkpoint, tokenizer: Tokenizer | None, generation: dict,
                  generation_path: str) -> tuple[int, ...]:
    """eos ids from config.json, generation_config.json (`generation`, read from
    `generation_path`) and the tokenizer, as HF merges them."""
    ids = set(ckpt.spec.eos_token_ids)
    ids.update(eos_token_ids_of(generation, generation_path))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
