// Causal prefill attention in bf16 on AMX tiles (Sapphire Rapids and later): for each
// sequence of a batch, as prefill_attention_bf16 in prefill_attention_cpu.c does for one,
// its new tokens over its cached prefix plus themselves; head_dim 32 or 64.
//
// Why transposed: the softmax is what bounds attention once AMX does the products, and it
// is cheapest with one query per lane. So the kernel computes S^T = K Q^T (keys x queries)
// and O^T = V^T P^T: each register of scores is one key for 16 queries, the row maxima and
// sums are lane-wise (no horizontal reductions), and two keys' probabilities, interleaved,
// are one row of the B operand of the next product as they stand.
//
// Work goes out in groups of 16 queries of one KV head's query heads, keys in chunks of
// 128: the exact maximum within a chunk, an online softmax across chunks (O^T is rescaled
// in memory, where it waits between chunks anyway). The group's query heads take each
// chunk in turn, so its keys and V^T come from L2 once and from L1 after (prefetched
// during the softmax). The next chunk's S^T is issued on the tiles between this one's
// softmax rows; measured, that costs the same as issuing it alone, not less.
//
// Precision as torch's CPU flash kernel for bf16 (and prefill_attention_cpu.c): q.k exact
// and summed in fp32, softmax in fp32 (online across chunks, as torch's), probabilities
// rounded to bf16 for the product with V, summed in fp32, one rounding at the end.
//
//   q      [T, Hq, D] bf16, every sequence's new tokens, rows q_stride elements apart
//          (heads D apart)
//   k, v   [T, Hkv, D] bf16, the new tokens' keys and values, rows k_stride / v_stride apart
//   caches [N, bs, Hkv, D] contiguous, read for a prefix through its block table: bf16, or
//          fp8 e4m3 (cache_fp8) with scales [N, Hkv], each value widened as the torch path
//          does (fp32 value times its block's scale, rounded to bf16)
//   out    [T, Hq, D] bf16, rows out_stride apart

#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_native.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define QUERIES 16  // queries per work item: the tiles' 16 columns
#define KEYS 32     // keys per step: the K of the product with V (32 bf16 a tile row)

// Every tile is 16 rows of 64 bytes (amx_configure_16x64; what each holds when: see "Tile
// use" below). 2^x is exp2_16 (cpu_native.h), with FTZ set in the kernel's threads.

typedef struct {
    const uint16_t *q;
    int64_t q_stride, n, prefix, S, Hq, Hkv, D;
    float scale;
    uint16_t *out;
    int64_t out_stride;
    const uint16_t *keys;      // [Hkv][steps * KEYS][D]: rows of K, zeros past S
    const uint16_t *values_t;  // [Hkv][steps][D][KEYS]: V^T per step, zeros past S
    int64_t steps;
} Attention;

// Where a prompt's cached prefix is: pages through the block table, bf16 or fp8 e4m3 with a
// scale per block and KV head.
typedef struct {
    const void *k, *v;
    const float *k_scale, *v_scale;  // fp8 only
    const int32_t *table;
    int64_t block_size;
    int fp8;
} Prefix;

// Row `at` of the cache (block * bs + row) for KV head h, as D bf16 values: into dst[d *
// step] (step 1 for keys' rows, KEYS for V^T's columns).
static inline void prefix_row(const Prefix *c, const void *cache, const float *scales,
                              int64_t at, int64_t block, int64_t Hkv, int64_t h, int64_t D,
                              uint16_t *dst, int64_t step) {
    if (c->fp8) {
        const uint8_t *row = (const uint8_t *)cache + (at * Hkv + h) * D;
        const float scale = scales[block * Hkv + h];
        for (int64_t d = 0; d < D; d++) dst[d * step] = float_to_bf16(from_e4m3(row[d]) * scale);
    } else {
        const uint16_t *row = (const uint16_t *)cache + (at * Hkv + h) * D;
        for (int64_t d = 0; d < D; d++) dst[d * step] = row[d];
    }
}

