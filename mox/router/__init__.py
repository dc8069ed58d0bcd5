"""The router: the model table and the loop (`router`), its configuration (`config`),
admission (`admission`), request-rate tracking (`rates`), model lifecycle (`served_model`:
opening, weight loading; the states are mox.messages.ModelState), memory policies
(`memory_policy`) and the planner they use (`planner`), applying a plan to the pools
(`residency`), and the async driver that steps the router on its own thread (`driver`)."""

from mox.router.config import ROUTER_POLICIES, RouterConfig
from mox.router.router import Router

__all__ = ["ROUTER_POLICIES", "Router", "RouterConfig"]
