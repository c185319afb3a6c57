/* cli.c: see cli.h. */
#include "cli.h"

#include <getopt.h>
#include <omp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "log.h"

#ifndef DFL_VERSION
#define DFL_VERSION "0.0.0"
#endif

void dfl_cli_init(const char *argv0)
{
    const char *slash = strrchr(argv0, '/');
    dfl_progname = slash ? slash + 1 : argv0;
    signal(SIGPIPE, SIG_IGN);
}

int dfl_cli_report(const dfl_err *e)
{
    if (e->code == DFL_OK)
        return 0;
    dfl_progress_end();
    fprintf(stderr, "%s: error: %s\n", dfl_progname, e->msg[0] ? e->msg : dfl_code_name(e->code));
    return dfl_exit_code(e->code);
}

const char *dfl_cli_version_line(void)
{
    static char line[160];
    snprintf(line, sizeof line, "%s (dfl) %s", dfl_progname, DFL_VERSION);
    return line;
}

int dfl_cli_usage_error(const char *fmt, ...)
{
    va_list ap;
    dfl_progress_end();
    fprintf(stderr, "%s: ", dfl_progname);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\nTry '%s --help' for more information.\n", dfl_progname);
    return 1;
}

const char *dfl_cli_opt_name(const struct option *lo, int c, char *buf, size_t n)
{
    const char *nm = NULL;
    for (; lo->name; lo++)
        if (lo->val == c)
            nm = lo->name;
    snprintf(buf, n, "--%s", nm ? nm : "?");
    return buf;
}

int dfl_cli_count_stdin(const char *const *inputs, int n)
{
    int k = 0;
    for (int i = 0; i < n; i++)
        k += strcmp(inputs[i], "-") == 0;
    return k;
}

void openblas_set_num_threads(int n);   /* OpenBLAS */

void dfl_cli_threads(int64_t n)
{
    if (n > 0) {
        omp_set_num_threads((int)n);
        openblas_set_num_threads((int)n);
    }
}

static volatile sig_atomic_t stop_flag;

static void on_stop_signal(int sig)
{
    stop_flag = 1;
    signal(sig, SIG_DFL);   /* a second signal ends the process at once */
}

volatile sig_atomic_t *dfl_cli_stop_on_signals(void)
{
    struct sigaction sa = {0};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    return &stop_flag;
}
