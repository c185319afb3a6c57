/* draft_stage.c: the drafter's staging and the step's driver (draft.h, "Pipelined steps").
 * A batch is staged into one of IN_SETS input sets (host arrays, pinned on a GPU, and their
 * backend copies): the host builds and checks the per-step arrays, copies the features in, and
 * enqueues the upload on the copy stream, which first waits for the end of the step that last
 * read that set (ev_read); the step waits on the compute stream for the upload (ev_up); the host
 * rewrites a set's host arrays only after its last upload has completed. A step's small results
 * (sums, block metrics, scalars, flags: one contiguous backend block) are copied on the compute
 * stream into one of RES_SLOTS pinned slots, with an event recorded right after; the host reads
 * a slot when it likes (one step later in dfl-draft). On the CPU the same code runs with plain
 * copies and no events. */
#include "draft_int.h"
#include "draft_rng.h"
#include "dtype.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The results block (res_layout) and its pinned host slots, the slots' and the input sets'
 * events (dfl_draft_open). */
int dfl_draft_stage_open(dfl_draft *m, dfl_err *e)
{
    dfl_be *be = m->be;
    res_layout *rl = &m->rl;
    size_t ro = 0;
    rl->sums = ro;
    ro += DFL_SUM_COUNT * sizeof(double);
    rl->bmet = ro;
    ro += (size_t)(2 * m->c.block_size + 2) * sizeof(double);
    rl->scal = ro;
    ro += 4 * sizeof(float);
    rl->skip = ro;
    ro += sizeof(int32_t);
    rl->prev_skip = ro;
    ro += sizeof(int32_t);
    rl->bytes = ro;
    m->n_sets = be->async ? IN_SETS : 1;
    int rc = (m->res = be_alloc(be, rl->bytes, e)) ? DFL_OK : (e ? e->code : DFL_ENOMEM);
    for (int i = 0; i < RES_SLOTS && !rc; i++) {
        if (!(m->slots[i].host = be->ops->host_alloc(be, rl->bytes, e)))
            rc = e ? e->code : DFL_ENOMEM;
        else
            rc = be->ops->event_new(be, &m->slots[i].ev_done, false, e);
    }
    for (int i = 0; i < m->n_sets && !rc; i++)
        if (!(rc = be->ops->event_new(be, &m->sets[i].ev_up, false, e)))
            rc = be->ops->event_new(be, &m->sets[i].ev_read, false, e);
    if (rc)
        return rc;
    m->sums = (double *)((char *)m->res + rl->sums);
    m->bmet = (double *)((char *)m->res + rl->bmet);
    m->scal = (float *)((char *)m->res + rl->scal);
    m->skip = (int32_t *)((char *)m->res + rl->skip);
    m->prev_skip = (int32_t *)((char *)m->res + rl->prev_skip);
    be->ops->memset0(be, m->res, rl->bytes);
    return DFL_OK;
}

/* Waits for the copies into host buffers that may still be in flight (dfl_draft_close). */
void dfl_draft_stage_drain(dfl_draft *m)
{
    dfl_be *be = m->be;
    if (!m->res || !be->async)
        return;
    dfl_err se = {0};
    for (int i = 0; i < m->n_sets; i++)
        if (m->sets[i].uploaded)
            be->ops->event_sync(be, m->sets[i].ev_up, &se);
    be->ops->sync(be, &se);
}

/* Frees what dfl_draft_stage_open made (after dfl_draft_stage_drain and the workspace). */
void dfl_draft_stage_close(dfl_draft *m)
{
    dfl_be *be = m->be;
    for (int i = 0; i < RES_SLOTS; i++) {
        be->ops->host_free(be, m->slots[i].host);
        be->ops->event_free(be, m->slots[i].ev_start);
        be->ops->event_free(be, m->slots[i].ev_done);
    }
    for (int i = 0; i < IN_SETS; i++) {
        be->ops->event_free(be, m->sets[i].ev_up);
        be->ops->event_free(be, m->sets[i].ev_read);
    }
    if (m->res)
        be->ops->free(be, m->res);
    dfl_span_prof_free(m->prof);
    m->prof = NULL;
}

