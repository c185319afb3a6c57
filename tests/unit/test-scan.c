/* test-scan.c: the non-finite scanner and the statistics. NaN, +Inf and -Inf planted at the
 * first, last and middle positions of odd lengths (within one chunk and across chunks) for bf16,
 * f16, f32 and f64, with 1, 2 and all threads: counts and first index exact. Every bf16 and f16
 * bit pattern classified. Statistics against a naive double loop, and identical whatever the
 * thread count. */
#include <fcntl.h>
#include <stdint.h>
#include <unistd.h>

#include "scan.h"
#include "util.h"
#include "t.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static double rnd_unit(void) { return (double)(rnd() >> 11) * 0x1p-53 * 2.0 - 1.0; }

static const dfl_dtype float_types[] = {DFL_BF16, DFL_F16, DFL_F32, DFL_F64};

/* Stores v at index i of a float tensor of type dt. */
static void store(void *p, dfl_dtype dt, size_t i, double v)
{
    switch (dt) {
    case DFL_BF16: ((uint16_t *)p)[i] = dfl_f32_to_bf16((float)v); break;
    case DFL_F16: ((uint16_t *)p)[i] = dfl_f32_to_f16((float)v); break;
    case DFL_F32: ((float *)p)[i] = (float)v; break;
    case DFL_F64: ((double *)p)[i] = v; break;
    default: break;
    }
}

static void *random_tensor(dfl_dtype dt, size_t n, double scale, double shift)
{
    void *p = malloc(n * dfl_dtype_size(dt) + 8);
    for (size_t i = 0; i < n; i++)
        store(p, dt, i, rnd_unit() * scale + shift);
    return p;
}

typedef struct plant {
    size_t at;
    double v;
} plant;

static void test_planted(void)
{
    const size_t C = DFL_SCAN_CHUNK;
    const size_t lengths[] = {1, 3, 17, 1001, C - 1, C + 7, 3 * C + 5};
    const int threads[] = {1, 2, 0};
    for (size_t ti = 0; ti < DFL_ARRAY_LEN(float_types); ti++) {
        dfl_dtype dt = float_types[ti];
        for (size_t li = 0; li < DFL_ARRAY_LEN(lengths); li++) {
            size_t n = lengths[li];
            /* planting patterns: one value at first / middle / last; all three kinds together */
            for (int pat = 0; pat < 6; pat++) {
                void *p = random_tensor(dt, n, 100.0, 0.0);
                plant pl[3];
                size_t np = 0;
                switch (pat) {
                case 0: pl[np++] = (plant){0, NAN}; break;
                case 1: pl[np++] = (plant){n - 1, INFINITY}; break;
                case 2: pl[np++] = (plant){n / 2, -INFINITY}; break;
                case 3:
                    pl[np++] = (plant){n - 1, NAN};
                    if (n > 4) {
                        pl[np++] = (plant){n / 2, INFINITY};
                        pl[np++] = (plant){n / 2 + 1, -INFINITY};
                    }
                    break;
                case 4: /* only in the last chunk */
                    pl[np++] = (plant){n - 1 - (n > 3 ? 2 : 0), -INFINITY};
                    break;
                default: break; /* none */
                }
                uint64_t want_nan = 0, want_pinf = 0, want_ninf = 0, want_first = DFL_SCAN_NONE;
                for (size_t k = 0; k < np; k++) {
                    store(p, dt, pl[k].at, pl[k].v);
                    want_nan += isnan(pl[k].v);
                    want_pinf += isinf(pl[k].v) && pl[k].v > 0;
                    want_ninf += isinf(pl[k].v) && pl[k].v < 0;
                    if (pl[k].at < want_first)
                        want_first = pl[k].at;
                }
                for (size_t th = 0; th < DFL_ARRAY_LEN(threads); th++) {
                    dfl_scan_result r;
                    dfl_err e;
                    T_CHECK(dfl_scan_nonfinite(p, dt, n, threads[th], &r, &e) == 0, "scan: %s", e.msg);
                    char what[128];
                    snprintf(what, sizeof what, "%s n=%zu pattern %d threads %d", dfl_dtype_lower(dt), n,
                             pat, threads[th]);
                    T_EQ_INT(r.n, n, what);
                    T_EQ_INT(r.nan, want_nan, what);
                    T_EQ_INT(r.posinf, want_pinf, what);
                    T_EQ_INT(r.neginf, want_ninf, what);
                    T_EQ_INT(r.nonfinite, want_nan + want_pinf + want_ninf, what);
                    T_CHECK(r.first == want_first, "%s: first %llu, expected %llu", what,
                            (unsigned long long)r.first, (unsigned long long)want_first);
                    T_EQ_INT(dfl_any_nonfinite(p, dt, n), np > 0, what);
                }
                free(p);
            }
        }
    }
}

