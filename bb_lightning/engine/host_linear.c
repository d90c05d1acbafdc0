/* The product of a few rows of bf16 activations with a bf16 weight on the CPU's matrix
 * tiles (Intel AMX): torch's `F.linear(x, w)` without bias,
 *
 *     out[m][n] = bf16(sum_k x[m][k] * w[n][k])     (x [m, k], w [n, k], out [m, n] bf16)
 *
 * the products of bf16 pairs exact in fp32 and summed in fp32 by the tiles, the blocks of 32
 * k in order (within a block in the tiles' own order), then rounded to bf16 to nearest even,
 * a NaN to the quiet NaN 0x7fc0 (as torch converts a float).
 *
 * torch's products (oneDNN) first copy the weight into the tiles' layout for a right
 * operand (each pair of consecutive k of a column side by side) at every call. With few
 * rows, as in a decode step (one row per sequence), that copy costs more than the products.
 * Here the weight is the tiles' left operand as it lies in memory (16 rows n by 32 k a
 * tile) and the activations are the right operand, copied once per call into the layout
 * (16 pairs of k of 16 rows m a tile row): the tiles compute out^T = w x^T, 32 rows n by
 * 32 rows m at a time, and each 32 x 32 block is written back transposed.
 *
 * Each thread of the calling thread's OpenMP team of `threads` takes a contiguous range of
 * 32-row strips of the weight. A strip is read from memory once and from the second-level
 * cache for each further 32 rows of x; while the tiles run on one strip, the thread asks for
 * the next strip's rows (a tile's rows lie a row of the weight apart, which the hardware's
 * stream prefetchers do not follow), so that reading memory and the products overlap.
 *
 * Linux grants the tiles' state to a process on request (arch_prctl); bb_linear_ready
 * asks once and says whether the tiles can run. Built without the tiles' instructions
 * (another CPU, another compiler), bb_linear_ready returns 0 and bb_linear_bf16 -1.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int bb_host_linear_team_threads(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BW__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Blocks of k ahead of the tiles whose weight rows a thread's first strip asks for (64 bytes
 * a row each); later strips' rows are asked for a strip ahead, into the second-level cache. */
#define AHEAD 4

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

int bb_linear_ready(void) {
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

/* 16 floats rounded to bf16 as torch converts a float: to nearest even, a NaN to 0x7fc0. */
static inline __m256i round16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

int bb_linear_bf16(int threads, int64_t m, int64_t n, int64_t k, const uint16_t *x,
                   const uint16_t *w, uint16_t *out) {
    if (!bb_linear_ready() || m < 1 || n % 32 != 0 || k % 32 != 0 || k < 32) return -1;
    const int64_t mblocks = (m + 15) / 16, pairs = k / 2, kblocks = k / 32;
    const int64_t strips = n / 32, mpairs = (m + 31) / 32;
    /* xp[mb][p][j]: the pair of x[16 mb + j][2 p], x[16 mb + j][2 p + 1] (zero past m) */
    uint32_t *xp = aligned_alloc(64, (size_t)(mblocks * pairs * 16 * 4));
    if (xp == NULL) return -2;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t mb = 0; mb < mblocks; ++mb)
            for (int64_t j = 0; j < 16; ++j) {
                int64_t row = 16 * mb + j;
                uint32_t *dst = xp + mb * pairs * 16 + j;
                if (row < m) {
                    const uint16_t *src = x + row * k;
                    for (int64_t p = 0; p < pairs; ++p) {
                        uint32_t pair;
                        memcpy(&pair, src + 2 * p, sizeof pair);
                        dst[p * 16] = pair;
                    }
                } else {
                    for (int64_t p = 0; p < pairs; ++p) dst[p * 16] = 0;
                }
            }
        tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; ++t) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
        float c[32][32] __attribute__((aligned(64)));
        const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                    10, 11, 12, 13, 14, 15),
                                                  _mm512_set1_epi32(32));
        int first = 1;  /* this thread's first strip: its rows were not asked for ahead */
        const int64_t rows_per = (32 + mpairs - 1) / mpairs;
#pragma omp for schedule(static)
        for (int64_t s = 0; s < strips; ++s) {
            const uint16_t *w0 = w + s * 32 * k, *w1 = w0 + 16 * k;
            for (int64_t mp = 0; mp < mpairs; ++mp) {
                const uint32_t *b0 = xp + 2 * mp * pairs * 16, *b1 = b0 + pairs * 16;
                const int two = 2 * mp + 1 < mblocks;
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
                /* the next strip's rows r0 .. r1, a block of k each step: read from memory
                 * while the tiles run, so that the next strip's first pass finds them */
                int64_t r0 = mp * rows_per, r1 = r0 + rows_per < 32 ? r0 + rows_per : 32;
                for (int64_t kb = 0; kb < kblocks; ++kb) {
                    if (first && mp == 0 && kb + AHEAD < kblocks)  /* no strip before it */
                        for (int r = 0; r < 32; ++r)
                            _mm_prefetch((const char *)(w0 + r * k + (kb + AHEAD) * 32), _MM_HINT_T0);
                    if (s + 1 < strips)
                        for (int64_t r = r0; r < r1; ++r)
                            _mm_prefetch((const char *)(w0 + (32 + r) * k + kb * 32), _MM_HINT_T1);
                    _tile_loadd(0, w0 + kb * 32, k * 2);
                    _tile_loadd(1, w1 + kb * 32, k * 2);
                    _tile_loadd(2, b0 + kb * 256, 64);
                    _tile_dpbf16ps(4, 0, 2);
                    _tile_dpbf16ps(6, 1, 2);
                    if (two) {
                        _tile_loadd(3, b1 + kb * 256, 64);
                        _tile_dpbf16ps(5, 0, 3);
                        _tile_dpbf16ps(7, 1, 3);
                    }
                }
                _tile_stored(4, &c[0][0], 128);  /* c[n][m] of this strip and pair of blocks */
                _tile_stored(6, &c[16][0], 128);
                if (two) {
                    _tile_stored(5, &c[0][16], 128);
                    _tile_stored(7, &c[16][16], 128);
                }
                int64_t rows = m - 32 * mp < 32 ? m - 32 * mp : 32;
                if (mp == mpairs - 1) first = 0;
                for (int64_t j = 0; j < rows; ++j) {
                    uint16_t *o = out + (32 * mp + j) * n + 32 * s;
                    __m512 lo = _mm512_i32gather_ps(column, &c[0][j], 4);
                    __m512 hi = _mm512_i32gather_ps(column, &c[16][j], 4);
                    _mm256_storeu_si256((__m256i *)o, round16(lo));
                    _mm256_storeu_si256((__m256i *)(o + 16), round16(hi));
                }
            }
        }
        _tile_release();
    }
    free(xp);
    return 0;
}
#else
int bb_linear_ready(void) { return 0; }

int bb_linear_bf16(int threads, int64_t m, int64_t n, int64_t k, const uint16_t *x,
                   const uint16_t *w, uint16_t *out) {
    (void)threads, (void)m, (void)n, (void)k, (void)x, (void)w, (void)out;
    return -1;
}
#endif
