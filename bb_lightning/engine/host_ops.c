/* Row-wise operations of a Llama-family forward on the host, each in one pass over a row:
 * the RMS norm before attention and MLP, and the rotary position embedding of the queries
 * and keys; and training's gradient sums. torch runs each as several operations, each a
 * pass over the activations; these compute the same roundings in one.
 *
 * RMS norm:
 *
 *     y = w * bf16(x * rsqrt(mean(x^2) + eps))     (x, w, y bf16; x^2, the mean, x * r fp32)
 *     y = w * (x * rsqrt(mean(x^2) + eps))         (x, w, y fp32)
 *
 * torch runs it as seven operations (the fp32 copy of a bf16 input among them); this reads
 * each row once for its sum of squares and once more, from the CPU's cache, for the
 * output. The roundings are those of the seven operations: the product x * r rounded to
 * bf16, then multiplied by the weight in fp32 and rounded again (round to nearest even,
 * NaN kept a NaN). The sum of squares runs in another order than torch's, so a product
 * x * r that lies within an fp32 rounding of a bf16 midpoint may round the other way.
 *
 * Rotary embedding (Hugging Face's `apply_rotary_pos_emb` with its `rotate_half`), for a
 * row x of `dim` elements, h = dim / 2, and the row's cos and sin:
 *
 *     y[i] = x[i] * cos[i] + (-x[i + h]) * sin[i]     (i < h)
 *     y[i] = x[i] * cos[i] + x[i - h] * sin[i]        (i >= h)
 *
 * each product and the sum rounded as torch rounds them: in bf16 each of the three to
 * bf16 (the products are exact in fp32 before that), in fp32 each to fp32 (no fused
 * multiply-add): the results equal torch's bit for bit.
 *
 * Gated MLP activation (Llama's `act_fn(gate_proj(x)) * up_proj(x)` with act_fn = SiLU), bf16:
 *
 *     y[i] = bf16(silu(g[i]) * u[i])     (silu(g) the bf16 torch's F.silu gives for g)
 *
 * torch runs it as two operations, two passes over the activations. Here silu is looked up
 * in a table of torch's own results for each of the 65,536 bf16 values (as floats, built by
 * the caller with F.silu), and the product is computed in fp32 and rounded to bf16 to
 * nearest even as torch's product rounds it: the results equal torch's bit for bit, a NaN
 * kept a NaN (its payload as the CPU's own conversion keeps it: sign and upper bits, quiet).
 * Its backward (training; `bb_silu_mul_backward` below) computes both gradients in one pass
 * from g, u and the output's gradient, the SiLU's derivative looked up in a second table.
 *
 * RMS norm's backward (training, bf16; `bb_rms_norm_backward` below): for a row x, the
 * weight w and the output's gradient dy, with r = rsqrt(mean(x^2) + eps) and the forward's
 * n = bf16(x * r),
 *
 *     dw += dy * n                                  (fp32 sums, one row of them per thread)
 *     g = dy * w
 *     dx = bf16(r * g - x * r^3 * mean(g * x))
 *
 * all in fp32, rounded once at the end, where autograd through the seven operations rounds
 * g and each product of dw to bf16 first: the results lie as close to the exact gradient or
 * closer, not bit for bit torch's.
 *
 * Gradient sums (training's fp32 accumulators, `bb_sum_f32` below): a bf16 or fp32 gradient
 * widened and added in one pass, the sums torch's bit for bit. AdamW (`bb_adamw`, at the
 * end): those sums, the update of torch's `_fused_adamw_` and the weights' cast, in one pass.
 *
 * The rows are shared among the calling thread's OpenMP team of `threads` (torch's own,
 * when built with OpenMP); built without it, the caller runs them all.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* a NaN, as torch writes it */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float inverse_rms(float squares, int64_t dim, float eps) {
    float variance = squares / (float)dim + eps;
    return (float)(1.0 / sqrt((double)variance)); /* not the fast-math estimate of 1 / sqrtf */
}

static void row_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t dim, float eps) {
    float squares = 0.0f;
    for (int64_t i = 0; i < dim; i++) {
        float v = bf16_float(x[i]);
        squares += v * v;
    }
    float r = inverse_rms(squares, dim, eps);
    for (int64_t i = 0; i < dim; i++)
        y[i] = float_bf16(bf16_float(w[i]) * bf16_float(float_bf16(bf16_float(x[i]) * r)));
}

