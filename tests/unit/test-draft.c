/* test-draft.c: the drafter's host-side pieces: the generator, target layer choice, anchors and
 * blocks, the learning-rate schedule, the config.json layout, the tensor table, and checkpoints
 * (round trip, bf16/f32 weights, latest, pruning, refusal of non-finite values), and the rows the
 * LM head runs on. */
#include <dirent.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "draft.h"
#include "draft_ckpt.h"
#include "draft_data.h"
#include "draft_rng.h"
#include "json.h"
#include "safetensors.h"
#include "t.h"
#include "util.h"

static dfl_draft_config tiny(void)
{
    dfl_draft_config c = {0};
    c.hidden = 32, c.vocab = 50, c.intermediate = 48, c.n_layers = 2, c.n_heads = 4, c.n_kv = 2;
    c.head_dim = 8, c.n_feat = 3, c.target_layers[0] = 1, c.target_layers[1] = 2;
    c.target_layers[2] = 3, c.n_target_layers = 6, c.block_size = 4, c.mask_token_id = 49;
    c.gamma = 4, c.rms_eps = 1e-6, c.rope_theta = 1e6, c.max_position = 4096;
    c.bos_token_id = c.eos_token_id = -1;
    return c;
}

static void test_rng(void)
{
    uint64_t x = 0;
    T_CHECK(dfl_splitmix64(&x) == 0xe220a8397b1dcdafull, "splitmix64 reference value");
    dfl_rng r;
    dfl_rng_seed(&r, 0);
    T_CHECK(r.s[0] == 0xe220a8397b1dcdafull && r.s[3] == 0xf88bb8a8724c81ecull, "seeding");
    T_CHECK(dfl_rng_next(&r) == 0x99ec5f36cb75f2b4ull, "xoshiro256** first output");
    T_CHECK(dfl_rng_next(&r) == 0xbf6e1f784956452aull, "xoshiro256** second output");
    int hist[7] = {0};
    for (int i = 0; i < 70000; i++)
        hist[dfl_rng_below(&r, 7)]++;
    for (int i = 0; i < 7; i++)
        T_CHECK(hist[i] > 9500 && hist[i] < 10500, "below(7) bucket %d: %d", i, hist[i]);
    double s = 0, s2 = 0;
    for (int i = 0; i < 100000; i++) {
        double g = dfl_rng_normal(&r);
        s += g;
        s2 += g * g;
    }
    T_NEAR(s / 1e5, 0, 0.02, "normal mean");
    T_NEAR(s2 / 1e5, 1, 0.02, "normal variance");
    T_CHECK(dfl_hash2(1, 2) != dfl_hash2(2, 1) && dfl_hash2(1, 2) == dfl_hash2(1, 2), "hash2");
}

static void test_default_layers(void)
{
    int32_t l[5];
    dfl_draft_default_layers(6, 3, l);
    T_CHECK(l[0] == 1 && l[1] == 2 && l[2] == 3, "T=6 n=3: %d %d %d", l[0], l[1], l[2]);
    dfl_draft_default_layers(36, 5, l);
    T_CHECK(l[0] == 1 && l[1] == 9 && l[2] == 17 && l[3] == 25 && l[4] == 33, "T=36 n=5");
    dfl_draft_default_layers(36, 1, l);
    T_EQ_INT(l[0], 18, "n=1");
}

