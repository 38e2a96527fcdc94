// FP8 e4m3 codec for whole KV blocks on CPU: the C twin of kv_codec.py's torch reference,
// bit for bit (tests/engine/kernels/test_kv_codec_cpu.py holds it to that).
//
// Blocks are contiguous [n, block_size, heads, head_dim]; one float32 scale per (block, head):
// scale = max(amax, 1e-12) / 448, q = e4m3(clamp(x / scale, -448, 448)), x' = (q * scale).
// The same IEEE operations as torch, in the same order: build without -ffast-math and with
// -ffp-contract=off, so neither the division nor the rounding tricks below are rewritten.
// dtype codes as in cpu_native.h (0 = float32, 1 = float16, 2 = bfloat16).

#include "cpu_native.h"

// 16 lanes at a time where AVX-512 is there and a head is whole vectors: the same integer and
// IEEE operations as the scalar functions below, lane by lane (the compiler's own
// vectorisation of the scalar loops ran at ~2 GB/s quantising bf16 here).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512CD__) && \
    defined(__AVX512BF16__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define CODEC_LANES 1

// 16 elements of a dtype-0/1/2 row as fp32 (exact conversions, as LOAD below).
INLINE __m512 load16_as_float(const int dtype, const void *p) {
    if (dtype == 0) return _mm512_loadu_ps(p);
    if (dtype == 1) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    return load16_bf16(p);
}

// to_e4m3 on 16 lanes (values already clamped to +-448 or NaN), as bytes.
static inline __m128i to16_e4m3(__m512 y) {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32((int)0x80000000u));
    const __m512i f = _mm512_xor_si512(bits, sign);
    const __m512i denorm = _mm512_set1_epi32(141 << 23);
    const __m512i subnormal = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(f), _mm512_castsi512_ps(denorm))),
        denorm);
    const __m512i round_bit = _mm512_and_si512(_mm512_srli_epi32(f, 20), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFF));
    const __m512i normal =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(f, bias), round_bit), 20);
    const __mmask16 small = _mm512_cmplt_epu32_mask(f, _mm512_set1_epi32(121 << 23));
    const __mmask16 big = _mm512_cmpge_epu32_mask(f, _mm512_set1_epi32(1087 << 20));
    __m512i result = _mm512_mask_blend_epi32(small, normal, subnormal);
    result = _mm512_mask_blend_epi32(big, result, _mm512_set1_epi32(0x7f));
    result = _mm512_or_si512(_mm512_and_si512(result, _mm512_set1_epi32(0xFF)),
                             _mm512_srli_epi32(sign, 24));
    return _mm512_cvtepi32_epi8(result);
}

// from_e4m3 on 16 bytes.
static inline __m512 from16_e4m3(const uint8_t *q) {
    const __m512i w = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q)), 24);
    const __m512i sign = _mm512_and_si512(w, _mm512_set1_epi32((int)0x80000000u));
    const __m512i nonsign = _mm512_and_si512(w, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i shift = _mm512_max_epi32(  // lzcnt gives 32 for 0, as the scalar's branch
        _mm512_sub_epi32(_mm512_lzcnt_epi32(nonsign), _mm512_set1_epi32(4)),
        _mm512_setzero_si512());
    const __m512i inf_nan = _mm512_and_si512(
        _mm512_srai_epi32(_mm512_add_epi32(nonsign, _mm512_set1_epi32(0x01000000)), 8),
        _mm512_set1_epi32(0x7F800000));
    const __m512i zero = _mm512_srai_epi32(_mm512_sub_epi32(nonsign, _mm512_set1_epi32(1)), 31);
    const __m512i normal = _mm512_add_epi32(
        _mm512_srli_epi32(_mm512_sllv_epi32(nonsign, shift), 4),
        _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(0x78), shift), 23));
    return _mm512_castsi512_ps(_mm512_or_si512(
        sign, _mm512_andnot_si512(zero, _mm512_or_si512(normal, inf_nan))));
}

