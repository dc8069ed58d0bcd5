"""Model forward: one generic MoE decoder for every supported architecture (`ModelSpec`)."""

from mox.models.decoder import MoEDecoder
from mox.models.loading import load_model

__all__ = ["MoEDecoder", "load_model"]
