/* stall: a producer that stops half-way, for the fault-injection tests (tests/bats/faults.bats):
 *   stall FILE BYTES [--ready PATH]
 * writes the first BYTES bytes of FILE to stdout (a pipe, as a producer would), then creates
 * PATH (if given, once every byte has been handed to the pipe) and waits, doing nothing, until
 * it is killed. With BYTES inside a frame, killing it is a producer that died mid-frame; with
 * BYTES at a frame boundary, it is a producer that hangs between batches. It never exits by
 * itself (a watchdog in the test kills it). */
#include <errno.h>
#include <fcntl.h>
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
    const char *ready = NULL;
    static const struct option lo[] = {{"ready", 1, 0, 'r'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (c) {
        case 'r': ready = optarg; break;
        case 'h': printf("usage: stall FILE BYTES [--ready PATH]\n"); return 0;
        default: return dfl_cli_usage_error("unknown option");
        }
    }
    if (argc - optind != 2)
        return dfl_cli_usage_error("expected FILE BYTES");
    dfl_err e = {0};
    int64_t want;
    if (dfl_parse_i64(argv[optind + 1], 0, INT64_MAX, &want, "BYTES", &e))
        return dfl_cli_usage_error("%s", e.msg);
    const char *path = argv[optind];
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        fprintf(stderr, "stall: %s: %s\n", path, strerror(errno));
        return 1;
    }
    char buf[65536];
    int64_t done = 0;
    while (done < want) {
        size_t n = want - done < (int64_t)sizeof buf ? (size_t)(want - done) : sizeof buf;
        ssize_t got = read(fd, buf, n);
        if (got <= 0) {
            fprintf(stderr, "stall: %s has only %lld bytes\n", path, (long long)done);
            return 1;
        }
        int rc = dfl_write_all(1, buf, (size_t)got, "stdout", &e);
        if (rc) {
            fprintf(stderr, "stall: %s\n", e.msg);
            return 1;
        }
        done += got;
    }
    close(fd);
    if (ready) {
        int rfd = open(ready, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (rfd < 0) {
            fprintf(stderr, "stall: %s: %s\n", ready, strerror(errno));
            return 1;
        }
        close(rfd);
    }
    for (;;)
        pause();
}
