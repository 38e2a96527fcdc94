// y = x @ W.T in bf16 on AMX tiles, for CPUs with AMX-BF16 (Sapphire Rapids and later).
// Up to 16 rows (a decode step's GEMMs: a few rows against weights read once per step) it
// streams the weights at ~29 GB/s, the machine's read bandwidth, where oneDNN reads them at
// ~17 (its per-call setup and blocking are made for larger row counts). From 17 rows (a
// short prompt) it reuses tiles both ways: ~1.2x oneDNN's packed GEMM at 32-256 rows here,
// ~1.5x at 512, level with it from ~1,700 rows (one layer's four GEMMs, 2 threads).
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

#include "cpu_native.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
// few_rows' output column blocks (of 16) per pass: 1 A tile + 3 B tiles + 3 C tiles of 8.
#define COLUMN_BLOCKS 3

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void load_config(const uint8_t rows[8]) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = rows[t];
        config.colsb[t] = rows[t] ? 64 : 0;  // 0 rows: a tile left unconfigured (unused)
    }
    _tile_loadconfig(&config);
}

// few_rows' tiles: 0 = x's `rows` rows (A), 1-3 = weight blocks (B), 4-6 = sums (C).
static void configure_few(int rows) {
    const uint8_t r = (uint8_t)rows;
    load_config((const uint8_t[8]){r, 16, 16, 16, r, r, r, 0});
}

