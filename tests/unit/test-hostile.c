/* test-hostile.c: hostile-input bounds of the readers that the other unit tests do not pin down
 * exactly (issue #9): JSON nesting and size limits at their edges, integers that do not fit,
 * and files that are not regular files where a mapping is wanted. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"
#include "safetensors.h"
#include "t.h"
#include "util.h"

/* "[[[...1...]]]" (or {"a":{"a":...1...}}) nested depth levels deep. */
static char *nested(int depth, bool objects, size_t *len)
{
    size_t cap = (size_t)depth * 8 + 16, n = 0;
    char *s = malloc(cap);
    for (int i = 0; i < depth; i++)
        n += (size_t)snprintf(s + n, cap - n, "%s", objects ? "{\"a\":" : "[");
    s[n++] = '1';
    for (int i = 0; i < depth; i++)
        s[n++] = objects ? '}' : ']';
    s[n] = 0;
    *len = n;
    return s;
}

static void test_json_depth(void)
{
    dfl_err e;
    json_t *v;
    size_t n;
    for (int objects = 0; objects <= 1; objects++) {
        char *s = nested(DFL_JSON_MAX_DEPTH, objects, &n);
        T_CHECK(dfl_json_parse(s, n, &v, "in", &e) == DFL_OK, "depth %d accepted: %s", DFL_JSON_MAX_DEPTH, e.msg);
        json_decref(v);
        free(s);
        s = nested(DFL_JSON_MAX_DEPTH + 1, objects, &n);
        T_CHECK(dfl_json_parse(s, n, &v, "in", &e) == DFL_EDATA && strstr(e.msg, "in: JSON nested deeper than 64"),
                "depth %d refused: %s", DFL_JSON_MAX_DEPTH + 1, e.msg);
        T_CHECK(v == NULL, "no value on failure");
        free(s);
    }
    /* brackets inside strings (escaped quotes too) are not nesting */
    char str[600];
    size_t k = 0;
    k += (size_t)snprintf(str + k, sizeof str - k, "{\"k\": \"\\\"");
    for (int i = 0; i < 100; i++)
        str[k++] = i & 1 ? '{' : '[';
    k += (size_t)snprintf(str + k, sizeof str - k, "\\\\\"}");
    T_CHECK(dfl_json_parse(str, k, &v, "in", &e) == DFL_OK, "brackets in a string: %s (%s)", e.msg, str);
    json_decref(v);
    /* closing brackets first cannot buy depth for later ones */
    char tricky[400];
    k = 0;
    for (int i = 0; i < 100; i++)
        tricky[k++] = ']';
    for (int i = 0; i < 100; i++)
        tricky[k++] = '[';
    T_CHECK(dfl_json_parse(tricky, k, &v, "in", &e) == DFL_EDATA, "]]][[[ refused");
}

static void test_json_size(void)
{
    dfl_err e;
    json_t *v;
    /* one byte over the limit: refused before jansson sees it */
    size_t n = (size_t)DFL_JSON_MAX_BYTES + 1;
    char *big = malloc(n);
    T_CHECK(big != NULL, "malloc");
    if (!big)
        return;
    memset(big, ' ', n);
    big[0] = '[', big[1] = '1', big[n - 2] = ']'; /* [1    ...    ] */
    T_CHECK(dfl_json_parse(big, n, &v, "big", &e) == DFL_EDATA && strstr(e.msg, "over the limit"), "size: %s", e.msg);
    /* at the limit: parsed */
    T_CHECK(dfl_json_parse(big, n - 1, &v, "big", &e) == DFL_OK, "at the limit: %s", e.msg);
    json_decref(v);
    free(big);
    /* a file over the limit is refused while reading it (a sparse file: no disk used) */
    char path[4200];
    snprintf(path, sizeof path, "%s/big.json", t_tmpdir());
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    T_CHECK(fd >= 0 && ftruncate(fd, (off_t)DFL_JSON_MAX_BYTES + 1) == 0, "sparse file");
    close(fd);
    T_CHECK(dfl_json_load_file(path, &v, &e) == DFL_EDATA && strstr(e.msg, "larger than the limit") &&
                strstr(e.msg, path), "file size: %s", e.msg);
    T_CHECK(v == NULL, "no value on failure");
    unlink(path);
    /* NUL bytes */
    T_CHECK(dfl_json_parse("{\"a\":\"x\0\"}", 10, &v, "nul", &e) == DFL_EDATA && strstr(e.msg, "NUL"), "NUL: %s", e.msg);
    T_CHECK(dfl_json_parse("{\"a\":\"x\\u0000\"}", 15, &v, "nul", &e) == DFL_EDATA, "escaped NUL: %s", e.msg);
}

static void test_json_int_range(void)
{
    dfl_err e;
    json_t *v;
    const char *txt = "{\"big\": 1e300, \"neg\": -1e300, \"over\": 9.3e18, \"frac\": 1.5, \"max\": 9223372036854775807,"
                      " \"huge\": 1281e300, \"ok\": 4096.0, \"negok\": -2.0}";
    T_CHECK(dfl_json_parse(txt, strlen(txt), &v, "cfg", &e) == DFL_OK, "%s", e.msg);
    int64_t i = 7;
    const char *bad[] = {"big", "neg", "over", "frac", "huge"};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        T_CHECK(dfl_json_int(v, bad[k], true, &i, "cfg", &e) == DFL_EDATA && strstr(e.msg, "must be an integer") &&
                    strstr(e.msg, bad[k]), "%s: %s", bad[k], e.msg);
        T_EQ_INT(i, 7, "untouched on failure");
    }
    T_CHECK(dfl_json_int(v, "max", true, &i, "cfg", &e) == DFL_OK && i == INT64_MAX, "int64 max");
    T_CHECK(dfl_json_int(v, "ok", true, &i, "cfg", &e) == DFL_OK && i == 4096, "4096.0");
    T_CHECK(dfl_json_int(v, "negok", true, &i, "cfg", &e) == DFL_OK && i == -2, "-2.0");
    json_decref(v);
}

/* A FIFO where a file to map is wanted (a weights file, a shard) is refused at once, not waited
 * on for a writer that never comes. */
static void test_map_fifo(void)
{
    char dir[4200], path[4300];
    snprintf(dir, sizeof dir, "%s/fifo-model", t_tmpdir());
    T_CHECK(mkdir(dir, 0755) == 0, "mkdir %s", dir);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    T_CHECK(mkfifo(path, 0644) == 0, "mkfifo");
    alarm(20); /* a hang fails the test instead of the whole run waiting */
    dfl_err e;
    dfl_st_file *f = NULL;
    T_CHECK(dfl_st_open(&f, path, &e) == DFL_EIO && strstr(e.msg, "not a regular file") && strstr(e.msg, path),
            "fifo: %s", e.msg);
    T_CHECK(f == NULL, "no file");
    dfl_st_model *m = NULL;
    T_CHECK(dfl_st_model_open(&m, dir, &e) == DFL_EIO && strstr(e.msg, "not a regular file"), "fifo model: %s", e.msg);
    T_CHECK(m == NULL, "no model");
    alarm(0);
    unlink(path);
    rmdir(dir);
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    T_RUN(test_json_depth);
    T_RUN(test_json_size);
    T_RUN(test_json_int_range);
    T_RUN(test_map_fifo);
    return t_done();
}
