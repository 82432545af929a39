/*
 * Paged attention on CPU over warmcap's KV cache, reading each key and value in its page.
 *
 * Layout (runner_v2/kv_cache.py): kv_cache is [2, num_blocks + 1, block_size, Hkv, D] float32,
 * contiguous; the last block is the sink, which no block table names. Query i of row r
 * (query length qlen = qsl[r + 1] - qsl[r]) sits at position seq_len - qlen + i and attends to
 * keys [max(0, pos - window + 1), pos] (window <= 0: no limit). Query head h reads KV head
 * h / (Hq / Hkv). Tokens of no position (pos < 0: rows of seq_len 0) and tokens past qsl[R]
 * (padding) get zeros.
 *
 * NOTE: only visible positions are ever loaded. A page's unread tail and a window's released
 * columns may hold anything (NaN from serve/poison.py, the null block), and must stay unread:
 * this is why the loops run over [lo, pos] instead of whole pages with a mask. (A prefetch is only a
 * hint: it never faults and no result reads what it fetched, so the next row's keys are prefetched
 * from position 0 whatever its window.)
 *
 * Built with -O3 -march=native -fopenmp but without -ffast-math: expf, NaN and inf keep their
 * IEEE meaning; the `omp simd` reductions are what lets the compiler reorder the dot products.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_nonpositive.h"
#include "paged_attention.h"

enum {
    WARMCAP_OK = 0,
    WARMCAP_BAD_SHAPE = 1,
    WARMCAP_BAD_BLOCK = 2,
    WARMCAP_NO_MEMORY = 3,
    WARMCAP_BAD_SLOT = 4,
};

/* Sixteen floats (GCC/Clang vector extension), and the vector the loops below work in: all sixteen
 * where one register holds them (AVX-512), else eight at a time. NOTE: GCC keeps a 16-float vector on
 * the stack on an AVX2 target, round-tripping every accumulator through memory and building each
 * broadcast from sixteen scalar stores (a store-forwarding stall per key): measured 50-55 ns a score
 * on an AVX2 EPYC. Eight-float vectors over the same lanes compute the same bits. */
typedef float v16f __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
#if defined(__AVX512F__)
typedef v16f vecf;
typedef int32_t veci __attribute__((vector_size(64)));
#define VL 16
#else
typedef v8f vecf;
typedef int32_t veci __attribute__((vector_size(32)));
#define VL 8
#endif

