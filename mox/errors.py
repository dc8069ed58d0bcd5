"""The errors mox raises for bad input; the server maps each to an HTTP status."""

from mox.loaders.errors import CheckpointError, MoxError


class InvalidRequestError(MoxError):
    """A request or parameter that mox refuses (maps to HTTP 400). `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(MoxError):
    """A model name or path that is not known (maps to HTTP 404)."""


class AdmissionError(MoxError):
    """The model's queue, or the server's, is full (maps to HTTP 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelUnavailableError(MoxError):
    """The model is registered but failed to load (maps to HTTP 503); the message says why."""


class RequestTimeoutError(MoxError):
    """A request waited in its queue longer than its timeout and was aborted."""


class ShuttingDownError(MoxError):
    """The server is stopping: the request was refused, or cut after the shutdown grace
    (maps to HTTP 503)."""


__all__ = ["AdmissionError", "CheckpointError", "InvalidRequestError", "ModelNotFoundError",
           "ModelUnavailableError", "MoxError", "RequestTimeoutError",
           "ShuttingDownError"]
