/* gpu-sh.h: what the end-to-end GPU tests (gpu-draft.c, gpu-eval.c, gpu-pipeline.c, gpu-target.c)
 * share: running a shell command, testing that a path exists, comparing rows. Header-only. */
#ifndef DFL_GPU_SH_H
#define DFL_GPU_SH_H

#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>

/* When set, sh() also prints the command of each nonzero exit. */
static bool sh_report_exit;

/* Runs a shell command; returns its exit status (or -1, printing the command, when it did not
 * exit normally). */
static int sh(const char *fmt, ...) __attribute__((format(printf, 1, 2), unused));
static int sh(const char *fmt, ...)
{
    char cmd[16384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int st = system(cmd);
    if (st == -1 || !WIFEXITED(st)) {
        fprintf(stderr, "  command did not exit normally: %s\n", cmd);
        return -1;
    }
    if (sh_report_exit && WEXITSTATUS(st) != 0)
        fprintf(stderr, "  exit %d: %s\n", WEXITSTATUS(st), cmd);
    return WEXITSTATUS(st);
}

/* The sums behind one row's comparison of got values x against reference values y: its relative
 * error ||x - y|| / ||y|| and its cosine. */
typedef struct rowcmp {
    double num, den, ab, aa;
} rowcmp;

static inline void rowcmp_add(rowcmp *s, double x, double y)
{
    s->num += (x - y) * (x - y);
    s->den += y * y;
    s->ab += x * y;
    s->aa += x * x;
}

static inline double rowcmp_rel(const rowcmp *s) { return sqrt(s->num) / (s->den > 0 ? sqrt(s->den) : 1e-30); }
static inline double rowcmp_cos(const rowcmp *s) { return s->ab / (sqrt(s->aa) * sqrt(s->den) + 1e-30); }

static bool exists(const char *p) __attribute__((unused));
static bool exists(const char *p)
{
    struct stat s;
    return stat(p, &s) == 0;
}

#endif
