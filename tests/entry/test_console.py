"""The `mox` console script: Ctrl-C while it still imports the CLI (torch: a second or two)
ends with one line and the shell's status 130, as it does once a command runs."""

from __future__ import annotations

import mox.console
from mox.console import INTERRUPTED


def test_an_interrupt_while_importing_the_cli_is_one_line(monkeypatch, capsys):
    def interrupted(name):
        raise KeyboardInterrupt
    monkeypatch.setattr(mox.console.importlib, "import_module", interrupted)
    assert mox.console.main(["models", "list"]) == INTERRUPTED == 130
    assert capsys.readouterr().err == "mox: interrupted\n"


def test_the_console_script_runs_the_cli(tmp_path, capsys):
    assert mox.console.main(["models", "list", "--home", str(tmp_path)]) == 0
    assert "no models" in capsys.readouterr().out.lower()
