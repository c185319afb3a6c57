/* dflash-golden FILE: computes the DFlash training step of a golden file (its keys are listed in
 * the oracle's own documentation, ../shared/DFLASH.md section 10: weights, inputs and fixed
 * anchors, written by SpecForge) with the drafter model code on the CPU
 * backend, and compares the loss, accuracy, every gradient, the activations saved under dbg.*,
 * per-sequence parts and the AdamW step against the file, within doc/dflash-step.md section 6's
 * tolerances. The configuration comes from the file's metadata ("config", "adamw"), and where a
 * field is missing, from the tensor shapes. Prints the worst error of each check; exits 0 only if
 * every check passes (1 on a failed check, 2 on an unreadable file). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "draft.h"
#include "golden_tol.h"
#include "json.h"
#include "safetensors.h"

static int failures;

/* --act bf16 (on a GPU): bf16 storage of activations and compute weights. Tolerances are then
 * multiplied by BF16_TOL_MULT (doc/dflash-step.md section 6's float32 thresholds x 500: loss 5e-3
 * relative, activations 5e-2 absolute, gradients 5e-2 x max|g|), and exact counts may differ by
 * 2% of the scored slots and the accuracy by as much (golden_tol.h: the two agree; the smallest
 * top-1/top-2 logit gap is 6e-3 in dflash-tiny, 3.2e-4 in dflash-swa: within bf16 rounding). */
#define BF16_TOL_MULT 500.0
/* Per-value checks in bf16 mode, where x500 does not describe bf16 rounding: activations within
 * 2% of the tensor's largest |value| (about 2.5 bf16 units in the last place of the largest
 * values, after a few layers of bf16 matmuls), per-slot cross-entropy within 2% (its logits come
 * from bf16 z and W); the pooled loss keeps the x500 tolerance (5e-3). */
#define BF16_ACT_TOL 0.02
#define BF16_CE_TOL 0.02
static bool bf16_mode;
static double count_slack;

static void report2(const char *what, double err, double tol, double tol_bf16, const char *unit)
{
    if (bf16_mode)
        tol = tol_bf16;
    bool ok = err <= tol;   /* NaN fails */
    printf("%-34s worst %-12.4g tol %-10.3g %-18s %s\n", what, err, tol, unit, ok ? "ok" : "FAIL");
    if (!ok)
        failures++;
}

static void report(const char *what, double err, double tol, const char *unit)
{
    if (bf16_mode)
        tol = tol == 0 ? count_slack : tol * BF16_TOL_MULT;
    bool ok = err <= tol;   /* NaN fails */
    printf("%-34s worst %-12.4g tol %-10.3g %-18s %s\n", what, err, tol, unit, ok ? "ok" : "FAIL");
    if (!ok)
        failures++;
}

static double max_abs(const float *x, uint64_t n)
{
    double m = 0;
    for (uint64_t i = 0; i < n; i++)
        m = fmax(m, fabs(x[i]));
    return m;
}

static const dfl_st_tensor *need(const dfl_st_file *f, const char *name)
{
    const dfl_st_tensor *t = dfl_st_find(f, name);
    if (!t) {
        fprintf(stderr, "dflash-golden: %s: no tensor '%s'\n", f->path, name);
        exit(2);
    }
    return t;
}

/* A tensor's values as f32 / i32 (malloc'ed; the file's data may be unaligned). */
static float *get_f32(const dfl_st_file *f, const char *name, uint64_t *n)
{
    const dfl_st_tensor *t = need(f, name);
    float *p = malloc((t->numel ? t->numel : 1) * sizeof *p);
    if (!p || !dfl_convert(p, DFL_F32, t->data, t->dtype, t->numel)) {
        fprintf(stderr, "dflash-golden: %s: cannot read '%s' (%s) as f32\n", f->path, name,
                dfl_dtype_name(t->dtype));
        exit(2);
    }
    if (n)
        *n = t->numel;
    return p;
}

static int32_t *get_i32(const dfl_st_file *f, const char *name, uint64_t *n)
{
    const dfl_st_tensor *t = need(f, name);
    int32_t *p = malloc((t->numel ? t->numel : 1) * sizeof *p);
    for (uint64_t i = 0; i < t->numel; i++) {
        if (t->dtype == DFL_I32) {
            memcpy(&p[i], (const char *)t->data + 4 * i, 4);
        } else if (t->dtype == DFL_I64) {
            int64_t v;
            memcpy(&v, (const char *)t->data + 8 * i, 8);
            p[i] = (int32_t)v;
        } else {
            p[i] = (int32_t)dfl_load_f64(t->data, t->dtype, i);
        }
    }
    if (n)
        *n = t->numel;
    return p;
}

static double scalar(const dfl_st_file *f, const char *name)
{
    float *p = get_f32(f, name, NULL);
    double v = p[0];
    free(p);
    return v;
}

