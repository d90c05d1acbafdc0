/* A decode step's attention over a KV cache in host memory: one query row per query head.
 *
 * For each (sequence, key/value head) of a range, the query heads of the group attend to
 * the head's cached keys and values, each read once from memory and widened to fp32 in
 * registers: the scores of a few key rows against a few query heads at once (independent
 * vector accumulators, so no product waits for the one before), a softmax in fp32, then
 * the weighted sum of the value rows, a few query heads by a few vectors of the output at
 * once, in registers across all positions.
 *
 * Compiled by bb_lightning.engine.native with the machine's own vector instructions; the
 * loops are plain C with the compiler's generic vectors (GCC's vector extensions), and bf16
 * pair products (vdpbf16ps) where the CPU has them. Masks arrive additive and finite (the
 * caller clamps them), so the fast-math flags hold. Built with OpenMP,
 * bb_decode_attention_team spreads a step's heads over the calling thread's team.
 *
 * Element strides (not bytes); the last dimension of keys, values and the mask is
 * contiguous. dtype 0: float32 keys and values, 1: bfloat16.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

typedef float vf __attribute__((vector_size(64), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(64)));

/* One unaligned vector load each (the types are aligned to their elements): a copy through
 * memcpy was split into two 256-bit moves where the compiler tunes for Intel cores, and the
 * 512-bit load of the copy then waited for both (a fp32 GQA layer read its cache 3.4 x
 * slower on one thread of an Intel Xeon). */
static inline vf load_f32(const float *p, int64_t i) { return *(const vf *)(p + i); }

/* A bfloat16 is the upper half of the float32 it rounds. */
static inline vf load_bf16(const uint16_t *p, int64_t i) {
    vh h = *(const vh *)(p + i);
    vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float elem_f32(const float *p, int64_t i) { return p[i]; }

static inline float elem_bf16(const uint16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; ++i) s += v[i];
    return s;
}

/* Rows ahead of the one read that are asked for early: the kernel reads a head's rows a few
 * at a time, in an order the hardware's stream prefetchers do not follow (it ran at half
 * the rate without these). Keys are read once, yet asked for into every level of the caches
 * (prefetcht2), not as non-temporal (prefetchnta): on an AMD EPYC (Zen 4) a thread then
 * read a cache from memory 1.2-1.35 x faster. A head's values are read once per tile of
 * the output, so they are kept in the caches. */
#define PREFETCH_ROWS 16
static inline void prefetch(const void *p) { __builtin_prefetch(p, 0, 1); }
static inline void prefetch_kept(const void *p) { __builtin_prefetch(p, 0, 3); }
/* A row asked for a whole pass ahead, into the outer caches: with bf16 pair products the
 * keys' pass asks for the head's values and the values' pass for the next head's keys, so
 * that memory streams while the products run and a head's first rows do not wait (which
 * costs most on a short head, or on the attended prefix of a longer cache, whose rows stop
 * before the buffer's next head begins). */
static inline void prefetch_next(const void *p) { __builtin_prefetch(p, 0, 2); }
/* prefetch_next of rows [p0, p0 + n) of ``rows`` (``stride`` elements apart), ``width`` bytes
 * of each from its start, one request per 64 bytes. */
#define ask_rows(rows, stride, width, p0, n)                                                   \
    for (int64_t r_ = (p0); r_ < (p0) + (n); ++r_)                                             \
        for (int64_t b_ = 0; b_ < (width); b_ += 64)                                           \
            prefetch_next((const char *)((rows) + r_ * (stride)) + b_)

