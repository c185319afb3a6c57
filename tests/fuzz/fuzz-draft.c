/* fuzz-draft.c: libFuzzer harness for what dfl-draft reads back from a checkpoint: the drafter
 * config.json (dfl_draft_config_from_json, dfl_draft_config_check, dfl_draft_ckpt_config) and
 * the data position of trainer_state.json (dfl_draft_src_restore).
 *
 * The input is a JSON object. As a drafter config: read over fixed defaults, checked, and when
 * accepted written back with dfl_draft_config_to_json and read again, which must give the same
 * config; read from a file (dfl_draft_ckpt_config) it must give the same outcome; its tensor
 * table must be computable. As a trainer state (its "data" member, or the whole object): restored
 * into an input source over two small hidden-state files made once (replay mode), and when the
 * restore is accepted the source is drained: every batch it hands out must be one of the files'.
 * (The rest of trainer_state.json is parsed by a static function of lib/train/draft_train.c, with the
 * typed getters of lib/base/json.c that fuzz-config exercises.) */
#include <stdbool.h>
#include <sys/stat.h>

#include "draft.h"
#include "draft_ckpt.h"
#include "draft_input.h"
#include "draft_rng.h"
#include "frame.h"
#include "fuzz.h"
#include "json.h"

enum { H = 8, NA = 5, NB = 4 };
static const int32_t layers[2] = {1, 2};
static char path_a[512], path_b[512], cfg_dir[512];

static void write_stream(const char *path, int f, int n, bool no_index)
{
    dfl_err e;
    dfl_stream_info si = {.kind = DFL_KIND_HIDDEN, .version_major = DFL_FRAME_MAJOR, .hidden_size = H,
                          .vocab_size = 100000, .n_layers = 2, .layers = {1, 2}, .dtype = DFL_BF16};
    snprintf(si.fingerprint, sizeof si.fingerprint, "fp");
    snprintf(si.producer, sizeof si.producer, "fuzz-draft");
    dfl_writer *w;
    dfl_writer_opts wo = {.no_index = no_index};
    if (dfl_writer_open(&w, path, &si, &wo, &e))
        fz_die("%s", e.msg);
    for (int b = 0; b < n; b++) {
        dfl_batch bt;
        uint64_t T = 3 + (uint64_t)b % 4;
        if (dfl_batch_alloc(&bt, T, 1, 2, H, DFL_BF16, &e))
            fz_die("%s", e.msg);
        ((uint32_t *)bt.seq_lens)[0] = (uint32_t)T;
        for (uint64_t t = 0; t < T; t++) {
            ((int32_t *)bt.input_ids)[t] = f * 1000 + b;
            ((uint8_t *)bt.loss_mask)[t] = 1;
        }
        if (dfl_writer_batch(w, &bt, &e))
            fz_die("%s", e.msg);
        dfl_batch_free(&bt);
    }
    if (dfl_writer_close(w, &e))
        fz_die("%s", e.msg);
}

static void setup(void)
{
    const char *top = fz_scratch_dir();
    snprintf(path_a, sizeof path_a, "%s/a.dfl", top);
    snprintf(path_b, sizeof path_b, "%s/b.dfl", top);
    snprintf(cfg_dir, sizeof cfg_dir, "%s/ckpt", top);
    write_stream(path_a, 1, NA, false);
    write_stream(path_b, 2, NB, true); /* no index: walked at open */
    if (mkdir(cfg_dir, 0755) != 0)
        fz_die("mkdir %s: %s", cfg_dir, strerror(errno));
}

/* What dfl-draft starts from before it reads a config (a small valid drafter). */
static dfl_draft_config defaults(void)
{
    dfl_draft_config c = {.hidden = 32, .vocab = 64, .intermediate = 64, .n_layers = 1, .n_heads = 4,
                          .n_kv = 2, .head_dim = 8, .n_feat = 2, .target_layers = {1, 2},
                          .n_target_layers = 4, .block_size = 8, .mask_token_id = 63, .gamma = 7,
                          .rms_eps = 1e-6, .rope_theta = 1e6, .max_position = 4096,
                          .bos_token_id = -1, .eos_token_id = -1};
    return c;
}

static bool same(const dfl_draft_config *a, const dfl_draft_config *b)
{
    if (a->n_feat != b->n_feat)
        return false;
    for (int i = 0; i < a->n_feat; i++)
        if (a->target_layers[i] != b->target_layers[i])
            return false;
    return a->hidden == b->hidden && a->vocab == b->vocab && a->intermediate == b->intermediate &&
           a->n_layers == b->n_layers && a->n_heads == b->n_heads && a->n_kv == b->n_kv &&
           a->head_dim == b->head_dim && a->n_target_layers == b->n_target_layers &&
           a->block_size == b->block_size && a->mask_token_id == b->mask_token_id &&
           a->gamma == b->gamma && a->rms_eps == b->rms_eps && a->rope_theta == b->rope_theta &&
           a->max_position == b->max_position && a->bos_token_id == b->bos_token_id &&
           a->eos_token_id == b->eos_token_id;
}

