// Causal prefill attention on CPU for bf16, with AVX-512 BF16 dot products: one sequence's
// new tokens over its cached prefix plus themselves, flash style (online softmax over key
// tiles of 64, the [S, S] scores never formed). The C twin of
// prefill_attention.prefill_attention_reference in the precision torch's own CPU flash
// kernel has for bf16: q.k products exact and summed in fp32, softmax in fp32, the
// probabilities rounded to bf16 for the product with V, summed in fp32, one rounding at
// the end. tests/engine/kernels/test_attention_cpu.py holds it to the reference.
//
//   q      [n, Hq, D] bf16, rows q_stride elements apart (heads D apart)
//   k, v   [n, Hkv, D] bf16, the new tokens' keys and values, rows k_stride / v_stride apart
//   caches [N, bs, Hkv, D] bf16 contiguous, read for the prefix through table[]
//   out    [n, Hq, D] bf16, rows out_stride apart
// New token i sits at position prefix + i and attends to keys 0 .. prefix + i.
// D must be a multiple of 32 (prefill_attention_bf16_available says whether it was built).

#include <stdlib.h>

#include "cpu_native.h"

int prefill_attention_bf16_available(void) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define KEYS 64  // keys per tile: four 16-lane registers of scores per query row
#define ROWS 6   // query rows per block: 6 x 4 score registers, the rest for the keys

// e^x on 16 lanes for x <= 0 (or -inf): Cody-Waite reduction, Cephes' polynomial, and
// scalef for the 2^n (so -inf gives 0).
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __m512bh broadcast_pair(const uint16_t *x) {  // x[0], x[1] into every lane
    int32_t pair;
    memcpy(&pair, x, 4);
    return (__m512bh)_mm512_set1_epi32(pair);
}

typedef struct {
    const uint16_t *q, *k, *v, *k_cache, *v_cache;
    const int32_t *table;
    int64_t q_stride, k_stride, v_stride, out_stride, n, prefix, Hq, Hkv, D, block_size;
    float scale;
    uint16_t *out;
    uint16_t *k_packed, *v_packed;  // [Hkv, tiles, KEYS * D] each, see pack_keys_values
    int64_t tiles;
} Prefill;

// Key j of KV head h: from the cache for the prefix, from k / v for the new tokens.
static inline const uint16_t *key_row(const Prefill *p, const uint16_t *cache,
                                      const uint16_t *fresh, int64_t fresh_stride, int64_t j,
                                      int64_t h) {
    if (j < p->prefix) {
        const int64_t block = p->table[j / p->block_size], row = j % p->block_size;
        return cache + ((block * p->block_size + row) * p->Hkv + h) * p->D;
    }
    return fresh + (j - p->prefix) * fresh_stride + h * p->D;
}

// Keys and values of each tile in the pair order the dot-product instruction reads:
//   keys   [h][tile][D / 2][KEYS][2 dims]: 16 keys' dims 2i, 2i + 1 per register
//   values [h][tile][KEYS / 2][D][2 keys]: 16 dims of keys 2i, 2i + 1 per register
// Keys past the sequence are zeros (their scores are masked anyway).
static void pack_keys_values(const Prefill *p, int64_t h) {
    const int64_t D = p->D, S = p->prefix + p->n;
    uint16_t *kp = p->k_packed + h * p->tiles * KEYS * D;
    uint16_t *vp = p->v_packed + h * p->tiles * KEYS * D;
    for (int64_t t = 0; t < p->tiles; t++)
        for (int64_t jj = 0; jj < KEYS; jj++) {
            const int64_t j = t * KEYS + jj;
            const uint16_t *kr = j < S ? key_row(p, p->k_cache, p->k, p->k_stride, j, h) : NULL;
            const uint16_t *vr = j < S ? key_row(p, p->v_cache, p->v, p->v_stride, j, h) : NULL;
            uint16_t *kt = kp + t * KEYS * D, *vt = vp + t * KEYS * D;
            for (int64_t d = 0; d < D; d++) {
                kt[(d / 2) * 2 * KEYS + jj * 2 + d % 2] = kr ? kr[d] : 0;
                vt[(jj / 2) * 2 * D + d * 2 + jj % 2] = vr ? vr[d] : 0;
            }
        }
}

