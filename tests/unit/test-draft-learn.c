/* test-draft-learn.c: the drafter learns. A tiny random target (frozen embedding and LM head)
 * and a synthetic dataset whose continuations are predictable: every sequence follows
 * t[i+1] = (5 t[i] + 3) mod 61, from a random first token, so each block's labels are a function
 * of its anchor token. A drafter that learns nothing has an acceptance length tau of about 1 (its
 * slot-1 guess is right 1 time in 61: tau ~ 1.02); a perfect one has tau = block size = 8.
 * After 300 CPU steps of the real training step (random anchors, packed batches, AdamW, warmup
 * and cosine schedule) tau must exceed 4: more than three tokens accepted per block on average,
 * far from chance, and a level the step reaches with margin (7.5 when this was written). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "draft.h"
#include "draft_data.h"
#include "draft_rng.h"
#include "t.h"

void openblas_set_num_threads(int n);   /* OpenBLAS (its cblas.h defines I, as complex.h does) */

enum { H = 64, V = 64, K = 2, NSEQ = 4, LEN = 48, STEPS = 300, CONTENT = 61 };

static void test_learns_predictable_continuations(void)
{
    dfl_err e = {0};
    dfl_be *be;
    T_CHECK(dfl_be_cpu_open(&be, 0, &e) == 0, "%s", e.msg);
    dfl_draft_config c = {0};
    c.hidden = H, c.vocab = V, c.intermediate = 128, c.n_layers = 1, c.n_heads = 4, c.n_kv = 2;
    c.head_dim = 16, c.n_feat = K, c.target_layers[0] = 1, c.target_layers[1] = 2;
    c.n_target_layers = 4, c.block_size = 8, c.mask_token_id = V - 1, c.gamma = 7;
    c.rms_eps = 1e-6, c.rope_theta = 1e4, c.max_position = 4096, c.bos_token_id = c.eos_token_id = -1;
    dfl_draft *m;
    T_CHECK(dfl_draft_open(&m, be, &c, &e) == 0, "%s", e.msg);
    dfl_rng r;
    dfl_rng_seed(&r, 2024);
    /* frozen target tables and per-token features */
    float *E = malloc(V * H * 4), *W = malloc(V * H * 4), *G = malloc(K * V * H * 4);
    for (int i = 0; i < V * H; i++) {
        E[i] = (float)dfl_rng_normal(&r);
        W[i] = (float)(dfl_rng_normal(&r) / sqrt(H));
    }
    for (int i = 0; i < K * V * H; i++)
        G[i] = (float)dfl_rng_normal(&r);
    dfl_st_tensor te = {.name = "embed", .dtype = DFL_F32, .ndim = 2, .shape = {V, H},
                        .numel = V * H, .data = E};
    dfl_st_tensor tw = te;
    tw.name = "lm_head";
    tw.data = W;
    T_CHECK(dfl_draft_set_frozen(m, &te, &tw, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_draft_init_random(m, 1, 0.02, &e) == 0, "%s", e.msg);
    const int T = NSEQ * LEN;
    T_CHECK(dfl_draft_reserve(m, T, dfl_draft_max_blocks(T, NSEQ, 16), 0, &e) == 0, "%s", e.msg);

    uint32_t lens[NSEQ];
    int32_t ids[NSEQ * LEN], bseq[NSEQ * LEN], banc[NSEQ * LEN], scratch[LEN];
    uint8_t mask[NSEQ * LEN];
    float *feat = malloc((size_t)K * T * H * 4);
    dfl_draft_optim opt = {0.9f, 0.999f, 1e-8f, 0.0f, 1.0f};
    double tau_first = 0, tau_last = 0, loss_first = 0, loss_last = 0;
    int64_t adam_t = 0;
    for (int step = 1; step <= STEPS; step++) {
        for (int s = 0; s < NSEQ; s++) {
            lens[s] = LEN;
            int tok = (int)dfl_rng_below(&r, CONTENT);
            for (int i = 0; i < LEN; i++) {
                ids[s * LEN + i] = tok;
                mask[s * LEN + i] = i >= 4;   /* a "prompt" of 4 unscored tokens */
                tok = (5 * tok + 3) % CONTENT;
            }
        }
        for (int j = 0; j < K; j++)
            for (int t = 0; t < T; t++)
                memcpy(feat + ((size_t)j * T + t) * H, G + ((size_t)j * V + ids[t]) * H, H * 4);
        int64_t nb = dfl_draft_blocks(lens, NSEQ, mask, 16, &r, bseq, banc, scratch);
        dfl_draft_input in = {.T = T, .S = NSEQ, .seq_lens = lens, .input_ids = ids,
                              .loss_mask = mask, .feat_dt = DFL_F32, .feat_ld = H,
                              .n_blocks = (int32_t)nb, .block_seq = bseq, .block_anchor = banc};
        for (int j = 0; j < K; j++)
            in.feat[j] = feat + (size_t)j * T * H;
        double lr = dfl_draft_lr(3e-3, step, 15, STEPS);
        dfl_draft_stats st;
        if (dfl_draft_step(m, &in, true, &e) || dfl_draft_apply(m, &opt, (float)lr, adam_t + 1, &e) ||
            dfl_draft_fetch(m, &st, &e)) {
            T_CHECK(0, "step %d: %s", step, e.msg);
            break;
        }
        T_CHECK(!st.skipped, "step %d skipped", step);
        adam_t++;
        double tau = st.tau_sum / (double)st.tau_blocks, loss = st.loss_num / st.loss_den;
        if (step <= 10) {
            tau_first += tau / 10;
            loss_first += loss / 10;
        }
        if (step > STEPS - 20) {
            tau_last += tau / 20;
            loss_last += loss / 20;
        }
    }
    printf("# tau %.3f -> %.3f, loss %.3f -> %.3f over %d steps\n", tau_first, tau_last, loss_first,
           loss_last, STEPS);
    T_CHECK(tau_first < 1.5, "an untrained drafter is near chance: tau %.3f", tau_first);
    T_CHECK(tau_last > 4.0, "tau after training %.3f (threshold 4)", tau_last);
    T_CHECK(loss_last < 0.5 * loss_first, "loss %.3f -> %.3f", loss_first, loss_last);
    free(E), free(W), free(G), free(feat);
    dfl_draft_close(m);
    dfl_be_close(be);
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    /* One thread: tiny ops gain nothing from more, and on a loaded machine (CI, parallel test
     * runs) spinning OpenMP and OpenBLAS threads make the run ten times slower. The threaded
     * ops are checked by test-gradcheck. */
    omp_set_num_threads(1);
    openblas_set_num_threads(1);
    T_RUN(test_learns_predictable_continuations);
    return t_done();
}
