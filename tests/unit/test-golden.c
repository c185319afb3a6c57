/* test-golden.c: runs build/tests/dflash-golden on the shared SpecForge goldens
 * ($DFL_ORACLE/dflash-tiny/golden.safetensors, full-attention layers, and
 * $DFL_ORACLE/dflash-swa/golden.safetensors, a sliding-window layer): the drafter's training step
 * must reproduce each within doc/dflash-step.md section 6's tolerances, on the CPU and (with a
 * GPU) on CUDA in f32 and bf16. Skipped when the oracle directory is absent.
 * And on the project's own small golden (tests/fixtures/golden/drafter-small.safetensors, made by
 * tests/tools/mkgolden), which is never skipped: a missing fixture fails, a copy with one value
 * moved by 10x its tolerance fails the check of that value, and mkgolden refuses to write a
 * golden when the "oracle" it is given does not pass. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "safetensors.h"
#include "golden_tol.h"
#include "t.h"

/* Runs dflash-golden on $DFL_ORACLE/NAME/golden.safetensors with the options opts (skips when
 * it is absent). */
static void run_golden(const char *name, const char *opts)
{
    char file[4096], cmd[8192];
    T_NEED_ORACLE(file, NULL, "%s/golden.safetensors", name);
    const char *bin = getenv("DFL_TESTBIN");
    snprintf(cmd, sizeof cmd, "'%s/dflash-golden' '%s' %s", bin && *bin ? bin : "build/tests", file,
             opts);
    int st = system(cmd);
    T_CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: exit status %d", cmd,
            st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}

static void test_dflash_tiny_golden(void) { run_golden("dflash-tiny", ""); }

/* layer_types [sliding_attention, full_attention], sliding_window 24 */
static void test_dflash_swa_golden(void) { run_golden("dflash-swa", ""); }

/* The same on CUDA (skipped without a GPU): f32 activations at the float32 tolerances, bf16 at
 * dflash-golden's bf16 tolerances. */
#define CUDA_GOLDEN(fn, name, act)                                      \
    static void fn(void)                                                \
    {                                                                   \
        if (!dfl_be_cuda_available())                                   \
            T_SKIP("no CUDA GPU");                                      \
        run_golden(name, "--device cuda --act " act);                   \
    }
CUDA_GOLDEN(test_dflash_tiny_golden_cuda_f32, "dflash-tiny", "f32")
CUDA_GOLDEN(test_dflash_tiny_golden_cuda_bf16, "dflash-tiny", "bf16")
CUDA_GOLDEN(test_dflash_swa_golden_cuda_f32, "dflash-swa", "f32")
CUDA_GOLDEN(test_dflash_swa_golden_cuda_bf16, "dflash-swa", "bf16")

static void test_rejects_missing_file(void)
{
    const char *bin = getenv("DFL_TESTBIN");
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s/dflash-golden' /nonexistent/golden.safetensors 2>/dev/null",
             bin && *bin ? bin : "build/tests");
    int st = system(cmd);
    T_CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 2, "exit status %d for a missing file",
            st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}

/* ---- the project's own golden ------------------------------------------------------------ */

static char testbin[4200], tools[4200];

static const char *fixture(void)
{
    static char p[4200];
    snprintf(p, sizeof p, "%s/tests/fixtures/golden/drafter-small.safetensors", t_src_root());
    return p;
}

/* dflash-golden FILE [ARGS] with its output in LOG; returns its exit status (-1: did not exit) */
static int golden(const char *file, const char *log)
{
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "'%s/dflash-golden' '%s' > '%s' 2>&1", testbin, file, log);
    int st = system(cmd);
    return st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* A line of LOG starting with `label` and ending in FAIL. */
static bool log_fails(const char *log, const char *label)
{
    FILE *f = fopen(log, "r");
    char line[1024];
    bool found = false;
    while (f && !found && fgets(line, sizeof line, f))
        found = strncmp(line, label, strlen(label)) == 0 && strstr(line, " FAIL");
    if (f)
        fclose(f);
    return found;
}

/* A copy of the fixture at OUT with tensor NAME's largest-|x| element x moved by
 * delta = abs + rel * |x| (f32 tensors only). */