static int config_part(const json_t *j, const uint8_t *data, size_t size)
{
    dfl_err e;
    dfl_draft_config c = defaults();
    int rc = dfl_draft_config_from_json(&c, j, "config.json", &e);
    fz_check_err(rc, &e, "dfl_draft_config_from_json");
    if (rc == DFL_OK) {
        rc = dfl_draft_config_check(&c, &e);
        fz_check_err(rc, &e, "dfl_draft_config_check");
    }
    if (rc == DFL_OK) {
        json_t *w = dfl_draft_config_to_json(&c);
        FZ_ASSERT(w != NULL, "to_json");
        dfl_draft_config c2 = defaults();
        int rc2 = dfl_draft_config_from_json(&c2, w, "written", &e);
        FZ_ASSERT(rc2 == DFL_OK && same(&c, &c2), "the written config.json reads back differently: %s",
                  rc2 ? e.msg : "fields differ");
        FZ_ASSERT(dfl_draft_config_check(&c2, &e) == DFL_OK, "the written config fails its check: %s", e.msg);
        json_decref(w);
        dfl_draft_tensor *t = NULL;
        int64_t flat = 0;
        int nt = dfl_draft_tensors(&c, &t, &flat);
        FZ_ASSERT(nt == 3 + 11 * c.n_layers && flat > 0, "%d tensors, flat length %lld", nt, (long long)flat);
        for (int i = 1; i < nt; i++)
            FZ_ASSERT(t[i].offset >= t[i - 1].offset + t[i - 1].numel && t[i].numel > 0, "tensor %s", t[i].name);
        free(t);
    }
    /* from a checkpoint directory: the same outcome up to the check */
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", cfg_dir);
    fz_write_file(path, data, size);
    dfl_draft_config c3 = defaults();
    int rc3 = dfl_draft_ckpt_config(cfg_dir, &c3, &e);
    fz_check_err(rc3, &e, "dfl_draft_ckpt_config");
    if (rc3 == DFL_OK)
        rc3 = dfl_draft_config_check(&c3, &e);
    FZ_ASSERT((rc3 == DFL_OK) == (rc == DFL_OK), "in memory %s, from the file %s", dfl_code_name(rc),
              dfl_code_name(rc3));
    return rc;
}

static void state_part(const json_t *st)
{
    const char *in[2] = {path_a, path_b};
    dfl_draft_src_opts o = {.n_inputs = 2, .inputs = in, .fingerprint = "fp", .hidden = H, .vocab = 100000,
                            .n_layers = 2, .layers = layers, .epochs = 2, .seed = 11, .pool_size = 3,
                            .min_ready = 2};
    dfl_draft_src *s;
    dfl_err e;
    if (dfl_draft_src_open(&s, &o, &e))
        fz_die("open: %s", e.msg);
    int rc = dfl_draft_src_restore(s, st, &e);
    fz_check_err(rc, &e, "dfl_draft_src_restore");
    if (rc == DFL_OK) {
        dfl_rng r;
        dfl_rng_seed(&r, 5);
        for (int n = 0; n < 2 * (NA + NB) + 8; n++) {
            const dfl_batch *b;
            double waited;
            rc = dfl_draft_src_next(s, &r, &b, &waited, &e);
            fz_check_err(rc, &e, "dfl_draft_src_next");
            if (rc || !b)
                break;
            int32_t id = b->input_ids[0];
            FZ_ASSERT((id / 1000 == 1 && id % 1000 < NA) || (id / 1000 == 2 && id % 1000 < NB),
                      "a batch that is in neither file: %d", id);
            fz_touch(b->layers[0], b->n_tokens * H * 2);
        }
    } else {
        FZ_ASSERT(rc == DFL_EDATA || rc == DFL_EMISMATCH, "restore: code %s: %s", dfl_code_name(rc), e.msg);
    }
    dfl_draft_src_close(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!path_a[0])
        setup();
    json_t *j;
    dfl_err e;
    if (dfl_json_parse((const char *)data, size, &j, "in", &e))
        return 0;
    config_part(j, data, size);
    if (json_is_object(j)) {
        const json_t *d = json_object_get(j, "data");
        state_part(d ? d : j);
    }
    json_decref(j);
    return 0;
}
