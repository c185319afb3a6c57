/* cli.c: see cli.h. */
#include "cli.h"

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
