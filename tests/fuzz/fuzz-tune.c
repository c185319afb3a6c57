/* fuzz-tune.c: libFuzzer harness for dfl-target's --tune-file (lib/train/tune_file.c over
 * lib/base/json.c).
 *
 * The input is the file. dfl_tune_file_open either refuses it, with DFL_EDATA (or DFL_ENOMEM)
 * and a message that names the file, or accepts it; an accepted file must hold what the reader
 * promises:
 *   - its scope is 1 to 159 characters, and count under it is the number of products in the
 *     file (read again here as JSON), under any other scope 0;
 *   - every product comes back from get under the scope with the bytes its 128 hex digits spell
 *     (decoded here, not by the reader), and from get under another scope not at all;
 *   - a put of a product's own bytes changes nothing: save writes nothing;
 *   - a put of a new product is saved (atomically) and the file read back holds every old
 *     product with the same bytes, the new one, and the same scope;
 *   - a put under another scope empties the file first: read back, it holds that one product
 *     under that scope. */
#include <jansson.h>
#include <stdbool.h>

#include "fuzz.h"
#include "json.h"
#include "tune_file.h"

static char path[512];

/* the harness's own reading of an algorithm: exactly 128 lowercase hex digits, two a byte */
static bool decode(const char *s, uint8_t out[DFL_MM_ALGO_BYTES])
{
    if (strlen(s) != 2 * DFL_MM_ALGO_BYTES || strspn(s, "0123456789abcdef") != 2 * DFL_MM_ALGO_BYTES)
        return false;
    for (int i = 0; i < DFL_MM_ALGO_BYTES; i++) {
        unsigned v;
        char two[3] = {s[2 * i], s[2 * i + 1], 0};
        if (sscanf(two, "%2x", &v) != 1)
            return false;
        out[i] = (uint8_t)v;
    }
    return true;
}

static dfl_mm_algo algo(const char *scope, const char *key, uint8_t fill)
{
    dfl_mm_algo a;
    memset(&a, 0, sizeof a);
    snprintf(a.scope, sizeof a.scope, "%s", scope);
    snprintf(a.key, sizeof a.key, "%s", key);
    for (int i = 0; i < DFL_MM_ALGO_BYTES; i++)
        a.bytes[i] = (uint8_t)(fill + 7 * i);
    return a;
}

static dfl_tune_file *open_ok(const char *where)
{
    dfl_tune_file *f;
    dfl_err e;
    int rc = dfl_tune_file_open(&f, path, &e);
    fz_check_err(rc, &e, where);
    FZ_ASSERT(rc == DFL_OK, "%s: a file the reader wrote is refused: %s", where, e.msg);
    return f;
}

