// Paged decode attention on CPU: each sequence's one new query token over its cached K/V,
// read in place from the cache blocks its block table names (no gather copy, no mask).
// The C twin of decode_attention.decode_attention_reference; tests/engine/kernels/
// test_attention_cpu.py holds it to that.
//
//   q      [B, Hq, D]   rows q_stride elements apart, heads D apart; dtype q_dtype
//   caches [N, bs, Hkv, D] contiguous; dtype cache_dtype (fp8: scales [N, Hkv] fp32)
//   tables [B, W] int32, context_lens [B] int32
//   out    [B, Hq, D] contiguous, in q's dtype
//
// fp32 throughout -- scores, softmax, the weighted sum of V -- with one rounding at the end
// (torch's CPU flash kernel rounds the probabilities to bf16 for a bf16 cache; this is
// closer to exact). The G = Hq / Hkv query heads of a KV head share each K/V row read.
// With bf16 queries and cache on a CPU with AVX-512 BF16, q.k runs on the cached rows as
// they are, in the CPU's bf16 dot-product instruction (exact products, summed in fp32),
// 1.2-1.3x the fp32 copy's speed; a bf16 cache's values are read in place too, each row
// converted once for the G query heads of its KV head (the fp32 copy's sums, ~1.1x). Blocks lie anywhere in the cache, where the hardware's
// prefetchers cannot follow: the next block is asked for while one computes (~1.2x).

#include <stdlib.h>

#include "cpu_native.h"

#define LANES 16  // fp32 partial sums kept apart: vectorises without reassociating a sum

// 16 fp32 lanes (one AVX-512 register, two AVX ones): the accumulators stay in registers.
typedef float f32x16 __attribute__((vector_size(64)));

static inline f32x16 load16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, f32x16 v) { memcpy(p, &v, sizeof v); }

typedef int32_t i32x16 __attribute__((vector_size(64)));

