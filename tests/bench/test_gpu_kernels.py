"""The GPU check's quantized phase (bench/micro/gpu_kernels.py), run as `--smoke` runs it: toy
sizes on the CPU under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET), so
the script the GPU machine runs is known to work before a GPU is lent."""

from __future__ import annotations

from mox.bench.micro.gpu_kernels import (
    QUANT_FORMATS,
    REL_TOL,
    SMOKE_SHAPES,
    markdown,
    measure_quantized,
)


def test_the_quantized_phase_times_every_format_against_its_reference():
    rows = measure_quantized(SMOKE_SHAPES, [5], device="cpu")
    assert [r["format"] for r in rows] == ["bf16", *QUANT_FORMATS]
    bf16 = rows[0]
    assert bf16["vs_bf16"] == 1.0
    for row in rows:
        # each within bf16 rounding of the reference over its own dequantized weights
        assert row["ok"] and 0 < row["rel_err"] < max(REL_TOL.values()), row
        assert row["ms"] > 0 and row["vs_bf16"] == bf16["ms"] / row["ms"]
    # the stored bytes shrink with the format, scales included (float32 in the pools: one a
    # row for int8, one a group of 128 for int4, of 32 for MXFP4: 0.25 + 4 / 32 / 2)
    share = {r["format"]: r["gbps"] * r["ms"] / (bf16["gbps"] * bf16["ms"]) for r in rows}
    assert 0.49 < share["int8"] < 0.55 and 0.49 < share["fp8"] < 0.55
    assert 0.25 < share["int4"] < 0.28 and 0.31 < share["mxfp4"] < 0.32
    # the printed table: a line per row, each naming its format
    lines = markdown(rows).splitlines()[2:]
    assert [line.split(" | ")[2] for line in lines] == [r["format"] for r in rows]
