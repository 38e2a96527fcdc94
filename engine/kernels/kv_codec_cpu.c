// FP8 e4m3 codec for whole KV blocks on CPU: the C twin of kv_codec.py's torch reference,
// bit for bit (tests/engine/kernels/test_kv_codec_cpu.py holds it to that).
//
// Blocks are contiguous [n, block_size, heads, head_dim]; one float32 scale per (block, head):
// scale = max(amax, 1e-12) / 448, q = e4m3(clamp(x / scale, -448, 448)), x' = (q * scale).
// The same IEEE operations as torch, in the same order: build without -ffast-math and with
// -ffp-contract=off, so neither the division nor the rounding tricks below are rewritten.
// dtype codes as in cpu_native.h (0 = float32, 1 = float16, 2 = bfloat16).

#include "cpu_native.h"

// One function per source dtype (LOAD reads element i as fp32), so each inner loop is one
// straight vectorisable body.
#define QUANTIZE(NAME, TYPE, LOAD)                                                          \
    static void NAME(const TYPE *restrict x, int64_t n, int64_t block_size, int64_t heads, \
                     int64_t head_dim, uint8_t *restrict q, float *restrict scale) {       \
        const int64_t row = heads * head_dim, block = block_size * row;                    \
        uint32_t top[heads];                                                               \
        for (int64_t b = 0; b < n; b++) {                                                  \
            const TYPE *xb = x + b * block;                                                \
            uint8_t *qb = q + b * block;                                                   \
            float *sb = scale + b * heads;                                                 \
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
QUANTIZE(quantize_f32, float, AS_FLOAT)
QUANTIZE(quantize_f16, uint16_t, fp16_to_float)
QUANTIZE(quantize_bf16, uint16_t, bf16_to_float)

void quantize_kv_blocks(const void *x, int dtype, int64_t n, int64_t block_size, int64_t heads,
                        int64_t head_dim, uint8_t *q, float *scale) {
    if (dtype == 0) quantize_f32(x, n, block_size, heads, head_dim, q, scale);
    else if (dtype == 1) quantize_f16(x, n, block_size, heads, head_dim, q, scale);
    else quantize_bf16(x, n, block_size, heads, head_dim, q, scale);
}

#define DEQUANTIZE(NAME, TYPE, STORE)                                                       \
    static void NAME(const uint8_t *q, const float *scale, int64_t n, int64_t block_size,  \
                     int64_t heads, int64_t head_dim, TYPE *out) {                         \
        const int64_t row = heads * head_dim, block = block_size * row;                    \
        for (int64_t b = 0; b < n; b++)                                                    \
            for (int64_t t = 0; t < block_size; t++)                                       \
                for (int64_t h = 0; h < heads; h++) {                                      \
                    const float s = scale[b * heads + h];                                  \
                    const int64_t start = b * block + t * row + h * head_dim;              \
                    for (int64_t d = 0; d < head_dim; d++)                                 \
                        out[start + d] = STORE(from_e4m3(q[start + d]) * s);              \
                }                                                                          \
    }

DEQUANTIZE(dequantize_f32, float, AS_FLOAT)
DEQUANTIZE(dequantize_f16, uint16_t, float_to_fp16)
DEQUANTIZE(dequantize_bf16, uint16_t, float_to_bf16)

void dequantize_kv_blocks(const uint8_t *q, const float *scale, int64_t n, int64_t block_size,
                          int64_t heads, int64_t head_dim, void *out, int dtype) {
    if (dtype == 0) dequantize_f32(q, scale, n, block_size, heads, head_dim, out);
    else if (dtype == 1) dequantize_f16(q, scale, n, block_size, heads, head_dim, out);
    else dequantize_bf16(q, scale, n, block_size, heads, head_dim, out);
}