/* every product of products (a jansson object) comes back from f under scope */
static void check_products(const dfl_tune_file *f, const char *scope, json_t *products, const char *where)
{
    const char *k;
    json_t *v;
    json_object_foreach(products, k, v) {
        uint8_t want[DFL_MM_ALGO_BYTES];
        FZ_ASSERT(json_is_string(v) && decode(json_string_value(v), want), "%s: product '%s' accepted but "
                  "not 128 lowercase hex digits", where, k);
        dfl_mm_algo a = algo(scope, k, 0);
        FZ_ASSERT(dfl_tune_file_get(f, &a), "%s: product '%s' not found under its scope", where, k);
        FZ_ASSERT(!memcmp(a.bytes, want, sizeof want), "%s: product '%s': other bytes than its digits", where, k);
        dfl_mm_algo b = algo("another scope", k, 0);
        if (strcmp(scope, "another scope"))
            FZ_ASSERT(!dfl_tune_file_get(f, &b), "%s: product '%s' found under another scope", where, k);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    if (!path[0])
        snprintf(path, sizeof path, "%s/tune.json", fz_scratch_dir());
    fz_write_file(path, data, n);
    dfl_tune_file *f;
    dfl_err e;
    int rc = dfl_tune_file_open(&f, path, &e);
    fz_check_err(rc, &e, "open");
    if (rc) {
        FZ_ASSERT(rc == DFL_EDATA || rc == DFL_ENOMEM, "open: %s for a bad file", dfl_code_name(rc));
        FZ_ASSERT(strstr(e.msg, path) != NULL, "open: the message does not name the file: %s", e.msg);
        FZ_ASSERT(f == NULL, "open: failed but handed out a file");
        return 0;
    }
    /* accepted: the file's products, read again as JSON (the reader accepted it, so it parses) */
    json_t *root = NULL;
    rc = dfl_json_load_file(path, &root, &e);
    FZ_ASSERT(rc == DFL_OK && json_is_object(root), "accepted, but no JSON object read again: %s", e.msg);
    const char *scope = dfl_tune_file_scope(f);
    size_t sl = strlen(scope);
    FZ_ASSERT(sl >= 1 && sl < sizeof(((dfl_mm_algo *)0)->scope), "scope of %zu characters", sl);
    FZ_ASSERT(!strcmp(scope, json_string_value(json_object_get(root, "scope"))), "scope '%s' is not the file's",
              scope);
    FZ_ASSERT(!strcmp(dfl_tune_file_path(f), path), "path '%s'", dfl_tune_file_path(f));
    json_t *products = json_object_get(root, "products");
    size_t np = json_object_size(products);
    FZ_ASSERT(dfl_tune_file_count(f, scope) == (int)np, "count %d, the file holds %zu",
              dfl_tune_file_count(f, scope), np);
    if (strcmp(scope, "another scope"))
        FZ_ASSERT(dfl_tune_file_count(f, "another scope") == 0, "products counted under another scope");
    check_products(f, scope, products, "open");

    /* a put of a product's own bytes changes nothing */
    bool written = true;
    const char *k;
    json_t *v;
    json_object_foreach(products, k, v) {
        dfl_mm_algo a = algo(scope, k, 0);
        decode(json_string_value(v), a.bytes);
        rc = dfl_tune_file_put(f, &a, &e);
        fz_check_err(rc, &e, "put same");
        FZ_ASSERT(rc == DFL_OK, "put of a product's own bytes: %s", e.msg);
        break;
    }
    rc = dfl_tune_file_save(f, &written, &e);
    fz_check_err(rc, &e, "save unchanged");
    FZ_ASSERT(rc == DFL_OK && !written, "save after no change: rc %d, written %d", rc, written);

    /* a new product under the scope: saved, read back with every old one */
    char nk[64];
    int i = 0;
    do
        snprintf(nk, sizeof nk, "fuzz new %d", i++);
    while (json_object_get(products, nk));
    dfl_mm_algo a = algo(scope, nk, 0x5a);
    rc = dfl_tune_file_put(f, &a, &e);
    fz_check_err(rc, &e, "put new");
    FZ_ASSERT(rc == DFL_OK, "put new: %s", e.msg);
    rc = dfl_tune_file_save(f, &written, &e);
    fz_check_err(rc, &e, "save new");
    FZ_ASSERT(rc == DFL_OK && written, "save after a new product: rc %d, written %d", rc, written);
    char keep_scope[sizeof a.scope];
    snprintf(keep_scope, sizeof keep_scope, "%s", scope);
    dfl_tune_file_close(f);
    f = open_ok("reopen");
    FZ_ASSERT(!strcmp(dfl_tune_file_scope(f), keep_scope), "reopened: scope '%s', was '%s'",
              dfl_tune_file_scope(f), keep_scope);
    FZ_ASSERT(dfl_tune_file_count(f, keep_scope) == (int)np + 1, "reopened: %d products, want %zu",
              dfl_tune_file_count(f, keep_scope), np + 1);
    check_products(f, keep_scope, products, "reopen");
    dfl_mm_algo got = algo(keep_scope, nk, 0);
    FZ_ASSERT(dfl_tune_file_get(f, &got) && !memcmp(got.bytes, a.bytes, sizeof a.bytes),
              "reopened: the new product is not as put");

    /* another scope: the file holds that one product */
    const char *other = strcmp(keep_scope, "another scope") ? "another scope" : "a third scope";
    dfl_mm_algo o = algo(other, "only", 0x11);
    rc = dfl_tune_file_put(f, &o, &e);
    fz_check_err(rc, &e, "put other scope");
    FZ_ASSERT(rc == DFL_OK, "put under another scope: %s", e.msg);
    FZ_ASSERT(dfl_tune_file_count(f, keep_scope) == 0 && dfl_tune_file_count(f, other) == 1,
              "after a put under another scope: %d under the old one, %d under the new",
              dfl_tune_file_count(f, keep_scope), dfl_tune_file_count(f, other));
    rc = dfl_tune_file_save(f, &written, &e);
    fz_check_err(rc, &e, "save other scope");
    FZ_ASSERT(rc == DFL_OK && written, "save under another scope: rc %d", rc);
    dfl_tune_file_close(f);
    f = open_ok("reopen other scope");
    FZ_ASSERT(!strcmp(dfl_tune_file_scope(f), other) && dfl_tune_file_count(f, other) == 1,
              "reopened under another scope: '%s', %d products", dfl_tune_file_scope(f),
              dfl_tune_file_count(f, other));
    got = algo(other, "only", 0);
    FZ_ASSERT(dfl_tune_file_get(f, &got) && !memcmp(got.bytes, o.bytes, sizeof o.bytes),
              "reopened under another scope: the product is not as put");
    dfl_tune_file_close(f);
    json_decref(root);
    return 0;
}