static inline uint16_t to_bf16(float f) {  /* rounded to nearest even */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The softmax of each query head's scores ``s[g * kv_len + p] * scale + mask``: in place,
 * or, with ``wb``, rounded to bf16 into ``wb`` (the scores then hold the exponentials). */
static void softmax(int64_t group, int64_t kv_len, const float *bias, int64_t msg, float scale,
                    float *scores, uint16_t *wb) {
    for (int64_t g = 0; g < group; ++g) {
        float *s = scores + g * kv_len;
        float top = -INFINITY;
        if (bias) {
            const float *m = bias + g * msg;
            for (int64_t p = 0; p < kv_len; ++p) s[p] = s[p] * scale + m[p];
        } else {
            for (int64_t p = 0; p < kv_len; ++p) s[p] *= scale;
        }
        for (int64_t p = 0; p < kv_len; ++p) top = s[p] > top ? s[p] : top;
        float total = 0.0f;
        for (int64_t p = 0; p < kv_len; ++p) {
            s[p] = expf(s[p] - top);
            total += s[p];
        }
        float inv = 1.0f / total;
        if (wb) {
            uint16_t *w = wb + g * kv_len;
            for (int64_t p = 0; p < kv_len; ++p) w[p] = to_bf16(s[p] * inv);
        } else {
            for (int64_t p = 0; p < kv_len; ++p) s[p] *= inv;
        }
    }
}

/* SCORES: scores[(g0 + j) * kv_len + p0 + r] = q[g0 + j] . key[p0 + r] for R key rows and GB
 * query heads, R x GB vector accumulators, each key and query vector loaded once.
 * WEIGHTED: out[g0 + j][d0 + c * LANES ...] = sum_p w[g0 + j][p] value[p][...] for GB query
 * heads and C vectors of the output, accumulated in registers over every position. */
#define KERNELS(T, SUF, LOAD, ELEM)                                                            \
    static void scores_##SUF(int R, int GB, int64_t dim, const float *q, int64_t g0,           \
                             const T *key, int64_t ksp, int64_t kv_len, int64_t p0,            \
                             float *scores);                                                   \
    static inline void block_##SUF(const int R, const int GB, int64_t dim, const float *q,     \
                                   int64_t g0, const T *key, int64_t ksp, int64_t kv_len,      \
                                   int64_t p0, float *scores) {                                \
        int64_t whole = dim - dim % LANES;                                                     \
        vf acc[8][4];                                                                          \
        for (int r = 0; r < R; ++r)                                                            \
            if (p0 + r + PREFETCH_ROWS < kv_len)                                               \
                for (int64_t d = 0; d < dim; d += LANES)                                       \
                    prefetch(key + (p0 + r + PREFETCH_ROWS) * ksp + d);                        \
        for (int r = 0; r < R; ++r)                                                            \
            for (int j = 0; j < GB; ++j) acc[r][j] = (vf){0};                                  \
        for (int64_t d = 0; d < whole; d += LANES) {                                           \
            vf qv[4];                                                                          \
            for (int j = 0; j < GB; ++j) qv[j] = load_f32(q + (g0 + j) * dim, d);              \
            for (int r = 0; r < R; ++r) {                                                      \
                vf kv = LOAD(key + (p0 + r) * ksp, d);                                         \
                for (int j = 0; j < GB; ++j) acc[r][j] += qv[j] * kv;                          \
            }                                                                                  \
        }                                                                                      \
        for (int r = 0; r < R; ++r)                                                            \
            for (int j = 0; j < GB; ++j) {                                                     \
                const float *qg = q + (g0 + j) * dim;                                          \
                const T *k = key + (p0 + r) * ksp;                                             \
                float s = hsum(acc[r][j]);                                                     \
                for (int64_t d = whole; d < dim; ++d) s += qg[d] * ELEM(k, d);                 \
                scores[(g0 + j) * kv_len + p0 + r] = s;                                        \
            }                                                                                  \
    }                                                                                          \
    static void scores_##SUF(int R, int GB, int64_t dim, const float *q, int64_t g0,           \
                             const T *key, int64_t ksp, int64_t kv_len, int64_t p0,            \
                             float *scores) {                                                  \
        if (R == 4 && GB == 4) block_##SUF(4, 4, dim, q, g0, key, ksp, kv_len, p0, scores);    \
        else if (R == 8 && GB == 2) block_##SUF(8, 2, dim, q, g0, key, ksp, kv_len, p0, scores); \
        else if (R == 8 && GB == 1) block_##SUF(8, 1, dim, q, g0, key, ksp, kv_len, p0, scores); \
        else block_##SUF(1, 1, dim, q, g0, key, ksp, kv_len, p0, scores);                      \
    }                                                                                          \
    static inline void weighted_##SUF(const int GB, const int C, int64_t vdim, int64_t d0,     \
                                      const float *w, int64_t g0, const T *value, int64_t vsp, \
                                      int64_t kv_len, float *out, const T *next_key,           \
                                      int64_t ksp, int64_t dim) {                              \
        vf acc[4][4];                                                                          \
        for (int j = 0; j < GB; ++j)                                                           \
            for (int c = 0; c < C; ++c) acc[j][c] = (vf){0};                                   \
        for (int64_t p = 0; p < kv_len; ++p) {                                                 \
            vf vv[4];                                                                          \
            if (d0 == 0 && p + PREFETCH_ROWS < kv_len)                                         \
                for (int64_t e = 0; e < vdim; e += LANES)                                      \
                    prefetch_kept(value + (p + PREFETCH_ROWS) * vsp + e);                      \
            if (next_key)  /* the next head's keys at this position, for its keys' pass */     \
                for (int64_t d = 0; d < dim; d += LANES) prefetch_next(next_key + p * ksp + d); \
            for (int c = 0; c < C; ++c) vv[c] = LOAD(value + p * vsp, d0 + c * LANES);         \
            for (int j = 0; j < GB; ++j) {                                                     \
                float wj = w[(g0 + j) * kv_len + p];                                           \
                for (int c = 0; c < C; ++c) acc[j][c] += wj * vv[c];                           \
            }                                                                                  \
        }                                                                                      \
        for (int j = 0; j < GB; ++j)                                                           \
            for (int c = 0; c < C; ++c)                                                        \
                memcpy(out + (g0 + j) * vdim + d0 + c * LANES, &acc[j][c], sizeof(vf));        \
    }                                                                                          \
    static void head_##SUF(int64_t group, int64_t kv_len, int64_t dim, int64_t vdim,           \
                           const float *q, const T *key, int64_t ksp, const T *value,          \
                           int64_t vsp, const float *bias, int64_t msg, float scale,           \
                           float *scores, float *out, const T *next_key) {                     \
        int64_t g = 0;                                                                         \
        for (; g + 4 <= group; g += 4) {                                                       \
            int64_t p = 0;                                                                     \
            for (; p + 4 <= kv_len; p += 4) {                                                  \
                if (g == 0) ask_rows(value, vsp, vdim * (int64_t)sizeof(T), p, 4);             \
                scores_##SUF(4, 4, dim, q, g, key, ksp, kv_len, p, scores);                    \
            }                                                                                  \
            for (; p < kv_len; ++p)                                                            \
                for (int j = 0; j < 4; ++j) scores_##SUF(1, 1, dim, q, g + j, key, ksp, kv_len, p, scores); \
        }                                                                                      \
        for (; g + 2 <= group; g += 2) {                                                       \
            int64_t p = 0;                                                                     \
            for (; p + 8 <= kv_len; p += 8) {                                                  \
                if (g == 0) ask_rows(value, vsp, vdim * (int64_t)sizeof(T), p, 8);             \
                scores_##SUF(8, 2, dim, q, g, key, ksp, kv_len, p, scores);                    \
            }                                                                                  \
            for (; p < kv_len; ++p)                                                            \
                for (int j = 0; j < 2; ++j) scores_##SUF(1, 1, dim, q, g + j, key, ksp, kv_len, p, scores); \
        }                                                                                      \
        for (; g < group; ++g) {                                                               \
            int64_t p = 0;                                                                     \
            for (; p + 8 <= kv_len; p += 8) {                                                  \
                if (g == 0) ask_rows(value, vsp, vdim * (int64_t)sizeof(T), p, 8);             \
                scores_##SUF(8, 1, dim, q, g, key, ksp, kv_len, p, scores);                    \
            }                                                                                  \
            for (; p < kv_len; ++p) scores_##SUF(1, 1, dim, q, g, key, ksp, kv_len, p, scores); \
        }                                                                                      \
        softmax(group, kv_len, bias, msg, scale, scores, NULL);                                \
        int64_t whole = vdim - vdim % LANES;                                                   \
        for (g = 0; g < group; g += 4) {                                                       \
            int gb = group - g < 4 ? (int)(group - g) : 4;                                     \
            int64_t d = 0;                                                                     \
            for (; d + 4 * LANES <= whole; d += 4 * LANES) {                                   \
                const T *nk = g == 0 && d == 0 ? next_key : NULL;                              \
                if (gb == 4)                                                                   \
                    weighted_##SUF(4, 4, vdim, d, scores, g, value, vsp, kv_len, out, nk, ksp, dim); \
                else                                                                           \
                    for (int j = 0; j < gb; ++j)                                               \
                        weighted_##SUF(1, 4, vdim, d, scores, g + j, value, vsp, kv_len, out,  \
                                       j == 0 ? nk : NULL, ksp, dim);                          \
            }                                                                                  \
            for (; d < whole; d += LANES)                                                      \
                for (int j = 0; j < gb; ++j)                                                   \
                    weighted_##SUF(1, 1, vdim, d, scores, g + j, value, vsp, kv_len, out,      \
                                   g == 0 && d == 0 && j == 0 ? next_key : NULL, ksp, dim);    \
            for (int j = 0; j < gb; ++j)                                                       \
                for (int64_t e = whole; e < vdim; ++e) {                                       \
                    float s = 0.0f;                                                            \
                    for (int64_t p = 0; p < kv_len; ++p)                                       \
                        s += scores[(g + j) * kv_len + p] * ELEM(value + p * vsp, e);          \
                    out[(g + j) * vdim + e] = s;                                               \
                }                                                                              \
        }                                                                                      \
    }

KERNELS(float, f32, load_f32, elem_f32)
KERNELS(uint16_t, bf16, load_bf16, elem_bf16)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_DPBF16 1

/* The 16 horizontal sums of a[0..15], lane i holding the sum of a[4 (i % 4) + i / 4] (a tree
 * of adds of half vectors: 45 operations where 16 separate reductions take about 128). */
static inline __m512 reduce16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}


/* Scores of R positions from p0 against GB query heads from g0 (R * GB == 16): bf16 pairs
 * multiplied and added into fp32 (vdpbf16ps), 16 accumulators reduced together. */
