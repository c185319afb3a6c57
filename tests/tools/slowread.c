/* slowread: a slow consumer for the output-path tests (tests/bats/target.bats, pump.bats):
 *   slowread [--chunk BYTES] [--sleep-us US]
 * copies stdin to stdout with read(2) of at most BYTES (default 4096) and write(2), sleeping US
 * microseconds (default 1000) before each read, so that a producer on the other side of a pipe
 * finds it full and has to wait for the reader before reusing a buffer it spliced. Exit 0 at the
 * end of the input; on a read or write error, the library's exit code for it. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "util.h"

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    int64_t chunk = 4096, sleep_us = 1000;
    static const struct option lo[] = {{"chunk", 1, 0, 'c'}, {"sleep-us", 1, 0, 's'}, {"help", 0, 0, 'h'},
                                       {0, 0, 0, 0}};
    dfl_err e = {0};
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'c':
            if (dfl_parse_i64(optarg, 1, 1 << 24, &chunk, "--chunk", &e))
                return dfl_cli_report(&e);
            break;
        case 's':
            if (dfl_parse_i64(optarg, 0, 10000000, &sleep_us, "--sleep-us", &e))
                return dfl_cli_report(&e);
            break;
        case 'h': printf("usage: slowread [--chunk BYTES] [--sleep-us US]\n"); return 0;
        default: return dfl_cli_usage_error("unknown option");
        }
    }
    if (optind < argc)
        return dfl_cli_usage_error("unexpected argument '%s'", argv[optind]);
    char *buf = malloc((size_t)chunk);
    if (!buf)
        return dfl_cli_report(&(dfl_err){.code = DFL_ENOMEM, .msg = "out of memory"});
    int rc = DFL_OK;
    while (!rc) {
        if (sleep_us)
            usleep((useconds_t)sleep_us);
        ssize_t n = read(0, buf, (size_t)chunk);
        if (n == 0)
            break;
        if (n < 0 && errno != EINTR)
            rc = dfl_fail(&e, DFL_EIO, "stdin: %s", strerror(errno));
        else if (n > 0)
            rc = dfl_write_all(1, buf, (size_t)n, "stdout", &e);
    }
    free(buf);
    return rc ? dfl_cli_report(&e) : 0;
}
