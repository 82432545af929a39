/*
 * A shared inline function of the CPU kernels (included by paged_attention.c and gemm.c; build.py
 * keys every library on this header's text too).
 */
#ifndef WARMCAP_EXP_NONPOSITIVE_H
#define WARMCAP_EXP_NONPOSITIVE_H

#include <stdint.h>
#include <string.h>

/*
 * e^x for x <= 0 in plain arithmetic the compiler vectorises (in paged_attention.c a call to
 * libm's expf per score was a third of the kernel's time; gemm.c's SiLU uses it too). x is split as
 * n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, Cody and Waite), e^r is a degree-7 polynomial (Cephes' expf
 * coefficients) and 2^n goes into the exponent bits. Within 1.02 ulp of e^x on every float in
 * [-87.3, 0] (checked against double exp); NaN stays NaN; below -87.3 it gives 0, where e^x is
 * under the smallest normal float and no softmax weight can notice it.
 */
static inline __attribute__((always_inline)) float exp_nonpositive(float x)
{
    const float clamped = x < -87.3f ? -87.3f : x; /* false for NaN: NaN passes through */
    const float shift = 12582912.0f;               /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (clamped * 1.44269504088896341f + shift) - shift;
    float r = clamped - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.3f ? 0.0f : p * scale;
}

/*
 * exp_nonpositive on each lane of a GCC vector of floats (V: the vector type, I: the int32 vector of
 * its width), as the same expressions in the same order, so every lane is the scalar function's bits
 * (the caller's -ffp-contract fuses the same multiply-adds in both). NOTE: the scalar function's
 * ternaries become branches under GCC's default -ftrapping-math, which keeps a loop over it scalar
 * even under `omp simd`; here the selections are bit masks.
 */
#define WARMCAP_EXP_NONPOSITIVE_V(V, I, x_in, out)                                                          \
    do {                                                                                                \
        const V x_ = (x_in);                                                                            \
        const V lo_ = (V){0} + -87.3f;                                                                  \
        const I below_ = x_ < lo_; /* all ones where x < -87.3; false for NaN */                        \
        const V clamped_ = (V)(((I)lo_ & below_) | ((I)x_ & ~below_));                                  \
        const V n_ = (clamped_ * 1.44269504088896341f + 12582912.0f) - 12582912.0f;                     \
        V r_ = clamped_ - n_ * 0.693359375f;                                                            \
        r_ = r_ - n_ * -2.12194440e-4f;                                                                 \
        V p_ = (V){0} + 1.9875691500e-4f;                                                               \
        p_ = p_ * r_ + 1.3981999507e-3f;                                                                \
        p_ = p_ * r_ + 8.3334519073e-3f;                                                                \
        p_ = p_ * r_ + 4.1665795894e-2f;                                                                \
        p_ = p_ * r_ + 1.6666665459e-1f;                                                                \
        p_ = p_ * r_ + 5.0000001201e-1f;                                                                \
        p_ = p_ * r_ * r_ + r_ + 1.0f;                                                                  \
        const I bits_ = (__builtin_convertvector(n_, I) + 127) << 23;                                   \
        const V e_ = p_ * (V)bits_;                                                                     \
        (out) = (V)((I)e_ & ~below_);                                                                   \
    } while (0)

#endif