static inline void scores_dp(const int R, const int GB, int64_t dim, const uint16_t *qb,
                             int64_t g0, const uint16_t *key, int64_t ksp, int64_t kv_len,
                             int64_t p0, float *scores, const uint16_t *value, int64_t vsp,
                             int64_t vdim) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int r = 0; r < R; ++r)
        if (p0 + r + PREFETCH_ROWS < kv_len)
            for (int64_t d = 0; d < dim; d += 32) prefetch(key + (p0 + r + PREFETCH_ROWS) * ksp + d);
    if (value)  /* the same positions' values, for the values' pass */
        for (int r = 0; r < R; ++r)
            for (int64_t e = 0; e < vdim; e += 32) prefetch_next(value + (p0 + r) * vsp + e);
    for (int64_t d = 0; d < dim; d += 32) {
        __m512i qv[4];
        for (int j = 0; j < GB; ++j) qv[j] = _mm512_loadu_si512(qb + (g0 + j) * dim + d);
        for (int r = 0; r < R; ++r) {
            __m512i kv = _mm512_loadu_si512(key + (p0 + r) * ksp + d);
            for (int j = 0; j < GB; ++j)
                acc[r * GB + j] = _mm512_dpbf16_ps(acc[r * GB + j], (__m512bh)kv, (__m512bh)qv[j]);
        }
    }
    __m512 in[16];  /* in the order that puts query head j's R scores in lanes j R .. */
    for (int k = 0; k < 16; ++k) {
        int lane = 4 * (k % 4) + k / 4;
        in[k] = acc[(lane % R) * GB + lane / R];
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, reduce16(in));
    for (int j = 0; j < GB; ++j)
        memcpy(scores + (g0 + j) * kv_len + p0, lanes + j * R, (size_t)R * sizeof(float));
}

/* Asks for key rows p0 + PREFETCH_ROWS .. + 7 (those inside kv_len) and, where value is
 * given, value rows p0 .. p0 + 7 for the values' pass. */
static inline void ask_eight(const uint16_t *key, int64_t ksp, int64_t dim, int64_t kv_len,
                             int64_t p0, const uint16_t *value, int64_t vsp, int64_t vdim) {
    for (int r = 0; r < 8; ++r)
        if (p0 + r + PREFETCH_ROWS < kv_len)
            for (int64_t d = 0; d < dim; d += 32) prefetch(key + (p0 + r + PREFETCH_ROWS) * ksp + d);
    if (value)
        for (int r = 0; r < 8; ++r)
            for (int64_t e = 0; e < vdim; e += 32) prefetch_next(value + (p0 + r) * vsp + e);
}

/* a[i] holds position i's partial scores, query head j's four in 128-bit block j: each
 * head's four scores (sums of its block) go to out + j * kv_len (4 x 4 transposes within
 * the blocks). */
static inline void store_four(const __m512 a[4], float *out, int64_t kv_len) {
    __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    __m512 t = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
    _mm_storeu_ps(out, _mm512_castps512_ps128(t));
    _mm_storeu_ps(out + kv_len, _mm512_extractf32x4_ps(t, 1));
    _mm_storeu_ps(out + 2 * kv_len, _mm512_extractf32x4_ps(t, 2));
    _mm_storeu_ps(out + 3 * kv_len, _mm512_extractf32x4_ps(t, 3));
}

/* The scores of key rows [0, end) (end a multiple of 8) against four query heads g0 .. g0 + 3
 * for a head of M * 8 elements: each 8-element slice of a key row is loaded into both 128-bit
 * halves of a 256-bit vector (a load, no shuffle), and multiplied (vdpbf16ps) with two vectors
 * whose halves hold that slice of query heads g0, g0 + 1 and of g0 + 2, g0 + 3, so each lane
 * keeps a partial score of one head; a position's scores are then four sums of four lanes,
 * done for four positions by 4 x 4 transposes within 128-bit blocks (9 operations per 16
 * scores, where reducing a vector per score takes about 45 per 16). */
static inline void scores_bc4(const int M, const uint16_t *qb, int64_t g0, int64_t dim,
                              const uint16_t *key, int64_t ksp, int64_t kv_len, int64_t end,
                              float *scores, const uint16_t *value, int64_t vsp, int64_t vdim) {
    __m256i qv[32];  /* [slice m][heads 0-1 | heads 2-3] */
    for (int m = 0; m < M; ++m)
        for (int h = 0; h < 2; ++h)
            qv[2 * m + h] = _mm256_loadu2_m128i(
                (const __m128i *)(qb + (g0 + 2 * h + 1) * dim + 8 * m),
                (const __m128i *)(qb + (g0 + 2 * h) * dim + 8 * m));
    for (int64_t p0 = 0; p0 < end; p0 += 8) {
        ask_eight(key, ksp, dim, kv_len, p0, value, vsp, vdim);
        __m256 lo[8], hi[8];
        for (int r = 0; r < 8; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
        for (int m = 0; m < M; ++m) {
            __m256i q01 = qv[2 * m], q23 = qv[2 * m + 1];
            for (int r = 0; r < 8; ++r) {
                __m256i k = _mm256_broadcastsi128_si256(
                    _mm_loadu_si128((const __m128i *)(key + (p0 + r) * ksp + 8 * m)));
                lo[r] = _mm256_dpbf16_ps(lo[r], (__m256bh)k, (__m256bh)q01);
                hi[r] = _mm256_dpbf16_ps(hi[r], (__m256bh)k, (__m256bh)q23);
            }
        }
        for (int half = 0; half < 2; ++half) {
            __m512 a[4];
            for (int i = 0; i < 4; ++i)
                a[i] = _mm512_insertf32x8(_mm512_castps256_ps512(lo[4 * half + i]), hi[4 * half + i], 1);
            store_four(a, scores + g0 * kv_len + p0 + 4 * half, kv_len);
        }
    }
}

/* scores_bc4 with 512-bit vectors: each 8-element key slice in all four 128-bit blocks, one
 * vdpbf16ps against that slice of all four query heads (a head a block), so a position's
 * partial scores come in one vector and need no insert before the transposes. Half the
 * products of scores_bc4 at twice the width: faster where the CPU runs a 512-bit vdpbf16ps
 * at the rate of a 256-bit one (Intel's), slower where it splits it in two (AMD's Zen 4,
 * which then runs two 256-bit ones a cycle); see bb_decode_attention_wide. */
static inline void scores_bc4z(const int M, const uint16_t *qb, int64_t g0, int64_t dim,
                               const uint16_t *key, int64_t ksp, int64_t kv_len, int64_t end,
                               float *scores, const uint16_t *value, int64_t vsp, int64_t vdim) {
    __m512i qv[16];  /* [slice m]: heads g0 .. g0 + 3, a head a 128-bit block */
    for (int m = 0; m < M; ++m)
        qv[m] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu2_m128i(
                (const __m128i *)(qb + (g0 + 1) * dim + 8 * m),
                (const __m128i *)(qb + g0 * dim + 8 * m))),
            _mm256_loadu2_m128i((const __m128i *)(qb + (g0 + 3) * dim + 8 * m),
                                (const __m128i *)(qb + (g0 + 2) * dim + 8 * m)), 1);
    for (int64_t p0 = 0; p0 < end; p0 += 8) {
        ask_eight(key, ksp, dim, kv_len, p0, value, vsp, vdim);
        __m512 a[8];
        for (int r = 0; r < 8; ++r) a[r] = _mm512_setzero_ps();
        for (int m = 0; m < M; ++m)
            for (int r = 0; r < 8; ++r) {
                __m512i k = _mm512_broadcast_i32x4(
                    _mm_loadu_si128((const __m128i *)(key + (p0 + r) * ksp + 8 * m)));
                a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)k, (__m512bh)qv[m]);
            }
        for (int half = 0; half < 2; ++half)
            store_four(a + 4 * half, scores + g0 * kv_len + p0 + 4 * half, kv_len);
    }
}

/* Whether four-head key products take 512-bit vectors (scores_bc4z; else scores_bc4), set
 * once by the loader for the CPU's maker (bb_decode_attention_set_wide). */
static int wide_bc4 = 0;

/* Positions (even) per block of the values' pass: a block's rows of 128 bf16 (16 KiB) stay in
 * the first-level cache from the output's first 64-element tile to its last, up to
 * VALUE_TILES tiles (wider rows run whole heads per tile). */