int dfl_draft_set_timing(dfl_draft *m, bool on, dfl_err *e)
{
    dfl_be *be = m->be;
    if (m->n_posted > m->n_collected)
        return dfl_fail(e, DFL_EUSAGE, "drafter: timing changed with results pending");
    for (int i = 0; i < RES_SLOTS; i++) {
        res_slot *s = &m->slots[i];
        be->ops->event_free(be, s->ev_start);
        be->ops->event_free(be, s->ev_done);
        s->ev_start = s->ev_done = NULL;
        int rc = (on ? be->ops->event_new(be, &s->ev_start, true, e) : DFL_OK);
        if (!rc)
            rc = be->ops->event_new(be, &s->ev_done, on, e);
        if (rc)
            return rc;
    }
    m->timing = on;
    dfl_span_prof_free(m->prof);
    m->prof = NULL;
    return on ? dfl_span_prof_new(be, &m->prof, e) : DFL_OK;
}

const char *const dfl_draft_prof_kind[DFL_DP_N] = {
    "GEMMs forward", "GEMMs backward", "attention forward", "attention backward",
    "LM head + cross-entropy", "norms, RoPE, SwiGLU, copies", "gradient zeroing + optimizer"};

void dfl_draft_prof_read(dfl_draft *m, dfl_span_sum *out) { dfl_span_read(m->prof, out); }

/* Builds the per-step arrays on the host (positions, block tokens, labels, weights) into a set's
 * host arrays and checks the batch. */
static int prepare(dfl_draft *m, const dfl_draft_input *in, in_set *set, dfl_err *e)
{
    const dfl_draft_config *c = &m->c;
    const int bs = c->block_size;
    if (in->T < 1 || in->S < 1)
        return dfl_fail(e, DFL_EDATA, "drafter step: empty batch (%lld tokens, %d sequences)",
                        (long long)in->T, in->S);
    if (in->T > m->capT || in->n_blocks > m->capB || in->S > m->capS)
        return dfl_fail(e, DFL_EUSAGE, "drafter step: batch of %lld tokens / %d blocks is over the "
                        "reserved %lld / %lld", (long long)in->T, in->n_blocks, (long long)m->capT,
                        (long long)m->capB);
    int64_t *st = m->h_seq_start, t = 0;
    for (int32_t s = 0; s < in->S; s++) {
        st[s] = t;
        if (in->seq_lens[s] == 0)
            return dfl_fail(e, DFL_EDATA, "drafter step: sequence %d is empty", s);
        for (uint32_t i = 0; i < in->seq_lens[s]; i++)
            set->h.pos[t + i] = (int32_t)i;
        t += in->seq_lens[s];
        if (t > in->T)
            break;
    }
    if (t != in->T)
        return dfl_fail(e, DFL_EDATA, "drafter step: sequence lengths add up to %lld, not %lld tokens",
                        (long long)t, (long long)in->T);
    st[in->S] = t;
    for (int64_t i = 0; i < in->T; i++)
        if (in->input_ids[i] < 0 || in->input_ids[i] >= c->vocab)
            return dfl_fail(e, DFL_EDATA, "drafter step: token %d at position %lld is outside the "
                            "vocabulary of %lld", in->input_ids[i], (long long)i, (long long)c->vocab);
    const int64_t T = in->T;
    int32_t prev_seq = 0;
    for (int32_t b = 0; b < in->n_blocks; b++) {
        int32_t s = in->block_seq[b], a = in->block_anchor[b];
        if (s < prev_seq || s >= in->S)
            return dfl_fail(e, DFL_EDATA, "drafter step: block %d: sequence %d out of order or range", b, s);
        prev_seq = s;
        int64_t cs = st[s], L = in->seq_lens[s];
        if (a < 0 || a >= L)
            return dfl_fail(e, DFL_EDATA, "drafter step: block %d: anchor %d outside sequence %d of "
                            "length %lld", b, a, s, (long long)L);
        set->h.ctx_start[b] = (int32_t)cs;
        set->h.anchor[b] = a;
        for (int j = 0; j < bs; j++) {
            int64_t q = (int64_t)b * bs + j, p = a + j;
            set->h.tok[q] = j == 0 ? in->input_ids[cs + a] : c->mask_token_id;
            set->h.pos[T + q] = (int32_t)p;
            bool in_range = p < L;
            set->h.labels[q] = in_range ? in->input_ids[cs + p] : 0;
            set->h.weight[q] = (j >= 1 && in_range && in->loss_mask[cs + p]) ? m->decay[j] : 0.0f;
        }
    }
    return DFL_OK;
}

