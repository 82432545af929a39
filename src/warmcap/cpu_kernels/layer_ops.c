/*
 * Small per-layer ops of a decoder on CPU, float32: RMSNorm (optionally after the residual add) and
 * rotate-half RoPE in place. Each replaces several torch ops (a dispatch and a pass over memory
 * each) by one call: at decode sizes the calls, not the arithmetic, were the cost.
 *
 * Built with -ffp-contract=off (build.py, EXTRA_FLAGS): no product is fused into an add, so RoPE
 * rounds exactly as torch's mul and add do and gives the same bits. RMSNorm sums its squares in a
 * vector order of its own, so it can differ from torch's in the last bit.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/*
 * out[t] = h[t] * (1 / sqrt(mean(h[t]^2) + eps)) * w for rows t < rows of n floats each, where
 * h = x, or h = x + delta (delta not NULL), which is stored to h_out first. out and h_out are
 * contiguous [rows, n]; x and delta have unit stride along n and the given row strides.
 */
void warmcap_rms_norm(float *restrict out, float *restrict h_out, const float *restrict x, int64_t x_stride,
                      const float *restrict delta, int64_t delta_stride, const float *restrict w, int64_t rows,
                      int64_t n, float eps, int32_t num_threads)
{
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && rows * n >= 65536) schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const float *xt = x + t * x_stride;
        const float *h = xt;
        if (delta != NULL) {
            const float *dt = delta + t * delta_stride;
            float *ht = h_out + t * n;
#pragma omp simd
            for (int64_t i = 0; i < n; ++i) {
                ht[i] = xt[i] + dt[i];
            }
            h = ht;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
            ss += h[i] * h[i];
        }
        const float r = 1.0f / sqrtf(ss / (float)n + eps);
        float *ot = out + t * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            ot[i] = (h[i] * r) * w[i];
        }
    }
}

/*
 * x [T, H, D] (unit stride in D; token and head strides given) rotated in place by cos/sin [T, D]
 * (row stride cs_stride): element i pairs with i + D/2, as transformers' rotate_half does, and each
 * output is (rotated * sin) + (x * cos) rounded in that order.
 */
void warmcap_rope(float *restrict x, int64_t stride_t, int64_t stride_h, int64_t tokens, int64_t heads, int64_t d,
                  const float *restrict cos_, const float *restrict sin_, int64_t cs_stride, int32_t num_threads)
{
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1 && tokens * heads * d >= 65536) schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos_ + t * cs_stride;
        const float *s = sin_ + t * cs_stride;
        for (int64_t h = 0; h < heads; ++h) {
            float *v = x + t * stride_t + h * stride_h;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = v[i];
                const float b = v[i + half];
                const float first = (-b) * s[i];
                const float second = a * s[i + half];
                v[i] = first + a * c[i];
                v[i + half] = second + b * c[i + half];
            }
        }
    }
}
