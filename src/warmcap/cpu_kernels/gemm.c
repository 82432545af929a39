/*
 * A float32 GEMM for CPU linears: out[M, N] = x[M, K] . W^T (+ bias), with W packed once into
 * column blocks of 16 output features, [ceil(N/16), K, 16] (zeros past N), so a block's weights are
 * read as one sequential stream. Used at every batch size, decode to prefill; a gated MLP's gate
 * and up can also leave silu(gate) * up directly (warmcap_gemm_silu_mul).
 *
 * Why not oneDNN's packed product (models/packed_linear.py): at 8 to 64 rows oneDNN's primitive
 * costs ~25 us a call before any arithmetic, and its kernels stream the weights less well when each
 * layer's weights are cold (30 layers, 424 MB in SmolLM2); whole runs of the throughput workload
 * measured 1.19x faster on this kernel (BENCHMARKS.md).
 *
 * How it computes. x is copied transposed into tiles of 16 rows, [K, 16] each, so the values of one
 * k are one cache line. Each thread takes an equal range of column blocks. A tile of R rows (R = its
 * real row count, 1..16: no padded row is multiplied) goes through C blocks at a time, C = 8, 4, 2
 * or 1 for R <= 2, 4, 8 or 16, keeping R x C accumulators of 16 lanes in registers while, for
 * k = 0..K-1, it adds x[r, k] * w[k, block] into each: at least 8 independent multiply-add chains
 * where the rows allow. With several row tiles, 4 blocks at a time stay in cache while every tile
 * passes.
 *
 * Each output element is one fused multiply-add chain over k = 0..K-1 in order, whatever M, N, R, C
 * or the thread count: an output column has the same bits wherever it sits and however many rows
 * or other columns are computed with it (the greedy head re-scores a few vocabulary rows and relies
 * on this; tests/cpu_kernels/test_gemm.py checks it). The build uses -ffp-contract=fast
 * (build.py) so the multiply-add is fused on every CPU with FMA.
 */

#include <omp.h>
#include <stddef.h>
#include <stdint.h>

#include "exp_nonpositive.h"

typedef float v16 __attribute__((vector_size(64)));
/* the same vector read from memory that may be only float-aligned (vmovups) */
typedef float v16u __attribute__((vector_size(64), aligned(4)));

#define BLOCK 16
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Rows [m, M) of tile t are zero; the tile lives at xt[t * K * 16]. */
static void transpose_tile(const float *restrict x, int64_t ldx, float *restrict xt, int64_t rows, int64_t k_dim)
{
    for (int64_t k = 0; k < k_dim; ++k) {
        float *dst = xt + k * BLOCK;
        for (int64_t r = 0; r < rows; ++r) {
            dst[r] = x[r * ldx + k];
        }
        for (int64_t r = rows; r < BLOCK; ++r) {
            dst[r] = 0.0f;
        }
    }
}

/*
 * One row tile (R rows, `rows` of them real) times C column blocks starting at w (blocks `bstride`
 * floats apart); writes `rows` x `cols` outputs at out (row stride ldo), plus bias where given.
 */
ALWAYS_INLINE void tile(const float *restrict xt, const float *restrict w, int64_t bstride, int64_t k_dim,
                        float *restrict out, int64_t ldo, int64_t rows, int64_t cols, const float *restrict bias,
                        const int R, const int C)
{
    /* Fixed sizes (R * C <= 16, C <= 8), not [R * C]: a variable-length array stays in memory. */
    v16 acc[16];
    for (int i = 0; i < R * C; ++i) {
        acc[i] = (v16){0};
    }
    for (int64_t k = 0; k < k_dim; ++k) {
        v16 wv[8];
        for (int c = 0; c < C; ++c) {
            wv[c] = *(const v16u *)(w + c * bstride + k * BLOCK);
            __builtin_prefetch(w + c * bstride + (k + 16) * BLOCK, 0, 0);
        }
        const float *xk = xt + k * BLOCK;
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const float xr = xk[r];
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) {
                acc[r * C + c] += xr * wv[c];
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        float *o = out + r * ldo;
        for (int c = 0; c < C; ++c) {
            const int64_t n0 = (int64_t)c * BLOCK;
            if (n0 >= cols) {
                break;
            }
            v16 v = acc[r * C + c];
            if (bias != NULL) {
                v += *(const v16u *)(bias + n0);
            }
            if (cols - n0 >= BLOCK) {
                __builtin_memcpy(o + n0, &v, sizeof v);
            } else {
                for (int64_t i = 0; i < cols - n0; ++i) {
                    o[n0 + i] = v[i];
                }
            }
        }
    }
}

