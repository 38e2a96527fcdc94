// Fused elementwise steps of a decoder layer on CPU, each one C call where torch runs
// several small ops: RoPE with the KV store, RMSNorm with its residual add, SiLU-and-mul. The C twins
// of engine.rope.apply_rotary + kv_store.store_kv_cpu, rmsnorm.rmsnorm_reference and
// silu_mul.silu_mul_reference;
// tests/engine/kernels/test_fused_cpu.py holds them to those.
//
// dtype codes as in cpu_native.h (0 float32, 1 float16, 2 bfloat16). Every product and sum
// is rounded to the dtype where torch's op would round it, so RoPE and the store are their
// torch versions bit for bit; RMSNorm's mean sums in another order than torch's reduction,
// and SiLU's exp is not torch's, so those may differ in the last bit of fp32 before the
// rounding to the dtype.

#include "cpu_native.h"

#include <pthread.h>

#define LANES 16
// Elements from which a call's rows are shared among `threads` OpenMP threads (the caller
// passes torch's intra-op count; see attention_cpu.c on why never OpenMP's default): below
// it the team's start costs more than it saves. A decode batch of 32 rows is above it for
// SiLU (32 x 1,536) and RoPE (32 x 12 heads x 64), under it for RMSNorm (32 x 576).
#define PARALLEL_ELEMENTS 20000

static inline float load(const void *p, int dtype, int64_t i) {
    if (dtype == 0) return ((const float *)p)[i];
    if (dtype == 1) return fp16_to_float(((const uint16_t *)p)[i]);
    return bf16_to_float(((const uint16_t *)p)[i]);
}

// fp32 -> the dtype -> fp32: the value torch's op in that dtype would hold.
static inline float round_to(float x, int dtype) {
    if (dtype == 0) return x;
    if (dtype == 1) return fp16_to_float(float_to_fp16(x));
    return bf16_to_float(float_to_bf16(x));
}

static inline void store(void *p, int dtype, int64_t i, float x) {
    if (dtype == 0) ((float *)p)[i] = x;
    else if (dtype == 1) ((uint16_t *)p)[i] = float_to_fp16(x);
    else ((uint16_t *)p)[i] = float_to_bf16(x);
}

// SiLU's e^x: x clamped to [-104, 89] (below, e^x rounds to 0 in fp32; above, to inf),
// x = n ln2 + f by Cody-Waite in fused multiply-adds, e^f = 1 + f P(f) with P of degree 5
// (within 7.4e-8 on |f| <= ln2 / 2, fitted here on Chebyshev nodes), and 2^n exactly. Half
// the operations of exp_reduced's form without fused multiply-adds, and as close.
#define EXP_LOW -104.0f
#define EXP_HIGH 89.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_C2 0.4999999403953552f
#define EXP_C3 0.1666642129421234f
#define EXP_C4 0.04166772589087486f
#define EXP_C5 0.008374763652682304f
#define EXP_C6 0.001385929062962532f

// Where the CPU has AVX-512 BF16, the bf16 loops below run 16 lanes at a time in
// intrinsics: the scalar loops' operations in their order and float_to_bf16's rounding (or,
// for SiLU, a table the scalar formula filled), so the same bits on every CPU (tests hold
// the vector lanes to the scalar tail). The compiler's own vectorisation of the scalar loops
// was 1.6-4x slower.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

// rope_head's bf16 body where the half head is whole vectors; 0 where it is not.
static int rope_head_bf16_lanes(const uint16_t *x, const uint16_t *cos, const uint16_t *sin,
                                int64_t D, uint16_t *out) {
    const int64_t half = D / 2;
    if (half % 16) return 0;
    for (int64_t d = 0; d < half; d += 16) {
        const __m512 lo = load16_bf16(x + d), hi = load16_bf16(x + d + half);
        const __m512 a_lo = round16_bf16(_mm512_mul_ps(hi, load16_bf16(sin + d)));
        const __m512 b_lo = round16_bf16(_mm512_mul_ps(lo, load16_bf16(cos + d)));
        _mm256_storeu_si256((__m256i *)(out + d), to16_bf16(_mm512_add_ps(a_lo, b_lo)));
        const __m512 a_hi = round16_bf16(_mm512_mul_ps(lo, load16_bf16(sin + d + half)));
        const __m512 b_hi = round16_bf16(_mm512_mul_ps(hi, load16_bf16(cos + d + half)));
        _mm256_storeu_si256((__m256i *)(out + d + half), to16_bf16(_mm512_add_ps(a_hi, b_hi)));
    }
    return 1;
}

