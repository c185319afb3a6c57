/* test-golden.c: runs build/tests/dflash-golden on the shared SpecForge golden
 * ($DFL_ORACLE/dflash-tiny/golden.safetensors): the drafter's training step must reproduce it
 * within doc/dflash-step.md section 6's tolerances. Skipped when the oracle directory is absent. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "t.h"

static void test_dflash_tiny_golden(void)
{
    const char *oracle = t_oracle();
    if (!oracle)
        T_SKIP("no oracle directory (set DFL_ORACLE)");
    char file[4096], cmd[8192];
    snprintf(file, sizeof file, "%s/dflash-tiny/golden.safetensors", oracle);
    if (access(file, R_OK) != 0)
        T_SKIP("%s is absent", file);
    const char *bin = getenv("DFL_TESTBIN");
    snprintf(cmd, sizeof cmd, "'%s/dflash-golden' '%s'", bin && *bin ? bin : "build/tests", file);
    int st = system(cmd);
    T_CHECK(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: exit status %d", cmd,
            st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1);
}

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
    T_RUN(test_rejects_missing_file);
    return t_done();
}
