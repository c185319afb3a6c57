/* eval.c: dfl-eval's engine (eval.h): the drafter from a checkpoint, the target's embedding and
 * LM head, the streams read one after another, every anchor a walk may visit computed in batched
 * forward passes (dfl_draft_eval), and the walk of greedy speculative decoding on the host. */
#include "eval.h"

#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "draft_ckpt.h"
#include "draft_input.h"
#include "frame.h"
#include "hfmodel.h"
#include "json.h"
#include "log.h"
#include "safetensors.h"
#include "util.h"

/* ---- counting ------------------------------------------------------------------------------ */

void dfl_eval_stats_init(dfl_eval_stats *st, int bs)
{
    memset(st, 0, sizeof *st);
    st->bs = bs;
}

int dfl_eval_step(dfl_eval_stats *st, const uint8_t *correct, int64_t left)
{
    const int bs = st->bs;
    const int reach = left < bs - 1 ? (int)left : bs - 1;   /* slots inside the span */
    int n = 0;
    while (n < reach && correct[n + 1])
        n++;
    for (int j = 1; j <= reach; j++) {
        st->slot_n[j]++;
        st->slot_ok[j] += correct[j] != 0;
        st->slot_acc[j] += j <= n;
    }
    const int got = n + 1 < left ? n + 1 : (int)left;
    st->steps++;
    st->tokens += got;
    st->hist[got]++;
    return got;
}

void dfl_eval_stats_add(dfl_eval_stats *a, const dfl_eval_stats *b)
{
    a->sequences += b->sequences;
    a->skipped += b->skipped;
    a->spans += b->spans;
    a->steps += b->steps;
    a->tokens += b->tokens;
    for (int j = 0; j <= DFL_DRAFT_MAX_BS; j++)
        a->hist[j] += b->hist[j];
    for (int j = 0; j < DFL_DRAFT_MAX_BS; j++) {
        a->slot_n[j] += b->slot_n[j];
        a->slot_ok[j] += b->slot_ok[j];
        a->slot_acc[j] += b->slot_acc[j];
    }
}

static json_t *ratio(double num, double den)
{
    return den > 0 ? json_real(num / den) : json_null();
}

json_t *dfl_eval_stats_json(const dfl_eval_stats *st)
{
    json_t *j = json_object();
    json_t *hist = json_array(), *acc = json_array(), *ok = json_array(), *reach = json_array();
    for (int n = 1; n <= st->bs; n++)
        json_array_append_new(hist, json_integer(st->hist[n]));
    for (int s = 1; s < st->bs; s++) {
        json_array_append_new(acc, ratio((double)st->slot_acc[s], (double)st->slot_n[s]));
        json_array_append_new(ok, ratio((double)st->slot_ok[s], (double)st->slot_n[s]));
        json_array_append_new(reach, json_integer(st->slot_n[s]));
    }
    /* decoding: one prefill per span (its first token), one verification pass per step */
    const int64_t forwards = st->spans + st->steps, out_tokens = st->spans + st->tokens;
    json_object_set_new(j, "tau", ratio((double)st->tokens, (double)st->steps));
    json_object_set_new(j, "block_size", json_integer(st->bs));
    json_object_set_new(j, "steps", json_integer(st->steps));
    json_object_set_new(j, "tokens", json_integer(st->tokens));
    json_object_set_new(j, "histogram", hist);
    json_object_set_new(j, "slot_acceptance", acc);
    json_object_set_new(j, "slot_accuracy", ok);
    json_object_set_new(j, "slot_count", reach);
    json_object_set_new(j, "response_tokens", json_integer(out_tokens));
    json_object_set_new(j, "target_forwards", json_integer(forwards));
    json_object_set_new(j, "speedup_bound", ratio((double)out_tokens, (double)forwards));
    json_object_set_new(j, "spans", json_integer(st->spans));
    json_object_set_new(j, "sequences", json_integer(st->sequences));
    json_object_set_new(j, "sequences_skipped", json_integer(st->skipped));
    return j;
}

