// What the CPU kernels share: conversions between fp32 and the cache and activation dtypes,
// each the same value torch computes (c10's conversions), written without branches so that
// the loops calling them vectorise. Built without -ffast-math and with -ffp-contract=off
// (cpu_native.py), so the compiler rewrites none of the arithmetic below.
//
// dtype codes: 0 = float32, 1 = float16, 2 = bfloat16, 3 = fp8 e4m3fn (caches only).

#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

// For helpers the compiler would call where their loop should be part of the caller's.
#define INLINE static inline __attribute__((always_inline))

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

static inline size_t element_size(int dtype) { return dtype == 0 ? 4 : (dtype == 3 ? 1 : 2); }

// e^x = 2^n e^f for x already clamped to fp32's normal range: Cody-Waite reduction to
// x = n ln2 + f, |f| <= ln2 / 2, and Cephes' polynomial for e^f, within ~2 ulp. Returns e^f
// and sets *n; no branches or libm call, so the loops calling it vectorise. The callers
// make 2^n and handle the range ends.
static inline float exp_reduced(float clamped, int32_t *n) {
    const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    const float shifted = clamped * 1.44269504088896341f + shifter;
    const float whole = shifted - shifter;
    const float f = (clamped - whole * 0.693359375f) - whole * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    *n = (int32_t)(bits_of(shifted) - bits_of(shifter));
    return p * (f * f) + f + 1.0f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

#if defined(__AMX_TILE__)
// Every one of the 8 tiles 16 rows of 64 bytes (the prefill attention's layout).
static inline void amx_configure_16x64(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}
#endif

// 2^x on 16 lanes for x <= 0: x = n + f with n = floor(x), 0 <= f < 1; a degree-5
// polynomial for 2^f (within 1.7e-7, a minimax fit made here, p(0) = 1 exactly), scalef for
// 2^n. One instruction takes f (reduce, rounding down) and scalef floors x itself, so n is
// never formed: 7 vector operations where round, subtract and scalef took 9. The prefill
// attention's softmax (prefill_attention_amx.c; benchmarks/amx_overlap.c times it). That
// kernel runs with FTZ set, so a result below 2^-126 is 0 rather than a subnormal: a
// subnormal costs a microcode assist, ~12x the whole kernel's time with such scores measured
// here. (Degree 4, within 3.7e-6, was 3% faster; but the default model's bf16 logits for the
// README's question then tied "L" with "The", and greedy decoding took "L": answers that
// close are not worth 3%.) The polynomial's coefficients, highest degree first (Horner): one
// definition for every width that evaluates it (benchmarks/amx_overlap.c times it on 8 lanes
// too). Literals, not a table: the kernel's code stays as it was compiled with them written out.
#define EXP2_C5 1.8671301659196615e-3f
#define EXP2_C4 9.017029777169228e-3f
#define EXP2_C3 5.579991266131401e-2f
#define EXP2_C2 2.4016444385051727e-1f
#define EXP2_C1 6.931512951850891e-1f
#define EXP2_C0 1.0f
// reduce's immediate: keep no fraction bits, round down, no precision exception
#define EXP2_FLOOR_FRACTION 0x09

#if defined(__AVX512DQ__)  // reduce is AVX-512 DQ's (every CPU with AMX has it)
static inline __m512 exp2_16(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, EXP2_FLOOR_FRACTION);
    __m512 p = _mm512_set1_ps(EXP2_C5);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C0));
    return _mm512_scalef_ps(p, x);
}
#endif

// 16 bf16 values to fp32 (exact: the upper half of each lane).
static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// float_to_bf16 on 16 lanes, in its integer arithmetic (the cvtneps2bf16 instruction would
// flush subnormals to zero and keep a NaN's sign and payload): the upper half of each lane.
static inline __m512i rounded16_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i top = _mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u));
    return _mm512_mask_mov_epi32(top, nan, _mm512_set1_epi32(0x7FC00000));
}

// Whether the cvtneps2bf16 instruction rounds all 16 lanes as float_to_bf16: it does for
// every value but NaNs and subnormals (checked over 6e8 fp32 patterns here), which the
// integer arithmetic above takes. One instruction where that is ~9.
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define HARDWARE_BF16(x) (_mm512_fpclass_ps_mask((x), 0x01 | 0x20 | 0x80) == 0)  // NaN, subnormal
#else
#define HARDWARE_BF16(x) 0
#endif

static inline __m256i to16_bf16(__m512 x) {  // float_to_bf16
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    if (HARDWARE_BF16(x)) return (__m256i)_mm512_cvtneps_pbh(x);
#endif
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded16_bf16(x), 16));
}

static inline __m512 round16_bf16(__m512 x) {  // round_to(x, bf16)
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    if (HARDWARE_BF16(x)) {
        const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(x);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16));
    }
#endif
    return _mm512_castsi512_ps(rounded16_bf16(x));
}

// silu(gate) * up on 16 lanes, rounded to bf16: SiLU looked up in silu_bf16_table by each
// lane's bf16 gate bits (the low 16 bits), times up (bf16 values as fp32). Both SiLU·mul
// loops call it (silu_mul_rows' lanes, the AMX GEMM's fused pass): the same bits.
static inline __m256i silu_mul16_bf16(__m512i gate_bits, __m512 up, const uint16_t *table) {
    const __m512i silu = _mm512_i32gather_epi32(gate_bits, (const void *)table, 2);
    return to16_bf16(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(silu, 16)), up));
}
#endif

// Entry points that decode_layer_cpu.c chains (defined in the files named; each takes
// torch's intra-op thread count as `threads`).
// gemm_amx.c
int amx_gemm_available(void);
// whether amx_linear_bf16 shares m rows among `threads` by rows (else by columns)
int amx_shares_rows(int64_t m, int threads);
int amx_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                    int64_t n, int64_t k, const uint16_t *bias, uint16_t *y, int threads);
// fused_cpu.c
void rope_and_store(const void *qk, int64_t qk_stride, const void *v, int64_t v_stride,
                    const void *cos, const void *sin, int64_t T, int64_t Hq, int64_t Hkv,
                    int64_t D, int dtype, void *q_out, void *k_out, void *k_cache,
                    void *v_cache, const int64_t *slots, int threads);
void rmsnorm_rows(const void *x, int64_t x_stride, const void *residual, int64_t r_stride,
                  const void *weight, int64_t T, int64_t H, float eps, int dtype, void *out,
                  void *new_residual, int threads);
void silu_mul_rows(const void *gate_up, int64_t stride, int64_t T, int64_t I, int dtype,
                   void *out, int threads);
// round_to(silu(g), bf16) for every bf16 g, by g's bits (filled on the first call)
const uint16_t *silu_bf16_table(void);
// attention_cpu.c
int paged_decode_attention(const void *q, int q_dtype, int64_t q_stride, const void *k_cache,
                           const void *v_cache, int cache_dtype, const float *k_scale,
                           const float *v_scale, const int32_t *tables, int64_t table_width,
                           const int32_t *context_lens, int64_t B, int64_t Hq, int64_t Hkv,
                           int64_t D, int64_t block_size, float softmax_scale, void *out,
                           int threads);