// s[r][c] = dot products of query row r with the tile's keys 16c .. 16c + 15. Inlined with
// a literal row count, so the rows x 4 sums live in registers.
INLINE void query_key_dots(const int rows, const uint16_t *q, int64_t q_stride,
                           const uint16_t *keys, int64_t pairs, __m512 s[ROWS][4]) {
    __m512 acc[rows][4];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; i++) {
        const uint16_t *ki = keys + i * 2 * KEYS;
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(ki);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(ki + 32);
        const __m512bh k2 = (__m512bh)_mm512_loadu_si512(ki + 64);
        const __m512bh k3 = (__m512bh)_mm512_loadu_si512(ki + 96);
        for (int r = 0; r < rows; r++) {
            const __m512bh qp = broadcast_pair(q + r * q_stride + 2 * i);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qp, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qp, k1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], qp, k2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], qp, k3);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 4; c++) s[r][c] = acc[r][c];
}

// acc [rows][D] += probs [rows][KEYS] (bf16) times the tile's values, two rows at a time so
// each value register is read once for both; `chunks` = D / 16 sums per row in registers.
INLINE void add_probs_times_values(const int chunks, const uint16_t *probs0,
                                   const uint16_t *probs1, const uint16_t *values, int64_t D,
                                   float *acc0, float *acc1) {
    __m512 o0[chunks], o1[chunks];
    for (int c = 0; c < chunks; c++) {
        o0[c] = _mm512_loadu_ps(acc0 + 16 * c);
        o1[c] = acc1 ? _mm512_loadu_ps(acc1 + 16 * c) : _mm512_setzero_ps();
    }
    for (int64_t jp = 0; jp < KEYS / 2; jp++) {
        const __m512bh p0 = broadcast_pair(probs0 + 2 * jp);
        const __m512bh p1 = acc1 ? broadcast_pair(probs1 + 2 * jp) : p0;
        for (int c = 0; c < chunks; c++) {
            const __m512bh v = (__m512bh)_mm512_loadu_si512(values + jp * 2 * D + 32 * c);
            o0[c] = _mm512_dpbf16_ps(o0[c], p0, v);
            o1[c] = _mm512_dpbf16_ps(o1[c], p1, v);
        }
    }
    for (int c = 0; c < chunks; c++) {
        _mm512_storeu_ps(acc0 + 16 * c, o0[c]);
        if (acc1) _mm512_storeu_ps(acc1 + 16 * c, o1[c]);
    }
}

static void add_probs_times_values_any(int64_t chunks, const uint16_t *probs,
                                       const uint16_t *values, int64_t D, float *acc) {
    for (int64_t c = 0; c < chunks; c++) {
        __m512 o = _mm512_loadu_ps(acc + 16 * c);
        for (int64_t jp = 0; jp < KEYS / 2; jp++)
            o = _mm512_dpbf16_ps(o, broadcast_pair(probs + 2 * jp),
                                 (__m512bh)_mm512_loadu_si512(values + jp * 2 * D + 32 * c));
        _mm512_storeu_ps(acc + 16 * c, o);
    }
}