// One (block, head) row group of quantize, D a multiple of 16: the amax bits, then q.
INLINE uint32_t amax_bits16(const int dtype, const char *x, int64_t rows, int64_t row_bytes,
                            int64_t D) {
    const size_t size = element_size(dtype);
    __m512i top = _mm512_setzero_si512();
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    for (int64_t t = 0; t < rows; t++)
        for (int64_t d = 0; d < D; d += 16) {
            const __m512 v = load16_as_float(dtype, x + t * row_bytes + d * size);
            top = _mm512_max_epu32(top, _mm512_and_si512(_mm512_castps_si512(v), magnitude));
        }
    return _mm512_reduce_max_epu32(top);
}

INLINE void quantize16(const int dtype, const char *x, int64_t rows, int64_t row_bytes,
                       int64_t D, float s, uint8_t *q, int64_t q_row) {
    const size_t size = element_size(dtype);
    const __m512 scale = _mm512_set1_ps(s), hi = _mm512_set1_ps(448.0f);
    const __m512 lo = _mm512_set1_ps(-448.0f);
    for (int64_t t = 0; t < rows; t++)
        for (int64_t d = 0; d < D; d += 16) {
            __m512 y = _mm512_div_ps(load16_as_float(dtype, x + t * row_bytes + d * size), scale);
            y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(y, hi, _CMP_GT_OQ), hi);
            y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(y, lo, _CMP_LT_OQ), lo);
            _mm_storeu_si128((__m128i *)(q + t * q_row + d), to16_e4m3(y));
        }
}
#else
#define CODEC_LANES 0
#endif

// A whole block through the 16-lane path (the scale as the scalar code computes it); 0 where
// it does not apply (no AVX-512 here, a head not whole vectors).
INLINE int quantize_block_lanes(const int dtype, const void *xb, int64_t block_size,
                                int64_t heads, int64_t head_dim, uint8_t *qb, float *sb) {
#if CODEC_LANES
    if (head_dim % 16) return 0;
    const size_t size = element_size(dtype);
    const int64_t row = heads * head_dim;
    for (int64_t h = 0; h < heads; h++) {
        const char *x = (const char *)xb + h * head_dim * size;
        const float a = float_of(amax_bits16(dtype, x, block_size, row * size, head_dim));
        sb[h] = (a != a ? a : (a < 1e-12f ? 1e-12f : a)) / 448.0f; /* keeps NaN */
        quantize16(dtype, x, block_size, row * size, head_dim, sb[h], qb + h * head_dim, row);
    }
    return 1;
#else
    (void)dtype, (void)xb, (void)block_size, (void)heads, (void)head_dim, (void)qb, (void)sb;
    return 0;
#endif
}

// One function per source dtype (LOAD reads element i as fp32), so each inner loop is one
// straight vectorisable body.
#define QUANTIZE(NAME, TYPE, DTYPE, LOAD)                                                   \
    static void NAME(const TYPE *restrict x, int64_t n, int64_t block_size, int64_t heads, \
                     int64_t head_dim, uint8_t *restrict q, float *restrict scale) {       \
        const int64_t row = heads * head_dim, block = block_size * row;                    \
        uint32_t top[heads];                                                               \
        for (int64_t b = 0; b < n; b++) {                                                  \
            const TYPE *xb = x + b * block;                                                \
            uint8_t *qb = q + b * block;                                                   \
            float *sb = scale + b * heads;                                                 \
            if (quantize_block_lanes(DTYPE, xb, block_size, heads, head_dim, qb, sb))       \
                continue;                                                                  \
            /* |v| as bits orders like |v|, NaN above inf: their integer max is the amax, \
               NaN when any is (as torch's amax), and it vectorises */                     \
            for (int64_t h = 0; h < heads; h++) top[h] = 0;                                \
            for (int64_t t = 0; t < block_size; t++)                                       \
                for (int64_t h = 0; h < heads; h++) {                                      \
                    const TYPE *p = xb + t * row + h * head_dim;                           \
                    uint32_t m = top[h];                                                   \
                    for (int64_t d = 0; d < head_dim; d++) {                               \
                        const uint32_t v = bits_of(LOAD(p[d])) & UINT32_C(0x7FFFFFFF);     \
                        m = v > m ? v : m;                                                 \
                    }                                                                      \
                    top[h] = m;                                                            \
                }                                                                          \
            for (int64_t h = 0; h < heads; h++) {                                          \
                const float a = float_of(top[h]);                                          \
                sb[h] = (a != a ? a : (a < 1e-12f ? 1e-12f : a)) / 448.0f; /* keeps NaN */ \
            }                                                                              \
            for (int64_t t = 0; t < block_size; t++)                                       \
                for (int64_t h = 0; h < heads; h++) {                                      \
                    const TYPE *p = xb + t * row + h * head_dim;                           \
                    uint8_t *o = qb + t * row + h * head_dim;                              \
                    const float s = sb[h];                                                 \
                    for (int64_t d = 0; d < head_dim; d++) {                               \
                        float y = LOAD(p[d]) / s;                                          \
                        y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y);             \
                        o[d] = to_e4m3(y);                                                 \
                    }                                                                      \
                }                                                                          \
        }                                                                                  \
    }