/* max |a - b| over n and max |b| */
/* The larger of a running worst error and a new one, keeping a NaN (fmax drops it). */
static double t_worst(double worst, double d)
{
    return (d > worst || d != d) ? d : worst;
}

static double max_abs_diff(const float *a, const float *b, int64_t n, double *bmax)
{
    double err = 0, mx = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= err))
            err = isnan(d) ? INFINITY : d;
        if (!(fabs(b[i]) <= mx))   /* a NaN reference makes the bound NaN: the check fails */
            mx = fabs(b[i]);
    }
    if (bmax)
        *bmax = mx;
    return err;
}

typedef struct golden_cfg {
    dfl_draft_config c;
    double lr, beta1, beta2, eps, wd;
} golden_cfg;

static int count_layers(const dfl_st_file *f)
{
    int n = 0;
    char nm[96];
    for (;;) {
        snprintf(nm, sizeof nm, "layers.%d.input_layernorm.weight", n);
        if (!dfl_st_find(f, nm))
            return n;
        n++;
    }
}

/* Configuration from the metadata, completed from shapes. */
static void read_config(const dfl_st_file *f, golden_cfg *g)
{
    dfl_draft_config *c = &g->c;
    memset(g, 0, sizeof *g);
    c->rms_eps = 1e-6;
    c->rope_theta = 1e6;
    c->mask_token_id = -1;
    c->bos_token_id = c->eos_token_id = -1;
    c->max_position = 4096;
    g->lr = 1e-3, g->beta1 = 0.9, g->beta2 = 0.95, g->eps = 1e-8, g->wd = 0;
    const dfl_st_tensor *fc = need(f, "fc.weight"), *qn = need(f, "layers.0.self_attn.q_norm.weight");
    const dfl_st_tensor *qp = need(f, "layers.0.self_attn.q_proj.weight");
    const dfl_st_tensor *kp = need(f, "layers.0.self_attn.k_proj.weight");
    const dfl_st_tensor *gp = need(f, "layers.0.mlp.gate_proj.weight");
    const dfl_st_tensor *em = need(f, "target.embed_tokens.weight");
    /* shapes first, then the metadata on top */
    c->hidden = fc->shape[0];
    c->n_feat = (int)(fc->shape[1] / fc->shape[0]);
    c->vocab = em->shape[0];
    c->head_dim = (int)qn->shape[0];
    c->n_heads = (int)(qp->shape[0] / c->head_dim);
    c->n_kv = (int)(kp->shape[0] / c->head_dim);
    c->intermediate = gp->shape[0];
    c->n_layers = count_layers(f);
    uint64_t nb = 0;
    float *decay = get_f32(f, "slot_decay_weight", &nb);
    c->block_size = (int)nb;
    c->gamma = nb > 2 ? -1.0 / log((double)decay[2]) : 4.0;
    free(decay);
    uint64_t nl = 0;
    int32_t *ids = get_i32(f, "target_layer_ids", &nl);
    for (uint64_t i = 0; i < nl && i < DFL_DRAFT_MAX_FEAT; i++)
        c->target_layers[i] = ids[i];
    free(ids);
    const char *from[32];
    int nfrom = 0;
    const char *cj = dfl_st_meta(f, "config");
    json_t *j = NULL;
    dfl_err e = {0};
    if (cj && dfl_json_parse(cj, strlen(cj), &j, "metadata config", &e) == 0) {
        int64_t v;
        double d;
#define MI(key, field)                                                                 \
    if (json_is_integer(json_object_get(j, key)) && !dfl_json_int(j, key, false, &v, "", &e)) { \
        c->field = v;                                                                  \
        from[nfrom < 31 ? nfrom++ : 31] = key;                                         \
    }
#define MD(obj, key, lval)                                                             \
    if (json_is_number(json_object_get(obj, key)) && !dfl_json_num(obj, key, false, &d, "", &e)) { \
        lval = d;                                                                      \
        from[nfrom < 31 ? nfrom++ : 31] = key;                                         \
    }
        MI("vocab_size", vocab);
        MI("hidden_size", hidden);
        MI("num_target_layers", n_target_layers);
        MI("num_draft_layers", n_layers);
        MI("num_attention_heads", n_heads);
        MI("num_key_value_heads", n_kv);
        MI("head_dim", head_dim);
        MI("intermediate_size", intermediate);
        MI("block_size", block_size);
        MI("num_target_features", n_feat);
        MI("mask_token_id", mask_token_id);
        MI("max_position_embeddings", max_position);
        MD(j, "rms_norm_eps", c->rms_eps);
        MD(j, "rope_theta", c->rope_theta);
        MD(j, "loss_decay_gamma", c->gamma);
        const json_t *tl = json_object_get(j, "target_layer_ids");
        if (json_is_array(tl) && json_array_size(tl) <= DFL_DRAFT_MAX_FEAT) {
            for (size_t i = 0; i < json_array_size(tl); i++)
                c->target_layers[i] = (int32_t)json_integer_value(json_array_get(tl, i));
            c->n_feat = (int)json_array_size(tl);
        }
        /* sliding-window layers (the dflash-swa golden): layer_types and sliding_window */
        MI("sliding_window", sliding_window);
        const json_t *lt = json_object_get(j, "layer_types");
        if (json_is_array(lt) && (int)json_array_size(lt) == c->n_layers) {
            for (size_t i = 0; i < json_array_size(lt); i++) {
                const char *ty = json_string_value(json_array_get(lt, i));
                if (!ty || (strcmp(ty, "sliding_attention") && strcmp(ty, "full_attention"))) {
                    fprintf(stderr, "dflash-golden: %s: layer_types[%zu] is not a layer type\n",
                            f->path, i);
                    exit(2);
                }
                c->sliding[i] = !strcmp(ty, "sliding_attention");
            }
            from[nfrom < 31 ? nfrom++ : 31] = "layer_types";
        } else if (lt) {
            fprintf(stderr, "dflash-golden: %s: layer_types does not list the %d layers\n", f->path,
                    c->n_layers);
            exit(2);
        }
        const json_t *ad = json_object_get(j, "adamw");
        if (json_is_object(ad)) {
            MD(ad, "lr", g->lr);
            MD(ad, "eps", g->eps);
            MD(ad, "weight_decay", g->wd);
            const json_t *b = json_object_get(ad, "betas");
            if (json_is_array(b) && json_array_size(b) == 2) {
                g->beta1 = json_number_value(json_array_get(b, 0));
                g->beta2 = json_number_value(json_array_get(b, 1));
            }
        }
#undef MI
#undef MD
    }
    if (c->mask_token_id < 0) {
        c->mask_token_id = (int32_t)(c->vocab - 1);
        printf("mask_token_id not in the metadata: assuming vocab-1 = %d\n", c->mask_token_id);
    }
    if (c->n_target_layers <= 0) {
        int mx = 0;
        for (int i = 0; i < c->n_feat; i++)
            mx = c->target_layers[i] > mx ? c->target_layers[i] : mx;
        c->n_target_layers = mx + 1;
    }
    printf("config: H=%lld V=%lld I=%lld layers=%d heads=%d/%d head_dim=%d features=%d bs=%d "
           "mask=%d gamma=%g eps=%g theta=%g\n", (long long)c->hidden, (long long)c->vocab,
           (long long)c->intermediate, c->n_layers, c->n_heads, c->n_kv, c->head_dim, c->n_feat,
           c->block_size, c->mask_token_id, c->gamma, c->rms_eps, c->rope_theta);
    printf("layer_types:");
    for (int l = 0; l < c->n_layers; l++)
        printf(" %s", c->sliding[l] ? "sliding_attention" : "full_attention");
    printf(" (sliding_window %lld)\n", (long long)c->sliding_window);
    printf("adamw: lr=%g betas=(%g, %g) eps=%g weight_decay=%g\n", g->lr, g->beta1, g->beta2,
           g->eps, g->wd);
    printf("from the metadata:");
    for (int i = 0; i < nfrom; i++)
        printf(" %s", from[i]);
    printf("%s\n", nfrom ? "" : " nothing (all from tensor shapes and defaults)");
    json_decref(j);
}