#define VALUE_BLOCK 64
#define VALUE_TILES 8

/* out[g0 + j][d0 .. d0 + 32 C) = sum over the position pairs of [0, p_end) of the value rows'
 * bf16 pairs times the weights' (vdpbf16ps), this call summing [p_begin, p_end): from the raw
 * accumulators in carry where p_begin > 0, and into carry where ``more`` positions follow
 * (else into out); the accumulators' lanes follow unpack's interleaving and are put back in
 * order on the way out. */
static inline void weighted_dp(const int GB, const int C, int64_t vdim, int64_t d0,
                               const uint16_t *wb, int64_t g0, const uint16_t *value,
                               int64_t vsp, int64_t p_begin, int64_t p_end, int64_t kv_len,
                               float *out, float *carry, int more, const uint16_t *next_key,
                               int64_t ksp, int64_t dim) {
    __m512 acc[4][8];
    for (int j = 0; j < GB; ++j)
        for (int c = 0; c < 2 * C; ++c)
            acc[j][c] = p_begin == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(carry + 16 * (2 * C * j + c));
    for (int64_t p = p_begin; p < p_end; p += 2) {
        __m512i lo[4], hi[4];
        if (d0 == 0 && p + PREFETCH_ROWS + 1 < kv_len)  /* whole rows: the next tiles reuse them */
            for (int64_t e = 0; e < vdim; e += 32) {
                prefetch_kept(value + (p + PREFETCH_ROWS) * vsp + e);
                prefetch_kept(value + (p + PREFETCH_ROWS + 1) * vsp + e);
            }
        if (next_key)  /* the next head's keys at these positions, for its keys' pass */
            for (int64_t d = 0; d < dim; d += 32) {
                prefetch_next(next_key + p * ksp + d);
                prefetch_next(next_key + (p + 1) * ksp + d);
            }
        for (int c = 0; c < C; ++c) {
            __m512i x = _mm512_loadu_si512(value + p * vsp + d0 + 32 * c);
            __m512i y = _mm512_loadu_si512(value + (p + 1) * vsp + d0 + 32 * c);
            lo[c] = _mm512_unpacklo_epi16(x, y);
            hi[c] = _mm512_unpackhi_epi16(x, y);
        }
        for (int j = 0; j < GB; ++j) {
            uint32_t pair;
            memcpy(&pair, wb + (g0 + j) * kv_len + p, sizeof pair);
            __m512i w = _mm512_set1_epi32((int)pair);
            for (int c = 0; c < C; ++c) {
                acc[j][2 * c] = _mm512_dpbf16_ps(acc[j][2 * c], (__m512bh)lo[c], (__m512bh)w);
                acc[j][2 * c + 1] = _mm512_dpbf16_ps(acc[j][2 * c + 1], (__m512bh)hi[c], (__m512bh)w);
            }
        }
    }
    if (more) {  /* positions after p_end to come: the raw accumulators wait in carry */
        for (int j = 0; j < GB; ++j)
            for (int c = 0; c < 2 * C; ++c) _mm512_storeu_ps(carry + 16 * (2 * C * j + c), acc[j][c]);
        return;
    }
    for (int j = 0; j < GB; ++j)
        for (int c = 0; c < C; ++c) {
            float l[16], h[16], *o = out + (g0 + j) * vdim + d0 + 32 * c;
            _mm512_storeu_ps(l, acc[j][2 * c]);
            _mm512_storeu_ps(h, acc[j][2 * c + 1]);
            for (int k = 0; k < 4; ++k)
                for (int i = 0; i < 4; ++i) {
                    o[8 * k + i] = l[4 * k + i];
                    o[8 * k + 4 + i] = h[4 * k + i];
                }
        }
}

/* A bf16 head with vdpbf16ps (dim and vdim multiples of 32); the products of bf16 pairs
 * are exact in fp32 and summed in fp32, the softmax's weights rounded to bf16 for the
 * weighted sum of the values (as torch's products of a bf16 cache take them). */
static void head_bf16_dp(int64_t group, int64_t kv_len, int64_t dim, int64_t vdim,
                         const float *q, const uint16_t *key, int64_t ksp,
                         const uint16_t *value, int64_t vsp, const float *bias, int64_t msg,
                         float scale, float *scores, uint16_t *qb, uint16_t *wb, float *out,
                         const uint16_t *next_key) {
    for (int64_t i = 0; i < group * dim; ++i) qb[i] = to_bf16(q[i]);
    int64_t g = 0;
    for (; g < group; ) {
        int gb = group - g >= 4 ? 4 : group - g >= 2 ? 2 : 1, r = 16 / gb;
        int64_t p = 0;
        const uint16_t *vpf = g == 0 ? value : NULL;
        if (gb == 4 && (dim == 128 || dim == 64)) {  /* four heads a vector (scores_bc4) */
            p = kv_len - kv_len % 8;
            int m = dim == 128 ? 16 : 8;
            if (wide_bc4) scores_bc4z(m, qb, g, dim, key, ksp, kv_len, p, scores, vpf, vsp, vdim);
            else scores_bc4(m, qb, g, dim, key, ksp, kv_len, p, scores, vpf, vsp, vdim);
        }
        for (; p + r <= kv_len; p += r) {
            if (gb == 4) scores_dp(4, 4, dim, qb, g, key, ksp, kv_len, p, scores, vpf, vsp, vdim);
            else if (gb == 2) scores_dp(8, 2, dim, qb, g, key, ksp, kv_len, p, scores, vpf, vsp, vdim);
            else scores_dp(16, 1, dim, qb, g, key, ksp, kv_len, p, scores, vpf, vsp, vdim);
        }
        for (; p < kv_len; ++p)
            for (int j = 0; j < gb; ++j) {
                float sum = 0.0f;
                for (int64_t d = 0; d < dim; ++d)
                    sum += elem_bf16(qb + (g + j) * dim, d) * elem_bf16(key + p * ksp, d);
                scores[(g + j) * kv_len + p] = sum;
            }
        g += gb;
    }
    softmax(group, kv_len, bias, msg, scale, scores, wb);
    int64_t pairs_end = kv_len - kv_len % 2;
    float carry[VALUE_TILES * 4 * 4 * 16];
    for (g = 0; g < group; ) {
        int gb = group - g >= 4 ? 4 : group - g >= 2 ? 2 : 1;
        /* positions a block at a time, each 64-element tile of the output over the block (the
         * tiles' raw accumulators kept between blocks), so that the tiles after the first read
         * the block's values from the first-level cache */
        int64_t tiles = vdim / 64, d = 64 * tiles;
        int64_t block = tiles <= VALUE_TILES ? VALUE_BLOCK : pairs_end;
        int64_t pb = 0, pe;
        do {
            pe = pb + block < pairs_end ? pb + block : pairs_end;
            int more = pe < pairs_end;
            for (int64_t t = 0; t < tiles; ++t) {
                const uint16_t *nk = g == 0 && t == 0 ? next_key : NULL;
                float *cy = tiles <= VALUE_TILES ? carry + t * 4 * 4 * 16 : NULL;
                if (gb == 4) weighted_dp(4, 2, vdim, 64 * t, wb, g, value, vsp, pb, pe, kv_len, out, cy, more, nk, ksp, dim);
                else if (gb == 2) weighted_dp(2, 2, vdim, 64 * t, wb, g, value, vsp, pb, pe, kv_len, out, cy, more, nk, ksp, dim);
                else weighted_dp(1, 2, vdim, 64 * t, wb, g, value, vsp, pb, pe, kv_len, out, cy, more, nk, ksp, dim);
            }
            pb = pe;
        } while (pb < pairs_end);
        for (; d < vdim; d += 32)
            for (int j = 0; j < gb; ++j) {
                const uint16_t *nk = g == 0 && d == 0 && j == 0 ? next_key : NULL;
                weighted_dp(1, 1, vdim, d, wb, g + j, value, vsp, 0, pairs_end, kv_len, out, NULL, 0, nk, ksp, dim);
            }
        if (pairs_end < kv_len)
            for (int j = 0; j < gb; ++j) {
                float w = elem_bf16(wb + (g + j) * kv_len, kv_len - 1);
                for (int64_t e = 0; e < vdim; ++e)
                    out[(g + j) * vdim + e] += w * elem_bf16(value + (kv_len - 1) * vsp, e);
            }
        g += gb;
    }
}
#endif

