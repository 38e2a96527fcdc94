// y = x @ W^T with W kept in its GGUF blocks (Q4_0, Q4_1, Q8_0): a decode step's GEMMs read
// 4.5-8.5 bits per weight instead of 32. Each block is dequantised in registers (the exact
// fp32 values gguf's dequantiser gives: its multiply, then its add, each rounded) and dotted
// with up to 4 input rows in fp32 (the products summed in 2 x 8 lanes, then the lanes: another
// order than a BLAS, the same precision). Without AVX2 and FMA, a row's weights are
// dequantised into a buffer and summed in the same order.
//
// Block layouts (32 weights each; d and m fp16):
//   kind 0, Q4_0: d, 16 bytes of nibbles   w = d * (q - 8)
//   kind 1, Q4_1: d, m, 16 bytes           w = d * q + m
//   kind 2, Q8_0: d, 32 int8               w = d * q
// Byte j of the nibbles holds weight j in its low half and weight j + 16 in its high half.

#include <stdlib.h>

#include "cpu_native.h"

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2_FMA 1
#include <immintrin.h>
#endif

#define QBLOCK 32

int64_t quantized_block_bytes(int kind) {
    switch (kind) {
        case 0: return 18;
        case 1: return 20;
        case 2: return 34;
        default: return 0;
    }
}

static inline uint16_t read_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

// One block's 32 nibbles or bytes as the integers their formula multiplies.
static inline void block_integers(const uint8_t *block, int kind, float *q) {
    if (kind == 2) {
        const int8_t *s = (const int8_t *)(block + 2);
        for (int i = 0; i < QBLOCK; i++) q[i] = (float)s[i];
        return;
    }
    const uint8_t *s = block + (kind == 1 ? 4 : 2);
    const int offset = kind == 0 ? 8 : 0;
    for (int j = 0; j < QBLOCK / 2; j++) {
        q[j] = (float)((int)(s[j] & 0x0F) - offset);
        q[j + QBLOCK / 2] = (float)((int)(s[j] >> 4) - offset);
    }
}

#ifdef HAVE_AVX2_FMA
static inline float half_to_float(const uint8_t *p) {
#if defined(__F16C__)
    return _cvtsh_ss(read_u16(p));
#else
    return fp16_to_float(read_u16(p));
#endif
}

// One block's 32 weights in 4 registers.
static inline __attribute__((always_inline)) void block_weights(const uint8_t *block, int kind,
                                                                __m256 w[4]) {
    const __m256 dv = _mm256_set1_ps(half_to_float(block));
    __m256i q32[4];
    if (kind == 2) {
        for (int i = 0; i < 4; i++)
            q32[i] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block + 2 + 8 * i)));
    } else {
        const __m128i bytes16 = _mm_loadu_si128((const __m128i *)(block + (kind == 1 ? 4 : 2)));
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(bytes16, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes16, 4), mask);
        q32[0] = _mm256_cvtepu8_epi32(lo);
        q32[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
        q32[2] = _mm256_cvtepu8_epi32(hi);
        q32[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
        if (kind == 0)
            for (int i = 0; i < 4; i++) q32[i] = _mm256_sub_epi32(q32[i], _mm256_set1_epi32(8));
    }
    if (kind == 1) {
        const __m256 mv = _mm256_set1_ps(half_to_float(block + 2));
        for (int i = 0; i < 4; i++)
            w[i] = _mm256_add_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(q32[i])), mv);
    } else {
        for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(q32[i]));
    }
}
#endif

// One output row's weights, in_features of them, as fp32.
static void dequantize_row(const uint8_t *row, int kind, int64_t in_features, float *out) {
    const int64_t bytes = quantized_block_bytes(kind);
    for (int64_t b = 0; b < in_features / QBLOCK; b++) {
        const uint8_t *block = row + b * bytes;
        float *w = out + b * QBLOCK;
#ifdef HAVE_AVX2_FMA
        __m256 v[4];
        block_weights(block, kind, v);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(w + 8 * i, v[i]);
#else
        const float d = fp16_to_float(read_u16(block));
        float q[QBLOCK];
        block_integers(block, kind, q);
        if (kind == 1) {
            const float m = fp16_to_float(read_u16(block + 2));
            for (int i = 0; i < QBLOCK; i++) w[i] = d * q[i] + m;
        } else {
            for (int i = 0; i < QBLOCK; i++) w[i] = d * q[i];
        }
#endif
    }
}