static void row_f32(const float *x, const float *w, float *y, int64_t dim, float eps) {
    float squares = 0.0f;
    for (int64_t i = 0; i < dim; i++) squares += x[i] * x[i];
    float r = inverse_rms(squares, dim, eps);
    for (int64_t i = 0; i < dim; i++) y[i] = w[i] * (x[i] * r);
}

/* Whether the library was built with OpenMP (else `threads` is ignored). */
int bb_host_ops_team_threads(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Normalise `rows` rows of `dim` elements: row i of x starts at x + i * x_stride
 * (elements), row i of y at y + i * dim; `dtype` 0 is fp32, 1 bf16 (x, w and y alike). */
int bb_rms_norm(int threads, int dtype, int64_t rows, int64_t dim, const void *x,
                int64_t x_stride, const void *w, void *y, float eps) {
    if (dtype != 0 && dtype != 1) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == 1)
            row_bf16((const uint16_t *)x + r * x_stride, (const uint16_t *)w,
                     (uint16_t *)y + r * dim, dim, eps);
        else
            row_f32((const float *)x + r * x_stride, (const float *)w, (float *)y + r * dim, dim,
                    eps);
    }
    return 0;
}

#define LANES 16

/* The backward of one bf16 row (see the header), its weight gradient added to `dw`. */
static void row_backward_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *dy,
                              uint16_t *dx, float *restrict dw, int64_t dim, float eps) {
    float sq[LANES] = {0}, dot[LANES] = {0};
    int64_t body = dim - dim % LANES;
    for (int64_t i = 0; i < body; i += LANES)
        for (int k = 0; k < LANES; k++) {
            float v = bf16_float(x[i + k]);
            sq[k] += v * v;
        }
    float squares = 0.0f;
    for (int k = 0; k < LANES; k++) squares += sq[k];
    for (int64_t i = body; i < dim; i++) squares += bf16_float(x[i]) * bf16_float(x[i]);
    float r = inverse_rms(squares, dim, eps);
    for (int64_t i = 0; i < body; i += LANES)
        for (int k = 0; k < LANES; k++) {
            float v = bf16_float(x[i + k]), d = bf16_float(dy[i + k]);
            dw[i + k] += d * bf16_float(float_bf16(v * r));
            dot[k] += d * bf16_float(w[i + k]) * v;
        }
    float total = 0.0f;
    for (int k = 0; k < LANES; k++) total += dot[k];
    for (int64_t i = body; i < dim; i++) {
        float v = bf16_float(x[i]), d = bf16_float(dy[i]);
        dw[i] += d * bf16_float(float_bf16(v * r));
        total += d * bf16_float(w[i]) * v;
    }
    float c = r * r * r * total / (float)dim;
    for (int64_t i = 0; i < dim; i++) {
        float v = bf16_float(x[i]);
        dx[i] = float_bf16(r * (bf16_float(dy[i]) * bf16_float(w[i])) - v * c);
    }
}

/* The backward of `rows` contiguous bf16 rows of `dim` elements (see the header): dx, and
 * the weight's gradient as `threads` fp32 rows of `dim` partial sums in `dw` (zeroed here;
 * the caller adds them up: thread t sums a contiguous share of the rows into row t). */
int bb_rms_norm_backward(int threads, int64_t rows, int64_t dim, const void *x, const void *w,
                         const void *dy, void *dx, float *dw, float eps) {
    if (threads < 1) return 1;
    memset(dw, 0, (size_t)threads * (size_t)dim * sizeof(float));
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), n = omp_get_num_threads();
#else
        int t = 0, n = 1;
#endif
        int64_t lo = rows * t / n, hi = rows * (t + 1) / n;
        for (int64_t r = lo; r < hi; r++)
            row_backward_bf16((const uint16_t *)x + r * dim, (const uint16_t *)w,
                              (const uint16_t *)dy + r * dim, (uint16_t *)dx + r * dim,
                              dw + (int64_t)t * dim, dim, eps);
    }
    return 0;
}

/* One product or sum of the rotation rounded to bf16, returned as the float it is. */
static inline float round_bf16(float f) { return bf16_float(float_bf16(f)); }