// A fixed tree (lane l + lane l + 8, then + 4, + 2, + 1), so every call sums in the same
// order; shuffles within the register, so the accumulators never go through memory.
static inline float sum16(f32x16 v) {
    v += __builtin_shuffle(v, (i32x16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (i32x16){4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15});
    v += __builtin_shuffle(v, (i32x16){2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
    v += __builtin_shuffle(v, (i32x16){1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
    return v[0];
}

// Rows of one cache block (rows row_stride elements apart, `cols` values each) to fp32,
// `out_stride` apart.
#define CONVERT_ROWS(NAME, TYPE, LOAD)                                                       \
    static void NAME(const TYPE *restrict src, int64_t rows, int64_t row_stride,            \
                     int64_t cols, int64_t out_stride, float scale, float *restrict out) {  \
        for (int64_t r = 0; r < rows; r++)                                                  \
            for (int64_t c = 0; c < cols; c++)                                              \
                out[r * out_stride + c] = LOAD(src[r * row_stride + c]);                    \
        (void)scale;                                                                        \
    }

#define AS_FLOAT(v) ((float)(v))
#define FP8_SCALED(v) (from_e4m3(v) * scale)
CONVERT_ROWS(rows_f32, float, AS_FLOAT)
CONVERT_ROWS(rows_f16, uint16_t, fp16_to_float)
CONVERT_ROWS(rows_bf16, uint16_t, bf16_to_float)
CONVERT_ROWS(rows_fp8, uint8_t, FP8_SCALED)

static void rows_to_float(const void *src, int dtype, int64_t rows, int64_t row_stride,
                          int64_t cols, int64_t out_stride, float scale, float *out) {
    if (dtype == 0) rows_f32(src, rows, row_stride, cols, out_stride, scale, out);
    else if (dtype == 1) rows_f16(src, rows, row_stride, cols, out_stride, scale, out);
    else if (dtype == 2) rows_bf16(src, rows, row_stride, cols, out_stride, scale, out);
    else rows_fp8(src, rows, row_stride, cols, out_stride, scale, out);
}

// a . b over D fp32 values: 16 lanes, then their fixed tree, then a scalar tail.
static inline float dot(const float *restrict a, const float *restrict b, int64_t D) {
    f32x16 lanes = {0};
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES) lanes += load16(a + d) * load16(b + d);
    float sum = sum16(lanes);
    for (; d < D; d++) sum += a[d] * b[d];
    return sum;
}

// out[i] = a . b_i for the four rows b_i = b + i * stride, each summed as dot() does. Four
// independent sums, so the adds overlap instead of waiting on one another.
static inline void dot4(const float *restrict a, const float *restrict b, int64_t stride,
                        int64_t D, float *restrict out) {
    f32x16 l0 = {0}, l1 = {0}, l2 = {0}, l3 = {0};
    int64_t d = 0;
    for (; d + LANES <= D; d += LANES) {
        const f32x16 x = load16(a + d);
        l0 += x * load16(b + d);
        l1 += x * load16(b + stride + d);
        l2 += x * load16(b + 2 * stride + d);
        l3 += x * load16(b + 3 * stride + d);
    }
    float s0 = sum16(l0), s1 = sum16(l1), s2 = sum16(l2), s3 = sum16(l3);
    for (; d < D; d++) {
        s0 += a[d] * b[d];
        s1 += a[d] * b[stride + d];
        s2 += a[d] * b[2 * stride + d];
        s3 += a[d] * b[3 * stride + d];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

// out [D] += sum over r of p[r] * rows[r, :] (rows `stride` apart), rows in order. Four
// 16-column strips at a time, each summed in its own register, so the adds overlap.
static inline void weighted_rows(const float *restrict p, const float *restrict rows,
                                 int64_t stride, int64_t n, int64_t D, float *restrict out) {
    int64_t d = 0;
    for (; d + 4 * LANES <= D; d += 4 * LANES) {
        f32x16 a0 = load16(out + d), a1 = load16(out + d + LANES);
        f32x16 a2 = load16(out + d + 2 * LANES), a3 = load16(out + d + 3 * LANES);
        for (int64_t r = 0; r < n; r++) {
            const float *row = rows + r * stride + d;
            a0 += p[r] * load16(row);
            a1 += p[r] * load16(row + LANES);
            a2 += p[r] * load16(row + 2 * LANES);
            a3 += p[r] * load16(row + 3 * LANES);
        }
        store16(out + d, a0), store16(out + d + LANES, a1);
        store16(out + d + 2 * LANES, a2), store16(out + d + 3 * LANES, a3);
    }
    for (; d + LANES <= D; d += LANES) {
        f32x16 acc = load16(out + d);
        for (int64_t r = 0; r < n; r++) acc += p[r] * load16(rows + r * stride + d);
        store16(out + d, acc);
    }
    for (; d < D; d++) {
        float acc = out[d];
        for (int64_t r = 0; r < n; r++) acc += p[r] * rows[r * stride + d];
        out[d] = acc;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define BF16_SCORES 1

// s[t] = the sum of v[t]'s 16 lanes, for 16 vectors at once: 45 shuffles and adds where
// one horizontal sum each takes 8. The halving steps leave token 4j + k in lane 4k + j;
// the last permute puts each in its place.
static inline __m512 sum16_each(const __m512 v[16]) {
    __m512 c[8], e[4], h[2];
    for (int j = 0; j < 8; j++)  // 128-bit lanes 0-1: v[2j]'s halves summed, 2-3: v[2j+1]'s
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int m = 0; m < 4; m++)  // lane k: v[4m + k]'s four partial sums
        e[m] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * m], c[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * m], c[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int n = 0; n < 2; n++)  // lane k: two of v[8n + k]'s, two of v[8n + 4 + k]'s
        h[n] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * n], e[2 * n + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(e[2 * n], e[2 * n + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(h[0], h[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(h[0], h[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, sums);
}

// Scores of query heads [g0, g0 + G) (bf16 rows D apart from q) against one block's `rows`
// (<= 16) bf16 key rows of one KV head (`stride` elements apart), times `scale`, into
// out + g * out_stride: q.k in the CPU's bf16 dot-product instruction (exact products,
// summed in fp32 in pairs), 32 dims a step. D is a multiple of 32.
static void block_scores_bf16(const uint16_t *restrict q, int64_t G, const uint16_t *restrict k,
                              int64_t stride, int64_t rows, int64_t D, float scale,
                              float *restrict out, int64_t out_stride) {
    const __mmask16 valid = (__mmask16)((1u << rows) - 1);
    for (int64_t g = 0; g < G; g++) {
        const uint16_t *qg = q + g * D;
        __m512 part[16];
        for (int64_t r = 0; r < 16; r++) {
            __m512 acc = _mm512_setzero_ps();
            if (r < rows)
                for (int64_t d = 0; d < D; d += 32)
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qg + d),
                                           (__m512bh)_mm512_loadu_si512(k + r * stride + d));
            part[r] = acc;
        }
        const __m512 scores = _mm512_mul_ps(sum16_each(part), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(out + g * out_stride, valid, scores);
    }
}

// weighted_rows for the G query heads of one KV head at once, on n bf16 value rows read in
// place (`stride` elements apart): each row is converted once for all G heads, where G
// calls of weighted_rows would read an fp32 copy G times. Head g's weights are p + g *
// p_stride, its sums acc + g * D; each sum adds the same products in the same order as
// weighted_rows (a multiply, then an add), so the bits are the same. D is a multiple of 64.
INLINE void weighted_rows_bf16(const int G, const float *restrict p, int64_t p_stride,
                               const uint16_t *restrict rows, int64_t stride, int64_t n,
                               int64_t D, float *restrict acc) {
    for (int64_t d = 0; d < D; d += 64) {
        __m512 a[4][4];
        for (int g = 0; g < G; g++)
            for (int s = 0; s < 4; s++) a[g][s] = _mm512_loadu_ps(acc + g * D + d + 16 * s);
        for (int64_t r = 0; r < n; r++) {
            const uint16_t *row = rows + r * stride + d;
            const __m512 v0 = load16_bf16(row), v1 = load16_bf16(row + 16);
            const __m512 v2 = load16_bf16(row + 32), v3 = load16_bf16(row + 48);
            for (int g = 0; g < G; g++) {
                const __m512 w = _mm512_set1_ps(p[g * p_stride + r]);
                a[g][0] = _mm512_add_ps(a[g][0], _mm512_mul_ps(w, v0));
                a[g][1] = _mm512_add_ps(a[g][1], _mm512_mul_ps(w, v1));
                a[g][2] = _mm512_add_ps(a[g][2], _mm512_mul_ps(w, v2));
                a[g][3] = _mm512_add_ps(a[g][3], _mm512_mul_ps(w, v3));
            }
        }
        for (int g = 0; g < G; g++)
            for (int s = 0; s < 4; s++) _mm512_storeu_ps(acc + g * D + d + 16 * s, a[g][s]);
    }
}

// One block's values for every KV head of an item, the G query heads of each at once.
static void block_values_bf16(int64_t G, const float *scores, int64_t max_ctx,
                              const uint16_t *block, int64_t row, int64_t heads, int64_t rows,
                              int64_t D, float *acc) {
    for (int64_t hh = 0; hh < heads; hh++) {
        const float *p = scores + hh * G * max_ctx;
        const uint16_t *v = block + hh * D;
        float *a = acc + hh * G * D;
        if (G == 1) weighted_rows_bf16(1, p, max_ctx, v, row, rows, D, a);
        else if (G == 2) weighted_rows_bf16(2, p, max_ctx, v, row, rows, D, a);
        else if (G == 3) weighted_rows_bf16(3, p, max_ctx, v, row, rows, D, a);
        else weighted_rows_bf16(4, p, max_ctx, v, row, rows, D, a);
    }
}
#endif

// Ask for block i + 1 of a sequence's table (its rows of KV heads [h0, h0 + heads)), if
// there is one: read while block i computes. A sequence's blocks lie anywhere in the cache,
// so the hardware's prefetchers cannot guess them. Inlined: called, it cost the decode ~20%.
INLINE void prefetch_next_block(const void *cache, int dtype, const int32_t *table, int64_t i,
                                int64_t blocks, int64_t block_size, int64_t Hkv, int64_t D,
                                int64_t h0, int64_t heads) {
    if (i + 1 >= blocks) return;
    const size_t size = element_size(dtype);
    for (int64_t r = 0; r < block_size; r++) {
        const char *first =
            (const char *)cache + ((table[i + 1] * block_size + r) * Hkv + h0) * D * size;
        for (size_t byte = 0; byte < heads * D * size; byte += 64) __builtin_prefetch(first + byte);
    }
}

static void store_row(const float *restrict x, int dtype, int64_t D, void *dst) {
    if (dtype == 0) {
        float *o = dst;
        for (int64_t d = 0; d < D; d++) o[d] = x[d];
    } else if (dtype == 1) {
        uint16_t *o = dst;
        for (int64_t d = 0; d < D; d++) o[d] = float_to_fp16(x[d]);
    } else {
        uint16_t *o = dst;
        for (int64_t d = 0; d < D; d++) o[d] = float_to_bf16(x[d]);
    }
}

// exp(x) for x <= 0 (x = score - max), within ~2 ulp (cpu_native.h's exp_reduced). Below
// -87 (e^x under the smallest normal) it is 0.
static inline float exp_nonpositive(float x) {
    int32_t n;
    const float p = exp_reduced(x < -87.0f ? -87.0f : x, &n);
    const float two_n = float_of((uint32_t)(n + 127) << 23);
    return x < -87.0f ? 0.0f : p * two_n;
}

// Softmax of one query's scores s [n] in place; returns the sum of the exponentials (the
// caller divides the weighted sum of V by it once, as a flash kernel does).
static float softmax_numerators(float *restrict s, int64_t n) {
    // The maximum in 16 lanes (a chain of scalar compares would wait on itself); a max is
    // exact in any order, and a NaN in s[0] stays the result, as it would in one chain.
    float top_lane[LANES], top = s[0];
    for (int l = 0; l < LANES; l++) top_lane[l] = s[0];
    int64_t m = 0;
    for (; m + LANES <= n; m += LANES)
        for (int l = 0; l < LANES; l++)
            top_lane[l] = s[m + l] > top_lane[l] ? s[m + l] : top_lane[l];
    for (int l = 0; l < LANES; l++) top = top_lane[l] > top ? top_lane[l] : top;
    for (; m < n; m++) top = s[m] > top ? s[m] : top;
    for (int64_t j = 0; j < n; j++) s[j] = exp_nonpositive(s[j] - top);
    float lane[LANES] = {0}, sum = 0.0f;
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += s[j + l];
    for (int l = 0; l < LANES; l++) sum += lane[l];
    for (; j < n; j++) sum += s[j];
    return sum;
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    const float *k_scale, *v_scale;
    const int32_t *tables, *context_lens;
    int64_t q_stride, table_width, Hq, Hkv, D, block_size, max_ctx;
    int q_dtype, cache_dtype;
    float softmax_scale;
    void *out;
} Problem;

// Floats of scratch one (sequence, `heads` KV heads) item needs: scores [heads * G,
// max_ctx], queries and accumulators [heads * G, D], one block's rows of those heads as fp32
// [bs, heads * D].
static int64_t scratch_floats(const Problem *p, int64_t heads) {
    const int64_t G = p->Hq / p->Hkv;
    return heads * (G * p->max_ctx + 2 * G * p->D + p->block_size * p->D);
}

// One block's rows of KV heads [h0, h0 + heads) as fp32: head h's rows start at the result +
// (h - h0) * D, `*stride` elements apart. An fp32 cache is read in place, any other converted
// into `buffer` in one pass over the block's contiguous rows (a head at a time reads pieces
// 1 / Hkv of a row apart: measured ~20% slower at smollm2-135m's 3 KV heads).
static const float *block_rows(const Problem *p, const void *cache, const float *scales,
                               int64_t id, int64_t h0, int64_t heads, int64_t rows,
                               float *buffer, int64_t *stride) {
    const int64_t row = p->Hkv * p->D, start = id * p->block_size * row + h0 * p->D;
    if (p->cache_dtype == 0) {
        *stride = row;
        return (const float *)cache + start;
    }
    const size_t size = element_size(p->cache_dtype);
    *stride = heads * p->D;
    if (p->cache_dtype != 3) {
        rows_to_float((const char *)cache + start * size, p->cache_dtype, rows, row,
                      heads * p->D, *stride, 1.0f, buffer);
        return buffer;
    }
    for (int64_t h = 0; h < heads; h++)  // fp8: a scale per head
        rows_to_float((const char *)cache + (start + h * p->D) * size, p->cache_dtype, rows, row,
                      p->D, *stride, scales[id * p->Hkv + h0 + h], buffer + h * p->D);
    return buffer;
}

// Scores of sequence b's query heads of KV heads [h0, h0 + heads) over its context, times
// the softmax scale, into scores [heads * G, max_ctx]: q and each block's keys as fp32
// (`qf` [heads * G, D] and `buffer` the caller's scratch).
static void key_scores(const Problem *p, int64_t b, int64_t h0, int64_t heads, float *qf,
                       float *buffer, float *scores) {
    const int64_t G = p->Hq / p->Hkv, D = p->D, bs = p->block_size, Q = heads * G;
    const int64_t ctx = p->context_lens[b], blocks = (ctx + bs - 1) / bs;
    const int32_t *table = p->tables + b * p->table_width;
    rows_to_float((const char *)p->q + (b * p->q_stride + h0 * G * D) * element_size(p->q_dtype),
                  p->q_dtype, Q, D, D, D, 1.0f, qf);  // [Q, D]
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t first = i * bs, rows = ctx - first < bs ? ctx - first : bs;
        int64_t stride;
        prefetch_next_block(p->k_cache, p->cache_dtype, table, i, blocks, bs, p->Hkv, D, h0,
                            heads);
        const float *k = block_rows(p, p->k_cache, p->k_scale, table[i], h0, heads, rows,
                                    buffer, &stride);
        for (int64_t g = 0; g < Q; g++) {
            const float *kh = k + (g / G) * D;  // query head g's KV head
            float *sg = scores + g * p->max_ctx + first;
            int64_t r = 0;
            for (; r + 4 <= rows; r += 4) dot4(qf + g * D, kh + r * stride, stride, D, sg + r);
            for (; r < rows; r++) sg[r] = dot(qf + g * D, kh + r * stride, D);
            for (r = 0; r < rows; r++) sg[r] *= p->softmax_scale;
        }
    }
}

#ifdef BF16_SCORES
// key_scores for bf16 queries and cache (D a multiple of 32, blocks of at most 16): the
// products straight from the cached rows, no fp32 copy.
static void key_scores_bf16(const Problem *p, int64_t b, int64_t h0, int64_t heads,
                            float *scores) {
    const int64_t G = p->Hq / p->Hkv, D = p->D, bs = p->block_size, row = p->Hkv * D;
    const int64_t ctx = p->context_lens[b], blocks = (ctx + bs - 1) / bs;
    const int32_t *table = p->tables + b * p->table_width;
    const uint16_t *q = (const uint16_t *)p->q + b * p->q_stride + h0 * G * D;
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t first = i * bs, rows = ctx - first < bs ? ctx - first : bs;
        const uint16_t *block = (const uint16_t *)p->k_cache + table[i] * bs * row;
        prefetch_next_block(p->k_cache, p->cache_dtype, table, i, blocks, bs, p->Hkv, D, h0,
                            heads);
        for (int64_t hh = 0; hh < heads; hh++)
            block_scores_bf16(q + hh * G * D, G, block + (h0 + hh) * D, row, rows, D,
                              p->softmax_scale, scores + hh * G * p->max_ctx + first,
                              p->max_ctx);
    }
}
#endif

// The G query heads of each KV head [h0, h0 + heads) of sequence b over its context; each
// head's sums in the same order whatever `heads` is, so the bits do not depend on it.
static void attend(const Problem *p, int64_t b, int64_t h0, int64_t heads, float *scratch) {
    const int64_t G = p->Hq / p->Hkv, D = p->D, bs = p->block_size, max_ctx = p->max_ctx;
    const int64_t Q = heads * G;  // query heads of this item
    const int64_t ctx = p->context_lens[b], blocks = (ctx + bs - 1) / bs;
    const int32_t *table = p->tables + b * p->table_width;
    const size_t q_size = element_size(p->q_dtype);
    float *scores = scratch, *qf = scores + Q * max_ctx, *acc = qf + Q * D, *buffer = acc + Q * D;
    char *out = (char *)p->out + (b * p->Hq + h0 * G) * D * q_size;
    for (int64_t x = 0; x < Q * D; x++) acc[x] = 0.0f;
    if (ctx <= 0) {  // nothing to attend to: zeros, as the reference gives
        for (int64_t g = 0; g < Q; g++) store_row(acc, p->q_dtype, D, out + g * D * q_size);
        return;
    }
#ifdef BF16_SCORES
    if (p->cache_dtype == 2 && p->q_dtype == 2 && D % 32 == 0 && bs <= 16)
        key_scores_bf16(p, b, h0, heads, scores);
    else
#endif
        key_scores(p, b, h0, heads, qf, buffer, scores);
    float total[Q];
    for (int64_t g = 0; g < Q; g++) total[g] = softmax_numerators(scores + g * max_ctx, ctx);
#ifdef BF16_SCORES
    const int values_bf16 = p->cache_dtype == 2 && D % 64 == 0 && G <= 4;
#endif
    for (int64_t i = 0; i < blocks; i++) {
        const int64_t first = i * bs, rows = ctx - first < bs ? ctx - first : bs;
        int64_t stride;
        prefetch_next_block(p->v_cache, p->cache_dtype, table, i, blocks, bs, p->Hkv, D, h0,
                            heads);
#ifdef BF16_SCORES
        if (values_bf16) {
            const int64_t row = p->Hkv * D;
            const uint16_t *block = (const uint16_t *)p->v_cache + table[i] * bs * row + h0 * D;
            block_values_bf16(G, scores + first, max_ctx, block, row, heads, rows, D, acc);
            continue;
        }
#endif
        const float *v = block_rows(p, p->v_cache, p->v_scale, table[i], h0, heads, rows,
                                    buffer, &stride);
        for (int64_t g = 0; g < Q; g++)
            weighted_rows(scores + g * max_ctx + first, v + (g / G) * D, stride, rows, D,
                          acc + g * D);
    }
    for (int64_t g = 0; g < Q; g++) {
        float *a = acc + g * D;
        for (int64_t d = 0; d < D; d++) a[d] = a[d] / total[g];
        store_row(a, p->q_dtype, D, out + g * D * q_size);
    }
}

// Returns 0, or -1 when its scratch memory cannot be had. The (sequence, KV head) pairs
// are shared among `threads` OpenMP threads: the caller passes torch's intra-op count
// (built with -fopenmp, the library binds to the libgomp torch has loaded). Never OpenMP's
// default: that is per calling thread, the machine's core count in a thread torch did not
// set up, and an idle team spins on the cores a serving process needs for its other work.
int paged_decode_attention(const void *q, int q_dtype, int64_t q_stride, const void *k_cache,
                           const void *v_cache, int cache_dtype, const float *k_scale,
                           const float *v_scale, const int32_t *tables, int64_t table_width,
                           const int32_t *context_lens, int64_t B, int64_t Hq, int64_t Hkv,
                           int64_t D, int64_t block_size, float softmax_scale, void *out,
                           int threads) {
    int64_t max_ctx = 1;
    for (int64_t b = 0; b < B; b++) max_ctx = context_lens[b] > max_ctx ? context_lens[b] : max_ctx;
    const Problem p = {q, k_cache, v_cache, k_scale, v_scale, tables, context_lens, q_stride,
                       table_width, Hq, Hkv, D, block_size, max_ctx, q_dtype, cache_dtype,
                       softmax_scale, out};
    // Work items: whole sequences (every KV head: each block read in one pass) when there
    // are enough of them to share among the threads, else (sequence, KV head) pairs.
    const int64_t heads = B >= 2 * (int64_t)threads ? Hkv : 1, per_seq = Hkv / heads;
    int failed = 0;
    (void)threads;  // unused when built without OpenMP
#pragma omp parallel num_threads(threads) if (threads > 1 && B * per_seq > 1)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats(&p, heads));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < B * per_seq; item++)
            if (scratch != NULL)
                attend(&p, item / per_seq, (item % per_seq) * heads, heads, scratch);
        free(scratch);
    }
    return failed ? -1 : 0;
}
