"""The server's limits, in one place: what a client may send, how long it may take, how many
connections may be open, what one request may ask for, and how long shutdown waits. `mox
serve` sets them from its flags; the defaults suit a server on loopback or behind a proxy."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """- `header_timeout_s`: from a connection's opening (or the end of its previous
      response) to a whole request's headers; also how long an idle keep-alive connection
      stays open.
    - `body_timeout_s`: from the headers to the whole body (408 past it).
    - `max_body_bytes`: the largest body (413); a 4k-token prompt as ids is ~30 KB of JSON.
    - `max_connections`: open connections at once; past it, new ones get 503 and are closed.
    - `default_max_tokens`: a chat request's output limit when it sets none (completions
      keep OpenAI's 16).
    - `max_tokens_cap`: the most tokens one request may ask for (400 past it).
    - `shutdown_grace_s`: on SIGTERM, the whole time from the signal to exit: in-flight
      requests run until 2 s before it
      (`app.SHUTDOWN_END_S`), then are ended with an error (streams: an error event and
      [DONE])."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_body_bytes: int = 1 << 20
    max_connections: int = 512
    default_max_tokens: int = 2048
    max_tokens_cap: int = 16384
    shutdown_grace_s: float = 10.0

    def __post_init__(self) -> None:
        positive = (self.header_timeout_s, self.body_timeout_s, self.max_body_bytes,
                    self.max_connections, self.default_max_tokens, self.max_tokens_cap)
        if min(positive) <= 0 or self.shutdown_grace_s < 0:
            raise ValueError(f"server limits must be positive (grace >= 0): {self}")
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError(f"default_max_tokens {self.default_max_tokens} is above "
                             f"max_tokens_cap {self.max_tokens_cap}")


DEFAULT_LIMITS = ServerLimits()