#if defined(HAVE_DPBF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) \
    && defined(__AVX512VL__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_TILES 1

/* A key/value head's G query heads (G dividing 16) on the matrix tiles (Intel's AMX), in three
 * passes:
 * - the scores, 32 positions a step: the keys loaded straight from the cache into two tiles
 *   of 16 rows, multiplied with tiles of the G queries' bf16 pairs (loaded once per head),
 *   a row of G scores per position (bf16 products exact in fp32, summed in fp32);
 * - a softmax in fp32, each vector holding 16 / G positions of all G heads;
 * - the weights (rounded to bf16, as torch's products take them) times the values, 32
 *   positions a step: the tiles want two positions' elements interleaved, so the next step's
 *   value rows are paired while this step's pairs are multiplied.
 * A tile product does the work of many vector products, which leaves a head's time to its
 * reads of the cache from memory. */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int tiles_ready(void) {
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ready;
}

/* Whether bf16 heads run on the tiles where they fit: -1 until bb_decode_attention_tiles
 * sets it. */
static int use_tiles = -1;

/* Bytes ahead of the row read that keys and values are asked for (prefetcht2). */
#define TILE_AHEAD 8192

/* Heads whose weights are computed under one tile configuration before their values under
 * the other (each load of a configuration costs about as much as a few dozen positions). */
#define TILE_BATCH 8

/* Asks for the 64 bytes at ``p``, TILE_AHEAD or less past a row being read: where that is past
 * the head's last row (``end``), the same distance into the next head's rows (``next``; none
 * where NULL), as a cache's rows past kv_len are not read. */
static inline void ask_ahead(const char *p, const char *end, const char *next) {
    if (p < end) _mm_prefetch(p, _MM_HINT_T2);
    else if (next) _mm_prefetch(next + (p - end), _MM_HINT_T2);
}

/* Positions from which heads of one or two query heads a key/value head run on the tiles. */
#define TILE_FEW_HEADS_FROM 288

/* Whether a head of this shape runs on the tiles: 1, 2, 4, 8 or 16 query heads a key/value
 * head (a vector of scores holds 16 / G positions of all of them), keys of 32-128 elements in
 * steps of 32 (held in four tiles), values in steps of 32. With one or two query heads a tile
 * product fills one or two rows of sixteen: on an Intel Xeon such heads read their cache
 * 1.1-1.3 x faster than with the vector products from 300 positions on, 5-15 % slower at
 * 144-256 (bench/host_attention.py and a decode step's shapes), so they take the tiles from
 * TILE_FEW_HEADS_FROM positions. */
static int tiles_fit(int64_t group, int64_t kv_len, int64_t dim, int64_t vdim, int64_t msg) {
    return use_tiles > 0 && group >= 1 && group <= 16 && 16 % group == 0 && dim % 32 == 0
        && dim >= 32 && dim <= 128 && vdim % 32 == 0 && vdim >= 32 && kv_len > 0
        && (group >= 4 || kv_len >= TILE_FEW_HEADS_FROM)
        && msg * group + kv_len < ((int64_t)1 << 31);
}

/* The offset of a piece of ``bytes`` in a scratch laid out up to ``*at`` (pieces 64-byte
 * aligned), which then moves past it. */
static inline size_t carve(size_t *at, size_t bytes) {
    size_t offset = *at;
    *at += (bytes + 63) & ~(size_t)63;
    return offset;
}

/* exp(x) in fp32 for x <= 0 (a softmax's shifted scores): 2^n e^r, r within ln 2 / 2, a
 * polynomial of degree 6 (relative error about 1e-7, below the bf16 rounding that follows);
 * exactly 0 below -87 (a masked position, as expf gives for the mask's floor), NaN for NaN. */
static inline __m512 exp_le0(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  /* a NaN stays (max returns its second) */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(live, p, n);
}

/* What tiles_weights's softmax needs for a group of G query heads, made once per call of
 * the kernel: the lane rotations that bring lanes of one head together (by 8, 4, .. G), the
 * position (at_pos) and mask element (at_mask, ``msg`` apart per head) of each lane, and the
 * order that puts each head's lanes first (heads' R = 16 / G positions each). */
typedef struct {
    __m512i rotate[4], at_pos, at_mask;
    __m256i order;
    int rotations;
} tile_tables;

static void make_tile_tables(int64_t group, int64_t msg, tile_tables *tab) {
    const int G = (int)group, R = 16 / G;
    int32_t ix[16];
    tab->rotations = 0;
    for (int shift = 8; shift >= G; shift >>= 1) {
        for (int i = 0; i < 16; ++i) ix[i] = (i + shift) & 15;
        tab->rotate[tab->rotations++] = _mm512_loadu_si512(ix);
    }
    for (int l = 0; l < 16; ++l) ix[l] = l / G;
    tab->at_pos = _mm512_loadu_si512(ix);
    for (int l = 0; l < 16; ++l) ix[l] = (int32_t)((l % G) * msg + l / G);
    tab->at_mask = _mm512_loadu_si512(ix);
    int16_t first[16];
    for (int g = 0; g < G; ++g)
        for (int j = 0; j < R; ++j) first[g * R + j] = (int16_t)(j * G + g);
    tab->order = _mm256_loadu_si256((const __m256i *)first);
}

/* One call's setting for the tiles: the two tile configurations (the scores' and the
 * values'), the softmax's tables, the scratch of one head, and the weights of a batch of
 * heads (wb, ``wstride`` elements apart). */
typedef struct {
    tile_config weights, values;
    tile_tables tables;
    float *s, *acc;
    uint16_t *qt, *vb, *tail, *zeros, *wb;
    int64_t wstride;
} tile_plan;

/* Sets ``tp`` up for ``batch`` heads at a time and returns the scratch it points into (to
 * free), or NULL where it could not be allocated. */
static char *make_tile_plan(int64_t group, int64_t kv_len, int64_t dim, int64_t vdim,
                            int64_t msg, int64_t batch, tile_plan *tp) {
    const int64_t G = group, pp = (kv_len + 31) & ~(int64_t)31;
    memset(tp, 0, sizeof *tp);
    tp->weights.palette = tp->values.palette = 1;
    for (int t = 0; t < 8; ++t) {
        tp->weights.rows[t] = 16;
        tp->weights.colsb[t] = t < 2 ? 64 : (uint16_t)(G * 4);
        tp->values.rows[t] = t == 1 || t == 2 ? 16 : (uint8_t)G;
        tp->values.colsb[t] = 64;
    }
    make_tile_tables(group, msg, &tp->tables);
    const size_t head_weights = (2 * (size_t)(pp * G) + 63) & ~(size_t)63;
    size_t at = 0;
    const size_t s = carve(&at, 4 * (size_t)(pp * G + 16)), qt = carve(&at, 2 * (size_t)(G * dim));
    const size_t vb = carve(&at, 2 * 64 * (size_t)vdim), acc = carve(&at, 4 * (size_t)(G * vdim));
    const size_t tail = carve(&at, 2 * 16 * (size_t)dim), zeros = carve(&at, 2 * (size_t)vdim);
    const size_t weights = carve(&at, (size_t)batch * head_weights);
    char *scratch = aligned_alloc(64, at);  /* at: a multiple of 64 */
    if (!scratch) return NULL;
    tp->s = (float *)(scratch + s);
    tp->qt = (uint16_t *)(scratch + qt);
    tp->vb = (uint16_t *)(scratch + vb);
    tp->acc = (float *)(scratch + acc);
    tp->tail = (uint16_t *)(scratch + tail);
    tp->zeros = (uint16_t *)(scratch + zeros);
    tp->wb = (uint16_t *)(scratch + weights);
    tp->wstride = (int64_t)head_weights / 2;
    memset(tp->zeros, 0, 2 * (size_t)vdim);
    return scratch;
}

/* Pairs rows p, p + 1 of ``value`` (zeros past kv_len) for positions [s0, s0 + 32) into
 * ``dst`` (16 rows of vdim pairs), in unpack's order: of each 32 elements, the first 16 pairs
 * hold elements 0-3, 8-11, 16-19, 24-27 and the next 16 the others (the output puts them
 * back). */
static inline void pair_values(const uint16_t *value, int64_t vsp, int64_t kv_len, int64_t vdim,
                               int64_t s0, const uint16_t *zeros, uint16_t *dst,
                               const uint16_t *next) {
    const char *end = (const char *)(value + kv_len * vsp);
    for (int64_t p = s0; p < s0 + 32; p += 2, dst += 2 * vdim) {
        const uint16_t *x = p < kv_len ? value + p * vsp : zeros;
        const uint16_t *y = p + 1 < kv_len ? value + (p + 1) * vsp : zeros;
        const char *ahead = (const char *)(value + p * vsp) + TILE_AHEAD;
        for (int64_t d = 0; d < vdim; d += 32) {
            ask_ahead(ahead + 2 * d, end, (const char *)next);
            ask_ahead(ahead + 2 * (vsp + d), end, (const char *)next);
            __m512i a = _mm512_loadu_si512(x + d), b = _mm512_loadu_si512(y + d);
            _mm512_storeu_si512(dst + 2 * d, _mm512_unpacklo_epi16(a, b));
            _mm512_storeu_si512(dst + 2 * d + 32, _mm512_unpackhi_epi16(a, b));
        }
    }
}

/* The scores of 32 key rows from k0 (row stride ks bytes) against the queries in tiles 2-5
 * (tile 2 + c: elements 32 c .. 32 c + 31 of the head) into s (32 rows of qs bytes); the keys
 * TILE_AHEAD bytes ahead are asked for on the way, a row's 64 bytes at a time, so that memory
 * streams under the products. */
static inline void keys32(const uint16_t *k0, int64_t ks, int64_t chunks, float *s, int64_t qs,
                          const char *end, const char *next) {
    const char *ahead = (const char *)k0 + TILE_AHEAD;
    _tile_zero(6);
    _tile_zero(7);
#define KEYS(c, B)                                                                             \
    if (chunks > c) {                                                                          \
        for (int j = 0; j < 32; ++j) ask_ahead(ahead + (32 * c + j) * 64, end, next);          \
        _tile_loadd(0, (const char *)k0 + 64 * c, ks);                                         \
        _tile_loadd(1, (const char *)k0 + 16 * ks + 64 * c, ks);                               \
        _tile_dpbf16ps(6, 0, B);                                                               \
        _tile_dpbf16ps(7, 1, B);                                                               \
    }
    KEYS(0, 2) KEYS(1, 3) KEYS(2, 4) KEYS(3, 5)
#undef KEYS
    _tile_stored(6, s, qs);
    _tile_stored(7, (char *)s + 16 * qs, qs);
}

/* keys32 for 16 rows. */
static inline void keys16(const uint16_t *k0, int64_t ks, int64_t chunks, float *s, int64_t qs) {
    _tile_zero(6);
#define KEYS(c, B)                                                                             \
    if (chunks > c) {                                                                          \
        _tile_loadd(0, (const char *)k0 + 64 * c, ks);                                         \
        _tile_dpbf16ps(6, 0, B);                                                               \
    }
    KEYS(0, 2) KEYS(1, 3) KEYS(2, 4) KEYS(3, 5)
#undef KEYS
    _tile_stored(6, s, qs);
}

/* A head's softmax weights in bf16 into wb[g][0 .. pp) (zero from kv_len), under
 * tp->weights: the scores on the tiles, then the softmax. */
static void tiles_weights(int64_t group, int64_t kv_len, int64_t dim, const float *q,
                          const uint16_t *key, int64_t ksp, const float *bias, int64_t msg,
                          float scale, const tile_plan *tp, uint16_t *wb,
                          const uint16_t *next_key) {
    const int64_t G = group, pp = (kv_len + 31) & ~(int64_t)31, chunks = dim / 32;
    const int R = 16 / (int)G;  /* positions a vector of scores */
    const tile_tables *tab = &tp->tables;
    float *s = tp->s;
    uint16_t *qt = tp->qt, *tail = tp->tail;
    /* qt[c][r][g]: the pair q[g][32 c + 2 r], q[g][32 c + 2 r + 1] */
    for (int64_t c = 0; c < chunks; ++c)
        for (int64_t r = 0; r < 16; ++r)
            for (int64_t g = 0; g < G; ++g) {
                qt[((c * 16 + r) * G + g) * 2] = to_bf16(q[g * dim + 32 * c + 2 * r]);
                qt[((c * 16 + r) * G + g) * 2 + 1] = to_bf16(q[g * dim + 32 * c + 2 * r + 1]);
            }
    /* the scores: s[p][g] */
    const int64_t ks = ksp * 2, qs = G * 4;
    _tile_loadd(2, qt, qs);
    if (chunks > 1) _tile_loadd(3, qt + 32 * G, qs);
    if (chunks > 2) _tile_loadd(4, qt + 64 * G, qs);
    if (chunks > 3) _tile_loadd(5, qt + 96 * G, qs);
    int64_t p0 = 0;
    const char *keys_end = (const char *)(key + kv_len * ksp);
    for (; p0 + 32 <= kv_len; p0 += 32)
        keys32(key + p0 * ksp, ks, chunks, s + p0 * G, qs, keys_end, (const char *)next_key);
    for (; p0 < kv_len; p0 += 16) {  /* 16 rows, or the last few copied into zeros */
        if (kv_len - p0 >= 16) {
            keys16(key + p0 * ksp, ks, chunks, s + p0 * G, qs);
        } else {
            memset(tail, 0, 2 * 16 * (size_t)dim);
            for (int64_t r = 0; r < kv_len - p0; ++r)
                memcpy(tail + r * dim, key + (p0 + r) * ksp, 2 * (size_t)dim);
            keys16(tail, 2 * dim, chunks, s + p0 * G, qs);
        }
    }
    /* the softmax over s[p][g] (n scores; a vector holds positions p .. p + R - 1, all heads):
     * scaled and masked in place, each head's largest, the exponentials and their sum */
    const int64_t n = kv_len * G;
    __m512 top = _mm512_set1_ps(-INFINITY), vs = _mm512_set1_ps(scale);
    const __m512i at_pos = tab->at_pos, at_mask = tab->at_mask;
    for (int64_t i = 0, p = 0; i < n; i += 16, p += R) {
        __mmask16 live = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + i), vs);
        if (bias) {
            const float *m = bias + p;
            int64_t here = kv_len - p < R ? kv_len - p : R;  /* positions in this vector */
            __m512 b = msg == 0
                ? _mm512_permutexvar_ps(at_pos, _mm512_maskz_loadu_ps((__mmask16)((1u << here) - 1), m))
                : _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, at_mask, m, 4);
            x = _mm512_add_ps(x, b);
        }
        _mm512_storeu_ps(s + i, x);
        top = _mm512_mask_max_ps(top, live, top, x);
    }
    for (int r = 0; r < tab->rotations; ++r)
        top = _mm512_max_ps(top, _mm512_permutexvar_ps(tab->rotate[r], top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 live = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 e = exp_le0(_mm512_sub_ps(_mm512_loadu_ps(s + i), top));
        _mm512_storeu_ps(s + i, e);
        total = _mm512_mask_add_ps(total, live, total, e);
    }
    for (int r = 0; r < tab->rotations; ++r)
        total = _mm512_add_ps(total, _mm512_permutexvar_ps(tab->rotate[r], total));
    /* the weights in bf16, head-major: wb[g][p], zero from kv_len to pp */
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), total);
    const __m256i order = tab->order;
    for (int64_t i = 0, p = 0; i < n; i += 16, p += R) {
        __m256i w = _mm256_permutexvar_epi16(
            order, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + i), inv)));
        for (int64_t g = 0; g < G; ++g)  /* lanes g R .. g R + R - 1 to wb[g][p ..] */
            _mm256_mask_storeu_epi16(wb + g * pp + p - g * R, (__mmask16)(((1u << R) - 1) << (g * R)), w);
    }
    for (int64_t g = 0; g < G; ++g)
        for (int64_t p = kv_len; p < pp; ++p) wb[g * pp + p] = 0;
}