static inline vecf loadv(const float *p)
{
    vecf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/*
 * a . b over d elements. NOTE: sixteen partial sums added as a tree. An `omp simd reduction`
 * without -ffast-math keeps the order of the sum: the compiler folds the vector lane after lane,
 * a chain of sixteen dependent adds per key that dominated the kernel's time.
 */
static inline __attribute__((always_inline)) float dot(const float *a, const float *b, int32_t d)
{
    /* Lanes 0-15 of the sixteen partial sums, VL at a time. */
    vecf acc[16 / VL];
    for (int32_t i = 0; i < 16 / VL; ++i) {
        acc[i] = (vecf){0};
    }
    int32_t x = 0;
    for (; x + 16 <= d; x += 16) {
        for (int32_t i = 0; i < 16 / VL; ++i) {
            acc[i] += loadv(a + x + i * VL) * loadv(b + x + i * VL);
        }
    }
#if VL == 16
    v8f h8 = __builtin_shufflevector(acc[0], acc[0], 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(acc[0], acc[0], 8, 9, 10, 11, 12, 13, 14, 15);
#else
    v8f h8 = acc[0] + acc[1];
#endif
    v4f h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
    float s = (h4[0] + h4[2]) + (h4[1] + h4[3]);
    for (; x < d; ++x) {
        s += a[x] * b[x];
    }
    return s;
}

#if VL == 8
/*
 * Eight keys' scores at once: h8[t] holds key t's two accumulators added lane by lane, as dot()
 * has them before its horizontal sum; the sums are formed across the eight vectors with the very
 * additions dot() makes for each (lanes i and i + 4, then (0 + 2) + (1 + 3)), so every score has
 * the same bits, and land in one vector in key order, instead of a horizontal sum and a scalar
 * store per key and head. Measured (benchmarks/bench_cpu_attention.py, 8 rows x 550 keys, 4 / 2
 * heads, D 16, 1 thread, AVX2 EPYC): 128-137 us a call before, 117-120 with this, 109-119 with
 * this and the paired value sums below.
 */
static inline __attribute__((always_inline)) v8f hsum8(const v8f h8[8])
{
    /* keys (0, 4), (1, 5), (2, 6), (3, 7): [h4 of the first | h4 of the second] */
    v8f v[4];
    for (int32_t t = 0; t < 4; ++t) {
        v[t] = __builtin_shufflevector(h8[t], h8[t + 4], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(h8[t], h8[t + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
    /* (h4[0] + h4[2]), (h4[1] + h4[3]) of keys 0, 1 | 4, 5 and of keys 2, 3 | 6, 7 */
    const v8f w1 = __builtin_shufflevector(v[0], v[1], 0, 1, 8, 9, 4, 5, 12, 13) +
                   __builtin_shufflevector(v[0], v[1], 2, 3, 10, 11, 6, 7, 14, 15);
    const v8f w2 = __builtin_shufflevector(v[2], v[3], 0, 1, 8, 9, 4, 5, 12, 13) +
                   __builtin_shufflevector(v[2], v[3], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(w1, w2, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(w1, w2, 1, 3, 9, 11, 5, 7, 13, 15);
}
#endif

/* How many positions ahead the scores prefetch a row's keys (8: measured on SmolLM2's shapes, 16 rows of
 * 30-110 keys and 30 layers' caches, 1 thread: 219 -> 193 us a call median, the same bits). */
#define KEYS_AHEAD 8

/* Prefetch the `floats` floats at p (a hint: it never faults and reads nothing into a result, so a
 * page's unread tail may be prefetched safely), into L2 and beyond (locality 2). */
static inline void prefetch_floats(const float *p, int64_t floats)
{
    for (int64_t x = 0; x < floats; x += 16) {
        __builtin_prefetch(p + x, 0, 2);
    }
}

/* Prefetch position j of the next row's keys (its block table next_row, next_len positions), the
 * `floats` floats from `offset` in the token's row. */
static inline void prefetch_next_keys(const float *k_cache, const int32_t *next_row, int32_t next_len, int32_t j,
                                      int64_t num_blocks, int32_t block_size, int64_t token_stride, int64_t offset,
                                      int64_t floats)
{
    if (j < next_len) {
        const int32_t block = next_row[j / block_size];
        if (block >= 0 && block < num_blocks) {
            prefetch_floats(k_cache + ((int64_t)block * block_size + j % block_size) * token_stride + offset, floats);
        }
    }
}

/* While the scores read key j: its values (the value sums find them close by), and the keys
 * KEYS_AHEAD positions on (the hardware's stream stops at a page's end, and a row's first keys were
 * not fetched while the row before it summed its values). */
static inline __attribute__((always_inline)) void prefetch_position(const float *k_cache, const float *v_cache,
                                                                     const int64_t *key_at, int32_t j, int32_t n,
                                                                     int64_t head_floats)
{
    prefetch_floats(v_cache + key_at[j], head_floats);
    if (j + KEYS_AHEAD < n) {
        prefetch_floats(k_cache + key_at[j + KEYS_AHEAD], head_floats);
    }
}

/*
 * One query position of one row: the query heads of KV heads [hb, he). out and q point at the token's
 * head 0. The scores read each token's keys for all those heads at once, in position order, so a
 * page is streamed whole rather than once per head. Memory, not arithmetic, bounds a decode step
 * here (a layer's cache is far from the caches by the time the layer comes round again), hence the
 * prefetches: while the scores read K, the same tokens' V is fetched, which the value sums then
 * find close by; while they run, the next row's K (next_row, next_len: its block table and how many
 * positions to fetch; NULL, 0 for none).
 */
static inline __attribute__((always_inline)) int attend_position(
    float *out, const float *q, int64_t q_stride_h, const float *k_cache, const float *v_cache,
    const int32_t *table_row, int32_t cols, int64_t num_blocks, int32_t block_size, int64_t token_stride,
    int32_t hb, int32_t he, int32_t lo, int32_t pos, int32_t group, int32_t d, float scale, float *scores,
    float *acc, int64_t *key_at, const int32_t *next_row, int32_t next_len)
{
    const int32_t n = pos - lo + 1;
    const int32_t heads = (he - hb) * group;
    const int64_t head_floats = (int64_t)(he - hb) * d;
    if ((pos / block_size) >= cols) {
        return WARMCAP_BAD_SHAPE;
    }
    /* Where each key's heads [hb, he) start in a cache half (floats), once: the loops below read it
     * per key and per head, and a division by the block size per read cost more than the dot
     * products at small head sizes. Every block is checked before any is read. */
    {
        int32_t col = lo / block_size, off = lo % block_size;
        for (int32_t j = 0; j < n; ++j) {
            const int32_t block = table_row[col];
            if (block < 0 || block >= num_blocks) {
                return WARMCAP_BAD_BLOCK;
            }
            key_at[j] = ((int64_t)block * block_size + off) * token_stride + (int64_t)hb * d;
            if (++off == block_size) {
                off = 0;
                ++col;
            }
        }
    }
    /* Scores, [head][key]: each key is loaded once for every query head that reads it. */
    int32_t j8 = 0;
#if VL == 8
    if (d % 16 == 0 && d <= 32) {
        /* Eight keys at a time (hsum8), their accumulators formed as dot() forms them. */
        for (; j8 + 8 <= n; j8 += 8) {
            for (int32_t j = j8; j < j8 + 8; ++j) {
                prefetch_position(k_cache, v_cache, key_at, j, n, head_floats);
            }
            for (int32_t h = 0; h < he - hb; ++h) {
                for (int32_t g = 0; g < group; ++g) {
                    const int32_t head = h * group + g;
                    const float *qh = q + (int64_t)((hb + h) * group + g) * q_stride_h;
                    v8f h8[8];
                    for (int32_t t = 0; t < 8; ++t) {
                        const float *key = k_cache + key_at[j8 + t] + (int64_t)h * d;
                        v8f acc0 = (v8f){0}, acc1 = (v8f){0};
                        for (int32_t x = 0; x < d; x += 16) {
                            acc0 += loadv(qh + x) * loadv(key + x);
                            acc1 += loadv(qh + x + 8) * loadv(key + x + 8);
                        }
                        h8[t] = acc0 + acc1;
                    }
                    const v8f sc = hsum8(h8) * scale;
                    memcpy(scores + (int64_t)head * n + j8, &sc, sizeof sc);
                }
            }
        }
    }
#endif
    for (int32_t j = j8; j < n; ++j) {
        const int64_t slot = key_at[j];
        prefetch_position(k_cache, v_cache, key_at, j, n, head_floats);
        for (int32_t h = 0; h < he - hb; ++h) {
            const float *key = k_cache + slot + (int64_t)h * d;
            for (int32_t g = 0; g < group; ++g) {
                const int32_t head = h * group + g;
                scores[(int64_t)head * n + j] = dot(q + (int64_t)((hb + h) * group + g) * q_stride_h, key, d) * scale;
            }
        }
    }
    /* Softmax per head, max subtracted; weights stay unnormalised until the end. */
    float *inv_sum = acc + (int64_t)heads * d;
    for (int32_t head = 0; head < heads; ++head) {
        float *sg = scores + (int64_t)head * n;
        /* The largest score, lane by lane and then across the lanes. NOTE: the scalar loop's one
         * chain of dependent comparisons per key was a sixth of a long-context step. The result
         * is the scalar loop's: NaN when the first score is (no comparison with it succeeds),
         * else the largest non-NaN score; of equal largest scores +0 and -0 only may differ in
         * which one is kept, and e^(x - m) is the same for both. */
        float m = sg[0];
        int32_t i0 = 0;
        if (n >= 2 * VL) {
            vecf mv = (vecf){0} + m;
            for (; i0 + VL <= n; i0 += VL) {
                const vecf x = loadv(sg + i0);
                const veci more = x > mv;
                mv = (vecf)(((veci)x & more) | ((veci)mv & ~more));
            }
            float lanes[VL];
            memcpy(lanes, &mv, sizeof mv);
            for (int32_t i = 0; i < VL; ++i) {
                m = lanes[i] > m ? lanes[i] : m;
            }
        }
        for (; i0 < n; ++i0) {
            m = sg[i0] > m ? sg[i0] : m;
        }
        /* The weights as one map the compiler vectorises, then their sum in position order. NOTE: a
         * reduction in the same loop kept the whole loop scalar (a third of a long-context decode
         * step on an AVX2 EPYC); summed in order, the total is the same bits as before. */
        int32_t j = 0;
        for (; j + VL <= n; j += VL) {
            vecf e;
            WARMCAP_EXP_NONPOSITIVE_V(vecf, veci, loadv(sg + j) - m, e);
            memcpy(sg + j, &e, sizeof e);
        }
        for (; j < n; ++j) {
            sg[j] = exp_nonpositive(sg[j] - m);
        }
    }
    /* Each head's weights summed in position order, four heads at a time: four independent chains
     * of additions instead of one (the same order within each head, so the same bits). */
    {
        int32_t head = 0;
        for (; head + 4 <= heads; head += 4) {
            const float *s0 = scores + (int64_t)head * n, *s1 = s0 + n, *s2 = s1 + n, *s3 = s2 + n;
            float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
            for (int32_t j = 0; j < n; ++j) {
                t0 += s0[j];
                t1 += s1[j];
                t2 += s2[j];
                t3 += s3[j];
            }
            inv_sum[head] = 1.0f / t0;
            inv_sum[head + 1] = 1.0f / t1;
            inv_sum[head + 2] = 1.0f / t2;
            inv_sum[head + 3] = 1.0f / t3;
        }
        for (; head < heads; ++head) {
            const float *sg = scores + (int64_t)head * n;
            float sum = 0.0f;
            for (int32_t j = 0; j < n; ++j) {
                sum += sg[j];
            }
            inv_sum[head] = 1.0f / sum;
        }
    }
    if (d % 16 == 0 && d <= 256) {
        /* Values, head by head: the head's output row stays in registers while its value rows
         * stream by (from L1/L2 after the first head of the KV head has read them). */
        for (int32_t h = 0; h < he - hb; ++h) {
            int32_t g = 0;
            if (d <= 32) {
                /* Small heads: two query heads of the KV head at once, so twice d / VL chains of
                 * FMAs run side by side (at D 16 on AVX2 two chains a head left the loop waiting on
                 * FMA latency); each head's sum in the same order, so the same bits. */
                for (; g + 2 <= group; g += 2) {
                    const int32_t head = h * group + g;
                    const float *w0 = scores + (int64_t)head * n, *w1 = w0 + n;
                    vecf a0[32 / VL] = {{0}}, a1[32 / VL] = {{0}};
                    for (int32_t j = 0; j < n; ++j) {
                        const float *vh = v_cache + key_at[j] + (int64_t)h * d;
                        if (head == 0) {
                            prefetch_next_keys(k_cache, next_row, next_len, j, num_blocks, block_size,
                                               token_stride, (int64_t)hb * d, head_floats);
                        }
                        const float wj0 = w0[j], wj1 = w1[j];
                        for (int32_t c = 0; c < d / VL; ++c) {
                            const vecf vv = loadv(vh + VL * c);
                            a0[c] += wj0 * vv;
                            a1[c] += wj1 * vv;
                        }
                    }
                    float *og = out + (int64_t)(hb * group + head) * d;
                    for (int32_t c = 0; c < d / VL; ++c) {
                        const vecf o0 = a0[c] * inv_sum[head], o1 = a1[c] * inv_sum[head + 1];
                        memcpy(og + VL * c, &o0, sizeof o0);
                        memcpy(og + d + VL * c, &o1, sizeof o1);
                    }
                }
            }
            for (; g < group; ++g) {
                const int32_t head = h * group + g;
                const float *w = scores + (int64_t)head * n;
                vecf a[256 / VL];
                for (int32_t c = 0; c < d / VL; ++c) {
                    a[c] = (vecf){0};
                }
                for (int32_t j = 0; j < n; ++j) {
                    const float *vh = v_cache + key_at[j] + (int64_t)h * d;
                    if (head == 0) {
                        prefetch_next_keys(k_cache, next_row, next_len, j, num_blocks, block_size, token_stride,
                                           (int64_t)hb * d, head_floats);
                    }
                    const float wj = w[j];
                    for (int32_t c = 0; c < d / VL; ++c) {
                        a[c] += wj * loadv(vh + VL * c);
                    }
                }
                float *og = out + (int64_t)(hb * group + head) * d;
                for (int32_t c = 0; c < d / VL; ++c) {
                    const vecf o = a[c] * inv_sum[head];
                    memcpy(og + VL * c, &o, sizeof o);
                }
            }
        }
        return WARMCAP_OK;
    }
    /* Other head sizes: each value row is loaded once and added into every head's accumulator (in
     * L1). */
    memset(acc, 0, sizeof(float) * (size_t)heads * (size_t)d);
    for (int32_t j = 0; j < n; ++j) {
        const float *value = v_cache + key_at[j];
        prefetch_next_keys(k_cache, next_row, next_len, j, num_blocks, block_size, token_stride, (int64_t)hb * d,
                           head_floats);
        for (int32_t h = 0; h < he - hb; ++h) {
            const float *vh = value + (int64_t)h * d;
            for (int32_t g = 0; g < group; ++g) {
                const int32_t head = h * group + g;
                const float w = scores[(int64_t)head * n + j];
                float *ag = acc + (int64_t)head * d;
#pragma omp simd
                for (int32_t x = 0; x < d; ++x) {
                    ag[x] += w * vh[x];
                }
            }
        }
    }
    for (int32_t head = 0; head < heads; ++head) {
        const float *ag = acc + (int64_t)head * d;
        float *og = out + (int64_t)(hb * group + head) * d;
        const float r = inv_sum[head];
#pragma omp simd
        for (int32_t x = 0; x < d; ++x) {
            og[x] = ag[x] * r;
        }
    }
    return WARMCAP_OK;
}

/* attend_position with the common head sizes as constants, so their D-loops are fully unrolled. */
static int attend(
    float *out, const float *q, int64_t q_stride_h, const float *k_cache, const float *v_cache,
    const int32_t *table_row, int32_t cols, int64_t num_blocks, int32_t block_size, int64_t token_stride,
    int32_t hb, int32_t he, int32_t lo, int32_t pos, int32_t group, int32_t d, float scale, float *scores,
    float *acc, int64_t *key_at, const int32_t *next_row, int32_t next_len)
{
#define WARMCAP_ATTEND(D)                                                                                   \
    attend_position(out, q, q_stride_h, k_cache, v_cache, table_row, cols, num_blocks, block_size,          \
                    token_stride, hb, he, lo, pos, group, D, scale, scores, acc, key_at, next_row, next_len)
    switch (d) {
    case 16:
        return WARMCAP_ATTEND(16);
    case 32:
        return WARMCAP_ATTEND(32);
    case 64:
        return WARMCAP_ATTEND(64);
    case 128:
        return WARMCAP_ATTEND(128);
    default:
        return WARMCAP_ATTEND(d);
    }
#undef WARMCAP_ATTEND
}

/*
 * The version, size and field offsets of struct warmcap_pa_params, for the Python mirror to check
 * (paged_attention.h). Writes up to n entries to out; returns how many there are.
 */
#define WARMCAP_PA_FIELD(f) (int64_t) offsetof(struct warmcap_pa_params, f)
int32_t warmcap_paged_attention_layout(int64_t *out, int32_t n)
{
    const int64_t layout[] = {
        WARMCAP_PA_PARAMS_VERSION, (int64_t)sizeof(struct warmcap_pa_params),
        WARMCAP_PA_FIELD(out), WARMCAP_PA_FIELD(q), WARMCAP_PA_FIELD(q_stride_t), WARMCAP_PA_FIELD(q_stride_h),
        WARMCAP_PA_FIELD(kv_cache), WARMCAP_PA_FIELD(block_table), WARMCAP_PA_FIELD(seq_lens),
        WARMCAP_PA_FIELD(qsl), WARMCAP_PA_FIELD(num_tokens), WARMCAP_PA_FIELD(num_blocks), WARMCAP_PA_FIELD(cols),
        WARMCAP_PA_FIELD(num_reqs), WARMCAP_PA_FIELD(hq), WARMCAP_PA_FIELD(hkv), WARMCAP_PA_FIELD(d),
        WARMCAP_PA_FIELD(block_size), WARMCAP_PA_FIELD(window), WARMCAP_PA_FIELD(scale),
        WARMCAP_PA_FIELD(num_threads), WARMCAP_PA_FIELD(reserved), WARMCAP_PA_FIELD(k),
        WARMCAP_PA_FIELD(k_stride_t), WARMCAP_PA_FIELD(k_stride_h), WARMCAP_PA_FIELD(v),
        WARMCAP_PA_FIELD(v_stride_t), WARMCAP_PA_FIELD(v_stride_h), WARMCAP_PA_FIELD(slots),
        WARMCAP_PA_FIELD(num_writes),
    };
    const int32_t count = (int32_t)(sizeof layout / sizeof layout[0]);
    for (int32_t i = 0; i < count && i < n; ++i) {
        out[i] = layout[i];
    }
    return count;
}
#undef WARMCAP_PA_FIELD

/*
 * One call over the struct's arguments (paged_attention.h): out [T, Hq, D] contiguous (fully
 * written); q [T, Hq, D] with unit stride in D and the given token and head strides; block_table
 * [R, cols]; seq_lens [R]; qsl [R + 1]. k, v [num_writes, Hkv, D] (unit stride in D) are written at
 * slots [num_writes] first, unless k is NULL. Returns 0 or a WARMCAP_* error (a table naming a
 * block outside the cache, a position past the table's columns, a write slot outside the cache, no
 * memory).
 *
 * Work is split by row (all of a row's heads in one task, which reads its pages whole) when there are
 * at least as many rows as threads, else by (row, KV head) so that few rows still fill the threads.
 */
int warmcap_paged_attention(const struct warmcap_pa_params *p)
{
    float *out = p->out;
    const float *q = p->q;
    const int64_t q_stride_t = p->q_stride_t, q_stride_h = p->q_stride_h;
    const int32_t *block_table = p->block_table, *seq_lens = p->seq_lens, *qsl = p->qsl;
    const int32_t cols = p->cols, num_reqs = p->num_reqs, hq = p->hq, hkv = p->hkv, d = p->d;
    const int64_t num_tokens = p->num_tokens, num_blocks = p->num_blocks, num_writes = p->num_writes;
    const int32_t block_size = p->block_size, window = p->window, num_threads = p->num_threads;
    const float scale = p->scale;
    const float *k = p->k, *v = p->v;
    const int64_t k_stride_t = p->k_stride_t, k_stride_h = p->k_stride_h;
    const int64_t v_stride_t = p->v_stride_t, v_stride_h = p->v_stride_h;
    const int64_t *slots = p->slots;
    if (hkv <= 0 || hq % hkv != 0 || d <= 0 || block_size <= 0 || num_reqs < 0 || cols < 0 || num_writes < 0) {
        return WARMCAP_BAD_SHAPE;
    }
    const int32_t group = hq / hkv;
    const int64_t token_stride = (int64_t)hkv * d;
    float *k_cache = p->kv_cache;
    float *v_cache = p->kv_cache + num_blocks * block_size * token_stride;
    const int64_t real_tokens = num_reqs > 0 ? qsl[num_reqs] : 0;
    if (real_tokens < 0 || real_tokens > num_tokens) {
        return WARMCAP_BAD_SHAPE;
    }
    /* This step's keys and values first (k NULL: the caller wrote them), in token order, so that
     * tokens sharing a slot (padding, sent to the sink) leave the last one there, as index_copy_ does.
     * Every slot is checked before anything is written. */
    if (k != NULL) {
        for (int64_t t = 0; t < num_writes; ++t) {
            if (slots[t] < 0 || slots[t] >= num_blocks * block_size) {
                return WARMCAP_BAD_SLOT;
            }
        }
        for (int64_t t = 0; t < num_writes; ++t) {
            float *kd = k_cache + slots[t] * token_stride;
            float *vd = v_cache + slots[t] * token_stride;
            for (int32_t h = 0; h < hkv; ++h) {
                memcpy(kd + (int64_t)h * d, k + t * k_stride_t + h * k_stride_h, sizeof(float) * (size_t)d);
                memcpy(vd + (int64_t)h * d, v + t * v_stride_t + h * v_stride_h, sizeof(float) * (size_t)d);
            }
        }
    }
    /* Padding past the last row's span. */
    if (num_tokens > real_tokens) {
        memset(out + real_tokens * hq * d, 0, sizeof(float) * (size_t)((num_tokens - real_tokens) * hq * d));
    }
    /* The longest key span any query reads sizes each thread's score buffer. */
    int64_t max_keys = 1;
    for (int32_t r = 0; r < num_reqs; ++r) {
        int64_t span = seq_lens[r];
        if (window > 0 && span > window) {
            span = window;
        }
        max_keys = span > max_keys ? span : max_keys;
    }
    const int by_row = num_threads <= 1 || num_reqs >= num_threads;
    const int32_t task_heads = by_row ? hkv : 1;
    const int64_t tasks = by_row ? (int64_t)num_reqs : (int64_t)num_reqs * hkv;
    int status = WARMCAP_OK;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && tasks > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)((int64_t)task_heads * group * max_keys));
        float *acc = malloc(sizeof(float) * (size_t)((int64_t)task_heads * group * (d + 1)));
        int64_t *key_at = malloc(sizeof(int64_t) * (size_t)max_keys);
        int local = (scores == NULL || acc == NULL || key_at == NULL) ? WARMCAP_NO_MEMORY : WARMCAP_OK;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; ++task) {
            const int32_t r = by_row ? (int32_t)task : (int32_t)(task / hkv);
            const int32_t hb = by_row ? 0 : (int32_t)(task % hkv);
            const int32_t he = hb + task_heads;
            const int32_t start = qsl[r];
            const int32_t qlen = qsl[r + 1] - start;
            const int32_t seq = seq_lens[r];
            /* The next row's keys, fetched during this row's last query (row tasks only). */
            const int32_t *next_row = NULL;
            int32_t next_len = 0;
            if (by_row && r + 1 < num_reqs) {
                next_row = block_table + (int64_t)(r + 1) * cols;
                next_len = seq_lens[r + 1];
                next_len = next_len < 0 ? 0 : (next_len > cols * block_size ? cols * block_size : next_len);
            }
            for (int32_t i = 0; i < qlen; ++i) {
                const int64_t t = (int64_t)start + i;
                float *ot = out + t * hq * d;
                const int32_t pos = seq - qlen + i;
                if (pos < 0 || local != WARMCAP_OK) {
                    memset(ot + (int64_t)hb * group * d, 0, sizeof(float) * (size_t)(task_heads * group * d));
                    continue;
                }
                const int32_t lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
                const int last = i + 1 == qlen;
                local = attend(
                    ot, q + t * q_stride_t, q_stride_h, k_cache, v_cache, block_table + (int64_t)r * cols, cols,
                    num_blocks, block_size, token_stride, hb, he, lo, pos, group, d, scale, scores, acc, key_at,
                    last ? next_row : NULL, last ? next_len : 0);
            }
        }
        if (local != WARMCAP_OK) {
#pragma omp critical
            status = local;
        }
        free(scores);
        free(acc);
        free(key_at);
    }
    return status;
}