/* Every bf16 and f16 bit pattern: the scan's counts equal those of a conversion to float. */
static void test_all_patterns(void)
{
    uint16_t *p = malloc(65536 * sizeof *p);
    for (uint32_t i = 0; i < 65536; i++)
        p[i] = (uint16_t)i;
    for (int k = 0; k < 2; k++) {
        dfl_dtype dt = k ? DFL_F16 : DFL_BF16;
        uint64_t nan = 0, pinf = 0, ninf = 0, first = DFL_SCAN_NONE;
        for (uint32_t i = 0; i < 65536; i++) {
            float f = k ? dfl_f16_to_f32((uint16_t)i) : dfl_bf16_to_f32((uint16_t)i);
            if (!isfinite(f) && first == DFL_SCAN_NONE)
                first = i;
            nan += isnan(f);
            pinf += isinf(f) && f > 0;
            ninf += isinf(f) && f < 0;
        }
        dfl_scan_result r;
        dfl_err e;
        T_CHECK(dfl_scan_nonfinite(p, dt, 65536, 2, &r, &e) == 0, "scan");
        T_EQ_INT(r.nan, nan, dfl_dtype_lower(dt));
        T_EQ_INT(r.posinf, pinf, dfl_dtype_lower(dt));
        T_EQ_INT(r.neginf, ninf, dfl_dtype_lower(dt));
        T_EQ_INT(r.first, first, dfl_dtype_lower(dt));
        T_EQ_INT(pinf, 1, "one +inf pattern");
    }
    free(p);
    /* values that are finite however they look: largest finite, -0, subnormals */
    const uint16_t bf_ok[] = {0x7f7f, 0xff7f, 0x8000, 0x0001, 0x807f};
    const uint16_t h_ok[] = {0x7bff, 0xfbff, 0x8000, 0x0001, 0x83ff};
    const float f_ok[] = {3.4028235e38f, -3.4028235e38f, -0.0f, 1e-45f};
    const double d_ok[] = {1.7976931348623157e308, -0.0, 5e-324};
    T_CHECK(!dfl_any_nonfinite(bf_ok, DFL_BF16, 5), "bf16 finite edge values");
    T_CHECK(!dfl_any_nonfinite(h_ok, DFL_F16, 5), "f16 finite edge values");
    T_CHECK(!dfl_any_nonfinite(f_ok, DFL_F32, 4), "f32 finite edge values");
    T_CHECK(!dfl_any_nonfinite(d_ok, DFL_F64, 3), "f64 finite edge values");
    /* float8: e4m3fn has NaN (S.1111.111) and no Inf; e5m2 has both */
    const uint8_t e4[] = {0x7e, 0xfe, 0x00, 0x7f, 0x10, 0xff};
    const uint8_t e5[] = {0x7b, 0xfb, 0xfc, 0x7c, 0x7d};
    dfl_scan_result r;
    dfl_err e;
    dfl_scan_nonfinite(e4, DFL_F8_E4M3, 6, 1, &r, &e);
    T_CHECK(r.nan == 2 && r.posinf == 0 && r.first == 3, "e4m3fn: nan %llu first %llu",
            (unsigned long long)r.nan, (unsigned long long)r.first);
    dfl_scan_nonfinite(e5, DFL_F8_E5M2, 5, 1, &r, &e);
    T_CHECK(r.nan == 1 && r.posinf == 1 && r.neginf == 1 && r.first == 2, "e5m2");
    /* integers have no non-finite values */
    const int32_t ints[] = {0x7f800000, -1, 0x7fc00000};
    dfl_scan_nonfinite(ints, DFL_I32, 3, 1, &r, &e);
    T_CHECK(r.n == 3 && r.nonfinite == 0 && r.first == DFL_SCAN_NONE, "i32");
    T_CHECK(dfl_scan_nonfinite(ints, DFL_DT_INVALID, 3, 1, &r, &e) == DFL_EUNSUP, "invalid dtype");
}

