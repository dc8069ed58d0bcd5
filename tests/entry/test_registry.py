"""The model registry and `mox models ...`: round trips, validation, atomic concurrent writes,
import (expert-major) and verify."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest

from mox import LLM
from mox.cli import main
from mox.errors import InvalidRequestError, ModelNotFoundError
from mox.loaders import Checkpoint
from mox.loaders.repack import ALIGNMENT, is_expert_major
from mox.messages import ModelSettings
from mox.model_import import check_same_tensors
from mox.registry import REGISTRY_FILE, Registry, RegistryError

BF16_NAN = b"\xc0\x7f"           # 0x7fc0, a quiet NaN in bfloat16, little-endian




@pytest.fixture
def own_copy(tmp_path, demo_path) -> str:
    """A private copy of the demo checkpoint that a test may corrupt."""
    return shutil.copytree(demo_path, str(tmp_path / "copy"))


def mox(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def registry_bytes(home: str) -> bytes | None:
    path = os.path.join(home, REGISTRY_FILE)
    return open(path, "rb").read() if os.path.exists(path) else None


def test_add_list_show_rm_round_trip(capsys, home, demo_path):
    registry = Registry(home)
    assert registry.version() is None and registry.list() == []
    assert mox(capsys, "models", "add", "q2", demo_path, "--home", home)[0] == 0
    first_version = registry.version()
    rc, out, _ = mox(capsys, "models", "list", "--home", home)
    assert rc == 0 and out.splitlines()[0].split()[:3] == ["NAME", "ARCH", "DTYPE"]
    assert "q2" in out and "qwen2_moe" in out and "bfloat16" in out and demo_path in out
    rc, out, _ = mox(capsys, "models", "list", "--json", "--home", home)
    [entry] = json.loads(out)
    assert entry["name"] == "q2" and entry["path"] == demo_path
    assert entry["architecture"] == "qwen2_moe" and entry["num_experts"] == 16
    assert entry["num_layers"] == entry["num_moe_layers"] == 4
    assert entry["expert_bytes"] == 4 * 16 * 3 * 128 * 256 * 2 and entry["dense_bytes"] > 0
    assert entry["repacked"] is False and entry["added"].endswith("+00:00")
    rc, out, _ = mox(capsys, "models", "show", "q2", "--json", "--home", home)
    assert rc == 0 and json.loads(out) == entry
    rc, out, _ = mox(capsys, "models", "show", "q2", "--home", home)
    assert rc == 0 and "expert_bytes" in out and "12.0 MiB" in out
    assert registry.get("q2").path == demo_path
    assert mox(capsys, "models", "rm", "q2", "--home", home)[0] == 0
    assert registry.version() != first_version and registry.list() == []
    rc, _, err = mox(capsys, "models", "show", "q2", "--home", home)
    assert rc == 2 and "not registered" in err
    with pytest.raises(ModelNotFoundError):
        registry.remove("q2")


def test_a_replaced_entry_keeps_its_settings_unless_given(capsys, home, demo_path, own_copy):
    registry = Registry(home)
    assert mox(capsys, "models", "add", "m", demo_path, "--home", home)[0] == 0
    assert mox(capsys, "models", "set", "m", "--pin", "--keep-alive", "30", "--home",
               home)[0] == 0
    assert mox(capsys, "models", "add", "m", own_copy, "--replace", "--priority", "3",
               "--home", home)[0] == 0
    entry = registry.get("m")
    assert entry.path == os.path.abspath(own_copy)
    assert entry.settings == ModelSettings(pin=True, priority=3.0, keep_alive_s=30.0)


def test_operator_settings_are_kept_shown_and_checked(capsys, home, demo_path):
    registry = Registry(home)
    assert mox(capsys, "models", "add", "q2", demo_path, "--priority", "2", "--home",
               home)[0] == 0
    assert registry.get("q2").settings == ModelSettings(priority=2.0)
    rc, out, _ = mox(capsys, "models", "set", "q2", "--pin", "--keep-alive", "30", "--home",
                     home)
    assert rc == 0 and "pinned, priority 2, keep-alive 30 s" in out
    rc, out, _ = mox(capsys, "models", "show", "q2", "--json", "--home", home)
    assert json.loads(out)["settings"] == {"pin": True, "priority": 2.0, "keep_alive_s": 30.0}
    rc, out, _ = mox(capsys, "models", "show", "q2", "--home", home)
    assert rc == 0 and any(line.split() == ["keep_alive_s", "30.0"] for line in out.splitlines())
    assert mox(capsys, "models", "set", "q2", "--no-pin", "--keep-alive", "default",
               "--home", home)[0] == 0
    assert registry.get("q2").settings == ModelSettings(priority=2.0)
    before = registry_bytes(home)
    for bad in (["--priority", "0"], ["--priority", "nan"], ["--keep-alive", "-1"],
                ["--keep-alive", "soon"], ["--keep-alive", "inf"], ["--keep-alive", "1e400"],
                []):
        rc, _, err = mox(capsys, "models", "set", "q2", *bad, "--home", home)
        assert rc == 2 and err, bad
    assert registry_bytes(home) == before                  # refused changes write nothing
    # a registry written before settings existed reads with the defaults
    raw = json.loads(before)
    del raw["models"][0]["settings"]
    with open(os.path.join(home, REGISTRY_FILE), "w") as f:
        json.dump(raw, f)
    assert registry.get("q2").settings == ModelSettings()


def test_home_from_environment(monkeypatch, capsys, home, demo_path):
    monkeypatch.setenv("MOX_HOME", home)
    assert mox(capsys, "models", "add", "q2", demo_path)[0] == 0
    assert [e.name for e in Registry(home).list()] == ["q2"]
    assert Registry().path == os.path.join(home, REGISTRY_FILE)


def test_a_file_as_home_is_one_clear_error(capsys, tmp_path, demo_path):
    not_a_folder = tmp_path / "home-file"
    not_a_folder.write_text("")
    for args in (("models", "list"), ("models", "add", "q2", demo_path)):
        rc, _, err = mox(capsys, *args, "--home", str(not_a_folder))
        assert rc == 2 and err.strip() == (f"mox: error: {not_a_folder}: not a directory (a "
                                           f"mox home is a folder that holds registry.json "
                                           f"and models/)")
    assert not_a_folder.read_text() == ""


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".hidden", "a..b", "a\\b", "x" * 129,
                                  "/abs", "sp ace"])
def test_invalid_names_refused(capsys, home, demo_path, name):
    with pytest.raises(InvalidRequestError, match="invalid model name"):
        Registry(home).add(name, demo_path)
    rc, _, err = mox(capsys, "models", "add", name, demo_path, "--home", home)
    assert rc == 2 and "invalid model name" in err
    assert registry_bytes(home) is None


def test_existing_name_needs_replace(capsys, home, demo_path, own_copy):
    registry = Registry(home)
    registry.add("m", demo_path)
    rc, _, err = mox(capsys, "models", "add", "m", own_copy, "--home", home)
    assert rc == 2 and "already registered" in err
    assert registry.get("m").path == demo_path
    assert mox(capsys, "models", "add", "m", own_copy, "--replace", "--home", home)[0] == 0
    assert registry.get("m").path == own_copy


def _truncate_shard(path: str) -> str:
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[-1]
    shard_path = os.path.join(path, shard)
    os.truncate(shard_path, os.path.getsize(shard_path) // 2)
    return shard_path


def _delete_tokenizer(path: str) -> str:
    os.remove(os.path.join(path, "tokenizer.json"))
    return os.path.join(path, "tokenizer.json")


def _garble_tokenizer(path: str) -> str:
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0", "model": ')
    return os.path.join(path, "tokenizer.json")


def _garble_config(path: str) -> str:
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{not json")
    return os.path.join(path, "config.json")


@pytest.mark.parametrize("corrupt", [_truncate_shard, _delete_tokenizer, _garble_tokenizer,
                                     _garble_config])
def test_corrupt_checkpoint_refused_and_registry_unchanged(capsys, home, demo_path, own_copy,
                                                           corrupt):
    Registry(home).add("good", demo_path)
    before = registry_bytes(home)
    bad_file = corrupt(own_copy)
    rc, _, err = mox(capsys, "models", "add", "bad", own_copy, "--home", home)
    assert rc == 2 and bad_file in err, err
    assert registry_bytes(home) == before


def test_concurrent_threads_lose_no_entry(home, demo_path):
    registry, stop, seen_invalid = Registry(home), threading.Event(), []
    registry.add("first", demo_path)

    def read_raw() -> None:             # no lock: the rename alone must keep the file whole
        while not stop.is_set():
            try:
                json.loads(registry_bytes(home))
            except ValueError as e:
                seen_invalid.append(e)

    reader = threading.Thread(target=read_raw)
    reader.start()
    writers = [threading.Thread(target=registry.add, args=(f"m{i}", demo_path))
               for i in range(8)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert not seen_invalid
    assert [e.name for e in registry.list()] == ["first"] + [f"m{i}" for i in range(8)]


def test_concurrent_processes_lose_no_entry(home, demo_path):
    script = ("import sys; from mox.registry import Registry; r = Registry(sys.argv[1]); "
              "[r.add(f'{sys.argv[2]}{i}', sys.argv[3]) for i in range(6)]")
    procs = [subprocess.Popen([sys.executable, "-c", script, home, prefix, demo_path])
             for prefix in ("a", "b")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert len(Registry(home).list()) == 12


def test_crash_before_rename_keeps_old_registry(monkeypatch, home, demo_path):
    registry = Registry(home)
    registry.add("kept", demo_path)
    before = registry_bytes(home)

    def crash(src: str, dst: str) -> None:
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr("mox.registry.os.replace", crash)
    with pytest.raises(OSError, match="simulated"):
        registry.add("lost", demo_path)
    monkeypatch.undo()
    assert registry_bytes(home) == before
    assert sorted(os.listdir(home)) == [REGISTRY_FILE, REGISTRY_FILE + ".lock"]  # no temp file


def test_corrupt_registry_file_is_reported(home, demo_path):
    Registry(home).add("m", demo_path)
    with open(os.path.join(home, REGISTRY_FILE), "w") as f:
        f.write('{"version": 1, "models": [{"name": ')
    with pytest.raises(RegistryError, match=REGISTRY_FILE):
        Registry(home).list()


def _greedy(path: str) -> list[int]:
    llm = LLM(path, dtype="float32")
    return llm.generate(prompt_token_ids=[list(range(5, 17))], max_tokens=6, temperature=0.0,
                        ignore_eos=True)[0].token_ids


def test_import_repacks_and_serves_identically(capsys, home, demo_path):
    registry = Registry(home)
    registry.add("q2", demo_path)
    rc, out, _ = mox(capsys, "models", "import", "q2", "--home", home)
    assert rc == 0 and "imported" in out
    entry = registry.get("q2")
    assert entry.repacked and entry.path == os.path.join(home, "models", "q2.expert-major")
    ckpt = Checkpoint(entry.path)
    assert is_expert_major(ckpt) and not is_expert_major(Checkpoint(demo_path))
    assert all(e.gate.offset % ALIGNMENT == 0 for e in ckpt.experts.values())
    check_same_tensors(demo_path, entry.path)
    assert _greedy(demo_path) == _greedy(entry.path)
    # no temp copy left, only the (empty) per-model import lock file
    assert [n for n in os.listdir(registry.models_dir) if n.startswith(".")] == [
        ".import-q2.lock"]
    rc, out, _ = mox(capsys, "models", "import", "q2", "--home", home)
    assert rc == 0 and "already expert-major" in out


def test_a_file_system_refusal_is_one_error_line_and_leaves_no_copy(capsys, home, demo_path,
                                                                     monkeypatch):
    """A full disk while repacking: a one-line error (no traceback), the entry unchanged and
    no temp copy left; `models` being a file is reported the same way."""
    import mox.model_import as model_import

    registry = Registry(home)
    registry.add("q3", demo_path)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(model_import, "repack_expert_major", full)
    rc, _, err = mox(capsys, "models", "import", "q3", "--home", home)
    assert rc == 1 and err.strip() == "mox: error: [Errno 28] No space left on device"
    assert registry.get("q3").path == demo_path
    assert [n for n in os.listdir(registry.models_dir) if n.startswith(".")] == [
        ".import-q3.lock"]
    blocked = os.path.join(home, "blocked")
    os.makedirs(blocked)
    open(os.path.join(blocked, "models"), "w").close()
    Registry(blocked).add("q4", demo_path)
    rc, _, err = mox(capsys, "models", "import", "q4", "--home", blocked)
    assert rc == 1 and "File exists" in err and "Traceback" not in err


def test_import_switch_refused_when_entry_changed(home, demo_path, own_copy):
    registry = Registry(home)
    registry.add("q2", demo_path)
    staged = str(os.path.join(home, "staged"))
    shutil.copytree(own_copy, staged)
    with pytest.raises(RegistryError, match="changed"):
        registry.switch_checkpoint("q2", own_copy, staged, os.path.join(home, "final"))
    assert registry.get("q2").path == demo_path and not os.path.exists(
        os.path.join(home, "final"))


def _overwrite_with_nan(path: str) -> str:
    info = Checkpoint(path).experts[(2, 5)].up
    with open(info.file, "r+b") as f:
        f.seek(info.offset + 64)
        f.write(BF16_NAN * 8)
    return info.file


@pytest.mark.parametrize("corrupt", [_overwrite_with_nan, _truncate_shard])
def test_verify_passes_then_fails_naming_the_file(capsys, home, own_copy, corrupt):
    Registry(home).add("m", own_copy)
    rc, out, _ = mox(capsys, "models", "verify", "m", "--home", home)
    assert rc == 0 and "ok" in out and "251 tensors" in out
    bad_file = corrupt(own_copy)
    rc, _, err = mox(capsys, "models", "verify", "m", "--home", home)
    assert rc == 2 and bad_file in err, err


@pytest.mark.parametrize("models", [
    [{"name": "../escape"}],                     # a hand-edited name that is a path
    [{"name": "m"}, {"name": "m"}],              # one name listed twice
])
def test_bad_names_in_the_registry_file_are_reported(home, demo_path, models):
    Registry(home).add("m", demo_path)
    path = os.path.join(home, REGISTRY_FILE)
    with open(path) as f:
        data = json.load(f)
    entry = data["models"][0]
    data["models"] = [{**entry, **m} for m in models]
    with open(path, "w") as f:
        json.dump(data, f)
    with pytest.raises(RegistryError, match=f"{REGISTRY_FILE}: corrupt registry"):
        Registry(home).list()
