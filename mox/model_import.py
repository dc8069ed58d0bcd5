"""Reading whole checkpoints: `verify` (every tensor read, sizes and finiteness checked) and
`import` (repacked expert-major into a staging copy, checked tensor by tensor, switched in
atomically). One import of a model runs at a time (a lock per model); a killed import's
staging copy is removed by the model's next import."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgspec
import torch
from tqdm import tqdm

from mox.errors import CheckpointError
from mox.kernels.quant import E8M0_NAN, MXFP4, WeightFormat, quantize
from mox.loaders import Checkpoint
from mox.loaders.quantize import quantize_checkpoint
from mox.loaders.repack import repack_expert_major
from mox.loaders.safetensors_format import TensorInfo
from mox.loaders.stream import read_tensor
from mox.registry import ModelEntry, Registry, RegistryError, validate_name

IMPORTED_SUFFIX = ".expert-major"     # MOX_HOME/models/NAME.expert-major
STAGING_PREFIX = ".importing-"        # models/.importing-NAME-RANDOM: an import's copy
IMPORT_LOCK = ".import-{}.lock"       # models/.import-NAME.lock: held for a whole import
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
Progress = Callable[[int], None]


class VerifySummary(msgspec.Struct, frozen=True):
    num_tensors: int
    num_bytes: int
    num_files: int


def format_bytes(num_bytes: int) -> str:
    size, unit = float(num_bytes), 0
    while size >= 1024 and unit < len(BYTE_UNITS) - 1:
        size, unit = size / 1024, unit + 1
    return f"{num_bytes} B" if unit == 0 else f"{size:.1f} {BYTE_UNITS[unit]}"


def progress_bar(desc: str, total: int) -> tqdm:
    """Bytes, on stderr, only when stderr is a terminal (logs and tests stay clean)."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, disable=None, leave=False)


def verify_checkpoint(path: str, progress: Progress | None = None) -> VerifySummary:
    """Read every tensor's byte range whole (sizes checked against the headers) and require
    floating tensors to be finite: what a header check cannot see, a NaN in the bytes or a
    file cut short after registering, fails here naming the file and tensor."""
    ckpt = Checkpoint(path)
    infos = sorted(ckpt.tensors.values(), key=lambda i: (i.file, i.offset))   # sequential
    mxfp4 = ckpt.expert_format is not None and ckpt.expert_format.kind == MXFP4
    for info in infos:
        tensor = read_tensor(info)
        num_bad = _non_finite(tensor, mxfp4_scales=mxfp4 and info.name.endswith("_scales"))
        if num_bad:
            raise CheckpointError(info.file, f"tensor {info.name!r}: {num_bad} of "
                                  f"{tensor.numel()} values are NaN or infinite")
        if progress is not None:
            progress(info.nbytes)
    return VerifySummary(len(infos), sum(i.nbytes for i in infos),
                         len({i.file for i in infos}))


def _non_finite(tensor: torch.Tensor, mxfp4_scales: bool) -> int:
    """How many of the tensor's values are NaN or infinite (MXFP4's E8M0 scales: 0xFF is
    NaN)."""
    if mxfp4_scales and tensor.dtype == torch.uint8:
        return int((tensor == E8M0_NAN).sum())
    if not tensor.is_floating_point():
        return 0
    # (torch has no isfinite for its 8-bit floats, FP8 checkpoints' weights)
    wide = tensor.float() if tensor.element_size() == 1 else tensor
    return int((~torch.isfinite(wide)).sum())


def check_same_tensors(src: str, dst: str, progress: Progress | None = None) -> None:
    """Every tensor of `dst` has the name, dtype, shape and bytes it has in `src`."""
    original, copy = Checkpoint(src), Checkpoint(dst)
    if set(original.tensors) != set(copy.tensors):
        missing = sorted(set(original.tensors) ^ set(copy.tensors))[:3]
        raise CheckpointError(dst, f"tensor names differ from {src} (e.g. {missing})")
    for name, info in copy.tensors.items():
        if not _same_bytes(original.tensors[name], info):
            raise CheckpointError(info.file, f"tensor {name!r} differs from {src}")
        if progress is not None:
            progress(info.nbytes)


def _same_bytes(a: TensorInfo, b: TensorInfo) -> bool:
    if (a.dtype, a.shape) != (b.dtype, b.shape):
        return False
    # compare bytes, not values: NaN != NaN, and -0.0 == 0.0
    return torch.equal(read_tensor(a).reshape(-1).view(torch.uint8),
                       read_tensor(b).reshape(-1).view(torch.uint8))


def check_quantized(src: str, dst: str, progress: Progress | None = None) -> None:
    """Every weight of `dst` is `src`'s, or (quantized) exactly what quantizing `src`'s
    gives: its stored values and scales compared bit for bit."""
    original, copy = Checkpoint(src), Checkpoint(dst)
    _check_extras(original, copy)
    for name, weight in copy.stored.items():
        source = original.stored[name].data
        if weight.fmt is None:
            same = _same_bytes(source, weight.data)
        else:
            data, scale = quantize(read_tensor(source), weight.fmt)
            same = (_bytes_equal(read_tensor(weight.data), data)
                    and _bytes_equal(read_tensor(weight.scale).float(), scale))
        if not same:
            raise CheckpointError(weight.data.file, f"tensor {weight.data.name!r} is not "
                                  f"{src}'s {name!r} {'quantized' if weight.fmt else ''}")
        if progress is not None:
            progress(source.nbytes)


