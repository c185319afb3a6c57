/* bucket_plan.c: dfl-bucket's planning (see bucket.h): the shuffle, bucket bounds (a spec or length
 * quantiles), packing samples into token-budget batches and dealing batches to shards, as pure
 * functions of their arguments; and dfl_bucket_plan, which runs them on a scanned index. */
#include "bucket_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "frame.h"
#include "json.h"
#include "jsonl.h"
#include "log.h"
#include "util.h"

/* ---- shuffles ---- */

void dfl_rng_shuffle_u32(dfl_rng *r, uint32_t *a, size_t n)
{
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)dfl_rng_below(r, i);
        uint32_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

/* ---- planning steps ---- */

int dfl_bucket_parse_spec(const char *s, uint32_t **bounds, size_t *n_bounds, uint32_t *auto_k, dfl_err *e)
{
    *bounds = NULL;
    *n_bounds = 0;
    *auto_k = 0;
    if (strncmp(s, "auto:", 5) == 0) {
        int64_t k;
        int rc = dfl_parse_i64(s + 5, 1, DFL_BUCKET_MAX_BUCKETS, &k, "--buckets auto:K", e);
        if (rc)
            return rc;
        *auto_k = (uint32_t)k;
        return DFL_OK;
    }
    int64_t *v;
    size_t n;
    int rc = dfl_parse_i64_list(s, 1, DFL_BUCKET_MAX_LEN, DFL_BUCKET_MAX_BUCKETS, &v, &n,
                                "--buckets (a list like 512,1024,2048 or auto:K)", e);
    if (rc)
        return rc;
    uint32_t *b = malloc(n * sizeof *b);
    if (!b) {
        free(v);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        if (i > 0 && v[i] <= v[i - 1]) {
            rc = dfl_fail(e, DFL_EUSAGE, "--buckets: bounds must increase (%lld after %lld)", (long long)v[i],
                          (long long)v[i - 1]);
            free(v);
            free(b);
            return rc;
        }
        b[i] = (uint32_t)v[i];
    }
    free(v);
    *bounds = b;
    *n_bounds = n;
    return DFL_OK;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

int dfl_bucket_auto_bounds(const uint32_t *lens, size_t n, uint32_t k, uint32_t *bounds, size_t *n_bounds,
                           dfl_err *e)
{
    *n_bounds = 0;
    if (n == 0 || k == 0)
        return dfl_fail(e, DFL_EDATA, "no lengths to place auto buckets on");
    uint32_t *s = malloc(n * sizeof *s);
    if (!s)
        return dfl_fail(e, DFL_ENOMEM, "out of memory sorting %zu lengths", n);
    memcpy(s, lens, n * sizeof *s);
    qsort(s, n, sizeof *s, cmp_u32);
    size_t nb = 0;
    for (uint64_t j = 1; j <= k; j++) {
        uint64_t idx = (j * (uint64_t)n + k - 1) / k - 1; /* ceil(j*n/k) - 1 */
        uint32_t b = s[idx];
        if (nb == 0 || b > bounds[nb - 1])
            bounds[nb++] = b;
    }
    free(s);
    *n_bounds = nb;
    return DFL_OK;
}

size_t dfl_bucket_find(const uint32_t *bounds, size_t n_bounds, uint32_t len)
{
    size_t lo = 0, hi = n_bounds;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (bounds[mid] >= len)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

typedef struct open_batch {
    uint32_t *m;
    size_t n, cap;
    uint64_t tokens;
    uint32_t max_len;
} open_batch;

static int emit_batch(const uint32_t *m, size_t n, uint64_t tokens, uint32_t max_len, uint32_t bucket,
                      dfl_bk_batch **batches, size_t *n_batches, size_t *cap_batches, uint32_t **members,
                      size_t *n_members, size_t *cap_members, dfl_err *e)
{
    if (*n_batches == *cap_batches) {
        size_t c = *cap_batches ? *cap_batches * 2 : 1024;
        dfl_bk_batch *nb = realloc(*batches, c * sizeof *nb);
        if (!nb)
            return dfl_fail(e, DFL_ENOMEM, "out of memory for %zu batches", c);
        *batches = nb;
        *cap_batches = c;
    }
    if (*n_members + n > *cap_members) {
        size_t c = *cap_members ? *cap_members : 4096;
        while (c < *n_members + n)
            c *= 2;
        uint32_t *nm = realloc(*members, c * sizeof *nm);
        if (!nm)
            return dfl_fail(e, DFL_ENOMEM, "out of memory for %zu batch members", c);
        *members = nm;
        *cap_members = c;
    }
    dfl_bk_batch *b = &(*batches)[(*n_batches)++];
    b->first = *n_members;
    b->n_tokens = tokens;
    b->n_seqs = (uint32_t)n;
    b->max_len = max_len;
    b->bucket = bucket;
    b->shard = 0;
    memcpy(*members + *n_members, m, n * sizeof *m);
    *n_members += n;
    return DFL_OK;
}

int dfl_bucket_pack(const uint32_t *order, size_t n, const uint32_t *lens, uint32_t min_len,
                    uint64_t max_tokens, uint32_t bucket, dfl_bk_batch **batches, size_t *n_batches,
                    size_t *cap_batches, uint32_t **members, size_t *n_members, size_t *cap_members,
                    dfl_err *e)
{
    open_batch open[DFL_BUCKET_OPEN];
    memset(open, 0, sizeof open);
    int n_open = 0, rc = DFL_OK;
    if (min_len == 0)
        min_len = 1;
#define EMIT(ob) emit_batch((ob)->m, (ob)->n, (ob)->tokens, (ob)->max_len, bucket, batches, n_batches, \
                            cap_batches, members, n_members, cap_members, e)
    for (size_t i = 0; i < n && !rc; i++) {
        uint32_t s = order[i], len = lens[s];
        if (len > max_tokens) {
            rc = emit_batch(&s, 1, len, len, bucket, batches, n_batches, cap_batches, members, n_members,
                            cap_members, e);
            continue;
        }
        int j;
        for (j = 0; j < n_open; j++)
            if (open[j].tokens + len <= max_tokens)
                break;
        if (j == n_open) {
            if (n_open == DFL_BUCKET_OPEN) { /* close the oldest */
                rc = EMIT(&open[0]);
                if (rc)
                    break;
                open_batch t = open[0];
                memmove(open, open + 1, (DFL_BUCKET_OPEN - 1) * sizeof *open);
                open[DFL_BUCKET_OPEN - 1] = t;
                j = DFL_BUCKET_OPEN - 1;
            } else {
                j = n_open++;
            }
            open[j].n = 0;
            open[j].tokens = 0;
            open[j].max_len = 0;
        }
        open_batch *ob = &open[j];
        if (ob->n == ob->cap) {
            size_t c = ob->cap ? ob->cap * 2 : 64;
            uint32_t *nm = realloc(ob->m, c * sizeof *nm);
            if (!nm) {
                rc = dfl_fail(e, DFL_ENOMEM, "out of memory while packing");
                break;
            }
            ob->m = nm;
            ob->cap = c;
        }
        ob->m[ob->n++] = s;
        ob->tokens += len;
        if (len > ob->max_len)
            ob->max_len = len;
        if (max_tokens - ob->tokens < min_len) { /* full: nothing of this bucket fits any more */
            rc = EMIT(ob);
            open_batch t = *ob;
            memmove(open + j, open + j + 1, (size_t)(n_open - j - 1) * sizeof *open);
            open[--n_open] = t;
        }
    }
    for (int j = 0; j < n_open && !rc; j++)
        rc = EMIT(&open[j]);
#undef EMIT
    for (int j = 0; j < DFL_BUCKET_OPEN; j++)
        free(open[j].m);
    return rc;
}

void dfl_bucket_deal(dfl_bk_batch *batches, const uint32_t *order, size_t n, uint32_t shards)
{
    /* a binary min-heap of shards keyed by (tokens, index) */
    uint64_t *tok = calloc(shards, sizeof *tok);
    uint32_t *heap = malloc(shards * sizeof *heap);
    if (!tok || !heap) { /* tiny allocations; fall back to a linear scan */
        free(heap);
        heap = NULL;
    }
    if (!tok) {
        for (size_t i = 0; i < n; i++)
            batches[order[i]].shard = (uint32_t)(i % shards);
        return;
    }
#define LESS(a, b) (tok[a] < tok[b] || (tok[a] == tok[b] && (a) < (b)))
    if (heap)
        for (uint32_t s = 0; s < shards; s++)
            heap[s] = s; /* all zero: index order is a valid heap */
    for (size_t i = 0; i < n; i++) {
        dfl_bk_batch *b = &batches[order[i]];
        uint32_t s;
        if (heap) {
            s = heap[0];
            b->shard = s;
            tok[s] += b->n_tokens;
            size_t k = 0;
            for (;;) { /* sift down */
                size_t l = 2 * k + 1, r = l + 1, m = k;
                if (l < shards && LESS(heap[l], heap[m]))
                    m = l;
                if (r < shards && LESS(heap[r], heap[m]))
                    m = r;
                if (m == k)
                    break;
                uint32_t t = heap[k];
                heap[k] = heap[m];
                heap[m] = t;
                k = m;
            }
        } else {
            s = 0;
            for (uint32_t q = 1; q < shards; q++)
                if (LESS(q, s))
                    s = q;
            b->shard = s;
            tok[s] += b->n_tokens;
        }
    }
#undef LESS
    free(tok);
    free(heap);
}

/* ---- planning ---- */

int dfl_bucket_plan(dfl_bucket_run *r, dfl_err *e)
{
    size_t n = r->n_samples;
    if (n == 0)
        return dfl_fail(e, DFL_EDATA, "no samples left (%llu lines: %llu skipped, %llu too long, %llu without a "
                        "trained token, %llu blank)", (unsigned long long)r->lines,
                        (unsigned long long)r->skipped, (unsigned long long)r->drop_long,
                        (unsigned long long)r->drop_masked, (unsigned long long)r->blank);
    if (n > UINT32_MAX)
        return dfl_fail(e, DFL_EUNSUP, "%zu samples: more than %u are not supported", n, UINT32_MAX);
    int rc = DFL_OK;
    uint32_t *lens = malloc(n * sizeof *lens);
    uint32_t *order = malloc(n * sizeof *order);
    size_t *start = NULL;
    if (!lens || !order) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory planning %zu samples", n);
        goto out;
    }
    r->len_min = UINT32_MAX;
    r->len_max = 0;
    memset(r->hist_n, 0, sizeof r->hist_n);
    memset(r->hist_tok, 0, sizeof r->hist_tok);
    for (size_t i = 0; i < n; i++) {
        uint32_t l = r->samples[i].n_tokens;
        lens[i] = l;
        r->len_min = l < r->len_min ? l : r->len_min;
        r->len_max = l > r->len_max ? l : r->len_max;
        int b = 31 - __builtin_clz(l);
        r->hist_n[b]++;
        r->hist_tok[b] += l;
    }
    if (r->o.auto_k) {
        free(r->bounds);
        r->bounds = malloc(r->o.auto_k * sizeof *r->bounds);
        if (!r->bounds) {
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
            goto out;
        }
        rc = dfl_bucket_auto_bounds(lens, n, r->o.auto_k, r->bounds, &r->n_bounds, e);
        if (rc)
            goto out;
    }
    size_t nb = r->n_bounds;
    r->bk = calloc(nb, sizeof *r->bk);
    r->sh = calloc(r->o.shards, sizeof *r->sh);
    start = calloc(nb + 1, sizeof *start);
    if (!r->bk || !r->sh || !start) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        goto out;
    }
    /* group by bucket, input order kept within each */
    for (size_t i = 0; i < n; i++) {
        size_t b = dfl_bucket_find(r->bounds, nb, lens[i]);
        if (b == nb) {
            rc = dfl_fail(e, DFL_EDATA, "internal: a sample of %u tokens is above the last bucket bound %u",
                          lens[i], r->bounds[nb - 1]);
            goto out;
        }
        r->bk[b].samples++;
        r->bk[b].tokens += lens[i];
    }
    for (size_t b = 0; b < nb; b++)
        start[b + 1] = start[b] + r->bk[b].samples;
    {
        size_t *fill = malloc(nb * sizeof *fill);
        if (!fill) {
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
            goto out;
        }
        memcpy(fill, start, nb * sizeof *fill);
        for (size_t i = 0; i < n; i++)
            order[fill[dfl_bucket_find(r->bounds, nb, lens[i])]++] = (uint32_t)i;
        free(fill);
    }
    dfl_rng rng;
    dfl_rng_seed(&rng, r->o.seed);
    size_t cap_b = 0, cap_m = 0;
    for (size_t b = 0; b < nb && !rc; b++) {
        dfl_rng_shuffle_u32(&rng, order + start[b], start[b + 1] - start[b]);
        uint32_t min_len = b == 0 ? 1 : r->bounds[b - 1] + 1;
        rc = dfl_bucket_pack(order + start[b], start[b + 1] - start[b], lens, min_len, r->o.max_tokens,
                             (uint32_t)b, &r->batches, &r->n_batches, &cap_b, &r->members, &r->n_members,
                             &cap_m, e);
    }
    if (rc)
        goto out;
    if (r->n_batches > UINT32_MAX) {
        rc = dfl_fail(e, DFL_EUNSUP, "more than %u batches", UINT32_MAX);
        goto out;
    }
    r->batch_order = malloc(r->n_batches * sizeof *r->batch_order);
    r->shard_list = malloc(r->n_batches * sizeof *r->shard_list);
    r->shard_start = calloc((size_t)r->o.shards + 1, sizeof *r->shard_start);
    if (!r->batch_order || !r->shard_list || !r->shard_start) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < r->n_batches; i++)
        r->batch_order[i] = (uint32_t)i;
    dfl_rng_shuffle_u32(&rng, r->batch_order, r->n_batches);
    dfl_bucket_deal(r->batches, r->batch_order, r->n_batches, r->o.shards);
    for (size_t i = 0; i < r->n_batches; i++) {
        const dfl_bk_batch *bt = &r->batches[i];
        bk_bucket *bk = &r->bk[bt->bucket];
        bk->batches++;
        bk->capacity += bt->n_tokens > r->o.max_tokens ? bt->n_tokens : r->o.max_tokens;
        if (bt->n_seqs > bk->warm.seqs)
            bk->warm.seqs = bt->n_seqs;
        if (bt->n_tokens > bk->warm.tokens)
            bk->warm.tokens = bt->n_tokens;
        if (bt->max_len > bk->warm.max_len)
            bk->warm.max_len = bt->max_len;
        bk_shard *sh = &r->sh[bt->shard];
        sh->batches++;
        sh->tokens += bt->n_tokens;
        sh->samples += bt->n_seqs;
        r->shard_start[bt->shard + 1]++;
    }
    for (uint32_t s = 0; s < r->o.shards; s++)
        r->shard_start[s + 1] += r->shard_start[s];
    {
        uint64_t *fill = malloc(r->o.shards * sizeof *fill);
        if (!fill) {
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
            goto out;
        }
        memcpy(fill, r->shard_start, r->o.shards * sizeof *fill);
        for (size_t i = 0; i < r->n_batches; i++) {
            uint32_t b = r->batch_order[i];
            r->shard_list[fill[r->batches[b].shard]++] = b;
        }
        free(fill);
    }
    r->planned = true;
    r->t_plan = dfl_now();
out:
    free(lens);
    free(order);
    free(start);
    return rc;
}