/* The golden's sequences, packed. */
typedef struct packed {
    int32_t S;
    int64_t T, B;
    uint32_t *lens;
    int32_t *ids;
    uint8_t *mask;
    float *hidden;        /* [T, k*H] */
    int32_t *bseq, *banchor;
    int32_t *nanch;       /* [S] blocks per sequence */
} packed;

static void load_batch(const dfl_st_file *f, const dfl_draft_config *c, packed *p)
{
    uint64_t ns;
    int32_t *lens = get_i32(f, "seq_lens", &ns);
    memset(p, 0, sizeof *p);
    p->S = (int32_t)ns;
    p->lens = malloc(ns * sizeof *p->lens);
    p->nanch = malloc(ns * sizeof *p->nanch);
    for (uint64_t s = 0; s < ns; s++) {
        p->lens[s] = (uint32_t)lens[s];
        p->T += lens[s];
    }
    const int64_t KH = (int64_t)c->n_feat * c->hidden;
    p->ids = malloc(p->T * 4);
    p->mask = malloc(p->T);
    p->hidden = malloc(p->T * KH * 4);
    p->bseq = malloc(p->T * 4);
    p->banchor = malloc(p->T * 4);
    int64_t t = 0;
    for (int32_t s = 0; s < p->S; s++) {
        char nm[64];
        uint64_t n;
        snprintf(nm, sizeof nm, "seq%d.input_ids", s);
        int32_t *ids = get_i32(f, nm, &n);
        snprintf(nm, sizeof nm, "seq%d.loss_mask", s);
        int32_t *mask = get_i32(f, nm, NULL);
        snprintf(nm, sizeof nm, "seq%d.hidden_states", s);
        uint64_t nh;
        float *h = get_f32(f, nm, &nh);
        snprintf(nm, sizeof nm, "seq%d.anchors", s);
        uint64_t na;
        int32_t *an = get_i32(f, nm, &na);
        if (n != p->lens[s] || nh != n * (uint64_t)KH) {
            fprintf(stderr, "dflash-golden: %s: seq%d sizes disagree with seq_lens\n", f->path, s);
            exit(2);
        }
        for (uint64_t i = 0; i < n; i++) {
            p->ids[t + i] = ids[i];
            p->mask[t + i] = mask[i] != 0;
        }
        memcpy(p->hidden + t * KH, h, nh * 4);
        for (uint64_t i = 0; i < na; i++) {
            p->bseq[p->B] = s;
            p->banchor[p->B++] = an[i];
        }
        p->nanch[s] = (int32_t)na;
        t += n;
        free(ids), free(mask), free(h), free(an);
    }
    free(lens);
}