static void test_blocks(void)
{
    /* seq 0: 10 tokens, mask 1 except positions 4,5; seq 1: 3 tokens all 0; seq 2: 300 all 1 */
    uint32_t lens[3] = {10, 3, 300};
    uint8_t mask[313];
    memset(mask, 1, sizeof mask);
    mask[4] = mask[5] = 0;
    mask[10] = mask[11] = mask[12] = 0;
    int32_t bs[400], ba[400], scratch[300];
    dfl_rng r, r0;
    dfl_rng_seed(&r, 7);
    r0 = r;
    int64_t n = dfl_draft_blocks(lens, 3, mask, 512, &r, bs, ba, scratch);
    /* seq 0 valid: a in 0..8 with m[a] && m[a+1]: 0,1,2,6,7,8; seq 2: 0..298 */
    T_EQ_INT(n, 6 + 299, "all valid anchors when under the cap");
    int32_t want0[6] = {0, 1, 2, 6, 7, 8};
    for (int i = 0; i < 6; i++)
        T_CHECK(bs[i] == 0 && ba[i] == want0[i], "block %d = (%d, %d)", i, bs[i], ba[i]);
    T_CHECK(bs[6] == 2 && ba[6] == 0 && ba[n - 1] == 298, "seq 2 blocks");
    T_CHECK(memcmp(&r, &r0, sizeof r) == 0, "no random draw when all anchors are used");
    /* capped: 16 per sequence, distinct, ascending, valid, reproducible */
    n = dfl_draft_blocks(lens, 3, mask, 16, &r, bs, ba, scratch);
    T_EQ_INT(n, 6 + 16, "capped count");
    for (int64_t i = 7; i < n; i++)
        T_CHECK(ba[i] > ba[i - 1] && bs[i] == 2, "ascending distinct");
    dfl_rng r2 = r0;
    int32_t bs2[400], ba2[400];
    int64_t n2 = dfl_draft_blocks(lens, 3, mask, 16, &r2, bs2, ba2, scratch);
    T_CHECK(n2 == n && memcmp(ba, ba2, (size_t)n * 4) == 0, "same seed, same anchors");
    /* uniform: over many draws every valid anchor of seq 2 is drawn about 16/299 of the time */
    int hits[300] = {0};
    for (int k = 0; k < 3000; k++) {
        n = dfl_draft_blocks(lens, 3, mask, 16, &r, bs, ba, scratch);
        for (int64_t i = 6; i < n; i++)
            hits[ba[i]]++;
    }
    int lo = 1 << 30, hi = 0;
    for (int a = 0; a < 299; a++) {
        lo = hits[a] < lo ? hits[a] : lo;
        hi = hits[a] > hi ? hits[a] : hi;
    }
    T_CHECK(lo > 110 && hi < 215 && hits[299] == 0, "uniform draws: %d..%d (expect ~160)", lo, hi);
    T_EQ_INT(dfl_draft_max_blocks(313, 3, 512), 310, "bound by tokens");
    T_EQ_INT(dfl_draft_max_blocks(10000, 3, 512), 1536, "bound by anchors");
}

static void test_schedule(void)
{
    T_NEAR(dfl_draft_lr(1.0, 1, 4, 100), 0.25, 1e-12, "warmup step 1");
    T_NEAR(dfl_draft_lr(1.0, 4, 4, 100), 1.0, 1e-12, "end of warmup");
    T_NEAR(dfl_draft_lr(1.0, 52, 4, 100), 0.5, 1e-12, "cosine midpoint");
    T_NEAR(dfl_draft_lr(1.0, 100, 4, 100), 0.0, 1e-12, "last step");
    T_NEAR(dfl_draft_lr(2.0, 5, 0, 10), 2.0 * 0.5 * (1 + cos(M_PI * 0.5)), 1e-12, "no warmup");
}