bool dfl_eval_next_span(const uint8_t *mask, int64_t len, int64_t from, int64_t *s0, int64_t *s1)
{
    int64_t a = from < 0 ? 0 : from;
    while (a < len && !mask[a])
        a++;
    if (a >= len)
        return false;
    int64_t b = a;
    while (b < len && mask[b])
        b++;
    *s0 = a;
    *s1 = b;
    return true;
}

/* ---- the run ------------------------------------------------------------------------------- */

/* Where one sequence's walk stands. */
typedef struct walk {
    int64_t pos;                 /* the current anchor (-1: done) */
    int64_t end;                 /* the current span's end */
    int64_t blk_lo, blk_hi;      /* its blocks in this round's forward */
} walk;

typedef struct ev {
    const dfl_eval_opts *o;
    dfl_eval_info *info;
    dfl_eval_stats *st;
    dfl_hf_config tc;
    json_t *tcfg;
    char fingerprint[33];
    dfl_st_model *tm;
    dfl_st_file *wf;
    dfl_be *be;
    dfl_draft_config c;
    dfl_draft *m;
    dfl_reader **rd;
    int n_rd;
    dfl_dtype feat_dt;
    /* one round */
    int32_t *bseq, *banchor;
    uint8_t *correct;
    walk *w;
    dfl_eval_stats *seq_st;
    int64_t cap_seqs;
    double t0, last_progress;
    bool progressed;             /* a progress line was printed */
} ev;

/* Moves w to the next span with something to decode (at or after `from`), counting spans of a
 * single token (the prefill's) on the way; done (pos -1) when there is none. */
static void next_walk(walk *w, const uint8_t *mask, int64_t len, int64_t from, dfl_eval_stats *st)
{
    int64_t s0, s1;
    while (dfl_eval_next_span(mask, len, from, &s0, &s1)) {
        st->spans++;
        if (s1 - s0 >= 2) {
            w->pos = s0;
            w->end = s1;
            return;
        }
        from = s1;
    }
    w->pos = -1;
}

static int load_target(ev *v, dfl_err *e)
{
    const char *dir = v->o->target_dir;
    int rc = dfl_hf_config_load(dir, &v->tc, &v->tcfg, e);
    if (!rc)
        rc = dfl_hf_fingerprint(dir, v->fingerprint, e);
    if (!rc)
        rc = dfl_st_model_open(&v->tm, dir, e);
    return rc;
}

/* The drafter's config: all of it from the checkpoint's config.json (a Qwen3 config with the
 * DFlash fields), the loss decay aside (not used here). */
static int load_config(ev *v, const char *dir, dfl_err *e)
{
    dfl_draft_config *c = &v->c;
    *c = (dfl_draft_config){.block_size = 16, .gamma = 7.0, .mask_token_id = -1, .rms_eps = 1e-6,
                            .rope_theta = 1e6, .bos_token_id = -1, .eos_token_id = -1,
                            .max_position = 40960};
    int rc = dfl_draft_ckpt_config(dir, c, e);
    if (rc)
        return rc;
    if (c->n_feat >= 1 && c->mask_token_id >= 0 && (rc = dfl_draft_config_check(c, e)))
        return dfl_err_prefix(e, "%s/config.json: ", dir);
    if (c->mask_token_id < 0)
        return dfl_fail(e, DFL_EDATA, "%s/config.json: no dflash_config.mask_token_id", dir);
    if (c->n_feat < 1)
        return dfl_fail(e, DFL_EDATA, "%s/config.json: no dflash_config.target_layer_ids", dir);
    if (c->hidden != v->tc.hidden_size || c->vocab != v->tc.vocab_size)
        return dfl_fail(e, DFL_EMISMATCH, "%s: the drafter's hidden size %lld / vocabulary %lld "
                        "differ from the target's %lld / %lld (%s)", dir, (long long)c->hidden,
                        (long long)c->vocab, (long long)v->tc.hidden_size,
                        (long long)v->tc.vocab_size, v->o->target_dir);
    if (c->n_target_layers > 0 && c->n_target_layers != v->tc.n_layers)
        return dfl_fail(e, DFL_EMISMATCH, "%s: the drafter was trained for a target of %d layers, "
                        "%s has %lld", dir, c->n_target_layers, v->o->target_dir,
                        (long long)v->tc.n_layers);
    v->info->trained_bs = c->block_size;
    if (v->o->block_size > 0) {
        if (v->o->block_size > c->block_size)
            return dfl_fail(e, DFL_EUSAGE, "--block-size %d: the drafter was trained with blocks "
                            "of %d", v->o->block_size, c->block_size);
        c->block_size = v->o->block_size;
    }
    return dfl_draft_config_check(c, e);
}

