/* hsdump: prints a .dfl stream as text for tests: the header, then one line per batch (sequence
 * lengths, loss-mask count, and an XXH64 of the token ids and of each layer array), then the end
 * totals; with --frames, one line per frame (offset, type). Errors as the library reports them
 * (exit 2 for a corrupt or cut stream). */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#include "cli.h"
#include "frame.h"
#include "frame_type.h"
#include "log.h"

/* The type's name, "OTHER" for a type version 1 does not define. */
static const char *type_name(uint32_t t)
{
    const char *n = dfl_frame_type_name(t);
    return n ? n : "OTHER";
}

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    bool frames = false;
    static const struct option lo[] = {{"frames", 0, 0, 'f'}, {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        if (c == 'f')
            frames = true;
        else
            return dfl_cli_usage_error("usage: hsdump [--frames] FILE");
    }
    const char *path = optind < argc ? argv[optind] : "-";
    dfl_err e = {0};
    dfl_reader *r = NULL;
    if (dfl_reader_open(&r, path, NULL, &e))
        return dfl_cli_report(&e);
    const dfl_stream_info *in = dfl_reader_info(r);
    int rc = 0;
    if (frames) {
        printf("0 HEADER\n");
        for (;;) {
            uint64_t off = dfl_reader_offset(r);
            dfl_frame f;
            memset(&f, 0, sizeof f);
            bool eos = false;
            if ((rc = dfl_reader_next_frame(r, &f, &eos, &e)) || eos)
                break;
            printf("%" PRIu64 " %s\n", off, type_name(f.type));
            dfl_frame_free(&f);
        }
        printf("%" PRIu64 " EOF\n", dfl_reader_offset(r));
        dfl_reader_close(r);
        return rc ? dfl_cli_report(&e) : 0;
    }
    printf("kind %s producer '%s' vocab %" PRId64, in->kind == DFL_KIND_TOKENS ? "tokens" : "hidden",
           in->producer, in->vocab_size);
    if (in->kind == DFL_KIND_HIDDEN) {
        printf(" hidden %" PRId64 " dtype %s fingerprint %s layers", in->hidden_size,
               dfl_dtype_lower(in->dtype), in->fingerprint);
        for (int k = 0; k < in->n_layers; k++)
            printf("%s%d", k ? "," : " ", in->layers[k]);
    }
    printf("\n");
    for (;;) {
        dfl_batch b = {0};
        bool eos = false;
        if ((rc = dfl_reader_next(r, &b, &eos, &e)) || eos)
            break;
        uint64_t mask = 0;
        for (uint64_t i = 0; i < b.n_tokens; i++)
            mask += b.loss_mask[i];
        printf("batch %" PRIu64 " seqs %u tokens %" PRIu64 " lens", b.index, b.n_seqs, b.n_tokens);
        for (uint32_t s = 0; s < b.n_seqs; s++)
            printf("%s%u", s ? "," : " ", b.seq_lens[s]);
        printf(" mask %" PRIu64 " ids %016llx", mask,
               (unsigned long long)XXH64(b.input_ids, b.n_tokens * 4, 0));
        size_t lb = (size_t)b.n_tokens * b.hidden * dfl_dtype_size(b.dtype);
        for (uint32_t k = 0; k < b.n_layers; k++)
            printf(" L%d %016llx", in->layers[k], (unsigned long long)XXH64(b.layers[k], lb, 0));
        printf("\n");
        dfl_batch_free(&b);
    }
    if (!rc) {
        const dfl_stream_end *end = dfl_reader_end(r);
        printf("end batches %" PRIu64 " seqs %" PRIu64 " tokens %" PRIu64 "\n", end->n_batches,
               end->n_seqs, end->n_tokens);
    }
    dfl_reader_close(r);
    return rc ? dfl_cli_report(&e) : 0;
}
