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
 * (16 pairs of k of 16 rows m a tile row; each 16 rows by 32 k a 16 x 16 transpose of 32-bit
 * pairs in vector registers): the tiles compute out^T = w x^T, 32 rows n by 32 rows m at a
 * time, and each 32 x 32 block is written back transposed (16 x 16 at a time, the same
 * transpose, then rounded to bf16 a row of 16).
 *
 * Each thread of the calling thread's OpenMP team of `threads` takes a contiguous range of
 * 32-row strips of the weight. A strip is read from memory once and from the second-level
 * cache for each further 32 rows of x; while the tiles run on one strip, the thread asks for
 * the next strip's rows (a tile's rows lie a row of the weight apart, which the hardware's
 * stream prefetchers do not follow), so that reading memory and the products overlap.
 *
 * A prefill's attention (bb_prefill_attention_bf16) runs on the tiles too. torch's fused CPU
 * attention works through blocks of 32 queries, each a pair of small products with its own
 * setup; a prefill of short prompts (16 prompts of 128 tokens, 16 heads of 64) spent most
 * of its attention time there. Here each (sequence, key/value head) at a time: its keys
 * copied once into the right operand's pair layout (16 keys by 16 pairs a transpose) and its
 * values with each pair of consecutive positions side by side; for each query head of the
 * group, the scores of 32 queries by 32 keys a block on the tiles (causal: the blocks past
 * the diagonal left out), a softmax in fp32 along each query's row (e^x by a polynomial of
 * relative error about 1e-7), the weights rounded to bf16 as torch's fused kernel rounds
 * them, their product with the values on the tiles, divided by the weights' fp32 sum (as a
 * product with its reciprocal) and rounded to bf16 into [batch, query, head, dim]. Not bit
 * for bit torch's: its e^x and sums differ in the last bits, so an output may round to the
 * neighbouring bf16 (a few in a hundred).
 *
 * A training step's attention backward (bb_attention_backward_bf16) runs on the tiles too.
 * torch's fused CPU attention recomputes and multiplies small blocks with a setup each, and its
 * bf16 backward ran at a fifth of the tiles' rate at a Llama block's training shape. Here each
 * (sequence, key/value head) at a time, laid out once: its keys and values as the right
 * operand's pairs of the head dimension, and its keys also with consecutive positions paired;
 * for each of its query heads, the queries and output gradients as rows and transposed (a 32 x
 * 32 block of bf16 as pairs of rows side by side, then two 16 x 16 transposes). Per block of 32
 * queries the scores and the output gradient's products with the values run on the tiles, the
 * softmax weights are recomputed from the forward's log-sum-exp and the score gradients formed
 * in fp32, and the queries' gradient is their product with the keys; the weights and score
 * gradients, rounded to bf16 with consecutive queries paired, then give the values' and keys'
 * gradients transposed, 32 keys by 32 columns a block over the queries that attend them,
 * summed in fp32 over the heads of a group, transposed back and rounded once.
 *
 * Linux grants the tiles' state to a process on request (arch_prctl); bb_linear_ready
 * asks once and says whether the tiles can run. Built without the tiles' instructions but with
 * AVX-512's bf16 pair products (vdpbf16ps; AMD's Zen 4, for one), the two attention kernels
 * run the same schedule with each 32 x 32 block's products on the 512-bit vectors instead
 * (block32 below: 8 rows of a block at a time, each pair of a row broadcast to every lane
 * against a pair row of the right operand's 32 columns), and bb_linear_bf16 multiplies on
 * them too: x's pairs laid out as for the tiles, each pair of a weight row broadcast to every
 * lane against the pairs of 16 rows of x (vec_tile below); bb_linear_ready returns 0 (no
 * tiles). bb_attention_ready says whether the attention kernels run; without
 * either instruction set, or where the tiles are not granted, it returns 0 and every kernel
 * here -1.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* bb_prefill_attention_bf16's parameters (below). */
#define PREFILL_ATTENTION_ARGS                                                                 \
    int threads, int64_t batch, int64_t heads, int64_t kv_heads, int64_t q_len, int64_t kv_len,  \
        int64_t dim, const uint16_t *q, const int64_t *qs, const uint16_t *k, const int64_t *ks, \
        const uint16_t *v, const int64_t *vs, const float *mask, const int64_t *ms, int causal, \
        float scale, uint16_t *out, float *lse

/* bb_attention_backward_bf16's parameters (below). */
#define ATTENTION_BACKWARD_ARGS                                                                 \
    int threads, int64_t batch, int64_t heads, int64_t kv_heads, int64_t len, int64_t dim,       \
        const uint16_t *q, const int64_t *qs, const uint16_t *k, const int64_t *ks,             \
        const uint16_t *v, const int64_t *vs, const uint16_t *o, const int64_t *os,             \
        const uint16_t *dout, const int64_t *dos, const float *lse, const int64_t *ls,          \
        int causal, float scale, uint16_t *dq, uint16_t *dk, uint16_t *dv

int bb_host_linear_team_threads(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define BB_TILES 1
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

/* The calling thread's tiles as every kernel here uses them: eight of 16 rows of 64 bytes. */
static inline void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
#define ATTENTION_READY() bb_linear_ready()
#define TILES_BEGIN() configure_tiles()
#define TILES_END() _tile_release()
#else
/* No tiles: the attention kernels' products run on the 512-bit vectors (vdpbf16ps). */
int bb_linear_ready(void) { return 0; }
#define ATTENTION_READY() 1
#define TILES_BEGIN() ((void)0)
#define TILES_END() ((void)0)
#endif

int bb_attention_ready(void) { return ATTENTION_READY(); }

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

/* The 16 x 16 transpose of 32-bit elements: r[j] lane c -> r[c] lane j. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; ++i)
        for (int c = 0; c < 4; ++c) {
            t[8 * i + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0x88);
            t[8 * i + 4 + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0xdd);
        }
    for (int c = 0; c < 8; ++c) {
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
    }
}

/* A right operand's pairs of 16 rows of x (rows past `rows` zero) and 32 k from `x` (its
 * rows k apart): dst[p * dstride + j] = the pair x[j][2 p], x[j][2 p + 1], 16 pairs of 16
 * rows (dst and dstride a multiple of 64 bytes). */
static inline void pairs16(const uint16_t *x, int64_t k, int64_t rows, uint32_t *dst,
                           int64_t dstride) {
    __m512i r[16];
    for (int64_t j = 0; j < 16; ++j)
        r[j] = j < rows ? _mm512_loadu_si512(x + j * k) : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(dst + dstride * p, r[p]);
}

/* Both products' right operand: xp[mb][p][j] = the pair x[16 mb + j][2 p], x[16 mb + j][2 p
 * + 1] of x ([m, k], zero past m), shared by the calling thread's OpenMP team. */
static void pairs_of(const uint16_t *x, int64_t m, int64_t k, uint32_t *xp) {
    const int64_t mblocks = (m + 15) / 16, kblocks = k / 32;
#pragma omp for schedule(static)
    for (int64_t mb = 0; mb < mblocks; ++mb) {
        const int64_t rows = m - 16 * mb < 16 ? m - 16 * mb : 16;
        for (int64_t kb = 0; kb < kblocks; ++kb)
            pairs16(x + 16 * mb * k + 32 * kb, k, rows, xp + (mb * kblocks + kb) * 256, 16);
    }
}

#ifdef BB_TILES
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
        pairs_of(x, m, k, xp);
        configure_tiles();
        float c[32][32] __attribute__((aligned(64)));
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
                /* each 16 x 16 quadrant of c transposed: r[j] lane i = c[16 q + i][16 h + j],
                 * out row 32 mp + 16 h + j, column 32 s + 16 q + i */
                for (int64_t h = 0; 16 * h < rows; ++h)
                    for (int q = 0; q < 2; ++q) {
                        __m512i r[16];
                        for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(&c[16 * q + i][16 * h]);
                        transpose16(r);
                        const int64_t left = rows - 16 * h < 16 ? rows - 16 * h : 16;
                        for (int64_t j = 0; j < left; ++j)
                            _mm256_storeu_si256((__m256i *)(out + (32 * mp + 16 * h + j) * n + 32 * s + 16 * q),
                                                round16(_mm512_castsi512_ps(r[j])));
                    }
            }
        }
        _tile_release();
    }
    free(xp);
    return 0;
}
#else
/* Rows of w a vector tile takes (each pair of a row broadcast to every lane), and blocks of 16
 * rows of x (their pairs a vector) it multiplies them by: 16 fp32 accumulators. */