// many_rows' tiles: 0-1 = two row tiles of x (A; `rows1` may be 0: none), 2-3 = weight
// blocks (B), 4-5 = row tile 0's sums (C), 6-7 = row tile 1's.
static void configure_many(int rows0, int rows1) {
    const uint8_t r0 = (uint8_t)rows0, r1 = (uint8_t)rows1;
    load_config((const uint8_t[8]){r0, r1, 16, 16, r0, r0, r1, r1});
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

// 16 columns of bias from `col` as fp32, zeros where there is no bias.
static inline __m512 bias16(const uint16_t *bias, int64_t col) {
    return bias ? load16_bf16(bias + col) : _mm512_setzero_ps();
}

// Sums of a block of 16 columns for `rows` rows (a C tile stored as fp32 [16][16]) plus
// bias, rounded to bf16 into y's rows (row stride n) at column `col`.
static void store_sums(const float sums[16][16], int rows, const uint16_t *bias, int64_t col,
                       uint16_t *y, int64_t n) {
    const __m512 add = bias16(bias, col);
    for (int r = 0; r < rows; r++) {
        const __m512 sum = _mm512_add_ps(_mm512_load_ps(sums[r]), add);
        _mm256_storeu_si256((__m256i *)(y + r * n + col), (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

// Up to 16 rows (a decode step): every weight byte is read once, so the loop streams the
// weight: one A tile of x against 3 column blocks at a time.
static void few_rows(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                     int64_t n, int64_t k, const uint16_t *bias, uint16_t *y, int threads) {
    const int64_t k_blocks = k / 32;
    const int64_t n_blocks = n / 16;
    const int64_t groups = (n_blocks + COLUMN_BLOCKS - 1) / COLUMN_BLOCKS;
    const int rows = (int)m;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1 && groups > 1)
    {
        float sums[COLUMN_BLOCKS][16][16] __attribute__((aligned(64)));
        configure_few(rows);
#pragma omp for schedule(static)
        for (int64_t group = 0; group < groups; group++) {
            const int64_t nb0 = group * COLUMN_BLOCKS;
            const int blocks = (int)(n_blocks - nb0 < COLUMN_BLOCKS ? n_blocks - nb0 : COLUMN_BLOCKS);
            const uint16_t *w0 = packed + nb0 * k_blocks * 512;
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            if (blocks == 3) {
                for (int64_t kb = 0; kb < k_blocks; kb++) {
                    _tile_loadd(0, x + kb * 32, x_stride * 2);
                    _tile_loadd(1, w0 + kb * 512, 64);
                    _tile_loadd(2, w0 + (k_blocks + kb) * 512, 64);
                    _tile_loadd(3, w0 + (2 * k_blocks + kb) * 512, 64);
                    _tile_dpbf16ps(4, 0, 1);
                    _tile_dpbf16ps(5, 0, 2);
                    _tile_dpbf16ps(6, 0, 3);
                }
            } else {  // the last one or two column blocks
                for (int64_t kb = 0; kb < k_blocks; kb++) {
                    _tile_loadd(0, x + kb * 32, x_stride * 2);
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
            for (int b = 0; b < blocks; b++) store_sums(sums[b], rows, bias, (nb0 + b) * 16, y, n);
        }
        _tile_release();  // no tile state kept in the thread between calls
    }
}

// Row tiles per chunk of x that many_rows keeps in L2 while it passes a thread's columns
// (256 rows of 1,536 inputs: 768 KiB).
#define CHUNK_ROWS 256
// From this many rows a thread (a prompt's GEMM), many_rows gives each thread its own rows,
// all columns, rather than all rows, its own columns: a core then writes the rows it (and the
// ops before and after, which split rows the same way) reads, rather than every row's part
// of each; a 1,676-token prefill step ran a few percent faster (2 threads; RESULTS.md). Below
// it, a thread's rows are too few to pay for reading the whole weight. Not with SiLU: no
// faster there (gate_up's weight, about twice a core's L2, read whole by each thread).
#define ROWS_PER_THREAD_MIN 256
// Outputs from this size on are streamed to memory (twice a core's L2 here).
#define STREAM_BYTES (4 << 20)

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

int amx_shares_rows(int64_t m, int threads) {
    return threads > 1 && m >= (int64_t)ROWS_PER_THREAD_MIN * threads;
}

// A block of 32 rows x 2 column blocks whose sums wait in memory (C tiles stored as fp32
// [4][16][16]: row tile 0's two blocks, then row tile 1's) for the vector unit to round and
// write them while the tiles compute the next block.
typedef struct {
    float (*sums)[16][16];
    int rows0, rows1, two_columns;
    int64_t m0, nb0;
} Finished;

// Rows [from, to) of a finished block (row tile 0's rows first) into y: each row's 32
// columns rounded to bf16 (plus bias), as one streamed 64-byte line where they are whole
// lines of y; with `table`, silu(gate) * up of the row's 16 gate and 16 up columns, as
// silu_mul_rows computes it from the rounded bf16 values.
static inline void write_rows(const Finished *f, int from, int to, const uint16_t *bias,
                              uint16_t *y, int64_t n, int lines, const uint16_t *table) {
    for (int e = from; e < to; e++) {
        const int tile = e < f->rows0 ? 0 : 1, r = tile ? e - f->rows0 : e;
        const int64_t row = f->m0 + 16 * tile + r, col = f->nb0 * 16;
        const float *s0 = f->sums[2 * tile][r], *s1 = f->sums[2 * tile + 1][r];
        if (table) {  // block nb0 of the gate half, and of the up half
            const int64_t half = n / 2;
            const __m512 g = _mm512_add_ps(_mm512_load_ps(s0), bias16(bias, col));
            const __m512 u = _mm512_add_ps(_mm512_load_ps(s1), bias16(bias, half + col));
            const __m512i g_bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(g));
            const __m512i u_bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(u));
            const __m512 u_rounded = _mm512_castsi512_ps(_mm512_slli_epi32(u_bits, 16));
            _mm256_storeu_si256((__m256i *)(y + row * half + col),
                                silu_mul16_bf16(g_bits, u_rounded, table));
            continue;
        }
        const __m512 a = _mm512_add_ps(_mm512_load_ps(s0), bias16(bias, col));
        if (!f->two_columns) {
            _mm256_storeu_si256((__m256i *)(y + row * n + col), (__m256i)_mm512_cvtneps_pbh(a));
            continue;
        }
        const __m512 b = _mm512_add_ps(_mm512_load_ps(s1), bias16(bias, col + 16));
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);
        if (lines) _mm512_stream_si512((void *)(y + row * n + col), both);
        else _mm512_storeu_si512(y + row * n + col, both);
    }
}

// More rows (a prompt): each weight tile is used by every row tile, so the loop reuses
// tiles in both directions: 2 row tiles x 2 column blocks, 4 sums from 4 loads. x is taken
// CHUNK_ROWS rows at a time (kept in L2 while the thread's column pairs pass); a column
// pair stays in L1/L2 while the chunk's row tiles pass, and the next pair is asked for from
// memory meanwhile, a few lines each step. A block's sums are written out a few rows a
// step while the tiles compute the next block, so the vector unit's rounding and stores
// run beside the tiles rather than between them. Threads share the work by rows (each
// its rows, every pair) from ROWS_PER_THREAD_MIN rows a thread, by pairs (each its pairs,
// every row) below; either way each output gets the same sums.
//
// A pair is two neighbouring column blocks; with `table` (SiLU's), block j of the gate
// half and block j of the up half, whose product is y's column block j (y [m, n / 2]).
static void many_rows(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                      int64_t n, int64_t k, const uint16_t *bias, uint16_t *y, int threads,
                      const uint16_t *table) {
    const int64_t k_blocks = k / 32, block = k_blocks * 512;  // a column block's elements
    const int64_t n_blocks = n / 16;
    const int64_t pairs = table ? n_blocks / 2 : (n_blocks + 1) / 2;
    const int64_t partner = table ? n_blocks / 2 * block : block;  // pair's second block
    const int64_t block_lines = block * 2 / 64;
    const char *packed_end = (const char *)(packed + n_blocks * block);
    // Stream y's lines past the caches where a pair's 32 columns are whole 64-byte lines of
    // its rows and y outgrows L2 anyway: each line written at its row's stride had cost a
    // read from memory first (gate_up at 8,192 rows, 1 thread: 1.7x the time without).
    const int lines = !table && (uintptr_t)y % 64 == 0 && n * 2 % 64 == 0 &&
                      m * n * 2 >= STREAM_BYTES;
    const int rows_per_step = (int)((32 + k_blocks - 1) / k_blocks);
    const int by_rows = !table && amx_shares_rows(m, threads);
#pragma omp parallel num_threads(threads) if (threads > 1 && (by_rows || pairs > 1))
    {
        float sums[2][4][16][16] __attribute__((aligned(64)));
        Finished done = {NULL, 0, 0, 0, 0, 0};  // the block whose rows are being written
        int written = 0, configured = -1, turn = 0;
        int64_t thread = 0, team = 1;
#ifdef _OPENMP
        thread = omp_get_thread_num();
        team = omp_get_num_threads();
#endif
        // this thread's rows [row0, row_end) and pairs [pair0, pair_end): rows in whole row
        // tiles, or pairs, in contiguous shares
        const int64_t tiles = (m + 15) / 16;
        const int64_t row0 = by_rows ? tiles * thread / team * 16 : 0;
        const int64_t row_end = by_rows ? min64(m, tiles * (thread + 1) / team * 16) : m;
        const int64_t pair0 = by_rows ? 0 : pairs * thread / team;
        const int64_t pair_end = by_rows ? pairs : pairs * (thread + 1) / team;
        for (int64_t chunk = row0; chunk < row_end; chunk += CHUNK_ROWS) {
            const int64_t chunk_end = min64(row_end, chunk + CHUNK_ROWS);
            const int64_t steps = (chunk_end - chunk + 31) / 32 * k_blocks;
            const int64_t lines_per_step = (block_lines + steps - 1) / steps;
            for (int64_t pair = pair0; pair < pair_end; pair++) {
                const int64_t nb0 = table ? pair : pair * 2;
                const int two_columns = table || nb0 + 1 < n_blocks;
                const uint16_t *w0 = packed + nb0 * block, *w1 = w0 + partner;
                // the next pair's two blocks, a few lines of each per step
                const char *next0 = (const char *)(w0 + (table ? block : 2 * block));
                const char *next1 = next0 + partner * 2;
                const int64_t ahead = block_lines * 64;
                const char *end0 = next0 + ahead < packed_end ? next0 + ahead : packed_end;
                const char *end1 = next1 + ahead < packed_end ? next1 + ahead : packed_end;
                for (int64_t m0 = chunk; m0 < chunk_end; m0 += 32) {
                    const int rows0 = (int)(chunk_end - m0 < 16 ? chunk_end - m0 : 16);
                    const int64_t left = chunk_end - m0 - 16;
                    const int rows1 = (int)(left <= 0 ? 0 : (left < 16 ? left : 16));
                    if (rows0 * 32 + rows1 != configured) {  // only a chunk's last tiles differ
                        configure_many(rows0, rows1);
                        configured = rows0 * 32 + rows1;
                    }
                    const uint16_t *x0 = x + m0 * x_stride, *x1 = x0 + 16 * x_stride;
                    const int pending = done.rows0 + done.rows1;
                    _tile_zero(4);
                    _tile_zero(5);
                    if (rows1) {
                        _tile_zero(6);
                        _tile_zero(7);
                    }
                    for (int64_t kb = 0; kb < k_blocks; kb++) {
                        for (int64_t l = 0; l < lines_per_step && next0 < end0; l++, next0 += 64)
                            _mm_prefetch(next0, _MM_HINT_T1);
                        for (int64_t l = 0; l < lines_per_step && next1 < end1; l++, next1 += 64)
                            _mm_prefetch(next1, _MM_HINT_T1);
                        _tile_loadd(0, x0 + kb * 32, x_stride * 2);
                        _tile_loadd(2, w0 + kb * 512, 64);
                        _tile_dpbf16ps(4, 0, 2);
                        if (two_columns) {
                            _tile_loadd(3, w1 + kb * 512, 64);
                            _tile_dpbf16ps(5, 0, 3);
                        }
                        if (rows1) {
                            _tile_loadd(1, x1 + kb * 32, x_stride * 2);
                            _tile_dpbf16ps(6, 1, 2);
                            if (two_columns) _tile_dpbf16ps(7, 1, 3);
                        }
                        if (written < pending) {  // the previous block's rows, beside the tiles
                            const int to = written + rows_per_step < pending
                                               ? written + rows_per_step : pending;
                            write_rows(&done, written, to, bias, y, n, lines, table);
                            written = to;
                        }
                    }
                    write_rows(&done, written, pending, bias, y, n, lines, table);
                    float(*out)[16][16] = sums[turn];
                    turn ^= 1;
                    _tile_stored(4, out[0], 64);
                    if (two_columns) _tile_stored(5, out[1], 64);
                    if (rows1) _tile_stored(6, out[2], 64);
                    if (rows1 && two_columns) _tile_stored(7, out[3], 64);
                    done = (Finished){out, rows0, rows1, two_columns, m0, nb0};
                    written = 0;
                }
            }
        }
        write_rows(&done, written, done.rows0 + done.rows1, bias, y, n, lines, table);
        _tile_release();
        _mm_sfence();  // the streamed lines reach memory before the caller reads y
    }
}

// y [m, n] (row stride n) = x [m, k] (row stride x_stride elements) @ W.T (+ bias [n]),
// all bf16; W as amx_pack_weight packed it. Returns 0, or -1 for shapes it does not take.
// Both loops give each output the same sums in the same order: which one runs does not
// change a bit.
int amx_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                    int64_t n, int64_t k, const uint16_t *bias, uint16_t *y, int threads) {
    if (!amx_gemm_available() || n % 16 || k % 32 || m < 0 || x_stride < k) return -1;
    if (m == 0) return 0;
    if (m <= 16) few_rows(x, x_stride, m, packed, n, k, bias, y, threads);
    else many_rows(x, x_stride, m, packed, n, k, bias, y, threads, NULL);
    return 0;
}

// y [m, n / 2] = silu(gate) * up, where [gate | up] = x @ W.T (+ bias) as amx_linear_bf16
// computes it (W's first n / 2 rows the gate's): the same bits as amx_linear_bf16 then
// silu_mul_rows, without writing [gate | up] out. From 17 rows (a prompt); returns -1 for
// fewer (decode's few rows gain nothing) and for shapes it does not take.
int amx_linear_silu_mul_bf16(const uint16_t *x, int64_t x_stride, int64_t m,
                             const uint16_t *packed, int64_t n, int64_t k, const uint16_t *bias,
                             uint16_t *y, int threads) {
    if (!amx_gemm_available() || n % 32 || k % 32 || m <= 16 || x_stride < k) return -1;
    many_rows(x, x_stride, m, packed, n, k, bias, y, threads, silu_bf16_table());
    return 0;
}

#else  // no AMX here: the engine keeps its other GEMMs

int amx_gemm_available(void) { return 0; }

int amx_shares_rows(int64_t m, int threads) {
    (void)m, (void)threads;
    return 0;
}

void amx_pack_weight(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed, int threads) {
    (void)w, (void)n, (void)k, (void)packed, (void)threads;
}

int amx_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                    int64_t n, int64_t k, const uint16_t *bias, uint16_t *y, int threads) {
    (void)x, (void)x_stride, (void)m, (void)packed, (void)n, (void)k, (void)bias, (void)y;
    (void)threads;
    return -1;
}

int amx_linear_silu_mul_bf16(const uint16_t *x, int64_t x_stride, int64_t m,
                             const uint16_t *packed, int64_t n, int64_t k, const uint16_t *bias,
                             uint16_t *y, int threads) {
    (void)x, (void)x_stride, (void)m, (void)packed, (void)n, (void)k, (void)bias, (void)y;
    (void)threads;
    return -1;
}

#endif