static dfl_draft_input make_input(const packed *p, const dfl_draft_config *c, int32_t only_seq)
{
    dfl_draft_input in = {0};
    const int64_t KH = (int64_t)c->n_feat * c->hidden;
    in.feat_dt = DFL_F32;
    in.feat_ld = KH;
    if (only_seq < 0) {
        in.T = p->T, in.S = p->S, in.seq_lens = p->lens, in.input_ids = p->ids;
        in.loss_mask = p->mask, in.n_blocks = (int32_t)p->B, in.block_seq = p->bseq;
        in.block_anchor = p->banchor;
        for (int j = 0; j < c->n_feat; j++)
            in.feat[j] = p->hidden + (int64_t)j * c->hidden;
        return in;
    }
    static int32_t zero_seq[1 << 16];
    int64_t t0 = 0, b0 = 0;
    for (int32_t s = 0; s < only_seq; s++) {
        t0 += p->lens[s];
        b0 += p->nanch[s];
    }
    in.T = p->lens[only_seq], in.S = 1, in.seq_lens = p->lens + only_seq;
    in.input_ids = p->ids + t0, in.loss_mask = p->mask + t0;
    in.n_blocks = p->nanch[only_seq], in.block_seq = zero_seq, in.block_anchor = p->banchor + b0;
    for (int j = 0; j < c->n_feat; j++)
        in.feat[j] = p->hidden + t0 * KH + (int64_t)j * c->hidden;
    return in;
}

/* Compares the batch step's gradients (of loss_num, divided by den here) with prefix + name. */
static void check_grads(dfl_draft *m, const dfl_st_file *f, const char *prefix, double den,
                        const char *label)
{
    int nt;
    const dfl_draft_tensor *t = dfl_draft_tensor_list(m, &nt);
    int64_t flat = dfl_draft_flat_len(m);
    float *g = malloc(flat * 4);
    dfl_err e = {0};
    if (dfl_draft_download(m, DFL_DRAFT_GRAD, g, &e)) {
        fprintf(stderr, "dflash-golden: %s\n", e.msg);
        exit(2);
    }
    double worst = 0, sq = 0;
    const char *worst_name = "";
    for (int i = 0; i < nt; i++) {
        char nm[160];
        snprintf(nm, sizeof nm, "%s%s", prefix, t[i].name);
        float *ref = get_f32(f, nm, NULL);
        float *mine = g + t[i].offset;
        for (int64_t k = 0; k < t[i].numel; k++) {
            mine[k] = (float)(mine[k] / den);
            sq += (double)mine[k] * mine[k];
        }
        double mx, err = max_abs_diff(mine, ref, t[i].numel, &mx);
        double rel = mx > 0 ? err / mx : err;
        if (!(rel <= worst)) {
            worst = isnan(rel) ? INFINITY : rel;
            worst_name = t[i].name;
        }
        free(ref);
    }
    char what[128];
    snprintf(what, sizeof what, "%s (%s)", label, worst_name);
    report(what, worst, 1e-4, "x max|g| per tensor");
    if (!strcmp(prefix, "grad.") && dfl_st_find(f, "grad_norm")) {
        double gn = scalar(f, "grad_norm");
        report("grad_norm", fabs(sqrt(sq) - gn) / gn, 1e-5, "relative");
    }
    free(g);
}

/* AdamW (the backend op) from p0 with gradients grad_prefix.*, compared with want_prefix.*;
 * m and v carry the moments between calls. */
