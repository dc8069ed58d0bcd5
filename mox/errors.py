"""The errors mox raises for bad input; the server maps each to an HTTP status."""

from mox.loaders.errors import CheckpointError, MoxError


class InvalidRequestError(MoxError):
    """A request or parameter that mox refuses (maps to HTTP 400)."""


class ModelNotFoundError(MoxError):
    """A model name or path that is not known (maps to HTTP 404)."""


__all__ = ["CheckpointError", "InvalidRequestError", "ModelNotFoundError", "MoxError"]
