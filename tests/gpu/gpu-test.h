/* gpu-test.h: what the GPU op tests (gpu-ops.c, gpu-train-ops.c) share: deterministic random
 * numbers, device buffers with guard bands of sentinel bytes (and NaN bytes in the data at
 * first), sync and byte comparisons, and the three backends they compare. Include after t.h,
 * backend.h and dtype.h, inside #ifdef DFL_CUDA. */
#ifndef DFL_GPU_TEST_H
#define DFL_GPU_TEST_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GUARD 256

/* the backends the op tests compare: the CPU reference, CUDA with bf16 and with f32 activations
 * (NULL without a GPU, where the tests skip; unused by the model tests) */
static dfl_be *g_cpu __attribute__((unused)), *g_bf __attribute__((unused)), *g_f32 __attribute__((unused));

/* Opens g_cpu, g_bf and g_f32 when there is a GPU. false (said on stderr) when they cannot be. */
static inline bool gpu_open_backends(const char *prog)
{
    if (dfl_be_cuda_count() <= 0)
        return true;
    dfl_err e = {0};
    if (dfl_be_cpu_open(&g_cpu, 0, &e) || dfl_be_cuda_open(&g_bf, 0, DFL_BF16, &e) ||
        dfl_be_cuda_open(&g_f32, 0, DFL_F32, &e)) {
        fprintf(stderr, "%s: cannot open the backends: %s\n", prog, e.msg);
        return false;
    }
    return true;
}

static inline void gpu_close_backends(void)
{
    dfl_be_close(g_bf);
    dfl_be_close(g_f32);
    dfl_be_close(g_cpu);
}

/* random numbers (deterministic) */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static inline uint64_t rng_next(void)
{
    uint64_t x = rng_state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng_state = x;
    return x * 0x2545F4914F6CDD1Dull;
}

static inline float rng_uniform(void) { return (float)((rng_next() >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }

static inline float rng_normal(void)
{
    float s = 0;
    for (int i = 0; i < 4; i++)
        s += rng_uniform();
    return s * 0.8660254f;
}

static inline int rng_int(int lo, int hi) { return lo + (int)(rng_next() % (uint64_t)(hi - lo + 1)); }

static inline float round_bf16(float x) { return dfl_bf16_to_f32(dfl_f32_to_bf16(x)); }

static inline void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    return p;
}

static inline float *rnd(size_t n, float scale, float offset, bool bf16)
{
    float *x = xmalloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) {
        x[i] = offset + scale * rng_normal();
        if (bf16)
            x[i] = round_bf16(x[i]);
    }
    return x;
}

static inline float *fdup(const float *x, size_t n)
{
    float *y = xmalloc(n * sizeof *y);
    memcpy(y, x, n * sizeof *y);
    return y;
}

/* ------------------------------------------------------------------------------------------ */
/* device buffers with guard bands */

typedef struct gbuf {
    dfl_be *be;
    uint8_t *base;      /* device: GUARD | data | GUARD */
    uint8_t *p;         /* device data */
    size_t bytes, n;
    dfl_dtype dt;
} gbuf;

static inline uint8_t guard_byte(size_t i) { return (uint8_t)(0x5A ^ (i * 37u)); }

/* n elements of dt; data starts `skew` bytes past a 256-byte boundary (misaligned tests) */
static inline bool gb_alloc_skew(gbuf *b, dfl_be *be, size_t n, dfl_dtype dt, size_t skew)
{
    dfl_err e = {0};
    memset(b, 0, sizeof *b);
    b->be = be;
    b->n = n;
    b->dt = dt;
    b->bytes = n * dfl_dtype_size(dt);
    size_t total = b->bytes + 2 * GUARD + skew;
    b->base = be->ops->alloc(be, total, &e);
    T_CHECK(b->base != NULL, "alloc of %zu bytes: %s", b->bytes, e.msg);
    if (!b->base)
        return false;
    b->p = b->base + GUARD + skew;
    uint8_t *h = xmalloc(total);
    for (size_t i = 0; i < total; i++)
        h[i] = guard_byte(i);
    memset(h + GUARD + skew, 0xFF, b->bytes);   /* NaN in every float type */
    T_CHECK(be->ops->upload(be, b->base, h, total) == 0, "upload");
    free(h);
    return true;
}

static inline bool gb_alloc(gbuf *b, dfl_be *be, size_t n, dfl_dtype dt) { return gb_alloc_skew(b, be, n, dt, 0); }

static inline void gb_free(gbuf *b)
{
    if (b->base)
        b->be->ops->free(b->be, b->base);
    memset(b, 0, sizeof *b);
}

static inline void gb_set(gbuf *b, const float *x)
{
    void *h = xmalloc(b->bytes);
    T_CHECK(dfl_convert(h, b->dt, x, DFL_F32, b->n), "host convert");
    T_CHECK(b->be->ops->upload(b->be, b->p, h, b->bytes) == 0, "upload");
    free(h);
}

static inline void gb_set_raw(gbuf *b, const void *x) { T_CHECK(b->be->ops->upload(b->be, b->p, x, b->bytes) == 0, "upload"); }

static inline void gb_get(gbuf *b, float *x)
{
    void *h = xmalloc(b->bytes);
    T_CHECK(b->be->ops->download(b->be, h, b->p, b->bytes) == 0, "download");
    T_CHECK(dfl_convert(x, DFL_F32, h, b->dt, b->n), "host convert");
    free(h);
}

static inline void gb_get_raw(gbuf *b, void *x) { T_CHECK(b->be->ops->download(b->be, x, b->p, b->bytes) == 0, "download"); }

