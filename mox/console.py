"""The `mox` console script. Importing the CLI imports torch (a second or two), so the
import runs inside the Ctrl-C handler too: an interrupt then ends quietly, as it does once
a command runs (mox.cli.main)."""

from __future__ import annotations

import importlib
import sys

INTERRUPTED = 130                  # the shell's status for a command ended by SIGINT (128 + 2)


def main(argv: list[str] | None = None) -> int:
    try:
        cli = importlib.import_module("mox.cli")
    except KeyboardInterrupt:
        print("mox: interrupted", file=sys.stderr)
        return INTERRUPTED
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