/* A head's output out[g][0 .. vdim) from its weights wb[g][0 .. pp), under tp->values. */
static void tiles_values(int64_t group, int64_t kv_len, int64_t vdim, const uint16_t *value,
                         int64_t vsp, const uint16_t *wb, const tile_plan *tp, float *out,
                         const uint16_t *next_value) {
    const int64_t G = group, pp = (kv_len + 31) & ~(int64_t)31;
    uint16_t *vb = tp->vb, *zeros = tp->zeros;
    float *acc = tp->acc;
    /* the values: acc[g][tile columns] += wb[g][32 positions] x paired values, 32 positions
     * a step; up to five tiles of 16 outputs at a time */
    memset(acc, 0, 4 * (size_t)(G * vdim));
    const int64_t ct = vdim / 16, bs = vdim * 4;
    pair_values(value, vsp, kv_len, vdim, 0, zeros, vb, next_value);
    for (int64_t s0 = 0; s0 < pp; s0 += 32) {
        const uint16_t *cur = vb + ((s0 / 32) & 1) * 32 * vdim;
        if (s0 + 32 < pp)  /* the next step's pairs, while these are multiplied */
            pair_values(value, vsp, kv_len, vdim, s0 + 32, zeros,
                        vb + ((s0 / 32 + 1) & 1) * 32 * vdim, next_value);
        for (int64_t t0 = 0; t0 < ct; t0 += 5) {
            const int64_t nt = ct - t0 < 5 ? ct - t0 : 5;
            float *a = acc + 16 * t0;
            const uint16_t *b = cur + 32 * t0;
            _tile_loadd(0, wb + s0, pp * 2);
#define VALUES(i, B, T)                                                                        \
    if (nt > i) {                                                                              \
        _tile_loadd(T, a + 16 * i, bs);                                                        \
        _tile_loadd(B, b + 32 * i, bs);                                                        \
        _tile_dpbf16ps(T, 0, B);                                                               \
        _tile_stored(T, a + 16 * i, bs);                                                       \
    }
            VALUES(0, 1, 3) VALUES(1, 2, 4) VALUES(2, 1, 5) VALUES(3, 2, 6) VALUES(4, 1, 7)
#undef VALUES
        }
    }
    /* acc's columns in unpack's order back to the output's */
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < vdim; d += 32) {
            __m512 l = _mm512_loadu_ps(acc + g * vdim + d), h = _mm512_loadu_ps(acc + g * vdim + d + 16);
            _mm512_storeu_ps(out + g * vdim + d, _mm512_permutex2var_ps(l, lo, h));
            _mm512_storeu_ps(out + g * vdim + d + 16, _mm512_permutex2var_ps(l, hi, h));
        }
}
#endif

