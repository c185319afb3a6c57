/* cli.h: what every program does the same way: program name, -q/-v levels, --version text,
 * reporting a dfl_err on stderr and turning it into the documented exit status. */
#ifndef DFL_CLI_H
#define DFL_CLI_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "err.h"

struct option;

/* Sets dfl_progname from argv[0], ignores SIGPIPE (writes then fail with EPIPE, reported as a
 * clear message instead of a silent death). */
void dfl_cli_init(const char *argv0);
/* Prints "prog: error: msg" to stderr and returns dfl_exit_code(e->code). */
int dfl_cli_report(const dfl_err *e);
/* "prog (dfl) VERSION", for --version (the program prints it: lib/ never writes to stdout). */
const char *dfl_cli_version_line(void);
/* For usage errors: prints "prog: msg\nTry 'prog --help'." and returns 1. */
int dfl_cli_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* "--NAME" of the getopt_long option whose val is c (in the list lo, ended by a NULL name) into
 * buf, "--?" if none; returns buf. For messages naming the option being parsed. */
const char *dfl_cli_opt_name(const struct option *lo, int c, char *buf, size_t n);
/* How many of the n inputs are "-" (stdin). */
int dfl_cli_count_stdin(const char *const *inputs, int n);
/* --threads N: N OpenMP and OpenBLAS threads (n <= 0: their defaults). */
void dfl_cli_threads(int64_t n);
/* SIGINT and SIGTERM set the returned flag (the program stops at its next boundary); a second
 * such signal ends the process at once. */
volatile sig_atomic_t *dfl_cli_stop_on_signals(void);

#endif