static bool perturbed_copy(const char *name, double abs_delta, double rel_delta, const char *out)
{
    dfl_err e = {0};
    dfl_st_file *f;
    if (dfl_st_open(&f, fixture(), &e)) {
        T_CHECK(0, "%s", e.msg);
        return false;
    }
    char *bytes = malloc(f->map.size);
    memcpy(bytes, f->map.data, f->map.size);
    const dfl_st_tensor *t = dfl_st_find(f, name);
    bool ok = t && t->dtype == DFL_F32 && t->numel > 0;
    T_CHECK(ok, "the fixture has no f32 tensor %s", name);
    if (ok) {
        uint64_t at = 0;
        float x, best = -1;
        for (uint64_t i = 0; i < t->numel; i++) {
            memcpy(&x, (const char *)t->data + 4 * i, 4);
            if (fabsf(x) > best)
                best = fabsf(x), at = i;
        }
        memcpy(&x, bytes + t->offset + 4 * at, 4);
        x = (float)(x + abs_delta + rel_delta * fabs(x));
        memcpy(bytes + t->offset + 4 * at, &x, 4);
        FILE *o = fopen(out, "wb");
        ok = o && fwrite(bytes, 1, f->map.size, o) == f->map.size;
        if (o)
            ok = fclose(o) == 0 && ok;
        T_CHECK(ok, "cannot write %s", out);
    }
    free(bytes);
    dfl_st_close(f);
    return ok;
}

static void test_own_golden(void)
{
    char log[4200];
    snprintf(log, sizeof log, "%s/own.log", t_tmpdir());
    T_CHECK(access(fixture(), R_OK) == 0, "%s is missing: a fresh clone must check the drafter's "
            "math (tests/fixtures/golden/README says how it is made)", fixture());
    int rc = golden(fixture(), log);
    T_CHECK(rc == 0, "dflash-golden %s: exit %d (see %s)", fixture(), rc, log);
}

/* Each value moved by 10x its tolerance (doc/dflash-step.md section 6) fails its own check; the
 * unchanged copy passes. */