#ifdef HAVE_TILES
/* attend_items on the tiles (a bf16 cache whose heads tiles_fit): TILE_BATCH heads' weights
 * under one configuration, then their values under the other. */
static int attend_tiles(int64_t b0, int64_t h0, int64_t h1, int64_t i0, int64_t i1,
                        int64_t kv_heads, int64_t group, int64_t kv_len, int64_t dim,
                        int64_t vdim, const float *q, const void *key, int64_t ksb,
                        int64_t ksh, int64_t ksp, const void *value, int64_t vsb,
                        int64_t vsh, int64_t vsp, const float *bias, int64_t msb,
                        int64_t msh, int64_t msg, float scale, float *out) {
    const int64_t batch = i1 - i0 < TILE_BATCH ? i1 - i0 : TILE_BATCH;
    tile_plan tp;
    char *scratch = make_tile_plan(group, kv_len, dim, vdim, msg, batch, &tp);
    if (!scratch) return -1;
    uint16_t *weights = tp.wb;
    const int64_t heads = h1 - h0, wstride = tp.wstride;
    const uint16_t *k = (const uint16_t *)key, *v = (const uint16_t *)value;
#define ITEM_B(i) (b0 + (i) / heads)
#define ITEM_H(i) (h0 + (i) % heads)
    for (int64_t i = i0; i < i1; i += batch) {
        const int64_t n = i1 - i < batch ? i1 - i : batch;
        _tile_loadconfig(&tp.weights);
        for (int64_t j = i; j < i + n; ++j) {
            int64_t b = ITEM_B(j), h = ITEM_H(j), qh = (b * kv_heads + h) * group;
            /* what is read next: the next head's keys, after the batch's last its first values */
            const uint16_t *next = j + 1 < i + n ? k + ITEM_B(j + 1) * ksb + ITEM_H(j + 1) * ksh
                                                 : v + ITEM_B(i) * vsb + ITEM_H(i) * vsh;
            tiles_weights(group, kv_len, dim, q + qh * dim, k + b * ksb + h * ksh, ksp,
                          bias ? bias + b * msb + h * msh : NULL, msg, scale, &tp,
                          weights + (j - i) * wstride, next);
        }
        _tile_loadconfig(&tp.values);
        for (int64_t j = i; j < i + n; ++j) {
            int64_t b = ITEM_B(j), h = ITEM_H(j), qh = (b * kv_heads + h) * group;
            /* the next head's values, after the batch's last the next batch's first keys */
            const uint16_t *next = j + 1 < i + n   ? v + ITEM_B(j + 1) * vsb + ITEM_H(j + 1) * vsh
                                   : j + 1 < i1 ? k + ITEM_B(j + 1) * ksb + ITEM_H(j + 1) * ksh
                                                : NULL;
            tiles_values(group, kv_len, vdim, v + b * vsb + h * vsh, vsp,
                         weights + (j - i) * wstride, &tp, out + qh * vdim, next);
        }
    }
#undef ITEM_B
#undef ITEM_H
    _tile_release();
    free(scratch);
    return 0;
}
#endif

