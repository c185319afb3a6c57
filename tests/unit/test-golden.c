/* test-golden.c: runs build/tests/dflash-golden on the shared SpecForge goldens
 * ($DFL_ORACLE/dflash-tiny/golden.safetensors, full-attention layers, and
 * $DFL_ORACLE/dflash-swa/golden.safetensors, a sliding-window layer): the drafter's training step
 * must reproduce each within DFLASH.md section 11's tolerances, on the CPU and (with a GPU) on
 * CUDA in f32 and bf16. Skipped when the oracle directory is absent. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "t.h"

/* Runs dflash-golden on $DFL_ORACLE/NAME/golden.safetensors with the options opts (skips when
 * it is absent). */
static void run_golden(const char *name, const char *opts)
{
    const char *oracle = t_oracle();
    if (!oracle)
        T_SKIP("no oracle directory (set DFL_ORACLE)");
    char file[4096], cmd[8192];
    snprintf(file, sizeof file, "%s/%s/golden.safetensors", oracle, name);
    if (access(file, R_OK) != 0)
        T_SKIP("%s is absent", file);
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

int main(int argc, char **argv)
{
    t_init(argv[0]);
    T_RUN(test_dflash_tiny_golden);
    T_RUN(test_dflash_swa_golden);
    T_RUN(test_dflash_tiny_golden_cuda_f32);
    T_RUN(test_dflash_tiny_golden_cuda_bf16);
    T_RUN(test_dflash_swa_golden_cuda_f32);
    T_RUN(test_dflash_swa_golden_cuda_bf16);
    T_RUN(test_rejects_missing_file);
    return t_done();
}