// rmsnorm_row's bf16 body where H is whole vectors (0 where it is not): lane l of the sum
// of squares is the scalar loop's lane[l], and the lanes are added up as it adds them. The
// row's h (bf16 values) waits in h_f32 and the weight comes widened (weight_f32, once a call),
// so the second pass converts nothing but its two roundings.
static int rmsnorm_row_bf16_lanes(const uint16_t *x, const uint16_t *residual,
                                  const float *weight_f32, int64_t H, float eps, uint16_t *out,
                                  uint16_t *new_residual, float *h_f32) {
    if (H % 16) return 0;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < H; i += 16) {
        __m512 h = load16_bf16(x + i);
        if (residual != NULL) {
            const __m256i summed = to16_bf16(_mm512_add_ps(load16_bf16(residual + i), h));
            _mm256_storeu_si256((__m256i *)(new_residual + i), summed);
            h = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(summed), 16));
        }
        _mm512_storeu_ps(h_f32 + i, h);
        squares = _mm512_add_ps(squares, _mm512_mul_ps(h, h));
    }
    float lane[16], sum = 0.0f;
    _mm512_storeu_ps(lane, squares);
    for (int l = 0; l < 16; l++) sum += lane[l];
    const __m512 rstd = _mm512_set1_ps(1.0f / sqrtf(sum / (float)H + eps));
    for (int64_t i = 0; i < H; i += 16) {
        const __m512 normed = round16_bf16(_mm512_mul_ps(_mm512_loadu_ps(h_f32 + i), rstd));
        const __m256i y = to16_bf16(_mm512_mul_ps(_mm512_loadu_ps(weight_f32 + i), normed));
        _mm256_storeu_si256((__m256i *)(out + i), y);
    }
    return 1;
}
#else
static int rmsnorm_row_bf16_lanes(const uint16_t *x, const uint16_t *residual,
                                  const float *weight_f32, int64_t H, float eps, uint16_t *out,
                                  uint16_t *new_residual, float *h_f32) {
    (void)x, (void)residual, (void)weight_f32, (void)H, (void)eps, (void)out;
    (void)new_residual, (void)h_f32;
    return 0;
}

static int rope_head_bf16_lanes(const uint16_t *x, const uint16_t *cos, const uint16_t *sin,
                                int64_t D, uint16_t *out) {
    (void)x, (void)cos, (void)sin, (void)D, (void)out;
    return 0;
}
#endif

// One head: out = round(round(swap(x) * signed_sin) + round(x * cos)), swap(x) = (x2, x1).
// Always inlined where dtype is a literal, so each dtype's loop is a straight body.
INLINE void rope_head(const int dtype, const void *x, const void *cos, const void *sin,
                      int64_t D, void *out) {
    if (dtype == 2 && rope_head_bf16_lanes(x, cos, sin, D, out)) return;
    const int64_t half = D / 2;
    for (int64_t d = 0; d < half; d++) {  // the halves apart: each loop vectorises
        const float a = round_to(load(x, dtype, d + half) * load(sin, dtype, d), dtype);
        const float b = round_to(load(x, dtype, d) * load(cos, dtype, d), dtype);
        store(out, dtype, d, a + b);
    }
    for (int64_t d = half; d < D; d++) {
        const float a = round_to(load(x, dtype, d - half) * load(sin, dtype, d), dtype);
        const float b = round_to(load(x, dtype, d) * load(cos, dtype, d), dtype);
        store(out, dtype, d, a + b);
    }
}

INLINE void rope_rows(const int dtype, const void *qk, int64_t qk_stride, const void *v,
                      int64_t v_stride, const void *cos, const void *sin, int64_t T,
                      int64_t Hq, int64_t Hkv, int64_t D, void *q_out, void *k_out,
                      void *k_cache, void *v_cache, const int64_t *slots, int threads) {
    const size_t size = element_size(dtype);
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && T * (Hq + Hkv) * D >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const char *row = (const char *)qk + t * qk_stride * size;
        const char *c = (const char *)cos + t * D * size, *s = (const char *)sin + t * D * size;
        for (int64_t h = 0; h < Hq; h++)
            rope_head(dtype, row + h * D * size, c, s, D, (char *)q_out + (t * Hq + h) * D * size);
        char *k_row = (char *)k_out + t * Hkv * D * size;
        for (int64_t h = 0; h < Hkv; h++)
            rope_head(dtype, row + (Hq + h) * D * size, c, s, D, k_row + h * D * size);
        if (k_cache == NULL || slots[t] < 0) continue;
        const int64_t at = slots[t] * Hkv * D * size;  // a slot is one row of Hkv heads
        memcpy((char *)k_cache + at, k_row, Hkv * D * size);
        memcpy((char *)v_cache + at, (const char *)v + t * v_stride * size, Hkv * D * size);
    }
}

