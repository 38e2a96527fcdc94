// Whether a core runs AMX tile products and other instructions at the same time: the time
// of a round of 4 tile products alone, of a round of vector (or scalar) work alone, and of
// both interleaved in one loop. Built and run by benchmarks/amx_overlap.py, which prints the
// table; on its own:
//
//   cc -O3 -march=native amx_overlap.c -o amx_overlap && ./amx_overlap ROUNDS
//
// Each line: work, ns per round alone, ns per round with the products, ns of products alone
// ("+loads": the products with their A tiles loaded each round).
// Why it matters: the prefill attention kernel (engine/kernels/prefill_attention_amx.c)
// issues its tile products between the softmax's vector instructions expecting the two to
// overlap; where they do not, its time is their sum.

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "../engine/kernels/cpu_native.h"  // amx_configure_16x64, exp2_16: the kernel's own

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint16_t operands[2048] __attribute__((aligned(64)));

enum { NONE, FMA512, PERMUTE512, FMA256, SCALAR, EXP512, EXP256, KINDS };
static const char *names[KINDS] = {"none",   "fma512", "permute512", "fma256",
                                   "scalar", "exp512", "exp256"};

// The prefill attention's 2^x (exp2_16, cpu_native.h) on 8 lanes: the same steps and the
// same coefficients (EXP2_C5 .. EXP2_C0).
static inline __m256 exp2_8(__m256 x) {
    const __m256 f = _mm256_reduce_ps(x, EXP2_FLOOR_FRACTION);
    __m256 p = _mm256_set1_ps(EXP2_C5);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C0));
    return _mm256_scalef_ps(p, x);
}

// `rounds` rounds of: 4 tile products (on four sums, so no product waits for another) when
// `products` (2: each of the two A tiles loaded from L1 before its products, as the
// attention kernel loads its keys), then `repeat` x 8 independent instructions of `kind` (for exp512 / exp256:
// 2^x of 16 / 8 lanes, 8 instructions each).
static double run(int products, int kind, int repeat, long rounds) {
    __m512 a[8];
    __m256 b[8];
    __m512i c[8];
    const __m512 m = _mm512_set1_ps(0.999f), add = _mm512_set1_ps(0.001f);
    const __m256 m2 = _mm256_set1_ps(0.999f), add2 = _mm256_set1_ps(0.001f);
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                           9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                           17, 1, 16, 0);
    for (int i = 0; i < 8; i++) {
        a[i] = _mm512_set1_ps((float)i);
        b[i] = _mm256_set1_ps((float)i);
        c[i] = _mm512_set1_epi32(i);
    }
    long x = 1;
    const double start = now();
    for (long r = 0; r < rounds; r++) {
        if (products == 2) {
            _tile_loadd(0, operands, 64);
            _tile_dpbf16ps(2, 0, 4);
            _tile_loadd(1, operands + 512, 64);
            _tile_dpbf16ps(3, 1, 4);
            _tile_dpbf16ps(6, 0, 5);
            _tile_dpbf16ps(7, 1, 5);
        } else if (products) {
            _tile_dpbf16ps(2, 0, 4);
            _tile_dpbf16ps(3, 1, 4);
            _tile_dpbf16ps(6, 0, 5);
            _tile_dpbf16ps(7, 1, 5);
        }
        for (int k = 0; k < repeat; k++) {
            if (kind == FMA512)
                for (int i = 0; i < 8; i++) a[i] = _mm512_fmadd_ps(a[i], m, add);
            if (kind == PERMUTE512)
                for (int i = 0; i < 8; i++) c[i] = _mm512_permutexvar_epi16(order, c[i]);
            if (kind == FMA256)
                for (int i = 0; i < 8; i++) b[i] = _mm256_fmadd_ps(b[i], m2, add2);
            if (kind == SCALAR)
                for (int i = 0; i < 8; i++) {
                    x = x * 3 + i;
                    __asm__ volatile("" ::"r"(x));
                }
            if (kind == EXP512)  // arguments <= 0, as the softmax's
                for (int i = 0; i < 8; i++) a[i] = exp2_16(_mm512_sub_ps(a[i], add));
            if (kind == EXP256)
                for (int i = 0; i < 8; i++) b[i] = exp2_8(_mm256_sub_ps(b[i], add2));
        }
    }
    const double seconds = now() - start;
    // keep the results live
    float sink[16];
    __m512 s = a[0];
    for (int i = 1; i < 8; i++) s = _mm512_add_ps(s, a[i]);
    _mm512_storeu_ps(sink, s);
    volatile float keep = sink[0] + b[0][0] + (float)_mm512_cvtsi512_si32(c[0]) + (float)x;
    (void)keep;
    return seconds / rounds * 1e9;
}

int main(int argc, char **argv) {
    const long rounds = argc > 1 ? atol(argv[1]) : 2000000;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) {
        fprintf(stderr, "the kernel refused AMX to this process\n");
        return 2;
    }
    amx_configure_16x64();
    for (int i = 0; i < 2048; i++) operands[i] = (uint16_t)(0x3f80 + i % 7);
    _tile_loadd(0, operands, 64);
    _tile_loadd(1, operands + 512, 64);
    _tile_loadd(4, operands + 1024, 64);
    _tile_loadd(5, operands + 1536, 64);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(6);
    _tile_zero(7);
    for (int loads = 0; loads < 2; loads++) {
        const int mode = loads ? 2 : 1;
        const double products = run(mode, NONE, 0, rounds);
        for (int kind = FMA512; kind < KINDS; kind++) {
            // rounds of 32, 64, 128 instructions; an exp is 8, so 8 or 16 of them
            const int exp = kind == EXP512 || kind == EXP256;
            if (loads && !exp) continue;
            for (int repeat = exp ? 1 : 4; repeat <= (exp ? 2 : 16); repeat *= 2) {
                const double alone = run(0, kind, repeat, rounds);
                const double both = run(mode, kind, repeat, rounds);
                printf("%s%s x%d %.2f %.2f %.2f\n", names[kind], loads ? "+loads" : "",
                       8 * repeat, alone, both, products);
            }
        }
    }
    _tile_release();
    return 0;
}
