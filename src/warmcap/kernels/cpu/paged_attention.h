/*
 * The one argument of warmcap_paged_attention (paged_attention.c): every pointer, shape and stride
 * of a call. paged_attention.py mirrors this struct once (ctypes.Structure) and checks the mirror
 * against warmcap_paged_attention_layout() when the library is loaded: bump
 * WARMCAP_PA_PARAMS_VERSION on any change here.
 */
#ifndef WARMCAP_PAGED_ATTENTION_H
#define WARMCAP_PAGED_ATTENTION_H

#include <stdint.h>

#define WARMCAP_PA_PARAMS_VERSION 1

struct warmcap_pa_params {
    float *out;                   /* [num_tokens, hq, d] contiguous, fully written */
    const float *q;               /* [num_tokens, hq, d], unit stride in d */
    int64_t q_stride_t;
    int64_t q_stride_h;
    float *kv_cache;              /* [2, num_blocks, block_size, hkv, d] contiguous (sink included) */
    const int32_t *block_table;   /* [num_reqs, cols] */
    const int32_t *seq_lens;      /* [num_reqs] */
    const int32_t *qsl;           /* [num_reqs + 1] query start locations */
    int64_t num_tokens;
    int64_t num_blocks;           /* blocks in the cache, sink included */
    int32_t cols;
    int32_t num_reqs;
    int32_t hq;                   /* query heads */
    int32_t hkv;                  /* KV heads */
    int32_t d;                    /* head size */
    int32_t block_size;
    int32_t window;               /* 0: none */
    float scale;
    int32_t num_threads;
    int32_t reserved;             /* 0 */
    const float *k;               /* [num_writes, hkv, d] to write first, unit stride in d; NULL: none */
    int64_t k_stride_t;
    int64_t k_stride_h;
    const float *v;               /* as k */
    int64_t v_stride_t;
    int64_t v_stride_h;
    const int64_t *slots;         /* [num_writes] cache slots of k and v */
    int64_t num_writes;
};

#endif