static void test_config_json(void)
{
    dfl_draft_config c = tiny(), d;
    json_t *j = dfl_draft_config_to_json(&c);
    const char *must[] = {"architectures", "block_size", "dflash_config", "hidden_size",
                          "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                          "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta",
                          "vocab_size", "num_target_layers", "model_type", "max_position_embeddings"};
    for (size_t i = 0; i < DFL_ARRAY_LEN(must); i++)
        T_CHECK(json_object_get(j, must[i]) != NULL, "config.json has %s", must[i]);
    T_CHECK(!strcmp(json_string_value(json_array_get(json_object_get(j, "architectures"), 0)),
                    "DFlashDraftModel"), "architectures");
    memset(&d, 0, sizeof d);
    dfl_err e = {0};
    T_CHECK(dfl_draft_config_from_json(&d, j, "test", &e) == 0, "%s", e.msg);
    T_CHECK(d.hidden == c.hidden && d.vocab == c.vocab && d.intermediate == c.intermediate &&
            d.n_layers == c.n_layers && d.n_heads == c.n_heads && d.n_kv == c.n_kv &&
            d.head_dim == c.head_dim && d.block_size == c.block_size &&
            d.mask_token_id == c.mask_token_id && d.n_feat == 3 && d.target_layers[2] == 3 &&
            d.gamma == c.gamma && d.rms_eps == c.rms_eps && d.rope_theta == c.rope_theta,
            "round trip");
    json_decref(j);
    /* the public layout (SpecForge's qwen3-8b config plus dflash_config) */
    const char *pub = "{\"architectures\":[\"DFlashDraftModel\"],\"block_size\":16,\"head_dim\":128,"
                      "\"hidden_size\":4096,\"intermediate_size\":12288,\"num_attention_heads\":32,"
                      "\"num_hidden_layers\":5,\"num_key_value_heads\":8,\"num_target_layers\":36,"
                      "\"rms_norm_eps\":1e-06,\"rope_theta\":1000000,\"vocab_size\":151936,"
                      "\"dflash_config\":{\"mask_token_id\":151669,\"target_layer_ids\":[1,9,17,25,33]}}";
    T_CHECK(dfl_json_parse(pub, strlen(pub), &j, "pub", &e) == 0, "%s", e.msg);
    memset(&d, 0, sizeof d);
    d.gamma = 7;
    T_CHECK(dfl_draft_config_from_json(&d, j, "pub", &e) == 0, "%s", e.msg);
    T_CHECK(d.n_layers == 5 && d.mask_token_id == 151669 && d.n_feat == 5 && d.target_layers[4] == 33
            && d.rope_theta == 1e6 && d.block_size == 16 && d.gamma == 7, "public config");
    T_CHECK(dfl_draft_config_check(&d, &e) == 0, "%s", e.msg);
    json_decref(j);
    /* a bad one */
    const char *bad = "{\"dflash_config\":{\"target_layer_ids\":[1,\"x\"]}}";
    dfl_json_parse(bad, strlen(bad), &j, "bad", &e);
    T_CHECK(dfl_draft_config_from_json(&d, j, "bad", &e) == DFL_EDATA && strstr(e.msg, "target_layer_ids"),
            "bad layer ids: %s", e.msg);
    json_decref(j);
    d = tiny();
    d.mask_token_id = 50;
    T_CHECK(dfl_draft_config_check(&d, &e) == DFL_EDATA && strstr(e.msg, "mask_token_id"), "%s", e.msg);
}

static void test_tensor_table(void)
{
    /* doc/dflash-step.md section 1: 3 + 11 * 2 = 25 tensors, 1,377,920 values */
    dfl_draft_config c = {0};
    c.hidden = 256, c.vocab = 2048, c.intermediate = 512, c.n_layers = 2, c.n_heads = 8, c.n_kv = 4;
    c.head_dim = 32, c.n_feat = 3;
    dfl_draft_tensor *t;
    int64_t flat;
    int n = dfl_draft_tensors(&c, &t, &flat);
    T_EQ_INT(n, 25, "tensor count");
    int64_t total = 0;
    for (int i = 0; i < n; i++)
        total += t[i].numel;
    T_EQ_INT(total, 1377920, "values");
    T_CHECK(!strcmp(t[0].name, "fc.weight") && !strcmp(t[n - 1].name, "norm.weight"), "names");
    for (int i = 0; i < n; i++)
        if (strstr(t[i].name, "up_proj"))
            T_CHECK(t[i].offset == t[i - 1].offset + t[i - 1].numel, "gate|up contiguous");
    free(t);
}

static int count_steps(const char *run)
{
    DIR *d = opendir(run);
    int n = 0;
    struct dirent *de;
    while (d && (de = readdir(d)))
        n += !strncmp(de->d_name, "step-", 5);
    if (d)
        closedir(d);
    return n;
}

static bool any_tmp(const char *run)
{
    DIR *d = opendir(run);
    bool t = false;
    struct dirent *de;
    while (d && (de = readdir(d)))
        t |= strstr(de->d_name, ".tmp") != NULL;
    if (d)
        closedir(d);
    return t;
}

