"""The model registry: `MOX_HOME/registry.json`, the models mox serves by name.

The CLI (`mox models ...`) writes it and a running server reads it, possibly at the same
time, so every change is a read-modify-write under an exclusive `flock` on a sibling lock
file, and the new file replaces the old by rename (temp file in the same folder, fsync,
`os.replace`, fsync of the folder): a reader, or a crash at any point, sees the old registry
or the new one, never half of one. Readers take a shared lock. `version()` is a cheap stat
that a server compares to notice changes without re-reading the file.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone

import msgspec

from mox.errors import CheckpointError, InvalidRequestError, ModelNotFoundError, MoxError
from mox.loaders import Checkpoint
from mox.loaders.repack import is_expert_major
from mox.loaders.spec import EXPERTS_MXFP4
from mox.messages import MAX_MODEL_NAME, ModelSettings
from mox.tokenizer import TOKENIZER_FILE, Tokenizer

REGISTRY_FILE = "registry.json"
LOCK_SUFFIX = ".lock"
REGISTRY_FORMAT_VERSION = 1       # bump when an entry's meaning changes; older mox refuses
MODELS_DIR = "models"             # under MOX_HOME: demo checkpoints and imported copies
# Names become URL path parts and folder names (models/NAME.expert-major): one safe segment.
NAME_PATTERN = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_MODEL_NAME - 1}}}$")


def default_home() -> str:
    """MOX_HOME, else `~/.cache/mox`: the one place every command and the server look."""
    return os.environ.get("MOX_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "mox")


class RegistryError(MoxError):
    """The registry file is unreadable or changed under an operation that needed it not to."""


class CheckpointFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What validating a checkpoint folder learns about it (sizes as stored on disk)."""

    path: str                     # absolute
    architecture: str             # config.json model_type
    dtype: str                    # of the experts, e.g. "bfloat16", "int8 per channel"
    dense_bytes: int
    expert_bytes: int             # all experts of all layers
    num_experts: int              # per MoE layer
    num_layers: int
    num_moe_layers: int
    repacked: bool                # expert-major (`mox models import`)


class ModelEntry(CheckpointFacts, frozen=True, kw_only=True):
    name: str
    added: str                    # ISO-8601 UTC
    settings: ModelSettings = ModelSettings()     # the operator's: pin, priority, keep-alive
    verified: str = ""            # ISO-8601 UTC of the last `mox models verify` that passed

    def __post_init__(self) -> None:
        # also on reading the file: a hand-edited name must not become a path or a label
        validate_name(self.name)


class RegistryFile(msgspec.Struct, kw_only=True):
    version: int = REGISTRY_FORMAT_VERSION
    models: list[ModelEntry] = msgspec.field(default_factory=list)


def validate_name(name: str) -> str:
    if not NAME_PATTERN.match(name or "") or ".." in name:
        raise InvalidRequestError(
            f"invalid model name {name!r}: use 1-{MAX_MODEL_NAME} letters, digits, '.', '_' or "
            "'-', starting with a letter or digit (no path separators, no '..')", param="name")
    return name


def validate_checkpoint(path: str) -> CheckpointFacts:
    """Parse config and every header (shapes, byte ranges within the files) and load the
    tokenizer; raises `CheckpointError` naming the file at fault. Reads no weights."""
    ckpt = Checkpoint(path)
    tokenizer = Tokenizer.from_checkpoint(ckpt.path)
    tokenizer_path = os.path.join(ckpt.path, TOKENIZER_FILE)
    if tokenizer is None:
        raise CheckpointError(tokenizer_path, "missing: mox needs tokenizer.json to encode "
                              "prompts and decode outputs")
    if tokenizer.vocab_size > ckpt.spec.vocab_size:
        raise CheckpointError(tokenizer_path, f"{tokenizer.vocab_size} tokens, but config.json "
                              f"has vocab_size {ckpt.spec.vocab_size}: ids would overflow")
    expert_bytes = sum(e.nbytes for e in ckpt.experts.values())
    some_expert = next(iter(ckpt.experts.values()), None)
    dtype = some_expert.infos[0].dtype if some_expert else next(iter(ckpt.tensors.values())).dtype
    dtype_name = ("mxfp4" if ckpt.spec.expert_storage == EXPERTS_MXFP4
                  else ckpt.expert_format.describe() if ckpt.expert_format
                  else str(dtype).removeprefix("torch."))
    return CheckpointFacts(
        path=ckpt.path, architecture=ckpt.spec.model_type,
        dtype=dtype_name,
        dense_bytes=sum(i.nbytes for i in ckpt.tensors.values()) - expert_bytes,
        expert_bytes=expert_bytes, num_experts=ckpt.spec.num_experts,
        num_layers=ckpt.spec.num_layers, num_moe_layers=ckpt.spec.num_moe_layers,
        repacked=is_expert_major(ckpt))


