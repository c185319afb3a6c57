/* err.c: error codes and messages (see err.h). */
#include "err.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static void vset(dfl_err *e, int code, const char *fmt, va_list ap)
{
    e->code = code;
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
}

int dfl_fail(dfl_err *e, int code, const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        vset(e, code, fmt, ap);
        va_end(ap);
    }
    return code;
}

int dfl_fail_empty(dfl_err *e, const char *name)
{
    return dfl_fail(e, DFL_ETRUNC, "%s: truncated: empty input (no bytes at all)", name);
}

int dfl_fail_errno(dfl_err *e, int code, int errnum, const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        vset(e, code, fmt, ap);
        va_end(ap);
        size_t n = strlen(e->msg);
        snprintf(e->msg + n, sizeof e->msg - n, ": %s", strerror(errnum));
    }
    return code;
}

int dfl_err_prefix(dfl_err *e, const char *fmt, ...)
{
    if (!e)
        return DFL_OK;
    char pre[512], old[sizeof e->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    memcpy(old, e->msg, sizeof old);
    snprintf(e->msg, sizeof e->msg, "%s%s", pre, old);
    return e->code;
}

void dfl_err_clear(dfl_err *e)
{
    if (e) {
        e->code = DFL_OK;
        e->msg[0] = 0;
    }
}

int dfl_exit_code(int code)
{
    switch (code) {
    case DFL_OK: return 0;
    case DFL_EDATA: case DFL_ETRUNC: case DFL_EUNSUP: case DFL_ENAN: case DFL_EMISMATCH: return 2;
    default: return 1;
    }
}

const char *dfl_code_name(int code)
{
    static const char *names[DFL_ECODE_COUNT] = {
        "ok", "usage", "io", "nomem", "device", "pipe", "interrupted",
        "data", "truncated", "unsupported", "non-finite", "mismatch",
    };
    return code >= 0 && code < DFL_ECODE_COUNT ? names[code] : "unknown";
}