/* Elements LO and LO + half of a row: each product and the sum rounded to bf16 (a macro: the
 * loops below vectorize with it written in place). */
#define ROPE_PAIR_BF16(LO)                                                                     \
    do {                                                                                       \
        int64_t lo = (LO), hi = lo + half;                                                     \
        float a = round_bf16(bf16_float(x[lo]) * bf16_float(c[lo]));                           \
        float b = round_bf16(-bf16_float(x[hi]) * bf16_float(s[lo]));                          \
        float d = round_bf16(bf16_float(x[hi]) * bf16_float(c[hi]));                           \
        float e = round_bf16(bf16_float(x[lo]) * bf16_float(s[hi]));                           \
        y[lo] = float_bf16(a + b);                                                             \
        y[hi] = float_bf16(d + e);                                                             \
    } while (0)

#define ROPE_BLOCK 16
static void rope_bf16(const uint16_t *restrict x, const uint16_t *restrict c,
                      const uint16_t *restrict s, uint16_t *restrict y, int64_t half) {
    int64_t i = 0;
    for (; i + ROPE_BLOCK <= half; i += ROPE_BLOCK) /* blocks of a fixed width vectorize */
        for (int j = 0; j < ROPE_BLOCK; j++) ROPE_PAIR_BF16(i + j);
    for (; i < half; i++) ROPE_PAIR_BF16(i);
}

/* Each product rounded to fp32 before the sum, as torch's three operations round them. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
static void rope_f32(const float *restrict x, const float *restrict c, const float *restrict s,
                     float *restrict y, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        float a = x[i] * c[i], b = -x[i + half] * s[i];
        y[i] = a + b;
    }
    for (int64_t i = half; i < 2 * half; i++) {
        float a = x[i] * c[i], b = x[i - half] * s[i];
        y[i] = a + b;
    }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* The rotary embedding of the rows of a [n0, n1, n2, dim] tensor x into y: row (a, b, c)
 * of x starts at x + a * xs[0] + b * xs[1] + c * xs[2] (elements), and likewise those of
 * cos (cs), sin (ss) and y (ys); a stride of 0 repeats a row (cos and sin are the same for
 * every head). `dtype` 0 is fp32, 1 bf16 (all four alike); `dim` is even. */
int bb_rope(int threads, int dtype, int64_t n0, int64_t n1, int64_t n2, int64_t dim,
            const void *x, const int64_t *xs, const void *cos, const int64_t *cs,
            const void *sin, const int64_t *ss, void *y, const int64_t *ys) {
    if ((dtype != 0 && dtype != 1) || dim % 2 != 0) return 1;
    int64_t planes = n0 * n1, half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < planes; p++) {
        int64_t a = p / n1, b = p % n1;
        int64_t xo = a * xs[0] + b * xs[1], co = a * cs[0] + b * cs[1];
        int64_t so = a * ss[0] + b * ss[1], yo = a * ys[0] + b * ys[1];
        for (int64_t k = 0; k < n2; k++, xo += xs[2], co += cs[2], so += ss[2], yo += ys[2]) {
            if (dtype == 1)
                rope_bf16((const uint16_t *)x + xo, (const uint16_t *)cos + co,
                          (const uint16_t *)sin + so, (uint16_t *)y + yo, half);
            else
                rope_f32((const float *)x + xo, (const float *)cos + co,
                         (const float *)sin + so, (float *)y + yo, half);
        }
    }
    return 0;
}

/* A product rounded to bf16 to nearest even; a NaN stays a NaN with its sign and upper
 * payload bits, made quiet. */
static inline uint16_t product_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#if defined(__AVX512F__)
static inline __m256i product_bf16x16(__m512 f) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i up = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_mask_mov_epi32(up, nan, quiet), 16));
}
#endif

static void silu_mul_span(const uint16_t *restrict g, const uint16_t *restrict u,
                          const float *restrict table, uint16_t *restrict y, int64_t i,
                          int64_t end) {
#if defined(__AVX512F__)
    for (; i + 16 <= end; i += 16) {
        __m512i index = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + i)));
        __m512 s = _mm512_i32gather_ps(index, table, 4);
        __m512i ubits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(u + i)));
        __m512 uf = _mm512_castsi512_ps(_mm512_slli_epi32(ubits, 16));
        _mm256_storeu_si256((__m256i *)(y + i), product_bf16x16(_mm512_mul_ps(s, uf)));
    }