#define VEC_N 8
#define VEC_M 2

/* VEC_N rows of w (w, rows k apart) times `blocks` (at most VEC_M) blocks of 16 rows of x's
 * pairs (xp, blocks pairs * 16 apart) over all k, into c[r][16 j + i] (rows cs apart): out^T
 * of these rows and columns, each pair of k in order. `ahead`: also ask for the next strip's
 * rows of w (16 rows on) into the second-level cache, a line of each row every 16 pairs. */
static inline void vec_tile(const uint16_t *w, int64_t k, const uint32_t *xp, int64_t pairs,
                            int blocks, int ahead, float *c, int64_t cs) {
    __m512 acc[VEC_N][VEC_M];
    const uint32_t *wr[VEC_N];
    for (int r = 0; r < VEC_N; ++r) {
        wr[r] = (const uint32_t *)(w + r * k);
        for (int j = 0; j < VEC_M; ++j) acc[r][j] = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < pairs; ++p) {
        if (ahead && (p & 15) == 0)
            for (int r = 0; r < VEC_N; ++r)
                _mm_prefetch((const char *)(wr[r] + 8 * k + p), _MM_HINT_T1);
        __m512i xv[VEC_M];
        for (int j = 0; j < VEC_M; ++j)
            if (j < blocks) xv[j] = _mm512_load_si512(xp + j * pairs * 16 + p * 16);
        for (int r = 0; r < VEC_N; ++r) {
            const __m512i b = _mm512_set1_epi32((int)wr[r][p]);
            for (int j = 0; j < VEC_M; ++j)
                if (j < blocks) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv[j], (__m512bh)b);
        }
    }
    for (int r = 0; r < VEC_N; ++r)
        for (int j = 0; j < blocks; ++j) _mm512_store_ps(c + r * cs + 16 * j, acc[r][j]);
}

