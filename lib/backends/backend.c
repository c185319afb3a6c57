/* backend.c: choosing a backend from a --device string. */
#include "backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

bool dfl_be_cuda_available(void)
{
#ifdef DFL_CUDA
    return dfl_be_cuda_count() > 0;
#else
    return false;
#endif
}

int dfl_be_open(dfl_be **be, const char *device, dfl_dtype act, dfl_err *e)
{
    *be = NULL;
    if (!device || strcmp(device, "cpu") == 0) {
        if (act != DFL_DT_INVALID && act != DFL_F32)
            return dfl_fail(e, DFL_EUSAGE, "--device cpu computes in f32 only (asked for %s)",
                            dfl_dtype_lower(act));
        return dfl_be_cpu_open(be, 0, e);
    }
    if (strncmp(device, "cuda", 4) == 0 && (device[4] == 0 || device[4] == ':')) {
        int64_t idx = 0;
        if (device[4] == ':') {
            int rc = dfl_parse_i64(device + 5, 0, 1023, &idx, "--device", e);
            if (rc)
                return rc;
        }
#ifdef DFL_CUDA
        int n = dfl_be_cuda_count();
        if (n <= 0)
            return dfl_fail(e, DFL_EDEVICE, "--device %s: no CUDA GPU found (use --device cpu)", device);
        if (idx >= n)
            return dfl_fail(e, DFL_EDEVICE, "--device %s: only %d CUDA GPU%s found", device, n,
                            n == 1 ? "" : "s");
        return dfl_be_cuda_open(be, (int)idx, act, e);
#else
        return dfl_fail(e, DFL_EDEVICE, "--device %s: this build has no CUDA support (built with "
                        "CUDA=0 or without nvcc); use --device cpu", device);
#endif
    }
    return dfl_fail(e, DFL_EUSAGE, "--device: '%s' is not cpu, cuda or cuda:N", device);
}

const char *dfl_be_device_for_rank(const char *device, int local_rank, char *buf, size_t n)
{
    if (device && strcmp(device, "cuda") == 0) {
        snprintf(buf, n, "cuda:%d", local_rank);
        return buf;
    }
    snprintf(buf, n, "%s", device ? device : "cpu");
    return buf;
}

void dfl_be_close(dfl_be *be)
{
    if (!be)
        return;
    if (be->ops && be->ops->sync)
        be->ops->sync(be, NULL);
    extern void dfl_be_cpu_destroy(dfl_be *);
#ifdef DFL_CUDA
    extern void dfl_be_cuda_destroy(dfl_be *);
    if (be->kind == DFL_BE_CUDA) {
        dfl_be_cuda_destroy(be);
        return;
    }
#endif
    dfl_be_cpu_destroy(be);
}