// Query rows [i0, i0 + rows) of q head `head` over every key tile they reach: scores, the
// online softmax (running max m and sum l per row), then the probabilities times V.
static void attend_block(const Prefill *p, int64_t head, int64_t i0, int64_t rows,
                         float *restrict acc /* [ROWS, D] */) {
    const int64_t D = p->D, pairs = D / 2, chunks = D / 16, h = head / (p->Hq / p->Hkv);
    const uint16_t *kp = p->k_packed + h * p->tiles * KEYS * D;
    const uint16_t *vp = p->v_packed + h * p->tiles * KEYS * D;
    const uint16_t *q = p->q + i0 * p->q_stride + head * D;
    float m[ROWS], l[ROWS];
    uint16_t probs[ROWS][KEYS];
    for (int64_t r = 0; r < ROWS; r++) m[r] = -INFINITY, l[r] = 0.0f;
    for (int64_t x = 0; x < ROWS * D; x++) acc[x] = 0.0f;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int64_t last = p->prefix + i0 + rows - 1;  // the furthest key any row sees
    for (int64_t t = 0; t * KEYS <= last; t++) {
        const uint16_t *kt = kp + t * KEYS * D, *vt = vp + t * KEYS * D;
        __m512 s[ROWS][4];
        if (rows == ROWS) query_key_dots(ROWS, q, p->q_stride, kt, pairs, s);
        else
            for (int64_t r = 0; r < rows; r++)
                query_key_dots(1, q + r * p->q_stride, p->q_stride, kt, pairs, s + r);
        for (int64_t r = 0; r < rows; r++) {
            const __m512i pos = _mm512_set1_epi32((int32_t)(p->prefix + i0 + r));
            __m512 top4 = _mm512_set1_ps(-INFINITY);
            for (int c = 0; c < 4; c++) {
                const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)(t * KEYS + 16 * c)));
                s[r][c] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY),
                                             _mm512_cmple_epi32_mask(key, pos), s[r][c],
                                             _mm512_set1_ps(p->scale));
                top4 = _mm512_max_ps(top4, s[r][c]);
            }
            const float top = _mm512_reduce_max_ps(top4);
            if (top == -INFINITY) {  // no key of this tile is visible to this row
                memset(probs[r], 0, sizeof probs[r]);
                continue;
            }
            if (top > m[r]) {  // a new maximum: rescale what is summed so far
                const float alpha = expf(m[r] - top);  // 0 for the first tile (m = -inf)
                l[r] *= alpha;
                float *a = acc + r * D;
                for (int64_t c = 0; c < chunks; c++)
                    _mm512_storeu_ps(a + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c),
                                                               _mm512_set1_ps(alpha)));
                m[r] = top;
            }
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < 4; c++) {
                const __m512 e = exp16(_mm512_sub_ps(s[r][c], _mm512_set1_ps(m[r])));
                sum = _mm512_add_ps(sum, e);
                const __m256bh rounded = _mm512_cvtneps_pbh(e);  // bf16, as torch's kernel
                memcpy(probs[r] + 16 * c, &rounded, 32);
            }
            l[r] += _mm512_reduce_add_ps(sum);
        }
        int64_t r = 0;
        for (; r + 2 <= rows; r += 2) {
            float *a0 = acc + r * D, *a1 = acc + (r + 1) * D;
            if (chunks == 4) add_probs_times_values(4, probs[r], probs[r + 1], vt, D, a0, a1);
            else if (chunks == 8) add_probs_times_values(8, probs[r], probs[r + 1], vt, D, a0, a1);
            else {
                add_probs_times_values_any(chunks, probs[r], vt, D, a0);
                add_probs_times_values_any(chunks, probs[r + 1], vt, D, a1);
            }
        }
        if (r < rows) add_probs_times_values_any(chunks, probs[r], vt, D, acc + r * D);
    }
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *o = p->out + (i0 + r) * p->out_stride + head * D;
        for (int64_t d = 0; d < D; d++) o[d] = float_to_bf16(acc[r * D + d] / l[r]);
    }
}
#endif

// Returns 0; -1 without the instructions or scratch memory; -2 for a D it does not take.
int prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                           int64_t k_stride, const uint16_t *v, int64_t v_stride,
                           const uint16_t *k_cache,
                           const uint16_t *v_cache, const int32_t *table, int64_t block_size,
                           int64_t n, int64_t prefix, int64_t Hq, int64_t Hkv, int64_t D,
                           float scale, uint16_t *out, int64_t out_stride, int threads) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    if (D % 32 != 0) return -2;
    const int64_t tiles = (prefix + n + KEYS - 1) / KEYS;
    uint16_t *packed = malloc(sizeof(uint16_t) * 2 * Hkv * tiles * KEYS * D);
    if (packed == NULL) return -1;
    Prefill p = {q, k, v, k_cache, v_cache, table, q_stride, k_stride, v_stride, out_stride, n, prefix,
                 Hq, Hkv, D, block_size, scale, out, packed, packed + Hkv * tiles * KEYS * D,
                 tiles};
    const int64_t blocks = (n + ROWS - 1) / ROWS;
    int failed = 0;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t h = 0; h < Hkv; h++) pack_keys_values(&p, h);
        float *acc = malloc(sizeof(float) * ROWS * D);
        if (acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        // Later query blocks see more keys: hand the work out round robin.
#pragma omp for schedule(static, 1)
        for (int64_t item = 0; item < blocks * Hq; item++) {
            const int64_t b = item / Hq, head = item % Hq;
            const int64_t rows = n - b * ROWS < ROWS ? n - b * ROWS : ROWS;
            if (acc != NULL) attend_block(&p, head, b * ROWS, rows, acc);
        }
        free(acc);
    }
    free(packed);
    return failed ? -1 : 0;
#else
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)k_cache;
    (void)v_cache;
    (void)table, (void)block_size, (void)n, (void)prefix, (void)Hq, (void)Hkv, (void)D;
    (void)scale, (void)out, (void)out_stride, (void)threads;
    return -1;
#endif
}