/* Weights from DIR/model.safetensors (public names, or under "model."), refusing non-finite
 * ones; the target's embedding and LM head. */
static int load_weights(ev *v, const char *dir, dfl_err *e)
{
    char *p = dfl_path_join(dir, "model.safetensors");
    if (!p)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    int rc = dfl_st_open(&v->wf, p, e);
    free(p);
    if (rc)
        return rc;
    const char *prefix = !dfl_st_find(v->wf, "fc.weight") && dfl_st_find(v->wf, "model.fc.weight")
                             ? "model." : "";
    if ((rc = dfl_draft_load_weights(v->m, v->wf, prefix, e)))
        return rc;
    const int64_t n = dfl_draft_flat_len(v->m);
    float *h = malloc((size_t)n * sizeof *h);
    if (!h)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    int64_t bad = -1;
    if (!(rc = dfl_draft_download(v->m, DFL_DRAFT_MASTER, h, e)) && !dfl_draft_all_finite(h, n, &bad)) {
        int nt;
        const dfl_draft_tensor *t = dfl_draft_tensor_list(v->m, &nt);
        const char *name = "?";
        for (int i = 0; i < nt; i++)
            if (bad >= t[i].offset && bad < t[i].offset + t[i].numel)
                name = t[i].name;
        rc = dfl_fail(e, DFL_ENAN, "%s/model.safetensors: tensor '%s%s' holds a non-finite value",
                      dir, prefix, name);
    }
    free(h);
    if (rc)
        return rc;
    int64_t shape[2] = {v->tc.vocab_size, v->tc.hidden_size};
    const dfl_st_tensor *emb, *lm = NULL;
    if ((rc = dfl_st_model_get(v->tm, "model.embed_tokens.weight", 2, shape, &emb, e)))
        return rc;
    if ((!v->tc.tie_word_embeddings || dfl_st_model_find(v->tm, "lm_head.weight")) &&
        (rc = dfl_st_model_get(v->tm, "lm_head.weight", 2, shape, &lm, e)))
        return rc;
    return dfl_draft_set_frozen(v->m, emb, lm, e);
}

/* --draft: a directory with model.safetensors (a checkpoint of dfl-draft or a public DFlash
 * drafter), or a run directory (its latest); not a checkpoint being written (.tmp). */
