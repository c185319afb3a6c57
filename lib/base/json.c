/* json.c: bounded JSON parsing and typed getters over jansson (see json.h). */
#include "json.h"

#include <string.h>

#include "util.h"

/* Nesting depth of the text itself, checked before jansson sees it (jansson's own limit is a
 * compile-time constant of 2048, far too deep for anything we read). Strings are skipped. */
bool dfl_json_depth_ok(const char *s, size_t n, int max)
{
    int d = 0;
    bool in_str = false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = false;
            continue;
        }
        if (c == '"')
            in_str = true;
        else if (c == '[' || c == '{') {
            if (++d > max)
                return false;
        } else if (c == ']' || c == '}')
            d--;
    }
    return true;
}

int dfl_json_parse(const char *buf, size_t len, json_t **out, const char *what, dfl_err *e)
{
    *out = NULL;
    if (len > DFL_JSON_MAX_BYTES)
        return dfl_fail(e, DFL_EDATA, "%s: JSON text of %zu bytes is over the limit of %u", what, len,
                        DFL_JSON_MAX_BYTES);
    if (memchr(buf, 0, len))
        return dfl_fail(e, DFL_EDATA, "%s: JSON text contains a NUL byte", what);
    if (!dfl_json_depth_ok(buf, len, DFL_JSON_MAX_DEPTH))
        return dfl_fail(e, DFL_EDATA, "%s: JSON nested deeper than %d levels", what, DFL_JSON_MAX_DEPTH);
    json_error_t je;
    json_t *v = json_loadb(buf, len, JSON_REJECT_DUPLICATES, &je);
    if (!v)
        return dfl_fail(e, DFL_EDATA, "%s: invalid JSON at line %d column %d: %s", what, je.line,
                        je.column, je.text);
    *out = v;
    return DFL_OK;
}

int dfl_json_load_file(const char *path, json_t **out, dfl_err *e)
{
    char *buf;
    size_t len;
    *out = NULL;
    int rc = dfl_read_file(path, DFL_JSON_MAX_BYTES, &buf, &len, e);
    if (rc)
        return rc;
    rc = dfl_json_parse(buf, len, out, path, e);
    free(buf);
    return rc;
}

static int get(const json_t *obj, const char *key, bool required, json_t **v, const char *what, dfl_err *e)
{
    *v = NULL;
    if (!json_is_object(obj))
        return dfl_fail(e, DFL_EDATA, "%s: expected a JSON object", what);
    *v = json_object_get(obj, key);
    if (!*v || json_is_null(*v)) {
        *v = NULL;
        if (required)
            return dfl_fail(e, DFL_EDATA, "%s: missing key '%s'", what, key);
    }
    return DFL_OK;
}

int dfl_json_int(const json_t *obj, const char *key, bool required, int64_t *out, const char *what, dfl_err *e)
{
    json_t *v;
    int rc = get(obj, key, required, &v, what, e);
    if (rc || !v)
        return rc;
    if (json_is_integer(v)) {
        *out = json_integer_value(v);
        return DFL_OK;
    }
    if (json_is_real(v)) { /* 4096.0 is an integer written by some tools */
        double d = json_real_value(v);
        /* range first: converting a double outside int64_t is undefined */
        if (d > -9.2e18 && d < 9.2e18 && d == (double)(int64_t)d) {
            *out = (int64_t)d;
            return DFL_OK;
        }
    }
    return dfl_fail(e, DFL_EDATA, "%s: key '%s' must be an integer", what, key);
}

int dfl_json_num(const json_t *obj, const char *key, bool required, double *out, const char *what, dfl_err *e)
{
    json_t *v;
    int rc = get(obj, key, required, &v, what, e);
    if (rc || !v)
        return rc;
    if (!json_is_number(v))
        return dfl_fail(e, DFL_EDATA, "%s: key '%s' must be a number", what, key);
    *out = json_number_value(v);
    return DFL_OK;
}

int dfl_json_bool(const json_t *obj, const char *key, bool required, bool *out, const char *what, dfl_err *e)
{
    json_t *v;
    int rc = get(obj, key, required, &v, what, e);
    if (rc || !v)
        return rc;
    if (!json_is_boolean(v))
        return dfl_fail(e, DFL_EDATA, "%s: key '%s' must be true or false", what, key);
    *out = json_is_true(v);
    return DFL_OK;
}

int dfl_json_str(const json_t *obj, const char *key, bool required, const char **out, const char *what, dfl_err *e)
{
    json_t *v;
    int rc = get(obj, key, required, &v, what, e);
    if (rc || !v)
        return rc;
    if (!json_is_string(v))
        return dfl_fail(e, DFL_EDATA, "%s: key '%s' must be a string", what, key);
    *out = json_string_value(v);
    return DFL_OK;
}

char *dfl_json_dump(const json_t *v, int indent)
{
    size_t flags = JSON_SORT_KEYS | JSON_REAL_PRECISION(17) | JSON_ENCODE_ANY;
    flags |= indent > 0 ? JSON_INDENT(indent) : JSON_COMPACT;
    return json_dumps(v, flags);
}

int dfl_json_write_file(const char *path, const json_t *v, dfl_err *e)
{
    char *s = dfl_json_dump(v, 2);
    if (!s)
        return dfl_fail(e, DFL_ENOMEM, "%s: cannot serialize JSON", path);
    size_t n = strlen(s);
    char *t = realloc(s, n + 2);
    if (!t) {
        free(s);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    }
    t[n] = '\n';
    t[n + 1] = 0;
    int rc = dfl_write_file_atomic(path, t, n + 1, e);
    free(t);
    return rc;
}
