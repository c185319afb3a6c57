/* gpu-e2e.h: what the end-to-end GPU tests of the programs (gpu-draft.c, gpu-eval.c,
 * gpu-pipeline.c) share: the folders they run in and the device they run on. Header-only;
 * include after t.h and backend.h. */
#ifndef DFL_GPU_E2E_H
#define DFL_GPU_E2E_H

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu-sh.h"

/* the test's own folder, the programs', the test tools', a scratch folder */
static char self_dir[4096], bin[4200], tools[4200], dir[4200];
/* DFL_TEST_DEVICE=cpu runs the test's own machinery on the CPU */
static const char *device = "cuda";

static bool have_device(void) { return strcmp(device, "cpu") == 0 || dfl_be_cuda_available(); }

/* Sets the folders and the device from argv[0] and the environment. */
static void e2e_init(const char *argv0)
{
    snprintf(self_dir, sizeof self_dir, "%s", t_self_dir(argv0));
    const char *d = getenv("DFL_TEST_DEVICE");
    if (d && *d)
        device = d;
    t_build_dir(bin, sizeof bin, "DFL_BIN", self_dir, "bin");
    t_build_dir(tools, sizeof tools, "DFL_TOOLS", self_dir, "tools");
    snprintf(dir, sizeof dir, "%s", t_tmpdir());
}

#endif
