/* mktokens: writes a token-batch stream (what dfl-bucket produces) from sequences given as text
 * or taken from a reference file, for tests of dfl-target.
 *
 * Text input (FILE or stdin): one sequence per line, token ids separated by spaces; an id written
 * as !ID has loss mask 0 (others 1); a line "--" ends a batch; empty lines and lines starting
 * with # are ignored.
 * --from-ref REF.safetensors: the sequences seq0.input_ids, seq1.input_ids, ... of an oracle
 * reference file, one batch per sequence, or all in one batch with --pack. */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "frame.h"
#include "log.h"
#include "safetensors.h"
#include "util.h"

/* Sequences collected for the current batch. */
typedef struct pending {
    uint32_t *lens;
    int32_t *ids;
    uint8_t *mask;
    size_t n_seqs, n_tokens, cap_seqs, cap_ids, cap_mask;
} pending;

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, c * elem);
    if (!q)
        return -1;
    *p = q;
    *cap = c;
    return 0;
}

static int add_token(pending *p, int32_t id, uint8_t m)
{
    if (grow((void **)&p->ids, &p->cap_ids, p->n_tokens + 1, 4) ||
        grow((void **)&p->mask, &p->cap_mask, p->n_tokens + 1, 1))
        return -1;
    p->ids[p->n_tokens] = id;
    p->mask[p->n_tokens++] = m;
    return 0;
}

static int end_seq(pending *p, uint32_t len)
{
    if (grow((void **)&p->lens, &p->cap_seqs, p->n_seqs + 1, 4))
        return -1;
    p->lens[p->n_seqs++] = len;
    return 0;
}

static int flush(dfl_writer *w, pending *p, dfl_err *e)
{
    if (!p->n_seqs)
        return DFL_OK;
    dfl_batch b;
    memset(&b, 0, sizeof b);
    int rc = dfl_batch_alloc(&b, p->n_tokens, (uint32_t)p->n_seqs, 0, 0, DFL_DT_INVALID, e);
    if (rc)
        return rc;
    memcpy((void *)b.seq_lens, p->lens, p->n_seqs * 4);
    memcpy((void *)b.input_ids, p->ids, p->n_tokens * 4);
    memcpy((void *)b.loss_mask, p->mask, p->n_tokens);
    uint32_t mx = 0;
    for (size_t i = 0; i < p->n_seqs; i++)
        mx = p->lens[i] > mx ? p->lens[i] : mx;
    b.max_len = mx;
    rc = dfl_writer_batch(w, &b, e);
    dfl_batch_free(&b);
    p->n_seqs = p->n_tokens = 0;
    return rc;
}

static int from_text(FILE *f, const char *name, dfl_writer *w, pending *p, dfl_err *e)
{
    char *line = NULL;
    size_t cap = 0;
    long lineno = 0;
    int rc = DFL_OK;
    while (!rc && getline(&line, &cap, f) > 0) {
        lineno++;
        char *s = line;
        while (isspace((unsigned char)*s))
            s++;
        if (!*s || *s == '#')
            continue;
        if (strncmp(s, "--", 2) == 0) {
            rc = flush(w, p, e);
            continue;
        }
        uint32_t len = 0;
        while (*s) {
            uint8_t m = 1;
            if (*s == '!') {
                m = 0;
                s++;
            }
            char *end;
            long long v = strtoll(s, &end, 10);
            if (end == s || v < INT32_MIN || v > INT32_MAX) {
                rc = dfl_fail(e, DFL_EDATA, "%s:%ld: bad token id near '%.20s'", name, lineno, s);
                break;
            }
            if (add_token(p, (int32_t)v, m)) {
                rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
                break;
            }
            len++;
            s = end;
            while (isspace((unsigned char)*s))
                s++;
        }
        if (!rc && end_seq(p, len))
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    free(line);
    if (!rc)
        rc = flush(w, p, e);
    return rc;
}

static int from_ref(const char *path, bool pack, dfl_writer *w, pending *p, dfl_err *e)
{
    dfl_st_file *f = NULL;
    int rc = dfl_st_open(&f, path, e);
    if (rc)
        return rc;
    for (int i = 0;; i++) {
        char name[64];
        snprintf(name, sizeof name, "seq%d.input_ids", i);
        const dfl_st_tensor *t = dfl_st_find(f, name);
        if (!t)
            break;
        if (t->dtype != DFL_I32 || t->ndim != 1) {
            rc = dfl_fail(e, DFL_EDATA, "%s: %s is not a 1-d int32 tensor", path, name);
            break;
        }
        const int32_t *ids = t->data;
        for (uint64_t j = 0; j < t->numel && !rc; j++)
            if (add_token(p, ids[j], 1))
                rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        if (!rc && end_seq(p, (uint32_t)t->numel))
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        if (!rc && !pack)
            rc = flush(w, p, e);
        if (rc)
            break;
    }
    if (!rc)
        rc = flush(w, p, e);
    dfl_st_close(f);
    return rc;
}

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    const char *out = "-", *ref = NULL;
    int64_t vocab = 0;
    bool pack = false;
    dfl_err e = {0};
    static const struct option lo[] = {{"output", 1, 0, 'o'}, {"vocab", 1, 0, 'V'},
                                       {"from-ref", 1, 0, 'r'}, {"pack", 0, 0, 'p'},
                                       {"help", 0, 0, 'h'}, {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "o:", lo, NULL)) != -1) {
        switch (c) {
        case 'o': out = optarg; break;
        case 'V':
            if (dfl_parse_i64(optarg, 0, INT32_MAX, &vocab, "--vocab", &e))
                return dfl_cli_report(&e);
            break;
        case 'r': ref = optarg; break;
        case 'p': pack = true; break;
        case 'h':
            printf("Usage: %s [-o OUT] [--vocab N] [--from-ref REF.safetensors [--pack]] [FILE]\n",
                   dfl_progname);
            return 0;
        default: return dfl_cli_usage_error("unknown option");
        }
    }
    dfl_stream_info info;
    memset(&info, 0, sizeof info);
    info.kind = DFL_KIND_TOKENS;
    info.version_major = DFL_FRAME_MAJOR;
    info.version_minor = DFL_FRAME_MINOR;
    snprintf(info.producer, sizeof info.producer, "mktokens");
    info.vocab_size = vocab;
    dfl_writer *w = NULL;
    pending p = {0};
    int rc = dfl_writer_open(&w, out, &info, NULL, &e);
    if (!rc) {
        if (ref) {
            rc = from_ref(ref, pack, w, &p, &e);
        } else {
            const char *in = optind < argc ? argv[optind] : "-";
            FILE *f = strcmp(in, "-") == 0 ? stdin : fopen(in, "r");
            if (!f)
                rc = dfl_fail_errno(&e, DFL_EIO, errno, "%s", in);
            else {
                rc = from_text(f, in, w, &p, &e);
                if (f != stdin)
                    fclose(f);
            }
        }
        if (!rc)
            rc = dfl_writer_close(w, &e);
        else
            dfl_writer_abort(w);
    }
    free(p.lens);
    free(p.ids);
    free(p.mask);
    return rc ? dfl_cli_report(&e) : 0;
}