static double load(const void *p, dfl_dtype dt, size_t i) { return dfl_load_f64(p, dt, i); }

static void naive_stats(const void *p, dfl_dtype dt, size_t n, dfl_stats *s)
{
    double sum = 0, mn = INFINITY, mx = -INFINITY;
    uint64_t m = 0;
    for (size_t i = 0; i < n; i++) {
        double v = load(p, dt, i);
        if (!isfinite(v))
            continue;
        sum += v;
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
        m++;
    }
    double mean = sum / (double)m, ss = 0;
    for (size_t i = 0; i < n; i++) {
        double v = load(p, dt, i);
        if (isfinite(v))
            ss += (v - mean) * (v - mean);
    }
    s->finite = m;
    s->mean = mean;
    s->std = sqrt(ss / (double)m);
    s->min = mn;
    s->max = mx;
    s->absmax = fabs(mn) > fabs(mx) ? fabs(mn) : fabs(mx);
}

static void test_stats(void)
{
    const size_t C = DFL_SCAN_CHUNK;
    const size_t lengths[] = {1, 5, 999, C + 3, 2 * C + 1};
    for (size_t ti = 0; ti < DFL_ARRAY_LEN(float_types); ti++) {
        dfl_dtype dt = float_types[ti];
        for (size_t li = 0; li < DFL_ARRAY_LEN(lengths); li++) {
            size_t n = lengths[li];
            /* a large mean beside a small spread stresses the variance (no sum-of-squares shortcut) */
            void *p = random_tensor(dt, n, 0.5, 300.0);
            if (n > 4) {
                store(p, dt, 1, NAN);
                store(p, dt, n - 2, -INFINITY);
            }
            dfl_stats s, ref, s1;
            dfl_err e;
            T_CHECK(dfl_scan_stats(p, dt, n, 2, &s, &e) == 0, "stats: %s", e.msg);
            T_CHECK(dfl_scan_stats(p, dt, n, 1, &s1, &e) == 0, "stats: %s", e.msg);
            naive_stats(p, dt, n, &ref);
            char what[64];
            snprintf(what, sizeof what, "%s n=%zu", dfl_dtype_lower(dt), n);
            T_EQ_INT(s.finite, ref.finite, what);
            T_EQ_INT(s.nf.nonfinite, n > 4 ? 2 : 0, what);
            T_EQ_INT(s.nf.first, n > 4 ? 1 : DFL_SCAN_NONE, what);
            T_NEAR(s.mean, ref.mean, 1e-12 * fabs(ref.mean), what);
            T_NEAR(s.std, ref.std, 1e-9 * ref.std + 1e-12, what);
            T_NEAR(s.min, ref.min, 0, what);
            T_NEAR(s.max, ref.max, 0, what);
            T_NEAR(s.absmax, ref.absmax, 0, what);
            T_CHECK(memcmp(&s, &s1, sizeof s) == 0, "%s: 1 and 2 threads differ", what);
            free(p);
        }
    }
    /* all non-finite: no statistics */
    float bad[3] = {NAN, INFINITY, -INFINITY};
    dfl_stats s;
    dfl_err e;
    dfl_scan_stats(bad, DFL_F32, 3, 1, &s, &e);
    T_CHECK(s.finite == 0 && s.nf.nonfinite == 3 && isnan(s.mean) && isnan(s.min) && isnan(s.std),
            "all non-finite");
    /* integers */
    const int64_t iv[] = {-5, 10, 1, 2};
    dfl_scan_stats(iv, DFL_I64, 4, 1, &s, &e);
    T_NEAR(s.mean, 2.0, 0, "i64 mean");
    T_NEAR(s.min, -5, 0, "i64 min");
    T_NEAR(s.max, 10, 0, "i64 max");
    T_NEAR(s.absmax, 10, 0, "i64 absmax");
    T_NEAR(s.std, sqrt((49 + 64 + 1 + 0) / 4.0), 1e-12, "i64 std");
    /* float8 values */
    const uint8_t e4[] = {0x38, 0xb8, 0x40}; /* 1.0, -1.0, 2.0 */
    dfl_scan_stats(e4, DFL_F8_E4M3, 3, 1, &s, &e);
    T_NEAR(s.min, -1, 0, "e4m3 min");
    T_NEAR(s.max, 2, 0, "e4m3 max");
    /* empty tensor */
    dfl_scan_stats(e4, DFL_F32, 0, 1, &s, &e);
    T_CHECK(s.nf.n == 0 && s.finite == 0 && isnan(s.mean), "empty");
}