static void check_adamw(dfl_be *be, dfl_draft *m, const dfl_st_file *f, const golden_cfg *g,
                        const char *p0_prefix, const char *grad_prefix, const char *want_prefix,
                        int64_t step, float **mom_m, float **mom_v, const char *label)
{
    int nt;
    const dfl_draft_tensor *t = dfl_draft_tensor_list(m, &nt);
    double worst = 0;
    const char *worst_name = "";
    for (int i = 0; i < nt; i++) {
        char nm[160];
        snprintf(nm, sizeof nm, "%s%s", p0_prefix, t[i].name);
        float *p = get_f32(f, nm, NULL);
        snprintf(nm, sizeof nm, "%s%s", grad_prefix, t[i].name);
        float *gr = get_f32(f, nm, NULL);
        snprintf(nm, sizeof nm, "%s%s", want_prefix, t[i].name);
        float *want = get_f32(f, nm, NULL);
        if (!mom_m[i]) {
            mom_m[i] = calloc(t[i].numel, 4);
            mom_v[i] = calloc(t[i].numel, 4);
        }
        dfl_adamw a = {.p = p, .g = gr, .m = mom_m[i], .v = mom_v[i], .n = t[i].numel,
                       .lr = (float)g->lr, .beta1 = (float)g->beta1, .beta2 = (float)g->beta2,
                       .eps = (float)g->eps, .weight_decay = (float)g->wd, .step = step};
        be->ops->adamw(be, &a);
        double err = max_abs_diff(p, want, t[i].numel, NULL);
        if (!(err <= worst)) {
            worst = isnan(err) ? INFINITY : err;
            worst_name = t[i].name;
        }
        free(p), free(gr), free(want);
    }
    char what[128];
    snprintf(what, sizeof what, "%s (%s)", label, worst_name);
    report(what, worst, 1e-6, "absolute");
}

/* End to end: the drafter's own gradients through dfl_draft_apply (no clipping), compared with
 * after_adamw: tight where the golden |g| >= 1e-5, about lr where smaller (doc/dflash-step.md section 6). */
static void check_apply(dfl_draft *m, const dfl_st_file *f, const golden_cfg *g)
{
    dfl_draft_optim o = {(float)g->beta1, (float)g->beta2, (float)g->eps, (float)g->wd, 0.0f};
    dfl_err e = {0};
    if (dfl_draft_apply(m, &o, (float)g->lr, 1, &e)) {
        fprintf(stderr, "dflash-golden: %s\n", e.msg);
        exit(2);
    }
    int nt;
    const dfl_draft_tensor *t = dfl_draft_tensor_list(m, &nt);
    float *p = malloc(dfl_draft_flat_len(m) * 4);
    dfl_draft_download(m, DFL_DRAFT_MASTER, p, &e);
    double worst_big = 0, worst_small = 0;
    int64_t n_big = 0, flips = 0;
    for (int i = 0; i < nt; i++) {
        char nm[160];
        snprintf(nm, sizeof nm, "after_adamw.%s", t[i].name);
        float *want = get_f32(f, nm, NULL);
        snprintf(nm, sizeof nm, "grad.%s", t[i].name);
        float *gr = get_f32(f, nm, NULL);
        for (int64_t k = 0; k < t[i].numel; k++) {
            double d = fabs((double)p[t[i].offset + k] - want[k]);
            if (isnan(d))
                d = INFINITY;
            if (fabs(gr[k]) >= 1e-5) {
                worst_big = t_worst(worst_big, d);
                n_big++;
                flips += !(d <= g->lr);
            } else
                worst_small = t_worst(worst_small, d);
        }
        free(want), free(gr);
    }
    /* bf16: Adam's first update is lr sign(g) (|g| >> eps), so a gradient whose bf16 error
     * exceeds its size moves its parameter 2 lr the other way; such flips must stay rare */
    report2("after_adamw end to end, |g|>=1e-5", worst_big, 1e-6, 2 * g->lr + 1e-6, "absolute");
    report2("after_adamw, |g|>=1e-5 updates flipped", n_big ? (double)flips / (double)n_big : 0, 0,
            0.01, "fraction");
    report2("after_adamw end to end, |g|<1e-5", worst_small, 2 * g->lr, 2 * g->lr + 1e-6,
            "absolute (~lr)");
    free(p);
}