// weight_f32: the weight widened (bf16 only; NULL otherwise).
INLINE void rmsnorm_row(const int dtype, const void *x, const void *residual,
                        const void *weight, const float *weight_f32, int64_t H, float eps,
                        void *out, void *new_residual, float *restrict h) {
    if (dtype == 2 && rmsnorm_row_bf16_lanes(x, residual, weight_f32, H, eps, out, new_residual, h))
        return;
    for (int64_t i = 0; i < H; i++) h[i] = load(x, dtype, i);
    if (residual != NULL)
        for (int64_t i = 0; i < H; i++) {
            h[i] = round_to(load(residual, dtype, i) + h[i], dtype);
            store(new_residual, dtype, i, h[i]);
        }
    float lane[LANES] = {0}, sum = 0.0f;
    int64_t i = 0;
    for (; i + LANES <= H; i += LANES)
        for (int l = 0; l < LANES; l++) lane[l] += h[i + l] * h[i + l];
    for (int l = 0; l < LANES; l++) sum += lane[l];
    for (; i < H; i++) sum += h[i] * h[i];
    const float rstd = 1.0f / sqrtf(sum / (float)H + eps);  // torch: sum, div_, add_, rsqrt_
    for (i = 0; i < H; i++)
        store(out, dtype, i, load(weight, dtype, i) * round_to(h[i] * rstd, dtype));
}

// RoPE on q and k heads, then k and v into the paged cache.
//   qk [T, Hq + Hkv, D]: rows qk_stride elements apart, q heads then k heads
//   v [T, Hkv, D]: rows v_stride apart; cos, signed_sin [T, D] contiguous (engine.rope)
//   q_out [T, Hq, D], k_out [T, Hkv, D] contiguous
//   caches [N, bs, Hkv, D] contiguous in the same dtype, or NULL (store nothing);
//   slots [T] int64 (block * bs + row; negative: not stored)
void rope_and_store(const void *qk, int64_t qk_stride, const void *v, int64_t v_stride,
                    const void *cos, const void *sin, int64_t T, int64_t Hq, int64_t Hkv,
                    int64_t D, int dtype, void *q_out, void *k_out, void *k_cache,
                    void *v_cache, const int64_t *slots, int threads) {
#define ROPE_ROWS(DTYPE)                                                                   \
    rope_rows(DTYPE, qk, qk_stride, v, v_stride, cos, sin, T, Hq, Hkv, D, q_out, k_out,  \
              k_cache, v_cache, slots, threads)
    if (dtype == 0) ROPE_ROWS(0);
    else if (dtype == 1) ROPE_ROWS(1);
    else ROPE_ROWS(2);
}

// RMSNorm over rows of H, HF's LlamaRMSNorm: h = x (+ residual, rounded to the dtype and
// written to new_residual), out = weight * round(h * 1 / sqrt(mean(h^2) + eps)).
//   x, residual [T, H]: rows x_stride / r_stride apart; residual may be NULL
//   weight [H] in the dtype; out, new_residual [T, H] contiguous
void rmsnorm_rows(const void *x, int64_t x_stride, const void *residual, int64_t r_stride,
                  const void *weight, int64_t T, int64_t H, float eps, int dtype, void *out,
                  void *new_residual, int threads) {
    const size_t size = element_size(dtype);
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1 && T * H >= PARALLEL_ELEMENTS)
    {
        // the row in fp32 and (bf16) the weight widened, once a thread: H is a hidden size,
        // a few KiB of stack each
        float scratch[H], wide[dtype == 2 ? H : 1];
        if (dtype == 2)
            for (int64_t i = 0; i < H; i++) wide[i] = bf16_to_float(((const uint16_t *)weight)[i]);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const char *xt = (const char *)x + t * x_stride * size;
            const char *rt = residual ? (const char *)residual + t * r_stride * size : NULL;
            char *ot = (char *)out + t * H * size, *nt = (char *)new_residual + t * H * size;
            if (dtype == 0) rmsnorm_row(0, xt, rt, weight, NULL, H, eps, ot, nt, scratch);
            else if (dtype == 1) rmsnorm_row(1, xt, rt, weight, NULL, H, eps, ot, nt, scratch);
            else rmsnorm_row(2, xt, rt, weight, wide, H, eps, ot, nt, scratch);
        }
    }
}