static int resolve_draft(const char *path, char **dir, dfl_err *e)
{
    char *m = dfl_path_join(path, "model.safetensors"), *l = dfl_path_join(path, "latest");
    if (!m || !l) {
        free(m);
        free(l);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    const bool direct = access(m, F_OK) == 0, run = access(l, F_OK) == 0;
    free(m);
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/')
        n--;
    if (direct && !(n >= 4 && strncmp(path + n - 4, ".tmp", 4) == 0)) {
        free(l);
        *dir = strdup(path);
        return *dir ? DFL_OK : dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    if (direct || !run) {
        free(l);
        return dfl_fail(e, DFL_EUSAGE, direct ? "--draft %s: a checkpoint still being written (.tmp)"
                        : "--draft %s: not a drafter checkpoint (no model.safetensors) nor a run "
                        "directory (no latest)", path);
    }
    *dir = l;
    return DFL_OK;
}

/* Opens every input and checks its header against the target and the drafter. */
static int open_inputs(ev *v, dfl_err *e)
{
    const dfl_eval_opts *o = v->o;
    v->rd = calloc((size_t)o->n_inputs, sizeof *v->rd);
    if (!v->rd)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    dfl_draft_src_opts so = {
        .fingerprint = v->fingerprint, .hidden = v->c.hidden, .vocab = v->c.vocab,
        .n_layers = v->c.n_feat, .layers = v->c.target_layers,
    };
    dfl_reader_opts ro = {.no_verify = o->no_verify};
    for (int i = 0; i < o->n_inputs; i++) {
        int rc = dfl_reader_open(&v->rd[i], o->inputs[i], &ro, e);
        if (rc)
            return rc;
        v->n_rd = i + 1;
        const dfl_stream_info *si = dfl_reader_info(v->rd[i]);
        if ((rc = dfl_draft_check_stream(&so, o->inputs[i], si, e)))
            return rc;
        v->feat_dt = i == 0 || si->dtype == v->feat_dt ? si->dtype : DFL_F32;
    }
    return DFL_OK;
}

/* Room for a round over S sequences and B blocks. */
static int grow(ev *v, int64_t S, dfl_err *e)
{
    if (S <= v->cap_seqs)
        return DFL_OK;
    free(v->w);
    free(v->seq_st);
    v->w = calloc((size_t)S, sizeof *v->w);
    v->seq_st = calloc((size_t)S, sizeof *v->seq_st);
    if (!v->w || !v->seq_st)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    v->cap_seqs = S;
    return DFL_OK;
}

/* The anchors of a walk from its position on: every anchor position of its remaining spans (a
 * with a + 1 < the span's end), in order, at most max of them and each with all the slots it
 * scores before `limit` (a + min(bs - 1, end - 1 - a) < limit). Writes them (when out is
 * non-NULL) and returns the count; *last receives the last one. */
static int64_t walk_anchors(const walk *w, const uint8_t *mask, int64_t len, int bs, int64_t max,
                            int64_t limit, int32_t *out, int64_t *last)
{
    int64_t n = 0, a = w->pos, end = w->end;
    while (a >= 0 && n < max) {
        for (; a + 1 < end && n < max; a++) {
            int64_t reach = end - 1 - a < bs - 1 ? end - 1 - a : bs - 1;
            if (a + reach >= limit)
                return n;
            if (out)
                out[n] = (int32_t)a;
            *last = a;
            n++;
        }
        int64_t s0, s1;
        if (!dfl_eval_next_span(mask, len, end, &s0, &s1))
            break;
        a = s0;
        end = s1;
    }
    return n;
}

static void progress(ev *v, bool force)
{
    double now = dfl_now();
    if (v->o->progress_every <= 0 || (!force && now - v->last_progress < v->o->progress_every) ||
        (force && !v->progressed))
        return;
    v->last_progress = now;
    v->progressed = true;
    const dfl_eval_stats *st = v->st;
    dfl_progress("%lld sequences, %lld steps, %lld tokens: tau %.3f (%.0f tokens/s)",
                 (long long)st->sequences, (long long)st->steps, (long long)st->tokens,
                 st->steps ? (double)st->tokens / (double)st->steps : 0.0,
                 (double)(st->tokens + st->spans) / (now - v->t0 > 1e-9 ? now - v->t0 : 1e-9));
}

/* Evaluates every sequence of one batch. */
static int eval_batch(ev *v, int input, const dfl_batch *b, dfl_err *e)
{
    const int bs = v->c.block_size;
    const char *path = v->o->inputs[input];
    const int64_t S = b->n_seqs;
    int rc = grow(v, S, e);
    if (rc)
        return rc;
    int64_t *start = malloc((size_t)(S + 1) * sizeof *start);
    if (!start)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    start[0] = 0;
    for (int64_t s = 0; s < S; s++)
        start[s + 1] = start[s] + b->seq_lens[s];
    for (int64_t s = 0; s < S; s++) {
        dfl_eval_stats_init(&v->seq_st[s], bs);
        next_walk(&v->w[s], b->loss_mask + start[s], b->seq_lens[s], 0, &v->seq_st[s]);
        if (v->w[s].pos < 0 && v->seq_st[s].spans == 0)
            v->seq_st[s].skipped = 1;
        else
            v->seq_st[s].sequences = 1;
    }
    const int64_t maxT = v->info->max_tokens, maxB = v->info->max_blocks;
    int64_t first = 0;
    uint32_t lens[1];
    while (first < S && !rc) {
        if (v->o->stop && *v->o->stop) {
            rc = dfl_fail(e, DFL_EINTR, "stopped by a signal");
            break;
        }
        /* finished sequences report in order */
        while (first < S && v->w[first].pos < 0) {
            dfl_eval_stats_add(v->st, &v->seq_st[first]);
            if (v->o->on_seq) {
                dfl_eval_seq q = {.input = path, .batch = (int64_t)b->index, .seq = (int32_t)first,
                                  .len = b->seq_lens[first], .st = &v->seq_st[first]};
                if ((rc = v->o->on_seq(v->o->ctx, &q, e)))
                    break;
            }
            first++;
        }
        if (rc || first >= S)
            break;
        /* a round: sequences first.. (rows contiguous) while their tokens and anchors fit; the
         * first one alone, cut to what fits, when it does not */
        int64_t T = 0, B = 0, last_s = first, cut_len = -1;
        for (int64_t s = first; s < S; s++) {
            const uint8_t *mask = b->loss_mask + start[s];
            const int64_t L = b->seq_lens[s];
            int64_t lastA = -1, n = 0;
            if (v->w[s].pos >= 0)
                n = walk_anchors(&v->w[s], mask, L, bs, INT64_MAX, L, NULL, &lastA);
            if (T + L <= maxT && B + n <= maxB) {
                v->w[s].blk_lo = B;
                if (v->w[s].pos >= 0)
                    walk_anchors(&v->w[s], mask, L, bs, n, L, v->banchor + B, &lastA);
                for (int64_t k = B; k < B + n; k++)
                    v->bseq[k] = (int32_t)(s - first);
                B += n;
                v->w[s].blk_hi = B;
                T += L;
                last_s = s;
                continue;
            }
            if (s == first) {   /* a window of its anchors, its text cut after the last block */
                const int64_t lim = L < maxT ? L : maxT;
                n = walk_anchors(&v->w[s], mask, L, bs, maxB, lim, v->banchor, &lastA);
                if (n == 0) {
                    rc = dfl_fail(e, DFL_EUSAGE, "%s: batch %llu, sequence %lld: %lld tokens of "
                                  "context do not fit --max-tokens %lld", path,
                                  (unsigned long long)b->index, (long long)s,
                                  (long long)v->w[s].pos + bs, (long long)maxT);
                    break;
                }
                for (int64_t k = 0; k < n; k++)
                    v->bseq[k] = 0;
                cut_len = lastA + bs < lim ? lastA + bs : lim;
                v->w[s].blk_lo = 0;
                v->w[s].blk_hi = B = n;
                T = cut_len;
                last_s = s;
            }
            break;
        }
        if (rc)
            break;
        const int32_t nS = (int32_t)(last_s - first + 1);
        const uint32_t *seq_lens = b->seq_lens + first;
        if (cut_len >= 0) {
            lens[0] = (uint32_t)cut_len;
            seq_lens = lens;
        }
        dfl_draft_input in = {
            .T = T, .S = nS, .seq_lens = seq_lens, .input_ids = b->input_ids + start[first],
            .loss_mask = b->loss_mask + start[first], .feat_dt = b->dtype, .feat_ld = b->hidden,
            .n_blocks = (int32_t)B, .block_seq = v->bseq, .block_anchor = v->banchor,
        };
        const size_t es = dfl_dtype_size(b->dtype);
        for (int j = 0; j < v->c.n_feat; j++)
            in.feat[j] = (const char *)b->layers[j] + (size_t)start[first] * b->hidden * es;
        if (B > 0) {
            if (!v->be->async && (rc = dfl_draft_reserve(v->m, T, B, 0, e)))
                break;
            if ((rc = dfl_draft_eval(v->m, &in, v->correct, e))) {
                dfl_err_prefix(e, "%s: batch %llu: ", path, (unsigned long long)b->index);
                break;
            }
            v->info->forwards++;
            v->info->blocks += B;
            if (v->o->on_forward)
                v->o->on_forward(v->o->ctx, input, (int64_t)b->index, first, B, v->bseq, v->banchor,
                                 v->correct, bs);
        }
        /* the walks, as far as the computed anchors reach */
        for (int64_t s = first; s <= last_s; s++) {
            walk *w = &v->w[s];
            const uint8_t *mask = b->loss_mask + start[s];
            for (int64_t k = w->blk_lo; w->pos >= 0 && k < w->blk_hi; k++) {
                if (v->banchor[k] < w->pos)
                    continue;
                if (v->banchor[k] != w->pos)
                    break;
                int got = dfl_eval_step(&v->seq_st[s], v->correct + k * bs, w->end - 1 - w->pos);
                w->pos += got;
                if (w->pos >= w->end - 1)
                    next_walk(w, mask, b->seq_lens[s], w->end, &v->seq_st[s]);
            }
        }
        progress(v, false);
    }
    free(start);
    return rc;
}

static void ev_close(ev *v)
{
    for (int i = 0; i < v->n_rd; i++)
        dfl_reader_close(v->rd[i]);
    free(v->rd);
    dfl_draft_close(v->m);
    dfl_be_close(v->be);
    dfl_st_close(v->wf);
    dfl_st_model_close(v->tm);
    json_decref(v->tcfg);
    free(v->bseq);
    free(v->banchor);
    free(v->correct);
    free(v->w);
    free(v->seq_st);
}

int dfl_eval_run(const dfl_eval_opts *o, dfl_eval_stats *st, dfl_eval_info *info, dfl_err *e)
{
    ev v = {.o = o, .info = info, .st = st};
    memset(info, 0, sizeof *info);
    v.t0 = v.last_progress = dfl_now();
    char *dir = NULL;
    int rc = resolve_draft(o->draft, &dir, e);
    if (!rc) {
        char *real = realpath(dir, NULL);
        snprintf(info->ckpt, sizeof info->ckpt, "%s", real ? real : dir);
        free(real);
        rc = load_target(&v, e);
    }
    if (!rc)
        rc = load_config(&v, dir, e);
    if (!rc)
        rc = open_inputs(&v, e);
    if (!rc && !(rc = dfl_be_open(&v.be, o->device, DFL_DT_INVALID, e))) {
        snprintf(info->device, sizeof info->device, "%s", v.be->name);
        rc = dfl_draft_open(&v.m, v.be, &v.c, e);
    }
    if (!rc)
        rc = load_weights(&v, dir, e);
    const int bs = v.c.block_size;
    if (!rc) {
        const bool gpu = v.be->async;   /* an asynchronous backend: a GPU's larger rounds */
        info->max_tokens = o->max_tokens > 0 ? o->max_tokens : gpu ? 65536 : 16384;
        info->max_blocks = o->max_blocks > 0 ? o->max_blocks : (gpu ? 32768 : 4096) / bs;
        v.bseq = malloc((size_t)info->max_blocks * sizeof *v.bseq);
        v.banchor = malloc((size_t)info->max_blocks * sizeof *v.banchor);
        v.correct = malloc((size_t)info->max_blocks * (size_t)bs);
        if (!v.bseq || !v.banchor || !v.correct)
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    /* an asynchronous backend sizes its workspace once, for the largest round */
    if (!rc && !(rc = dfl_draft_set_feat_dtype(v.m, v.feat_dt, e)) && v.be->async)
        rc = dfl_draft_reserve(v.m, info->max_tokens, info->max_blocks, 0, e);
    if (!rc)
        dfl_eval_stats_init(st, bs);
    for (int i = 0; !rc && i < v.n_rd; i++) {
        const int64_t spans0 = st->spans, steps0 = st->steps;
        for (;;) {
            dfl_batch b = {0};
            bool eos = false;
            if ((rc = dfl_reader_next(v.rd[i], &b, &eos, e)) || eos)
                break;
            rc = eval_batch(&v, i, &b, e);
            dfl_reader_recycle(v.rd[i], &b);
            if (rc)
                break;
        }
        if (!rc && st->spans == spans0)
            rc = dfl_fail(e, DFL_EDATA, "%s: no response position to evaluate (loss_mask is 0 "
                          "everywhere: no labels other than -100)", o->inputs[i]);
        else if (!rc && st->steps == steps0)
            dfl_warn("%s: every response is a single token: no drafting step", o->inputs[i]);
    }
    if (!rc)
        progress(&v, true);
    dfl_progress_end();
    info->seconds = dfl_now() - v.t0;
    ev_close(&v);
    free(dir);
    return rc;
}
