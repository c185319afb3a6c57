/* gpu-draft.c: dfl-draft --device cuda end to end through its pipeline (inputs staged and
 * uploaded ahead on the copy stream, results read one step late through events), on a small
 * random target (tests/tools/mktarget) and hidden-state file (tests/tools/draftdata). Checked:
 *  - no host sync in the steady state: --profile's per-window count of syncs (the CUDA backend's
 *    count of calls that drained a stream) is 0 in every window but the first;
 *  - the pipeline changes nothing: metrics.jsonl (less its timing fields) and the checkpoint
 *    equal those of --no-pipeline, which reads every step before the next;
 *  - two identical runs give identical checkpoints (dfl-ckpt --diff) and metrics;
 *  - the losses track --device cpu within bf16 tolerance;
 *  - a NaN planted in one batch (tests/tools/poison) skips that step, read one step late: one
 *    warning, skipped_steps 1, adam_step one less than the steps, the same checkpoint as
 *    --no-pipeline (the AdamW step count after the skip comes from the device); --max-bad-steps 1
 *    stops with 2 naming the last good checkpoint;
 *  - sizing: a stream without --max-tokens is refused before the first step; a batch larger than
 *    --max-tokens stops with a message naming the batch and both sizes;
 *  - DFL_CUDA_LMCE_ROWS not a number from 64 to 65535 stops the run (exit 1, the variable named).
 * DFL_TEST_DEVICE=cpu runs the same comparisons with --device cpu (a check of this test itself,
 * without a GPU; the sizing test is skipped there: the CPU grows); DFL_GPU_SMALL=1 makes the
 * runs 12 steps instead of 44. Skips without a GPU (77). */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "backend.h"
#include "../unit/t.h"
#include "gpu-e2e.h"

static char common[8192];   /* the options every run shares */

static int STEPS = 44;   /* batches, steps of a run (DFL_GPU_SMALL: 12) */

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s)
        s[n] = 0;
    fclose(f);
    return s;
}

/* One dfl-draft run into dir/NAME (stderr to dir/NAME.err); returns its exit status. */
static int draft(const char *name, const char *dev, const char *extra, const char *input)
{
    sh("rm -rf '%s/%s'", dir, name);
    return sh("'%s/dfl-draft' %s --device %s --out '%s/%s' %s '%s' > /dev/null 2> '%s/%s.err'", bin,
              common, dev, dir, name, extra, input, dir, name);
}

/* metrics.jsonl of a run with the values that measure time cut out (tokens_per_s, wait_s). */
static char *metrics_of(const char *name)
{
    char p[4400];
    snprintf(p, sizeof p, "%s/%s/metrics.jsonl", dir, name);
    char *s = slurp(p);
    if (!s)
        return NULL;
    static const char *const keys[] = {"\"tokens_per_s\":", "\"wait_s\":"};
    for (int i = 0; i < 2; i++) {   /* the value, up to the next , or } */
        size_t kl = strlen(keys[i]);
        for (char *k = s; (k = strstr(k, keys[i])); k += kl) {
            char *end = strpbrk(k + kl, ",}");
            if (end)
                memmove(k + kl, end, strlen(end) + 1);
        }
    }
    return s;
}

