/* bucket-dump: prints what dfl-bucket's shards hold, through the libdfl reader (every frame and
 * checksum checked), for the round-trip tests.
 *
 *   bucket-dump [--batches] [--meta] SHARD.dfl...
 *
 * Default: one line per sequence, "id id id|0110" (token ids, then the loss mask).
 * --batches: one line per batch, "FILE BATCH seqs tokens max_len min_len".
 * --meta: the header's meta object (compact JSON, sorted keys), one line per file.
 * Exit status 0, or 2 when a stream is not a valid token-batch stream. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "frame.h"
#include "json.h"

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    static const struct option lo[] = {
        {"batches", no_argument, NULL, 'b'},
        {"meta", no_argument, NULL, 'm'},
        {NULL, 0, NULL, 0},
    };
    bool batches = false, meta = false;
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        if (c == 'b')
            batches = true;
        else if (c == 'm')
            meta = true;
        else
            return dfl_cli_usage_error("unknown option");
    }
    dfl_err e;
    for (int i = optind; i < argc; i++) {
        dfl_reader *r;
        if (dfl_reader_open(&r, argv[i], NULL, &e))
            return dfl_cli_report(&e);
        const dfl_stream_info *info = dfl_reader_info(r);
        if (info->kind != DFL_KIND_TOKENS) {
            dfl_reader_close(r);
            dfl_fail(&e, DFL_EDATA, "%s: not a token-batch stream", argv[i]);
            return dfl_cli_report(&e);
        }
        if (meta) {
            char *s = info->meta ? dfl_json_dump(info->meta, 0) : NULL;
            printf("%s\n", s ? s : "null");
            free(s);
        }
        for (;;) {
            dfl_batch b;
            memset(&b, 0, sizeof b);
            bool eos;
            if (dfl_reader_next(r, &b, &eos, &e)) {
                dfl_reader_close(r);
                return dfl_cli_report(&e);
            }
            if (eos)
                break;
            if (batches) {
                uint32_t mn = UINT32_MAX;
                for (uint32_t s = 0; s < b.n_seqs; s++)
                    mn = b.seq_lens[s] < mn ? b.seq_lens[s] : mn;
                printf("%s %llu %u %llu %u %u\n", argv[i], (unsigned long long)b.index, b.n_seqs,
                       (unsigned long long)b.n_tokens, b.max_len, mn);
            }
            if (!batches && !meta) {
                uint64_t off = 0;
                for (uint32_t s = 0; s < b.n_seqs; s++) {
                    uint32_t n = b.seq_lens[s];
                    for (uint32_t k = 0; k < n; k++)
                        printf(k ? " %d" : "%d", b.input_ids[off + k]);
                    putchar('|');
                    for (uint32_t k = 0; k < n; k++)
                        putchar('0' + b.loss_mask[off + k]);
                    putchar('\n');
                    off += n;
                }
            }
            dfl_batch_free(&b);
        }
        dfl_reader_close(r);
    }
    if (fflush(stdout) != 0)
        return 1;
    return 0;
}
