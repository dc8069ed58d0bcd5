"""`mox models add|list|show|set|rm|import|verify`: the model registry from the command line.

`import` and `verify` read whole checkpoints (every tensor's bytes), so they show a byte
progress bar on stderr when it is a terminal; the other commands only read headers.
"""

from __future__ import annotations

import argparse
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

from mox.errors import CheckpointError, InvalidRequestError
from mox.loaders import Checkpoint
from mox.loaders.repack import repack_expert_major
from mox.loaders.safetensors_format import TensorInfo
from mox.loaders.stream import read_tensor
from mox.messages import ModelSettings
from mox.registry import (
    CheckpointFacts,
    ModelEntry,
    Registry,
    RegistryError,
    facts_of,
    validate_checkpoint,
    validate_name,
)

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


def _progress_bar(desc: str, total: int) -> tqdm:
    """Bytes, on stderr, only when stderr is a terminal (logs and tests stay clean)."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, disable=None, leave=False)


def verify_checkpoint(path: str, progress: Progress | None = None) -> VerifySummary:
    """Read every tensor's byte range whole (sizes checked against the headers) and require
    floating tensors to be finite: what a header check cannot see, a NaN in the bytes or a
    file cut short after registering, fails here naming the file and tensor."""
    ckpt = Checkpoint(path)
    infos = sorted(ckpt.tensors.values(), key=lambda i: (i.file, i.offset))   # sequential
    for info in infos:
        tensor = read_tensor(info)
        if tensor.is_floating_point():
            num_bad = int((~torch.isfinite(tensor)).sum())
            if num_bad:
                raise CheckpointError(info.file, f"tensor {info.name!r}: {num_bad} of "
                                      f"{tensor.numel()} values are NaN or infinite")
        if progress is not None:
            progress(info.nbytes)
    return VerifySummary(len(infos), sum(i.nbytes for i in infos),
                         len({i.file for i in infos}))


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


def import_expert_major(registry: Registry, entry: ModelEntry) -> ModelEntry:
    """Repack `entry` into a temp folder beside its final place, check it holds the same
    tensors, then move it into place and switch the entry over in one registry write. An
    interruption anywhere leaves the registry pointing at the original checkpoint; a kill
    leaves the temp folder, which the model's next import removes."""
    final = os.path.join(registry.models_dir, validate_name(entry.name) + IMPORTED_SUFFIX)
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
            with _progress_bar(f"repack {entry.name}", total) as bar:
                repack_expert_major(entry.path, staged, progress=bar.update)
            with _progress_bar(f"check {entry.name}", total) as bar:
                check_same_tensors(entry.path, staged, bar.update)
            return registry.switch_checkpoint(entry.name, entry.path, staged, final)
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
        num_bytes += _tree_bytes(folder)
        shutil.rmtree(folder)
    return num_bytes


def _tree_bytes(folder: str) -> int:
    return sum(os.lstat(os.path.join(root, f)).st_size
               for root, _, files in os.walk(folder) for f in files)


def _stale_fields(entry: ModelEntry, facts: CheckpointFacts) -> list[str]:
    registered = msgspec.structs.asdict(facts_of(entry))
    return [f"{k}: registered {v!r}, now {getattr(facts, k)!r}"
            for k, v in registered.items() if getattr(facts, k) != v]


def _print_json(obj: object) -> None:
    print(msgspec.json.format(msgspec.json.encode(obj), indent=2).decode())


def _table(entries: list[ModelEntry]) -> str:
    header = ("NAME", "ARCH", "DTYPE", "EXPERTS", "LAYERS", "EXPERT BYTES", "REPACKED", "PATH")
    rows = [header] + [(e.name, e.architecture, e.dtype, str(e.num_experts),
                        f"{e.num_moe_layers}/{e.num_layers}", format_bytes(e.expert_bytes),
                        "yes" if e.repacked else "no", e.path) for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]])
                     for row in rows)


def _settings_changes(args: argparse.Namespace) -> dict[str, object]:
    """The settings flags given on the command line (absent ones keep their value)."""
    changes: dict[str, object] = {}
    if args.pin is not None:
        changes["pin"] = args.pin
    if args.priority is not None:
        changes["priority"] = args.priority
    if args.keep_alive is not None:
        changes["keep_alive_s"] = (None if args.keep_alive == "default"
                                   else _seconds(args.keep_alive))
    return changes


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InvalidRequestError(f"keep-alive must be seconds or 'default', not {text!r}",
                                  param="keep_alive") from None


def _add(args: argparse.Namespace) -> int:
    settings = ModelSettings(**_settings_changes(args))
    entry = Registry(args.home).add(args.name, args.path, replace=args.replace,
                                    settings=settings)
    print(f"added {entry.name}: {entry.architecture}, {entry.num_experts} experts x "
          f"{entry.num_moe_layers} layers, {format_bytes(entry.expert_bytes)} experts + "
          f"{format_bytes(entry.dense_bytes)} dense ({entry.dtype}), from {entry.path}")
    return 0