// 16 x 16 32-bit elements transposed in registers: rows[i] lane j <- rows[j] lane i. Four
// rounds of shuffles; a gather per output row cost ~10x as much here.
static inline void transpose16x16(__m512i rows[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {  // 2 x 2 blocks of 32-bit elements
        t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // 4 x 4: rows[i + e] = element e of each 128 bits
        rows[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        rows[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        rows[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        rows[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)  // 8 x 8: 128-bit lanes 0, 2 and 1, 3 of row pairs
        for (int j = 0; j < 4; j++) {
            t[i + j] = _mm512_shuffle_i32x4(rows[i + j], rows[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_i32x4(rows[i + j], rows[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; j++) {  // 16 x 16
        rows[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
        rows[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
    }
}

// Step s's KEYS new tokens (rows j0 - prefix ... of k and v, all present) for KV head h:
// the keys' rows copied, V^T [D][KEYS] by transposes. Each pair of keys' values is
// interleaved into 32-bit pairs (key 2p's dim d, key 2p + 1's), 16 dims a register; then
// 16 pairs x 16 dims transposed is 16 rows of V^T.
static void pack_new_step(const Attention *a, const uint16_t *k, int64_t k_stride,
                          const uint16_t *v, int64_t v_stride, int64_t h, int64_t j0,
                          uint16_t *kt, uint16_t *vt) {
    const int64_t D = a->D, first = j0 - a->prefix;
    for (int64_t j = 0; j < KEYS; j++)
        memcpy(kt + j * D, k + (first + j) * k_stride + h * D, sizeof(uint16_t) * D);
    const __m512i low = _mm512_set_epi16(  // dims 0-15 of two rows, interleaved
        47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
        35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));  // dims 16-31
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
        __m512i lo[16], hi[16];  // pair p's dims d0 .. d0 + 15, d0 + 16 .. d0 + 31
        for (int p = 0; p < 16; p++) {
            const uint16_t *row = v + (first + 2 * p) * v_stride + h * D + d0;
            const __m512i even = _mm512_loadu_si512(row), odd = _mm512_loadu_si512(row + v_stride);
            lo[p] = _mm512_permutex2var_epi16(even, low, odd);
            hi[p] = _mm512_permutex2var_epi16(even, high, odd);
        }
        transpose16x16(lo);
        transpose16x16(hi);
        for (int i = 0; i < 16; i++) {
            _mm512_store_si512(vt + (d0 + i) * KEYS, lo[i]);
            _mm512_store_si512(vt + (d0 + 16 + i) * KEYS, hi[i]);
        }
    }
}

// One KV head's keys (rows as they are) and values (transposed per step of KEYS keys),
// from the cache for the prefix and from k / v for the new tokens.
static void pack_head(const Attention *a, const uint16_t *k, int64_t k_stride,
                      const uint16_t *v, int64_t v_stride, const Prefix *prefix, int64_t h,
                      uint16_t *keys, uint16_t *values_t) {
    const int64_t D = a->D, padded = a->steps * KEYS;
    uint16_t *kh = keys + h * padded * D, *vh = values_t + h * padded * D;
    for (int64_t j = 0; j < padded; j++) {
        if (j % KEYS == 0 && j >= a->prefix && j + KEYS <= a->S) {  // a step of new tokens
            pack_new_step(a, k, k_stride, v, v_stride, h, j, kh + j * D, vh + j * D);
            j += KEYS - 1;
            continue;
        }
        uint16_t *kt = kh + j * D, *vt = vh + (j / KEYS) * D * KEYS + j % KEYS;
        if (j < a->prefix) {
            const int64_t block = prefix->table[j / prefix->block_size];
            const int64_t at = block * prefix->block_size + j % prefix->block_size;
            prefix_row(prefix, prefix->k, prefix->k_scale, at, block, a->Hkv, h, D, kt, 1);
            prefix_row(prefix, prefix->v, prefix->v_scale, at, block, a->Hkv, h, D, vt, KEYS);
        } else if (j < a->S) {
            const uint16_t *kr = k + (j - a->prefix) * k_stride + h * D;
            const uint16_t *vr = v + (j - a->prefix) * v_stride + h * D;
            memcpy(kt, kr, sizeof(uint16_t) * D);
            for (int64_t d = 0; d < D; d++) vt[d * KEYS] = vr[d];
        } else {
            memset(kt, 0, sizeof(uint16_t) * D);
            for (int64_t d = 0; d < D; d++) vt[d * KEYS] = 0;
        }
    }
}

// 16 queries of one q head, and where they sit.
typedef struct {
    int64_t head, i0, rows;
    int64_t first;  // position of query lane 0 (prefix + i0)
    int64_t steps;  // steps of KEYS keys through the last query's own key
    const uint16_t *keys_h, *values_h;
} Item;

// Work goes out in groups: one query block of one KV head, with that head's G query
// heads. Groups KV head by KV head (a core then keeps one head's keys and values in L2),
// within a head from the longest (the last query block) down.
static int64_t group_count(const Attention *a) {
    return (a->n + QUERIES - 1) / QUERIES * a->Hkv;
}

// Query head g of group `index`.
static Item item_at(const Attention *a, int64_t index, int64_t g) {
    const int64_t blocks = (a->n + QUERIES - 1) / QUERIES, group = a->Hq / a->Hkv;
    const int64_t h = index / blocks, b = blocks - 1 - index % blocks;
    const int64_t padded = a->steps * KEYS;
    Item it = {h * group + g, b * QUERIES,
               a->n - b * QUERIES < QUERIES ? a->n - b * QUERIES : QUERIES,
               a->prefix + b * QUERIES, 0, a->keys + h * padded * a->D,
               a->values_t + h * padded * a->D};
    it.steps = (it.first + it.rows - 1) / KEYS + 1;
    return it;
}

// Steps per chunk: 128 keys, whose K and V^T (2 x 16 KiB for head_dim 64) stay in L1 for
// the group's query heads, and a thread's scores with them whatever the prompt's length.
#define CHUNK_STEPS 4

// A chunk's working memory: its S^T and P^T. A thread has two: the chunk in its softmax
// and the next one on the tiles.
typedef struct {
    float *scores;    // [CHUNK_STEPS * KEYS][16]: S^T, one row of 16 queries per key
    uint16_t *probs;  // [CHUNK_STEPS][KEYS/2][16][2]: P^T in bf16, key pairs per query
} Scratch;

// Steps [s0, s1) of query head g of a group.
typedef struct {
    Item it;
    int64_t s0, s1, g;
} Chunk;

// Q^T as B tiles: row i of tile t = dims 32t + 2i, 32t + 2i + 1 of each query, one 32-bit
// pair per query (zeros for queries past the rows): the queries' rows, 32-bit pairs
// transposed 16 at a time.
static void gather_queries(const Attention *a, const Item *it, uint16_t *q_t) {
    const uint16_t *q0 = a->q + it->i0 * a->q_stride + it->head * a->D;
    for (int64_t p0 = 0; p0 < a->D / 2; p0 += 16) {  // 16 pairs = 32 dims
        __m512i rows[16];
        for (int64_t r = 0; r < 16; r++)
            rows[r] = r < it->rows ? _mm512_loadu_si512(q0 + r * a->q_stride + 2 * p0)
                                   : _mm512_setzero_si512();
        transpose16x16(rows);
        for (int i = 0; i < 16; i++) _mm512_store_si512(q_t + (p0 + i) * 32, rows[i]);
    }
}

// Tile use (each 16 rows x 64 bytes): 4-5 = Q^T of the query head whose S^T is on the
// tiles, 0-1 = K rows (A), 2-3 and 6-7 = S^T of two steps; then, for the product with
// V, 4-7 = O^T (16 dims each), 0-1 = V^T rows (A), 2-3 = P^T (B).
static void load_queries(const Attention *a, const uint16_t *q_t) {
    _tile_loadd(4, q_t, 64);
    if (a->D == 64) _tile_loadd(5, q_t + 512, 64);
}

// Sums tile C += A tile x Q^T's tile for the dims of `half` (tile 4: dims 0-31, 5: 32-63).
// (Literal tile numbers throughout: the intrinsics take constants.)
#define TIMES_QUERIES(C, A, half)                          \
    do {                                                   \
        if (half) _tile_dpbf16ps(C, A, 5);                 \
        else _tile_dpbf16ps(C, A, 4);                      \
    } while (0)

// S^T = K Q^T for steps s and s + 1 of chunk c (keys [32 s, 32 s + 64)), or s alone where it
// is the chunk's last, into the chunk's scores (a row of 16 queries per key); Q^T in tiles
// 4-5. Two steps take four sums (16 keys each), so that each one's second product comes four
// products after its first (not right behind it, as with a step's pair of sums alone: ~1.4x
// the time measured here); two A tiles in turn. Returns the steps issued.
static inline int key_scores(const Attention *a, const Chunk *c, float *scores, int64_t s) {
    const int64_t D = a->D;
    const int two = s + 1 < c->s1;
    const uint16_t *k0 = c->it.keys_h + s * KEYS * D;
    float *out = scores + (s - c->s0) * KEYS * 16;
    _tile_zero(2);
    _tile_zero(3);
    if (two) {
        _tile_zero(6);
        _tile_zero(7);
    }
    for (int half = 0; half < D / 32; half++) {
        const uint16_t *k = k0 + 32 * half;
        _tile_loadd(0, k, D * 2);
        TIMES_QUERIES(2, 0, half);
        _tile_loadd(1, k + 16 * D, D * 2);
        TIMES_QUERIES(3, 1, half);
        if (two) {
            _tile_loadd(0, k + 32 * D, D * 2);
            TIMES_QUERIES(6, 0, half);
            _tile_loadd(1, k + 48 * D, D * 2);
            TIMES_QUERIES(7, 1, half);
        }
    }
    _tile_stored(2, out, 64);
    _tile_stored(3, out + 16 * 16, 64);
    if (two) {
        _tile_stored(6, out + 32 * 16, 64);
        _tile_stored(7, out + 48 * 16, 64);
    }
    return two ? 2 : 1;
}
#undef TIMES_QUERIES

// Which of the 16 queries (positions first .. first + 15) see key j: causal.
static inline __mmask16 visible(int64_t first, int64_t j) {
    if (j <= first) return 0xFFFF;
    if (j > first + 15) return 0;
    return (__mmask16)(0xFFFFu << (j - first));
}

// Each query's maximum score over the chunk's keys that it sees (-inf if none). Keys up
// to `first` are seen by all 16; four running maxima, as max's latency is 4 of its throughput.
static __m512 row_maxima(const Chunk *c, const float *scores) {
    const int64_t j0 = c->s0 * KEYS, j1 = c->s1 * KEYS;
    const int64_t open = c->it.first + 1 < j1 ? c->it.first + 1 : j1;
    __m512 tops[4];
    for (int i = 0; i < 4; i++) tops[i] = _mm512_set1_ps(-INFINITY);
    int64_t j = j0;
    for (; j + 4 <= open; j += 4)
        for (int i = 0; i < 4; i++)
            tops[i] = _mm512_max_ps(tops[i], _mm512_load_ps(scores + (j + i - j0) * 16));
    for (; j < j1; j++)
        tops[0] = _mm512_mask_max_ps(tops[0], visible(c->it.first, j), tops[0],
                                     _mm512_load_ps(scores + (j - j0) * 16));
    return _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
}

// P^T = 2^(s * factor - shift) in bf16 (0 where masked), key pairs interleaved per query;
// returns the rows' sums in fp32. Between steps it issues the next chunk's S^T (its Q^T
// already in tiles 4-5), two steps at a time, on the tiles; next may be NULL.
// Everything the loop reads is in locals first: its stores (vector types, which may alias
// anything) had made the compiler reload each field every two keys.
static __m512 probabilities(const Chunk *c, const Scratch *w, __m512 factor, __m512 shift,
                            const Attention *a, const Chunk *next, const Scratch *next_w) {
    const int64_t j0 = c->s0 * KEYS, j1 = c->s1 * KEYS, first = c->it.first;
    const int64_t open = first + 1;  // keys before it are seen by all 16 queries
    const __m512i interleave = _mm512_set_epi16(  // word 2i: key j's lane i, 2i + 1: key j + 1's
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int64_t key_bytes = KEYS * a->D * 2;  // one step's keys
    __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t issued = next ? next->s0 : 0;  // the next chunk's steps on the tiles so far
    const int64_t next_end = next ? next->s1 : 0;
    // Into L1 ahead of the tiles, 4 lines of each every two keys: this chunk's V^T, and the
    // keys of the next chunk's steps still to be issued.
    const char *values = (const char *)(c->it.values_h + c->s0 * KEYS * a->D);
    const char *keys = NULL, *keys_end = NULL;
    const float *rows = w->scores;
    uint16_t *out = w->probs;
    for (int64_t j = j0; j < j1; j += 2, rows += 32, out += 32, values += 256) {
        if (j % (2 * KEYS) == 0 && issued < next_end) {
            issued += key_scores(a, next, next_w->scores, issued);
            keys = (const char *)next->it.keys_h + issued * key_bytes;
            keys_end = keys + (next_end - issued < 2 ? next_end - issued : 2) * key_bytes;
        }
        if (keys < keys_end) {
            for (int l = 0; l < 4; l++) _mm_prefetch(keys + l * 64, _MM_HINT_T0);
            keys += 256;
        }
        for (int l = 0; l < 4; l++) _mm_prefetch(values + l * 64, _MM_HINT_T0);
        __m512 p[2];
        for (int e = 0; e < 2; e++) {
            const __m512 x = _mm512_fmsub_ps(_mm512_load_ps(rows + e * 16), factor, shift);
            p[e] = exp2_16(x);
        }
        if (j + 2 > open)  // the diagonal: later queries only
            for (int e = 0; e < 2; e++) p[e] = _mm512_maskz_mov_ps(visible(first, j + e), p[e]);
        sums[0] = _mm512_add_ps(sums[0], p[0]);
        sums[1] = _mm512_add_ps(sums[1], p[1]);
        // bf16 of keys j (low half) and j + 1 (high half), then pairs per query
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]);
        _mm512_store_si512(out, _mm512_permutexvar_epi16(interleave, both));
    }
    while (issued < next_end) issued += key_scores(a, next, next_w->scores, issued);
    return _mm512_add_ps(sums[0], sums[1]);
}

// O^T += V^T P^T for step s, in tiles 4-7 (free: the next chunk's S^T is done).
#define VALUES_STEP(B, s)                                          \
    do {                                                           \
        const uint16_t *vt_ = c->it.values_h + (s) * D * KEYS;     \
        _tile_loadd(B, w->probs + ((s) - c->s0) * KEYS * 16, 64);  \
        _tile_loadd(0, vt_, KEYS * 2);                             \
        _tile_dpbf16ps(4, 0, B);                                   \
        _tile_loadd(1, vt_ + 16 * KEYS, KEYS * 2);                 \
        _tile_dpbf16ps(5, 1, B);                                   \
        if (D == 64) {                                             \
            _tile_loadd(0, vt_ + 32 * KEYS, KEYS * 2);             \
            _tile_dpbf16ps(6, 0, B);                               \
            _tile_loadd(1, vt_ + 48 * KEYS, KEYS * 2);             \
            _tile_dpbf16ps(7, 1, B);                               \
        }                                                          \
    } while (0)

// o_t [D][16] += the chunk's V^T P^T; for an item's first chunk, o_t = V^T P^T (the tiles
// start from zeros, not from o_t: short prompts' items are mostly one chunk).
static void add_values(const Attention *a, const Chunk *c, const Scratch *w, float *o_t) {
    const int64_t D = a->D;
    if (c->s0 == 0) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
    } else {
        _tile_loadd(4, o_t, 64);
        _tile_loadd(5, o_t + 256, 64);
        if (D == 64) {
            _tile_loadd(6, o_t + 512, 64);
            _tile_loadd(7, o_t + 768, 64);
        }
    }
    int64_t s = c->s0;
    for (; s + 2 <= c->s1; s += 2) {
        VALUES_STEP(2, s);
        VALUES_STEP(3, s + 1);
    }
    if (s < c->s1) VALUES_STEP(2, s);
    _tile_stored(4, o_t, 64);
    _tile_stored(5, o_t + 256, 64);
    if (D == 64) {
        _tile_stored(6, o_t + 512, 64);
        _tile_stored(7, o_t + 768, 64);
    }
}
#undef VALUES_STEP

// O = O^T transposed / l into out's rows, 16 dims at a time.
static void write_out(const Attention *a, const Item *it, const float *o_t, __m512 sum) {
    const __m512 inverse = _mm512_div_ps(_mm512_set1_ps(1.0f), sum);
    for (int64_t d0 = 0; d0 < a->D; d0 += 16) {
        __m512i rows[16];  // dim d0 + i's 16 queries, then query r's 16 dims
        for (int i = 0; i < 16; i++)
            rows[i] = _mm512_castps_si512(
                _mm512_mul_ps(_mm512_load_ps(o_t + (d0 + i) * QUERIES), inverse));
        transpose16x16(rows);
        for (int64_t r = 0; r < it->rows; r++) {
            uint16_t *o = a->out + (it->i0 + r) * a->out_stride + it->head * a->D + d0;
            _mm256_storeu_si256((__m256i *)o,
                                (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(rows[r])));
        }
    }
}

// The unit after c among a thread's groups (thread, thread + threads, ...: longest first,
// so the threads end together): the chunk's next query head, else the next chunk's first,
// else the next group's; 0 when c was the last.
static int following(const Attention *a, const Chunk *c, int64_t *index, int threads,
                     Chunk *next) {
    if (c->g + 1 < a->Hq / a->Hkv) {
        *next = (Chunk){item_at(a, *index, c->g + 1), c->s0, c->s1, c->g + 1};
        return 1;
    }
    if (c->s1 < c->it.steps) {
        const int64_t s1 = c->s1 + CHUNK_STEPS < c->it.steps ? c->s1 + CHUNK_STEPS : c->it.steps;
        *next = (Chunk){item_at(a, *index, 0), c->s1, s1, 0};
        return 1;
    }
    if (*index + threads >= group_count(a)) return 0;
    *index += threads;
    const Item it = item_at(a, *index, 0);
    *next = (Chunk){it, 0, CHUNK_STEPS < it.steps ? CHUNK_STEPS : it.steps, 0};
    return 1;
}

// Per query head of the group in hand: Q^T, O^T so far, and the online softmax's state.
typedef struct {
    uint16_t *q_t[2];  // [G][D/32][16 dim pairs][16 queries][2]: this group's, the next's
    float *o_t;        // [G][D][16]
    float *tops;       // [G][16]: each query's largest score so far
    float *sums;       // [G][16]: its sum of 2^((s - top) * scale * log2 e) so far
} Heads;

// A thread's units, each one's S^T computed on the tiles during the softmax of the one
// before it.
static void attend_items(const Attention *a, int thread, int threads, Scratch w[2],
                         const Heads *heads) {
    int64_t index = thread;
    if (index >= group_count(a)) return;
    const int64_t G = a->Hq / a->Hkv, q_size = a->D * QUERIES, o_size = a->D * QUERIES;
    const __m512 factor = _mm512_set1_ps(a->scale * 1.44269504088896341f);
    const Item first = item_at(a, index, 0);
    Chunk c = {first, 0, CHUNK_STEPS < first.steps ? CHUNK_STEPS : first.steps, 0};
    int q_at = 0;  // which q_t holds c's group's queries
    for (int64_t g = 0; g < G; g++) {
        const Item it = item_at(a, index, g);
        gather_queries(a, &it, heads->q_t[q_at] + g * q_size);
    }
    load_queries(a, heads->q_t[q_at]);
    for (int64_t s = c.s0; s < c.s1;) s += key_scores(a, &c, w[0].scores, s);
    for (int cur = 0;; cur ^= 1) {
        Chunk next;
        const int has_next = following(a, &c, &index, threads, &next);
        const int new_group = has_next && next.s0 == 0 && next.g == 0;
        const int next_q = new_group ? q_at ^ 1 : q_at;
        if (new_group)
            for (int64_t g = 0; g < G; g++) {
                const Item it = item_at(a, index, g);
                gather_queries(a, &it, heads->q_t[next_q] + g * q_size);
            }
        if (has_next) load_queries(a, heads->q_t[next_q] + next.g * q_size);
        float *o_t = heads->o_t + c.g * o_size, *tops = heads->tops + c.g * 16;
        float *sums = heads->sums + c.g * 16;
        if (c.s0 == 0) {  // a new item (add_values starts its O^T from zeros)
            _mm512_store_ps(tops, _mm512_set1_ps(-INFINITY));
            _mm512_store_ps(sums, _mm512_setzero_ps());
        }
        const __m512 top = _mm512_load_ps(tops);
        const __m512 new_top = _mm512_max_ps(top, row_maxima(&c, w[cur].scores));
        __m512 sum = _mm512_load_ps(sums);
        if (c.s0 > 0 && _mm512_cmp_ps_mask(new_top, top, _CMP_GT_OQ)) {
            // a larger maximum: what was summed against the old one shrinks by 2^(old - new),
            // at most by 2^-60 (past that it is nothing next to the new maximum's 1, and
            // the products stay clear of subnormals)
            const __m512 alpha = exp2_16(_mm512_max_ps(
                _mm512_mul_ps(_mm512_sub_ps(top, new_top), factor), _mm512_set1_ps(-60.0f)));
            sum = _mm512_mul_ps(sum, alpha);
            for (int64_t d = 0; d < a->D; d++)
                _mm512_store_ps(o_t + d * 16, _mm512_mul_ps(_mm512_load_ps(o_t + d * 16), alpha));
        }
        sum = _mm512_add_ps(sum, probabilities(&c, &w[cur], factor, _mm512_mul_ps(new_top, factor),
                                               a, has_next ? &next : NULL, &w[cur ^ 1]));
        _mm512_store_ps(tops, new_top);
        _mm512_store_ps(sums, sum);
        add_values(a, &c, &w[cur], o_t);
        if (c.s1 == c.it.steps) write_out(a, &c.it, o_t, sum);
        if (!has_next) return;
        c = next;
        q_at = next_q;
    }
}
#endif

int prefill_attention_amx_available(void) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    return amx_gemm_available();
#else
    return 0;
#endif
}

// A batch of sequences in one call: sequence b's new tokens are rows starts[b] ..
// starts[b] + lengths[b] of q, k, v and out, after prefixes[b] cached tokens whose pages are
// tables[table_starts[b] ...]. Every sequence's keys are packed first, then the threads
// take every sequence's groups in turn, each sequence's longest first and the first of them
// to the next thread in turn, so one parallel region and one set of scratch serve the batch.
// Returns 0; -1 without AMX or scratch memory; -2 for a D it does not take (32 and 64).
int prefill_attention_amx_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                               int64_t k_stride, const uint16_t *v, int64_t v_stride,
                               const void *k_cache, const void *v_cache, const int32_t *tables,
                               const int64_t *table_starts, int64_t block_size, int64_t count,
                               const int64_t *starts, const int64_t *lengths,
                               const int64_t *prefixes, int64_t Hq, int64_t Hkv, int64_t D,
                               float scale, uint16_t *out, int64_t out_stride, int threads,
                               const float *k_scale, const float *v_scale, int cache_fp8) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (D != 32 && D != 64) return -2;
    if (!amx_gemm_available()) return -1;
    if (count <= 0) return 0;
    Attention *seqs = malloc(sizeof(Attention) * count);
    size_t *packed_at = malloc(sizeof(size_t) * (count + 1));  // each one's K, then V^T
    if (seqs == NULL || packed_at == NULL) {
        free(seqs);
        free(packed_at);
        return -1;
    }
    packed_at[0] = 0;
    for (int64_t b = 0; b < count; b++) {
        const int64_t S = prefixes[b] + lengths[b], steps = (S + KEYS - 1) / KEYS;
        seqs[b] = (Attention){q + starts[b] * q_stride, q_stride, lengths[b], prefixes[b], S,
                              Hq, Hkv, D, scale, out + starts[b] * out_stride, out_stride,
                              NULL, NULL, steps};
        packed_at[b + 1] = packed_at[b] + 2 * (size_t)Hkv * steps * KEYS * D;
    }
    const size_t packed_size = packed_at[count] ? packed_at[count] : 32;  // 0: sequences of 0
    uint16_t *packed = aligned_alloc(64, sizeof(uint16_t) * packed_size);
    if (packed == NULL) {
        free(seqs);
        free(packed_at);
        return -1;
    }
    for (int64_t b = 0; b < count; b++) {
        seqs[b].keys = packed + packed_at[b];
        seqs[b].values_t = packed + packed_at[b] + Hkv * seqs[b].steps * KEYS * D;
    }
    int failed = 0;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(dynamic)
        for (int64_t bh = 0; bh < count * Hkv; bh++) {
            const int64_t b = bh / Hkv, h = bh % Hkv;
            const Prefix cached = {k_cache, v_cache, k_scale, v_scale,
                                   tables ? tables + table_starts[b] : NULL, block_size,
                                   cache_fp8};
            pack_head(&seqs[b], k + starts[b] * k_stride, k_stride, v + starts[b] * v_stride,
                      v_stride, &cached, h, (uint16_t *)seqs[b].keys,
                      (uint16_t *)seqs[b].values_t);
        }
        Scratch w[2];
        const size_t keys = CHUNK_STEPS * KEYS, G = (size_t)(Hq / Hkv);
        for (int i = 0; i < 2; i++) {
            w[i].scores = aligned_alloc(64, sizeof(float) * keys * QUERIES);
            w[i].probs = aligned_alloc(64, sizeof(uint16_t) * keys * QUERIES);
        }
        Heads heads = {{aligned_alloc(64, sizeof(uint16_t) * G * 64 * QUERIES),
                        aligned_alloc(64, sizeof(uint16_t) * G * 64 * QUERIES)},
                       aligned_alloc(64, sizeof(float) * G * 64 * QUERIES),
                       aligned_alloc(64, sizeof(float) * G * QUERIES),
                       aligned_alloc(64, sizeof(float) * G * QUERIES)};
        const int ready = w[0].scores && w[1].scores && w[0].probs && w[1].probs &&
                          heads.q_t[0] && heads.q_t[1] && heads.o_t && heads.tops && heads.sums;
        if (!ready) {
#pragma omp atomic write
            failed = 1;
        }
        if (ready) {
            const unsigned int csr = _mm_getcsr();
            _mm_setcsr(csr | 0x8000);  // FTZ: no subnormal results (see exp2_16)
            amx_configure_16x64();
            int thread = 0, team = 1;
#ifdef _OPENMP
            thread = omp_get_thread_num();
            team = omp_get_num_threads();
#endif
            for (int64_t b = 0; b < count; b++)
                attend_items(&seqs[b], (int)((thread + b) % team), team, w, &heads);
            _tile_release();
            _mm_setcsr(csr);
        }
        for (int i = 0; i < 2; i++) {
            free(w[i].scores);
            free(w[i].probs);
            free(heads.q_t[i]);
        }
        free(heads.o_t);
        free(heads.tops);
        free(heads.sums);
    }
    free(packed);
    free(packed_at);
    free(seqs);
    return failed ? -1 : 0;
#else
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)k_cache;
    (void)v_cache, (void)tables, (void)table_starts, (void)block_size, (void)count;
    (void)starts, (void)lengths, (void)prefixes, (void)Hq, (void)Hkv, (void)D, (void)scale;
    (void)out, (void)out_stride, (void)threads, (void)k_scale, (void)v_scale, (void)cache_fp8;
    return -1;
#endif
}
