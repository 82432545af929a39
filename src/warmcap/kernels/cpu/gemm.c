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
 * on this; tests/kernels/cpu/test_gemm.py checks it). The build uses -ffp-contract=fast
 * (build.py) so the multiply-add is fused on every CPU with FMA.
 */

#include <omp.h>
#include <stddef.h>
#include <stdint.h>

#include "exp_nonpositive.h"

#define BLOCK 16
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/*
 * The accumulator: one vector register of the target. A column block (16 floats) is PER_BLOCK of
 * them: one zmm on AVX-512, two ymm otherwise. NOTE: a 64-byte GCC vector on a target with 32-byte
 * registers is lowered through memory, and an array of them stays on the stack: every k then loads
 * and stores each accumulator.
 */
/*
 * WIDE: the AVX-512 tiling (16-float accumulators, the wide tile table). Chosen by the target, or
 * forced either way (build.py's WARMCAP_CPU_ISA): WARMCAP_WIDE_TILES builds the AVX-512 tiling for a
 * CPU without AVX-512 (GCC lowers each 16-float vector to two 8-float ones, and each output is still
 * the same one multiply-add chain), so any x86 machine can test the logic of both.
 */
#if defined(WARMCAP_WIDE_TILES) || (defined(__AVX512F__) && !defined(WARMCAP_NARROW_TILES))
#define WIDE 1
#else
#define WIDE 0
#endif

#if WIDE
#define LANES 16
#else
#define LANES 8
#endif

/*
 * How the weights ahead are prefetched: past every cache but L1 (0: a tile reads its block once) on
 * AVX-512. Where a row tile is split into sub-tiles (below), each re-reads the block, which must then
 * still be in L2 (2): measured on the AVX2 build, L2 prefetch ran the products of 12 SmolLM2 layers
 * 3-5x faster than the non-temporal one with the same tiles (BENCHMARKS.md).
 */
#if WIDE
#define WEIGHT_LOCALITY 0
#else
#define WEIGHT_LOCALITY 2
#endif
#define PER_BLOCK (BLOCK / LANES)
typedef float vec __attribute__((vector_size(LANES * 4)));
/* the same vector read from memory that may be only float-aligned (vmovups) */
typedef float vecu __attribute__((vector_size(LANES * 4), aligned(4)));

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
    /* Fixed sizes (R * C <= 16 blocks, C <= 8), not [R * C]: a variable-length array stays in memory. */
    vec acc[16 * PER_BLOCK];
    const int V = C * PER_BLOCK; /* vectors per row */
    for (int i = 0; i < R * V; ++i) {
        acc[i] = (vec){0};
    }
    for (int64_t k = 0; k < k_dim; ++k) {
        vec wv[8 * PER_BLOCK];
        for (int c = 0; c < C; ++c) {
            for (int h = 0; h < PER_BLOCK; ++h) {
                wv[c * PER_BLOCK + h] = *(const vecu *)(w + c * bstride + k * BLOCK + h * LANES);
            }
            __builtin_prefetch(w + c * bstride + (k + 16) * BLOCK, 0, WEIGHT_LOCALITY);
        }
        const float *xk = xt + k * BLOCK;
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const float xr = xk[r];
#pragma GCC unroll 16
            for (int j = 0; j < V; ++j) {
                acc[r * V + j] += xr * wv[j];
            }
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        float *o = out + r * ldo;
        for (int j = 0; j < V; ++j) {
            const int64_t n0 = (int64_t)j * LANES;
            if (n0 >= cols) {
                break;
            }
            vec v = acc[r * V + j];
            if (bias != NULL) {
                v += *(const vecu *)(bias + n0);
            }
            if (cols - n0 >= LANES) {
                __builtin_memcpy(o + n0, &v, sizeof v);
            } else {
                for (int64_t i = 0; i < cols - n0; ++i) {
                    o[n0 + i] = v[i];
                }
            }
        }
    }
}

/*
 * The register budget of a tile, chosen at compile time from the target's vector registers: R x C
 * accumulators of 16 floats, the C weight vectors of the current k and x[r, k] broadcast must all
 * stay in registers, or every k spills and reloads them (counted with objdump: BENCHMARKS.md).
 *
 * AVX-512 (32 zmm; a 16-float vector is one): R x C <= 16 accumulators and C <= 8, at most 25
 * registers; tiles of up to 16 rows.
 *
 * Otherwise (AVX2's 16 ymm, where a 16-float vector is two; NEON's 32 q registers, four): 2RC + 2C
 * + 1 <= 16 ymm, so R x C + C <= 7: tiles of at most 6 rows (C = 1), 2 rows x 2 blocks, or 1 row x 4
 * blocks (its weights are read once each, straight into the multiply-add, so they need no
 * register). A row tile of more rows is split into sub-tiles of equal height (16 = 5 + 5 + 6).
 */
#if WIDE
#define MAX_TILE_ROWS 16
static int max_blocks(int64_t rows)
{
    return rows <= 2 ? 8 : rows <= 4 ? 4 : rows <= 8 ? 2 : 1;
}
#else
#define MAX_TILE_ROWS 6
static int max_blocks(int64_t rows)
{
    return rows <= 1 ? 4 : rows <= 2 ? 2 : 1;
}
#endif