// e^x over all of fp32 within ~2 ulp (see EXP_LOW above): SiLU's, in the scalar loop and
// the bf16 table.
static inline float exp_any(float x) {
    const float c = fminf(fmaxf(x, EXP_LOW), EXP_HIGH);
    const float n = nearbyintf(c * EXP_LOG2E);
    float f = fmaf(-n, EXP_LN2_HI, c);
    f = fmaf(-n, EXP_LN2_LO, f);
    float p = EXP_C6;
    p = fmaf(p, f, EXP_C5);
    p = fmaf(p, f, EXP_C4);
    p = fmaf(p, f, EXP_C3);
    p = fmaf(p, f, EXP_C2);
    p = fmaf(p, f, 1.0f);
    p = fmaf(p, f, 1.0f);
    return ldexpf(p, (int)n);
}

// SiLU of a bf16 gate rounded to bf16, by the gate's bits: a value depends on the gate alone,
// so 65,536 of them, computed once by silu_mul_row's scalar formula, replace an exp and a
// division per lane. Two entries of padding: a lane's gather reads 4 bytes.
static uint16_t silu_bf16_values[65536 + 2];
static pthread_once_t silu_bf16_once = PTHREAD_ONCE_INIT;

static void fill_silu_bf16_values(void) {
    for (uint32_t bits = 0; bits < 65536; bits++) {
        const float g = bf16_to_float((uint16_t)bits);
        silu_bf16_values[bits] = float_to_bf16(g / (1.0f + exp_any(-g)));
    }
}

const uint16_t *silu_bf16_table(void) {
    pthread_once(&silu_bf16_once, fill_silu_bf16_values);
    return silu_bf16_values;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// silu_mul_row's bf16 lanes, 16 at a time; returns how many columns it did.
static int64_t silu_mul_bf16_lanes(const uint16_t *gate, const uint16_t *up, int64_t I,
                                   uint16_t *out) {
    const uint16_t *table = silu_bf16_table();
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) {
        const __m256i gate_bits = _mm256_loadu_si256((const __m256i *)(gate + i));
        const __m256i prod =
            silu_mul16_bf16(_mm512_cvtepu16_epi32(gate_bits), load16_bf16(up + i), table);
        _mm256_storeu_si256((__m256i *)(out + i), prod);
    }
    return i;
}
#else
static int64_t silu_mul_bf16_lanes(const uint16_t *gate, const uint16_t *up, int64_t I,
                                   uint16_t *out) {
    (void)gate, (void)up, (void)I, (void)out;
    return 0;
}
#endif

INLINE void silu_mul_row(const int dtype, const void *gate, const void *up, int64_t I,
                         void *out) {
    const int64_t done = dtype == 2 ? silu_mul_bf16_lanes(gate, up, I, out) : 0;
    for (int64_t i = done; i < I; i++) {
        const float g = load(gate, dtype, i);
        const float silu = round_to(g / (1.0f + exp_any(-g)), dtype);  // torch's form
        store(out, dtype, i, silu * load(up, dtype, i));
    }
}

// out [T, I] = silu(gate) * up from gate_up [T, 2I] (gate columns, then up; rows `stride`
// apart), HF's act_fn(gate) * up in the dtype: the SiLU in fp32, rounded to the dtype,
// times up, rounded again. Its exp is this file's, within ~2 ulp of torch's, so a value
// may round the other way.
void silu_mul_rows(const void *gate_up, int64_t stride, int64_t T, int64_t I, int dtype,
                   void *out, int threads) {
    const size_t size = element_size(dtype);
    (void)threads;
    if (dtype == 2) silu_bf16_table();  // filled before the threads read it
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && T * I >= PARALLEL_ELEMENTS)
    for (int64_t t = 0; t < T; t++) {
        const char *row = (const char *)gate_up + t * stride * size;
        char *o = (char *)out + t * I * size;
        if (dtype == 0) silu_mul_row(0, row, row + I * size, I, o);
        else if (dtype == 1) silu_mul_row(1, row, row + I * size, I, o);
        else silu_mul_row(2, row, row + I * size, I, o);
    }
}