static int count_lines(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = s; p && (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

/* The losses of a run's metrics lines, in order; returns their number. */
static int losses_of(const char *metrics, double *out, int max)
{
    int n = 0;
    for (const char *p = metrics; p && (p = strstr(p, "\"loss\":")) && n < max; p += 7)
        out[n++] = strncmp(p + 7, "null", 4) == 0 ? NAN : strtod(p + 7, NULL);
    return n;
}

static bool setup(void)
{
    if (sh("'%s/mktarget' -o '%s/t' --hidden 256 --layers 6 --heads 4 --kv-heads 2 --intermediate 512 "
           "--vocab 2048 > /dev/null", tools, dir) ||
        sh("'%s/draftdata' '%s/t' '%s/h.dfl' --batches %d --seqs 4 --len 256 --layers 1,2,3 > /dev/null",
           tools, dir, dir, STEPS) ||
        sh("'%s/poison' '%s/h.dfl' '%s/nan.dfl' --batch 5 --layer 1 --token 3 --dim 7", tools, dir, dir))
        return false;
    snprintf(common, sizeof common, "--target '%s/t' --mask-token-id 2047 --draft-layers 2 "
             "--block-size 16 --num-anchors 64 --log-every 4 --save-every 0 --seed 7", dir);
    return true;
}

static void run_pair(const char *a, const char *b, const char *extra_a, const char *extra_b,
                     const char *input)
{
    char in[4400];
    snprintf(in, sizeof in, "%s/%s", dir, input);
    T_CHECK(draft(a, device, extra_a, in) == 0, "%s: dfl-draft failed (see %s/%s.err)", a, dir, a);
    T_CHECK(draft(b, device, extra_b, in) == 0, "%s: dfl-draft failed (see %s/%s.err)", b, dir, b);
}

static void same_run(const char *a, const char *b, const char *what)
{
    char *ma = metrics_of(a), *mb = metrics_of(b);
    T_CHECK(ma && mb && count_lines(ma, "\n") >= STEPS / 4, "%s: metrics lines", what);
    T_CHECK(ma && mb && strcmp(ma, mb) == 0, "%s: metrics lines differ:\n%s\n--\n%s", what,
            ma ? ma : "", mb ? mb : "");
    T_CHECK(sh("'%s/dfl-ckpt' --diff '%s/%s/latest' '%s/%s/latest' > '%s/diff.txt'", bin, dir, a, dir,
               b, dir) == 0, "%s: checkpoints differ (%s/diff.txt)", what, dir);
    free(ma);
    free(mb);
}

/* --profile windows: every one but the first (the pipeline filling) without a host sync. */
static void test_profile(void)
{
    if (!have_device())
        T_SKIP("no GPU");
    char in[4400], p[4400];
    snprintf(in, sizeof in, "%s/h.dfl", dir);
    T_CHECK(draft("prof", device, "--profile", in) == 0, "dfl-draft --profile failed");
    snprintf(p, sizeof p, "%s/prof.err", dir);
    char *err = slurp(p);
    T_CHECK(err != NULL, "stderr of the run");
    if (!err)
        return;
    int windows = 0, bad = 0;
    for (const char *l = err; (l = strstr(l, "profile: steps ")); l++) {
        long long a = 0, b = 0, syncs = -1, evw = -1;
        const char *h = strstr(l, "host syncs ");
        const char *v = strstr(l, "event waits ");
        sscanf(l, "profile: steps %lld-%lld", &a, &b);
        if (h)
            syncs = strtoll(h + 11, NULL, 10);
        if (v)
            evw = strtoll(v + 12, NULL, 10);
        windows++;
        fprintf(stderr, "  window %lld-%lld: %lld host syncs, %lld event waits\n", a, b, syncs, evw);
        if (windows > 1 && syncs != 0)
            bad++;
        if (syncs < 0 || evw < 0)
            bad++;
    }
    T_CHECK(windows >= STEPS / 4 - 1, "--profile printed %d windows for %d steps, --log-every 4",
            windows, STEPS);
    T_CHECK(bad == 0, "a steady-state window has host syncs (or a line could not be read):\n%s", err);
    T_CHECK(strcmp(device, "cpu") == 0 || !strstr(err, "GPU step n/a"),
            "the GPU step time comes from timing events");
    free(err);
}

static void test_pipeline_changes_nothing(void)
{
    if (!have_device())
        T_SKIP("no GPU");
    run_pair("pipe", "nopipe", "", "--no-pipeline", "h.dfl");
    same_run("pipe", "nopipe", "pipelined vs --no-pipeline");
    run_pair("pipe2", "pipe3", "", "", "h.dfl");
    same_run("pipe2", "pipe3", "two identical runs");
    same_run("pipe", "pipe2", "a third identical run");
}

static void test_tracks_cpu(void)
{
    if (!have_device() || strcmp(device, "cpu") == 0)
        T_SKIP(strcmp(device, "cpu") == 0 ? "the reference itself" : "no GPU");
    char in[4400];
    snprintf(in, sizeof in, "%s/h.dfl", dir);
    T_CHECK(draft("cpu", "cpu", "", in) == 0, "the --device cpu run failed");
    if (sh("test -d '%s/pipe/latest'", dir) != 0)   /* test_pipeline_changes_nothing made it */
        T_CHECK(draft("pipe", device, "", in) == 0, "the GPU run failed");
    char *mc = metrics_of("cpu"), *mg = metrics_of("pipe");
    double lc[64], lg[64];
    int nc = losses_of(mc, lc, 64), ng = losses_of(mg, lg, 64);
    T_CHECK(nc == ng && nc >= STEPS / 4, "%d CPU and %d GPU metrics lines", nc, ng);
    double worst = 0;
    for (int i = 0; i < nc && i < ng; i++) {
        double d = fabs(lc[i] - lg[i]) / fabs(lc[i]);
        fprintf(stderr, "  loss cpu %.5f gpu %.5f (%.2f%%)\n", lc[i], lg[i], 100 * d);
        if (!(d <= worst))
            worst = d;   /* NaN sticks */
    }
    /* bf16 activations and weights over 44 steps: a few percent */
    T_CHECK(worst <= 0.05, "GPU losses drift from the CPU's by %.2f%% at worst", 100 * worst);
    free(mc);
    free(mg);
}

static void test_skip_one_late(void)
{
    if (!have_device())
        T_SKIP("no GPU");
    run_pair("nan", "nan-nopipe", "--log-every 1", "--log-every 1 --no-pipeline", "nan.dfl");
    char p[4400];
    snprintf(p, sizeof p, "%s/nan.err", dir);
    char *err = slurp(p);
    T_CHECK(err && count_lines(err, "non-finite loss: skipped") == 1,
            "one warning of the skipped step:\n%s", err ? err : "");
    free(err);
    T_CHECK(sh("grep -q '\"skipped_steps\": 1,' '%s/nan/latest/trainer_state.json'", dir) == 0,
            "trainer_state.json counts the skipped step");
    T_CHECK(sh("grep -q '\"adam_step\": %d,' '%s/nan/latest/trainer_state.json'", STEPS - 1, dir) == 0,
            "adam_step is %d: the skipped step made no update", STEPS - 1);
    T_CHECK(sh("tail -1 '%s/nan/metrics.jsonl' | grep -q '\"skipped_steps\":1,'", dir) == 0,
            "the last metrics line counts the skipped step");
    T_CHECK(sh("'%s/dfl-ckpt' --check-nan '%s/nan/latest' > /dev/null", bin, dir) == 0,
            "the weights stay finite");
    same_run("nan", "nan-nopipe", "a NaN step, pipelined vs --no-pipeline");
    /* stop at the first bad step, one step late: exit 2, no checkpoint of a later step */
    char in[4400];
    snprintf(in, sizeof in, "%s/nan.dfl", dir);
    T_CHECK(draft("nanstop", device, "--max-bad-steps 1 --save-every 2", in) == 2,
            "--max-bad-steps 1 stops with 2");
    snprintf(p, sizeof p, "%s/nanstop.err", dir);
    err = slurp(p);
    T_CHECK(err && strstr(err, "1 non-finite steps in a row (--max-bad-steps 1)") &&
                strstr(err, "the last good checkpoint is step"),
            "the message names --max-bad-steps and the last good checkpoint:\n%s", err ? err : "");
    free(err);
}

static void test_sizing(void)
{
    if (!have_device() || strcmp(device, "cpu") == 0)
        T_SKIP(strcmp(device, "cpu") == 0 ? "the CPU grows its workspace" : "no GPU");
    char p[4400];
    /* a stream: no index to size from */
    int rc = sh("cat '%s/h.dfl' | '%s/dfl-draft' %s --device %s --out '%s/pipe-in' --total-steps 8 - "
                "> /dev/null 2> '%s/pipe-in.err'", dir, bin, common, device, dir, dir);
    T_CHECK(rc == 1, "a stream without --max-tokens on %s: exit %d, want 1", device, rc);
    snprintf(p, sizeof p, "%s/pipe-in.err", dir);
    char *err = slurp(p);
    T_CHECK(err && strstr(err, "--max-tokens is needed"), "the message asks for --max-tokens:\n%s",
            err ? err : "");
    free(err);
    rc = sh("cat '%s/h.dfl' | '%s/dfl-draft' %s --device %s --out '%s/pipe-small' --total-steps 8 "
            "--max-tokens 600 - > /dev/null 2> '%s/pipe-small.err'", dir, bin, common, device, dir, dir);
    T_CHECK(rc == 1, "a batch over --max-tokens: exit %d, want 1", rc);
    snprintf(p, sizeof p, "%s/pipe-small.err", dir);
    err = slurp(p);
    T_CHECK(err && strstr(err, "error: batch ") && strstr(err, " tokens and ") &&
                strstr(err, "sized for at the start (600 tokens") && strstr(err, "--max-tokens "),
            "the message names the batch and both sizes:\n%s", err ? err : "");
    free(err);
    rc = sh("cat '%s/h.dfl' | '%s/dfl-draft' %s --device %s --out '%s/pipe-ok' --total-steps 8 "
            "--max-tokens 1024 - > /dev/null 2> '%s/pipe-ok.err'", dir, bin, common, device, dir, dir);
    T_CHECK(rc == 0, "a stream with --max-tokens 1024: exit %d (see %s/pipe-ok.err)", rc, dir);
}

/* DFL_CUDA_LMCE_ROWS out of range or not a number: exit 1 before the GPU is opened, the message
 * naming the variable and its value, no checkpoint directory made; in range: the run works. */
static void test_lmce_rows_env(void)
{
    if (!have_device() || strcmp(device, "cpu") == 0)
        T_SKIP(strcmp(device, "cpu") == 0 ? "a CUDA backend variable" : "no GPU");
    static const char *bad[] = {"63", "65536", "abc", "128x", "-1"};
    char p[4400], in[4400];
    snprintf(in, sizeof in, "%s/h.dfl", dir);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        sh("rm -rf '%s/lmrows'", dir);
        int rc = sh("DFL_CUDA_LMCE_ROWS='%s' '%s/dfl-draft' %s --device %s --out '%s/lmrows' "
                    "--total-steps 2 '%s' > /dev/null 2> '%s/lmrows.err'", bad[i], bin, common, device,
                    dir, in, dir);
        T_CHECK(rc == 1, "DFL_CUDA_LMCE_ROWS=%s: exit %d, want 1", bad[i], rc);
        snprintf(p, sizeof p, "%s/lmrows.err", dir);
        char *err = slurp(p), want[64];
        snprintf(want, sizeof want, "DFL_CUDA_LMCE_ROWS=%s:", bad[i]);
        T_CHECK(err && strstr(err, want) && strstr(err, "64 to 65535"),
                "the message names the variable and the range:\n%s", err ? err : "");
        free(err);
        T_CHECK(sh("test -e '%s/lmrows/latest'", dir) != 0, "DFL_CUDA_LMCE_ROWS=%s: a checkpoint was written",
                bad[i]);
    }
    sh("rm -rf '%s/lmrows'", dir);
    int rc = sh("DFL_CUDA_LMCE_ROWS=64 '%s/dfl-draft' %s --device %s --out '%s/lmrows' --total-steps 2 "
                "'%s' > /dev/null 2> '%s/lmrows.err'", bin, common, device, dir, in, dir);
    T_CHECK(rc == 0, "DFL_CUDA_LMCE_ROWS=64: exit %d (see %s/lmrows.err)", rc, dir);
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    e2e_init(argv[0]);
    if (getenv("DFL_GPU_SMALL"))
        STEPS = 12;
    if (have_device() && !setup()) {
        printf("not ok - setup (target, hidden states)\n");
        return 1;
    }
    T_RUN(test_profile);
    T_RUN(test_pipeline_changes_nothing);
    T_RUN(test_tracks_cpu);
    T_RUN(test_skip_one_late);
    T_RUN(test_sizing);
    T_RUN(test_lmce_rows_env);
    return t_done();
}
