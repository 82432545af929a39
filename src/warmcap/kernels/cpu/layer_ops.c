/*
 * Small per-layer ops of a decoder on CPU, float32: RMSNorm (optionally after the residual add),
 * rotate-half RoPE in place, and the candidate test of the screened greedy LM head. Each replaces
 * several torch ops (a dispatch and a pass over memory each) by one call: at decode sizes the calls
 * and passes, not the arithmetic, were the cost.
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

static inline float bf16_to_float(uint16_t b)
{
    union {
        uint32_t u;
        float f;
    } v = {.u = (uint32_t)b << 16};
    return v.f;
}

/*
 * The candidate test of the screened greedy head (models/greedy_head.py, whose docstring proves
 * it) over its bf16 screen z = approx [rows, vocab] (row stride a_stride), with t = cx[m] *
 * norms[v] rounded to float:
 *   lo[m] = max_v (z[m, v] - t) - 2 * absolute[m],
 *   v is a candidate when z[m, v] + t >= lo[m] for some row m.
 * Writes lo [rows], the candidates to ids in ascending order, and returns how many there are.
 * flags is scratch of vocab bytes. One pass over the screen per test, in place of the torch path's
 * float32 copy and six passes over it.
 */
int64_t warmcap_greedy_candidates(const uint16_t *restrict approx, int64_t a_stride, const float *restrict cx,
                                  const float *restrict absolute, const float *restrict norms, int64_t rows,
                                  int64_t vocab, float *restrict lo, uint8_t *restrict flags, int64_t *restrict ids,
                                  int32_t num_threads)
{
    const int parallel = num_threads > 1 && rows * vocab >= 65536;
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (int64_t m = 0; m < rows; ++m) {
        const uint16_t *a = approx + m * a_stride;
        const float c = cx[m];
        float best = -INFINITY;
#pragma omp simd reduction(max : best)
        for (int64_t v = 0; v < vocab; ++v) {
            const float low = bf16_to_float(a[v]) - c * norms[v];
            best = best > low ? best : low;
        }
        lo[m] = best - 2.0f * absolute[m];
    }
    const int64_t chunk = 4096;
#pragma omp parallel for num_threads(num_threads) if (parallel) schedule(static)
    for (int64_t start = 0; start < vocab; start += chunk) {
        const int64_t end = start + chunk < vocab ? start + chunk : vocab;
        for (int64_t v = start; v < end; ++v) {
            flags[v] = 0;
        }
        for (int64_t m = 0; m < rows; ++m) {
            const uint16_t *a = approx + m * a_stride;
            const float c = cx[m];
            const float l = lo[m];
#pragma omp simd
            for (int64_t v = start; v < end; ++v) {
                flags[v] |= (uint8_t)(bf16_to_float(a[v]) + c * norms[v] >= l);
            }
        }
    }
    int64_t k = 0;
    for (int64_t v = 0; v < vocab; ++v) {
        if (flags[v]) {
            ids[k++] = v;
        }
    }
    return k;
}
