"""Byte-range reads with `pread` into caller-owned tensors: no mmap, so a read costs exactly
its bytes and finishes before the call returns (mmap-backed tensors fault lazily, which hides
I/O inside the first matmul that touches them)."""

from __future__ import annotations

import os

import torch

from .errors import CheckpointError
from .safetensors_format import TensorInfo


class FileSet:
    """Open file descriptors for a checkpoint's shards, shared by all reads."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(path, f"cannot open: {e.strerror}") from e
            self._fds[path] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def read_into(self, info: TensorInfo, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (contiguous, CPU, info.nbytes bytes) with the tensor's bytes; returns
        `out` viewed with the tensor's dtype and shape."""
        assert out.is_contiguous() and out.device.type == "cpu"
        assert out.numel() * out.element_size() == info.nbytes, (info.name, out.shape)
        buffer = memoryview(out.view(torch.uint8).reshape(-1).numpy())
        done = 0
        while done < info.nbytes:
            n = os.preadv(self.fd(info.file), [buffer[done:]], info.offset + done)
            if n == 0:
                raise CheckpointError(info.file, f"tensor {info.name!r}: file ends at byte "
                                      f"{info.offset + done}, expected {info.end} (truncated)")
            done += n
        return out.view(info.dtype).view(info.shape)

    def read(self, info: TensorInfo) -> torch.Tensor:
        out = torch.empty(info.nbytes, dtype=torch.uint8)
        return self.read_into(info, out)
