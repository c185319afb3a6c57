/* log.c: levelled logging to stderr. One write() per line so that lines from threads and from
 * several processes sharing a terminal do not interleave mid-line. */
#include "log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int dfl_log_level = DFL_LOG_INFO;
const char *dfl_progname = "dfl";

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static int progress_pending; /* a \r progress line is on the terminal */

static void emit(const char *buf, size_t n)
{
    while (n > 0) {
        ssize_t w = write(2, buf, n);
        if (w <= 0)
            return;
        buf += w;
        n -= (size_t)w;
    }
}

static void vlog(int level, int progress, const char *fmt, va_list ap)
{
    if (level > dfl_log_level)
        return;
    char line[2048];
    size_t n = 0;
    int tty = isatty(2);
    pthread_mutex_lock(&log_mu);
    if (progress_pending && !(progress && tty))
        line[n++] = '\n';
    progress_pending = 0;
    const char *tag = level == DFL_LOG_ERROR ? "error: " : level == DFL_LOG_WARN ? "warning: " : "";
    int k = snprintf(line + n, sizeof line - n, "%s: %s", dfl_progname, tag);
    if (k > 0)
        n += (size_t)k < sizeof line - n ? (size_t)k : sizeof line - n - 1;
    k = vsnprintf(line + n, sizeof line - n, fmt, ap);
    if (k > 0)
        n += (size_t)k < sizeof line - n ? (size_t)k : sizeof line - n - 1;
    while (n > 0 && line[n - 1] == '\n')
        n--;
    if (progress && tty) {
        if (n + 4 < sizeof line) {
            memmove(line + 1, line, n);
            line[0] = '\r';
            n++;
            memcpy(line + n, "\033[K", 3); /* clear to end of line */
            n += 3;
        }
        progress_pending = 1;
    } else if (n < sizeof line) {
        line[n++] = '\n';
    }
    emit(line, n);
    pthread_mutex_unlock(&log_mu);
}

void dfl_log(int level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog(level, 0, fmt, ap);
    va_end(ap);
}

void dfl_progress(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog(DFL_LOG_INFO, 1, fmt, ap);
    va_end(ap);
}

void dfl_progress_end(void)
{
    pthread_mutex_lock(&log_mu);
    if (progress_pending)
        emit("\n", 1);
    progress_pending = 0;
    pthread_mutex_unlock(&log_mu);
}
