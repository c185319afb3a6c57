/* hspump: the producer half of dfl-target's output path without a model: writes N hidden-state
 * batches through the library writer (header, checksums, writev or vmsplice) to stdout or FILE,
 * from --slots rotating source buffers filled once with random bf16 values (so that, as in
 * dfl-target, each batch comes from memory that is not in the caches). With hsdrain on the
 * other end of a pipe it measures the pipe path alone, on any machine:
 *
 *   hspump [--batches N] [--tokens T] [--seqs S] [--layers K] [--hidden H] [--slots N]
 *          [--output-mode write|vmsplice|auto] [--vmsplice] [--rewrite] [--pipe-mib M]
 *          [--chunk-kib C] [--hash-thread on|off] [-o FILE]  | hsdrain [--chunk-kib C]
 *
 * --output-mode as dfl-target's, but the default here is write (auto and vmsplice: vmsplice into a
 * pipe; --vmsplice = --output-mode vmsplice). A slot is reused as dfl-target reuses its output
 * slots: only once dfl_writer_read_upto says the consumer has read past the slot's last frame (at
 * once when nothing is spliced), so that a pump with --slots 4 in vmsplice mode runs as far ahead
 * of its consumer as dfl-target does. --rewrite refills the slot's arrays with values of the batch
 * number before each batch (as dfl-target's copies refill its slots): a slot reused before the
 * consumer has read it then changes pages still in the pipe, which the consumer's checksums
 * catch. At the end it waits for the consumer to read everything before it frees the slots
 * (free() writes into the blocks it frees).
 *
 * Defaults: the dfl-target benchmark's Qwen3-8B batch (16384 tokens in 8 sequences, 5 layers of
 * 4096, bf16: 671 MB a batch), 20 batches, 3 slots. --pipe-mib and --chunk-kib set the
 * writer's pipe_size and chunk (dfl_writer_opts; 0 = the library's default), --hash-thread its
 * hash thread (dfl_writer_opts.hash_thread; default off, as the library's). Prints one JSON
 * line on stderr: bytes, seconds, GB/s, tokens/s, the pipe size in use, the slots and the time
 * spent waiting for a slot to be read out of the pipe, and the CPU time from the first batch on
 * of the process (cpu_s) and of the writing thread alone (writer_cpu_s; the rest is the hash
 * thread's). */
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "cli.h"
#include "frame.h"
#include "log.h"
#include "util.h"

