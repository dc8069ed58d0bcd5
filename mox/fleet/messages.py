"""What the ingress and the replicas pass through Ray: an HTTP exchange, forwarded as it came,
and the head of the replica's response (its body follows as byte chunks)."""

from __future__ import annotations

import msgspec

REPLICA_HEADER = "x-mox-replica"           # which replica answered (for operators and tests)
# Headers that describe one connection, not the message: each hop sets its own.
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                         "host", "date", "server", "upgrade", "te", "trailer"})


class Exchange(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    method: str
    path: str                                  # with the query string
    headers: list[tuple[str, str]]
    body: bytes = b""


class ResponseHead(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    status: int
    headers: list[tuple[str, str]]


class RequestFields(msgspec.Struct):
    """The two fields of an OpenAI request body the ingress routes by."""

    model: str = ""
    stream: bool = False


def request_fields(body: bytes) -> RequestFields:
    """The body's model and stream flag; a body that is not a JSON object routes as no model
    (the replica answers it with the proper 400)."""
    try:
        return msgspec.json.decode(body, type=RequestFields)
    except msgspec.DecodeError:              # (a ValidationError is one too)
        return RequestFields()


def end_to_end(headers) -> list[tuple[str, str]]:
    """`headers` (pairs) without the hop-by-hop ones."""
    return [(k, v) for k, v in headers if k.lower() not in HOP_HEADERS]
