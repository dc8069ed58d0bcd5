"""Quantized expert weights: the formats mox pages and computes as stored, and the one
definition of their values (`dequantize`) that every kernel backend is checked against.

A weight `[N, K]` (N output rows, K inputs) is stored as integers or FP8 plus scales, one per
block of `block_rows x block_cols` values (`block_cols` 0: the whole row): the value is
`stored * scale`. Symmetric (no zero point), as the published layouts mox reads store them:
- int8, one scale per output row (compressed-tensors `int-quantized`, strategy "channel");
- int4, groups of 128 inputs (compressed-tensors `pack-quantized`): values + 8 as unsigned
  nibbles, two a byte, the first in the low nibble (the bytes of its little-endian int32
  `weight_packed`, eight values each), so stored `[N, K / 2]` uint8;
- FP8 E4M3, blocks of 128 x 128 (DeepSeek-V3's `weight_scale_inv`, which despite its name
  multiplies);
- MXFP4, groups of 32 (GPT-OSS): E2M1 values packed as int4 is (no offset: sign, 2 exponent
  bits, 1 mantissa bit), with power-of-two scales (stored E8M0, held as float32).

Scales are `[ceil(N / block_rows), ceil(K / block_cols)]` float32. An expert's gate and up
weights are quantized apart, so a slot's w13 scales are `[2, rows, cols]`: gate's, then up's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

INT8, INT4, FP8, MXFP4 = "int8", "int4", "fp8", "mxfp4"
KINDS = (INT8, INT4, FP8, MXFP4)
PACKED = (INT4, MXFP4)              # two values a byte
_STORAGE = {INT8: torch.int8, INT4: torch.uint8, FP8: torch.float8_e4m3fn, MXFP4: torch.uint8}
_MAX = {INT8: 127.0, INT4: 7.0, FP8: 448.0, MXFP4: 6.0}
INT4_OFFSET = 8
# The 16 E2M1 codes: sign bit, 2 exponent bits, 1 mantissa bit.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
E8M0_NAN = 0xFF          # the one E8M0 code that is no power of two


@dataclass(frozen=True)
class WeightFormat:
    kind: str                 # INT8 | INT4 | FP8
    block_rows: int = 1       # output rows sharing one scale
    block_cols: int = 0       # inputs sharing one scale; 0: the whole row

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown weight format {self.kind!r}; mox reads {KINDS}")

    @property
    def storage_dtype(self) -> torch.dtype:
        return _STORAGE[self.kind]

    def stored_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return (rows, cols // 2) if self.kind in PACKED else (rows, cols)

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return (math.ceil(rows / self.block_rows),
                1 if self.block_cols == 0 else math.ceil(cols / self.block_cols))

    def describe(self) -> str:
        """e.g. "int8 per channel", "int4 groups of 128", "fp8 blocks of 128x128"."""
        if self.block_cols == 0 and self.block_rows == 1:
            return f"{self.kind} per channel"
        if self.block_rows == 1:
            return f"{self.kind} groups of {self.block_cols}"
        cols = "row" if self.block_cols == 0 else self.block_cols
        return f"{self.kind} blocks of {self.block_rows}x{cols}"


INT8_PER_CHANNEL = WeightFormat(INT8)
INT4_GROUP128 = WeightFormat(INT4, 1, 128)
FP8_BLOCK128 = WeightFormat(FP8, 128, 128)
MXFP4_GROUP32 = WeightFormat(MXFP4, 1, 32)
IMPORT_FORMATS = {INT8: INT8_PER_CHANNEL, INT4: INT4_GROUP128, FP8: FP8_BLOCK128}


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """`[..., K / 2]` uint8 -> `[..., K]` int8 in [-8, 7]."""
    low = (packed & 0x0F).to(torch.int8) - INT4_OFFSET
    high = (packed >> 4).to(torch.int8) - INT4_OFFSET
    return torch.stack((low, high), dim=-1).flatten(-2)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """`[..., K / 2]` uint8 of E2M1 codes -> `[..., K]` float32."""
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=packed.device)
    return torch.stack((table[(packed & 0x0F).long()], table[(packed >> 4).long()]),
                       dim=-1).flatten(-2)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """MXFP4's stored scales (uint8 exponents) -> float32 powers of two."""
    exponents = scales.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(torch.ones(exponents.shape, device=scales.device), exponents)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """`[..., K]` integers in [-8, 7] (K even) -> `[..., K / 2]` uint8."""
    unsigned = (values.to(torch.int16) + INT4_OFFSET).to(torch.uint8)
    return unsigned[..., 0::2] | (unsigned[..., 1::2] << 4)