/* Host part of staging: waits until the set's host arrays are free (their last upload has
 * completed), builds the step's arrays, copies the features in (rows packed). */
static int fill_set(dfl_draft *m, const dfl_draft_input *in, in_set *set, dfl_err *e)
{
    dfl_be *be = m->be;
    const dfl_draft_config *c = &m->c;
    const int64_t T = in->T, H = c->hidden;
    const size_t fs = dfl_dtype_size(in->feat_dt);
    if (!dfl_dtype_is_float(in->feat_dt) || fs > dfl_dtype_size(m->feat_dt) ||
        (in->feat_dt != be->act && !m->featc))
        return dfl_fail(e, DFL_EUNSUP, "drafter step: features of dtype %s, the workspace was sized "
                        "for %s", dfl_dtype_name(in->feat_dt), dfl_dtype_name(m->feat_dt));
    int rc;
    if (set->uploaded && (rc = be->ops->event_sync(be, set->ev_up, e)))
        return rc;
    if ((rc = prepare(m, in, set, e)))
        return rc;
    for (int j = 0; j < c->n_feat; j++) {
        char *dst = (char *)set->h.feat + (size_t)j * T * H * fs;
        if (!in->feat[j])
            return dfl_fail(e, DFL_EUSAGE, "drafter step: no features for captured layer %d", j);
        if (in->feat_ld == H)
            memcpy(dst, in->feat[j], (size_t)(T * H) * fs);
        else
            for (int64_t t = 0; t < T; t++)
                memcpy(dst + (size_t)(t * H) * fs, (const char *)in->feat[j] + (size_t)(t * in->feat_ld) * fs,
                       (size_t)H * fs);
    }
    set->T = T;
    set->S = in->S;
    set->B = in->n_blocks;
    set->feat_dt = in->feat_dt;
    set->noise_amp = in->noise_amp;
    set->noise_seed = in->noise_seed;
    return DFL_OK;
}

