"""The router: admission, request-rate tracking (`rates`), model lifecycle (`served_model`:
opening, weight loading, states), memory policies (`memory_policy`) and the planner they use
(`planner`), applying a plan to the pager (`residency`), and the async driver that steps it on
its own thread (`driver`)."""

from mox.router.router import ROUTER_POLICIES, Router, RouterConfig

__all__ = ["ROUTER_POLICIES", "Router", "RouterConfig"]
