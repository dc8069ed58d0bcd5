"""The OpenAI-compatible HTTP server (aiohttp): `create_app(backend)` over any
`ServingBackend`, and `start_server(app, host, port)`."""

from mox.server.app import METRICS, create_app, start_server
from mox.server.backend import ModelInfo, ServingBackend
from mox.server.chat_template import ChatTemplate

__all__ = ["METRICS", "ChatTemplate", "ModelInfo", "ServingBackend", "create_app",
           "start_server"]
