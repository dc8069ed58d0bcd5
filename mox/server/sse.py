"""The one Server-Sent Events writer, for completions and chat completions alike:

    data: <chunk json>\\n\\n  ...  [data: <usage chunk json>\\n\\n]  data: [DONE]\\n\\n

The headers go out only with the first output, so everything that fails before it (a prompt
too long, admission refused, an unknown model) still gets its proper HTTP status. A failure
after that is an error event (`data: {"error": {...}}`) followed by [DONE], as OpenAI does.
A client that goes away is noticed at the next write (or by the handler's cancellation) and
the backend's generator is closed, which aborts the request.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web

from mox.server.errors import http_error
from mox.server.formatting import OutputFormat
from mox.server.generation import Generation

log = logging.getLogger("mox.server")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}      # tell reverse proxies not to buffer
DONE = b"data: [DONE]\n\n"


def sse_event(payload: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def stream_sse(http_request: web.Request, generation: Generation, fmt: OutputFormat,
                     include_usage: bool) -> web.StreamResponse:
    outputs = generation.outputs()
    try:
        first = await anext(outputs)       # errors here become ordinary HTTP errors
    except BaseException:
        await outputs.aclose()
        raise
    response = web.StreamResponse(headers=SSE_HEADERS)
    try:
        await response.prepare(http_request)
        await response.write(sse_event(fmt.chunk(first)))
        try:
            async for out in outputs:
                await response.write(sse_event(fmt.chunk(out)))
            if include_usage:
                await response.write(sse_event(fmt.usage_chunk(generation.usage)))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - mid-stream failures become an error event
            await response.write(sse_event(http_error(e).body))
        await response.write(DONE)
        await response.write_eof()
    except ConnectionResetError:
        log.info("client went away; aborting %s", generation.request.request_id)
    finally:
        await outputs.aclose()            # aborts the request if it is still running
    return response