static void test_own_golden_perturbed(void)
{
    static const struct {
        const char *tensor;
        double abs, rel;
        const char *check;   /* the line that must fail; NULL: none (exit 0) */
    } cases[] = {
        {"loss", 0, 0, NULL},
        {"grad.layers.1.self_attn.q_proj.weight", 0, 1e-3, "gradients (layers.1.self_attn.q_proj.weight)"},
        {"grad.layers.0.mlp.down_proj.weight", 0, 1e-3, "gradients (layers.0.mlp.down_proj.weight)"},
        {"loss", 0, 1e-4, "loss "},
        {"dbg.layer0.out", 1e-3, 0, "dbg.layer0.out"},
        {"acc_num", 1, 0, "acc_num/acc_den"},
        {"after_adamw.fc.weight", 1e-5, 0, "AdamW on the golden grads (fc.weight)"},
        {"seq1.loss_den", 0, 1e-4, "seq1 loss_den"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char copy[4200], log[4200];
        snprintf(copy, sizeof copy, "%s/perturbed-%zu.safetensors", t_tmpdir(), i);
        snprintf(log, sizeof log, "%s/perturbed-%zu.log", t_tmpdir(), i);
        if (!perturbed_copy(cases[i].tensor, cases[i].abs, cases[i].rel, copy))
            continue;
        int rc = golden(copy, log);
        if (!cases[i].check) {
            T_CHECK(rc == 0, "the unchanged copy: exit %d (see %s)", rc, log);
            continue;
        }
        T_CHECK(rc == 1 && log_fails(log, cases[i].check), "%s moved by %g + %g x |x|: exit %d, "
                "expected 1 with '%s ... FAIL' (see %s)", cases[i].tensor, cases[i].abs,
                cases[i].rel, rc, cases[i].check, log);
        unlink(copy);
    }
}

/* mkgolden DIR OUT with DIR as the oracle directory; returns its exit status. */
static int mkgolden(const char *oracle, const char *out, const char *args)
{
    char cmd[16384];
    snprintf(cmd, sizeof cmd, "'%s/mkgolden' --oracle '%s' --golden-bin '%s/dflash-golden' %s '%s' "
             "2> '%s.log'", tools, oracle, testbin, args, out, out);
    int st = system(cmd);
    return st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* mkgolden checks the build against the oracle first: given a directory whose
 * dflash-tiny/golden.safetensors does not pass (our fixture with a gradient moved), it refuses and
 * writes nothing; given one that passes (the fixture itself stands in for the 24 MB shared file),
 * it writes a golden that passes, the same bytes twice. */
static void test_mkgolden(void)
{
    char bad[4200], good[4200], p[4400], out[4400], out2[4400];
    snprintf(bad, sizeof bad, "%s/bad-oracle", t_tmpdir());
    snprintf(good, sizeof good, "%s/good-oracle", t_tmpdir());
    snprintf(p, sizeof p, "mkdir -p '%s/dflash-tiny' '%s/dflash-tiny' && cp '%s' '%s/dflash-tiny/golden.safetensors'",
             bad, good, fixture(), good);
    T_CHECK(system(p) == 0, "%s", p);
    snprintf(p, sizeof p, "%s/dflash-tiny/golden.safetensors", bad);
    if (!perturbed_copy("grad.norm.weight", 0, 1e-3, p))
        return;
    snprintf(out, sizeof out, "%s/refused.safetensors", t_tmpdir());
    int rc = mkgolden(bad, out, "");
    T_CHECK(rc == 1, "mkgolden with a failing oracle: exit %d, expected 1 (see %s.log)", rc, out);
    snprintf(p, sizeof p, "%s.partial", out);
    T_CHECK(access(out, F_OK) != 0 && access(p, F_OK) != 0, "mkgolden refused but left %s or %s", out, p);

    snprintf(out, sizeof out, "%s/seed7.safetensors", t_tmpdir());
    snprintf(out2, sizeof out2, "%s/seed7-again.safetensors", t_tmpdir());
    rc = mkgolden(good, out, "--seed 7");
    T_CHECK(rc == 0, "mkgolden --seed 7: exit %d (see %s.log)", rc, out);
    rc = mkgolden(good, out2, "--seed 7");
    T_CHECK(rc == 0, "mkgolden --seed 7 again: exit %d (see %s.log)", rc, out2);
    snprintf(p, sizeof p, "cmp -s '%s' '%s'", out, out2);
    T_CHECK(system(p) == 0, "two runs of mkgolden --seed 7 differ: %s %s", out, out2);
    snprintf(p, sizeof p, "%s.check", out);
    rc = golden(out, p);
    T_CHECK(rc == 0, "dflash-golden on mkgolden's output: exit %d (see %s)", rc, p);
    snprintf(p, sizeof p, "cmp -s '%s' '%s'", out, fixture());
    T_CHECK(system(p) != 0, "--seed 7 made the same file as the default seed");
}

/* dflash-golden's count and accuracy tolerances agree: k flipped argmaxes among acc_den scored
 * slots (accuracy off by k / acc_den) pass both checks or neither, in float32 and in bf16 */
static void test_count_and_accuracy_tolerances_agree(void)
{
    static const double dens[] = {1, 7, 49, 50, 51, 100, 1126, 4096, 12345, 999999};
    for (int mode = 0; mode < 2; mode++)
        for (size_t i = 0; i < sizeof dens / sizeof *dens; i++) {
            double den = dens[i], ct = golden_count_tol(mode, den), at = golden_acc_tol(mode, den);
            for (double k = 0; k <= ct + 3; k++) {
                bool count_ok = k <= ct, acc_ok = k / den <= at;
                T_CHECK(count_ok == acc_ok, "%s, %g scored slots, %g flipped: counts %s (tol %g), "
                        "accuracy %s (%.3g, tol %.3g)", mode ? "bf16" : "f32", den, k,
                        count_ok ? "pass" : "fail", ct, acc_ok ? "pass" : "fail", k / den, at);
            }
        }
    /* the case that was inconsistent: 1,126 scored slots, one flip (8.9e-4) in bf16 */
    T_CHECK(1 <= golden_count_tol(true, 1126) && 1.0 / 1126 <= golden_acc_tol(true, 1126),
            "one flip among 1126 slots: counts tol %g, accuracy tol %g", golden_count_tol(true, 1126),
            golden_acc_tol(true, 1126));
    T_CHECK(golden_count_tol(false, 1126) == 0 && !(1.0 / 1126 <= golden_acc_tol(false, 1126)),
            "float32: one flip fails both");
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    const char *self_dir = t_self_dir(argv[0]);
    t_build_dir(testbin, sizeof testbin, "DFL_TESTBIN", self_dir, "tests");
    t_build_dir(tools, sizeof tools, "DFL_TOOLS", self_dir, "tools");
    T_RUN(test_dflash_tiny_golden);
    T_RUN(test_dflash_swa_golden);
    T_RUN(test_dflash_tiny_golden_cuda_f32);
    T_RUN(test_dflash_tiny_golden_cuda_bf16);
    T_RUN(test_dflash_swa_golden_cuda_f32);
    T_RUN(test_dflash_swa_golden_cuda_bf16);
    T_RUN(test_rejects_missing_file);
    T_RUN(test_own_golden);
    T_RUN(test_own_golden_perturbed);
    T_RUN(test_mkgolden);
    T_RUN(test_count_and_accuracy_tolerances_agree);
    return t_done();
}