static inline uint8_t *gb_image(gbuf *b)
{
    uint8_t *h = xmalloc(b->bytes);
    gb_get_raw(b, h);
    return h;
}

static inline void gb_check_guards(gbuf *b, const char *what)
{
    size_t skew = (size_t)(b->p - b->base) - GUARD;
    size_t total = b->bytes + 2 * GUARD + skew;
    uint8_t *h = xmalloc(total);
    T_CHECK(b->be->ops->download(b->be, h, b->base, total) == 0, "download");
    for (size_t i = 0; i < GUARD + skew; i++)
        if (h[i] != guard_byte(i)) {
            T_CHECK(0, "%s: guard band before the buffer overwritten at byte -%zu (0x%02x)", what,
                    GUARD + skew - i, h[i]);
            break;
        }
    for (size_t i = GUARD + skew + b->bytes; i < total; i++)
        if (h[i] != guard_byte(i)) {
            T_CHECK(0, "%s: guard band after the buffer (%zu bytes) overwritten at byte +%zu (0x%02x)",
                    what, b->bytes, i - GUARD - skew - b->bytes, h[i]);
            break;
        }
    free(h);
}

static inline void sync_ok(dfl_be *be, const char *what)
{
    dfl_err e = {0};
    int rc = be->ops->sync(be, &e);
    T_CHECK(rc == 0, "%s: sync: %s", what, e.msg);
}

static inline bool cmp_bytes(const char *what, const uint8_t *got, const uint8_t *ref, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (got[i] != ref[i]) {
            T_CHECK(0, "%s: byte %zu of %zu differs (0x%02x, expected 0x%02x)", what, i, n, got[i], ref[i]);
            return false;
        }
    return true;
}

/* Compares rows of n values (got with stride ldg, ref with stride ldr): relative error and cosine
 * per row; returns true if every row is within tolerance. Prints one "#" summary line, and the
 * worst rows (described by desc, if given) and elements on failure. With zero_row_fails, a
 * nonzero GPU row where the CPU's is all zero fails. */

/* Optional description of row r for failure reports. */
typedef void (*row_desc_fn)(const void *ctx, int64_t r, char *buf, size_t n);

static inline bool gpu_cmp_rows(const char *what, const float *got, int64_t ldg, const float *ref,
                                int64_t ldr, int64_t R, int64_t n, double rel_tol, double cos_min,
                                row_desc_fn desc, const void *ctx, bool zero_row_fails)
{
    double worst_rel = 0, worst_cos = 1;
    int64_t bad_rows = 0, nonfinite = 0, worst_row = -1;
    int printed = 0;
    for (int64_t r = 0; r < R; r++) {
        const float *g = got + r * ldg, *f = ref + r * ldr;
        double e2 = 0, r2 = 0, g2 = 0, dot = 0, maxd = -1;
        int64_t maxj = 0, nf = 0;
        for (int64_t j = 0; j < n; j++) {
            double gv = g[j], fv = f[j];
            if (!isfinite(gv) && isfinite(fv)) {
                nf++;
                continue;
            }
            double dd = fabs(gv - fv);
            e2 += dd * dd;
            r2 += fv * fv;
            g2 += gv * gv;
            dot += gv * fv;
            if (!(dd <= maxd)) {
                maxd = dd;
                maxj = j;
            }
        }
        double rel = sqrt(e2) / (sqrt(r2) > 1e-30 ? sqrt(r2) : 1e-30);
        double cs = (r2 == 0 && g2 == 0) ? 1.0 : dot / sqrt(r2 * g2 > 0 ? r2 * g2 : 1e-300);
        if (r2 == 0 && g2 == 0)
            rel = 0;
        if (zero_row_fails && r2 == 0 && g2 > 0)
            cs = 0;   /* the CPU row is all zero and the GPU's is not */
        nonfinite += nf;
        bool ok = nf == 0 && rel <= rel_tol && cs >= cos_min;
        if (!(rel <= worst_rel) || !(cs >= worst_cos) || nf) {
            if (!(rel <= worst_rel))
                worst_rel = rel;
            if (!(cs >= worst_cos))
                worst_cos = cs;
            worst_row = r;
        }
        if (!ok) {
            bad_rows++;
            if (printed < 6) {
                printed++;
                char d[200] = "";
                if (desc)
                    desc(ctx, r, d, sizeof d);
                fprintf(stderr, "    %s: row %lld%s%s: rel %.3g (tol %.3g), cos %.9f (min %.9f), %lld "
                        "non-finite; worst element [%lld]: gpu %.9g cpu %.9g (|diff| %.3g)\n",
                        what, (long long)r, d[0] ? " " : "", d, rel, rel_tol, cs, cos_min,
                        (long long)nf, (long long)maxj, (double)g[maxj], (double)f[maxj], maxd);
                int shown = 0;
                for (int64_t j = 0; j < n && shown < 3; j++)
                    if (!isfinite(g[j]) && isfinite(f[j])) {
                        fprintf(stderr, "      non-finite at [%lld]: gpu %g cpu %g\n", (long long)j,
                                (double)g[j], (double)f[j]);
                        shown++;
                    }
            }
        }
    }
    printf("#   %-64s rows %-7lld max rel %.3g  min cos %.9f%s\n", what, (long long)R, worst_rel,
           worst_cos, bad_rows ? "  FAIL" : "");
    T_CHECK(bad_rows == 0, "%s: %lld of %lld rows out of tolerance (worst row %lld: rel %.3g, cos %.9f; "
            "%lld non-finite values)", what, (long long)bad_rows, (long long)R, (long long)worst_row,
            worst_rel, worst_cos, (long long)nonfinite);
    return bad_rows == 0;
}

#endif
