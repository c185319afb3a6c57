/* tensorview.c: see tensorview.h. */
#include "tensorview.h"

#include <inttypes.h>
#include <stdio.h>

const char *dfl_shape_str(int ndim, const int64_t *shape, char *buf, size_t n)
{
    size_t k = 0;
    if (n == 0)
        return buf;
    buf[0] = 0;
    k += (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%" PRId64, i ? ", " : "", shape[i]);
    if (k < n)
        snprintf(buf + k, n - k, "]");
    return buf;
}