#define TILE_CASE(RR, CC)                                                                                       \
    case (RR) * 16 + (CC):                                                                                      \
        tile(xt, w, bstride, k_dim, out, ldo, rows, cols, bias, RR, CC);                                        \
        break;
#define TILE_CASES_8(RR) TILE_CASE(RR, 1) TILE_CASE(RR, 2) TILE_CASE(RR, 4) TILE_CASE(RR, 8)
#define TILE_CASES_4(RR) TILE_CASE(RR, 1) TILE_CASE(RR, 2) TILE_CASE(RR, 4)
#define TILE_CASES_2(RR) TILE_CASE(RR, 1) TILE_CASE(RR, 2)

/* A tile of exactly `rows` rows (R = rows: no padded rows are multiplied) against C blocks: the
 * (R, C) pairs max_blocks allows, and the narrower ones the end of a range may need. */
static void tile_rc(int64_t rows, int c_blocks, const float *xt, const float *w, int64_t bstride, int64_t k_dim,
                    float *out, int64_t ldo, int64_t cols, const float *bias)
{
    switch (rows * 16 + c_blocks) {
#if WIDE
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
#else
        TILE_CASES_4(1)
        TILE_CASES_2(2)
        TILE_CASE(3, 1)
        TILE_CASE(4, 1)
        TILE_CASE(5, 1)
        TILE_CASE(6, 1)
#endif
    default:
        break;
    }
}

/* How many sub-tiles a row tile of `rows` rows is split into (1 where it fits the budget). */
static int64_t sub_tiles(int64_t rows)
{
    return (rows + MAX_TILE_ROWS - 1) / MAX_TILE_ROWS;
}

/* tile_rc over a row tile of any height up to 16, as sub-tiles of equal height: the sub-tile of rows
 * [r0, r1) reads x[r0..r1) (at xt + r0: a tile keeps 16 rows per k) and writes out's rows r0..r1. */
static void tile_rows(int64_t rows, int c_blocks, const float *xt, const float *w, int64_t bstride,
                      int64_t k_dim, float *out, int64_t ldo, int64_t cols, const float *bias)
{
    const int64_t n = sub_tiles(rows);
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r0 = rows * i / n, r1 = rows * (i + 1) / n;
        tile_rc(r1 - r0, c_blocks, xt + r0, w, bstride, k_dim, out + r0 * ldo, ldo, cols, bias);
    }
}

/* silu(g) = g / (1 + e^-g), from e^-|g| only (never overflows): g / (1 + t) for g >= 0, and
 * g t / (1 + t) for g < 0, where t = e^g. NaN stays NaN. */
static inline __attribute__((always_inline)) float silu(float g)
{
    const float t = exp_nonpositive(g >= 0.0f ? -g : g);
    return (g >= 0.0f ? g : g * t) / (1.0f + t);
}

typedef int32_t veci __attribute__((vector_size(LANES * 4)));

/* silu on each lane, the scalar function's expressions with its selections as bit masks: every lane
 * has silu()'s bits. The scalar one's ternaries keep a loop over it scalar (exp_nonpositive.h), and
 * a prefill's 30 x M x 1536 SiLUs then cost a third of the gated MLP's multiply-adds. */
static inline __attribute__((always_inline)) vec silu_v(vec g)
{
    const veci nonneg = g >= (vec){0}; /* all ones where g >= 0; false for NaN */
    const vec neg = -g;
    const vec arg = (vec)(((veci)neg & nonneg) | ((veci)g & ~nonneg));
    vec t;
    WARMCAP_EXP_NONPOSITIVE_V(vec, veci, arg, t);
    const vec gt = g * t;
    const vec num = (vec)(((veci)g & nonneg) | ((veci)gt & ~nonneg));
    return num / (1.0f + t);
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
                int c = max_blocks((rows + sub_tiles(rows) - 1) / sub_tiles(rows));
                while (c > 1 && b + c > c1) {
                    c >>= 1;
                }
                const int64_t n0 = b * BLOCK;
                const int64_t cols = n_dim - n0 < (int64_t)c * BLOCK ? n_dim - n0 : (int64_t)c * BLOCK;
                float *o = out + t * BLOCK * ldo + n0;
                if (up == NULL) {
                    tile_rows(rows, c, xt, wp + b * bstride, bstride, k_dim, o, ldo, cols,
                            bias == NULL ? NULL : bias + n0);
                } else {
                    tile_rows(rows, c, xt, wp + b * bstride, bstride, k_dim, gate_tile, cols, cols,
                            bias == NULL ? NULL : bias + n0);
                    tile_rows(rows, c, xt, up + b * bstride, bstride, k_dim, up_tile, cols, cols,
                            up_bias == NULL ? NULL : up_bias + n0);
                    for (int64_t r = 0; r < rows; ++r) {
                        const float *g = gate_tile + r * cols, *u = up_tile + r * cols;
                        int64_t i = 0;
                        for (; i + LANES <= cols; i += LANES) {
                            const vec s = silu_v(*(const vecu *)(g + i)) * *(const vecu *)(u + i);
                            __builtin_memcpy(o + r * ldo + i, &s, sizeof s);
                        }
                        for (; i < cols; ++i) {
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

/* The accumulator width this library was built with: 16 for the AVX-512 tiling, 8 otherwise (the
 * forced-ISA tests check that WARMCAP_CPU_ISA reached the build). */
int warmcap_gemm_lanes(void)
{
    return LANES;
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