#endif
    for (; i < end; i++) y[i] = product_bf16(table[g[i]] * bf16_float(u[i]));
}

#define SILU_MUL_SPAN 8192
/* y = bf16(table[g] * u) over `n` bf16 elements of contiguous g, u and y; `table` holds the
 * 65,536 floats silu(v) for each bf16 bit pattern v. */
int bb_silu_mul(int threads, int64_t n, const void *g, const void *u, const float *table,
                void *y) {
    int64_t spans = (n + SILU_MUL_SPAN - 1) / SILU_MUL_SPAN;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t s = 0; s < spans; s++) {
        int64_t end = (s + 1) * SILU_MUL_SPAN < n ? (s + 1) * SILU_MUL_SPAN : n;
        silu_mul_span((const uint16_t *)g, (const uint16_t *)u, table, (uint16_t *)y,
                      s * SILU_MUL_SPAN, end);
    }
    return 0;
}

static void silu_mul_backward_span(const uint16_t *restrict g, const uint16_t *restrict u,
                                   const uint16_t *restrict dy, const float *restrict silu,
                                   const float *restrict dsilu, uint16_t *restrict dg,
                                   uint16_t *restrict du, int64_t i, int64_t end) {
#if defined(__AVX512F__)
    for (; i + 16 <= end; i += 16) {
        __m512i index = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + i)));
        __m512 s = _mm512_i32gather_ps(index, silu, 4);
        __m512 d = _mm512_i32gather_ps(index, dsilu, 4);
        __m512i ubits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(u + i)));
        __m512i ybits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(dy + i)));
        __m512 uf = _mm512_castsi512_ps(_mm512_slli_epi32(ubits, 16));
        __m512 yf = _mm512_castsi512_ps(_mm512_slli_epi32(ybits, 16));
        _mm256_storeu_si256((__m256i *)(du + i), product_bf16x16(_mm512_mul_ps(yf, s)));
        __m512 gy = _mm512_mul_ps(_mm512_mul_ps(yf, uf), d);
        _mm256_storeu_si256((__m256i *)(dg + i), product_bf16x16(gy));
    }
#endif
    for (; i < end; i++) {
        float y = bf16_float(dy[i]);
        du[i] = product_bf16(y * silu[g[i]]);
        dg[i] = product_bf16(y * bf16_float(u[i]) * dsilu[g[i]]);
    }
}

/* The gated MLP activation's backward (training, bf16): over `n` elements of contiguous g,
 * u, the output's gradient dy, and the gradients dg, du written,
 *
 *     du = bf16(dy * silu[g])                 (silu[g]: the forward's table; torch's bit for bit)
 *     dg = bf16((dy * u) * dsilu[g])           (fp32, rounded once)
 *
 * `dsilu` holds silu'(v) = sigmoid(v) * (1 + v * (1 - sigmoid(v))) for each bf16 bit pattern
 * v, computed by the caller in float64 and rounded to fp32. autograd rounds dy * u to bf16
 * before its SiLU backward: dg lies as close to the exact gradient or closer, not bit for
 * bit torch's. */
int bb_silu_mul_backward(int threads, int64_t n, const void *g, const void *u, const void *dy,
                         const float *silu, const float *dsilu, void *dg, void *du) {
    int64_t spans = (n + SILU_MUL_SPAN - 1) / SILU_MUL_SPAN;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t s = 0; s < spans; s++) {
        int64_t end = (s + 1) * SILU_MUL_SPAN < n ? (s + 1) * SILU_MUL_SPAN : n;
        silu_mul_backward_span((const uint16_t *)g, (const uint16_t *)u, (const uint16_t *)dy,
                               silu, dsilu, (uint16_t *)dg, (uint16_t *)du, s * SILU_MUL_SPAN,
                               end);
    }
    return 0;
}