/* The most column blocks a tile of R rows takes at once: R * C <= 16 accumulators, C <= 8. */
static int max_blocks(int64_t rows)
{
    return rows <= 2 ? 8 : rows <= 4 ? 4 : rows <= 8 ? 2 : 1;
}

#define TILE_CASE(RR, CC)                                                                                       \
    case (RR) * 16 + (CC):                                                                                      \
        tile(xt, w, bstride, k_dim, out, ldo, rows, cols, bias, RR, CC);                                        \
        break;
#define TILE_CASES_8(RR) TILE_CASE(RR, 1) TILE_CASE(RR, 2) TILE_CASE(RR, 4) TILE_CASE(RR, 8)
#define TILE_CASES_4(RR) TILE_CASE(RR, 1) TILE_CASE(RR, 2) TILE_CASE(RR, 4)
#define TILE_CASES_2(RR) TILE_CASE(RR, 1) TILE_CASE(RR, 2)

/* A tile of exactly `rows` rows (R = rows: no padded rows are multiplied) against C blocks. */
static void tile_rc(int64_t rows, int c_blocks, const float *xt, const float *w, int64_t bstride, int64_t k_dim,
                    float *out, int64_t ldo, int64_t cols, const float *bias)
{
    switch (rows * 16 + c_blocks) {
        TILE_CASES_8(1)
        TILE_CASES_8(2)
        TILE_CASES_4(3)
        TILE_CASES_4(4)
        TILE_CASES_2(5)
        TILE_CASES_2(6)
        TILE_CASES_2(7)
        TILE_CASES_2(8)
        TILE_CASE(9, 1)
        TILE_CASE(10, 1)
        TILE_CASE(11, 1)
        TILE_CASE(12, 1)
        TILE_CASE(13, 1)
        TILE_CASE(14, 1)
        TILE_CASE(15, 1)
        TILE_CASE(16, 1)
    default:
        break;
    }
}

/* silu(g) = g / (1 + e^-g), from e^-|g| only (never overflows): g / (1 + t) for g >= 0, and
 * g t / (1 + t) for g < 0, where t = e^g. NaN stays NaN. */
static inline __attribute__((always_inline)) float silu(float g)
{
    const float t = exp_nonpositive(g >= 0.0f ? -g : g);
    return (g >= 0.0f ? g : g * t) / (1.0f + t);
}

/* A gated MLP's tiles go to these stack buffers first: up to 16 rows of 8 blocks. */
#define GROUP_FLOATS (BLOCK * 8 * BLOCK)

/*
 * Output blocks [b0, b1) for every row tile, in chunks of up to `chunk` blocks (kept in cache while
 * the row tiles pass), each chunk split into the widest groups its tiles take. up == NULL: out =
 * x . W^T (+ bias). Else out = silu(x . W^T + bias) * (x . U^T + up_bias): the gate's blocks at wp,
 * up's at `up`, n_dim a multiple of 16.
 */
static void column_range(const float *xt_all, const float *wp, const float *bias, const float *up,
                         const float *up_bias, float *out, int64_t ldo, int64_t m_dim, int64_t k_dim,
                         int64_t n_dim, int64_t b0, int64_t b1, int64_t chunk)
{
    const int64_t bstride = k_dim * BLOCK;
    float gate_tile[GROUP_FLOATS] __attribute__((aligned(64)));
    float up_tile[GROUP_FLOATS] __attribute__((aligned(64)));
    for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
        const int64_t c1 = c0 + chunk < b1 ? c0 + chunk : b1;
        for (int64_t t = 0; t * BLOCK < m_dim; ++t) {
            const int64_t rows = m_dim - t * BLOCK < BLOCK ? m_dim - t * BLOCK : BLOCK;
            const float *xt = xt_all + t * bstride;
            for (int64_t b = c0; b < c1;) {
                int c = max_blocks(rows);
                while (c > 1 && b + c > c1) {
                    c >>= 1;
                }
                const int64_t n0 = b * BLOCK;
                const int64_t cols = n_dim - n0 < (int64_t)c * BLOCK ? n_dim - n0 : (int64_t)c * BLOCK;
                float *o = out + t * BLOCK * ldo + n0;
                if (up == NULL) {
                    tile_rc(rows, c, xt, wp + b * bstride, bstride, k_dim, o, ldo, cols,
                            bias == NULL ? NULL : bias + n0);
                } else {
                    tile_rc(rows, c, xt, wp + b * bstride, bstride, k_dim, gate_tile, cols, cols,
                            bias == NULL ? NULL : bias + n0);
                    tile_rc(rows, c, xt, up + b * bstride, bstride, k_dim, up_tile, cols, cols,
                            up_bias == NULL ? NULL : up_bias + n0);
                    for (int64_t r = 0; r < rows; ++r) {
                        const float *g = gate_tile + r * cols, *u = up_tile + r * cols;
#pragma omp simd
                        for (int64_t i = 0; i < cols; ++i) {
                            o[r * ldo + i] = silu(g[i]) * u[i];
                        }
                    }
                }
                b += c;
            }
        }
    }
}