#define AS_FLOAT(v) ((float)(v))
QUANTIZE(quantize_f32, float, 0, AS_FLOAT)
QUANTIZE(quantize_f16, uint16_t, 1, fp16_to_float)
QUANTIZE(quantize_bf16, uint16_t, 2, bf16_to_float)

void quantize_kv_blocks(const void *x, int dtype, int64_t n, int64_t block_size, int64_t heads,
                        int64_t head_dim, uint8_t *q, float *scale) {
    if (dtype == 0) quantize_f32(x, n, block_size, heads, head_dim, q, scale);
    else if (dtype == 1) quantize_f16(x, n, block_size, heads, head_dim, q, scale);
    else quantize_bf16(x, n, block_size, heads, head_dim, q, scale);
}

// Rows of D (a multiple of 16) through the 16-lane path into fp32 (dtype 0) or bf16 (2)
// outputs; 0 where it does not apply (fp16 outputs keep the scalar loop: NaN bits as c10's).
INLINE int dequantize_row_lanes(const int dtype, const uint8_t *q, float s, int64_t D,
                                void *out) {
#if CODEC_LANES
    if (D % 16 || dtype == 1) return 0;
    const __m512 scale = _mm512_set1_ps(s);
    for (int64_t d = 0; d < D; d += 16) {
        const __m512 x = _mm512_mul_ps(from16_e4m3(q + d), scale);
        if (dtype == 0) _mm512_storeu_ps((float *)out + d, x);
        else _mm256_storeu_si256((__m256i *)((uint16_t *)out + d), to16_bf16(x));
    }
    return 1;
#else
    (void)dtype, (void)q, (void)s, (void)D, (void)out;
    return 0;
#endif
}

#define DEQUANTIZE(NAME, TYPE, DTYPE, STORE)                                                \
    static void NAME(const uint8_t *q, const float *scale, int64_t n, int64_t block_size,  \
                     int64_t heads, int64_t head_dim, TYPE *out) {                         \
        const int64_t row = heads * head_dim, block = block_size * row;                    \
        for (int64_t b = 0; b < n; b++)                                                    \
            for (int64_t t = 0; t < block_size; t++)                                       \
                for (int64_t h = 0; h < heads; h++) {                                      \
                    const float s = scale[b * heads + h];                                  \
                    const int64_t start = b * block + t * row + h * head_dim;              \
                    if (dequantize_row_lanes(DTYPE, q + start, s, head_dim, out + start))  \
                        continue;                                                          \
                    for (int64_t d = 0; d < head_dim; d++)                                 \
                        out[start + d] = STORE(from_e4m3(q[start + d]) * s);              \
                }                                                                          \
    }

DEQUANTIZE(dequantize_f32, float, 0, AS_FLOAT)
DEQUANTIZE(dequantize_f16, uint16_t, 1, float_to_fp16)
DEQUANTIZE(dequantize_bf16, uint16_t, 2, float_to_bf16)

void dequantize_kv_blocks(const uint8_t *q, const float *scale, int64_t n, int64_t block_size,
                          int64_t heads, int64_t head_dim, void *out, int dtype) {
    if (dtype == 0) dequantize_f32(q, scale, n, block_size, heads, head_dim, out);
    else if (dtype == 1) dequantize_f16(q, scale, n, block_size, heads, head_dim, out);
    else dequantize_bf16(q, scale, n, block_size, heads, head_dim, out);
}
