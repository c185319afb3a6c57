/* draft_train.c: the dfl-draft training run (see draft_train.h and dfl-draft(1)). */
#include "draft_train.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "dist.h"
#include "draft.h"
#include "draft_ckpt.h"
#include "draft_data.h"
#include "draft_input.h"
#include "draft_rng.h"
#include "hfmodel.h"
#include "json.h"
#include "log.h"
#include "safetensors.h"
#include "util.h"

#define STATE_FORMAT "dfl-draft-state-1"

void dfl_draft_train_defaults(dfl_draft_train_opts *o)
{
    memset(o, 0, sizeof *o);
    o->mask_token_id = -1;
    o->num_anchors = 512;
    o->lr = 6e-4;
    o->beta1 = 0.9;
    o->beta2 = 0.999;
    o->eps = 1e-8;
    o->weight_decay = 0;
    o->max_grad_norm = 1.0;
    o->warmup_ratio = 0.04;
    o->epochs = 1;
    o->pool_size = 8;
    o->min_ready = 4;
    o->save_every = 1000;
    o->keep = 0;
    o->save_dtype = DFL_BF16;
    o->log_every = 10;
    o->max_bad_steps = 10;
    o->seed = 0;
    o->init_std = 0.02;
    o->dist_timeout = 600;
}

/* Everything one run holds. */
typedef struct run {
    const dfl_draft_train_opts *o;
    dfl_hf_drafter_target tc;    /* what the drafter needs of the target */
    char fingerprint[33];
    dfl_st_model *tm;
    dfl_be *be;
    dfl_draft_config c;
    dfl_draft *m;
    dfl_draft_src *src;
    char *resume_dir;
    json_t *state;               /* from the checkpoint */
    /* trainer state */
    uint64_t seed;
    int64_t step, adam_t, total, warmup;
    int64_t bad_run, skipped, tokens_seen, empty_batches;
    dfl_rng rng;
    /* blocks */
    int32_t *bseq, *banchor, *scratch;
    int64_t cap_blocks, cap_len;
    /* metrics over the log interval */
    int metrics_fd;              /* RUN/metrics.jsonl, appending; -1 when not open */
    uint64_t metrics_size;       /* its size after the last whole line */
    bool metrics_failed;         /* a write failed: warned, no more lines */
    double m_num, m_den, m_acc, m_accden, m_tau, m_wait, m_t0;
    int64_t m_taublocks, m_tokens, m_steps;
    double m_slot_ok[DFL_DRAFT_MAX_BS], m_slot_n[DFL_DRAFT_MAX_BS];
    double last_norm, last_lr;
    int64_t last_saved;
    /* steps enqueued and not read yet (dfl_draft_post'ed), oldest first */
    struct pend {
        int64_t tokens;
        double lr, waited, prep;
    } pend[2];
    int npend;
    /* --profile over the log window */
    double p_wait, p_prep, p_gpu;
    int64_t p_steps, p_gpu_steps, p_first;
    double k_gpu, k_steps;       /* over the whole run: GPU step ms, steps */
    uint64_t p_syncs, p_evwaits;   /* the counters at the window's start */
    pid_t *children;
    int n_children;
    /* data parallel: this rank's part of the checkpoint's state ("ranks"), its inputs */
    dfl_dist *dist;
    int rank, world;
    json_t *ranks_state;         /* rank 0 while saving: every rank's rng and data position */
    char **rank_inputs;
    int lock_fd;                 /* rank 0: the lock of the run directory; -1 when none */
} run;

/* ---- target and drafter configuration ------------------------------------------------------ */

/* The target's config (any family dfl_hf_drafter_target_parse reads, Qwen3.5/3.6 included), its
 * fingerprint (dfl_hf_fingerprint's: the raw config and the tensor table) and its weights. */
static int open_target(run *r, dfl_err *e)
{
    const char *dir = r->o->target_dir;
    int rc = dfl_hf_drafter_target_load(dir, &r->tc, r->fingerprint, e);
    if (!rc)
        rc = dfl_st_model_open(&r->tm, dir, e);
    return rc;
}

/* --heads, --kv-heads, --head-dim, --intermediate-size, --layer-types, --sliding-window over the
 * config (on resume a difference from the checkpoint is refused by dfl_draft_ckpt_load). */
static int drafter_shape_opts(const dfl_draft_train_opts *o, dfl_draft_config *c, dfl_err *e)
{
    if (o->heads > 0)
        c->n_heads = o->heads;
    if (o->kv_heads > 0)
        c->n_kv = o->kv_heads;
    if (o->head_dim > 0)
        c->head_dim = o->head_dim;
    if (o->intermediate > 0)
        c->intermediate = o->intermediate;
    int rc;
    if (o->layer_types &&
        (rc = dfl_draft_parse_layer_types(c, o->layer_types, c->n_layers, "--layer-types", e)))
        return rc;
    if (o->sliding_window > 0)
        c->sliding_window = o->sliding_window;
    if (dfl_draft_n_sliding(c) > 0 && c->sliding_window < 1)
        return dfl_fail(e, DFL_EUSAGE, "--layer-types has sliding layers: --sliding-window is "
                        "required");
    if (o->sliding_window > 0 && dfl_draft_n_sliding(c) == 0)
        return dfl_fail(e, DFL_EUSAGE, "--sliding-window %lld: no drafter layer is sliding (give "
                        "--layer-types, e.g. sliding:4,full:1)", (long long)o->sliding_window);
    return DFL_OK;
}