def facts_of(entry: CheckpointFacts) -> CheckpointFacts:
    """The checkpoint part of an entry, to compare with a fresh `validate_checkpoint`."""
    fields = {f: getattr(entry, f) for f in CheckpointFacts.__struct_fields__}
    return CheckpointFacts(**fields)


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Registry:
    """The models registered in one MOX_HOME. Holds no state between calls: every method
    reads the file, so several processes (CLI, server) can share one registry."""

    def __init__(self, home: str | None = None) -> None:
        self.home = os.path.abspath(home or default_home())
        if os.path.exists(self.home) and not os.path.isdir(self.home):
            raise RegistryError(f"{self.home}: not a directory (a mox home is a folder that "
                                f"holds {REGISTRY_FILE} and {MODELS_DIR}/)")
        self.path = os.path.join(self.home, REGISTRY_FILE)
        self.models_dir = os.path.join(self.home, MODELS_DIR)
        self._lock_path = self.path + LOCK_SUFFIX

    def list(self) -> list[ModelEntry]:
        with self._locked(exclusive=False):
            return sorted(self._read().models, key=lambda e: e.name)

    def get(self, name: str) -> ModelEntry:
        for entry in self.list():
            if entry.name == name:
                return entry
        raise ModelNotFoundError(f"model {name!r} is not registered in {self.path}; "
                                 "see `mox models list`")

    def add(self, name: str, path: str, replace: bool = False,
            settings: dict[str, object] | None = None) -> ModelEntry:
        """Validate, then register, with `settings` (pin, priority, keep_alive_s) changed
        from the defaults, or from a replaced entry's own: an operator's pin survives a
        replace. The checkpoint is read before taking the lock, so a slow disk never blocks
        other registry users."""
        validate_name(name)
        facts = msgspec.structs.asdict(validate_checkpoint(path))
        with self.update() as models:
            if name in models and not replace:
                raise InvalidRequestError(f"model {name!r} is already registered (at "
                                          f"{models[name].path}); remove it first or replace "
                                          "it", param="name")
            base = models[name].settings if name in models else ModelSettings()
            entry = ModelEntry(name=name, added=utc_now(), **facts,
                               settings=msgspec.structs.replace(base, **(settings or {})))
            models[name] = entry
        return entry

    def configure(self, name: str, **changes: object) -> ModelEntry:
        """Change some of the model's settings (pin, priority, keep_alive_s), atomically."""
        with self.update() as models:
            if name not in models:
                raise ModelNotFoundError(f"model {name!r} is not registered in {self.path}")
            settings = msgspec.structs.replace(models[name].settings, **changes)
            models[name] = msgspec.structs.replace(models[name], settings=settings)
            return models[name]

    def mark_verified(self, name: str) -> ModelEntry:
        """Record a passed verification (a running server opens a failed model again)."""
        with self.update() as models:
            if name not in models:
                raise ModelNotFoundError(f"model {name!r} is not registered in {self.path}")
            models[name] = msgspec.structs.replace(models[name], verified=utc_now())
            return models[name]

    def remove(self, name: str) -> ModelEntry:
        with self.update() as models:
            if name not in models:
                raise ModelNotFoundError(f"model {name!r} is not registered in {self.path}")
            return models.pop(name)

    def switch_checkpoint(self, name: str, old_path: str, staged: str, final: str) -> ModelEntry:
        """Move the checkpoint folder `staged` to `final` and point `name` at it, under the
        lock, in one registry write (`import`: same model, other layout). Refused if the
        entry changed since `old_path` was read, so a concurrent `add --replace` or `rm` is
        not silently undone."""
        facts = msgspec.structs.replace(validate_checkpoint(staged),
                                        path=os.path.abspath(final))
        with self.update() as models:
            current = models.get(name)
            if current is None or current.path != old_path:
                raise RegistryError(f"model {name!r} changed while it was being imported; "
                                    "nothing was switched")
            users = [e.name for e in models.values() if e.path == facts.path]
            if users:
                raise RegistryError(f"{final} is the checkpoint of {users}; not replacing it")
            if os.path.exists(final):        # a stale copy that no entry points at
                shutil.rmtree(final)
            os.replace(staged, final)
            fsync_dir(os.path.dirname(final))
            models[name] = msgspec.structs.replace(current, **msgspec.structs.asdict(facts))
            return models[name]

    def version(self) -> tuple[int, int, int] | None:
        """Changes whenever the file is rewritten (a rename gives a new inode); None when
        there is no registry yet."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    @contextmanager
    def update(self) -> Iterator[dict[str, ModelEntry]]:
        """Read-modify-write under the exclusive lock: yields name -> entry to change in
        place; written back (atomically) only if the block finishes without raising."""
        with self._locked(exclusive=True):
            models = {e.name: e for e in self._read().models}
            yield models
            entries = sorted(models.values(), key=lambda e: e.name)
            self._write(RegistryFile(models=entries))

    @contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        if exclusive:
            os.makedirs(self.home, exist_ok=True)
        try:
            fd = os.open(self._lock_path, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:
            if exclusive:
                raise
            fd = None      # no home yet, or read-only: the rename alone keeps reads whole
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            if fd is not None:
                os.close(fd)                      # releases the lock

    def _read(self) -> RegistryFile:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return RegistryFile()
        try:
            registry = msgspec.json.decode(raw, type=RegistryFile)
        except (msgspec.DecodeError, InvalidRequestError) as e:
            raise RegistryError(f"{self.path}: corrupt registry ({e}); fix or delete it") from e
        names = [m.name for m in registry.models]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise RegistryError(f"{self.path}: corrupt registry (models listed twice: "
                                f"{', '.join(twice)}); fix or delete it")
        if registry.version > REGISTRY_FORMAT_VERSION:
            raise RegistryError(f"{self.path}: registry format {registry.version} is newer "
                                f"than this mox understands ({REGISTRY_FORMAT_VERSION})")
        return registry

    def _write(self, registry: RegistryFile) -> None:
        data = msgspec.json.format(msgspec.json.encode(registry), indent=2) + b"\n"
        write_bytes_atomic(self.path, data)


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Temp file in the same folder (so the rename is atomic), fsync, rename, fsync the
    folder (so the rename itself survives a crash). A unique temp name, unlike
    `loaders.writer.write_json_atomic`, and the folder fsync are why that one is not used."""
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)                 # mkstemp makes 0600; a server may run as another user
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_dir(folder)


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
