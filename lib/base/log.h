/* log.h: levelled logging to stderr (never stdout). Programs set the level from -q / -v. */
#ifndef DFL_LOG_H
#define DFL_LOG_H

enum { DFL_LOG_QUIET = 0, DFL_LOG_ERROR = 1, DFL_LOG_WARN = 2, DFL_LOG_INFO = 3,
       DFL_LOG_VERBOSE = 4, DFL_LOG_DEBUG = 5 };

extern int dfl_log_level;          /* default DFL_LOG_INFO */
extern const char *dfl_progname;   /* prefix of every line; set by programs */

void dfl_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Progress line that rewrites itself on a terminal (\r), plain lines otherwise; level INFO. */
void dfl_progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Ends a progress line (prints the newline if one is pending). */
void dfl_progress_end(void);

#define dfl_error(...) dfl_log(DFL_LOG_ERROR, __VA_ARGS__)
#define dfl_warn(...) dfl_log(DFL_LOG_WARN, __VA_ARGS__)
#define dfl_info(...) dfl_log(DFL_LOG_INFO, __VA_ARGS__)
#define dfl_verbose(...) dfl_log(DFL_LOG_VERBOSE, __VA_ARGS__)
#define dfl_debug(...) dfl_log(DFL_LOG_DEBUG, __VA_ARGS__)

#endif
