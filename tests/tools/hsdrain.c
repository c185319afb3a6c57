/* hsdrain: the consumer of the dfl-target benchmark: reads a hidden-state stream (stdin or a
 * file) through the library reader, so that every frame is read and its checksum verified, as
 * dfl-draft would, and prints one JSON line on stdout: batches, tokens, bytes, seconds from the
 * first byte to the end, and the steady rate: tokens per second from the end of batch W-1 to the
 * end of the last batch (W = --warmup, default 2), which leaves out the pipeline's fill.
 * --chunk-kib sets the reader's read(2) size on a pipe (dfl_reader_opts.chunk; 0 = default);
 * --hash-thread on|off|auto its hash thread (dfl_reader_opts.hash_thread; default auto);
 * --bounce off|inline|thread|auto its bounce path for large frames (dfl_reader_opts.bounce: off -1,
 * inline 1: read(2) into a cache-resident buffer, hashed there and streamed into the frame by the
 * reading thread; thread 2: hashed and streamed by a thread of the reader; default auto) and
 * --bounce-slots N the ring of the thread (dfl_reader_opts.bounce_slots; 0 = default), so that
 * one build compares the paths.
 * tail_s is the time from the last batch to the end of the stream (the producer's close).
 * cpu_s is the CPU time of the process, reader_cpu_s that of the reading thread alone (with the
 * hash thread, the rest is the hashing): where the cores are not shared, the reading thread's
 * time per byte is the ceiling of the consumer.
 * Exit 2 on a corrupt or cut stream (the library's message on stderr). */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>

#include "cli.h"
#include "frame.h"
#include "log.h"
#include "util.h"

static double cpu_seconds(const struct rusage *u)
{
    return (double)(u->ru_utime.tv_sec + u->ru_stime.tv_sec) + 1e-6 * (double)(u->ru_utime.tv_usec + u->ru_stime.tv_usec);
}

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    int64_t warm = 2, chunk_kib = 0;
    int64_t bounce_slots = 0;
    int hash_thread = 0, bounce = 0;
    static const struct option lo[] = {{"warmup", 1, 0, 'w'}, {"chunk-kib", 1, 0, 'c'}, {"hash-thread", 1, 0, 't'},
                                       {"bounce", 1, 0, 'b'}, {"bounce-slots", 1, 0, 's'}, {"help", 0, 0, 'h'},
                                       {0, 0, 0, 0}};
    dfl_err e = {0};
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case 'w':
            if (dfl_parse_i64(optarg, 0, 1000000, &warm, "--warmup", &e))
                return dfl_cli_report(&e);
            break;
        case 'c':
            if (dfl_parse_i64(optarg, 0, 1 << 20, &chunk_kib, "--chunk-kib", &e))
                return dfl_cli_report(&e);
            break;
        case 't':
            if (strcmp(optarg, "on") && strcmp(optarg, "off") && strcmp(optarg, "auto"))
                return dfl_cli_usage_error("--hash-thread: '%s' is not on, off or auto", optarg);
            hash_thread = !strcmp(optarg, "on") ? 1 : !strcmp(optarg, "off") ? -1 : 0;
            break;
        case 'b':
            if (!strcmp(optarg, "off"))
                bounce = -1;
            else if (!strcmp(optarg, "inline"))
                bounce = 1;
            else if (!strcmp(optarg, "thread"))
                bounce = 2;
            else if (!strcmp(optarg, "auto"))
                bounce = 0;
            else
                return dfl_cli_usage_error("--bounce: '%s' is not off, inline, thread or auto", optarg);
            break;
        case 's':
            if (dfl_parse_i64(optarg, 0, 64, &bounce_slots, "--bounce-slots", &e))
                return dfl_cli_report(&e);
            break;
        case 'h':
            printf("Usage: %s [--warmup W] [--chunk-kib C] [--hash-thread on|off|auto] [--bounce off|inline|thread|auto]\n"
                   "       [--bounce-slots N] [FILE]\n", dfl_progname);
            return 0;
        default: return dfl_cli_usage_error("unknown option");
        }
    }
    const char *path = optind < argc ? argv[optind] : "-";
    double t_open = dfl_now();
    dfl_reader *r = NULL;
    dfl_reader_opts ro = {.chunk = (uint32_t)(chunk_kib << 10), .hash_thread = hash_thread, .bounce = bounce,
                          .bounce_slots = (uint32_t)bounce_slots};
    if (dfl_reader_open(&r, path, &ro, &e))
        return dfl_cli_report(&e);
    double t_first = dfl_now(), t_warm = t_first, t_last = t_first;
    uint64_t batches = 0, tokens = 0, steady_tokens = 0, sum = 0;
    int rc;
    for (;;) {
        dfl_batch b = {0};
        bool eos = false;
        if ((rc = dfl_reader_next(r, &b, &eos, &e)) || eos)
            break;
        /* touch the data as a consumer would (one byte per 4 KiB: the checksum read it all) */
        size_t n = (size_t)b.n_tokens * b.hidden * dfl_dtype_size(b.dtype);
        for (uint32_t k = 0; k < b.n_layers; k++)
            for (size_t i = 0; i < n; i += 4096)
                sum += ((const uint8_t *)b.layers[k])[i];
        batches++;
        tokens += b.n_tokens;
        t_last = dfl_now();
        if ((int64_t)batches == warm)
            t_warm = t_last;
        else if ((int64_t)batches > warm)
            steady_tokens += b.n_tokens;
        dfl_reader_recycle(r, &b);
    }
    double t_end = dfl_now();
    struct rusage ru_all, ru_main;
    getrusage(RUSAGE_SELF, &ru_all);
    getrusage(RUSAGE_THREAD, &ru_main);
    uint64_t bytes = dfl_reader_offset(r);
    dfl_reader_close(r);
    if (rc)
        return dfl_cli_report(&e);
    /* the steady window ends with the last batch, not with the END frame: what the producer
     * does between its last batch and its END is not throughput (tail_s shows it) */
    double steady_s = t_last - t_warm;
    printf("{\"batches\": %" PRIu64 ", \"tokens\": %" PRIu64 ", \"bytes\": %" PRIu64
           ", \"seconds\": %.4f, \"wait_first_s\": %.4f, \"steady_batches\": %" PRIu64
           ", \"steady_tokens\": %" PRIu64 ", \"steady_seconds\": %.4f, \"steady_tokens_per_s\": %.1f, "
           "\"gb_per_s\": %.3f, \"cpu_s\": %.3f, \"reader_cpu_s\": %.3f, \"tail_s\": %.4f, \"touch\": %" PRIu64 "}\n",
           batches, tokens, bytes, t_end - t_first, t_first - t_open,
           batches > (uint64_t)warm ? batches - (uint64_t)warm : 0, steady_tokens, steady_s,
           steady_s > 0 && steady_tokens ? (double)steady_tokens / steady_s : 0.0,
           t_end > t_first ? (double)bytes / (t_end - t_first) / 1e9 : 0.0, cpu_seconds(&ru_all),
           cpu_seconds(&ru_main), t_end - t_last, sum % 1000);
    return 0;
}
