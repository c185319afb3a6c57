/* t.h: a minimal unit-test harness. A test case is a function run by T_RUN; it fails if any
 * check in it fails. Comparisons are written so that NaN fails. main() ends with
 * `return t_done();`, which prints "<prog>: N passed, N failed, N skipped" and exits 0 when
 * nothing failed (77 when everything was skipped). */
#ifndef DFL_T_H
#define DFL_T_H

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int t_pass_, t_fail_, t_skip_, t_case_failed_, t_case_skipped_;
static const char *t_name_ = "test";

#define T_CHECK(cond, ...)                                                               \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            t_case_failed_ = 1;                                                          \
            fprintf(stderr, "  FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);            \
            fprintf(stderr, __VA_ARGS__);                                                \
            fputc('\n', stderr);                                                         \
        }                                                                                \
    } while (0)

/* |a - b| <= tol, failing on NaN */
#define T_NEAR(a, b, tol, what)                                                          \
    do {                                                                                 \
        double t_a_ = (double)(a), t_b_ = (double)(b), t_t_ = (double)(tol);             \
        if (!(fabs(t_a_ - t_b_) <= t_t_)) {                                              \
            t_case_failed_ = 1;                                                          \
            fprintf(stderr, "  FAIL %s:%d: %s: %.9g vs %.9g (tol %.3g)\n", __FILE__,     \
                    __LINE__, what, t_a_, t_b_, t_t_);                                   \
        }                                                                                \
    } while (0)

#define T_EQ_INT(a, b, what)                                                             \
    do {                                                                                 \
        long long t_a_ = (long long)(a), t_b_ = (long long)(b);                          \
        if (t_a_ != t_b_) {                                                              \
            t_case_failed_ = 1;                                                          \
            fprintf(stderr, "  FAIL %s:%d: %s: %lld != %lld\n", __FILE__, __LINE__,      \
                    what, t_a_, t_b_);                                                   \
        }                                                                                \
    } while (0)

/* Inside a test case: mark it skipped and return. */
#define T_SKIP(...)                                                                      \
    do {                                                                                 \
        t_case_skipped_ = 1;                                                             \
        fprintf(stderr, "  skip: ");                                                     \
        fprintf(stderr, __VA_ARGS__);                                                    \
        fputc('\n', stderr);                                                             \
        return;                                                                          \
    } while (0)

/* The larger of a running worst error and a new one, keeping a NaN (fmax drops it): a NaN
 * error then fails the closing `worst <= tol` check. */
static inline double t_worst(double worst, double d)
{
    return (d > worst || d != d) ? d : worst;
}

/* T_ONLY=SUBSTRING in the environment: the tests whose name does not hold it are skipped (to
 * run one test of a binary, e.g. under compute-sanitizer). */
#define T_RUN(fn)                                                                        \
    do {                                                                                 \
        t_case_failed_ = t_case_skipped_ = 0;                                            \
        if (getenv("T_ONLY") && !strstr(#fn, getenv("T_ONLY")))                          \
            t_case_skipped_ = 1;                                                         \
        else                                                                             \
            fn();                                                                        \
        if (t_case_failed_) {                                                            \
            t_fail_++;                                                                   \
            printf("not ok - %s\n", #fn);                                                \
        } else if (t_case_skipped_) {                                                    \
            t_skip_++;                                                                   \
            printf("ok - %s # skip\n", #fn);                                             \
        } else {                                                                         \
            t_pass_++;                                                                   \
            printf("ok - %s\n", #fn);                                                    \
        }                                                                                \
        fflush(stdout);                                                                  \
    } while (0)

static inline void t_init(const char *argv0)
{
    const char *s = strrchr(argv0, '/');
    t_name_ = s ? s + 1 : argv0;
}

static inline int t_done(void)
{
    printf("# %s: %d passed, %d failed, %d skipped\n", t_name_, t_pass_, t_fail_, t_skip_);
    if (t_fail_)
        return 1;
    return t_pass_ == 0 && t_skip_ > 0 ? 77 : 0;
}

/* The largest over rows of ||a - b|| / ||b|| (Euclidean norms, in double, of rows of n: row r of a
 * at a + r * lda, of b at b + r * ldb). A row where b is all zero is divided by zero_den instead
 * (1e-30: any difference fails; 1: its absolute error). NaN sticks. */
static inline double t_rows_err(const float *a, int64_t lda, const float *b, int64_t ldb, int64_t rows,
                                int64_t n, double zero_den)
{
    double worst = 0;
    for (int64_t r = 0; r < rows; r++) {
        double num = 0, den = 0;
        for (int64_t i = 0; i < n; i++) {
            double d = (double)a[r * lda + i] - b[r * ldb + i];
            num += d * d;
            den += (double)b[r * ldb + i] * b[r * ldb + i];
        }
        double err = sqrt(num) / (den > 0 ? sqrt(den) : zero_den);
        if (!(err <= worst))
            worst = err;
    }
    return worst;
}

/* The logits of the last n of the rows rows of x (rows of H): out[r * V + v] = sum over i of
 * x[(rows - n + r) * H + i] * lm[v * H + i], added in double in the order of i. */
static inline void t_logits_last(float *out, const float *x, int64_t rows, int64_t n, int64_t H, const float *lm,
                                 int64_t V)
{
    for (int64_t r = 0; r < n; r++)
        for (int64_t v = 0; v < V; v++) {
            double a = 0;
            for (int64_t i = 0; i < H; i++)
                a += (double)x[(rows - n + r) * H + i] * lm[v * H + i];
            out[r * V + v] = (float)a;
        }
}

#ifdef DFL_BACKEND_H
/* The CPU backend (f32) for a test program (include backend.h before t.h); NULL, with the message
 * on stderr, when it cannot be opened. */
static inline dfl_be *t_cpu_backend(void)
{
    dfl_be *be = NULL;
    dfl_err e = {0};
    if (dfl_be_open(&be, "cpu", DFL_DT_INVALID, &e))
        fprintf(stderr, "%s\n", e.msg);
    return be;
}
#endif

/* The shared oracle directory ($DFL_ORACLE), or NULL when absent. A directory there without the
 * oracles' README.md is a copy made wrong (the oracle cases would all skip unseen): the current
 * case fails, saying so. */
static inline const char *t_oracle(void)
{
    const char *o = getenv("DFL_ORACLE");
    if (!o || !*o)
        return NULL;
    FILE *f;
    char p[4096];
    snprintf(p, sizeof p, "%s/README.md", o);
    f = fopen(p, "r");
    if (!f) {
        struct stat st;
        if (stat(o, &st) == 0 && S_ISDIR(st.st_mode)) {
            t_case_failed_ = 1;
            fprintf(stderr, "  FAIL: DFL_ORACLE=%s is a directory without the oracles' README.md: "
                    "copy it with the oracles\n", o);
        }
        return NULL;
    }
    fclose(f);
    return o;
}

/* buf (of n bytes) = $DFL_ORACLE/ followed by the path fmt formats. Returns 0 when it is there (with
 * must, a file inside it, when must is not NULL), 1 without an oracle directory, 2 when it is
 * absent (a partial copy of the oracles). See T_NEED_ORACLE. */
static inline __attribute__((format(printf, 4, 5))) int t_oracle_path(char *buf, size_t n, const char *must,
                                                                      const char *fmt, ...)
{
    const char *o = t_oracle();
    if (!o)
        return 1;
    int k = snprintf(buf, n, "%s/", o);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + k, n - (size_t)k, fmt, ap);
    va_end(ap);
    char p[8192];
    snprintf(p, sizeof p, "%s%s%s", buf, must ? "/" : "", must ? must : "");
    return access(p, R_OK) == 0 ? 0 : 2;
}

/* Inside a test case: buf (an array) = the oracle path of t_oracle_path; the case is skipped when
 * there is no oracle directory or the path (or must inside it) is absent. */
#define T_NEED_ORACLE(buf, must, ...)                                                    \
    do {                                                                                 \
        int t_o_ = t_oracle_path(buf, sizeof buf, must, __VA_ARGS__);                    \
        if (t_o_ == 1)                                                                   \
            T_SKIP("no oracle directory (set DFL_ORACLE)");                              \
        if (t_o_ == 2)                                                                   \
            T_SKIP("%s is absent", buf);                                                 \
    } while (0)

/* A scratch directory for this test binary (created; removed by the runner). */
static inline const char *t_tmpdir(void)
{
    static char dir[4096];
    if (!dir[0]) {
        const char *base = getenv("TMPDIR");
        snprintf(dir, sizeof dir, "%s/dfl-test-XXXXXX", base && *base ? base : "/tmp");
        if (!mkdtemp(dir)) {
            perror("mkdtemp");
            exit(1);
        }
    }
    return dir;
}

/* A directory of the build for a test that runs the programs: $VAR (DFL_BIN, DFL_TOOLS) when
 * set, else SELF_DIR/../SUB (the test binary lives in BUILD/tests). */
static inline void t_build_dir(char *out, size_t n, const char *var, const char *self_dir,
                               const char *sub)
{
    const char *v = getenv(var);
    if (v && *v)
        snprintf(out, n, "%s", v);
    else
        snprintf(out, n, "%s/../%s", self_dir, sub);
}

/* The directory of this binary, from argv[0] ("." when it has no slash). */
static inline const char *t_self_dir(const char *argv0)
{
    static char dir[4096];
    const char *slash = strrchr(argv0, '/');
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - argv0) : 1, slash ? argv0 : ".");
    return dir;
}

/* The source tree: $DFL_SRCDIR when set, else three levels above this binary
 * (<root>/build/tests/<test>); "." when neither is known. */
static inline const char *t_src_root(void)
{
    static char root[4096];
    const char *env = getenv("DFL_SRCDIR");
    if (env && *env)
        return env;
    ssize_t n = readlink("/proc/self/exe", root, sizeof root - 1);
    root[n > 0 ? n : 0] = 0;
    for (int i = 0; i < 3; i++) {
        char *slash = strrchr(root, '/');
        if (!slash)
            return ".";
        *slash = 0;
    }
    return root;
}

#endif