/* Several tensors in one call: each gets its own result. */
static void test_many(void)
{
    const size_t C = DFL_SCAN_CHUNK;
    size_t ns[5] = {10, C + 1, 0, 7, 2 * C};
    dfl_dtype dts[5] = {DFL_F32, DFL_BF16, DFL_F16, DFL_I64, DFL_F64};
    void *ps[5];
    dfl_scan_job jobs[5];
    for (int k = 0; k < 5; k++) {
        ps[k] = dts[k] == DFL_I64 ? calloc(ns[k] + 1, 8) : random_tensor(dts[k], ns[k], 1, 0);
        jobs[k] = (dfl_scan_job){.data = ps[k], .fd = -1, .dtype = dts[k], .n = ns[k]};
    }
    store(ps[1], DFL_BF16, C, NAN);        /* second chunk of job 1 */
    store(ps[4], DFL_F64, 2 * C - 1, INFINITY);
    dfl_scan_result r[5];
    dfl_stats st[5];
    dfl_err e;
    T_CHECK(dfl_scan_nonfinite_many(jobs, 5, 0, r, &e) == 0, "many");
    T_CHECK(r[0].nonfinite == 0 && r[0].first == DFL_SCAN_NONE, "job 0");
    T_CHECK(r[1].nan == 1 && r[1].first == C, "job 1 first %llu", (unsigned long long)r[1].first);
    T_CHECK(r[2].n == 0 && r[2].nonfinite == 0, "job 2 (empty)");
    T_CHECK(r[3].nonfinite == 0 && r[3].n == 7, "job 3 (ints)");
    T_CHECK(r[4].posinf == 1 && r[4].first == 2 * C - 1, "job 4");
    T_CHECK(dfl_scan_stats_many(jobs, 5, 2, st, &e) == 0, "stats many");
    for (int k = 0; k < 5; k++) {
        T_EQ_INT(st[k].nf.nonfinite, r[k].nonfinite, "stats agree with the scan");
        T_EQ_INT(st[k].nf.first, r[k].first, "stats agree with the scan");
    }
    T_NEAR(st[3].mean, 0, 0, "ints mean");

    /* the same tensors read from a file (at odd offsets) give the same results */
    char path[4096];
    snprintf(path, sizeof path, "%s/tensors.bin", t_tmpdir());
    FILE *fp = fopen(path, "wb");
    uint64_t off = 3;
    fwrite("abc", 1, 3, fp);
    dfl_scan_job fjobs[5];
    for (int k = 0; k < 5; k++) {
        size_t nb = ns[k] * dfl_dtype_size(dts[k]);
        fwrite(ps[k], 1, nb, fp);
        fjobs[k] = (dfl_scan_job){.data = NULL, .dtype = dts[k], .n = ns[k], .offset = off, .what = "t"};
        off += nb;
    }
    fclose(fp);
    int fd = open(path, O_RDONLY);
    for (int k = 0; k < 5; k++)
        fjobs[k].fd = fd;
    dfl_scan_result fr[5];
    dfl_stats fst[5];
    T_CHECK(dfl_scan_nonfinite_many(fjobs, 5, 2, fr, &e) == 0, "from a file: %s", e.msg);
    T_CHECK(dfl_scan_stats_many(fjobs, 5, 1, fst, &e) == 0, "stats from a file: %s", e.msg);
    for (int k = 0; k < 5; k++) {
        T_CHECK(memcmp(&fr[k], &r[k], sizeof r[k]) == 0, "file scan %d differs", k);
        T_CHECK(memcmp(&fst[k], &st[k], sizeof st[k]) == 0,
                "file stats %d differ", k);
    }
    /* unaligned tensors in memory (foreign safetensors files) are scanned the same */
    uint8_t *odd = malloc(ns[4] * 8 + 1);
    memcpy(odd + 1, ps[4], ns[4] * 8);
    dfl_scan_job oj = {.data = odd + 1, .fd = -1, .dtype = DFL_F64, .n = ns[4]};
    dfl_stats ost;
    T_CHECK(dfl_scan_nonfinite_many(&oj, 1, 2, fr, &e) == 0 && memcmp(&fr[0], &r[4], sizeof r[4]) == 0,
            "unaligned scan");
    T_CHECK(dfl_scan_stats_many(&oj, 1, 2, &ost, &e) == 0 && memcmp(&ost, &st[4], sizeof ost) == 0,
            "unaligned stats");
    free(odd);
    /* a file shorter than the tensor: a read error naming the tensor */
    close(fd);
    fd = open(path, O_RDWR);
    T_CHECK(ftruncate(fd, (off_t)(off - 5)) == 0, "truncate");
    for (int k = 0; k < 5; k++)
        fjobs[k].fd = fd;
    fjobs[4].what = "layer.9";
    T_EQ_INT(dfl_scan_nonfinite_many(fjobs, 5, 2, fr, &e), DFL_EIO, "short file");
    T_CHECK(strstr(e.msg, "layer.9") != NULL, "message: %s", e.msg);
    close(fd);
    for (int k = 0; k < 5; k++)
        free(ps[k]);
}