/* Drafter config: target sizes, then the checkpoint's or --config's config.json, then flags. */
static int make_config(run *r, const int32_t *layers, int n_layers, dfl_err *e)
{
    const dfl_draft_train_opts *o = r->o;
    dfl_draft_config *c = &r->c;
    memset(c, 0, sizeof *c);
    c->hidden = r->tc.hidden_size;
    c->vocab = r->tc.vocab_size;
    c->intermediate = r->tc.intermediate_size;
    c->n_heads = (int)r->tc.n_heads;
    c->n_kv = (int)r->tc.n_kv_heads;
    c->head_dim = (int)r->tc.head_dim;
    c->rms_eps = r->tc.rms_norm_eps;
    c->rope_theta = r->tc.rope_theta;
    c->n_target_layers = (int)r->tc.n_layers;
    c->block_size = 16;
    c->gamma = 7.0;
    c->mask_token_id = -1;
    c->bos_token_id = c->eos_token_id = -1;
    c->max_position = r->tc.max_position > 0 ? r->tc.max_position : 40960;
    c->bos_token_id = r->tc.bos_token_id;
    c->eos_token_id = r->tc.eos_token_id;
    c->n_feat = 0;
    int rc = DFL_OK;
    if (r->resume_dir) {
        rc = dfl_draft_ckpt_config(r->resume_dir, c, e);
    } else if (o->config_path) {
        json_t *j;
        rc = dfl_json_load_file(o->config_path, &j, e);
        if (!rc) {
            rc = dfl_draft_config_from_json(c, j, o->config_path, e);
            json_decref(j);
        }
    }
    if (rc)
        return rc;
    if (c->n_feat == 0) {   /* the layers the streams carry */
        c->n_feat = n_layers;
        memcpy(c->target_layers, layers, (size_t)n_layers * sizeof *layers);
    }
    if (!r->resume_dir && !o->config_path)
        c->n_layers = o->draft_layers > 0 ? o->draft_layers : o->layer_types ? 0 : c->n_feat;
    else if (o->draft_layers > 0 && o->draft_layers != c->n_layers)
        return dfl_fail(e, DFL_EUSAGE, "--draft-layers %d: the %s has %d layers", o->draft_layers,
                        r->resume_dir ? "checkpoint" : "--config", c->n_layers);
    if ((rc = drafter_shape_opts(o, c, e)))
        return rc;
    if (o->block_size > 0)
        c->block_size = o->block_size;
    if (o->gamma > 0)
        c->gamma = o->gamma;
    if (o->mask_token_id >= 0)
        c->mask_token_id = (int32_t)o->mask_token_id;
    if (c->mask_token_id < 0)
        return dfl_fail(e, DFL_EUSAGE, "--mask-token-id is required (no --config gives "
                        "dflash_config.mask_token_id)");
    if (c->intermediate <= 0 && r->tc.intermediate_size <= 0)
        return dfl_fail(e, DFL_EUSAGE, "the target (model_type '%s') has no intermediate_size (its "
                        "MLPs are mixtures of experts): give the drafter's width with "
                        "--intermediate-size N or --config", r->tc.model_type);
    if (c->hidden != r->tc.hidden_size || c->vocab != r->tc.vocab_size)
        return dfl_fail(e, DFL_EMISMATCH, "the drafter's hidden size %lld / vocabulary %lld differ "
                        "from the target's %lld / %lld", (long long)c->hidden, (long long)c->vocab,
                        (long long)r->tc.hidden_size, (long long)r->tc.vocab_size);
    return dfl_draft_config_check(c, e);
}

static int load_frozen(run *r, dfl_err *e)
{
    int64_t shape[2] = {r->tc.vocab_size, r->tc.hidden_size};
    const dfl_st_tensor *emb, *lm = NULL;
    double t0 = dfl_now();
    int rc = dfl_st_model_get(r->tm, r->tc.embed_name, 2, shape, &emb, e);
    if (rc)
        return rc;
    if (!r->tc.tie_word_embeddings || dfl_st_model_find(r->tm, r->tc.lm_head_name)) {
        if ((rc = dfl_st_model_get(r->tm, r->tc.lm_head_name, 2, shape, &lm, e)))
            return rc;
    }
    if ((rc = dfl_draft_set_frozen(r->m, emb, lm, e)))
        return rc;
    dfl_verbose("target embedding%s loaded in %.1f s", lm ? " and LM head" : "", dfl_now() - t0);
    return DFL_OK;
}

/* ---- trainer state ------------------------------------------------------------------------- */

static json_t *make_state(run *r)
{
    json_t *j = json_object(), *rng = json_array();
    char hex[24];
    for (int i = 0; i < 4; i++) {
        snprintf(hex, sizeof hex, "%016llx", (unsigned long long)r->rng.s[i]);
        json_array_append_new(rng, json_string(hex));
    }
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)r->seed);
    json_object_set_new(j, "format", json_string(STATE_FORMAT));
    json_object_set_new(j, "step", json_integer(r->step));
    json_object_set_new(j, "adam_step", json_integer(r->adam_t));
    json_object_set_new(j, "seed", json_string(hex));
    json_object_set_new(j, "rng", rng);
    json_object_set_new(j, "bad_steps_in_a_row", json_integer(r->bad_run));
    json_object_set_new(j, "skipped_steps", json_integer(r->skipped));
    json_object_set_new(j, "tokens_seen", json_integer(r->tokens_seen));
    json_object_set_new(j, "empty_batches", json_integer(r->empty_batches));
    json_t *sch = json_object();
    json_object_set_new(sch, "lr", json_real(r->o->lr));
    json_object_set_new(sch, "warmup_steps", json_integer(r->warmup));
    json_object_set_new(sch, "total_steps", json_integer(r->total));
    json_object_set_new(sch, "next_lr", json_real(dfl_draft_lr(r->o->lr, r->step + 1, r->warmup, r->total)));
    json_object_set_new(j, "schedule", sch);
    json_object_set_new(j, "data", dfl_draft_src_state(r->src));
    if (r->world > 1) {   /* each rank's generator and input position, for its resume */
        json_object_set_new(j, "world_size", json_integer(r->world));
        if (r->ranks_state)
            json_object_set(j, "ranks", r->ranks_state);
    }
    return j;
}

/* This rank's part of the state: its anchor generator and input position. */
static json_t *rank_state(run *r)
{
    json_t *full = make_state(r), *j = json_object();
    json_object_set_new(j, "rank", json_integer(r->rank));
    json_object_set(j, "rng", json_object_get(full, "rng"));
    json_object_set(j, "data", json_object_get(full, "data"));
    json_decref(full);
    return j;
}

static int parse_hex64(const json_t *v, uint64_t *out)
{
    const char *s = json_string_value(v);
    char *end;
    if (!s || !*s)
        return -1;
    errno = 0;
    unsigned long long x = strtoull(s, &end, 16);
    if (*end || errno)
        return -1;
    *out = x;
    return 0;
}

