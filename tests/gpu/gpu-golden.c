/* gpu-golden.c: the drafter's training step on CUDA against the goldens, through
 * build/tests/dflash-golden FILE --device cuda: the project's own small golden
 * (tests/fixtures/golden/drafter-small.safetensors: head_dim 16, 4 x 16 != hidden 32, weight
 * decay; its bf16 attention takes the exact per-row kernels, not the tiled ones) and, when
 * $DFL_ORACLE is there, the shared SpecForge golden ($DFL_ORACLE/dflash-tiny: head_dim 32, the
 * tiled kernels in bf16), each with --act f32 (float32 tolerances: doc/dflash-step.md section 6)
 * and --act bf16 (the training mode, at dflash-golden's bf16 tolerances). A missing fixture fails;
 * a missing oracle skips (tests/run-checks fails the run for that unless DFL_ALLOW_SKIP=1).
 * Skips without a GPU (77). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "../unit/t.h"

static char testbin[4200];

/* dflash-golden FILE --device cuda --act ACT, its output in the scratch directory */
static void golden_on_cuda(const char *file, const char *act, const char *tag)
{
    char log[4200], cmd[16384];
    snprintf(log, sizeof log, "%s/%s-%s.log", t_tmpdir(), tag, act);
    snprintf(cmd, sizeof cmd, "'%s/dflash-golden' '%s' --device cuda --act %s > '%s' 2>&1", testbin,
             file, act, log);
    int st = system(cmd);
    int rc = st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    T_CHECK(rc == 0, "dflash-golden %s --device cuda --act %s: exit %d (see %s)", file, act, rc, log);
    snprintf(cmd, sizeof cmd, "tail -n 1 '%s'", log);
    printf("# %s --act %s: ", tag, act);
    fflush(stdout);
    if (system(cmd) != 0)
        printf("\n");
}

static void own(const char *act)
{
    if (!dfl_be_cuda_available())
        T_SKIP("no GPU");
    char file[4200];
    snprintf(file, sizeof file, "%s/tests/fixtures/golden/drafter-small.safetensors", t_src_root());
    T_CHECK(access(file, R_OK) == 0, "%s is missing", file);
    golden_on_cuda(file, act, "drafter-small");
}

static void shared(const char *act)
{
    if (!dfl_be_cuda_available())
        T_SKIP("no GPU");
    char file[4200];
    T_NEED_ORACLE(file, NULL, "dflash-tiny/golden.safetensors");
    golden_on_cuda(file, act, "dflash-tiny");
}

static void test_own_golden_f32(void) { own("f32"); }
static void test_own_golden_bf16(void) { own("bf16"); }
static void test_shared_golden_f32(void) { shared("f32"); }
static void test_shared_golden_bf16(void) { shared("bf16"); }

int main(int argc, char **argv)
{
    t_init(argv[0]);
    const char *self_dir = t_self_dir(argv[0]);
    t_build_dir(testbin, sizeof testbin, "DFL_TESTBIN", self_dir, "tests");
    T_RUN(test_own_golden_f32);
    T_RUN(test_own_golden_bf16);
    T_RUN(test_shared_golden_f32);
    T_RUN(test_shared_golden_bf16);
    return t_done();
}