static void test_diff(void)
{
    const size_t n = DFL_SCAN_CHUNK + 11;
    float *a = random_tensor(DFL_F32, n, 10, 0), *b = malloc(n * 4);
    memcpy(b, a, n * 4);
    dfl_diff_job j = {a, b, DFL_F32, DFL_F32, n};
    dfl_diff_result r;
    dfl_err e;
    T_CHECK(dfl_diff_many(&j, 1, 2, &r, &e) == 0 && r.ndiff == 0 && r.first == DFL_SCAN_NONE &&
                r.max_abs == 0 && r.max_rel == 0, "identical");
    b[DFL_SCAN_CHUNK + 3] = a[DFL_SCAN_CHUNK + 3] + 0.5f;
    b[7] = -0.0f;
    a[7] = 0.0f;                   /* -0 equals +0 */
    a[9] = b[9] = NAN;             /* NaN equals NaN */
    dfl_diff_many(&j, 1, 0, &r, &e);
    T_EQ_INT(r.ndiff, 1, "one difference");
    T_EQ_INT(r.first, DFL_SCAN_CHUNK + 3, "first difference");
    T_NEAR(r.max_abs, fabsf(b[DFL_SCAN_CHUNK + 3] - a[DFL_SCAN_CHUNK + 3]), 1e-6, "max_abs");
    b[2] = NAN;
    dfl_diff_many(&j, 1, 1, &r, &e);
    T_CHECK(r.ndiff == 2 && r.first == 2 && isinf(r.max_abs) && isinf(r.max_rel), "NaN against a number");
    /* mixed dtypes compare values */
    uint16_t h[3] = {dfl_f32_to_bf16(1.5f), dfl_f32_to_bf16(-2.0f), dfl_f32_to_bf16(3.0f)};
    float f[3] = {1.5f, -2.0f, 3.5f};
    dfl_diff_job m = {h, f, DFL_BF16, DFL_F32, 3};
    dfl_diff_many(&m, 1, 1, &r, &e);
    T_CHECK(r.ndiff == 1 && r.first == 2, "mixed dtypes");
    T_NEAR(r.max_abs, 0.5, 0, "mixed max_abs");
    T_NEAR(r.max_rel, 0.5 / 3.5, 1e-15, "mixed max_rel");
    free(a);
    free(b);
}

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    T_RUN(test_planted);
    T_RUN(test_all_patterns);
    T_RUN(test_stats);
    T_RUN(test_many);
    T_RUN(test_diff);
    return t_done();
}
