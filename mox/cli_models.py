"""`mox models add|list|show|set|rm|import|verify`: the model registry from the command line.

`import` and `verify` read whole checkpoints (every tensor's bytes), so they show a byte
progress bar on stderr when it is a terminal; the other commands only read headers.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

import msgspec

from mox.errors import InvalidRequestError
from mox.kernels.quant import IMPORT_FORMATS
from mox.messages import ModelSettings
from mox.model_import import (
    format_bytes,
    import_expert_major,
    progress_bar,
    remove_import_lock,
    staging_folders,
    tree_bytes,
    verify_checkpoint,
)
from mox.registry import (
    CheckpointFacts,
    ModelEntry,
    Registry,
    RegistryError,
    facts_of,
    validate_checkpoint,
)


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
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):           # (JSON has no infinity: it would read back null)
        raise InvalidRequestError(f"keep-alive must be seconds or 'default', not {text!r}",
                                  param="keep_alive")
    return seconds


def _add(args: argparse.Namespace) -> int:
    entry = Registry(args.home).add(args.name, args.path, replace=args.replace,
                                    settings=_settings_changes(args))
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
        print(f"note: {format_bytes(sum(map(tree_bytes, staged)))} in import copies in "
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
    registry = Registry(args.home)
    entry = registry.remove(args.name)
    remove_import_lock(registry.models_dir, entry.name)
    print(f"removed {entry.name} (its files stay at {entry.path})")
    return 0


def _import(args: argparse.Namespace) -> int:
    registry = Registry(args.home)
    entry = registry.get(args.name)
    if entry.repacked and args.quantize is None:
        print(f"{entry.name} is already expert-major at {entry.path}; nothing to do")
        return 0
    fmt = None if args.quantize is None else IMPORT_FORMATS[args.quantize]
    new = import_expert_major(registry, entry, fmt)
    how = "expert-major" if fmt is None else f"expert-major, experts {fmt.describe()}"
    print(f"imported {new.name} {how} into {new.path}: experts "
          f"{format_bytes(entry.expert_bytes)} -> {format_bytes(new.expert_bytes)} "
          f"(the original at {entry.path} is left in place: a server may still read it; "
          f"remove it when none does)")
    return 0


def _verify(args: argparse.Namespace) -> int:
    entry = Registry(args.home).get(args.name)
    stale = _stale_fields(entry, validate_checkpoint(entry.path))
    if stale:
        raise RegistryError(f"{entry.path} no longer matches its registry entry ("
                            f"{'; '.join(stale)}); re-add it with `mox models add --replace`")
    with progress_bar(f"verify {entry.name}", entry.dense_bytes + entry.expert_bytes) as bar:
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
    imports = command("import", _import, "repack a model expert-major into MOX_HOME/models")
    imports.add_argument("--quantize", choices=sorted(IMPORT_FORMATS),
                         help="store its experts quantized: int8 per output channel, int4 in "
                              "groups of 128, fp8 in 128 x 128 blocks")
    command("verify", _verify, "read every tensor; check sizes and that weights are finite")