static void test_checkpoint(void)
{
    dfl_err e = {0};
    dfl_be *be;
    dfl_be_cpu_open(&be, 0, &e);
    dfl_draft_config c = tiny();
    dfl_draft *m, *m2;
    T_CHECK(dfl_draft_open(&m, be, &c, &e) == 0 && dfl_draft_open(&m2, be, &c, &e) == 0, "%s", e.msg);
    dfl_draft_init_random(m, 5, 0.5, &e);
    int64_t flat = dfl_draft_flat_len(m);
    float *a = malloc(flat * 4), *b = malloc(flat * 4);
    dfl_rng r;
    dfl_rng_seed(&r, 3);
    int nt;
    const dfl_draft_tensor *t = dfl_draft_tensor_list(m, &nt);
    for (int w = DFL_DRAFT_ADAM_M; w <= DFL_DRAFT_ADAM_V; w++) {
        memset(a, 0, flat * 4);   /* padding between tensors stays 0, as in training */
        for (int i = 0; i < nt; i++)
            for (int64_t j = 0; j < t[i].numel; j++)
                a[t[i].offset + j] = (float)fabs(dfl_rng_normal(&r));
        dfl_draft_upload(m, w, a, &e);
    }
    char run[4096];
    snprintf(run, sizeof run, "%s/run", t_tmpdir());
    dfl_mkdir_p(run, 0777, &e);
    json_t *st = json_pack("{s:s, s:i}", "format", "test", "step", 7);
    char *dir = NULL;
    T_CHECK(dfl_draft_ckpt_save(m, run, 7, st, DFL_BF16, &dir, &e) == 0, "save: %s", e.msg);
    T_CHECK(dir && strstr(dir, "step-0000007"), "dir %s", dir ? dir : "(null)");
    /* model.safetensors: exactly the drafter names, bf16 */
    char p[4200];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    dfl_st_file *f;
    T_CHECK(dfl_st_open(&f, p, &e) == 0, "%s", e.msg);
    T_EQ_INT(f->n, nt, "model tensors");
    dfl_draft_download(m, DFL_DRAFT_MASTER, a, &e);
    for (int i = 0; i < nt; i++) {
        const dfl_st_tensor *x = dfl_st_find(f, t[i].name);
        T_CHECK(x && x->dtype == DFL_BF16 && x->numel == (uint64_t)t[i].numel, "%s", t[i].name);
        if (x)
            T_NEAR(dfl_load_f64(x->data, x->dtype, 0), a[t[i].offset], fabs(a[t[i].offset]) * 4e-3 + 1e-30, t[i].name);
    }
    dfl_st_close(f);
    /* latest -> step-0000007, resolve through the run directory */
    char *res = NULL;
    T_CHECK(dfl_draft_ckpt_resolve(run, &res, &e) == 0 && strstr(res, "latest"), "resolve run: %s", e.msg);
    free(res);
    char lat[4200], tgt[256] = "";
    snprintf(lat, sizeof lat, "%s/latest", run);
    ssize_t k = readlink(lat, tgt, sizeof tgt - 1);
    tgt[k > 0 ? k : 0] = 0;
    T_CHECK(!strcmp(tgt, "step-0000007"), "latest -> %s", tgt);
    /* load into a fresh model: identical bits */
    json_t *st2 = NULL;
    T_CHECK(dfl_draft_ckpt_load(m2, dir, &st2, &e) == 0, "load: %s", e.msg);
    int64_t sv = 0;
    dfl_json_int(st2, "step", true, &sv, "", &e);
    T_EQ_INT(sv, 7, "trainer state");
    json_decref(st2);
    for (int w = DFL_DRAFT_MASTER; w <= DFL_DRAFT_ADAM_V; w++) {
        if (w == DFL_DRAFT_GRAD)
            continue;
        dfl_draft_download(m, w, a, &e);
        dfl_draft_download(m2, w, b, &e);
        T_CHECK(memcmp(a, b, flat * 4) == 0, "buffer %d restored bit for bit", w);
    }
    /* f32 weights, more steps, keep 2 */
    for (int s = 8; s <= 10; s++)
        T_CHECK(dfl_draft_ckpt_save(m, run, s, st, DFL_F32, NULL, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_draft_ckpt_prune(run, 2, &e) == 0, "%s", e.msg);
    T_EQ_INT(count_steps(run), 2, "kept 2");
    snprintf(p, sizeof p, "%s/step-0000009/model.safetensors", run);
    T_CHECK(dfl_st_open(&f, p, &e) == 0 && f->t[0].dtype == DFL_F32, "f32 weights");
    dfl_st_close(f);
    /* a non-finite master weight: nothing written */
    dfl_draft_download(m, DFL_DRAFT_MASTER, a, &e);
    a[flat / 2] = NAN;
    dfl_draft_upload(m, DFL_DRAFT_MASTER, a, &e);
    T_CHECK(dfl_draft_ckpt_save(m, run, 11, st, DFL_BF16, NULL, &e) == DFL_ENAN, "NaN refused");
    T_CHECK(strstr(e.msg, "not written") != NULL, "%s", e.msg);
    T_EQ_INT(count_steps(run), 2, "no new checkpoint");
    T_CHECK(!any_tmp(run), "no temporary left");
    k = readlink(lat, tgt, sizeof tgt - 1);
    tgt[k > 0 ? k : 0] = 0;
    T_CHECK(!strcmp(tgt, "step-0000010"), "latest unchanged: %s", tgt);
    /* a checkpoint holding a NaN (written by something else) is refused on load */
    snprintf(p, sizeof p, "%s/step-0000010/optimizer.safetensors", run);
    dfl_st_writer *w = dfl_st_writer_new();
    for (int i = 0; i < nt; i++) {
        const char *pre[3] = {"master.", "exp_avg.", "exp_avg_sq."};
        for (int q = 0; q < 3; q++) {
            char nm[128];
            snprintf(nm, sizeof nm, "%s%s", pre[q], t[i].name);
            dfl_st_writer_add(w, nm, DFL_F32, t[i].ndim, t[i].shape, a + t[i].offset, &e);
        }
    }
    T_CHECK(dfl_st_write(w, p, &e) == 0, "%s", e.msg);
    dfl_st_writer_free(w);
    snprintf(p, sizeof p, "%s/step-0000010", run);
    T_CHECK(dfl_draft_ckpt_load(m2, p, &st2, &e) == DFL_ENAN && strstr(e.msg, "not finite"), "%s", e.msg);
    /* a different drafter is refused */
    dfl_draft_config c3 = tiny();
    c3.block_size = 8;
    dfl_draft *m3;
    dfl_draft_open(&m3, be, &c3, &e);
    snprintf(p, sizeof p, "%s/step-0000009", run);
    T_CHECK(dfl_draft_ckpt_load(m3, p, &st2, &e) == DFL_EMISMATCH && strstr(e.msg, "block_size"), "%s", e.msg);
    /* a temporary directory is not a checkpoint */
    snprintf(p, sizeof p, "%s/.step-0000012.tmp", run);
    mkdir(p, 0777);
    snprintf(lat, sizeof lat, "%s/trainer_state.json", p);
    FILE *fp = fopen(lat, "w");
    fputs("{}", fp);
    fclose(fp);
    T_CHECK(dfl_draft_ckpt_resolve(p, &res, &e) == DFL_EDATA, "tmp refused: %s", e.msg);
    json_decref(st);
    free(dir);
    free(a);
    free(b);
    dfl_draft_close(m);
    dfl_draft_close(m2);
    dfl_draft_close(m3);
    dfl_be_close(be);
}

/* The LM head runs on the scored rows only: slots 1..bs-1 of each block (slot 0, the anchor's
 * own token, is never scored). Counted through a wrapper of the CPU backend's lmce op; the step's
 * counts and per-row figures are still those of every row. */
static int (*plain_lmce)(dfl_be *be, const dfl_lmce *a);
static int64_t lmce_rows_seen;

static int counting_lmce(dfl_be *be, const dfl_lmce *a)
{
    lmce_rows_seen += a->Q;
    return plain_lmce(be, a);
}

static void test_lm_head_rows(void)
{
    dfl_err e = {0};
    dfl_be *be;
    dfl_draft *m = NULL;
    T_CHECK(dfl_be_cpu_open(&be, 1, &e) == 0, "cpu backend: %s", e.msg);
    const dfl_be_ops *plain = be->ops;
    static dfl_be_ops counting;
    counting = *plain;
    plain_lmce = plain->lmce;
    counting.lmce = counting_lmce;
    be->ops = &counting;
    const dfl_draft_config c = tiny();
    enum { L = 20, NB = 5 };
    const int bs = c.block_size, H = (int)c.hidden, V = (int)c.vocab;
    static float E[50 * 32], feat[3][L * 32];
    int32_t ids[L], bseq[NB] = {0}, banc[NB] = {0, 3, 7, 12, 18};
    uint8_t mask[L];
    uint32_t len = L;
    dfl_rng r;
    dfl_rng_seed(&r, 7);
    for (int i = 0; i < V * H; i++)
        E[i] = (float)(0.1 * dfl_rng_normal(&r));
    for (int j = 0; j < 3; j++)
        for (int i = 0; i < L * H; i++)
            feat[j][i] = (float)dfl_rng_normal(&r);
    for (int i = 0; i < L; i++) {
        ids[i] = (int32_t)(dfl_rng_next(&r) % (uint64_t)(V - 1));
        mask[i] = i != 9 && i != 10;
    }
    const dfl_st_tensor te = {.name = "embed", .dtype = DFL_F32, .ndim = 2, .shape = {V, H},
                              .numel = (uint64_t)V * H, .nbytes = sizeof E, .data = E};
    dfl_draft_input in = {.T = L, .S = 1, .seq_lens = &len, .input_ids = ids, .loss_mask = mask,
                          .feat_dt = DFL_F32, .feat_ld = H, .n_blocks = NB, .block_seq = bseq,
                          .block_anchor = banc};
    for (int j = 0; j < 3; j++)
        in.feat[j] = feat[j];
    dfl_draft_stats st;
    T_CHECK(dfl_draft_open(&m, be, &c, &e) == 0 && dfl_draft_init_random(m, 3, 0.1, &e) == 0 &&
            dfl_draft_set_frozen(m, &te, NULL, &e) == 0 && dfl_draft_reserve(m, L, NB, 0, &e) == 0 &&
            dfl_draft_step(m, &in, true, &e) == 0 && dfl_draft_fetch(m, &st, &e) == 0,
            "drafter step: %s", e.msg);
    T_CHECK(lmce_rows_seen == NB * (bs - 1), "the LM head ran on %lld rows, not the %d of slots "
            "1..%d", (long long)lmce_rows_seen, NB * (bs - 1), bs - 1);
    /* what the host says is scored */
    int scored = 0, per_slot[4] = {0};
    for (int b = 0; b < NB; b++)
        for (int j = 1; j < bs; j++)
            if (banc[b] + j < L && mask[banc[b] + j])
                scored++, per_slot[j]++;
    T_CHECK(st.acc_den == scored, "scored slots: %g, expected %d", st.acc_den, scored);
    for (int j = 1; j < bs; j++)
        T_CHECK(st.slot_count[j] == per_slot[j], "slot %d: %g scored, expected %d", j,
                st.slot_count[j], per_slot[j]);
    T_CHECK(isfinite(st.loss_num) && st.loss_num > 0 && st.loss_den > 0, "loss %g / %g",
            st.loss_num, st.loss_den);
    float ce[NB * 4], w[NB * 4], z[NB * 4 * 32];
    T_CHECK(dfl_draft_activation(m, DFL_DRAFT_ACT_CE, 0, ce, NB * bs, &e) == 0 &&
            dfl_draft_activation(m, DFL_DRAFT_ACT_WEIGHT, 0, w, NB * bs, &e) == 0 &&
            dfl_draft_activation(m, DFL_DRAFT_ACT_OUT, 0, z, NB * bs * H, &e) == 0,
            "activations: %s", e.msg);
    int bad = 0;
    for (int q = 0; q < NB * bs; q++) {
        bad += (w[q] > 0) != (q % bs && banc[q / bs] + q % bs < L && mask[banc[q / bs] + q % bs]);
        bad += w[q] > 0 ? !(ce[q] > 0) : ce[q] != 0;
        double ss = 0;
        for (int i = 0; i < H; i++)
            ss += (double)z[q * H + i] * z[q * H + i];
        /* z = norm(h) with a unit weight; slot 0 is not computed (draft.h) and reads 0 */
        bad += q % bs ? !(fabs(ss / H - 1) < 1e-3) : ss != 0;
    }
    T_CHECK(bad == 0, "%d per-row figures wrong (ce 0 exactly where unscored, z of the scored "
            "rows, 0 at slot 0)", bad);
    dfl_draft_close(m);
    be->ops = plain;
    dfl_be_close(be);
}

/* dfl_draft_init_random: the same weights for any number of threads; N(0, std^2) on matrices
 * (a tensor of more than one generator piece of 2^20 elements included), 1 on norms, 0 in the
 * padding between tensors; another seed, other weights */
static void test_init_random(void)
{
    dfl_err e = {0};
    dfl_be *be;
    dfl_be_cpu_open(&be, 0, &e);
    dfl_draft_config c = tiny();
    c.hidden = 1024, c.intermediate = 1100, c.n_layers = 1, c.n_heads = 8, c.n_kv = 4, c.head_dim = 128;
    dfl_draft *m;
    T_CHECK(dfl_draft_open(&m, be, &c, &e) == 0, "%s", e.msg);
    int64_t flat = dfl_draft_flat_len(m);
    float *a = malloc(flat * 4), *b = malloc(flat * 4);
    int threads = omp_get_max_threads();
    omp_set_num_threads(1);
    T_CHECK(dfl_draft_init_random(m, 7, 0.02, &e) == 0 && dfl_draft_download(m, DFL_DRAFT_MASTER, a, &e) == 0,
            "%s", e.msg);
    omp_set_num_threads(3);
    T_CHECK(dfl_draft_init_random(m, 7, 0.02, &e) == 0 && dfl_draft_download(m, DFL_DRAFT_MASTER, b, &e) == 0,
            "%s", e.msg);
    omp_set_num_threads(threads);
    T_CHECK(memcmp(a, b, flat * 4) == 0, "1 thread and 3 threads gave other weights");
    int nt;
    const dfl_draft_tensor *t = dfl_draft_tensor_list(m, &nt);
    int64_t covered = 0, big = 0;
    for (int i = 0; i < nt; i++) {
        const float *x = a + t[i].offset;
        covered += t[i].numel;
        if (t[i].ndim == 1) {
            for (int64_t j = 0; j < t[i].numel; j++)
                T_CHECK(x[j] == 1.0f, "norm %s[%lld] = %g, not 1", t[i].name, (long long)j, x[j]);
            continue;
        }
        double s1 = 0, s2 = 0;
        for (int64_t j = 0; j < t[i].numel; j++)
            s1 += x[j], s2 += (double)x[j] * x[j];
        double n = (double)t[i].numel, mean = s1 / n, sd = sqrt(s2 / n - mean * mean);
        /* 6 standard errors: the mean's 0.02/sqrt(n), the sd's about 0.02/sqrt(2n) */
        T_CHECK(fabs(mean) <= 6 * 0.02 / sqrt(n), "%s: mean %g over %.0f elements", t[i].name, mean, n);
        T_CHECK(fabs(sd - 0.02) <= 6 * 0.02 / sqrt(2 * n), "%s: sd %g, not 0.02", t[i].name, sd);
        if (t[i].numel > (1 << 20)) {
            big++;   /* the second piece is not the first one again */
            T_CHECK(memcmp(x, x + (1 << 20), 64 * 4) != 0, "%s: piece 1 repeats piece 0", t[i].name);
        }
    }
    T_CHECK(big > 0, "no tensor spans two pieces: the test shape is too small");
    int64_t zeros = 0;
    for (int64_t j = 0; j < flat; j++)
        zeros += a[j] == 0.0f;
    T_CHECK(zeros >= flat - covered, "padding: %lld zeros for %lld padding elements", (long long)zeros,
            (long long)(flat - covered));
    T_CHECK(dfl_draft_init_random(m, 8, 0.02, &e) == 0 && dfl_draft_download(m, DFL_DRAFT_MASTER, b, &e) == 0,
            "%s", e.msg);
    T_CHECK(memcmp(a, b, flat * 4) != 0, "seeds 7 and 8 gave the same weights");
    free(a);
    free(b);
    dfl_draft_close(m);
    dfl_be_close(be);
}

/* dfl_draft_all_finite: the first non-finite value, by index, whatever the threads and pieces */
static void test_all_finite(void)
{
    const int64_t n = 3 * (1 << 20) + 77;
    float *x = calloc(n, sizeof *x);
    int64_t first = -1;
    T_CHECK(dfl_draft_all_finite(x, n, &first) && first == -1, "all zero: not finite?");
    const int64_t at[][2] = {{n - 1, n - 1}, {2500000, 2500000}, {(1 << 18) - 1, (1 << 18) - 1}, {0, 0}};
    for (int k = 0; k < 4; k++) {   /* each adds one earlier bad value */
        x[at[k][0]] = k % 2 ? INFINITY : NAN;
        for (int threads = 1; threads <= 3; threads += 2) {
            omp_set_num_threads(threads);
            first = -1;
            T_CHECK(!dfl_draft_all_finite(x, n, &first) && first == at[k][1],
                    "bad value at %lld: first %lld (%d threads)", (long long)at[k][0], (long long)first, threads);
        }
    }
    x[0] = 1.0f;
    first = -1;
    T_CHECK(!dfl_draft_all_finite(x, n, &first) && first == (1 << 18) - 1, "first %lld", (long long)first);
    T_CHECK(!dfl_draft_all_finite(x, 1 << 18, &first) && first == (1 << 18) - 1, "short: first %lld",
            (long long)first);
    T_CHECK(dfl_draft_all_finite(x, (1 << 18) - 1, NULL), "the finite prefix");
    free(x);
}

#ifdef DFL_CUDA
/* each of the n bad values of environment variable var: dfl_be_cuda_open fails with a usage error
 * whose message starts "VAR=value:" and holds what */
static void env_refused(const char *var, const char *const *bad, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        setenv(var, bad[i], 1);
        dfl_be *be = NULL;
        dfl_err e = {0};
        const int rc = dfl_be_cuda_open(&be, 0, DFL_BF16, &e);
        char want[96];
        snprintf(want, sizeof want, "%s=%s:", var, bad[i]);
        T_CHECK(rc == DFL_EUSAGE && be == NULL && strstr(e.msg, want) && strstr(e.msg, what),
                "%s='%s': rc %d, message '%s'", var, bad[i], rc, e.msg);
    }
    unsetenv(var);
}
#endif

