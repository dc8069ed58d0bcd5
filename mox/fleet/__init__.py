"""mox on Ray Serve (`mox serve --ray`): replicas that are each a whole mox, behind one
OpenAI endpoint, with requests routed to the replica where their model is warm.

    HTTP -> Ray's proxy -> MoxIngress (reads the body's "model") -> DeploymentHandle with
         multiplexed_model_id=model -> WarmFirstRouter (picks the replica) -> MoxReplica
         -> that replica's own mox server on loopback (the same handlers as `mox serve`)

Ray is an optional dependency (`pip install 'mox[ray]'`); nothing outside this package
imports it, and `require_ray` says how to install it.
"""

from __future__ import annotations

from mox.errors import MoxError


def require_ray() -> None:
    """Raise a MoxError that says how to get Ray when it is not installed."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise MoxError("mox serve --ray needs Ray Serve: pip install 'mox[ray]' "
                       f"(import failed: {e})") from e