/* Without the tiles: the same product on the 512-bit vectors, x's pairs laid out as for the
 * tiles (pairs16), each thread a contiguous range of 16-row strips of the weight; a strip's
 * out^T gathered in fp32 (c) 256 rows of x at a time, then written back transposed 16 x 16
 * and rounded. */
int bb_linear_bf16(int threads, int64_t m, int64_t n, int64_t k, const uint16_t *x,
                   const uint16_t *w, uint16_t *out) {
    if (m < 1 || n % 16 != 0 || k % 32 != 0 || k < 32) return -1;
    const int64_t mblocks = (m + 15) / 16, pairs = k / 2, strips = n / 16;
    uint32_t *xp = aligned_alloc(64, (size_t)(mblocks * pairs * 16 * 4));
    if (xp == NULL) return -2;
#pragma omp parallel num_threads(threads)
    {
        pairs_of(x, m, k, xp);
        float c[16][256] __attribute__((aligned(64)));  /* c[n][m] of a strip, 256 rows m */
#pragma omp for schedule(static)
        for (int64_t s = 0; s < strips; ++s)
            for (int64_t m0 = 0; m0 < mblocks; m0 += 16) {  /* 16 blocks of 16 rows at a time */
                const int64_t m1 = m0 + 16 < mblocks ? m0 + 16 : mblocks;
                for (int r0 = 0; r0 < 16; r0 += VEC_N)
                    for (int64_t mb = m0; mb < m1; mb += VEC_M) {
                        const int blocks = m1 - mb < VEC_M ? (int)(m1 - mb) : VEC_M;
                        vec_tile(w + (16 * s + r0) * k, k, xp + mb * pairs * 16, pairs, blocks,
                                 mb == 0 && s + 1 < strips, &c[r0][16 * (mb - m0)], 256);
                    }
                for (int64_t h = m0; h < m1; ++h) {
                    __m512i r[16];
                    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(&c[i][16 * (h - m0)]);
                    transpose16(r);
                    const int64_t left = m - 16 * h < 16 ? m - 16 * h : 16;
                    for (int64_t j = 0; j < left; ++j)
                        _mm256_storeu_si256((__m256i *)(out + (16 * h + j) * n + 16 * s),
                                            round16(_mm512_castsi512_ps(r[j])));
                }
            }
    }
    free(xp);
    return 0;
}
#endif

/* e^x for x <= 0 (x >= -87 meaningful; below, 0): 2^n e^r with |r| <= ln2/2, a degree-6
 * polynomial for e^r (relative error near 1e-7). */
static inline __m512 exp16(__m512 x) {
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.3981999507e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
}

/* c (32 x 32 fp32, rows `c_stride` bytes apart) = a (32 rows of bf16, `a_stride` bytes apart)
 * times b (pair rows of 16 32-bit pairs, `b_stride` bytes apart), over `steps` blocks of 32
 * a's columns and 16 b's pair rows (b advancing `b_step` 32-bit elements a block), on the
 * tiles: 0-3 the four 16 x 16 quarters of c, 4-5 a's two halves, 6-7 b's. */
