// FP8 e4m3 codec for whole KV blocks on CPU: the C twin of kv_codec.py's torch reference,
// bit for bit (tests/engine/kernels/test_kv_codec_cpu.py holds it to that).
//
// Blocks are contiguous [n, block_size, heads, head_dim]; one float32 scale per (block, head):
// scale = max(amax, 1e-12) / 448, q = e4m3(clamp(x / scale, -448, 448)), x' = (q * scale).
// The same IEEE operations as torch, in the same order: build without -ffast-math and with
// -ffp-contract=off, so neither the division nor the rounding tricks below are rewritten.
//
// dtype codes: 0 = float32, 1 = float16, 2 = bfloat16.

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float bf16_to_float(uint16_t b) { return float_of((uint32_t)b << 16); }

// fp16 <-> fp32 in integer and float arithmetic (c10's fp16_ieee_{to,from}_fp32_value), so
// the compiler vectorises them; the same values as the hardware conversion (NaNs as NaN).
static inline float fp16_to_float(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & UINT32_C(0x80000000);
    const uint32_t two_w = w + w;
    const float normalized = float_of((two_w >> 4) + (UINT32_C(0xE0) << 23)) * 0x1.0p-112f;
    const float denormalized = float_of((two_w >> 17) | (UINT32_C(126) << 23)) - 0.5f;
    return float_of(sign | (two_w < (UINT32_C(1) << 27) ? bits_of(denormalized)
                                                         : bits_of(normalized)));
}

static inline uint16_t float_to_fp16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = bits_of(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & UINT32_C(0x80000000);
    uint32_t bias = shl1_w & UINT32_C(0xFF000000);
    bias = bias < UINT32_C(0x71000000) ? UINT32_C(0x71000000) : bias;
    base = float_of((bias >> 1) + UINT32_C(0x07800000)) + base;
    const uint32_t bits = bits_of(base);
    const uint32_t nonsign = ((bits >> 13) & UINT32_C(0x7C00)) + (bits & UINT32_C(0x0FFF));
    return (uint16_t)((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? 0x7E00 : nonsign));
}

// fp32 -> e4m3fn, round to nearest even; NaN -> 0x7f (c10's fp8e4m3fn_from_fp32_value).
// Both of its paths computed, then selected: no branches, so the loops vectorise.
static inline uint8_t to_e4m3(float f) {
    const uint32_t fp8_max = UINT32_C(1087) << 20;
    const uint32_t denorm_mask = UINT32_C(141) << 23;
    uint32_t f_bits = bits_of(f);
    const uint32_t sign = f_bits & UINT32_C(0x80000000);
    f_bits ^= sign;
    // subnormal: let the fp32 adder round, then read the low bits
    const uint32_t subnormal = bits_of(float_of(f_bits) + float_of(denorm_mask)) - denorm_mask;
    const uint32_t normal =
        (f_bits + ((uint32_t)(7 - 127) << 23) + 0x7FFFF + ((f_bits >> 20) & 1)) >> 20;
    const uint32_t result = f_bits >= fp8_max                     ? 0x7f
                            : f_bits < (UINT32_C(121) << 23) ? subnormal
                                                               : normal;
    return (uint8_t)((result & 0xFF) | (sign >> 24));
}

// e4m3fn -> fp32 (exact), as c10's fp8e4m3fn_to_fp32_value; integer ops that vectorise
// (faster here than a 256-entry table's gathers).
static inline float from_e4m3(uint8_t x) {
    const uint32_t w = (uint32_t)x << 24;
    const uint32_t sign = w & UINT32_C(0x80000000);
    const uint32_t nonsign = w & UINT32_C(0x7FFFFFFF);
    uint32_t renorm_shift = nonsign ? (uint32_t)__builtin_clz(nonsign) : 32;
    renorm_shift = renorm_shift > 4 ? renorm_shift - 4 : 0;
    const int32_t inf_nan_mask = ((int32_t)(nonsign + 0x01000000) >> 8) & INT32_C(0x7F800000);
    const int32_t zero_mask = (int32_t)(nonsign - 1) >> 31;
    uint32_t result =
        sign | ((((nonsign << renorm_shift >> 4) + ((0x78 - renorm_shift) << 23)) |
                 (uint32_t)inf_nan_mask) &
                ~(uint32_t)zero_mask);
    return float_of(result);
}

static inline uint16_t float_to_bf16(float f) {
    const uint32_t u = bits_of(f);
    return f != f ? (uint16_t)0x7FC0 : (uint16_t)((u + (((u >> 16) & 1) + 0x7FFF)) >> 16);
}

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