/* dbg.* activations: [S, N*bs, H] per sequence in SpecForge's padded layout */
static void check_activations(dfl_draft *m, const dfl_st_file *f, const packed *p,
                              const dfl_draft_config *c)
{
    const int64_t H = c->hidden, bs = c->block_size, Q = p->B * bs;
    dfl_err e = {0};
    if (dfl_st_find(f, "dbg.target_ctx")) {
        const dfl_st_tensor *t = need(f, "dbg.target_ctx");
        float *ref = get_f32(f, "dbg.target_ctx", NULL), *mine = malloc(p->T * H * 4);
        dfl_draft_activation(m, DFL_DRAFT_ACT_CTX, 0, mine, p->T * H, &e);
        double worst = 0;
        int64_t row = 0, Smax = t->shape[1];
        for (int32_t s = 0; s < p->S; s++) {
            for (uint32_t i = 0; i < p->lens[s]; i++)
                worst = t_worst(worst, max_abs_diff(mine + (row + i) * H, ref + ((int64_t)s * Smax + i) * H, H, NULL));
            row += p->lens[s];
        }
        report2("dbg.target_ctx (C)", worst, 1e-4, BF16_ACT_TOL * max_abs(ref, t->numel), "absolute");
        free(ref), free(mine);
    }
    float *mine = malloc(Q * H * 4);
    for (int l = -1; l <= c->n_layers; l++) {
        char nm[64];
        int which = DFL_DRAFT_ACT_LAYER;
        if (l == c->n_layers) {
            snprintf(nm, sizeof nm, "dbg.draft_out");
            which = DFL_DRAFT_ACT_OUT;
        } else if (l >= 0) {
            snprintf(nm, sizeof nm, "dbg.layer%d.out", l);
        } else {
            continue;
        }
        if (!dfl_st_find(f, nm))
            continue;
        const dfl_st_tensor *t = need(f, nm);
        float *ref = get_f32(f, nm, NULL);
        dfl_draft_activation(m, which, l, mine, Q * H, &e);
        /* the last layer runs past its attention at the scored slots only (draft.h: slot 0's
         * output is never scored, and is 0 there): its output and z are compared at slots
         * 1..bs-1, and must be exactly 0 at slot 0 */
        const int64_t j0 = l >= c->n_layers - 1 ? 1 : 0;
        double worst = 0;
        int64_t b = 0, rows = t->shape[1], nonzero0 = 0;
        for (int32_t s = 0; s < p->S; s++)
            for (int32_t n = 0; n < p->nanch[s]; n++, b++) {
                for (int64_t j = j0; j < bs; j++)
                    worst = t_worst(worst, max_abs_diff(mine + (b * bs + j) * H,
                                                     ref + ((int64_t)s * rows + n * bs + j) * H, H, NULL));
                for (int64_t i = 0; j0 && i < H; i++)
                    nonzero0 += mine[b * bs * H + i] != 0.0f;
            }
        report2(nm, worst, 1e-4, BF16_ACT_TOL * max_abs(ref, t->numel), "absolute");
        if (j0) {   /* exact in every mode */
            printf("%-34s %lld values not 0 %31s\n", "  (slot 0: not computed, 0)",
                   (long long)nonzero0, nonzero0 ? "FAIL" : "ok");
            failures += nonzero0 != 0;
        }
        free(ref);
    }
    free(mine);
    if (dfl_st_find(f, "dbg.ce") && dfl_st_find(f, "dbg.weight_mask")) {
        const dfl_st_tensor *t = need(f, "dbg.ce");
        float *ref = get_f32(f, "dbg.ce", NULL), *w0 = get_f32(f, "dbg.weight_mask", NULL);
        float *ce = malloc(Q * 4), *w = malloc(Q * 4);
        dfl_draft_activation(m, DFL_DRAFT_ACT_CE, 0, ce, Q, &e);
        dfl_draft_activation(m, DFL_DRAFT_ACT_WEIGHT, 0, w, Q, &e);
        double worst = 0;
        int64_t b = 0, N = t->shape[1];
        int bad_mask = 0;
        for (int32_t s = 0; s < p->S; s++)
            for (int32_t n = 0; n < p->nanch[s]; n++, b++)
                for (int64_t j = 0; j < bs; j++) {
                    int64_t gi = ((int64_t)s * N + n) * bs + j;
                    bad_mask += (w[b * bs + j] > 0) != (w0[gi] > 0.5f);
                    if (w0[gi] > 0.5f)
                        worst = t_worst(worst, fabs(ce[b * bs + j] - ref[gi]) / fmax(1.0, fabs(ref[gi])));
                }
        report("dbg.weight_mask (scored slots)", bad_mask, 0, "slots differing");
        report2("dbg.ce (scored slots)", worst, 1e-5, BF16_CE_TOL, "relative");
        free(ref), free(w0), free(ce), free(w);
    }
}