def _list(args: argparse.Namespace) -> int:
    registry = Registry(args.home)
    entries = registry.list()
    if args.json:
        _print_json(entries)
    elif entries:
        print(_table(entries))
    else:
        print(f"no models registered in {registry.path}; add one with `mox models add`")
    _note_staging(registry.models_dir)
    return 0


def _note_staging(models_dir: str) -> None:
    """On stderr (so --json stays parseable): import copies, which may be a dead import's."""
    staged = staging_folders(models_dir)
    if staged:
        print(f"note: {format_bytes(sum(map(_tree_bytes, staged)))} in import copies in "
              f"{models_dir} ({', '.join(map(os.path.basename, staged))}): imports running "
              "now or interrupted; the model's next `mox models import` removes the latter",
              file=sys.stderr)


def _show(args: argparse.Namespace) -> int:
    entry = Registry(args.home).get(args.name)
    if args.json:
        _print_json(entry)
        return 0
    fields = msgspec.structs.asdict(entry) | msgspec.structs.asdict(entry.settings)
    del fields["settings"]
    width = max(map(len, fields))
    for key in ("name", *(k for k in fields if k != "name")):
        value = fields[key]
        shown = f"{format_bytes(value)} ({value})" if key.endswith("_bytes") else value
        print(f"{key.ljust(width)}  {shown}")
    return 0


def _set(args: argparse.Namespace) -> int:
    changes = _settings_changes(args)
    if not changes:
        raise InvalidRequestError("nothing to set: give --pin/--no-pin, --priority or "
                                  "--keep-alive")
    entry = Registry(args.home).configure(args.name, **changes)
    print(f"{entry.name}: {_describe(entry.settings)} (a running server applies it within "
          "seconds)")
    return 0


def _describe(settings: ModelSettings) -> str:
    keep = ("the server's idle timeout" if settings.keep_alive_s is None
            else f"{settings.keep_alive_s:g} s")
    return (f"{'pinned' if settings.pin else 'not pinned'}, priority {settings.priority:g}, "
            f"keep-alive {keep}")


def _rm(args: argparse.Namespace) -> int:
    entry = Registry(args.home).remove(args.name)
    print(f"removed {entry.name} (its files stay at {entry.path})")
    return 0


def _import(args: argparse.Namespace) -> int:
    registry = Registry(args.home)
    entry = registry.get(args.name)
    if entry.repacked:
        print(f"{entry.name} is already expert-major at {entry.path}; nothing to do")
        return 0
    new = import_expert_major(registry, entry)
    print(f"imported {new.name} expert-major into {new.path} "
          f"(the original at {entry.path} is left in place)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    entry = Registry(args.home).get(args.name)
    stale = _stale_fields(entry, validate_checkpoint(entry.path))
    if stale:
        raise RegistryError(f"{entry.path} no longer matches its registry entry ("
                            f"{'; '.join(stale)}); re-add it with `mox models add --replace`")
    with _progress_bar(f"verify {entry.name}", entry.dense_bytes + entry.expert_bytes) as bar:
        summary = verify_checkpoint(entry.path, bar.update)
    Registry(args.home).mark_verified(entry.name)      # a server retries it if it failed
    print(f"{entry.name}: ok, {summary.num_tensors} tensors, "
          f"{format_bytes(summary.num_bytes)} in {summary.num_files} files read and finite")
    return 0


def _settings_flags(parser: argparse.ArgumentParser) -> None:
    pin = parser.add_mutually_exclusive_group()
    pin.add_argument("--pin", dest="pin", action="store_true", default=None,
                     help="keep every expert resident while registered; never park it")
    pin.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument("--priority", type=float,
                        help="weight on the model's value in the memory plan (default 1)")
    parser.add_argument("--keep-alive", metavar="SECONDS|default",
                        help="idle seconds before its weights leave the device ('default': "
                        "the server's --idle-timeout)")


def add_models_parser(sub: argparse._SubParsersAction) -> None:
    models = sub.add_parser("models", help="manage the registered models (MOX_HOME)")
    commands = models.add_subparsers(dest="models_command", required=True)

    def command(name: str, func: Callable[[argparse.Namespace], int], help: str,
                takes_name: bool = True) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=help)
        if takes_name:
            parser.add_argument("name")
        parser.add_argument("--home", help="MOX_HOME (default $MOX_HOME or ~/.cache/mox)")
        parser.set_defaults(func=func)
        return parser

    add = command("add", _add, "validate a checkpoint folder and register it under NAME")
    add.add_argument("path", help="Hugging Face checkpoint folder")
    add.add_argument("--replace", action="store_true", help="replace an existing NAME")
    _settings_flags(add)
    _settings_flags(command("set", _set, "change a model's pin, priority or keep-alive"))
    listing = command("list", _list, "list the registered models", takes_name=False)
    listing.add_argument("--json", action="store_true")
    show = command("show", _show, "show one model's entry")
    show.add_argument("--json", action="store_true")
    command("rm", _rm, "unregister a model (its files stay)")
    command("import", _import, "repack a model expert-major into MOX_HOME/models")
    command("verify", _verify, "read every tensor; check sizes and that weights are finite")
