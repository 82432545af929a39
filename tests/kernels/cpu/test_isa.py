"""Every instruction-set path the code can select, tested on whatever x86 machine runs the suite.

CI lands on Intel or AMD, AVX2 or AVX-512 machines at random, and a path that only another machine
takes is otherwise never tested here. Two kinds of path:
- the compiled kernels' target (``WARMCAP_CPU_ISA``, ``kernels/cpu/build.py``): ``gemm.c`` tiles by
  the ISA it is built for; ``avx512`` on a CPU without AVX-512 builds the AVX-512 tiling with this
  CPU's instructions, so its logic is tested on any machine;
- torch's and MKL's own kernel dispatch (``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``),
  which decide the rounding of the ops a ``--batch-invariant`` model runs: its graphs must verify
  within 1e-5 of the unpadded batch on every path (an AMD EPYC once failed there, 5e-5: SDPA's
  GEMMs round by the query count, so the invariant attention path uses no BLAS).
Each case runs in a subprocess (the switches are read when the kernels are built or torch starts).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from warmcap.kernels.cpu.build import ISA_ENV, cpu_has

ROOT = Path(__file__).parents[3]

#: the forced kernel targets this CPU can run (native is the rest of the suite)
KERNEL_ISAS = [
    isa for isa, need in (("avx2", "avx2"), ("avx512", "avx2"), ("baseline", "sse4_2")) if cpu_has(need)
]
_AVX512 = all(cpu_has(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))
#: torch's and MKL's dispatch levels this CPU can run
TORCH_ISAS = [("default", "SSE4_2"), ("avx2", "AVX2")] + ([("avx512", "AVX512")] if _AVX512 else [])


def _pytest(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_the_gemm_built_for_each_isa_keeps_its_contract(isa: str) -> None:
    """The product within float32's bound, the same bits in any batch beside any columns on any
    thread count, the fused SiLU product: under each forced target (the build reports the tiling it
    got, so a switch that did not reach the compiler fails here)."""
    lanes = subprocess.run(
        [sys.executable, "-c", "from warmcap.kernels.cpu.gemm import built_lanes; print(built_lanes())"],
        env={**os.environ, ISA_ENV: isa},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert lanes.returncode == 0, lanes.stderr[-2000:]
    assert int(lanes.stdout.split()[-1]) == (16 if isa == "avx512" else 8)
    done = _pytest(
        {ISA_ENV: isa},
        "tests/kernels/cpu/test_gemm.py",
        "-k",
        "f_linear or same_bits or silu_mul_is or keeps_nan",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(("aten", "mkl"), TORCH_ISAS)
def test_batch_invariant_graphs_verify_on_each_torch_and_mkl_path(aten: str, mkl: str) -> None:
    done = _pytest(
        {"ATEN_CPU_CAPABILITY": aten, "MKL_ENABLE_INSTRUCTIONS": mkl},
        "tests/models/test_batch_invariant.py",
        "tests/runner_v2/test_invariant_attention.py",
        "-k",
        "tiny_graphs or depend_on_the_batch",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