static int restore_state(run *r, dfl_err *e)
{
    const json_t *j = r->state;
    const char *what = "trainer_state.json", *fmt = NULL;
    int rc = dfl_json_str(j, "format", true, &fmt, what, e);
    if (rc)
        return rc;
    if (strcmp(fmt, STATE_FORMAT) != 0)
        return dfl_fail(e, DFL_EUNSUP, "%s: format '%s' (this dfl-draft reads %s)", what, fmt,
                        STATE_FORMAT);
    if ((rc = dfl_json_int(j, "step", true, &r->step, what, e)) ||
        (rc = dfl_json_int(j, "adam_step", true, &r->adam_t, what, e)) ||
        (rc = dfl_json_int(j, "bad_steps_in_a_row", false, &r->bad_run, what, e)) ||
        (rc = dfl_json_int(j, "skipped_steps", false, &r->skipped, what, e)) ||
        (rc = dfl_json_int(j, "tokens_seen", false, &r->tokens_seen, what, e)) ||
        (rc = dfl_json_int(j, "empty_batches", false, &r->empty_batches, what, e)))
        return rc;
    const json_t *rng = json_object_get(j, "rng");
    if (parse_hex64(json_object_get(j, "seed"), &r->seed) || !json_is_array(rng) ||
        json_array_size(rng) != 4)
        return dfl_fail(e, DFL_EDATA, "%s: 'seed' and 'rng' must be hex strings", what);
    for (int i = 0; i < 4; i++)
        if (parse_hex64(json_array_get(rng, (size_t)i), &r->rng.s[i]))
            return dfl_fail(e, DFL_EDATA, "%s: 'rng' must be 4 hex strings", what);
    if (r->step < 0 || r->adam_t < 0 || r->adam_t > r->step)
        return dfl_fail(e, DFL_EDATA, "%s: step %lld, adam_step %lld", what, (long long)r->step,
                        (long long)r->adam_t);
    int64_t w = 1;
    if ((rc = dfl_json_int(j, "world_size", false, &w, what, e)))
        return rc;
    if (w != r->world)
        return dfl_fail(e, DFL_EUSAGE, "%s: the checkpoint was written by %lld rank%s; resume it with "
                        "as many (this is rank %d of %d): each rank continues its own inputs", what,
                        (long long)w, w == 1 ? "" : "s", r->rank, r->world);
    if (r->world > 1) {   /* this rank's generator and input position */
        const json_t *mine = json_array_get(json_object_get(j, "ranks"), (size_t)r->rank);
        const json_t *mrng = json_object_get(mine, "rng");
        if (!json_is_array(mrng) || json_array_size(mrng) != 4)
            return dfl_fail(e, DFL_EDATA, "%s: no state of rank %d in 'ranks'", what, r->rank);
        for (int i = 0; i < 4; i++)
            if (parse_hex64(json_array_get(mrng, (size_t)i), &r->rng.s[i]))
                return dfl_fail(e, DFL_EDATA, "%s: 'ranks[%d].rng' must be 4 hex strings", what, r->rank);
        json_object_set(r->state, "data", json_object_get(mine, "data"));
    }
    /* the step must be the one the directory is named for (its real name: latest is a link) */
    char *real = realpath(r->resume_dir, NULL);
    const char *base = real ? strrchr(real, '/') : NULL;
    long long named;
    int len = -1;
    base = base ? base + 1 : real;
    if (base && sscanf(base, "step-%lld%n", &named, &len) == 1 && len == (int)strlen(base) &&
        named != r->step)
        rc = dfl_fail(e, DFL_EDATA, "%s: %s says step %lld, but the checkpoint is %s: refusing to "
                      "resume from it (an edited or misplaced trainer state)", r->resume_dir, what,
                      (long long)r->step, base);
    free(real);
    return rc;
}

/* ---- checkpoints --------------------------------------------------------------------------- */

/* Collects the --on-save commands that ended (all of them with wait_all, saying so when one has
 * not ended after a second: a hook that hangs must not look like dfl-draft hanging). */
static void reap_some(run *r, bool block)
{
    for (int i = 0; i < r->n_children;) {
        int st;
        pid_t p = waitpid(r->children[i], &st, block ? 0 : WNOHANG);
        if (p == 0) {
            i++;
            continue;
        }
        if (p > 0 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0))
            dfl_warn("--on-save command (pid %d) failed (%s %d)", (int)p,
                     WIFEXITED(st) ? "exit status" : "signal",
                     WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
        r->children[i] = r->children[--r->n_children];
    }
}

static void reap_children(run *r, bool wait_all)
{
    reap_some(r, false);
    for (int t = 0; wait_all && r->n_children > 0 && t < 20; t++) {
        usleep(50000);
        reap_some(r, false);
    }
    if (!wait_all || r->n_children == 0)
        return;
    char pids[128] = "";
    size_t k = 0;
    for (int i = 0; i < r->n_children && k < sizeof pids - 16; i++)
        k += (size_t)snprintf(pids + k, sizeof pids - k, "%s%d", i ? ", " : "", (int)r->children[i]);
    dfl_info("waiting for %d --on-save command%s to end (pid %s)", r->n_children,
             r->n_children > 1 ? "s" : "", pids);
    reap_some(r, true);
}

static void run_on_save(run *r, const char *dir)
{
    pid_t *nc = realloc(r->children, (size_t)(r->n_children + 1) * sizeof *nc);
    if (!nc)
        return;
    r->children = nc;
    pid_t p = fork();
    if (p == 0) {
        int fd = open("/dev/null", O_RDONLY);
        if (fd >= 0) {
            dup2(fd, 0);
            close(fd);
        }
        dup2(2, 1);   /* the hook's output goes to stderr: stdout carries data only */
        size_t n = strlen(r->o->on_save) + 8;
        char *script = malloc(n);
        if (!script)
            _exit(127);
        snprintf(script, n, "%s \"$1\"", r->o->on_save);   /* CMD "$1", $1 = the checkpoint */
        setenv("DFL_CHECKPOINT", dir, 1);
        execl("/bin/sh", "sh", "-c", script, "dfl-draft-on-save", dir, (char *)NULL);
        _exit(127);
    }
    if (p > 0)
        r->children[r->n_children++] = p;
    else
        dfl_warn("--on-save: cannot fork: %s", strerror(errno));
}

static int save_rank0(run *r, dfl_err *e)
{
    json_t *st = make_state(r);
    char *dir = NULL;
    double t0 = dfl_now();
    int rc = dfl_draft_ckpt_save(r->m, r->o->run_dir, r->step, st, r->o->save_dtype, &dir, e);
    json_decref(st);
    if (rc == DFL_ENAN)   /* the message says which value and that nothing was written */
        return rc;
    if (rc) {   /* a full disk, a file-size limit, an I/O error: say what is still there */
        if (r->last_saved >= 0)
            return dfl_err_prefix(e, "checkpoint of step %lld not written (the last one, step %lld, "
                                  "is intact): ", (long long)r->step, (long long)r->last_saved);
        return dfl_err_prefix(e, "checkpoint of step %lld not written: ", (long long)r->step);
    }
    dfl_verbose("checkpoint %s (written in %.1f s)", dir, dfl_now() - t0);
    if (r->o->keep > 0 && (rc = dfl_draft_ckpt_prune(r->o->run_dir, r->o->keep, e)))
        dfl_warn("--keep: %s", e->msg);
    if (r->o->on_save)
        run_on_save(r, dir);
    free(dir);
    return DFL_OK;
}

/* A checkpoint (collective): rank 0 gathers every rank's state and writes it; the others wait
 * for the outcome, so that no rank goes on before the checkpoint is complete, and all fail
 * when rank 0 could not write it. */
static int save(run *r, dfl_err *e)
{
    if (r->last_saved == r->step)   /* this step is saved already (the end after --save-every) */
        return DFL_OK;
    int rc = DFL_OK;
    if (r->world > 1) {
        json_t *mine = rank_state(r);
        char *text = dfl_json_dump(mine, 0);
        json_decref(mine);
        void **parts = NULL;
        size_t *lens = NULL;
        rc = text ? dfl_dist_gather(r->dist, text, strlen(text), &parts, &lens, e)
                  : dfl_fail(e, DFL_ENOMEM, "out of memory");
        free(text);
        if (rc)
            return rc;
        if (parts) {
            r->ranks_state = json_array();
            for (int k = 0; k < r->world; k++) {
                json_error_t je;
                json_t *p = json_loadb(parts[k], lens[k], 0, &je);
                json_array_append_new(r->ranks_state, p ? p : json_null());
                free(parts[k]);
            }
            free(parts);
            free(lens);
        }
    }
    if (r->rank == 0)
        rc = save_rank0(r, e);
    json_decref(r->ranks_state);
    r->ranks_state = NULL;
    if (r->world > 1) {   /* rank 0's outcome to all: the barrier after the checkpoint */
        uint8_t out[4 + sizeof e->msg] = {0};
        if (r->rank == 0) {
            out[0] = (uint8_t)rc;
            if (rc)
                snprintf((char *)out + 4, sizeof e->msg, "%s", e->msg);
        }
        int brc = dfl_dist_bcast(r->dist, out, sizeof out, e);
        if (brc)
            return brc;
        if (r->rank != 0 && out[0])
            rc = dfl_fail(e, out[0], "rank 0 did not write the checkpoint of step %lld: %.900s",
                          (long long)r->step, (char *)out + 4);
    }
    if (!rc)
        r->last_saved = r->step;
    return rc;
}

