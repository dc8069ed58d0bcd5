"""Ray is optional: mox imports and serves without it, and `--ray` says how to get it."""

from __future__ import annotations

import subprocess
import sys

from mox.cli import main

NO_RAY = "import sys; sys.modules['ray'] = None; "      # `import ray` raises ImportError


def test_serve_ray_without_ray_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["serve", "--ray", "--home", str(tmp_path)]) == 2
    assert "pip install 'mox[ray]'" in capsys.readouterr().err


def test_mox_imports_without_ray():
    code = NO_RAY + "import mox.cli, mox.serve, mox.server.app, mox.llm, mox.fleet; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