def _expand(scale: torch.Tensor, fmt: WeightFormat, rows: int, cols: int) -> torch.Tensor:
    """Scales `[..., nb, kb]` -> one per value `[..., rows, cols]` (or `[..., rows, 1]`)."""
    scale = scale.float()
    if fmt.block_rows > 1:
        scale = scale.repeat_interleave(fmt.block_rows, dim=-2)[..., :rows, :]
    if fmt.block_cols > 0:
        scale = scale.repeat_interleave(fmt.block_cols, dim=-1)[..., :cols]
    return scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, fmt: WeightFormat,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored `[..., N, K']` and scales `[..., nb, kb]` -> values `[..., N, K]` in `dtype`."""
    values = (unpack_int4(data) if fmt.kind == INT4 else unpack_fp4(data) if fmt.kind == MXFP4
              else data).float()
    *batch, rows, cols = values.shape
    br, bc = fmt.block_rows, fmt.block_cols or cols
    if rows % br == 0 and cols % bc == 0:         # whole blocks: broadcast, no per-value scales
        blocks = values.view(*batch, rows // br, br, cols // bc, bc)
        scaled = blocks * scale.float().view(*batch, rows // br, 1, cols // bc, 1)
        return scaled.view(*batch, rows, cols).to(dtype)
    return (values * _expand(scale, fmt, rows, cols)).to(dtype)


def quantize(weight: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, K]` -> (stored, float32 scales): each block's largest magnitude maps to the
    format's largest value (round to nearest)."""
    rows, cols = weight.shape
    if fmt.kind in PACKED and cols % 2:
        raise ValueError(f"{fmt.kind} packs two values a byte: {cols} inputs is odd")
    w = weight.float()
    nb, kb = fmt.scale_shape(rows, cols)
    br, bc = fmt.block_rows, fmt.block_cols or cols
    padded = torch.zeros(nb * br, kb * bc, device=weight.device)
    padded[:rows, :cols] = w.abs()
    amax = padded.view(nb, br, kb, bc).amax(dim=(1, 3))                      # [nb, kb]
    scale = (amax / _MAX[fmt.kind]).clamp(min=torch.finfo(torch.float32).tiny)
    if fmt.kind == MXFP4:                             # a power of two, the largest value <= 6
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scaled = w / _expand(scale, fmt, rows, cols)
    if fmt.kind == MXFP4:
        return _nearest_fp4(scaled), scale
    if fmt.kind == FP8:
        return scaled.clamp(-_MAX[FP8], _MAX[FP8]).to(torch.float8_e4m3fn), scale
    ints = scaled.round().clamp(-_MAX[fmt.kind] - (fmt.kind == INT4), _MAX[fmt.kind])
    return (pack_int4(ints) if fmt.kind == INT4 else ints.to(torch.int8)), scale


def _nearest_fp4(values: torch.Tensor) -> torch.Tensor:
    """`[..., K]` (K even) -> the nearest E2M1 codes, packed `[..., K / 2]` uint8."""
    table = torch.tensor(FP4_E2M1_VALUES[:8])
    magnitude = (values.abs()[..., None] - table).abs().argmin(dim=-1)     # codes 0..7
    codes = (magnitude + 8 * (values < 0)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


@dataclass(frozen=True)
class ExpertScales:
    """The scales of a quantized slot pool, beside its stored `w13 [S, 2I, H']` and
    `w2 [S, H, I']`: `w13 [S, 2, nb, kb]` (gate's, up's), `w2 [S, nb, kb]`, float32."""

    fmt: WeightFormat
    w13: torch.Tensor
    w2: torch.Tensor


def dequantize_experts(w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales,
                       slots: torch.Tensor, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts in `slots` (int64 `[A]`) as values: `[A, 2I, H]`, `[A, H, I]`."""
    inter = w13.shape[1] // 2
    data13 = w13[slots]                                                   # [A, 2I, H']
    gate = dequantize(data13[:, :inter], scales.w13[slots, 0], scales.fmt, dtype)
    up = dequantize(data13[:, inter:], scales.w13[slots, 1], scales.fmt, dtype)
    down = dequantize(w2[slots], scales.w2[slots], scales.fmt, dtype)
    return torch.cat((gate, up), dim=1), down
