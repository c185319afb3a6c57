/* cli.h: what every program does the same way: program name, -q/-v levels, --version text,
 * reporting a dfl_err on stderr and turning it into the documented exit status. */
#ifndef DFL_CLI_H
#define DFL_CLI_H

#include "err.h"

/* Sets dfl_progname from argv[0], ignores SIGPIPE (writes then fail with EPIPE, reported as a
 * clear message instead of a silent death). */
void dfl_cli_init(const char *argv0);
/* Prints "prog: error: msg" to stderr and returns dfl_exit_code(e->code). */
int dfl_cli_report(const dfl_err *e);
/* "prog (dfl) VERSION", for --version (the program prints it: lib/ never writes to stdout). */
const char *dfl_cli_version_line(void);
/* For usage errors: prints "prog: msg\nTry 'prog --help'." and returns 1. */
int dfl_cli_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