#ifdef BB_TILES
static inline void block32(const uint16_t *a, int64_t a_stride, const uint32_t *b,
                           int64_t b_stride, int64_t b_step, int64_t steps, float *c,
                           int64_t c_stride) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t i = 0; i < steps; ++i, a += 32, b += b_step) {
        _tile_loadd(4, a, a_stride);
        _tile_loadd(5, (const char *)a + 16 * a_stride, a_stride);
        _tile_loadd(6, b, b_stride);
        _tile_loadd(7, b + 16, b_stride);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, c_stride);
    _tile_stored(1, c + 16, c_stride);
    _tile_stored(2, (char *)c + 16 * c_stride, c_stride);
    _tile_stored(3, (char *)c + 16 * c_stride + 64, c_stride);
}
#else
static inline void block32(const uint16_t *a, int64_t a_stride, const uint32_t *b,
                           int64_t b_stride, int64_t b_step, int64_t steps, float *c,
                           int64_t c_stride) {
    /* 8 rows of c at a time in 16 accumulators: each pair of a's row broadcast to every
     * lane, times a pair row of b's 32 columns (two registers) */
    for (int r0 = 0; r0 < 32; r0 += 8) {
        __m512 acc[8][2];
        for (int m = 0; m < 8; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        const char *ar = (const char *)a + r0 * a_stride;
        const uint32_t *bs = b;
        for (int64_t i = 0; i < steps; ++i, ar += 64, bs += b_step)
            for (int kk = 0; kk < 16; ++kk) {
                const uint32_t *brow = (const uint32_t *)((const char *)bs + kk * b_stride);
                const __m512bh b0 = (__m512bh)_mm512_loadu_si512(brow);
                const __m512bh b1 = (__m512bh)_mm512_loadu_si512(brow + 16);
                for (int m = 0; m < 8; ++m) {
                    int32_t pair;
                    memcpy(&pair, ar + m * a_stride + kk * 4, 4);
                    const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
                    acc[m][0] = _mm512_dpbf16_ps(acc[m][0], x, b0);
                    acc[m][1] = _mm512_dpbf16_ps(acc[m][1], x, b1);
                }
            }
        for (int m = 0; m < 8; ++m) {
            float *row = (float *)((char *)c + (r0 + m) * c_stride);
            _mm512_storeu_ps(row, acc[m][0]);
            _mm512_storeu_ps(row + 16, acc[m][1]);
        }
    }
}
#endif

/* Prefill attention of bf16 queries [batch, heads, q_len, dim], keys and values [batch,
 * kv_heads, kv_len, dim] (element strides of batch, head, position; rows contiguous), an
 * additive fp32 mask [.., q_len, kv_len] (strides of batch, head, query; 0 broadcasts) or
 * none, `causal`: query i attends keys j <= i; a query whose every score the mask takes below
 * -1e37 (no key attended) gets zeros, as torch gives it. Output bf16 [batch, q_len, heads,
 * dim]; and, where `lse` is not NULL, each query's log-sum-exp of its scaled, masked scores
 * into fp32 lse [batch, heads, q_len] (what the backward below takes; -FLT_MAX where no key is
 * attended).
 * Scores and softmax in fp32, the weights rounded to bf16 for their product with the values,
 * which is divided by the weights' fp32 sum. dim a multiple of 32, at most 256. */
int bb_prefill_attention_bf16(PREFILL_ATTENTION_ARGS) {
    if (!ATTENTION_READY() || dim % 32 != 0 || dim > 256 || q_len < 1 || kv_len < 1 ||
        heads % kv_heads != 0)
        return -1;
    const int64_t group = heads / kv_heads, lp = (q_len + 31) / 32 * 32, sp = (kv_len + 31) / 32 * 32;
    const int64_t half = dim / 2;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t *qp = aligned_alloc(64, (size_t)(lp * dim * 2));
        uint32_t *kp = aligned_alloc(64, (size_t)(half * sp * 4));
        uint32_t *vp = aligned_alloc(64, (size_t)(sp / 2 * dim * 4));
        float *sc = aligned_alloc(64, (size_t)(lp * sp * 4));
        uint16_t *pw = aligned_alloc(64, (size_t)(lp * sp * 2));
        float *total = aligned_alloc(64, (size_t)(lp * 4));
        float c[32][32] __attribute__((aligned(64)));
        int ok = qp && kp && vp && sc && pw && total;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        if (ok) TILES_BEGIN();
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < batch * kv_heads; ++item) {
            if (!ok) continue;
            const int64_t b = item / kv_heads, hk = item % kv_heads;
            const uint16_t *kb = k + b * ks[0] + hk * ks[1], *vb = v + b * vs[0] + hk * vs[1];
            /* keys: kp[p][s] = the pair (k[s][2p], k[s][2p + 1]), 16 keys by 16 pairs at a
             * time; zero past kv_len */
            for (int64_t s0 = 0; s0 < sp; s0 += 16)
                for (int64_t d = 0; d < dim; d += 32)
                    pairs16(kb + s0 * ks[2] + d, ks[2], kv_len - s0, kp + d / 2 * sp + s0, sp);
            /* values: vp[t][d] = the pair (v[2t][d], v[2t + 1][d]), 32 columns at a time */
            uint16_t order[32];
            for (int i = 0; i < 32; ++i) order[i] = (uint16_t)(i / 2 + (i % 2) * 32);
            const __m512i lo = _mm512_loadu_si512(order);
            const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
            for (int64_t t = 0; t < sp / 2; ++t) {
                const uint16_t *r0 = vb + 2 * t * vs[2], *r1 = r0 + vs[2];
                const int has0 = 2 * t < kv_len, has1 = 2 * t + 1 < kv_len;
                for (int64_t d = 0; d < dim; d += 32) {
                    __m512i a = has0 ? _mm512_loadu_si512(r0 + d) : _mm512_setzero_si512();
                    __m512i c1 = has1 ? _mm512_loadu_si512(r1 + d) : _mm512_setzero_si512();
                    _mm512_store_si512(vp + t * dim + d, _mm512_permutex2var_epi16(a, lo, c1));
                    _mm512_store_si512(vp + t * dim + d + 16, _mm512_permutex2var_epi16(a, hi, c1));
                }
            }
            for (int64_t g = 0; g < group; ++g) {
                const int64_t h = hk * group + g;
                const uint16_t *qb = q + b * qs[0] + h * qs[1];
                for (int64_t l = 0; l < lp; ++l) {
                    if (l < q_len) memcpy(qp + l * dim, qb + l * qs[2], (size_t)dim * 2);
                    else memset(qp + l * dim, 0, (size_t)dim * 2);
                }
                /* scores, 32 queries by 32 keys a block; causal: the blocks past the diagonal left out */
                for (int64_t l0 = 0; l0 < lp; l0 += 32) {
                    const int64_t keys = causal ? (l0 + 32 < sp ? l0 + 32 : sp) : sp;
                    for (int64_t s0 = 0; s0 < keys; s0 += 32) {
                        block32(qp + l0 * dim, dim * 2, kp + s0, sp * 4, sp * 16, dim / 32,
                                sc + l0 * sp + s0, sp * 4);
                    }
                }
                /* softmax of each query's scores over the keys it attends */
                const float *mb = mask ? mask + b * ms[0] + h * ms[1] : NULL;
                for (int64_t l = 0; l < lp; ++l) {
                    float *s = sc + l * sp;
                    uint16_t *w = pw + l * sp;
                    int64_t n = l >= q_len ? 0 : causal ? (l + 1 < kv_len ? l + 1 : kv_len) : kv_len;
                    const float *m = mb ? mb + l * ms[2] : NULL;
                    __m512 top = _mm512_set1_ps(-FLT_MAX);
                    int64_t j = 0;
                    for (; j < n; j += 16) {
                        __mmask16 in = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
                        __m512 x = _mm512_maskz_loadu_ps(in, s + j);
                        if (m) {
                            x = _mm512_fmadd_ps(x, _mm512_set1_ps(scale), _mm512_maskz_loadu_ps(in, m + j));
                            _mm512_mask_storeu_ps(s + j, in, x);
                        }
                        top = _mm512_mask_max_ps(top, in, top, x);
                    }
                    /* e^(x - max): x the scaled, masked score (with no mask, the raw score
                     * scaled here) */
                    const float mx = n ? _mm512_reduce_max_ps(top) : 0.0f;
                    if (m && mx < -1e37f) n = 0; /* no key attended: zeros, as torch gives */
                    const __m512 mul = _mm512_set1_ps(m ? 1.0f : scale);
                    const __m512 sub = _mm512_set1_ps(m ? -mx : -mx * scale);
                    __m512 sum = _mm512_setzero_ps();
                    for (j = 0; j < n; j += 16) {
                        __mmask16 in = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
                        __m512 e = exp16(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(in, s + j), mul, sub));
                        e = _mm512_maskz_mov_ps(in, e);
                        sum = _mm512_add_ps(sum, e);
                        _mm256_storeu_si256((__m256i *)(w + j), (__m256i)_mm512_cvtneps_pbh(e));
                    }
                    for (j = (n + 15) / 16 * 16; j < sp; j += 16)
                        _mm256_storeu_si256((__m256i *)(w + j), _mm256_setzero_si256());
                    const float all = n ? _mm512_reduce_add_ps(sum) : 0.0f;
                    total[l] = n ? 1.0f / all : 0.0f;
                    if (lse && l < q_len) /* log of the sum of e^(scaled score), as torch's */
                        lse[(b * heads + h) * q_len + l] = n ? (m ? mx : mx * scale) + logf(all) : -FLT_MAX;
                }
                /* weighted values, 32 queries by 32 columns a block */
                for (int64_t l0 = 0; l0 < lp; l0 += 32) {
                    const int64_t keys = causal ? (l0 + 32 < sp ? l0 + 32 : sp) : sp;
                    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
                        block32(pw + l0 * sp, sp * 2, vp + d0, dim * 4, dim * 16,
                                keys / 32, &c[0][0], 128);
                        for (int64_t j = 0; j < 32 && l0 + j < q_len; ++j) {
                            __m512 inv = _mm512_set1_ps(total[l0 + j]);
                            uint16_t *o = out + ((b * q_len + l0 + j) * heads + h) * dim + d0;
                            _mm256_storeu_si256((__m256i *)o, round16(_mm512_mul_ps(_mm512_load_ps(&c[j][0]), inv)));
                            _mm256_storeu_si256((__m256i *)(o + 16), round16(_mm512_mul_ps(_mm512_load_ps(&c[j][16]), inv)));
                        }
                    }
                }
            }
        }
        if (ok) TILES_END();
        free(qp); free(kp); free(vp); free(sc); free(pw); free(total);
    }
    return failed ? -2 : 0;
}
/* The 32 pairs (a[c], b[c]) of two rows of 32 bf16, c = 0..31, into dst (64-byte aligned). */
static inline void interleave32(__m512i a, __m512i b, uint32_t *dst) {
    static const uint16_t order[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                       8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i lo = _mm512_loadu_si512(order);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    _mm512_store_si512(dst, _mm512_permutex2var_epi16(a, lo, b));
    _mm512_store_si512(dst + 16, _mm512_permutex2var_epi16(a, hi, b));
}

/* t[c][r] = x[r][c] for x of `lp` rows of `dim` bf16 (rows `xs` elements apart; rows from `rows`
 * on read as zeros) and t of `dim` rows of `lp` (both multiples of 32): each 32 x 32 block as
 * pairs of consecutive rows side by side, then two 16 x 16 transposes of the pairs. */
static void transpose_bf16(const uint16_t *x, int64_t xs, int64_t rows, int64_t dim, int64_t lp,
                           uint16_t *t) {
    uint32_t y[16][32] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < lp; r0 += 32)
        for (int64_t c0 = 0; c0 < dim; c0 += 32) {
            for (int w = 0; w < 16; ++w) {
                const int64_t ra = r0 + 2 * w;
                __m512i a = ra < rows ? _mm512_loadu_si512(x + ra * xs + c0) : _mm512_setzero_si512();
                __m512i b = ra + 1 < rows ? _mm512_loadu_si512(x + (ra + 1) * xs + c0) : _mm512_setzero_si512();
                interleave32(a, b, y[w]);
            }
            for (int h = 0; h < 2; ++h) {
                __m512i r[16];
                for (int w = 0; w < 16; ++w) r[w] = _mm512_load_si512(&y[w][16 * h]);
                transpose16(r);
                for (int c = 0; c < 16; ++c) _mm512_storeu_si512(t + (c0 + 16 * h + c) * lp + r0, r[c]);
            }
        }
}

