"""The vector exp of the CPU kernels (``kernels/cpu/exp_nonpositive.h``) gives each lane the scalar
function's bits: paged attention's softmax weights moved from the scalar function to the vector
one, and its outputs must not move by a bit. Compiled with the paged-attention kernel's own flags."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from warmcap.kernels.cpu import build

HEADER_DIR = Path(build.__file__).resolve().parent

HARNESS = r"""
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include "exp_nonpositive.h"
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* Both widths the kernel builds (8 lanes on AVX2, 16 on AVX-512), on the same 16 floats. */
static int check(const float *xs, long *bad) {
    v8f x8[2]; memcpy(x8, xs, sizeof x8);
    v8f e8[2];
    WARMCAP_EXP_NONPOSITIVE_V(v8f, v8i, x8[0], e8[0]);
    WARMCAP_EXP_NONPOSITIVE_V(v8f, v8i, x8[1], e8[1]);
    v16f x16; memcpy(&x16, xs, sizeof x16);
    v16f e16; WARMCAP_EXP_NONPOSITIVE_V(v16f, v16i, x16, e16);
    float es[32]; memcpy(es, e8, sizeof e8); memcpy(es + 16, &e16, sizeof e16);
    for (int i = 0; i < 32; ++i) {
        const float xi = xs[i % 16];
        const float s = exp_nonpositive(xi);
        uint32_t a, b; memcpy(&a, &s, 4); memcpy(&b, &es[i], 4);
        if (a != b && !(isnan(s) && isnan(es[i]))) {
            if (*bad < 3) printf("x=%a scalar=%a vector=%a (%d lanes)\n", xi, s, es[i], i < 16 ? 8 : 16);
            ++*bad;
        }
    }
    return 0;
}

int main(void) {
    long bad = 0, n = 0;
    float xs[16];
    int k = 0;
    /* Every 61st non-positive float (all exponents, many mantissas), then the edges. */
    for (uint64_t u = 0x80000000u; u <= 0xFFFFFFFFu; u += 61) {
        uint32_t b = (uint32_t)u; memcpy(&xs[k++], &b, 4);
        if (k == 16) { check(xs, &bad); n += 16; k = 0; }
    }
    const float edges[16] = {0.0f, -0.0f, -87.3f, -87.29999f, -87.30001f, -INFINITY, NAN, -NAN,
                             -1e-45f, -0.5f, -0.6931472f, -88.0f, -103.0f, -1.0f, -20.0f, -86.0f};
    check(edges, &bad); n += 16;
    printf("checked %ld, differing %ld\n", n, bad);
    return bad != 0;
}
"""


def test_every_lane_of_the_vector_exp_is_the_scalar_exp(tmp_path: Path) -> None:
    cc = build.compiler()
    if cc is None:
        pytest.fail("no C compiler: the CPU kernels (and this check) need one; install gcc or set CC")
    src = tmp_path / "harness.c"
    src.write_text(HARNESS)
    flags = [f for f in build.flags_of("paged_attention.c") if f not in ("-shared", "-fPIC")]
    exe = tmp_path / "harness"
    subprocess.run([cc, *flags, "-I", str(HEADER_DIR), "-o", str(exe), str(src), "-lm"], check=True)
    done = subprocess.run([str(exe)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout
    assert "differing 0" in done.stdout
