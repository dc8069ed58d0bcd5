"""Moving one expert's bytes into a slot: from the host cache if it has them, else from disk
through the streaming reader; then into the pool tensors on the compute device.

Runs on the reader's I/O threads, outside the pager's lock: the target slot is reserved
(pinned, loading), so nothing else touches it until the load commits.
- CPU pool in the checkpoint's dtype, parts stored as the slot holds them: `preadv` straight
  into the slot's memory, no copy.
- Otherwise bytes land in a staging buffer (per thread, reused; pinned for CUDA) and are
  converted (MXFP4's E8M0 scales to float32, dtypes) and copied into the slot through each
  part's destination view (strided where the stored layout differs: GPT-OSS); on CUDA the
  copy runs on a side stream and the I/O thread waits on its event before reusing the
  buffer, so the compute stream never stalls.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from mox.kernels import MappedExpert
from mox.kernels.quant import e8m0_to_float
from mox.loaders import ExpertTensors
from mox.loaders.experts import DOWN, DOWN_SCALES, GATE, GATE_UP_SCALES, MXFP4_ROLES, UP
from mox.loaders.stream import ByteRange, StreamingReader
from mox.pager.host_cache import CacheKey, HostCache
from mox.pager.slot_pool import SlotPool

FROM_DISK, FROM_HOST = "disk", "host"


@dataclass(frozen=True)
class LoadResult:
    source: str          # FROM_DISK or FROM_HOST
    nbytes: int
    seconds: float


def expert_ranges(tensors: ExpertTensors, label: str) -> list[ByteRange]:
    return [ByteRange(t.file, t.offset, t.nbytes, f"{label} {t.name}")
            for t in tensors.infos]


class ExpertLoader:
    def __init__(self, reader: StreamingReader, host_cache: HostCache | None) -> None:
        self.reader = reader
        self.host_cache = host_cache
        self._local = threading.local()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def load(self, pool: SlotPool, index: int, tensors: ExpertTensors, cache_key: CacheKey,
             label: str, last_use: torch.cuda.Event | None = None) -> LoadResult:
        """`last_use`: on CUDA, the event after the last kernel that read this slot's
        previous expert; the copy waits for it (the host releases leases before the GPU is
        done with them)."""
        start = time.perf_counter()
        infos = tensors.infos
        cached = self.host_cache.get(cache_key) if self.host_cache else None
        if cached is not None:
            source = FROM_HOST
            self._copy_in(*_placed(pool, index, tensors, _split(cached, infos)), pool.device,
                          last_use)
        elif self.host_cache is None and (destinations := _in_place(pool, index, tensors)):
            source = FROM_DISK
            self.reader.read_into(expert_ranges(tensors, label), destinations)
        else:
            source = FROM_DISK
            raw = (self.host_cache.new_buffer(tensors.nbytes) if self.host_cache
                   else self._staging(tensors.nbytes, pool.device))
            parts = _split(raw, infos)
            self.reader.read_into(expert_ranges(tensors, label), parts)
            self._copy_in(*_placed(pool, index, tensors, parts), pool.device, last_use)
            if self.host_cache:
                self.host_cache.put(cache_key, raw)
        return LoadResult(source, tensors.nbytes, time.perf_counter() - start)

    def mapped(self, pool: SlotPool, tensors: ExpertTensors, cache_key: CacheKey,
               touch: bool = True) -> MappedExpert | None:
        """The expert as the Triton kernels can read it in place from the host cache (pinned
        host memory, mapped into the GPU's address space), or None: not cached, or not
        stored as a slot holds it (gate, up, down in the pool's dtype, gate's rows right
        before up's; no scales or biases)."""
        roles = tuple(part.role for part in tensors.parts)
        if (self.host_cache is None or roles != (GATE, UP, DOWN) or pool.fmt is not None
                or pool.has_bias or any(i.dtype != pool.dtype for i in tensors.infos)):
            return None
        raw = self.host_cache.get(cache_key, touch)
        if raw is None:
            return None
        gate, up, down = _split(raw, tensors.infos)
        w13_shape, w2_shape = pool.w13.shape[1:], pool.w2.shape[1:]
        if (gate.shape[0] + up.shape[0], *gate.shape[1:]) != w13_shape or down.shape != w2_shape:
            return None
        # gate's bytes, then up's: one [2I, H] matrix, as in a slot
        return MappedExpert(raw[:gate.nbytes + up.nbytes].view(pool.dtype).view(w13_shape), down)

    def _staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = getattr(self._local, "staging", None)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
            self._local.staging = buf
        return buf[:nbytes]

    def _copy_in(self, destinations, parts, device: torch.device,
                 last_use: torch.cuda.Event | None = None) -> None:
        if device.type != "cuda":
            for dst, src in zip(destinations, parts):
                dst.copy_(src)
            return
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        if last_use is not None:
            stream.wait_event(last_use)     # kernels still reading the evicted expert finish
        with torch.cuda.stream(stream):
            for dst, src in zip(destinations, parts):
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()     # blocks this I/O thread only; the slot commits after


def _in_place(pool: SlotPool, index: int, tensors: ExpertTensors) -> list[torch.Tensor]:
    """The slot's views that the stored parts can be read straight into, or [] if any part
    needs a decode, a conversion or a strided copy."""
    if pool.device.type != "cpu" or any(p.role in MXFP4_ROLES for p in tensors.parts):
        return []
    destinations = [pool.destination(index, p.role) for p in tensors.parts]
    return destinations if all(d.is_contiguous() and d.dtype == p.info.dtype
                               for d, p in zip(destinations, tensors.parts)) else []


def _placed(pool: SlotPool, index: int, tensors: ExpertTensors,
            parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(destination views, sources shaped like them) for one expert's stored parts; MXFP4's
    E8M0 scales are decoded to the pool's float32 first."""
    sources = [e8m0_to_float(t) if p.role in (GATE_UP_SCALES, DOWN_SCALES) else t
               for p, t in zip(tensors.parts, parts)]
    destinations = [pool.destination(index, p.role) for p in tensors.parts]
    return destinations, [t.view(d.shape) for t, d in zip(sources, destinations)]


def _split(raw: torch.Tensor, infos) -> list[torch.Tensor]:
    """Views of one byte buffer as the expert's three tensors, in their checkpoint dtype."""
    parts, pos = [], 0
    for info in infos:
        parts.append(raw[pos:pos + info.nbytes].view(info.dtype).view(info.shape))
        pos += info.nbytes
    return parts