/* Both entry points: transpose x into scratch, then each thread takes an equal range of blocks. */
static void gemm(const float *x, int64_t ldx, const float *wp, const float *bias, const float *up,
                 const float *up_bias, float *out, int64_t ldo, int64_t m_dim, int64_t k_dim, int64_t n_dim,
                 float *scratch, int32_t num_threads)
{
    const int64_t tiles = (m_dim + BLOCK - 1) / BLOCK;
    const int64_t blocks = (n_dim + BLOCK - 1) / BLOCK;
    const int64_t bstride = k_dim * BLOCK;
    /* One row tile: a thread's whole range at once. Several: 4 blocks (<= 4 * K * 64 bytes, of
     * each half for a gated MLP) stay in cache while every row tile passes. */
    const int64_t chunk = tiles == 1 ? blocks : 4;
    const int threads = num_threads < 1 ? 1 : (int64_t)num_threads > blocks ? (int)blocks : num_threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t rows = m_dim - t * BLOCK < BLOCK ? m_dim - t * BLOCK : BLOCK;
            transpose_tile(x + t * BLOCK * ldx, ldx, scratch + t * bstride, rows, k_dim);
        }
        /* the implicit barrier of the loop above: every tile is transposed */
        const int64_t me = omp_get_thread_num(), team = omp_get_num_threads();
        const int64_t b0 = blocks * me / team, b1 = blocks * (me + 1) / team;
        column_range(scratch, wp, bias, up, up_bias, out, ldo, m_dim, k_dim, n_dim, b0, b1, chunk);
    }
}

/*
 * out[M, N] (row stride ldo) = x[M, K] (row stride ldx, unit stride in K) . W^T + bias (NULL: none;
 * else padded to a multiple of 16 floats), W packed as [ceil(N/16), K, 16]. scratch holds at least
 * ceil(M/16) * K * 16 floats. Each of num_threads OpenMP threads takes an equal range of column
 * blocks.
 */
void warmcap_gemm(const float *restrict x, int64_t ldx, const float *restrict wp, const float *restrict bias,
                  float *restrict out, int64_t ldo, int64_t m_dim, int64_t k_dim, int64_t n_dim,
                  float *restrict scratch, int32_t num_threads)
{
    gemm(x, ldx, wp, bias, NULL, NULL, out, ldo, m_dim, k_dim, n_dim, scratch, num_threads);
}

/*
 * out[M, I] (row stride ldo) = silu(x . Wg^T + bg) * (x . Wu^T + bu), the gate and up linears
 * packed as one weight of 2I output features (gate first; I a multiple of 16, so up's blocks start
 * at block I/16), bias NULL or padded as warmcap_gemm's. The gate and up products are the bits
 * warmcap_gemm gives them. scratch and threads as warmcap_gemm.
 */
void warmcap_gemm_silu_mul(const float *restrict x, int64_t ldx, const float *restrict wp,
                           const float *restrict bias, float *restrict out, int64_t ldo, int64_t m_dim,
                           int64_t k_dim, int64_t i_dim, float *restrict scratch, int32_t num_threads)
{
    const float *up = wp + i_dim * k_dim; /* I/16 blocks of K * 16 floats */
    gemm(x, ldx, wp, bias, up, bias == NULL ? NULL : bias + i_dim, out, ldo, m_dim, k_dim, i_dim, scratch,
         num_threads);
}