/* Floats one of the machine's vector registers holds, as compiled: 16 with AVX-512; with
 * fewer, each of the generic paths' 16-float vectors takes two registers or more. */
int bb_decode_attention_lanes(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(__AVX__)
    return 8;
#else
    return 4;
#endif
}

/* Attention of items [i0, i1) of sequences [b0, b1) x key/value heads [h0, h1), item i the
 * head h0 + i % (h1 - h0) of sequence b0 + i / (h1 - h0); returns 0, or -1 where the scratch
 * buffer could not be allocated.
 * q: [batch, kv_heads, group, dim] float32, contiguous. out: the same with vdim, float32.
 * key, value: strides (sequence, head, position). bias: additive float32 mask with strides
 * (sequence, head, query head of the group), 0 where broadcast; NULL for none. */
static int attend_items(int dtype, int64_t b0, int64_t h0, int64_t h1, int64_t i0, int64_t i1,
                        int64_t kv_heads, int64_t group, int64_t kv_len, int64_t dim,
                        int64_t vdim, const float *q, const void *key, int64_t ksb,
                        int64_t ksh, int64_t ksp, const void *value, int64_t vsb,
                        int64_t vsh, int64_t vsp, const float *bias, int64_t msb,
                        int64_t msh, int64_t msg, float scale, float *out) {
#ifdef HAVE_TILES
    if (dtype == 1 && tiles_fit(group, kv_len, dim, vdim, msg))
        return attend_tiles(b0, h0, h1, i0, i1, kv_heads, group, kv_len, dim, vdim, q, key, ksb,
                            ksh, ksp, value, vsb, vsh, vsp, bias, msb, msh, msg, scale, out);
#endif
    size_t n = (size_t)(group * (kv_len > 0 ? kv_len : 1));
    float *scores = (float *)malloc(n * sizeof(float) + (n + (size_t)(group * dim)) * 2 + 64);
    if (!scores) return -1;
#ifdef HAVE_DPBF16
    uint16_t *wb = (uint16_t *)(scores + n), *qb = wb + n;
    int dp = dtype == 1 && dim % 32 == 0 && vdim % 32 == 0;
#endif
    int64_t heads = h1 - h0;
    for (int64_t i = i0; i < i1; ++i) {
        int64_t b = b0 + i / heads, h = h0 + i % heads;
        int64_t qh = (b * kv_heads + h) * group;
        const float *m = bias ? bias + b * msb + h * msh : NULL;
        /* the next item's head, whose keys the values' pass asks for */
        int64_t next = i + 1 < i1 ? (b0 + (i + 1) / heads) * ksb + (h0 + (i + 1) % heads) * ksh : -1;
        if (dtype == 0)
            head_f32(group, kv_len, dim, vdim, q + qh * dim,
                     (const float *)key + b * ksb + h * ksh, ksp,
                     (const float *)value + b * vsb + h * vsh, vsp, m, msg, scale, scores,
                     out + qh * vdim, next < 0 ? NULL : (const float *)key + next);
#ifdef HAVE_DPBF16
        else if (dp)
            head_bf16_dp(group, kv_len, dim, vdim, q + qh * dim,
                         (const uint16_t *)key + b * ksb + h * ksh, ksp,
                         (const uint16_t *)value + b * vsb + h * vsh, vsp, m, msg, scale,
                         scores, qb, wb, out + qh * vdim,
                         next < 0 ? NULL : (const uint16_t *)key + next);
#endif
        else
            head_bf16(group, kv_len, dim, vdim, q + qh * dim,
                      (const uint16_t *)key + b * ksb + h * ksh, ksp,
                      (const uint16_t *)value + b * vsb + h * vsh, vsp, m, msg, scale,
                      scores, out + qh * vdim,
                      next < 0 ? NULL : (const uint16_t *)key + next);
    }
    free(scores);
    return 0;
}

#define ATTEND_ARGS                                                                            \
    int dtype, int64_t b0, int64_t b1, int64_t h0, int64_t h1, int64_t kv_heads,               \
        int64_t group, int64_t kv_len, int64_t dim, int64_t vdim, const float *q,              \
        const void *key, int64_t ksb, int64_t ksh, int64_t ksp, const void *value,             \
        int64_t vsb, int64_t vsh, int64_t vsp, const float *bias, int64_t msb, int64_t msh,    \
        int64_t msg, float scale, float *out
#define ITEM_ARGS                                                                              \
    kv_heads, group, kv_len, dim, vdim, q, key, ksb, ksh, ksp, value, vsb, vsh, vsp, bias,     \
        msb, msh, msg, scale, out

/* Attention of sequences [b0, b1) x key/value heads [h0, h1) on the calling thread (see
 * attend_items); returns 0, or -1 where the scratch buffer could not be allocated. */
int bb_decode_attention(ATTEND_ARGS) {
    return attend_items(dtype, b0, h0, h1, 0, (b1 - b0) * (h1 - h0), ITEM_ARGS);
}

/* Whether bb_decode_attention_team runs on a team of threads (built with OpenMP). */
int bb_decode_attention_team_threads(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* bb_decode_attention on the calling thread's OpenMP team of ``threads`` (the team that
 * runs torch's own operations for a caller on the CPU, when torch runs on the same OpenMP
 * runtime: its threads then take the attention's pieces instead of waiting for the next
 * operation beside the caller's own workers): pieces of a few heads each, taken in turn. */
int bb_decode_attention_team(int threads, ATTEND_ARGS) {
    int64_t items = (b1 - b0) * (h1 - h0);
#ifdef _OPENMP
    int64_t piece = items / (8 * (int64_t)(threads > 0 ? threads : 1));
    piece = piece > 0 ? piece : 1;
    int64_t pieces = (items + piece - 1) / piece;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : failed)
    for (int64_t k = 0; k < pieces; ++k) {
        int64_t end = (k + 1) * piece < items ? (k + 1) * piece : items;
        failed |= attend_items(dtype, b0, h0, h1, k * piece, end, ITEM_ARGS) != 0;
    }
    return failed ? -1 : 0;
#else
    (void)threads;
    return attend_items(dtype, b0, h0, h1, 0, items, ITEM_ARGS);
#endif
}

/* Sets whether four-head key products take 512-bit vectors (wide 1) or 256-bit ones (0; a
 * negative value leaves it) and returns the setting (0 where the kernel has no such
 * products). */
int bb_decode_attention_wide(int wide) {
#ifdef HAVE_DPBF16
    if (wide >= 0) wide_bc4 = wide != 0;
    return wide_bc4;
#else
    (void)wide;
    return 0;
#endif
}

/* Whether a bf16 head of ``group`` query heads, ``kv_len`` positions, keys of ``dim`` and
 * values of ``vdim`` elements runs on the matrix tiles with the setting as it is. */
int bb_decode_attention_fits_tiles(int64_t group, int64_t kv_len, int64_t dim, int64_t vdim) {
#ifdef HAVE_TILES
    return tiles_fit(group, kv_len, dim, vdim, 0);
#else
    (void)group, (void)kv_len, (void)dim, (void)vdim;
    return 0;
#endif
}

/* Sets whether bf16 heads run on the matrix tiles (on 1, off 0; a negative value leaves it)
 * and returns the setting (0 where the CPU or the kernel has no tiles, or the process may not
 * use them). */
int bb_decode_attention_tiles(int on) {
#ifdef HAVE_TILES
    if (on >= 0) use_tiles = on != 0 && tiles_ready();
    return use_tiles > 0;
#else
    (void)on;
    return 0;
#endif
}