int dfl_draft_stage(dfl_draft *m, const dfl_draft_input *in, dfl_err *e)
{
    dfl_be *be = m->be;
    if (!m->arena)
        return dfl_fail(e, DFL_EUSAGE, "drafter step: no workspace (dfl_draft_reserve first)");
    in_set *set = &m->sets[m->n_staged % m->n_sets];
    if (set->full)
        return dfl_fail(e, DFL_EUSAGE, "drafter: %d batches staged and not run", m->n_sets);
    int rc = fill_set(m, in, set, e);
    if (rc)
        return rc;
    /* the upload, on the copy stream, after the step that last read the set's backend copies */
    const int64_t T = set->T, B = set->B, Q = B * m->c.block_size;
    const size_t fb = (size_t)m->c.n_feat * (size_t)(T * m->c.hidden) * dfl_dtype_size(set->feat_dt);
    if ((set->read && (rc = be->ops->stream_wait(be, DFL_STREAM_COPY, set->ev_read, e))) ||
        (rc = be->ops->upload_async(be, set->d.pos, set->h.pos, (size_t)(T + Q) * 4, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->upload_async(be, set->d.tok, set->h.tok, (size_t)Q * 4, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->upload_async(be, set->d.labels, set->h.labels, (size_t)Q * 4, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->upload_async(be, set->d.weight, set->h.weight, (size_t)Q * 4, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->upload_async(be, set->d.ctx_start, set->h.ctx_start, (size_t)B * 4, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->upload_async(be, set->d.anchor, set->h.anchor, (size_t)B * 4, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->upload_async(be, set->d.feat, set->h.feat, fb, DFL_STREAM_COPY, e)) ||
        (rc = be->ops->event_record(be, set->ev_up, DFL_STREAM_COPY, e)))
        return rc;
    set->uploaded = true;
    set->full = true;
    m->n_staged++;
    return DFL_OK;
}

/* The step's inputs on the compute stream: wait for the set's upload, point the model at its
 * arrays, convert the features to the act dtype when they differ, add the noise. */
static int use_set(dfl_draft *m, in_set *set, dfl_err *e)
{
    dfl_be *be = m->be;
    const dfl_draft_config *c = &m->c;
    int rc = be->ops->stream_wait(be, DFL_STREAM_COMPUTE, set->ev_up, e);
    if (rc)
        return rc;
    m->in = set->d;
    m->h_in = set->h;
    const int64_t n = (int64_t)c->n_feat * set->T * c->hidden;
    if (set->feat_dt != be->act) {
        m->in.feat = m->featc;
        TRY(be->ops->convert(be, m->in.feat, be->act, set->d.feat, set->feat_dt, n));
    }
    if (set->noise_amp > 0)
        TRY(be->ops->uniform_noise(be, m->in.feat, n, set->noise_amp, set->noise_seed));
    return DFL_OK;
}

/* The forward (and backward) of the batch in set. */
static int run_step(dfl_draft *m, const in_set *set, bool backward, dfl_err *e)
{
    m->T = set->T;
    m->S = set->S;
    m->B = set->B;
    m->Q = m->B * m->c.block_size;
    int rc = dfl_draft_forward(m, backward, e);
    if (rc)
        return rc;
    m->have_step = true;
    return backward ? dfl_draft_backward(m, e) : DFL_OK;
}

int dfl_draft_run(dfl_draft *m, bool backward, dfl_err *e)
{
    dfl_be *be = m->be;
    m->have_step = m->have_apply = m->step_posted = false;
    if (!m->embed)
        return dfl_fail(e, DFL_EUSAGE, "drafter step: no target embedding / LM head");
    if (m->n_run >= m->n_staged)
        return dfl_fail(e, DFL_EUSAGE, "drafter step: no batch staged");
    in_set *set = &m->sets[m->n_run % m->n_sets];
    res_slot *slot = &m->slots[m->n_posted % RES_SLOTS];
    int rc = use_set(m, set, e);
    if (!rc && slot->ev_start)
        rc = be->ops->event_record(be, slot->ev_start, DFL_STREAM_COMPUTE, e);
    if (!rc)
        rc = run_step(m, set, backward, e);
    /* the set's backend copies may be overwritten once the step's work so far has run */
    if (!rc && !(rc = be->ops->event_record(be, set->ev_read, DFL_STREAM_COMPUTE, e)))
        set->read = true;
    set->full = false;
    m->n_run++;
    return rc;
}

int dfl_draft_step(dfl_draft *m, const dfl_draft_input *in, bool backward, dfl_err *e)
{
    m->have_step = m->have_apply = false;
    if (m->n_run < m->n_staged)
        return dfl_fail(e, DFL_EUSAGE, "drafter step: a batch is staged (dfl_draft_run it first)");
    int rc = dfl_draft_stage(m, in, e);
    return rc ? rc : dfl_draft_run(m, backward, e);
}

int dfl_draft_post(dfl_draft *m, dfl_err *e)
{
    dfl_be *be = m->be;
    if (!m->have_step || m->step_posted)
        return dfl_fail(e, DFL_EUSAGE, "drafter: no step to post (or posted already)");
    if (m->n_posted - m->n_collected >= RES_SLOTS)
        return dfl_fail(e, DFL_EUSAGE, "drafter: %d results posted and not collected", RES_SLOTS);
    res_slot *s = &m->slots[m->n_posted % RES_SLOTS];
    /* on the compute stream, which produced them; the event right after */
    int rc = be->ops->download_async(be, s->host, m->res, m->rl.bytes, DFL_STREAM_COMPUTE, e);
    if (!rc)
        rc = be->ops->event_record(be, s->ev_done, DFL_STREAM_COMPUTE, e);
    if (rc)
        return rc;
    s->T = m->T;
    s->B = m->B;
    s->have_apply = m->have_apply;
    s->posted = true;
    m->n_posted++;
    m->step_posted = true;
    return DFL_OK;
}

int dfl_draft_pending(const dfl_draft *m) { return (int)(m->n_posted - m->n_collected); }

int dfl_draft_collect(dfl_draft *m, dfl_draft_stats *st, dfl_err *e)
{
    dfl_be *be = m->be;
    memset(st, 0, sizeof *st);
    st->gpu_ms = -1;
    if (m->n_collected >= m->n_posted)
        return dfl_fail(e, DFL_EUSAGE, "drafter: no results posted");
    res_slot *s = &m->slots[m->n_collected % RES_SLOTS];
    int rc = be->ops->event_sync(be, s->ev_done, e);
    if (rc)
        return rc;
    if (s->ev_start) {
        float ms;
        if (be->ops->event_elapsed(be, s->ev_start, s->ev_done, &ms, e) == DFL_OK)
            st->gpu_ms = ms;
    }
    const int bs = m->c.block_size;
    const char *h = s->host;
    double sums[DFL_SUM_COUNT], bm[2 * DFL_DRAFT_MAX_BS + 2];
    float scal[4];
    int32_t skip;
    memcpy(sums, h + m->rl.sums, sizeof sums);
    memcpy(bm, h + m->rl.bmet, (size_t)(2 * bs + 2) * sizeof(double));
    memcpy(scal, h + m->rl.scal, sizeof scal);
    memcpy(&skip, h + m->rl.skip, sizeof skip);
    s->posted = false;
    m->n_collected++;
    st->loss_num = sums[DFL_SUM_LOSS_NUM];
    st->loss_den = sums[DFL_SUM_LOSS_DEN];
    st->acc_num = sums[DFL_SUM_ACC_NUM];
    st->acc_den = sums[DFL_SUM_ACC_DEN];
    if (s->have_apply) {
        st->grad_norm = scal[1];
        st->clip_coef = scal[2];
    }
    st->skipped = s->have_apply ? skip != 0 : !isfinite(st->loss_num);
    st->bs = bs;
    st->tokens = s->T;
    st->blocks = s->B;
    for (int j = 1; j < bs; j++) {
        st->slot_count[j] = bm[j];
        st->slot_correct[j] = bm[bs + j];
    }
    st->tau_sum = bm[2 * bs];
    st->tau_blocks = (int64_t)bm[2 * bs + 1];
    return DFL_OK;
}

int dfl_draft_fetch(dfl_draft *m, dfl_draft_stats *st, dfl_err *e)
{
    memset(st, 0, sizeof *st);
    if (!m->have_step)
        return dfl_fail(e, DFL_EUSAGE, "drafter: no step to fetch");
    if (m->n_collected == m->n_posted)   /* fetched already: read it again (after apply, say) */
        m->step_posted = false;
    int rc = m->step_posted ? DFL_OK : dfl_draft_post(m, e);
    while (!rc && m->n_collected < m->n_posted)
        rc = dfl_draft_collect(m, st, e);
    return rc;
}

int dfl_draft_warmup(dfl_draft *m, dfl_err *e)
{
    dfl_be *be = m->be;
    const dfl_draft_config *c = &m->c;
    if (!m->arena)
        return dfl_fail(e, DFL_EUSAGE, "drafter warm-up: no workspace");
    if (m->n_run < m->n_staged)
        return dfl_fail(e, DFL_EUSAGE, "drafter warm-up: a batch is staged");
    /* one sequence of capT tokens, capB blocks at anchors 0, 1, ...; zero features (with --tune
     * normal ones); every slot scored */
    const int64_t T = m->capT, B = m->capB < T ? m->capB : T - 1 > 0 ? T - 1 : 1;
    const size_t fs = dfl_dtype_size(m->feat_dt);
    uint32_t len = (uint32_t)T;
    int32_t *ids = calloc((size_t)T, 4), *bseq = calloc((size_t)B, 4), *banc = calloc((size_t)B, 4);
    uint8_t *mask = malloc((size_t)T);
    void *feat = calloc((size_t)(T * c->hidden), fs);
    int rc = DFL_OK;
    if (!ids || !bseq || !banc || !mask || !feat) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        goto out;
    }
    memset(mask, 1, (size_t)T);
    for (int64_t b = 0; b < B; b++)
        banc[b] = (int32_t)(T > 1 ? b % (T - 1) : 0);
    if (m->tune) {
        /* the GEMMs are timed at the power cap, where their energy sets their rate, and the
         * energy depends on the data: varied tokens and normal features, not zeros */
        dfl_rng r;
        dfl_rng_seed(&r, 0x74756e65);
        for (int64_t i = 0; i < T; i++)
            ids[i] = (int32_t)((i * 7919 + 13) % c->vocab);
        for (int64_t i = 0; i < T * c->hidden; i++) {
            const float v = (float)dfl_rng_normal(&r);
            dfl_convert((char *)feat + (size_t)i * fs, m->feat_dt, &v, DFL_F32, 1);
        }
    }
    dfl_draft_input in = {.T = T, .S = 1, .seq_lens = &len, .input_ids = ids, .loss_mask = mask,
                          .feat_dt = m->feat_dt, .feat_ld = c->hidden, .n_blocks = (int32_t)B,
                          .block_seq = bseq, .block_anchor = banc};
    for (int j = 0; j < c->n_feat; j++)
        in.feat[j] = feat;
    /* the results block is the last step's until it is posted: keep it */
    const bool pending_step = m->have_step;
    if (pending_step) {
        rc = dfl_fail(e, DFL_EUSAGE, "drafter warm-up: the last step is not posted");
        goto out;
    }
    m->tuning = m->tune;
    m->n_tuned = 0;
    if (!(rc = dfl_draft_step(m, &in, true, e)))
        rc = be->ops->sync(be, e);
    m->tuning = false;
    m->have_step = m->have_apply = false;
out:
    free(ids);
    free(bseq);
    free(banc);
    free(mask);
    free(feat);
    return rc ? dfl_err_prefix(e, "drafter warm-up on %lld tokens, %lld blocks: ", (long long)T,
                               (long long)B) : DFL_OK;
}

void dfl_draft_set_tune(dfl_draft *m, bool on) { m->tune = on; }

void dfl_draft_host_waits(const dfl_draft *m, uint64_t *syncs, uint64_t *event_waits)
{
    m->be->ops->wait_stats(m->be, syncs, event_waits);
}

int dfl_draft_eval(dfl_draft *m, const dfl_draft_input *in, uint8_t *correct, dfl_err *e)
{
    dfl_be *be = m->be;
    const int bs = m->c.block_size;
    if (m->n_run < m->n_staged || m->n_posted > m->n_collected)
        return dfl_fail(e, DFL_EUSAGE, "drafter evaluation: a step is staged or pending");
    if (in->noise_amp > 0)
        return dfl_fail(e, DFL_EUSAGE, "drafter evaluation: no feature noise");
    /* every slot in range weighs 1, so that no decay underflow leaves one unscored */
    float decay[DFL_DRAFT_MAX_BS];
    memcpy(decay, m->decay, sizeof decay);
    for (int j = 0; j < bs; j++)
        m->decay[j] = 1.0f;
    int rc = dfl_draft_step(m, in, false, e);
    memcpy(m->decay, decay, sizeof decay);
    if (!rc && in->n_blocks > 0 &&
        be->ops->download(be, correct, m->correct, (size_t)in->n_blocks * (size_t)bs))
        rc = dfl_fail(e, DFL_EDEVICE, "drafter evaluation: download failed");
    if (!rc)
        rc = be->ops->sync(be, e);
    m->have_step = m->have_apply = false;
    return rc;
}
