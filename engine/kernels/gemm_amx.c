// y = x @ W.T in bf16 on AMX tiles, for CPUs with AMX-BF16 (Sapphire Rapids and later):
// what a decode step's GEMMs are, a few rows against weights read once per step. oneDNN
// reads those weights at ~17 GB/s here (its per-call setup and blocking are made for larger
// row counts); this kernel streams them at ~29 GB/s, the machine's read bandwidth.
//
// The weight is packed once into the tile layout the AMX dot product takes as its B operand
// (amx_pack_weight): for each block of 16 output columns and 32 inputs, 16 rows of input
// pairs x 16 columns x 2, 1 KiB contiguous, the blocks of one column block in input order.
// A thread's share of the weight is then one sequential stream.
//
// Each output is the fp32 sum of bf16 products in 32-input blocks, in input order, rounded
// once to bf16 (round to nearest even): for up to 32 rows oneDNN computes the same bits
// (tests compare). Rows are independent: a row's result does not depend on the others.
//
// Built without AMX (another CPU, an older compiler), amx_gemm_available() returns 0 and
// the engine keeps its other GEMMs.

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
// Output column blocks (of 16) per pass: 1 A tile + 3 B tiles + 3 C tiles of the 8.
#define COLUMN_BLOCKS 3

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

// Tiles: 0 = x's rows (A), 1-3 = weight blocks (B), 4-6 = sums (C) of `rows` rows.
static void configure_tiles(int rows) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    config.rows[0] = (uint8_t)rows;
    config.colsb[0] = 64;
    for (int t = 1; t <= COLUMN_BLOCKS; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
        config.rows[t + COLUMN_BLOCKS] = (uint8_t)rows;
        config.colsb[t + COLUMN_BLOCKS] = 64;
    }
    _tile_loadconfig(&config);
}

// Linux hands out the tile registers' state only to a process that asks (once per process).
int amx_gemm_available(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

// w [n, k] bf16, row-major -> packed [n/16][k/32][16 input pairs][16 columns][2].
void amx_pack_weight(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed, int threads) {
    const int64_t k_blocks = k / 32;
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t nb = 0; nb < n / 16; nb++)
        for (int64_t kb = 0; kb < k_blocks; kb++) {
            uint16_t *tile = packed + (nb * k_blocks + kb) * 512;
            for (int pair = 0; pair < 16; pair++)
                for (int col = 0; col < 16; col++) {
                    const uint16_t *src = w + (nb * 16 + col) * k + kb * 32 + pair * 2;
                    tile[(pair * 16 + col) * 2] = src[0];
                    tile[(pair * 16 + col) * 2 + 1] = src[1];
                }
        }
}

// y [m, n] (row stride n) = x [m, k] (row stride x_stride elements) @ W.T (+ bias [n]),
// all bf16; W as amx_pack_weight packed it. Returns 0, or -1 for shapes it does not take.
int amx_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                    int64_t n, int64_t k, const uint16_t *bias, uint16_t *y, int threads) {
    if (!amx_gemm_available() || n % 16 || k % 32 || m < 0 || x_stride < k) return -1;
    const int64_t k_blocks = k / 32;
    const int64_t n_blocks = n / 16;
    const int64_t groups = (n_blocks + COLUMN_BLOCKS - 1) / COLUMN_BLOCKS;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1 && groups > 1)
    {
        float sums[COLUMN_BLOCKS][16][16] __attribute__((aligned(64)));
        int configured = -1;
#pragma omp for schedule(static)
        for (int64_t group = 0; group < groups; group++) {
            const int64_t nb0 = group * COLUMN_BLOCKS;
            const int blocks = (int)(n_blocks - nb0 < COLUMN_BLOCKS ? n_blocks - nb0 : COLUMN_BLOCKS);
            const uint16_t *w0 = packed + nb0 * k_blocks * 512;
            for (int64_t m0 = 0; m0 < m; m0 += 16) {
                const int rows = (int)(m - m0 < 16 ? m - m0 : 16);
                if (rows != configured) {
                    configure_tiles(rows);
                    configured = rows;
                }
                const uint16_t *xa = x + m0 * x_stride;
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                if (blocks == 3) {
                    for (int64_t kb = 0; kb < k_blocks; kb++) {
                        _tile_loadd(0, xa + kb * 32, x_stride * 2);
                        _tile_loadd(1, w0 + kb * 512, 64);
                        _tile_loadd(2, w0 + (k_blocks + kb) * 512, 64);
                        _tile_loadd(3, w0 + (2 * k_blocks + kb) * 512, 64);
                        _tile_dpbf16ps(4, 0, 1);
                        _tile_dpbf16ps(5, 0, 2);
                        _tile_dpbf16ps(6, 0, 3);
                    }
                } else {  // the last one or two column blocks
                    for (int64_t kb = 0; kb < k_blocks; kb++) {
                        _tile_loadd(0, xa + kb * 32, x_stride * 2);
                        _tile_loadd(1, w0 + kb * 512, 64);
                        _tile_dpbf16ps(4, 0, 1);
                        if (blocks == 2) {
                            _tile_loadd(2, w0 + (k_blocks + kb) * 512, 64);
                            _tile_dpbf16ps(5, 0, 2);
                        }
                    }
                }
                _tile_stored(4, sums[0], 64);
                if (blocks > 1) _tile_stored(5, sums[1], 64);
                if (blocks > 2) _tile_stored(6, sums[2], 64);
                for (int b = 0; b < blocks; b++) {
                    const int64_t col = (nb0 + b) * 16;
                    const __m512 add = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                      (const __m256i *)(bias + col))),
                                                  16))
                                            : _mm512_setzero_ps();
                    for (int r = 0; r < rows; r++) {
                        const __m512 sum = _mm512_add_ps(_mm512_load_ps(sums[b][r]), add);
                        _mm256_storeu_si256((__m256i *)(y + (m0 + r) * n + col),
                                            (__m256i)_mm512_cvtneps_pbh(sum));
                    }
                }
            }
        }
        _tile_release();  // no tile state kept in the thread between calls
    }
    return 0;
}

#else  // no AMX here: the engine keeps its other GEMMs

int amx_gemm_available(void) { return 0; }

void amx_pack_weight(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed, int threads) {
    (void)w, (void)n, (void)k, (void)packed, (void)threads;
}

int amx_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                    int64_t n, int64_t k, const uint16_t *bias, uint16_t *y, int threads) {
    (void)x, (void)x_stride, (void)m, (void)packed, (void)n, (void)k, (void)bias, (void)y;
    (void)threads;
    return -1;
}

#endif
