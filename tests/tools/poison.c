/* poison: plants one non-finite value in a hidden-state stream, for the fault-injection tests
 * (tests/bats/faults.bats):
 *   poison IN OUT --batch K [--layer J] [--token T] [--dim D] [--value nan|inf|-inf]
 * copies the stream IN (a dump or a pipe; "-" = stdin) to OUT ("-" = stdout) batch by batch,
 * with element [T, D] of layer array J (0-based, in array order) of batch K replaced by the value
 * (default nan). The frames are written afresh, so their checksums are right: the stream is
 * valid, only its numbers are bad, as when a producer computes a NaN. Everything else is copied
 * as it is (header, other batches; the output gets an index when it is a file). */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "frame.h"
#include "util.h"

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    int64_t batch = -1, layer = 0, token = 0, dim = 0;
    float value = NAN;
    dfl_err e = {0};
    static const struct option lo[] = {{"batch", 1, 0, 'b'}, {"layer", 1, 0, 'l'},
                                       {"token", 1, 0, 't'}, {"dim", 1, 0, 'd'},
                                       {"value", 1, 0, 'v'}, {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    int c, rc = 0;
    while ((c = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (c) {
        case 'b': rc = dfl_parse_i64(optarg, 0, INT64_MAX, &batch, "--batch", &e); break;
        case 'l': rc = dfl_parse_i64(optarg, 0, DFL_MAX_LAYERS - 1, &layer, "--layer", &e); break;
        case 't': rc = dfl_parse_i64(optarg, 0, INT64_MAX, &token, "--token", &e); break;
        case 'd': rc = dfl_parse_i64(optarg, 0, INT64_MAX, &dim, "--dim", &e); break;
        case 'v':
            if (!strcmp(optarg, "nan"))
                value = NAN;
            else if (!strcmp(optarg, "inf"))
                value = INFINITY;
            else if (!strcmp(optarg, "-inf"))
                value = -INFINITY;
            else
                return dfl_cli_usage_error("--value: nan, inf or -inf");
            break;
        case 'h':
            printf("usage: poison IN OUT --batch K [--layer J] [--token T] [--dim D] "
                   "[--value nan|inf|-inf]\n");
            return 0;
        default: return dfl_cli_usage_error("unknown option");
        }
        if (rc)
            return dfl_cli_usage_error("%s", e.msg);
    }
    if (argc - optind != 2 || batch < 0)
        return dfl_cli_usage_error("expected IN OUT --batch K");
    dfl_reader *r = NULL;
    dfl_writer *w = NULL;
    if ((rc = dfl_reader_open(&r, argv[optind], NULL, &e)))
        return dfl_cli_report(&e);
    const dfl_stream_info *si = dfl_reader_info(r);
    if (si->kind != DFL_KIND_HIDDEN || layer >= si->n_layers || dim >= si->hidden_size) {
        dfl_reader_close(r);
        return dfl_cli_usage_error("%s: not a hidden-state stream with layer array %lld and "
                                   "dimension %lld", argv[optind], (long long)layer, (long long)dim);
    }
    dfl_stream_info info = *si;
    dfl_writer_opts wo = {0};
    if ((rc = dfl_writer_open(&w, argv[optind + 1], &info, &wo, &e))) {
        dfl_reader_close(r);
        return dfl_cli_report(&e);
    }
    bool planted = false;
    for (;;) {
        dfl_batch b = {0}, copy = {0};
        bool eos = false;
        if ((rc = dfl_reader_next(r, &b, &eos, &e)) || eos)
            break;
        if ((int64_t)b.index == batch) {
            if (token >= (int64_t)b.n_tokens) {
                rc = dfl_fail(&e, DFL_EUSAGE, "batch %lld has %llu tokens, no token %lld",
                              (long long)batch, (unsigned long long)b.n_tokens, (long long)token);
                dfl_batch_free(&b);
                break;
            }
            /* the batch may point into a read-only mapping: change a copy */
            if ((rc = dfl_batch_alloc(&copy, b.n_tokens, b.n_seqs, b.n_layers, b.hidden, b.dtype, &e))) {
                dfl_batch_free(&b);
                break;
            }
            size_t es = dfl_dtype_size(b.dtype), lb = (size_t)b.n_tokens * b.hidden * es;
            memcpy((void *)copy.seq_lens, b.seq_lens, (size_t)b.n_seqs * 4);
            memcpy((void *)copy.input_ids, b.input_ids, (size_t)b.n_tokens * 4);
            memcpy((void *)copy.loss_mask, b.loss_mask, (size_t)b.n_tokens);
            for (uint32_t k = 0; k < b.n_layers; k++)
                memcpy((void *)copy.layers[k], b.layers[k], lb);
            char *at = (char *)copy.layers[layer] + ((size_t)token * b.hidden + (size_t)dim) * es;
            dfl_convert(at, b.dtype, &value, DFL_F32, 1);
            rc = dfl_writer_batch(w, &copy, &e);
            dfl_batch_free(&copy);
            planted = true;
        } else {
            rc = dfl_writer_batch(w, &b, &e);
        }
        dfl_batch_free(&b);
        if (rc)
            break;
    }
    if (!rc && !planted)
        rc = dfl_fail(&e, DFL_EUSAGE, "%s has no batch %lld", argv[optind], (long long)batch);
    dfl_reader_close(r);
    if (rc) {
        dfl_writer_abort(w);
        return dfl_cli_report(&e);
    }
    if ((rc = dfl_writer_close(w, &e)))
        return dfl_cli_report(&e);
    return 0;
}
