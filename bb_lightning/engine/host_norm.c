/* Root-mean-square normalisation of rows on the host, in one pass over each row.
 *
 * The norm Llama-family models apply before their attention and MLP:
 *
 *     y = w * bf16(x * rsqrt(mean(x^2) + eps))     (x, w, y bf16; x^2, the mean, x * r fp32)
 *     y = w * (x * rsqrt(mean(x^2) + eps))         (x, w, y fp32)
 *
 * torch runs it as seven operations, each a pass over the activations (the fp32 copy of a
 * bf16 input among them); this reads each row once for its sum of squares and once more,
 * from the CPU's cache, for the output. The roundings are those of the seven operations:
 * the product x * r rounded to bf16, then multiplied by the weight in fp32 and rounded
 * again (round to nearest even, NaN kept a NaN). The sum of squares runs in another order
 * than torch's, so a product x * r that lies within an fp32 rounding of a bf16 midpoint
 * may round the other way.
 *
 * The rows are shared among the calling thread's OpenMP team of `threads` (torch's own,
 * when built with OpenMP); built without it, the caller runs them all.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

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
int bb_rms_norm_team_threads(void) {
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