/* DFL_CUDA_LMCE_ROWS that is not a number from 64 to 65535, DFL_CUDA_DFLASH_DS other than 0 or 1:
 * the CUDA backend refuses to open, naming the variable, before it looks for a GPU (so this runs
 * on a machine without one); a CUDA build only. */
static void test_lmce_rows_env(void)
{
#ifdef DFL_CUDA
    static const char *bad[] = {"63", "65536", "abc", "128x", "-1", " 64"};
    env_refused("DFL_CUDA_LMCE_ROWS", bad, sizeof bad / sizeof bad[0], "64 to 65535");
    static const char *bad_ds[] = {"2", "yes", "01", " 1", "on"};
    env_refused("DFL_CUDA_DFLASH_DS", bad_ds, sizeof bad_ds / sizeof bad_ds[0], "0 (the attention");
#else
    T_SKIP("a build without CUDA");
#endif
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    T_RUN(test_rng);
    T_RUN(test_default_layers);
    T_RUN(test_blocks);
    T_RUN(test_schedule);
    T_RUN(test_config_json);
    T_RUN(test_tensor_table);
    T_RUN(test_checkpoint);
    T_RUN(test_lm_head_rows);
    T_RUN(test_init_random);
    T_RUN(test_all_finite);
    T_RUN(test_lmce_rows_env);
    return t_done();
}
