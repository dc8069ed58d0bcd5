"""Checkpoint reading: safetensors headers, byte-range reads, normalized model specs.
Imported as `mox.loaders`; depends on nothing else in mox."""

from .checkpoint import INDEX_FILE, Checkpoint
from .config import load_spec, parse_config
from .errors import CheckpointError, MoxError
from .experts import ExpertPart, ExpertTensors
from .safetensors_format import TensorInfo, read_header
from .spec import ExpertNaming, ModelSpec

__all__ = [
    "INDEX_FILE", "Checkpoint", "CheckpointError", "ExpertNaming", "ExpertPart", "ExpertTensors",
    "ModelSpec", "MoxError", "TensorInfo", "load_spec", "parse_config", "read_header",
]