/* Gradient sums in fp32 (training's accumulators): over `n` elements of contiguous fp32 dst
 * and of `nsrc` contiguous sources (`dtypes[j]` 0 fp32, 1 bf16),
 *
 *     dst[i] = ((dst[i] + s0[i]) + s1[i]) + ...     (into)
 *     dst[i] = (s0[i] + s1[i]) + ...                (not into: s0 copied in, -0.0 kept)
 *
 * each source widened to fp32 (exact) and each sum rounded to fp32, left to right: the
 * results of torch's `dst.copy_(s0)` or `dst.add_(s0.float())` then `dst.add_(s1.float())`,
 * bit for bit. torch converts a bf16 source in a pass of its own (or adds it several times
 * slower through its mixed-dtype path); here each span of dst is summed while it stays in
 * the core's cache, every source read once. */
#define SUM_SPAN 4096

static void add_span(float *restrict d, const void *src, int dtype, int64_t i, int64_t end,
                     int copy) {
    if (dtype == 1) {
        const uint16_t *restrict s = (const uint16_t *)src;
        if (copy)
            for (int64_t k = i; k < end; k++) d[k] = bf16_float(s[k]);
        else
            for (int64_t k = i; k < end; k++) d[k] += bf16_float(s[k]);
    } else {
        const float *restrict s = (const float *)src;
        if (copy)
            for (int64_t k = i; k < end; k++) d[k] = s[k];
        else
            for (int64_t k = i; k < end; k++) d[k] += s[k];
    }
}

int bb_sum_f32(int threads, int64_t n, float *dst, int nsrc, const void *const *srcs,
               const int *dtypes, int into) {
    for (int j = 0; j < nsrc; j++)
        if (dtypes[j] != 0 && dtypes[j] != 1) return 1;
    if (nsrc < 1) return into ? 0 : 1;
    int64_t spans = (n + SUM_SPAN - 1) / SUM_SPAN;
#pragma omp parallel for num_threads(spans > 16 ? threads : 1) schedule(static)
    for (int64_t s = 0; s < spans; s++) {
        int64_t i = s * SUM_SPAN, end = i + SUM_SPAN < n ? i + SUM_SPAN : n;
        for (int j = 0; j < nsrc; j++) add_span(dst, srcs[j], dtypes[j], i, end, !into && j == 0);
    }
    return 0;
}

/* AdamW on fp32 master weights and moments, its gradient summed in and its weights cast out
 * in the same pass (training's optimizer step on the host). Over `n` contiguous elements:
 *
 *     g = ((acc + s0) + s1) + ...        (bb_sum_f32's sums; acc NULL: from s0; none: 0)
 *     g = g / inv_scale                  (when `h[SCALED]` is set)
 *     p = p * decay
 *     m = fma(lerp, g - m, m)            (|lerp| < 0.5; else fma(lerp - 1, g - m, g))
 *     v = fma(sq_coef * g, g, v * beta2)
 *     p = p + (neg_step * m) / (sqrt(v) / bc2_sqrt + eps)
 *     out = p                            (bf16 to nearest even, or fp32; `out` NULL: none)
 *
 * in fp32 with the scalars in `h` (rounded to fp32 by the caller as torch rounds them): the
 * arithmetic of torch's `_fused_adamw_` vector loop, which the caller checks bit for bit
 * when it loads the library. Every element is computed alike wherever it lies (torch's
 * own loop computes the last n % 16 elements of a call another way). The gradient is summed
 * into a buffer of one span on the stack and never written out. */