int main(int argc, char **argv)
{
    const char *device = "cpu", *file = NULL;
    dfl_dtype act = DFL_DT_INVALID;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--device") && i + 1 < argc)
            device = argv[++i];
        else if (!strcmp(argv[i], "--act") && i + 1 < argc)
            act = dfl_dtype_from_name(argv[++i]);
        else if (!file && argv[i][0] != '-')
            file = argv[i];
        else
            file = NULL, i = argc;
    }
    if (!file || (act != DFL_DT_INVALID && act != DFL_F32 && act != DFL_BF16)) {
        fprintf(stderr, "usage: dflash-golden FILE [--device cpu|cuda[:N]] [--act f32|bf16]\n"
                        "  Default: --device cpu (f32). On CUDA, --act f32 is the exact mode "
                        "(float32 tolerances), --act bf16 the bf16 mode (tolerances x%.0f).\n",
                BF16_TOL_MULT);
        return 1;
    }
    if (strcmp(device, "cpu") && act == DFL_DT_INVALID)
        act = DFL_F32;
    bf16_mode = act == DFL_BF16;
    setvbuf(stdout, NULL, _IOLBF, 0);
    dfl_err e = {0};
    dfl_st_file *f;
    if (dfl_st_open(&f, file, &e)) {
        fprintf(stderr, "dflash-golden: %s\n", e.msg);
        return 2;
    }
    golden_cfg g;
    read_config(f, &g);
    dfl_draft_config *c = &g.c;
    dfl_be *be, *cpu;
    dfl_draft *m;
    if (bf16_mode && dfl_st_find(f, "acc_den"))
        count_slack = golden_count_tol(true, scalar(f, "acc_den"));
    printf("device %s, activations %s%s\n", device, act == DFL_BF16 ? "bf16" : "f32",
           bf16_mode ? " (bf16 tolerances)" : "");
    if (dfl_be_open(&be, device, act, &e) || dfl_be_cpu_open(&cpu, 0, &e) ||
        dfl_draft_open(&m, be, c, &e) ||
        dfl_draft_load_weights(m, f, "", &e) ||
        dfl_draft_set_frozen(m, need(f, "target.embed_tokens.weight"),
                             need(f, "target.lm_head.weight"), &e)) {
        fprintf(stderr, "dflash-golden: %s\n", e.msg);
        return 2;
    }
    packed p;
    load_batch(f, c, &p);
    printf("batch: %d sequences, %lld tokens, %lld blocks\n", p.S, (long long)p.T, (long long)p.B);
    if (dfl_draft_reserve(m, p.T, p.B, 0, &e)) {
        fprintf(stderr, "dflash-golden: %s\n", e.msg);
        return 2;
    }

    /* decay weights */
    uint64_t nb;
    float *decay = get_f32(f, "slot_decay_weight", &nb);
    double dworst = 0;
    for (int j = 1; j < c->block_size && j < (int)nb; j++)
        dworst = t_worst(dworst, fabs(exp(-(double)(j - 1) / c->gamma) - decay[j]) / decay[j]);
    report("slot_decay_weight", dworst, 1e-6, "relative");
    free(decay);

    /* each sequence alone */
    for (int32_t s = 0; s < p.S; s++) {
        char nm[64], what[64];
        snprintf(nm, sizeof nm, "seq%d.loss_num", s);
        if (!dfl_st_find(f, nm))
            continue;
        dfl_draft_input in = make_input(&p, c, s);
        dfl_draft_stats st;
        if (dfl_draft_step(m, &in, false, &e) || dfl_draft_fetch(m, &st, &e)) {
            fprintf(stderr, "dflash-golden: %s\n", e.msg);
            return 2;
        }
        double ln = scalar(f, nm);
        snprintf(nm, sizeof nm, "seq%d.loss_den", s);
        double ld = scalar(f, nm);
        snprintf(nm, sizeof nm, "seq%d.acc_num", s);
        double an = scalar(f, nm);
        snprintf(nm, sizeof nm, "seq%d.acc_den", s);
        double ad = scalar(f, nm);
        snprintf(what, sizeof what, "seq%d loss", s);
        report(what, fabs(st.loss_num / st.loss_den - ln / ld) / (ln / ld), 1e-5, "relative");
        snprintf(what, sizeof what, "seq%d loss_den", s);
        report(what, fabs(st.loss_den - ld) / ld, 1e-5, "relative");
        snprintf(what, sizeof what, "seq%d acc_num/acc_den", s);
        report(what, fabs(st.acc_num - an) + fabs(st.acc_den - ad), 0, "exact counts");
    }

    /* the batch */
    dfl_draft_input in = make_input(&p, c, -1);
    dfl_draft_stats st;
    if (dfl_draft_step(m, &in, true, &e) || dfl_draft_fetch(m, &st, &e)) {
        fprintf(stderr, "dflash-golden: %s\n", e.msg);
        return 2;
    }
    double loss = scalar(f, "loss");
    printf("loss %.7f = %.4f / %.4f (golden %.7f), accuracy %.0f/%.0f (golden %.0f/%.0f)\n",
           st.loss_num / st.loss_den, st.loss_num, st.loss_den, loss, st.acc_num, st.acc_den,
           scalar(f, "acc_num"), scalar(f, "acc_den"));
    report("loss", fabs(st.loss_num / st.loss_den - loss) / loss, 1e-5, "relative");
    report("loss_num", fabs(st.loss_num - scalar(f, "loss_num")) / scalar(f, "loss_num"), 1e-5, "relative");
    report("loss_den", fabs(st.loss_den - scalar(f, "loss_den")) / scalar(f, "loss_den"), 1e-5, "relative");
    report("acc_num/acc_den", fabs(st.acc_num - scalar(f, "acc_num")) +
           fabs(st.acc_den - scalar(f, "acc_den")), 0, "exact counts");
    report2("accuracy", fabs(st.acc_num / st.acc_den - scalar(f, "accuracy")),
            golden_acc_tol(false, scalar(f, "acc_den")), golden_acc_tol(true, scalar(f, "acc_den")),
            "absolute");
    if (dfl_st_find(f, "extra.slot_correct")) {
        float *sc = get_f32(f, "extra.slot_correct", NULL), *sn = get_f32(f, "extra.slot_count", NULL);
        double d = 0;
        for (int j = 0; j < c->block_size; j++)
            d += fabs(st.slot_correct[j] - sc[j]) + fabs(st.slot_count[j] - sn[j]);
        report("extra.slot_correct/slot_count", d, 0, "exact counts");
        printf("acceptance length estimate tau = %.4f over %lld blocks\n",
               st.tau_sum / (double)st.tau_blocks, (long long)st.tau_blocks);
        if (dfl_st_find(f, "dbg.pred_ids") && dfl_st_find(f, "dbg.target_ids")) {
            /* the same from SpecForge's own predictions: 1 + leading correct slots from slot 1 */
            const dfl_st_tensor *pt = need(f, "dbg.pred_ids");
            int32_t *pred = get_i32(f, "dbg.pred_ids", NULL), *lab = get_i32(f, "dbg.target_ids", NULL);
            float *w0 = get_f32(f, "dbg.weight_mask", NULL);
            const int64_t N = pt->shape[1], bs = c->block_size;
            double tsum = 0, tn = 0;
            for (int32_t s = 0; s < p.S; s++)
                for (int32_t n = 0; n < p.nanch[s]; n++) {
                    int64_t base = ((int64_t)s * N + n) * bs;
                    if (!(w0[base + 1] > 0.5f))
                        continue;
                    int k = 0;
                    while (k + 1 < bs && w0[base + k + 1] > 0.5f && pred[base + k + 1] == lab[base + k + 1])
                        k++;
                    tsum += 1 + k;
                    tn += 1;
                }
            report("tau from dbg.pred_ids/target_ids", fabs(tsum - st.tau_sum) + fabs(tn - st.tau_blocks),
                   0, "exact counts");
            free(pred), free(lab), free(w0);
        }
        free(sc), free(sn);
    }
    check_activations(m, f, &p, c);
    check_grads(m, f, "grad.", st.loss_den, "gradients");

    /* AdamW on the golden gradients, then end to end */
    int nt;
    dfl_draft_tensor_list(m, &nt);
    float **mm_ = calloc(nt, sizeof *mm_), **vv_ = calloc(nt, sizeof *vv_);
    /* the optimizer op on the golden gradients runs on the CPU backend (host arrays); the CUDA
     * adamw is compared with the CPU one in gpu-train-ops */
    check_adamw(cpu, m, f, &g, "", "grad.", "after_adamw.", 1, mm_, vv_, "AdamW on the golden grads");
    check_apply(m, f, &g);
    if (dfl_st_find(f, "step2.grad.fc.weight") && dfl_st_find(f, "after_adamw_step2.fc.weight")) {
        /* step 2 from the golden step-1 weights */
        if (dfl_draft_load_weights(m, f, "after_adamw.", &e) || dfl_draft_step(m, &in, true, &e) ||
            dfl_draft_fetch(m, &st, &e)) {
            fprintf(stderr, "dflash-golden: %s\n", e.msg);
            return 2;
        }
        check_grads(m, f, "step2.grad.", st.loss_den, "step 2 gradients");
        check_adamw(cpu, m, f, &g, "after_adamw.", "step2.grad.", "after_adamw_step2.", 2, mm_, vv_,
                    "AdamW step 2 on the golden grads");
    }
    for (int i = 0; i < nt; i++)
        free(mm_[i]), free(vv_[i]);
    free(mm_), free(vv_);
    free(p.lens), free(p.nanch), free(p.ids), free(p.mask), free(p.hidden), free(p.bseq);
    free(p.banchor);
    dfl_draft_close(m);
    dfl_be_close(be);
    dfl_be_close(cpu);
    dfl_st_close(f);
    printf("%s: %d check%s failed\n", failures ? "FAIL" : "PASS", failures, failures == 1 ? "" : "s");
    return failures ? 1 : 0;
}
