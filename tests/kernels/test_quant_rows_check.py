"""The native kernels' vector loops against their plain-C definitions on this CPU: the int8
activation quantizers (AVX2, AVX-512 where the CPU has them) byte for byte in every layout,
NaN and infinity included, and AVX2's int4 span loop and FP8 loop at 1 to 8 rows (these run
on AVX2 CPUs without VNNI, so an AVX-512 test host checks them here too). A C program
(csrc/quant_rows_check.c) compares them; a vector path the CPU lacks is skipped inside it."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

import pytest

from mox.kernels.native_build import SOURCE_DIR

CHECK = os.path.join(os.path.dirname(__file__), "csrc", "quant_rows_check.c")
CC = os.environ.get("CC", "cc")


@pytest.mark.skipif(shutil.which(CC) is None or platform.machine() not in ("x86_64", "AMD64"),
                    reason="needs a C compiler for x86-64 (the loops use its intrinsics)")
def test_vector_loops_match_their_plain_definitions(tmp_path):
    program = str(tmp_path / "check")
    build = subprocess.run([CC, "-O3", "-march=native", "-ffp-contract=off", "-fopenmp",
                            f"-I{SOURCE_DIR}", CHECK, "-o", program, "-lm"],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr[-2000:]
    result = subprocess.run([program], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout
    assert "mismatches: 0" in result.stdout
