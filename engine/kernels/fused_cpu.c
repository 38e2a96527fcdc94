// Fused elementwise steps of a decoder layer on CPU, each one C call where torch runs
// several small ops: RoPE with the KV store, and RMSNorm with its residual add. The C twins
// of engine.rope.apply_rotary + kv_store.store_kv_cpu and of rmsnorm.rmsnorm_reference;
// tests/engine/kernels/test_fused_cpu.py holds them to those.
//
// dtype codes as in cpu_native.h (0 float32, 1 float16, 2 bfloat16). Every product and sum
// is rounded to the dtype where torch's op would round it, so RoPE and the store are their
// torch versions bit for bit; RMSNorm's mean sums in another order than torch's reduction
// (so it may differ in the last bit of fp32 before the rounding to the dtype).

#include "cpu_native.h"

#define LANES 16

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

static inline size_t element_size(int dtype) { return dtype == 0 ? 4 : 2; }

#define INLINE static inline __attribute__((always_inline))

// One head: out = round(round(swap(x) * signed_sin) + round(x * cos)), swap(x) = (x2, x1).
// Always inlined where dtype is a literal, so each dtype's loop is a straight body.
INLINE void rope_head(const int dtype, const void *x, const void *cos, const void *sin,
                      int64_t D, void *out) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < D; d++) {
        const float swapped = load(x, dtype, d < half ? d + half : d - half);
        const float a = round_to(swapped * load(sin, dtype, d), dtype);
        const float b = round_to(load(x, dtype, d) * load(cos, dtype, d), dtype);
        store(out, dtype, d, a + b);
    }
}

INLINE void rope_rows(const int dtype, const void *qk, int64_t qk_stride, const void *v,
                      int64_t v_stride, const void *cos, const void *sin, int64_t T,
                      int64_t Hq, int64_t Hkv, int64_t D, void *q_out, void *k_out,
                      void *k_cache, void *v_cache, const int64_t *slots) {
    const size_t size = element_size(dtype);
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

INLINE void rmsnorm_row(const int dtype, const void *x, const void *residual,
                        const void *weight, int64_t H, float eps, void *out,
                        void *new_residual, float *restrict h) {
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
                    void *v_cache, const int64_t *slots) {
#define ROPE_ROWS(DTYPE)                                                                   \
    rope_rows(DTYPE, qk, qk_stride, v, v_stride, cos, sin, T, Hq, Hkv, D, q_out, k_out,  \
              k_cache, v_cache, slots)
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
                  void *new_residual) {
    const size_t size = element_size(dtype);
    float scratch[H];  // one row in fp32 (H is a hidden size: a few KiB of stack)
    for (int64_t t = 0; t < T; t++) {
        const char *xt = (const char *)x + t * x_stride * size;
        const char *rt = residual ? (const char *)residual + t * r_stride * size : NULL;
        char *ot = (char *)out + t * H * size, *nt = (char *)new_residual + t * H * size;
        if (dtype == 0) rmsnorm_row(0, xt, rt, weight, H, eps, ot, nt, scratch);
        else if (dtype == 1) rmsnorm_row(1, xt, rt, weight, H, eps, ot, nt, scratch);
        else rmsnorm_row(2, xt, rt, weight, H, eps, ot, nt, scratch);
    }
}