/* out[r][c] = bf16(acc[c][r]) for the first `rows` rows: acc fp32 of `dim` rows of `lp`, out
 * rows of `dim` contiguous. */
static void transposed_out(const float *acc, int64_t dim, int64_t lp, int64_t rows, uint16_t *out) {
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
        for (int64_t c0 = 0; c0 < dim; c0 += 16) {
            __m512i r[16];
            for (int c = 0; c < 16; ++c) r[c] = _mm512_loadu_si512(acc + (c0 + c) * lp + r0);
            transpose16(r);
            for (int j = 0; j < 16 && r0 + j < rows; ++j)
                _mm256_storeu_si256((__m256i *)(out + (r0 + j) * dim + c0),
                                    round16(_mm512_castsi512_ps(r[j])));
        }
}

/* acc (32 x 32 fp32, rows `stride` floats apart) += c. */
static inline void add32(float *acc, int64_t stride, float c[32][32]) {
    for (int j = 0; j < 32; ++j)
        for (int x = 0; x < 32; x += 16) {
            float *a = acc + j * stride + x;
            _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_load_ps(&c[j][x])));
        }
}

/* The gradients of self-attention (queries and keys of one length `len`) with respect to its
 * bf16 queries [batch, heads, len, dim], keys and values [batch, kv_heads, len, dim] (element
 * strides of batch, head, position; rows contiguous), given its bf16 output `o` and output
 * gradient `dout` [batch, heads, len, dim] and the fp32 log-sum-exp of each query's scaled
 * scores `lse` [batch, heads, len] (strides of each), as torch's fused CPU attention leaves them;
 * `causal`: query i attends keys j <= i. Into contiguous bf16 dq [batch, heads, len, dim], dk and
 * dv [batch, kv_heads, len, dim] (a key/value head's gradients summed over its query heads).
 * Per (sequence, key/value head), per query head of its group, per block of 32 queries: the
 * scores S = Q K^T and dP = dO V^T on the tiles, P = e^(S scale - lse) in fp32, dS = P (dP - D)
 * scale with D = the row sums of dO o (zero for a query that attends one key: its weight is
 * constant, whatever the sums' roundings), dQ = dS K on the tiles; then dV^T += dO^T P and dK^T +=
 * Q^T dS, with P and dS rounded to bf16 for the tiles, over the queries that attend each block
 * of 32 keys. fp32 sums throughout, each gradient rounded to bf16 once. dim a multiple of 32, at
 * most 256. */