#ifdef HAVE_AVX2_FMA
// The dots of one output row's blocks with R input rows, each block dequantised once into
// registers. Every input row sums alike (two accumulators, then their lanes) whatever R is,
// so a row's result does not depend on the batch it came in.
static inline __attribute__((always_inline)) void dot_tile(const uint8_t *row, int kind,
                                                           int64_t blocks, int64_t block_bytes,
                                                           const float *x, int64_t x_stride,
                                                           const int R, float *out) {
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256 w[4];
        block_weights(row + b * block_bytes, kind, w);
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * x_stride + b * QBLOCK;
            acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r][1]);
            acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(acc[r][0], acc[r][1]));
        out[r] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                 ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    }
}
#endif

#ifndef HAVE_AVX2_FMA
// The AVX2 path's sums without it: chunk k of 8 into accumulator k % 2, a fused multiply-add
// each (fmaf), then the two added and their lanes.
static void scalar_dot(const float *w, const float *x, int64_t n, float *out) {
    float acc[2][8] = {{0}};
    for (int64_t i = 0; i < n; i += 8)
        for (int l = 0; l < 8; l++) acc[(i / 8) % 2][l] = fmaf(w[i + l], x[i + l], acc[(i / 8) % 2][l]);
    float lanes[8];
    for (int l = 0; l < 8; l++) lanes[l] = acc[0][l] + acc[1][l];
    *out = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
           ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}
#endif

// y[r, o] = sum_i x[r, i] * W[o, i] (+ bias[o]); in_features a multiple of 32. Output rows
// split over threads. Returns 0, -1 for an unknown kind or a bad in_features, -2 out of
// memory.
int quantized_linear(const uint8_t *weights, int kind, int64_t out_features,
                     int64_t in_features, const float *x, int64_t rows, int64_t x_stride,
                     const float *bias, float *y, int64_t y_stride, int threads) {
    const int64_t block_bytes = quantized_block_bytes(kind);
    if (block_bytes == 0 || in_features <= 0 || in_features % QBLOCK) return -1;
    const int64_t blocks = in_features / QBLOCK;
    const int64_t row_bytes = blocks * block_bytes;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
#ifndef HAVE_AVX2_FMA
        float *w = malloc(sizeof(float) * (size_t)in_features);
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#endif
#pragma omp for schedule(static)
        for (int64_t o = 0; o < out_features; o++) {
            const uint8_t *row = weights + o * row_bytes;
            const float add = bias ? bias[o] : 0.0f;
            int tile = 4;
            for (int64_t r0 = 0; r0 < rows; r0 += tile) {
                const int64_t left = rows - r0;
                const float *xr = x + r0 * x_stride;
                float dots[4];
#ifdef HAVE_AVX2_FMA
                if (left >= 4) {
                    tile = 4;
                    dot_tile(row, kind, blocks, block_bytes, xr, x_stride, 4, dots);
                } else if (left >= 2) {
                    tile = 2;
                    dot_tile(row, kind, blocks, block_bytes, xr, x_stride, 2, dots);
                } else {
                    tile = 1;
                    dot_tile(row, kind, blocks, block_bytes, xr, x_stride, 1, dots);
                }
#else
                if (w == NULL) break;
                if (r0 == 0) dequantize_row(row, kind, in_features, w);
                tile = left < 4 ? (int)left : 4;
                for (int r = 0; r < tile; r++) {
                    scalar_dot(w, xr + r * x_stride, in_features, &dots[r]);
                }
#endif
                for (int r = 0; r < tile; r++)
                    y[(r0 + r) * y_stride + o] = bias ? dots[r] + add : dots[r];
            }
        }
#ifndef HAVE_AVX2_FMA
        free(w);
#endif
    }
    return failed ? -2 : 0;
}

// The whole matrix as fp32 [out_features, in_features]: the values quantized_linear computes
// with (checked against the dense weights at load).
int quantized_dequantize(const uint8_t *weights, int kind, int64_t out_features,
                         int64_t in_features, float *out, int threads) {
    const int64_t block_bytes = quantized_block_bytes(kind);
    if (block_bytes == 0 || in_features <= 0 || in_features % QBLOCK) return -1;
    const int64_t row_bytes = in_features / QBLOCK * block_bytes;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < out_features; o++)
        dequantize_row(weights + o * row_bytes, kind, in_features, out + o * in_features);
    return 0;
}
