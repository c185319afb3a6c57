/* tune_file.c: see tune_file.h. */
#include "tune_file.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "json.h"
#include "util.h"

#define TUNE_FORMAT "dfl-tune 1"

struct dfl_tune_file {
    char *path;
    json_t *root;    /* {"format", "scope", "products"} as read or as put */
    char scope[sizeof(((dfl_mm_algo *)0)->scope)];
    bool changed;
};

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* 128 lowercase hex digits into DFL_MM_ALGO_BYTES bytes; false when s is not that */
static bool unhex(const char *s, uint8_t *out)
{
    if (strlen(s) != 2 * DFL_MM_ALGO_BYTES)
        return false;
    for (int i = 0; i < DFL_MM_ALGO_BYTES; i++) {
        int hi = hexval(s[2 * i]), lo = hexval(s[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return false;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return true;
}

/* Checks root as read from f->path; fills f->scope */
static int check(dfl_tune_file *f, dfl_err *e)
{
    const char *p = f->path;
    if (!json_is_object(f->root))
        return dfl_fail(e, DFL_EDATA, "%s: not a JSON object (a --tune-file holds {\"format\": \"%s\", "
                        "\"scope\": ..., \"products\": {...}})", p, TUNE_FORMAT);
    const char *k;
    json_t *v;
    json_object_foreach(f->root, k, v) {
        if (strcmp(k, "format") && strcmp(k, "scope") && strcmp(k, "products"))
            return dfl_fail(e, DFL_EDATA, "%s: unknown key '%s' (a --tune-file holds format, scope and "
                            "products)", p, k);
    }
    const char *fmt = NULL, *scope = NULL;
    int rc = dfl_json_str(f->root, "format", true, &fmt, p, e);
    if (rc)
        return rc;
    if (strcmp(fmt, TUNE_FORMAT))
        return dfl_fail(e, DFL_EDATA, "%s: format '%s' is not '%s'", p, fmt, TUNE_FORMAT);
    if ((rc = dfl_json_str(f->root, "scope", true, &scope, p, e)))
        return rc;
    if (!scope[0] || strlen(scope) >= sizeof f->scope)
        return dfl_fail(e, DFL_EDATA, "%s: scope must be 1 to %zu characters", p, sizeof f->scope - 1);
    json_t *prods = json_object_get(f->root, "products");
    if (!json_is_object(prods))
        return dfl_fail(e, DFL_EDATA, "%s: key 'products' must be an object (product key: algorithm)", p);
    json_object_foreach(prods, k, v) {
        uint8_t b[DFL_MM_ALGO_BYTES];
        if (!k[0] || strlen(k) >= sizeof(((dfl_mm_algo *)0)->key))
            return dfl_fail(e, DFL_EDATA, "%s: a product key must be 1 to %zu characters", p,
                            sizeof(((dfl_mm_algo *)0)->key) - 1);
        if (!json_is_string(v) || !unhex(json_string_value(v), b))
            return dfl_fail(e, DFL_EDATA, "%s: product '%s': the algorithm must be %d lowercase hex digits",
                            p, k, 2 * DFL_MM_ALGO_BYTES);
    }
    snprintf(f->scope, sizeof f->scope, "%s", scope);
    return DFL_OK;
}

int dfl_tune_file_open(dfl_tune_file **out, const char *path, dfl_err *e)
{
    *out = NULL;
    dfl_tune_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = dfl_strdup(path))) {
        free(f);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    }
    struct stat st;
    int rc = DFL_OK;
    if (stat(path, &st) != 0 && errno == ENOENT) {
        f->root = NULL;   /* absent: empty */
    } else if ((rc = dfl_json_load_file(path, &f->root, e)) || (rc = check(f, e))) {
        dfl_tune_file_close(f);
        return rc;
    }
    *out = f;
    return DFL_OK;
}

bool dfl_tune_file_get(const dfl_tune_file *f, dfl_mm_algo *a)
{
    if (!f->root || strcmp(f->scope, a->scope))
        return false;
    json_t *v = json_object_get(json_object_get(f->root, "products"), a->key);
    return v && json_is_string(v) && unhex(json_string_value(v), a->bytes);
}

int dfl_tune_file_put(dfl_tune_file *f, const dfl_mm_algo *a, dfl_err *e)
{
    if (!a->scope[0] || !a->key[0])
        return dfl_fail(e, DFL_EUSAGE, "%s: a product without a key or scope", f->path);
    if (!f->root || strcmp(f->scope, a->scope)) {
        json_decref(f->root);
        f->root = json_pack("{s:s, s:s, s:{}}", "format", TUNE_FORMAT, "scope", a->scope, "products");
        if (!f->root)
            return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", f->path);
        snprintf(f->scope, sizeof f->scope, "%s", a->scope);
    }
    char hex[2 * DFL_MM_ALGO_BYTES + 1];
    for (int i = 0; i < DFL_MM_ALGO_BYTES; i++)
        snprintf(hex + 2 * i, 3, "%02x", a->bytes[i]);
    json_t *prods = json_object_get(f->root, "products");
    json_t *old = json_object_get(prods, a->key);
    if (old && json_is_string(old) && !strcmp(json_string_value(old), hex))
        return DFL_OK;
    if (json_object_set_new(prods, a->key, json_string(hex)))
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", f->path);
    f->changed = true;
    return DFL_OK;
}

int dfl_tune_file_count(const dfl_tune_file *f, const char *scope)
{
    if (!f->root || strcmp(f->scope, scope))
        return 0;
    return (int)json_object_size(json_object_get(f->root, "products"));
}

const char *dfl_tune_file_scope(const dfl_tune_file *f) { return f->scope; }

const char *dfl_tune_file_path(const dfl_tune_file *f) { return f->path; }

int dfl_tune_file_save(dfl_tune_file *f, bool *written, dfl_err *e)
{
    if (written)
        *written = false;
    if (!f->changed)
        return DFL_OK;
    int rc = dfl_json_write_file(f->path, f->root, e);
    if (!rc) {
        f->changed = false;
        if (written)
            *written = true;
    }
    return rc;
}

void dfl_tune_file_close(dfl_tune_file *f)
{
    if (!f)
        return;
    json_decref(f->root);
    free(f->path);
    free(f);
}