int bb_attention_backward_bf16(ATTENTION_BACKWARD_ARGS) {
    if (!ATTENTION_READY() || dim % 32 != 0 || dim > 256 || len < 1 || heads % kv_heads != 0)
        return -1;
    const int64_t group = heads / kv_heads, lp = (len + 31) / 32 * 32, half = dim / 2;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint32_t *kp = aligned_alloc(64, (size_t)(half * lp * 4));    /* K, pairs of d */
        uint32_t *vp = aligned_alloc(64, (size_t)(half * lp * 4));    /* V, pairs of d */
        uint32_t *kr = aligned_alloc(64, (size_t)(lp / 2 * dim * 4)); /* K, pairs of keys */
        uint16_t *qr = aligned_alloc(64, (size_t)(lp * dim * 2));     /* Q rows */
        uint16_t *gr = aligned_alloc(64, (size_t)(lp * dim * 2));     /* dO rows */
        uint16_t *qt = aligned_alloc(64, (size_t)(dim * lp * 2));     /* Q^T */
        uint16_t *gt = aligned_alloc(64, (size_t)(dim * lp * 2));     /* dO^T */
        uint32_t *pp = aligned_alloc(64, (size_t)(lp / 2 * lp * 4));  /* P, pairs of queries */
        uint32_t *dsp = aligned_alloc(64, (size_t)(lp / 2 * lp * 4)); /* dS, pairs of queries */
        float *sb = aligned_alloc(64, (size_t)(32 * lp * 4));         /* a block's S, then P */
        float *db = aligned_alloc(64, (size_t)(32 * lp * 4));         /* a block's dP */
        uint16_t *dsw = aligned_alloc(64, (size_t)(32 * lp * 2));     /* a block's dS rows */
        float *dkt = aligned_alloc(64, (size_t)(dim * lp * 4));       /* dK^T */
        float *dvt = aligned_alloc(64, (size_t)(dim * lp * 4));       /* dV^T */
        float *rowd = aligned_alloc(64, (size_t)(lp * 4));            /* D */
        float c[32][32] __attribute__((aligned(64)));
        int ok = kp && vp && kr && qr && gr && qt && gt && pp && dsp && sb && db && dsw && dkt &&
                 dvt && rowd;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        if (ok) TILES_BEGIN();
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < batch * kv_heads; ++item) {
            if (!ok) continue;
            const int64_t b = item / kv_heads, hk = item % kv_heads;
            const uint16_t *kb = k + b * ks[0] + hk * ks[1], *vb = v + b * vs[0] + hk * vs[1];
            for (int64_t s0 = 0; s0 < lp; s0 += 16)
                for (int64_t d = 0; d < dim; d += 32) {
                    pairs16(kb + s0 * ks[2] + d, ks[2], len - s0, kp + d / 2 * lp + s0, lp);
                    pairs16(vb + s0 * vs[2] + d, vs[2], len - s0, vp + d / 2 * lp + s0, lp);
                }
            for (int64_t t = 0; t < lp / 2; ++t)
                for (int64_t d = 0; d < dim; d += 32) {
                    __m512i a = 2 * t < len ? _mm512_loadu_si512(kb + 2 * t * ks[2] + d) : _mm512_setzero_si512();
                    __m512i a1 = 2 * t + 1 < len ? _mm512_loadu_si512(kb + (2 * t + 1) * ks[2] + d) : _mm512_setzero_si512();
                    interleave32(a, a1, kr + t * dim + d);
                }
            memset(dkt, 0, (size_t)(dim * lp * 4));
            memset(dvt, 0, (size_t)(dim * lp * 4));
            for (int64_t g = 0; g < group; ++g) {
                const int64_t h = hk * group + g;
                const uint16_t *qb = q + b * qs[0] + h * qs[1], *ob = o + b * os[0] + h * os[1];
                const uint16_t *gb = dout + b * dos[0] + h * dos[1];
                const float *lb = lse + b * ls[0] + h * ls[1];
                for (int64_t l = 0; l < lp; ++l) {
                    rowd[l] = 0.0f;
                    if (l >= len) {
                        memset(qr + l * dim, 0, (size_t)dim * 2);
                        memset(gr + l * dim, 0, (size_t)dim * 2);
                        continue;
                    }
                    memcpy(qr + l * dim, qb + l * qs[2], (size_t)dim * 2);
                    memcpy(gr + l * dim, gb + l * dos[2], (size_t)dim * 2);
                    __m512 acc = _mm512_setzero_ps();
                    for (int64_t d = 0; d < dim; d += 16) {
                        __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(gb + l * dos[2] + d)));
                        __m512i y = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(ob + l * os[2] + d)));
                        acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
                                              _mm512_castsi512_ps(_mm512_slli_epi32(y, 16)), acc);
                    }
                    rowd[l] = _mm512_reduce_add_ps(acc);
                }
                transpose_bf16(qr, dim, lp, dim, lp, qt);
                transpose_bf16(gr, dim, lp, dim, lp, gt);
                for (int64_t l0 = 0; l0 < lp; l0 += 32) {
                    const int64_t keys = causal ? l0 + 32 : lp;
                    for (int64_t s0 = 0; s0 < keys; s0 += 32) {
                        block32(qr + l0 * dim, dim * 2, kp + s0, lp * 4, lp * 16, dim / 32, sb + s0, lp * 4);
                        block32(gr + l0 * dim, dim * 2, vp + s0, lp * 4, lp * 16, dim / 32, db + s0, lp * 4);
                    }
                    /* P and dS; zero for queries past len and keys a query does not attend */
                    const __m512 sc = _mm512_set1_ps(scale);
                    for (int64_t j = 0; j < 32; ++j) {
                        const int64_t l = l0 + j, n = l >= len ? 0 : causal ? l + 1 : len;
                        float *s = sb + j * lp;
                        const float *dp = db + j * lp;
                        const __m512 sub = _mm512_set1_ps(l < len ? -lb[l * ls[2]] : 0.0f);
                        const __m512 dl = _mm512_set1_ps(rowd[l]);
                        for (int64_t x = 0; x < keys; x += 16) {
                            __mmask16 in = x >= n ? 0 : n - x >= 16 ? 0xffff : (__mmask16)((1u << (n - x)) - 1);
                            __m512 p = _mm512_maskz_mov_ps(in, exp16(_mm512_fmadd_ps(_mm512_load_ps(s + x), sc, sub)));
                            _mm512_store_ps(s + x, p);
                            __m512 ds = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_sub_ps(_mm512_load_ps(dp + x), dl)), sc);
                            if (n == 1) ds = _mm512_setzero_ps(); /* one key: a constant weight */
                            _mm256_store_si256((__m256i *)(dsw + j * lp + x), round16(ds));
                        }
                    }
                    /* P and dS in pairs of consecutive queries, for the keys' products */
                    for (int64_t t = 0; t < 16; ++t)
                        for (int64_t x = 0; x < keys; x += 32) {
                            const float *r0 = sb + 2 * t * lp + x, *r1 = r0 + lp;
                            __m512i p0 = _mm512_inserti64x4(_mm512_castsi256_si512(round16(_mm512_load_ps(r0))),
                                                            round16(_mm512_load_ps(r0 + 16)), 1);
                            __m512i p1 = _mm512_inserti64x4(_mm512_castsi256_si512(round16(_mm512_load_ps(r1))),
                                                            round16(_mm512_load_ps(r1 + 16)), 1);
                            interleave32(p0, p1, pp + (l0 / 2 + t) * lp + x);
                            interleave32(_mm512_load_si512(dsw + 2 * t * lp + x),
                                         _mm512_load_si512(dsw + (2 * t + 1) * lp + x),
                                         dsp + (l0 / 2 + t) * lp + x);
                        }
                    /* dQ of the block's queries = dS K */
                    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
                        block32(dsw, lp * 2, kr + d0, dim * 4, dim * 16, keys / 32, &c[0][0], 128);
                        for (int64_t j = 0; j < 32 && l0 + j < len; ++j) {
                            uint16_t *dst = dq + ((b * heads + h) * len + l0 + j) * dim + d0;
                            _mm256_storeu_si256((__m256i *)dst, round16(_mm512_load_ps(&c[j][0])));
                            _mm256_storeu_si256((__m256i *)(dst + 16), round16(_mm512_load_ps(&c[j][16])));
                        }
                    }
                }
                /* dV^T += dO^T P and dK^T += Q^T dS, each block of 32 keys over the queries that
                 * attend it */
                for (int64_t s0 = 0; s0 < lp; s0 += 32) {
                    const int64_t from = causal ? s0 : 0;
                    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
                        block32(gt + d0 * lp + from, lp * 2, pp + from / 2 * lp + s0, lp * 4, lp * 16,
                                (lp - from) / 32, &c[0][0], 128);
                        add32(dvt + d0 * lp + s0, lp, c);
                        block32(qt + d0 * lp + from, lp * 2, dsp + from / 2 * lp + s0, lp * 4, lp * 16,
                                (lp - from) / 32, &c[0][0], 128);
                        add32(dkt + d0 * lp + s0, lp, c);
                    }
                }
            }
            transposed_out(dkt, dim, lp, len, dk + (b * kv_heads + hk) * len * dim);
            transposed_out(dvt, dim, lp, len, dv + (b * kv_heads + hk) * len * dim);
        }
        if (ok) TILES_END();
        free(kp); free(vp); free(kr); free(qr); free(gr); free(qt); free(gt); free(pp); free(dsp);
        free(sb); free(db); free(dsw); free(dkt); free(dvt); free(rowd);
    }
    return failed ? -2 : 0;
}
#else
int bb_linear_ready(void) { return 0; }

int bb_attention_ready(void) { return 0; }

int bb_linear_bf16(int threads, int64_t m, int64_t n, int64_t k, const uint16_t *x,
                   const uint16_t *w, uint16_t *out) {
    (void)threads, (void)m, (void)n, (void)k, (void)x, (void)w, (void)out;
    return -1;
}

int bb_prefill_attention_bf16(PREFILL_ATTENTION_ARGS) {
    (void)threads, (void)batch, (void)heads, (void)kv_heads, (void)q_len, (void)kv_len;
    (void)dim, (void)q, (void)qs, (void)k, (void)ks, (void)v, (void)vs, (void)mask, (void)ms;
    (void)causal, (void)scale, (void)out, (void)lse;
    return -1;
}

int bb_attention_backward_bf16(ATTENTION_BACKWARD_ARGS) {
    (void)threads, (void)batch, (void)heads, (void)kv_heads, (void)len, (void)dim, (void)q;
    (void)qs, (void)k, (void)ks, (void)v, (void)vs, (void)o, (void)os, (void)dout, (void)dos;
    (void)lse, (void)ls, (void)causal, (void)scale, (void)dq, (void)dk, (void)dv;
    return -1;
}
#endif