/* CPU seconds of the process (self) or of the calling thread. */
static double cpu_now(int who)
{
    struct rusage u;
    getrusage(who, &u);
    return (double)(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * (double)(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

/* Waits until the consumer has read the stream up to offset `upto` (at once when nothing is
 * spliced), adding the time to *waited. */
static int wait_read(dfl_writer *w, uint64_t upto, double *waited, dfl_err *e)
{
    double t0 = dfl_now();
    uint64_t got = 0;
    int rc;
    while (!(rc = dfl_writer_read_upto(w, &got, e)) && got < upto)
        usleep((useconds_t)(dfl_pipe_poll_ns(upto - got) / 1000));
    *waited += dfl_now() - t0;
    return rc;
}

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    int64_t batches = 20, T = 16384, S = 8, K = 5, H = 4096, slots = 3, pipe_mib = 0, chunk_kib = 0;
    bool vms = false, rewrite = false;
    int hash_thread = 0;
    const char *out = "-";
    static const struct option lo[] = {
        {"batches", 1, 0, 'b'}, {"tokens", 1, 0, 't'}, {"seqs", 1, 0, 's'}, {"layers", 1, 0, 'k'},
        {"hidden", 1, 0, 'H'}, {"slots", 1, 0, 'n'}, {"vmsplice", 0, 0, 'v'}, {"output-mode", 1, 0, 'm'}, {"rewrite", 0, 0, 'r'}, {"pipe-mib", 1, 0, 'p'}, {"chunk-kib", 1, 0, 'c'},
        {"hash-thread", 1, 0, 'T'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    dfl_err e = {0};
    int c;
    while ((c = getopt_long(argc, argv, "o:", lo, NULL)) != -1) {
        int64_t *dst = NULL, lo_ = 1, hi = 1 << 30;
        const char *what = NULL;
        switch (c) {
        case 'b': dst = &batches, what = "--batches", lo_ = 0; break;
        case 't': dst = &T, what = "--tokens"; break;
        case 's': dst = &S, what = "--seqs", hi = 1 << 16; break;
        case 'k': dst = &K, what = "--layers", hi = DFL_MAX_LAYERS; break;
        case 'H': dst = &H, what = "--hidden", hi = 1 << 20; break;
        case 'n': dst = &slots, what = "--slots", hi = 64; break;
        case 'p': dst = &pipe_mib, what = "--pipe-mib", hi = 2047; break;
        case 'c': dst = &chunk_kib, what = "--chunk-kib", hi = 1 << 20; break;
        case 'v': vms = true; break;
        case 'm': {
            dfl_writer_opts mo = {0};
            if (dfl_writer_output_mode(optarg, &mo, &e))
                return dfl_cli_usage_error("%s", e.msg);
            vms = mo.vmsplice;
            break;
        }
        case 'r': rewrite = true; break;
        case 'T':
            if (strcmp(optarg, "on") && strcmp(optarg, "off"))
                return dfl_cli_usage_error("--hash-thread: '%s' is not on or off", optarg);
            hash_thread = !strcmp(optarg, "on") ? 1 : -1;
            break;
        case 'o': out = optarg; break;
        case 'h':
            printf("Usage: %s [--batches N] [--tokens T] [--seqs S] [--layers K] [--hidden H] "
                   "[--slots N] [--output-mode write|vmsplice|auto] [--vmsplice] [--rewrite] [--pipe-mib M] "
                   "[--chunk-kib C] [--hash-thread on|off] [-o FILE]\n", dfl_progname);
            return 0;
        default: return dfl_cli_usage_error("unknown option");
        }
        if (dst && dfl_parse_i64(optarg, lo_, hi, dst, what, &e))
            return dfl_cli_report(&e);
    }
    if (optind < argc)
        return dfl_cli_usage_error("unexpected argument '%s'", argv[optind]);
    if (S > T)
        return dfl_cli_usage_error("--seqs %lld is more than --tokens %lld", (long long)S, (long long)T);

    dfl_stream_info info = {.kind = DFL_KIND_HIDDEN, .version_major = DFL_FRAME_MAJOR,
                            .version_minor = DFL_FRAME_MINOR, .hidden_size = H, .n_layers = (int)K,
                            .dtype = DFL_BF16};
    snprintf(info.producer, sizeof info.producer, "hspump (dfl tests)");
    for (int k = 0; k < K; k++)
        info.layers[k] = k;

    /* the slots: K layer arrays each, random bf16 values (never zeros), lengths and ids */
    size_t n = (size_t)T * (size_t)H;
    uint16_t **buf = calloc((size_t)(slots * K), sizeof *buf);
    uint32_t *lens = malloc((size_t)S * sizeof *lens);
    int32_t *ids = malloc((size_t)T * sizeof *ids);
    uint8_t *mask = malloc((size_t)T);
    if (!buf || !lens || !ids || !mask)
        return dfl_cli_report(&(dfl_err){.code = DFL_ENOMEM, .msg = "out of memory"});
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int64_t i = 0; i < slots * K; i++) {
        if (!(buf[i] = malloc(n * 2)))
            return dfl_cli_report(&(dfl_err){.code = DFL_ENOMEM, .msg = "out of memory for the slots"});
        for (size_t j = 0; j < n; j++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            buf[i][j] = (uint16_t)(0x3c00u + (x & 0x07ffu)) ^ (uint16_t)((x >> 20) & 0x8000u);
        }
    }
    for (int64_t s = 0; s < S; s++)
        lens[s] = (uint32_t)(T / S + (s < T % S));
    for (int64_t t = 0; t < T; t++)
        ids[t] = (int32_t)(t % 1000), mask[t] = 1;

    dfl_writer *w;
    dfl_writer_opts wo = {.vmsplice = vms, .pipe_size = (uint32_t)(pipe_mib << 20),
                          .chunk = (uint32_t)(chunk_kib << 10), .hash_thread = hash_thread};
    if (dfl_writer_open(&w, out, &info, &wo, &e))
        return dfl_cli_report(&e);
    int pipe_sz = strcmp(out, "-") ? -1 : fcntl(1, F_GETPIPE_SZ);
    uint64_t end_off[64] = {0}; /* stream offset after each slot's last frame */
    double t0 = dfl_now(), waited = 0, cpu0 = cpu_now(RUSAGE_SELF), wcpu0 = cpu_now(RUSAGE_THREAD);
    for (int64_t b = 0; b < batches; b++) {
        int64_t sl = b % slots;
        /* the slot's last frame must have been read out of the pipe */
        if (b >= slots && wait_read(w, end_off[sl], &waited, &e)) {
            dfl_writer_abort(w);
            return dfl_cli_report(&e);
        }
        if (rewrite)
            for (int k = 0; k < K; k++)
                for (size_t j = 0; j < n; j++)
                    buf[sl * K + k][j] = (uint16_t)(0x3c00u + (((uint64_t)j * 2654435761u + (uint64_t)b * 40503u) & 0x7ffu));
        dfl_batch ob;
        memset(&ob, 0, sizeof ob);
        ob.n_tokens = (uint64_t)T;
        ob.n_seqs = (uint32_t)S;
        ob.n_layers = (uint32_t)K;
        ob.hidden = (uint32_t)H;
        ob.dtype = DFL_BF16;
        ob.seq_lens = lens;
        ob.input_ids = ids;
        ob.loss_mask = mask;
        for (int k = 0; k < K; k++)
            ob.layers[k] = buf[sl * K + k];
        if (dfl_writer_batch(w, &ob, &e)) {
            dfl_writer_abort(w);
            return dfl_cli_report(&e);
        }
        end_off[sl] = dfl_writer_bytes(w);
    }
    uint64_t bytes = dfl_writer_bytes(w);
    /* spliced pages must not change until they are read, and free() writes into the blocks it
     * frees (the allocator's links): wait for the reader before giving the slots back */
    double tail = 0;
    if (wait_read(w, bytes, &tail, &e)) {
        dfl_writer_abort(w);
        return dfl_cli_report(&e);
    }
    if (dfl_writer_close(w, &e))
        return dfl_cli_report(&e);
    double s = dfl_now() - t0, cpu = cpu_now(RUSAGE_SELF) - cpu0, wcpu = cpu_now(RUSAGE_THREAD) - wcpu0;
    fprintf(stderr, "{\"bytes\": %" PRIu64 ", \"seconds\": %.4f, \"gb_per_s\": %.3f, \"tokens_per_s\": %.1f, "
            "\"pipe_bytes\": %d, \"chunk_kib\": %lld, \"vmsplice\": %s, \"slots\": %lld, \"slot_wait_s\": %.4f, "
            "\"cpu_s\": %.3f, \"writer_cpu_s\": %.3f}\n",
            bytes, s, s > 0 ? bytes / s / 1e9 : 0.0, s > 0 ? (double)(batches * T) / s : 0.0, pipe_sz,
            (long long)chunk_kib, vms ? "true" : "false", (long long)slots, waited, cpu, wcpu);
    for (int64_t i = 0; i < slots * K; i++)
        free(buf[i]);
    free(buf), free(lens), free(ids), free(mask);
    return 0;
}