/* ---- metrics ------------------------------------------------------------------------------- */

static void metrics_reset(run *r)
{
    r->m_num = r->m_den = r->m_acc = r->m_accden = r->m_tau = r->m_wait = 0;
    r->m_taublocks = r->m_tokens = r->m_steps = 0;
    memset(r->m_slot_ok, 0, sizeof r->m_slot_ok);
    memset(r->m_slot_n, 0, sizeof r->m_slot_n);
    r->m_t0 = dfl_now();
}

static void metrics_add(run *r, const dfl_draft_stats *st, double waited)
{
    r->m_wait += waited;
    r->m_tokens += st->tokens;
    r->m_steps++;
    if (st->skipped)
        return;
    r->m_num += st->loss_num;
    r->m_den += st->loss_den;
    r->m_acc += st->acc_num;
    r->m_accden += st->acc_den;
    r->m_tau += st->tau_sum;
    r->m_taublocks += st->tau_blocks;
    for (int j = 0; j < st->bs; j++) {
        r->m_slot_ok[j] += st->slot_correct[j];
        r->m_slot_n[j] += st->slot_count[j];
    }
}

/* JSON number or null (non-finite) */
static json_t *num(double x) { return isfinite(x) ? json_real(x) : json_null(); }

static void metrics_write(run *r)
{
    if (r->rank != 0) {   /* the sums are global: rank 0 writes them */
        metrics_reset(r);
        return;
    }
    double dt = dfl_now() - r->m_t0;
    double loss = r->m_den > 0 ? r->m_num / r->m_den : NAN;
    double acc = r->m_accden > 0 ? r->m_acc / r->m_accden : NAN;
    double tau = r->m_taublocks > 0 ? r->m_tau / (double)r->m_taublocks : NAN;
    double tps = dt > 0 ? (double)r->m_tokens / dt : 0;
    json_t *j = json_object(), *slots = json_array();
    for (int s = 1; s < r->c.block_size; s++)
        json_array_append_new(slots, num(r->m_slot_n[s] > 0 ? r->m_slot_ok[s] / r->m_slot_n[s] : NAN));
    json_object_set_new(j, "step", json_integer(r->step));
    json_object_set_new(j, "loss", num(loss));
    json_object_set_new(j, "accuracy", num(acc));
    json_object_set_new(j, "acc_per_slot", slots);
    json_object_set_new(j, "tau", num(tau));
    json_object_set_new(j, "lr", num(r->last_lr));
    json_object_set_new(j, "grad_norm", num(r->last_norm));
    json_object_set_new(j, "tokens_per_s", num(tps));
    json_object_set_new(j, "wait_s", num(r->m_wait));
    json_object_set_new(j, "skipped_steps", json_integer(r->skipped));
    json_object_set_new(j, "tokens", json_integer(r->tokens_seen));
    char *line = dfl_json_dump(j, 0), *nl = NULL;
    if (line && (nl = malloc(strlen(line) + 2)))
        sprintf(nl, "%s\n", line);
    if (nl && r->metrics_fd >= 0 && !r->metrics_failed) {   /* one write per line */
        dfl_err we = {0};
        char *p = dfl_path_join(r->o->run_dir, "metrics.jsonl");
        size_t n = strlen(nl);
        if (dfl_write_all(r->metrics_fd, nl, n, p ? p : "metrics.jsonl", &we) == DFL_OK) {
            r->metrics_size += n;
        } else {   /* a full disk: no partial line stays; say so once, training goes on */
            r->metrics_failed = true;
            if (ftruncate(r->metrics_fd, (off_t)r->metrics_size) != 0)
                dfl_verbose("metrics.jsonl: cannot cut a partial line: %s", strerror(errno));
            dfl_warn("%s: metrics lines from step %lld on are lost", we.msg, (long long)r->step);
        }
        free(p);
    }
    free(nl);
    free(line);
    json_decref(j);
    dfl_progress("step %lld/%lld  loss %.4f  acc %.3f  tau %.3f  lr %.3g  |g| %.3g  %.0f tok/s  "
                 "waited %.1fs%s", (long long)r->step, (long long)r->total, loss, acc, tau,
                 r->last_lr, r->last_norm, tps, r->m_wait,
                 r->skipped ? "  (skipped steps)" : "");
    metrics_reset(r);
}

/* Opens RUN/metrics.jsonl for appending; on resume drops the lines of steps after the
 * checkpoint (a run that went further before it was stopped). */