enum { DECAY, LERP, LERP_SMALL, BETA2, SQ_COEF, BC2_SQRT, EPS, NEG_STEP, INV_SCALE, SCALED,
       ADAM_SCALARS };

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "no-math-errno", "fp-contract=off")
#endif
static void adamw_span(float *restrict p, float *restrict m, float *restrict v,
                       const float *restrict g, void *out, int odt, const float *h, int64_t len) {
    uint16_t *ob = out != NULL && odt == 1 ? (uint16_t *)out : NULL;
    float *of = out != NULL && odt == 0 ? (float *)out : NULL;
    int64_t k = 0;
#if defined(__AVX512F__)
    __m512 decay = _mm512_set1_ps(h[DECAY]), beta2 = _mm512_set1_ps(h[BETA2]);
    __m512 lerp = _mm512_set1_ps(h[LERP_SMALL] != 0.0f ? h[LERP] : h[LERP] - 1.0f);
    __m512 sq = _mm512_set1_ps(h[SQ_COEF]), bc2 = _mm512_set1_ps(h[BC2_SQRT]);
    __m512 eps = _mm512_set1_ps(h[EPS]), step = _mm512_set1_ps(h[NEG_STEP]);
    __m512 inv = _mm512_set1_ps(h[INV_SCALE]);
    for (; k + 16 <= len; k += 16) {
        __m512 gv = _mm512_loadu_ps(g + k);
        if (h[SCALED] != 0.0f) gv = _mm512_div_ps(gv, inv);
        __m512 pv = _mm512_mul_ps(_mm512_loadu_ps(p + k), decay);
        __m512 mo = _mm512_loadu_ps(m + k);
        __m512 mv = _mm512_fmadd_ps(lerp, _mm512_sub_ps(gv, mo), h[LERP_SMALL] != 0.0f ? mo : gv);
        __m512 vv = _mm512_fmadd_ps(_mm512_mul_ps(sq, gv), gv,
                                    _mm512_mul_ps(_mm512_loadu_ps(v + k), beta2));
        _mm512_storeu_ps(m + k, mv);
        _mm512_storeu_ps(v + k, vv);
        __m512 den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), bc2), eps);
        pv = _mm512_add_ps(pv, _mm512_div_ps(_mm512_mul_ps(step, mv), den));
        _mm512_storeu_ps(p + k, pv);
        if (ob != NULL) {
            __m512i u = _mm512_castps_si512(pv);
            __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            __m512i up = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
            __mmask16 nan = _mm512_cmpgt_epu32_mask(
                _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
            up = _mm512_mask_mov_epi32(up, nan, _mm512_set1_epi32(0x7fc00000));
            _mm256_storeu_si256((__m256i *)(ob + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
        }
        if (of != NULL) _mm512_storeu_ps(of + k, pv);
    }
#endif
    float lerp1 = h[LERP_SMALL] != 0.0f ? h[LERP] : h[LERP] - 1.0f;
    for (; k < len; k++) {
        float gv = h[SCALED] != 0.0f ? g[k] / h[INV_SCALE] : g[k];
        float pv = p[k] * h[DECAY];
        float mv = fmaf(lerp1, gv - m[k], h[LERP_SMALL] != 0.0f ? m[k] : gv);
        float vv = fmaf(h[SQ_COEF] * gv, gv, v[k] * h[BETA2]);
        m[k] = mv;
        v[k] = vv;
        pv = pv + (h[NEG_STEP] * mv) / (sqrtf(vv) / h[BC2_SQRT] + h[EPS]);
        p[k] = pv;
        if (ob != NULL) ob[k] = float_bf16(pv);
        if (of != NULL) of[k] = pv;
    }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

static const void *element(const void *t, int dtype, int64_t i) {
    return dtype == 1 ? (const void *)((const uint16_t *)t + i) : (const void *)((const float *)t + i);
}

int bb_adamw(int threads, int64_t n, float *p, float *m, float *v, const float *acc, int nsrc,
             const void *const *srcs, const int *dtypes, void *out, int odt, const float *h) {
    for (int j = 0; j < nsrc; j++)
        if (dtypes[j] != 0 && dtypes[j] != 1) return 1;
    if (out != NULL && odt != 0 && odt != 1) return 1;
    int64_t spans = (n + SUM_SPAN - 1) / SUM_SPAN;
#pragma omp parallel for num_threads(spans > 16 ? threads : 1) schedule(static)
    for (int64_t s = 0; s < spans; s++) {
        float g[SUM_SPAN];
        int64_t i = s * SUM_SPAN, len = (i + SUM_SPAN < n ? i + SUM_SPAN : n) - i;
        if (acc != NULL)
            memcpy(g, acc + i, (size_t)len * sizeof(float));
        else if (nsrc == 0)
            memset(g, 0, (size_t)len * sizeof(float));
        for (int j = 0; j < nsrc; j++)
            add_span(g, element(srcs[j], dtypes[j], i), dtypes[j], 0, len, acc == NULL && j == 0);
        adamw_span(p + i, m + i, v + i, g,
                   out == NULL ? NULL : (void *)element(out, odt, i), odt, h, len);
    }
    return 0;
}
