"""MXFP4 (OCP microscaling FP4), as GPT-OSS checkpoints store expert weights: blocks of 32
E2M1 values, two a byte (low nibble first), sharing one E8M0 scale byte (2^(byte - 127)).
mox dequantizes each expert as it loads into the slot dtype; the pager still reads and
caches the compact bytes.

Legend: R rows, G blocks per row (columns / 32).
"""

from __future__ import annotations

import torch

from .layout import MXFP4_BLOCK_BYTES, MXFP4_BLOCK_VALUES

# The 16 E2M1 codes: sign bit, 2 exponent bits, 1 mantissa bit.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """blocks `[R, G, 16]` uint8, scales `[R, G]` uint8 -> `[R, G * 32]` in `dtype`."""
    rows, groups, nbytes = blocks.shape
    assert nbytes == MXFP4_BLOCK_BYTES and scales.shape == (rows, groups), (blocks.shape,
                                                                           scales.shape)
    assert blocks.dtype == scales.dtype == torch.uint8
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]   # [R, G, 16]
    values = torch.stack((low, high), dim=-1).view(rows, groups, MXFP4_BLOCK_VALUES)
    exponents = scales.to(torch.int32) - E8M0_BIAS                            # [R, G]
    return torch.ldexp(values, exponents[..., None]).view(rows, -1).to(dtype)
