"""The native kernels quantize activations to int8 with AVX2 or AVX-512 where the CPU has
them; each must give the scalar loop's bytes (the values in each packed layout, the block
scales, the sums the weights' offsets take). A C program (csrc/quantize_blocks_check.c)
compares them on this CPU; a vector path the CPU lacks is not compiled into the check."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from mox.kernels.native_build import SOURCE_DIR

CHECK = os.path.join(os.path.dirname(__file__), "csrc", "quantize_blocks_check.c")
CC = os.environ.get("CC", "cc")


@pytest.mark.skipif(shutil.which(CC) is None, reason="no C compiler")
def test_vector_quantizers_give_the_scalar_loops_bytes(tmp_path):
    program = str(tmp_path / "check")
    subprocess.run([CC, "-O3", "-march=native", "-ffp-contract=off", "-fopenmp", f"-I{SOURCE_DIR}",
                    CHECK, "-o", program, "-lm"], check=True, capture_output=True, timeout=120)
    result = subprocess.run([program], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout
    assert "mismatches: 0" in result.stdout