def _check_extras(original: Checkpoint, copy: Checkpoint) -> None:
    """Tensors of `copy` outside its weights (extra layers; int4's `weight_shape`) are the
    source's, or the logical shape of the packed weight they describe."""
    covered = {info.name for weight in copy.stored.values() for info in weight.infos}
    for name, info in copy.tensors.items():
        if name in covered:
            continue
        if name in original.tensors:
            same = _same_bytes(original.tensors[name], info)
        else:
            weight = name.removesuffix("_shape")
            same = (name.endswith(".weight_shape") and weight in original.tensors
                    and read_tensor(info).tolist() == list(original.tensors[weight].shape))
        if not same:
            raise CheckpointError(info.file, f"tensor {name!r} is not {original.path}'s")


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.nbytes == b.nbytes and torch.equal(a.reshape(-1).view(torch.uint8),
                                                b.contiguous().reshape(-1).view(torch.uint8))


def import_expert_major(registry: Registry, entry: ModelEntry,
                        quantize_to: WeightFormat | None = None) -> ModelEntry:
    """Repack `entry` (its experts quantized to `quantize_to`, if given) into a temp folder
    beside its final place, check it holds the same tensors (or their exact quantization),
    then move it into place and switch the entry over in one registry write. An
    interruption anywhere leaves the registry pointing at the original checkpoint; a kill
    leaves the temp folder, which the model's next import removes."""
    suffix = IMPORTED_SUFFIX if quantize_to is None else f".{quantize_to.kind}"
    final = os.path.join(registry.models_dir, validate_name(entry.name) + suffix)
    os.makedirs(registry.models_dir, exist_ok=True)
    with _import_lock(registry.models_dir, entry.name):
        # under the lock, every staging folder of this model is a dead importer's
        num_stale = remove_stale_staging(registry.models_dir, entry.name)
        if num_stale:
            print(f"removed {format_bytes(num_stale)} left by an interrupted import of "
                  f"{entry.name}", file=sys.stderr)
        staged = os.path.join(registry.models_dir,
                              f"{STAGING_PREFIX}{entry.name}-{secrets.token_hex(4)}")
        os.mkdir(staged)
        os.chmod(staged, 0o755)                  # whatever the umask: a server may be another user
        try:
            total = entry.dense_bytes + entry.expert_bytes
            source = entry.path
            if quantize_to is not None:
                source = quantize_checkpoint(entry.path, os.path.join(staged, ".quantized"),
                                             quantize_to)
            out = os.path.join(staged, "out")
            with progress_bar(f"repack {entry.name}", total) as bar:
                repack_expert_major(source, out, progress=bar.update)
            os.chmod(out, 0o755)                 # whatever the umask: a server may be another user
            with progress_bar(f"check {entry.name}", total) as bar:
                if quantize_to is None:
                    check_same_tensors(entry.path, out, bar.update)
                else:
                    check_quantized(entry.path, out, bar.update)
            return registry.switch_checkpoint(entry.name, entry.path, out, final)
        finally:
            shutil.rmtree(staged, ignore_errors=True)     # already moved after a switch


@contextmanager
def _import_lock(models_dir: str, name: str) -> Iterator[None]:
    """Exclusive per model, not waited for: two imports of one model would each take the
    other's staging folder for stale. The kernel drops it when the holder dies."""
    path = os.path.join(models_dir, IMPORT_LOCK.format(name))
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RegistryError(f"another import of {name} is running (it holds {path}); "
                                "wait for it to finish") from None
        yield
    finally:
        os.close(fd)                              # releases the lock


def remove_import_lock(models_dir: str, name: str) -> None:
    """Delete model `name`'s lock file (`mox models rm`), unless an import holds it: one
    file per model ever imported would otherwise stay behind."""
    path = os.path.join(models_dir, IMPORT_LOCK.format(name))
    try:
        with _import_lock(models_dir, name):
            os.unlink(path)
    except (RegistryError, FileNotFoundError):
        pass                                      # an import runs: it keeps its lock


def is_staging_of(name: str, folder: str) -> bool:
    """Whether `folder` (a name in models_dir) is an import copy of model `name`. The random
    part never holds '-' (hex here, mkdtemp's letters, digits and '_' before), so model
    `a` never claims `.importing-a-b-RANDOM`, which belongs to model `a-b`."""
    prefix = f"{STAGING_PREFIX}{name}-"
    rest = folder[len(prefix):]
    return folder.startswith(prefix) and rest != "" and "-" not in rest


def staging_folders(models_dir: str, name: str | None = None) -> list[str]:
    """Import copies in `models_dir`: of model `name`, or of any model."""
    try:
        entries = list(os.scandir(models_dir))
    except FileNotFoundError:
        return []
    return sorted(e.path for e in entries if e.is_dir(follow_symlinks=False) and (
        is_staging_of(name, e.name) if name else e.name.startswith(STAGING_PREFIX)))


def remove_stale_staging(models_dir: str, name: str) -> int:
    """Delete model `name`'s import copies; only while holding its import lock, when they
    are all stale. Returns the bytes they held."""
    num_bytes = 0
    for folder in staging_folders(models_dir, name):
        num_bytes += tree_bytes(folder)
        shutil.rmtree(folder)
    return num_bytes


def tree_bytes(folder: str) -> int:
    return sum(os.lstat(os.path.join(root, f)).st_size
               for root, _, files in os.walk(folder) for f in files)