static int open_metrics(run *r, dfl_err *e)
{
    char *p = dfl_path_join(r->o->run_dir, "metrics.jsonl");
    if (!p)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    if (r->resume_dir) {
        char *buf = NULL;
        size_t len = 0;
        if (access(p, F_OK) == 0 && dfl_read_file(p, (size_t)1 << 30, &buf, &len, NULL) == 0) {
            size_t keep = 0;
            for (size_t i = 0; i < len;) {
                char *nl = memchr(buf + i, '\n', len - i);
                size_t end = nl ? (size_t)(nl - buf) + 1 : len;
                long long s = -1;
                const char *k = strstr(buf + i, "\"step\":");
                if (k && k < buf + end)
                    s = strtoll(k + 7, NULL, 10);
                if (s < 0 || s > r->step)
                    break;
                keep = end;
                i = end;
            }
            int rc = dfl_write_file_atomic(p, buf, keep, e);
            free(buf);
            if (rc) {
                free(p);
                return rc;
            }
        }
    }
    r->metrics_fd = open(p, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
    int err = errno;
    struct stat sb;
    if (r->metrics_fd >= 0 && fstat(r->metrics_fd, &sb) == 0)
        r->metrics_size = (uint64_t)sb.st_size;
    if (r->metrics_fd < 0) {
        int rc = dfl_fail_errno(e, DFL_EIO, err, "%s: cannot open", p);
        free(p);
        return rc;
    }
    free(p);
    return DFL_OK;
}

/* ---- the loop ------------------------------------------------------------------------------ */

static int grow_blocks(run *r, int64_t blocks, int64_t max_len, dfl_err *e)
{
    if (blocks > r->cap_blocks) {
        int32_t *a = realloc(r->bseq, (size_t)blocks * 4), *b = a ? realloc(r->banchor, (size_t)blocks * 4) : NULL;
        if (a)
            r->bseq = a;
        if (b)
            r->banchor = b;
        if (!a || !b)
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        r->cap_blocks = blocks;
    }
    if (max_len > r->cap_len) {
        int32_t *s = realloc(r->scratch, (size_t)max_len * 4);
        if (!s)
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        r->scratch = s;
        r->cap_len = max_len;
    }
    return DFL_OK;
}

static void profile_reset(run *r)
{
    r->p_wait = r->p_prep = r->p_gpu = 0;
    r->p_steps = r->p_gpu_steps = 0;
    r->p_first = r->step + 1;
    dfl_draft_host_waits(r->m, &r->p_syncs, &r->p_evwaits);
}

/* --profile: one line per log window. syncs: host waits that drained a stream (the GPU idles
 * after them); event waits: the host waited for a step that was still running, with later work
 * queued (the GPU is the bottleneck, as it should be). */
static void profile_write(run *r)
{
    if (!r->o->profile || r->p_steps == 0)
        return;
    uint64_t syncs, evw;
    dfl_draft_host_waits(r->m, &syncs, &evw);
    double n = (double)r->p_steps;
    char gpu[48] = "n/a";
    if (r->p_gpu_steps > 0)
        snprintf(gpu, sizeof gpu, "%.3f ms", r->p_gpu / (double)r->p_gpu_steps);
    dfl_info("profile: steps %lld-%lld: input wait %.3f ms, host prep %.3f ms, GPU step %s per "
             "step; host syncs %llu (%.2f per step), event waits %llu", (long long)r->p_first,
             (long long)r->step, 1e3 * r->p_wait / n, 1e3 * r->p_prep / n, gpu,
             (unsigned long long)(syncs - r->p_syncs), (double)(syncs - r->p_syncs) / n,
             (unsigned long long)(evw - r->p_evwaits));
    profile_reset(r);
}

/* --profile's closing lines: the step's time by kind of work (dfl_draft_prof_read), per step and
 * as shares of the GPU step time measured by the step's own events (on the CPU, of the spans'
 * sum), what no span covers being the rest; then the GEMMs by weight shape, longest first. */
static void profile_kinds(run *r)
{
    if (!r->o->profile || r->k_steps <= 0)
        return;
    dfl_span_sum s;
    dfl_draft_prof_read(r->m, &s);
    double known = 0;
    for (int k = 0; k < DFL_DP_N; k++)
        known += s.seconds[k];
    const double n = r->k_steps, step = r->k_gpu > 0 ? r->k_gpu / 1e3 / n : known / n;
    char line[1400] = "";
    size_t len = 0;
    for (int k = 0; k < DFL_DP_N; k++)
        if (s.calls[k])
            dfl_span_item(line, sizeof line, &len, dfl_draft_prof_kind[k], s.seconds[k] / n,
                          s.flops[k] / n, step, true);
    const double rest = step > known / n ? step - known / n : 0;
    dfl_info("profile: the %s step's %.3f ms by kind, per step over %.0f steps: %s; the rest (gaps "
             "between ops, all-reduce, results) %.3f ms (%.1f%%)%s", r->be->async ? "GPU" : "CPU",
             1e3 * step, n, line, 1e3 * rest, step > 0 ? 100 * rest / step : 0.0,
             s.incomplete ? "; incomplete: a timing event failed" : "");
    if (!s.n_gemm)
        return;
    static const char *const tag[] = {"fwd ", "dx ", "dW "};   /* DFL_DP_TAG_* */
    dfl_span_shapes(&s, tag, NULL, n, step, true, line, sizeof line);
    dfl_info("profile: the GEMMs by weight shape N x K (fwd: the forward, dx: the input gradient, "
             "dW: the weight gradient), per step: %s", line);
}

/* Reads the oldest enqueued step's results and does what follows a step: counts, the
 * non-finite check, metrics, a checkpoint when one is due (the caller drained the pipeline
 * before: save steps are read at once). */
static int finish_step(run *r, dfl_err *e)
{
    const dfl_draft_train_opts *o = r->o;
    dfl_draft_stats st;
    struct pend p = r->pend[0];
    int rc = dfl_draft_collect(r->m, &st, e);
    if (rc)
        return dfl_err_prefix(e, "step %lld: ", (long long)r->step + 1);
    r->pend[0] = r->pend[1];
    r->npend--;
    r->step++;
    r->tokens_seen += p.tokens;
    r->last_lr = p.lr;
    r->last_norm = st.grad_norm;
    r->p_wait += p.waited;
    r->p_prep += p.prep;
    r->p_steps++;
    if (st.gpu_ms >= 0) {
        r->p_gpu += st.gpu_ms;
        r->p_gpu_steps++;
        r->k_gpu += st.gpu_ms;
    }
    r->k_steps++;
    if (st.skipped) {
        r->skipped++;
        r->bad_run++;
        dfl_warn("step %lld: non-finite %s: skipped (no update; %lld in a row)",
                 (long long)r->step, isfinite(st.loss_num) ? "gradient norm" : "loss",
                 (long long)r->bad_run);
        if (o->max_bad_steps > 0 && r->bad_run >= o->max_bad_steps)
            return dfl_fail(e, DFL_ENAN, "%lld non-finite steps in a row (--max-bad-steps %d): "
                            "stopping; the last good checkpoint is step %lld", (long long)r->bad_run,
                            o->max_bad_steps, (long long)r->last_saved);
    } else {
        r->bad_run = 0;
        r->adam_t++;
    }
    st.tokens = p.tokens;   /* over all ranks */
    metrics_add(r, &st, p.waited);
    if (o->log_every > 0 && r->step % o->log_every == 0) {
        metrics_write(r);
        profile_write(r);
    }
    if (o->save_every > 0 && r->step % o->save_every == 0) {
        if (r->npend > 0)   /* cannot happen: save steps drain */
            return dfl_fail(e, DFL_EUSAGE, "step %lld: checkpoint with a step in flight", (long long)r->step);
        if ((rc = save(r, e)))
            return rc;
    }
    reap_children(r, false);
    return DFL_OK;
}

/* Reads every enqueued step (before a checkpoint, a stop, the end). */
static int drain(run *r, dfl_err *e)
{
    int rc = DFL_OK;
    while (r->npend > 0 && !rc)
        rc = finish_step(r, e);
    return rc;
}

/* The input ended before this run took a step (collective: every rank comes here at the same
 * step). When batches were read and none had an anchor, there is nothing to train on: an error
 * naming the inputs, rather than an untrained checkpoint given as the result. */
static int no_anchor_check(run *r, int64_t empty, dfl_err *e)
{
    double n[1] = {(double)empty};   /* over all ranks */
    int rc = dfl_dist_sum_host(r->dist, n, 1, e);
    if (rc || n[0] <= 0)
        return rc;
    char names[512] = "";
    size_t k = 0;
    for (int i = 0; i < r->o->n_inputs && k < sizeof names - 8; i++)
        k += (size_t)snprintf(names + k, sizeof names - k, "%s%s", i ? ", " : "", r->rank_inputs[i]);
    if (k >= sizeof names - 8)
        snprintf(names + sizeof names - 8, 8, ", ...");
    return dfl_fail(e, DFL_EDATA, "%s%s: no valid anchor in any of the %.0f batch%s read%s: an "
                    "anchor is a scored token (loss mask 1) followed by another in the same sequence, and "
                    "every sequence here has one token or no two scored tokens in a row (a loss mask "
                    "like [1, 0]); nothing to train on, no checkpoint written", names,
                    r->world > 1 ? " (and the other ranks' inputs)" : "", n[0],
                    n[0] == 1 ? "" : "es", r->world > 1 ? " by all ranks" : "");
}

/* The loop, pipelined: while the device runs step N, the host reads the next batch, draws its
 * anchors, builds and stages its arrays (uploaded on the copy stream), enqueues step N+1, and
 * then reads step N's results (long done, unless the host is ahead of the GPU). r->step counts
 * the steps read; r->npend (0..2) those enqueued and not read. */
static int train_loop(run *r, dfl_err *e)
{
    const dfl_draft_train_opts *o = r->o;
    dfl_draft_optim opt = {(float)o->beta1, (float)o->beta2, (float)o->eps, (float)o->weight_decay,
                           (float)o->max_grad_norm};
    const float noise_amp = (float)(o->noise_std * sqrt(3.0));   /* U(-a, a) has std a/sqrt(3) */
    uint64_t noise_seed = dfl_hash2(r->seed, 0x4e4f495345ull);
    if (r->rank > 0)   /* each rank its own noise; rank 0 (and a single rank) as before */
        noise_seed = dfl_hash2(noise_seed, (uint64_t)r->rank);
    const bool grows = !r->be->async;   /* the CPU may resize between steps */
    const int64_t step0 = r->step, empty0 = r->empty_batches;   /* where this run started */
    int rc = DFL_OK;
    metrics_reset(r);
    profile_reset(r);
    for (;;) {
        const int64_t next = r->step + r->npend;   /* steps enqueued so far */
        if (next >= r->total)
            break;
        if (o->stop_at > 0 && next >= o->stop_at)
            break;
        double t0 = dfl_now();
        const dfl_batch *b = NULL;
        double waited = 0;
        int64_t nb = 0;
        bool stop = o->stop && *o->stop;
        while (!stop) {   /* this rank's next batch with blocks, or the end of its input */
            /* about to wait for a stream: read the steps in flight first (the GPU is idle
             * anyway), so that the metrics and skip counts of an idle run are up to date */
            if (r->npend > 0 && dfl_draft_src_would_wait(r->src) && (rc = drain(r, e)))
                return rc;
            if ((rc = dfl_draft_src_next(r->src, &r->rng, &b, &waited, e)) == DFL_EINTR)
                stop = true;
            else if (rc)
                return rc;
            if (!b || stop)
                break;
            int64_t maxlen = b->max_len ? b->max_len : (int64_t)b->n_tokens;
            int64_t maxb = dfl_draft_max_blocks((int64_t)b->n_tokens, b->n_seqs, o->num_anchors);
            if ((rc = grow_blocks(r, maxb, maxlen, e)))
                return rc;
            nb = dfl_draft_blocks(b->seq_lens, (int32_t)b->n_seqs, b->loss_mask, o->num_anchors,
                                  &r->rng, r->bseq, r->banchor, r->scratch);
            if (nb > 0)
                break;
            r->empty_batches++;   /* nothing to learn from: no step */
            dfl_verbose("batch %llu has no valid anchor: skipped", (unsigned long long)b->index);
        }
        /* every rank steps, or none: a stop anywhere stops all, the end of any rank's input ends
         * the run (one rank alone: the same, at no cost) */
        double agree[3] = {b && !stop ? 1 : 0, stop ? 1 : 0,
                           b && !stop ? (double)b->n_tokens : 0};
        if ((rc = dfl_dist_sum_host(r->dist, agree, 3, e)))
            return dfl_err_prefix(e, "step %lld: ", (long long)next + 1);
        if (agree[1] > 0)
            return (rc = drain(r, e)) ? rc : DFL_EINTR;
        if (agree[0] < r->world) {
            if ((rc = drain(r, e)))
                return rc;
            if (r->step == step0 && (rc = no_anchor_check(r, r->empty_batches - empty0, e)))
                return rc;
            if (r->world > 1 && b)
                dfl_info("the input of another rank ended after %lld steps", (long long)r->step);
            else
                dfl_info("the input ended after %lld steps", (long long)r->step);
            break;
        }
        const int64_t step_tokens = (int64_t)agree[2];   /* over all ranks */
        int64_t capT, capB;
        dfl_draft_capacity(r->m, &capT, &capB, NULL);
        if ((int64_t)b->n_tokens > capT || nb > capB) {
            if (!grows)
                return dfl_fail(e, DFL_EUSAGE, "batch %llu has %lld tokens and %lld blocks, more than "
                                "the %s workspace was sized for at the start (%lld tokens, %lld "
                                "blocks); rerun with --max-tokens %lld --max-blocks %lld or more",
                                (unsigned long long)b->index, (long long)b->n_tokens, (long long)nb,
                                r->be->name, (long long)capT, (long long)capB,
                                (long long)(capT > (int64_t)b->n_tokens ? capT : (int64_t)b->n_tokens),
                                (long long)(capB > nb ? capB : nb));
            if ((rc = dfl_draft_reserve(r->m, (int64_t)b->n_tokens, nb, 0, e)))
                return rc;
        }
        dfl_draft_input in = {
            .T = (int64_t)b->n_tokens, .S = (int32_t)b->n_seqs, .seq_lens = b->seq_lens,
            .input_ids = b->input_ids, .loss_mask = b->loss_mask, .feat_dt = b->dtype,
            .feat_ld = b->hidden, .n_blocks = (int32_t)nb, .block_seq = r->bseq,
            .block_anchor = r->banchor, .noise_amp = noise_amp,
            .noise_seed = dfl_hash2(noise_seed, (uint64_t)next),
        };
        for (uint32_t j = 0; j < b->n_layers && j < DFL_DRAFT_MAX_FEAT; j++)
            in.feat[j] = b->layers[j];
        const double lr = dfl_draft_lr(o->lr, next + 1, r->warmup, r->total);
        /* t: the updates of the steps read so far; dfl_draft_apply accounts for one in flight */
        if ((rc = dfl_draft_stage(r->m, &in, e)) || (rc = dfl_draft_run(r->m, true, e)) ||
            (rc = dfl_draft_apply(r->m, &opt, (float)lr, r->adam_t + 1, e)) ||
            (rc = dfl_draft_post(r->m, e)))
            return dfl_err_prefix(e, "step %lld: ", (long long)next + 1);
        r->pend[r->npend++] = (struct pend){.tokens = step_tokens, .lr = lr,
                                            .waited = waited, .prep = dfl_now() - t0 - waited};
        /* read the previous step (one late); a checkpoint step, or no pipelining, reads all */
        bool save_due = o->save_every > 0 && (next + 1) % o->save_every == 0;
        if (save_due || o->no_pipeline)
            rc = drain(r, e);
        else if (r->npend > 1)
            rc = finish_step(r, e);
        if (rc)
            return rc;
    }
    if ((rc = drain(r, e)))
        return rc;
    if (r->m_steps > 0) {
        metrics_write(r);
        profile_write(r);
    }
    profile_kinds(r);
    return DFL_OK;
}

/* Most blocks of a batch of T tokens in any number of sequences: max over S of
 * dfl_draft_max_blocks(T, S, A) = min(T - S, S A), largest near S = T / (A + 1). */
static int64_t blocks_bound(int64_t T, int A)
{
    int64_t best = 0, s0 = T / ((int64_t)A + 1);
    for (int64_t s = s0 > 1 ? s0 - 1 : 1; s <= s0 + 2 && s <= T; s++) {
        int64_t b = dfl_draft_max_blocks(T, s, A);
        if (b > best)
            best = b;
    }
    return best > 0 ? best : 1;
}

/* The workspace, before the first batch: for the largest batch of the files (their indexes) and
 * --max-tokens / --max-blocks, whichever is larger. On an asynchronous backend (a GPU) it is sized
 * once: then a warm-up step on that shape, and no device allocation afterwards. The CPU may start
 * from nothing and grow with the batches. */
static int size_workspace(run *r, dfl_err *e)
{
    const dfl_draft_train_opts *o = r->o;
    const bool once = r->be->async;
    int rc = dfl_draft_set_feat_dtype(r->m, dfl_draft_src_dtype(r->src), e);
    if (rc)
        return rc;
    int64_t mt = o->max_tokens, mb = o->max_blocks, ft = 0, fb = 0;
    if (dfl_draft_src_replay(r->src))
        dfl_draft_src_max(r->src, o->num_anchors, &ft, &fb);
    if (mt && !mb)
        mb = blocks_bound(mt, o->num_anchors);
    if (ft > mt)
        mt = ft;
    if (fb > mb)
        mb = fb;
    if (mt <= 0) {
        if (once)
            return dfl_fail(e, DFL_EUSAGE, "--max-tokens is needed with --device %s when an input is "
                            "a stream: the workspace is sized before the first batch (give the most "
                            "tokens a batch will have; --max-blocks too, to size it closer)",
                            r->be->name);
        return DFL_OK;
    }
    if ((rc = dfl_draft_reserve(r->m, mt, mb, 0, e)))
        return rc;
    uint64_t bytes;
    char b1[32];
    dfl_draft_capacity(r->m, &mt, &mb, &bytes);
    dfl_verbose("drafter workspace for %lld tokens, %lld blocks: %s on %s", (long long)mt,
                (long long)mb, dfl_fmt_bytes((double)bytes, b1, sizeof b1), r->be->name);
    if (!once)
        return DFL_OK;
    double t0 = dfl_now();
    if ((rc = dfl_draft_warmup(r->m, e)))
        return rc;
    r->be->ops->freeze(r->be, true);   /* no device allocation from here on */
    dfl_verbose("warm-up step on %lld tokens, %lld blocks: %.2f s", (long long)mt, (long long)mb,
                dfl_now() - t0);
    return DFL_OK;
}

/* The inputs of this rank: "{rank}" in a name becomes the rank, so that one command line can
 * give every rank its own streams. */
static int make_rank_inputs(run *r, dfl_err *e)
{
    const dfl_draft_train_opts *o = r->o;
    if (!(r->rank_inputs = calloc((size_t)o->n_inputs, sizeof *r->rank_inputs)))
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    char num[16];
    snprintf(num, sizeof num, "%d", r->rank);
    for (int i = 0; i < o->n_inputs; i++) {
        const char *in = o->inputs[i], *p;
        size_t len = strlen(in) + 1;
        for (p = strstr(in, "{rank}"); p; p = strstr(p + 6, "{rank}"))
            len += strlen(num);
        char *out = malloc(len), *q = out;
        if (!(r->rank_inputs[i] = out))
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        while ((p = strstr(in, "{rank}"))) {
            memcpy(q, in, (size_t)(p - in));
            q += p - in;
            q += sprintf(q, "%s", num);
            in = p + 6;
        }
        strcpy(q, in);
    }
    return DFL_OK;
}

/* The ranks must train the same model on the same schedule: checks what they were given and
 * takes the shortest schedule. */
static int agree_on_start(run *r, dfl_err *e)
{
    int64_t mine[4] = {(int64_t)r->o->seed, dfl_draft_flat_len(r->m), r->step, r->total};
    int64_t *all = malloc((size_t)r->world * sizeof mine);
    if (!all)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    int rc = dfl_dist_allgather(r->dist, mine, sizeof mine, all, e);
    for (int k = 1; !rc && k < r->world; k++) {
        const int64_t *a = all + 4 * k;
        if (a[0] != all[0] || a[1] != all[1] || a[2] != all[2])
            rc = dfl_fail(e, DFL_EUSAGE, "rank %d differs from rank 0 in its %s (%lld vs %lld): "
                          "give every rank the same options and checkpoint", k,
                          a[0] != all[0] ? "--seed" : a[1] != all[1] ? "drafter size" : "resumed step",
                          (long long)(a[0] != all[0] ? a[0] : a[1] != all[1] ? a[1] : a[2]),
                          (long long)(a[0] != all[0] ? all[0] : a[1] != all[1] ? all[1] : all[2]));
        else if (a[3] < r->total) {
            if (r->rank == 0)
                dfl_warn("rank %d has %lld steps of input, rank 0 %lld: the schedule takes %lld", k,
                         (long long)a[3], (long long)mine[3], (long long)a[3]);
            r->total = a[3];
        }
    }
    free(all);
    return rc;
}

int dfl_draft_train(const dfl_draft_train_opts *o, dfl_err *e)
{
    run R = {0}, *r = &R;
    r->o = o;
    r->last_saved = -1;
    r->metrics_fd = -1;
    r->lock_fd = -1;
    int rc;
    if (o->n_inputs < 1)
        return dfl_fail(e, DFL_EUSAGE, "no input (give hidden-state streams, or - for stdin)");
    /* data parallel: this rank joins the others first (rank 0 alone writes the run directory) */
    dfl_dist_env env;
    if ((rc = dfl_dist_env_get(&env, e)))
        return rc;
    dfl_dist_opts dop = {.rank = env.rank, .world = env.world, .local_rank = env.local_rank,
                         .rendezvous = o->rendezvous, .timeout_s = o->dist_timeout};
    if ((rc = dfl_dist_open(&r->dist, &dop, e)))
        return rc;
    r->rank = env.rank;
    r->world = env.world;
    if (r->world > 1)
        dfl_info("rank %d of %d (local rank %d, from %s), joined through %s", r->rank, r->world,
                 env.local_rank, env.from, o->rendezvous);
    if ((rc = make_rank_inputs(r, e)))
        goto out;
    if (r->rank == 0 && ((rc = dfl_mkdir_p(o->run_dir, 0777, e)) ||
                         (rc = dfl_draft_run_lock(o->run_dir, &r->lock_fd, e))))
        goto out;
    if (o->resume && (rc = dfl_draft_ckpt_resolve(o->resume, &r->resume_dir, e)))
        goto out;
    if (r->rank == 0 && (rc = dfl_draft_ckpt_clean(o->run_dir, e)))   /* after --resume refused a temporary */
        goto out;
    if ((rc = open_target(r, e)))
        goto out;
    /* inputs: the drafter's target layers come from the config if it has them, else from the
     * streams; open with the config's ids when known, so that mismatches name the stream */
    dfl_draft_config pre = {0};
    int32_t *want = NULL;
    int nwant = 0;
    if (r->resume_dir)
        rc = dfl_draft_ckpt_config(r->resume_dir, &pre, e);
    else if (o->config_path) {
        json_t *j;
        if (!(rc = dfl_json_load_file(o->config_path, &j, e))) {
            rc = dfl_draft_config_from_json(&pre, j, o->config_path, e);
            json_decref(j);
        }
    }
    if (rc)
        goto out;
    if (pre.n_feat > 0) {
        for (int i = 0; i < pre.n_feat; i++)
            if (pre.target_layers[i] >= r->tc.n_layers) {
                rc = dfl_fail(e, DFL_EDATA, "%s: target layer id %d is outside the target's %lld "
                              "layers", r->resume_dir ? r->resume_dir : o->config_path,
                              pre.target_layers[i], (long long)r->tc.n_layers);
                goto out;
            }
        want = pre.target_layers;
        nwant = pre.n_feat;
    }
    dfl_draft_src_opts so = {
        .n_inputs = o->n_inputs, .inputs = (const char *const *)r->rank_inputs, .fingerprint = r->fingerprint,
        .hidden = r->tc.hidden_size, .vocab = r->tc.vocab_size, .n_layers = nwant, .layers = want,
        .epochs = o->epochs, .seed = o->seed, .pool_size = o->pool_size, .min_ready = o->min_ready,
        .no_verify = o->no_verify, .allow_truncated = o->allow_truncated, .stop = o->stop,
    };
    if ((rc = dfl_draft_src_open(&r->src, &so, e)))
        goto out;
    int nl;
    const int32_t *layers = dfl_draft_src_layers(r->src, &nl);
    if ((rc = make_config(r, layers, nl, e)))
        goto out;
    char dev[32];
    dfl_be_device_for_rank(o->device, env.local_rank, dev, sizeof dev);
    if ((rc = dfl_be_open(&r->be, dev, DFL_DT_INVALID, e)) ||
        (rc = dfl_draft_open(&r->m, r->be, &r->c, e)) || (rc = load_frozen(r, e)) ||
        (rc = dfl_dist_attach(r->dist, r->be, e)))
        goto out;
    dfl_draft_set_comm(r->m, r->dist);
    dfl_info("drafter: %d layers, hidden %lld, %d/%d heads of %d, block %d, gamma %g, mask %d, "
             "target layers from %d streams, %s", r->c.n_layers, (long long)r->c.hidden,
             r->c.n_heads, r->c.n_kv, r->c.head_dim, r->c.block_size, r->c.gamma,
             r->c.mask_token_id, o->n_inputs, dfl_draft_src_replay(r->src) ? "replay" : "stream");
    /* weights and state */
    r->seed = o->seed;
    if (r->resume_dir) {
        if ((rc = dfl_draft_ckpt_load(r->m, r->resume_dir, &r->state, e)) || (rc = restore_state(r, e)))
            goto out;
        const json_t *data = json_object_get(r->state, "data");
        if (data && (rc = dfl_draft_src_restore(r->src, data, e)))
            goto out;
        r->last_saved = r->step;
        dfl_info("resuming from %s at step %lld", r->resume_dir, (long long)r->step);
    } else {
        uint64_t anchor_seed = dfl_hash2(o->seed, 0x414e43484f52ull);
        if (r->rank > 0)   /* each rank its own anchors; rank 0 (and a single rank) as before */
            anchor_seed = dfl_hash2(anchor_seed, (uint64_t)r->rank);
        dfl_rng_seed(&r->rng, anchor_seed);
        double t0 = dfl_now();
        if ((rc = dfl_draft_init_random(r->m, dfl_hash2(o->seed, 0x494e4954ull), o->init_std, e)))
            goto out;
        dfl_verbose("drafter weights initialized in %.1f s", dfl_now() - t0);
    }
    /* schedule */
    if (o->total_steps > 0)
        r->total = o->total_steps;
    else if (dfl_draft_src_replay(r->src))
        r->total = dfl_draft_src_batches(r->src) * (o->epochs > 0 ? o->epochs : 1);
    else {
        rc = dfl_fail(e, DFL_EUSAGE, "--total-steps is needed when an input is a stream (the "
                      "learning-rate schedule needs its length)");
        goto out;
    }
    if (r->world > 1 && (rc = agree_on_start(r, e)))
        goto out;
    r->warmup = (int64_t)ceil(o->warmup_ratio * (double)r->total);
    if (r->state) {
        int64_t t = 0;
        const json_t *sch = json_object_get(r->state, "schedule");
        if (sch && dfl_json_int(sch, "total_steps", false, &t, "", NULL) == 0 && t != r->total)
            dfl_warn("--resume: the schedule now has %lld steps, the checkpoint's had %lld",
                     (long long)r->total, (long long)t);
    }
    dfl_draft_set_tune(r->m, r->o->tune);
    if ((rc = size_workspace(r, e)) ||
        (r->o->profile && (rc = dfl_draft_set_timing(r->m, true, e))))   /* after the warm-up */
        goto out;
    if (r->rank == 0 && (rc = open_metrics(r, e)))
        goto out;
    rc = train_loop(r, e);
    if (rc == DFL_OK || rc == DFL_EINTR) {
        int rs = save(r, e);
        if (rs)
            rc = rs;
        else if (rc == DFL_EINTR)
            dfl_fail(e, DFL_EINTR, "stopped by a signal at step %lld; checkpoint %s/step-%07lld",
                     (long long)r->step, o->run_dir, (long long)r->step);
        else
            dfl_info("done: %lld steps (%lld skipped), checkpoint %s/step-%07lld", (long long)r->step,
                     (long long)r->skipped, o->run_dir, (long long)r->step);
        if (rs == DFL_OK) {   /* every rank is here: end the communicator cleanly */
            dfl_err fe = {0};
            int rf = dfl_dist_finish(r->dist, &fe);
            if (rf && rc == DFL_OK) {
                *e = fe;
                rc = rf;
            }
        }
    }
out:
    dfl_dist_close(r->dist);   /* first: on an error, the other ranks learn of it at once */
    dfl_progress_end();
    if (r->be)
        r->be->ops->freeze(r->be, false);
    reap_children(r, true);
    free(r->children);
    if (r->metrics_fd >= 0)
        close(r->metrics_fd);
    dfl_draft_src_close(r->src);
    dfl_draft_close(r->m);
    dfl_be_close(r->be);
    dfl_st_model_close(r->tm);
    json_decref(r->state);
    free(r->resume_dir);
    free(r->bseq);
    free(r->banchor);
    free(r->scratch);
    for (int i = 0; r->rank_inputs && i < o->n_inputs; i++)
        free(r->rank_inputs[i]);
    free(r->rank_inputs);
    if (r->lock_fd >= 0)   /* last: the directory is left complete */
        close(r->lock_fd);
    return rc;
}
