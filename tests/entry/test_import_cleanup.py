"""`mox models import` after a kill: the dead import's full-size temp copy is removed by the
model's next import, never a live import's copy nor another model's (issue 17)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mox.cli import main
from mox.model_import import format_bytes, is_staging_of, staging_folders
from mox.registry import Registry
from tests.conftest import default_sigint

READY_TIMEOUT_S = 30             # bound on the importer's start (imports torch) and repack
# A real `mox models import` that stops once the repacked copy is complete in its staging
# folder, before the check and the switch: a deterministic point to kill it at.
HUNG_IMPORT = """
import sys, time
import mox.model_import as model_import
from mox.cli import main

def hang(*args, **kwargs):
    open(sys.argv[3], "w").close()
    time.sleep(600)

model_import.check_same_tensors = hang
sys.exit(main(["models", "import", sys.argv[1], "--home", sys.argv[2]]))
"""




@pytest.fixture
def hung_import(tmp_path, home, demo_path):
    """`q2` registered and an import of it running, stopped with its copy staged."""
    Registry(home).add("q2", demo_path)
    ready = str(tmp_path / "ready")
    err = tmp_path / "stderr"
    with open(err, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", HUNG_IMPORT, "q2", home, ready],
                                stderr=stderr, preexec_fn=default_sigint)
    proc.stderr_path = err
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not os.path.exists(ready):
            assert proc.poll() is None, f"the import exited early (rc {proc.returncode})"
            assert time.monotonic() < deadline, "the import did not reach its check"
            time.sleep(0.05)
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def mox(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def tree_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f))
               for root, _, files in os.walk(folder) for f in files)


def test_killed_import_copy_is_removed_by_the_next_import(capsys, home, hung_import):
    registry = Registry(home)
    [staged] = staging_folders(registry.models_dir, "q2")
    hung_import.send_signal(signal.SIGKILL)
    assert hung_import.wait(timeout=10) == -signal.SIGKILL
    assert os.path.isdir(staged)                      # a kill -9 runs no cleanup
    stale_bytes = tree_bytes(staged)
    assert stale_bytes > 10 << 20                     # the whole repacked copy
    _, _, err = mox(capsys, "models", "list", "--home", home)
    assert f"note: {format_bytes(stale_bytes)} in import copies" in err
    rc, out, err = mox(capsys, "models", "import", "q2", "--home", home)
    assert rc == 0 and "imported" in out, err
    assert (f"removed {format_bytes(stale_bytes)} left by an interrupted import of q2"
            in err)
    assert staging_folders(registry.models_dir) == []
    assert registry.get("q2").repacked


def test_concurrent_import_of_same_model_refused(capsys, home, hung_import):
    registry = Registry(home)
    [staged] = staging_folders(registry.models_dir, "q2")
    staged_bytes = tree_bytes(staged)
    rc, _, err = mox(capsys, "models", "import", "q2", "--home", home)
    assert rc == 2 and "another import of q2 is running" in err
    assert tree_bytes(staged) == staged_bytes         # the live copy is untouched
    assert not registry.get("q2").repacked
    hung_import.kill()
    hung_import.wait(timeout=10)                      # the kernel drops its lock
    rc, out, err = mox(capsys, "models", "import", "q2", "--home", home)
    assert rc == 0 and registry.get("q2").repacked, err


@pytest.mark.parametrize("name, folder, expected", [
    ("a", ".importing-a-1f2e3d4c", True),              # this mox's hex suffix
    ("a", ".importing-a-k2_x9q0z", True),              # mkdtemp's, from older mox
    ("a", ".importing-a-b-1f2e3d4c", False),           # model a-b
    ("a", ".importing-a--1f2e3d4c", False),            # model a-
    ("a", ".importing-ab-1f2e3d4c", False),            # model ab
    ("a", ".importing-a-", False),
    ("a-b", ".importing-a-b-1f2e3d4c", True),
    ("a", ".import-a.lock", False),
])
def test_staging_folder_names(name, folder, expected):
    assert is_staging_of(name, folder) is expected


def test_import_removes_only_its_own_stale_copies(capsys, home, demo_path):
    registry = Registry(home)
    registry.add("a", demo_path)
    others = [".importing-a-b-1f2e3d4c", ".importing-ab-k2_x9q0z", ".importing-a--0a1b2c3d"]
    for folder in [".importing-a-k2_x9q0z", *others]:
        os.makedirs(os.path.join(registry.models_dir, folder))
        with open(os.path.join(registry.models_dir, folder, "part"), "wb") as f:
            f.write(b"\0" * 1000)
    rc, out, err = mox(capsys, "models", "list", "--json", "--home", home)
    assert json.loads(out)[0]["name"] == "a" and "3.9 KiB in import copies" in err
    rc, _, err = mox(capsys, "models", "import", "a", "--home", home)
    assert rc == 0 and "removed 1000 B left by an interrupted import of a" in err
    assert sorted(map(os.path.basename, staging_folders(registry.models_dir))) == sorted(
        others)


def test_ctrl_c_ends_an_import_cleanly(home, hung_import):
    """SIGINT mid-import: one line, the shell's status 130, no traceback; the staging copy
    is gone and the registry still points at the original."""
    registry = Registry(home)
    [staged] = staging_folders(registry.models_dir, "q2")
    hung_import.send_signal(signal.SIGINT)
    assert hung_import.wait(timeout=READY_TIMEOUT_S) == 130
    err = hung_import.stderr_path.read_text()
    assert "mox: interrupted" in err and "Traceback" not in err, err
    assert not os.path.exists(staged)
    assert not registry.get("q2").repacked


def test_rm_removes_the_models_import_lock(capsys, home, demo_path):
    registry = Registry(home)
    registry.add("a", demo_path)
    rc, _, err = mox(capsys, "models", "import", "a", "--home", home)
    lock = os.path.join(registry.models_dir, ".import-a.lock")
    assert rc == 0 and os.path.exists(lock), err
    rc, _, err = mox(capsys, "models", "rm", "a", "--home", home)
    assert rc == 0 and not os.path.exists(lock), err
