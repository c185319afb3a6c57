/* gpu-sh.h: what the end-to-end GPU tests (gpu-draft.c, gpu-eval.c, gpu-pipeline.c, gpu-target.c)
 * share: running a shell command and testing that a path exists. Header-only. */
#ifndef DFL_GPU_SH_H
#define DFL_GPU_SH_H

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

static bool exists(const char *p) __attribute__((unused));
static bool exists(const char *p)
{
    struct stat s;
    return stat(p, &s) == 0;
}

#endif
