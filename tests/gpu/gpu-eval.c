/* gpu-eval.c: dfl-eval on CUDA against the CPU, on one stream and one checkpoint. A drafter is
 * trained (dfl-draft) on a small random target's hidden states (tests/tools/mktarget, draftdata),
 * then evaluated on held-out hidden states on both devices through the library (every anchor of a
 * batch in one forward, each forward's blocks collected through on_forward):
 *  - the blocks whose number of leading matches differs between the devices are counted and
 *    printed (the CUDA drafter runs in bf16, the CPU one in f32: an argmax tie, or two logits
 *    closer than bf16 resolves, may differ); at most 2% may;
 *  - tau, steps and tokens are printed for both; tau may differ by at most 2%;
 *  - the dfl-eval program itself on --device cuda: exit 0, one JSON object with the same tau.
 * DFL_TEST_DEVICE=cpu runs it with the CPU on both sides (a check of this test itself without a
 * GPU: then nothing may differ). Skips without a GPU (77). */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "backend.h"
#include "eval.h"
#include "../unit/t.h"
#include "gpu-e2e.h"


/* Leading matches of every block, by (batch, sequence, anchor): batches x seqs x len entries. */
enum { BATCHES = 6, SEQS = 4, LEN = 200 };
typedef struct blocks {
    int8_t n[BATCHES][SEQS][LEN];   /* -1: not computed */
    int64_t count;
} blocks;

static void on_forward(void *ctx, int input, int64_t batch, int64_t seq0, int64_t nb,
                       const int32_t *bseq, const int32_t *banchor, const uint8_t *correct, int bs)
{
    blocks *b = ctx;
    for (int64_t k = 0; k < nb; k++) {
        int64_t s = seq0 + bseq[k], a = banchor[k];
        if (batch >= BATCHES || s >= SEQS || a >= LEN)
            continue;
        int n = 0;
        while (n + 1 < bs && correct[k * bs + n + 1])
            n++;
        b->n[batch][s][a] = (int8_t)n;
        b->count++;
    }
}

static int eval_on(const char *dev, blocks *b, dfl_eval_stats *st, dfl_err *e)
{
    static char ckpt[4300], tgt[4300], hs[4300];
    snprintf(ckpt, sizeof ckpt, "%s/r", dir);
    snprintf(tgt, sizeof tgt, "%s/t", dir);
    snprintf(hs, sizeof hs, "%s/held.dfl", dir);
    static const char *inputs[1];
    inputs[0] = hs;
    memset(b, -1, sizeof b->n);
    b->count = 0;
    dfl_eval_opts o = {.draft = ckpt, .target_dir = tgt, .device = dev, .n_inputs = 1,
                       .inputs = inputs, .max_tokens = BATCHES * SEQS * LEN,
                       .max_blocks = SEQS * LEN, .on_forward = on_forward, .ctx = b};
    dfl_eval_info info;
    return dfl_eval_run(&o, st, &info, e);
}

static void test_cpu_and_cuda_agree(void)
{
    if (!have_device())
        T_SKIP("no CUDA GPU");
    static blocks bc, bg;
    dfl_eval_stats sc, sg;
    dfl_err e = {0};
    int rc = eval_on("cpu", &bc, &sc, &e);
    T_CHECK(rc == 0, "cpu: %s", e.msg);
    rc = rc ? rc : eval_on(device, &bg, &sg, &e);
    T_CHECK(rc == 0, "%s: %s", device, e.msg);
    if (rc)
        return;
    int64_t both = 0, differ = 0;
    for (int i = 0; i < BATCHES; i++)
        for (int s = 0; s < SEQS; s++)
            for (int a = 0; a < LEN; a++)
                if (bc.n[i][s][a] >= 0 && bg.n[i][s][a] >= 0) {
                    both++;
                    differ += bc.n[i][s][a] != bg.n[i][s][a];
                }
    const double tc = (double)sc.tokens / (double)sc.steps, tg = (double)sg.tokens / (double)sg.steps;
    printf("# cpu: tau %.4f (%lld tokens, %lld steps); %s: tau %.4f (%lld tokens, %lld steps); "
           "%lld of %lld blocks differ in their leading matches\n", tc, (long long)sc.tokens,
           (long long)sc.steps, device, tg, (long long)sg.tokens, (long long)sg.steps,
           (long long)differ, (long long)both);
    T_EQ_INT(bc.count, bg.count, "blocks computed");
    T_CHECK(both == bc.count && both > 0, "every block on both devices (%lld of %lld)",
            (long long)both, (long long)bc.count);
    T_EQ_INT(sc.tokens, sg.tokens, "tokens decoded (the text's)");
    T_CHECK(tc > 1.3, "the trained drafter accepts something (tau %.3f)", tc);
    T_CHECK(differ * 50 <= both, "%lld blocks of %lld differ (at most 2%%)", (long long)differ,
            (long long)both);
    T_CHECK(fabs(tc - tg) <= 0.02 * tc, "tau %.4f vs %.4f", tc, tg);
    if (strcmp(device, "cpu") == 0)
        T_EQ_INT(differ, 0, "the same device: the same blocks");
    /* the program, end to end */
    char out[4400];
    snprintf(out, sizeof out, "%s/eval.json", dir);
    rc = sh("'%s/dfl-eval' -q --device %s --draft '%s/r' --target '%s/t' '%s/held.dfl' > '%s'", bin,
            device, dir, dir, dir, out);
    T_EQ_INT(rc, 0, "dfl-eval exit status");
    FILE *f = fopen(out, "r");
    char line[8192] = "";
    if (f) {
        if (!fgets(line, sizeof line, f))
            line[0] = 0;
        fclose(f);
    }
    const char *t = strstr(line, "\"tau\":");
    T_CHECK(t && fabs(strtod(t + 6, NULL) - tg) <= 1e-6, "the program's tau (%s) is the library's %.6f",
            t ? t + 6 : "none", tg);
}

static bool setup(void)
{
    const char *dev = strcmp(device, "cpu") == 0 ? "cpu" : device;
    return sh("'%s/mktarget' -o '%s/t' --hidden 128 --layers 6 --heads 4 --kv-heads 2 --intermediate 256 "
              "--vocab 512 > /dev/null", tools, dir) == 0 &&
           sh("'%s/draftdata' '%s/t' '%s/train.dfl' --batches 40 --seqs 4 --len 120 --layers 1,3 > /dev/null",
              tools, dir, dir) == 0 &&
           sh("'%s/draftdata' '%s/t' '%s/held.dfl' --batches %d --seqs %d --len %d --exact-len "
              "--layers 1,3 --seed 99 > /dev/null", tools, dir, dir, BATCHES, SEQS, LEN) == 0 &&
           sh("'%s/dfl-draft' -q --device %s --target '%s/t' --out '%s/r' --mask-token-id 511 "
              "--draft-layers 1 --block-size 8 --num-anchors 64 --epochs 6 --lr 1e-2 --save-every 0 "
              "'%s/train.dfl' > /dev/null", bin, dev, dir, dir, dir) == 0;
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    e2e_init(argv[0]);
    if (have_device() && !setup()) {
        printf("not ok - setup (target, hidden states, a trained drafter)\n");
        return 1;
    }
    T_RUN(test_cpu_and_cuda_agree);
    return t_done();
}
