"""Errors raised for user-supplied files.

`MoxError` is the root of every error mox raises for bad input; it lives here, at the bottom
of the dependency picture, so that `loaders` needs nothing from the rest of mox and
`mox.errors` can re-export it.
"""

from __future__ import annotations

import os


class MoxError(Exception):
    """Root of the errors mox raises for bad user input or bad files."""


class CheckpointError(MoxError):
    """A checkpoint file is missing, corrupt or not a supported model; names the file."""

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
