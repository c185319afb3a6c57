/* test-safetensors.c: the safetensors reader, writer and model directories: round trips of every
 * dtype and odd shapes, byte-identical output, the shared oracle files, sharded directories, the
 * fixtures under tests/fixtures/st/ and the known-bad corpus under tests/bad/safetensors/. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"
#include "safetensors.h"
#include "util.h"
#include "t.h"

/* The source tree: two levels above this binary (build/tests/test-safetensors). */
static char *tmp_path(const char *name)
{
    return dfl_path_join(t_tmpdir(), name);
}

static int read_all(const char *path, char **buf, size_t *len)
{
    dfl_err e;
    return dfl_read_file(path, 1u << 30, buf, len, &e);
}

/* Plain (not synced) whole-file write, for the many small files of the mutation tests. */
static int write_plain(const char *path, const void *buf, size_t n)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    dfl_err e;
    int rc = dfl_write_all(fd, buf, n, path, &e);
    return close(fd) != 0 || rc ? -1 : 0;
}

/* Number of entries in dir other than . and .. */
static int count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
            n++;
    closedir(d);
    return n;
}

static void fill(uint8_t *p, size_t n, unsigned seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        p[i] = (uint8_t)(x >> 24);
    }
}

/* ------------------------------------------------------------------------------------------ */

typedef struct spec {
    const char *name;
    dfl_dtype dt;
    int ndim;
    int64_t shape[DFL_MAX_DIMS];
} spec;

static const spec specs[] = {
    {"scalar.f32", DFL_F32, 0, {0}},
    {"scalar.i64", DFL_I64, 0, {0}},
    {"empty.bf16", DFL_BF16, 1, {0}},
    {"empty.mid.f64", DFL_F64, 3, {3, 0, 2}},
    {"w.bf16", DFL_BF16, 2, {3, 5}},
    {"w.f16", DFL_F16, 2, {7, 1}},
    {"w.f32", DFL_F32, 2, {4, 9}},
    {"w.f64", DFL_F64, 1, {3}},
    {"i.i8", DFL_I8, 1, {5}},
    {"i.i16", DFL_I16, 1, {3}},
    {"i.i32", DFL_I32, 2, {2, 3}},
    {"i.i64", DFL_I64, 1, {2}},
    {"u.u8", DFL_U8, 1, {13}},
    {"u.u16", DFL_U16, 1, {1}},
    {"u.u32", DFL_U32, 1, {3}},
    {"u.u64", DFL_U64, 1, {1}},
    {"b.bool", DFL_BOOL, 1, {6}},
    {"f8.e4m3", DFL_F8_E4M3, 2, {2, 2}},
    {"f8.e5m2", DFL_F8_E5M2, 1, {3}},
    {"deep", DFL_F32, 8, {1, 2, 1, 1, 2, 1, 1, 3}},
    {"z\xc3\xa9ta/\"quoted\"\\name", DFL_U8, 1, {2}}, /* UTF-8 and JSON escapes in a name */
};
#define NSPECS DFL_ARRAY_LEN(specs)

static uint64_t spec_bytes(const spec *s)
{
    uint64_t n = dfl_dtype_size(s->dt);
    for (int i = 0; i < s->ndim; i++)
        n *= (uint64_t)s->shape[i];
    return n;
}

/* Adds specs in the given order (reverse when rev) with data bufs[i]. */
static int write_specs(const char *path, uint8_t **bufs, int rev, dfl_err *e)
{
    dfl_st_writer *w = dfl_st_writer_new();
    if (!w)
        return DFL_ENOMEM;
    int rc = 0;
    if (rev) {
        rc = dfl_st_writer_meta(w, "zz", "last", e);
        if (!rc)
            rc = dfl_st_writer_meta(w, "format", "pt", e);
    } else {
        rc = dfl_st_writer_meta(w, "format", "pt", e);
        if (!rc)
            rc = dfl_st_writer_meta(w, "zz", "last", e);
    }
    for (size_t k = 0; !rc && k < NSPECS; k++) {
        size_t i = rev ? NSPECS - 1 - k : k;
        rc = dfl_st_writer_add(w, specs[i].name, specs[i].dt, specs[i].ndim, specs[i].shape,
                               spec_bytes(&specs[i]) ? bufs[i] : NULL, e);
    }
    if (!rc)
        rc = dfl_st_write(w, path, e);
    dfl_st_writer_free(w);
    return rc;
}

/* One buffer per spec, filled from seed + i. */
static void fill_specs(uint8_t **bufs, unsigned seed)
{
    for (size_t i = 0; i < NSPECS; i++) {
        uint64_t n = spec_bytes(&specs[i]);
        bufs[i] = malloc(n ? n : 1);
        fill(bufs[i], n, (unsigned)i + seed);
    }
}

static void free_specs(uint8_t **bufs)
{
    for (size_t i = 0; i < NSPECS; i++)
        free(bufs[i]);
}

static void test_roundtrip(void)
{
    uint8_t *bufs[NSPECS];
    fill_specs(bufs, 7);
    char *path = tmp_path("rt.safetensors");
    dfl_err e;
    int rc = write_specs(path, bufs, 0, &e);
    T_CHECK(rc == 0, "write: %s", e.msg);
    dfl_st_file *f = NULL;
    rc = dfl_st_open(&f, path, &e);
    T_CHECK(rc == 0, "open: %s", e.msg);
    if (f) {
        T_EQ_INT(f->n, NSPECS, "tensor count");
        T_EQ_INT(f->data_start % 64, 0, "data starts at a multiple of 64");
        T_CHECK(dfl_st_meta(f, "format") && strcmp(dfl_st_meta(f, "format"), "pt") == 0, "meta format");
        T_CHECK(dfl_st_meta(f, "zz") && strcmp(dfl_st_meta(f, "zz"), "last") == 0, "meta zz");
        T_CHECK(dfl_st_meta(f, "nope") == NULL, "absent meta key");
        T_CHECK(dfl_st_find(f, "nope") == NULL, "absent tensor");
        for (size_t i = 0; i < NSPECS; i++) {
            const spec *s = &specs[i];
            const dfl_st_tensor *t = dfl_st_find(f, s->name);
            T_CHECK(t != NULL, "find %s", s->name);
            if (!t)
                continue;
            T_CHECK(strcmp(t->name, s->name) == 0, "name %s", t->name);
            T_CHECK(t->dtype == s->dt, "%s: dtype %s", s->name, dfl_dtype_name(t->dtype));
            T_EQ_INT(t->ndim, s->ndim, s->name);
            for (int d = 0; d < s->ndim; d++)
                T_EQ_INT(t->shape[d], s->shape[d], s->name);
            T_EQ_INT(t->nbytes, spec_bytes(s), s->name);
            T_EQ_INT(t->numel * dfl_dtype_size(t->dtype), t->nbytes, s->name);
            T_EQ_INT((uintptr_t)t->data % dfl_dtype_size(t->dtype), 0, "aligned data");
            T_EQ_INT(t->offset % dfl_dtype_size(t->dtype), 0, "aligned offset");
            T_CHECK(t->file && strcmp(t->file, path) == 0, "file of %s", s->name);
            T_CHECK(t->nbytes == 0 || memcmp(t->data, bufs[i], t->nbytes) == 0, "data of %s", s->name);
        }
        /* tensors are in offset order and tile the data */
        uint64_t off = f->data_start;
        for (size_t i = 0; i < f->n; i++) {
            T_EQ_INT(f->t[i].offset, off, f->t[i].name);
            off += f->t[i].nbytes;
            if (i > 0)
                T_CHECK(dfl_dtype_size(f->t[i - 1].dtype) >= dfl_dtype_size(f->t[i].dtype),
                        "element size descending at %s", f->t[i].name);
        }
        T_EQ_INT(off, f->map.size, "data ends at the end of the file");
        dfl_st_close(f);
    }
    /* the same file as a model: dfl_st_model_get wants float tensors of the exact shape */
    dfl_st_model *m = NULL;
    T_CHECK(dfl_st_model_open(&m, path, &e) == 0 && m, "model open: %s", e.msg);
    if (m) {
        const dfl_st_tensor *t = NULL;
        int64_t s23[2] = {2, 3}, s0[1] = {0};
        rc = dfl_st_model_get(m, "i.i32", 2, s23, &t, &e);
        T_CHECK(rc == DFL_EDATA && !t && strstr(e.msg, "'i.i32'") && strstr(e.msg, "I32") &&
                    strstr(e.msg, "float"), "integer tensor refused: %s", e.msg);
        T_CHECK(dfl_st_model_get(m, "scalar.f32", 0, NULL, &t, &e) == 0 && t && t->numel == 1,
                "0-d get: %s", e.msg);
        T_CHECK(dfl_st_model_get(m, "empty.bf16", 1, s0, &t, &e) == 0 && t && t->nbytes == 0,
                "zero-size get: %s", e.msg);
        rc = dfl_st_model_get(m, "scalar.f32", 1, s0, &t, &e);
        T_CHECK(rc == DFL_EMISMATCH && strstr(e.msg, "shape []") && strstr(e.msg, "expected [0]"),
                "0-d vs [0]: %s", e.msg);
        dfl_st_model_close(m);
    }
    free(path);
    free_specs(bufs);
}

static void test_deterministic(void)
{
    uint8_t *bufs[NSPECS];
    fill_specs(bufs, 100);
    char *a = tmp_path("det-a.safetensors"), *b = tmp_path("det-b.safetensors");
    dfl_err e;
    T_CHECK(write_specs(a, bufs, 0, &e) == 0, "write a: %s", e.msg);
    T_CHECK(write_specs(b, bufs, 1, &e) == 0, "write b: %s", e.msg);
    char *ba = NULL, *bb = NULL;
    size_t na = 0, nb = 0;
    T_CHECK(read_all(a, &ba, &na) == 0 && read_all(b, &bb, &nb) == 0, "read back");
    T_CHECK(ba && bb && na == nb && memcmp(ba, bb, na) == 0,
            "same tensors in another order give the same bytes (%zu vs %zu bytes)", na, nb);
    /* writing again over an existing file gives the same bytes too */
    T_CHECK(write_specs(a, bufs, 1, &e) == 0, "rewrite a: %s", e.msg);
    free(ba);
    ba = NULL;
    T_CHECK(read_all(a, &ba, &na) == 0 && ba && na == nb && memcmp(ba, bb, na) == 0, "rewrite");
    free(ba);
    free(bb);
    free(a);
    free(b);
    free_specs(bufs);
}

/* The exact bytes of a small file: the documented header layout. */
static void test_exact_layout(void)
{
    dfl_err e;
    dfl_st_writer *w = dfl_st_writer_new();
    float fb[2] = {1.0f, -2.0f};
    uint8_t ua[3] = {1, 2, 3};
    int64_t s2[1] = {2}, s3[1] = {3};
    T_CHECK(dfl_st_writer_add(w, "b", DFL_F32, 1, s2, fb, &e) == 0, "add b: %s", e.msg);
    T_CHECK(dfl_st_writer_add(w, "a", DFL_U8, 1, s3, ua, &e) == 0, "add a: %s", e.msg);
    T_CHECK(dfl_st_writer_meta(w, "k", "v", &e) == 0, "meta: %s", e.msg);
    char *path = tmp_path("exact.safetensors");
    T_CHECK(dfl_st_write(w, path, &e) == 0, "write: %s", e.msg);
    dfl_st_writer_free(w);
    const char *hdr = "{\"__metadata__\":{\"k\":\"v\"},"
                      "\"a\":{\"data_offsets\":[8,11],\"dtype\":\"U8\",\"shape\":[3]},"
                      "\"b\":{\"data_offsets\":[0,8],\"dtype\":\"F32\",\"shape\":[2]}}";
    size_t hl = strlen(hdr), padded = 184; /* 8 + 132 -> 192 = 3 x 64 */
    char *buf = NULL;
    size_t n = 0;
    T_CHECK(read_all(path, &buf, &n) == 0, "read");
    T_EQ_INT(n, 8 + padded + 11, "file size");
    if (buf && n == 8 + padded + 11) {
        uint8_t *u = (uint8_t *)buf;
        T_EQ_INT(u[0] | u[1] << 8, padded, "header length");
        for (int i = 2; i < 8; i++)
            T_EQ_INT(u[i], 0, "header length high bytes");
        T_CHECK(memcmp(buf + 8, hdr, hl) == 0, "header text: %.*s", (int)padded, buf + 8);
        for (size_t i = 8 + hl; i < 8 + padded; i++)
            T_EQ_INT(buf[i], ' ', "padding is spaces");
        T_CHECK(memcmp(buf + 192, fb, 8) == 0, "b data first");
        T_CHECK(memcmp(buf + 200, ua, 3) == 0, "a data next");
    }
    free(buf);
    free(path);
}

static void test_empty_file(void)
{
    dfl_err e;
    dfl_st_writer *w = dfl_st_writer_new();
    char *path = tmp_path("empty.safetensors");
    T_CHECK(dfl_st_write(w, path, &e) == 0, "write: %s", e.msg);
    dfl_st_writer_free(w);
    dfl_st_file *f = NULL;
    T_CHECK(dfl_st_open(&f, path, &e) == 0, "open: %s", e.msg);
    if (f) {
        T_EQ_INT(f->n, 0, "no tensors");
        T_EQ_INT(f->map.size, 64, "just the padded header");
        T_CHECK(f->metadata == NULL, "no metadata");
        dfl_st_close(f);
    }
    free(path);
}

static void test_writer_errors(void)
{
    dfl_err e;
    dfl_st_writer *w = dfl_st_writer_new();
    float x[4] = {0};
    int64_t s[DFL_MAX_DIMS + 1] = {2, 2, 1, 1, 1, 1, 1, 1, 1};
    int64_t neg[2] = {2, -1};
    int64_t huge[3] = {INT64_MAX, INT64_MAX, 2};
    T_CHECK(dfl_st_writer_add(w, "x", DFL_F32, 2, s, x, &e) == 0, "first add: %s", e.msg);
    T_CHECK(dfl_st_writer_add(w, "x", DFL_F32, 2, s, x, &e) == DFL_EUSAGE && strstr(e.msg, "duplicate")
                && strstr(e.msg, "'x'"), "duplicate: %s", e.msg);
    T_CHECK(dfl_st_writer_add(w, "", DFL_F32, 1, s, x, &e) == DFL_EUSAGE, "empty name");
    T_CHECK(dfl_st_writer_add(w, "__metadata__", DFL_F32, 1, s, x, &e) == DFL_EUSAGE, "reserved name");
    T_CHECK(dfl_st_writer_add(w, "n", DFL_F32, 2, neg, x, &e) == DFL_EUSAGE && strstr(e.msg, "negative"),
            "negative dim: %s", e.msg);
    T_CHECK(dfl_st_writer_add(w, "d", DFL_F32, DFL_MAX_DIMS + 1, s, x, &e) == DFL_EUSAGE, "too many dims");
    T_CHECK(dfl_st_writer_add(w, "h", DFL_F32, 3, huge, x, &e) == DFL_EUSAGE && strstr(e.msg, "overflow"),
            "overflow: %s", e.msg);
    T_CHECK(dfl_st_writer_add(w, "t", DFL_DT_INVALID, 1, s, x, &e) == DFL_EUSAGE, "invalid dtype");
    T_CHECK(dfl_st_writer_add(w, "t", DFL_DT_COUNT, 1, s, x, &e) == DFL_EUSAGE, "dtype out of range");
    T_CHECK(dfl_st_writer_add(w, "nodata", DFL_F32, 1, s, NULL, &e) == DFL_EUSAGE, "NULL data");
    T_CHECK(dfl_st_writer_add(w, "bad\xff", DFL_F32, 1, s, x, &e) == DFL_EUSAGE, "non-UTF-8 name");
    T_CHECK(dfl_st_writer_meta(w, "k", "v", &e) == 0, "meta");
    T_CHECK(dfl_st_writer_meta(w, "k", "w", &e) == DFL_EUSAGE, "duplicate meta key");
    T_CHECK(dfl_st_writer_meta(w, "k2", "\xc3", &e) == DFL_EUSAGE, "non-UTF-8 meta value");
    /* the failed adds left the writer usable: one tensor */
    char *path = tmp_path("werr.safetensors");
    T_CHECK(dfl_st_write(w, path, &e) == 0, "write: %s", e.msg);
    dfl_st_file *f = NULL;
    T_CHECK(dfl_st_open(&f, path, &e) == 0 && f->n == 1, "one tensor");
    dfl_st_close(f);
    /* a directory that does not exist: an I/O error, nothing written */
    char *bad = tmp_path("no/such/dir/x.safetensors");
    T_CHECK(dfl_st_write(w, bad, &e) == DFL_EIO && strstr(e.msg, "no/such/dir"), "missing dir: %s", e.msg);
    dfl_st_writer_free(w);
    free(bad);
    free(path);
}

/* A write that fails half-way (file size limit) leaves nothing behind, not even a temporary. */
static void test_writer_abort(void)
{
    char *dir = tmp_path("abort");
    dfl_err e;
    T_CHECK(dfl_mkdir_p(dir, 0755, &e) == 0, "mkdir");
    char *path = dfl_path_join(dir, "big.safetensors");
    size_t n = 1u << 20;
    uint8_t *big = calloc(n, 1);
    int64_t shape[1] = {(int64_t)n};
    dfl_st_writer *w = dfl_st_writer_new();
    T_CHECK(dfl_st_writer_add(w, "big", DFL_U8, 1, shape, big, &e) == 0, "add");
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    void (*oldsig)(int) = signal(SIGXFSZ, SIG_IGN);
    lim = old;
    lim.rlim_cur = 64 * 1024;
    if (setrlimit(RLIMIT_FSIZE, &lim) != 0) {
        signal(SIGXFSZ, oldsig);
        dfl_st_writer_free(w);
        free(big);
        free(path);
        free(dir);
        T_SKIP("cannot lower RLIMIT_FSIZE");
    }
    int rc = dfl_st_write(w, path, &e);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, oldsig);
    T_CHECK(rc == DFL_EIO, "write past the size limit fails: %d %s", rc, e.msg);
    T_EQ_INT(count_entries(dir), 0, "nothing left behind");
    dfl_st_writer_free(w);
    free(big);
    free(path);
    free(dir);
}

/* ------------------------------------------------------------------------------------------ */
/* Oracle files */

static void check_tensor(const dfl_st_file *f, const char *name, dfl_dtype dt, int ndim,
                         int64_t d0, int64_t d1, int64_t d2)
{
    const dfl_st_tensor *t = dfl_st_find(f, name);
    T_CHECK(t != NULL, "%s: tensor %s", f->path, name);
    if (!t)
        return;
    int64_t d[3] = {d0, d1, d2};
    T_CHECK(t->dtype == dt, "%s: dtype %s", name, dfl_dtype_name(t->dtype));
    T_EQ_INT(t->ndim, ndim, name);
    for (int i = 0; i < ndim && i < 3; i++)
        T_EQ_INT(t->shape[i], d[i], name);
}

static float load_f32(const dfl_st_tensor *t, size_t i)
{
    float v;
    memcpy(&v, (const uint8_t *)t->data + 4 * i, 4);
    return v;
}

static int32_t load_i32(const dfl_st_tensor *t, size_t i)
{
    int32_t v;
    memcpy(&v, (const uint8_t *)t->data + 4 * i, 4);
    return v;
}

static void test_oracle_target(void)
{
    const char *o = t_oracle();
    if (!o)
        T_SKIP("no $DFL_ORACLE");
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s/qwen3-tiny-a", o);
    dfl_st_model *m = NULL;
    dfl_err e;
    T_CHECK(dfl_st_model_open(&m, dir, &e) == 0, "open %s: %s", dir, e.msg);
    if (!m)
        return;
    T_EQ_INT(m->nfiles, 1, "one file");
    T_EQ_INT(m->n, 3 + 6 * 11, "tensors: embed, lm_head, norm, 11 per layer x 6");
    for (size_t i = 1; i < m->n; i++)
        T_CHECK(strcmp(m->t[i - 1]->name, m->t[i]->name) < 0, "sorted at %s", m->t[i]->name);
    for (size_t i = 0; i < m->n; i++)
        T_CHECK(m->t[i]->dtype == DFL_BF16, "%s is bf16", m->t[i]->name);
    const dfl_st_file *f = m->files[0];
    T_CHECK(dfl_st_meta(f, "format") && strcmp(dfl_st_meta(f, "format"), "pt") == 0, "format pt");
    check_tensor(f, "model.embed_tokens.weight", DFL_BF16, 2, 2048, 256, 0);
    check_tensor(f, "lm_head.weight", DFL_BF16, 2, 2048, 256, 0);
    check_tensor(f, "model.norm.weight", DFL_BF16, 1, 256, 0, 0);
    check_tensor(f, "model.layers.0.self_attn.q_proj.weight", DFL_BF16, 2, 256, 256, 0);
    check_tensor(f, "model.layers.5.self_attn.k_proj.weight", DFL_BF16, 2, 128, 256, 0);
    check_tensor(f, "model.layers.3.self_attn.q_norm.weight", DFL_BF16, 1, 32, 0, 0);
    check_tensor(f, "model.layers.2.mlp.down_proj.weight", DFL_BF16, 2, 256, 768, 0);
    check_tensor(f, "model.layers.2.mlp.gate_proj.weight", DFL_BF16, 2, 768, 256, 0);

    const dfl_st_tensor *t;
    int64_t want[2] = {128, 256}, wrong[2] = {256, 256};
    T_CHECK(dfl_st_model_get(m, "model.layers.1.self_attn.v_proj.weight", 2, want, &t, &e) == 0 && t,
            "get v_proj: %s", e.msg);
    int rc = dfl_st_model_get(m, "model.layers.1.self_attn.v_proj.weight", 2, wrong, &t, &e);
    T_CHECK(rc == DFL_EMISMATCH && !t && strstr(e.msg, "[128, 256]") && strstr(e.msg, "[256, 256]") &&
                strstr(e.msg, "v_proj") && strstr(e.msg, "model.safetensors"),
            "wrong shape: %d %s", rc, e.msg);
    rc = dfl_st_model_get(m, "model.layers.1.self_attn.v_proj.weight", 1, want, &t, &e);
    T_CHECK(rc == DFL_EMISMATCH && strstr(e.msg, "[128]"), "wrong rank: %s", e.msg);
    rc = dfl_st_model_get(m, "model.layers.9.self_attn.v_proj.weight", 2, want, &t, &e);
    T_CHECK(rc == DFL_EDATA && strstr(e.msg, "layers.9"), "missing: %s", e.msg);
    /* norms were perturbed away from 1 but stay near it */
    t = dfl_st_model_find(m, "model.norm.weight");
    if (t) {
        double lo = 1e9, hi = -1e9;
        for (size_t i = 0; i < t->numel; i++) {
            double v = dfl_load_f64(t->data, t->dtype, i);
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        T_CHECK(lo > 0.0 && hi < 3.0 && hi - lo > 1e-3, "norm weights in (0, 3), not all equal: %g..%g", lo, hi);
    }
    dfl_st_model_close(m);

    /* the file path itself opens as a model too */
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/qwen3-tiny-a/model.safetensors", o);
    T_CHECK(dfl_st_model_open(&m, p, &e) == 0 && m && m->n == 69, "open as a file: %s", e.msg);
    if (m)
        T_CHECK(strcmp(m->dir, dir) == 0, "dir of a file: %s", m->dir);
    dfl_st_model_close(m);
}

/* Opens the oracle's file rel into f (checked), or skips the test case when there is no
 * oracle; returns from the test case when it does not open. */
#define OPEN_ORACLE_ST(f, rel)                                                    \
    do {                                                                          \
        const char *o_ = t_oracle();                                              \
        if (!o_)                                                                  \
            T_SKIP("no $DFL_ORACLE");                                             \
        char p_[PATH_MAX];                                                        \
        dfl_err e_;                                                               \
        snprintf(p_, sizeof p_, "%s/%s", o_, rel);                                \
        T_CHECK(dfl_st_open(&(f), p_, &e_) == 0, "open: %s", e_.msg);             \
        if (!(f))                                                                 \
            return;                                                               \
    } while (0)

static void test_oracle_ref(void)
{
    dfl_st_file *f = NULL;
    OPEN_ORACLE_ST(f, "qwen3-tiny-a/ref.safetensors");
    T_EQ_INT(f->n, 5 * 9, "9 tensors per sequence");
    static const int64_t lens[5] = {1, 5, 33, 200, 517};
    char name[64];
    for (int s = 0; s < 5; s++) {
        snprintf(name, sizeof name, "seq%d.input_ids", s);
        check_tensor(f, name, DFL_I32, 1, lens[s], 0, 0);
        const dfl_st_tensor *t = dfl_st_find(f, name);
        for (size_t i = 0; t && i < t->numel; i++) {
            int32_t id = load_i32(t, i);
            if (id < 0 || id >= 2048) {
                T_CHECK(0, "%s[%zu] = %d out of the vocabulary", name, i, id);
                break;
            }
        }
        for (int k = 0; k < 6; k++) {
            snprintf(name, sizeof name, "seq%d.layer%d", s, k);
            check_tensor(f, name, DFL_F32, 2, lens[s], 256, 0);
        }
        snprintf(name, sizeof name, "seq%d.norm", s);
        check_tensor(f, name, DFL_F32, 2, lens[s], 256, 0);
        snprintf(name, sizeof name, "seq%d.logits_last8", s);
        check_tensor(f, name, DFL_F32, 2, lens[s] < 8 ? lens[s] : 8, 2048, 0);
    }
    T_CHECK(dfl_st_meta(f, "lens") && strcmp(dfl_st_meta(f, "lens"), "[1, 5, 33, 200, 517]") == 0,
            "metadata lens");
    dfl_st_close(f);
}

static void test_oracle_golden(void)
{
    dfl_st_file *f = NULL;
    OPEN_ORACLE_ST(f, "dflash-tiny/golden.safetensors");
    T_EQ_INT(f->n, 134, "tensor count");
    T_CHECK(dfl_st_meta(f, "format") && strcmp(dfl_st_meta(f, "format"), "dflash-golden-v1") == 0,
            "format");
    check_tensor(f, "fc.weight", DFL_F32, 2, 256, 768, 0);
    check_tensor(f, "grad.fc.weight", DFL_F32, 2, 256, 768, 0);
    check_tensor(f, "after_adamw.layers.1.mlp.down_proj.weight", DFL_F32, 2, 256, 512, 0);
    check_tensor(f, "layers.0.self_attn.k_proj.weight", DFL_F32, 2, 128, 256, 0);
    check_tensor(f, "target.embed_tokens.weight", DFL_F32, 2, 2048, 256, 0);
    check_tensor(f, "target.lm_head.weight", DFL_F32, 2, 2048, 256, 0);
    check_tensor(f, "seq1.hidden_states", DFL_F32, 2, 97, 768, 0);
    check_tensor(f, "seq2.anchors", DFL_I32, 1, 14, 0, 0);
    check_tensor(f, "batch.block_keep_mask", DFL_I32, 2, 3, 29, 0);
    check_tensor(f, "dbg.attn_mask", DFL_U8, 3, 3, 232, 329);
    check_tensor(f, "loss", DFL_F32, 1, 1, 0, 0);
    const dfl_st_tensor *t = dfl_st_find(f, "seq_lens");
    check_tensor(f, "seq_lens", DFL_I32, 1, 3, 0, 0);
    if (t && t->numel == 3)
        T_CHECK(load_i32(t, 0) == 40 && load_i32(t, 1) == 97 && load_i32(t, 2) == 61, "seq_lens");
    t = dfl_st_find(f, "loss");
    if (t && t->numel == 1)
        T_NEAR(load_f32(t, 0), 6.897005, 1e-5, "loss");
    t = dfl_st_find(f, "acc_num");
    if (t && t->numel == 1)
        T_NEAR(load_f32(t, 0), 92, 0, "acc_num");
    dfl_st_close(f);
}

/* ------------------------------------------------------------------------------------------ */
/* Sharded model directories */

static int write_one(const char *path, const char *const *names, size_t n, const float *data, dfl_err *e)
{
    dfl_st_writer *w = dfl_st_writer_new();
    int64_t shape[2] = {2, 3};
    int rc = 0;
    for (size_t i = 0; !rc && i < n; i++)
        rc = dfl_st_writer_add(w, names[i], DFL_F32, 2, shape, data + 6 * i, e);
    if (!rc)
        rc = dfl_st_write(w, path, e);
    dfl_st_writer_free(w);
    return rc;
}

static void test_sharded(void)
{
    dfl_err e;
    char *dir = tmp_path("sharded");
    T_CHECK(dfl_mkdir_p(dir, 0755, &e) == 0, "mkdir");
    float data[6 * 4];
    for (int i = 0; i < 24; i++)
        data[i] = (float)i;
    static const char *const s1[] = {"model.layers.0.w", "model.norm.weight"};
    static const char *const s2[] = {"lm_head.weight", "model.embed_tokens.weight"};
    char *p1 = dfl_path_join(dir, "model-00001-of-00002.safetensors");
    char *p2 = dfl_path_join(dir, "model-00002-of-00002.safetensors");
    T_CHECK(write_one(p1, s1, 2, data, &e) == 0, "shard 1: %s", e.msg);
    T_CHECK(write_one(p2, s2, 2, data + 12, &e) == 0, "shard 2: %s", e.msg);
    const char *index =
        "{\n  \"metadata\": {\"total_size\": 96},\n  \"weight_map\": {\n"
        "    \"lm_head.weight\": \"model-00002-of-00002.safetensors\",\n"
        "    \"model.embed_tokens.weight\": \"model-00002-of-00002.safetensors\",\n"
        "    \"model.layers.0.w\": \"model-00001-of-00002.safetensors\",\n"
        "    \"model.norm.weight\": \"model-00001-of-00002.safetensors\"\n  }\n}\n";
    char *ip = dfl_path_join(dir, "model.safetensors.index.json");
    T_CHECK(dfl_write_file_atomic(ip, index, strlen(index), &e) == 0, "index");
    dfl_st_model *m = NULL;
    T_CHECK(dfl_st_model_open(&m, dir, &e) == 0, "open: %s", e.msg);
    if (m) {
        T_EQ_INT(m->nfiles, 2, "two shards");
        T_EQ_INT(m->n, 4, "four tensors");
        static const char *const sorted[] = {"lm_head.weight", "model.embed_tokens.weight",
                                             "model.layers.0.w", "model.norm.weight"};
        for (size_t i = 0; i < 4 && i < m->n; i++)
            T_CHECK(strcmp(m->t[i]->name, sorted[i]) == 0, "sorted[%zu] = %s", i, m->t[i]->name);
        const dfl_st_tensor *t = dfl_st_model_find(m, "model.norm.weight");
        T_CHECK(t && strcmp(t->file, p1) == 0, "norm is in shard 1");
        if (t)
            T_NEAR(load_f32(t, 5), 11.0f, 0, "norm data");
        int64_t shape[2] = {2, 3};
        T_CHECK(dfl_st_model_get(m, "lm_head.weight", 2, shape, &t, &e) == 0 && strcmp(t->file, p2) == 0,
                "get lm_head: %s", e.msg);
        if (t)
            T_NEAR(load_f32(t, 0), 12.0f, 0, "lm_head data");
        T_CHECK(dfl_st_model_find(m, "nope") == NULL, "absent");
        dfl_st_model_close(m);
    }
    /* a model.safetensors beside the index wins (as in transformers) */
    char *single = dfl_path_join(dir, "model.safetensors");
    static const char *const s3[] = {"only"};
    T_CHECK(write_one(single, s3, 1, data, &e) == 0, "single: %s", e.msg);
    m = NULL;
    T_CHECK(dfl_st_model_open(&m, dir, &e) == 0 && m && m->n == 1 && dfl_st_model_find(m, "only"),
            "single file wins: %s", e.msg);
    dfl_st_model_close(m);
    /* an empty directory */
    char *empty = tmp_path("emptydir");
    dfl_mkdir_p(empty, 0755, &e);
    T_CHECK(dfl_st_model_open(&m, empty, &e) == DFL_EIO && strstr(e.msg, "no model.safetensors"),
            "empty dir: %s", e.msg);
    T_CHECK(dfl_st_model_open(&m, "/nonexistent/model", &e) == DFL_EIO, "missing path");
    free(empty);
    free(single);
    free(ip);
    free(p1);
    free(p2);
    free(dir);
}

/* ------------------------------------------------------------------------------------------ */
/* Fixtures (written by tests/fixtures/st/gen.py, in the layout of other writers) */

static void test_fixtures(void)
{
    char p[PATH_MAX];
    dfl_err e;
    dfl_st_file *f = NULL;
    snprintf(p, sizeof p, "%s/tests/fixtures/st/foreign.safetensors", t_src_root());
    T_CHECK(dfl_st_open(&f, p, &e) == 0, "open %s: %s", p, e.msg);
    if (!f)
        return;
    T_EQ_INT(f->n, 5, "tensors");
    T_CHECK(f->data_start % 8 != 0, "the fixture's data is deliberately unaligned");
    check_tensor(f, "a.f32", DFL_F32, 2, 2, 2, 0);
    check_tensor(f, "b.scalar", DFL_F64, 0, 0, 0, 0);
    check_tensor(f, "c.empty", DFL_BF16, 2, 0, 4, 0);
    check_tensor(f, "d.i16", DFL_I16, 1, 3, 0, 0);
    check_tensor(f, "e.bf16", DFL_BF16, 1, 2, 0, 0);
    const dfl_st_tensor *t = dfl_st_find(f, "a.f32");
    if (t)
        for (int i = 0; i < 4; i++)
            T_NEAR(load_f32(t, (size_t)i), 0.5 * (i + 1), 0, "a.f32 values");
    /* the data is unaligned here: read through memcpy */
    t = dfl_st_find(f, "b.scalar");
    if (t) {
        double d;
        memcpy(&d, t->data, 8);
        T_NEAR(d, -3.25, 0, "scalar");
    }
    t = dfl_st_find(f, "e.bf16");
    if (t) {
        uint16_t h[2];
        memcpy(h, t->data, 4);
        T_NEAR(dfl_bf16_to_f32(h[0]), 1.0, 0, "bf16 1.0");
        T_NEAR(dfl_bf16_to_f32(h[1]), -2.0, 0, "bf16 -2.0");
    }
    t = dfl_st_find(f, "d.i16");
    if (t) {
        int16_t v[3];
        memcpy(v, t->data, 6);
        T_CHECK(v[0] == -1 && v[1] == 2 && v[2] == 300, "i16 values");
    }
    T_CHECK(dfl_st_meta(f, "note") && strcmp(dfl_st_meta(f, "note"), "caf\xc3\xa9") == 0, "UTF-8 metadata");
    dfl_st_close(f);
}

/* ------------------------------------------------------------------------------------------ */
/* The known-bad corpus: tests/bad/safetensors/MANIFEST lists each case as
 *   name<TAB>code<TAB>substring
 * where name is a file (opened with dfl_st_open) or a directory (dfl_st_model_open), code is
 * EDATA or ETRUNC and substring must appear in the message. Every entry of the directory must be
 * listed (besides MANIFEST, README and gen.py). */

static void test_bad_corpus(void)
{
    char dir[PATH_MAX], mf[PATH_MAX + 16];
    snprintf(dir, sizeof dir, "%s/tests/bad/safetensors", t_src_root());
    snprintf(mf, sizeof mf, "%s/MANIFEST", dir);
    FILE *fp = fopen(mf, "r");
    T_CHECK(fp != NULL, "cannot open %s", mf);
    if (!fp)
        return;
    char line[1024];
    char listed[256][128];
    int nlisted = 0, lineno = 0;
    while (fgets(line, sizeof line, fp)) {
        lineno++;
        line[strcspn(line, "\n")] = 0;
        if (!line[0] || line[0] == '#')
            continue;
        char *name = line, *code = strchr(line, '\t'), *sub = NULL;
        if (code) {
            *code++ = 0;
            sub = strchr(code, '\t');
            if (sub)
                *sub++ = 0;
        }
        T_CHECK(code && sub && *sub, "MANIFEST line %d is not name<TAB>code<TAB>substring", lineno);
        if (!code || !sub || !*sub)
            continue;
        int want = strcmp(code, "ETRUNC") == 0 ? DFL_ETRUNC : strcmp(code, "EDATA") == 0 ? DFL_EDATA : -1;
        T_CHECK(want > 0, "MANIFEST line %d: code %s", lineno, code);
        if (nlisted < 256)
            snprintf(listed[nlisted++], sizeof listed[0], "%s", name);
        char p[PATH_MAX + 200];
        snprintf(p, sizeof p, "%s/%s", dir, name);
        struct stat st;
        T_CHECK(stat(p, &st) == 0, "%s is listed but missing", name);
        dfl_err e;
        dfl_err_clear(&e);
        int rc;
        if (S_ISDIR(st.st_mode)) {
            dfl_st_model *m = NULL;
            rc = dfl_st_model_open(&m, p, &e);
            T_CHECK(m == NULL, "%s: no model on failure", name);
            dfl_st_model_close(m);
        } else {
            dfl_st_file *f = NULL;
            rc = dfl_st_open(&f, p, &e);
            T_CHECK(f == NULL, "%s: no file on failure", name);
            dfl_st_close(f);
        }
        T_CHECK(rc == want, "%s: code %s, expected %s (%s)", name, dfl_code_name(rc), code, e.msg);
        T_CHECK(strstr(e.msg, sub) != NULL, "%s: message lacks '%s': %s", name, sub, e.msg);
        T_CHECK(strstr(e.msg, name) != NULL, "%s: message does not name the input: %s", name, e.msg);
    }
    fclose(fp);
    T_CHECK(nlisted >= 20, "only %d cases", nlisted);
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        const char *n = de->d_name;
        if (n[0] == '.' || !strcmp(n, "MANIFEST") || !strcmp(n, "README") || !strcmp(n, "gen.py"))
            continue;
        int found = 0;
        for (int i = 0; i < nlisted; i++)
            found |= strcmp(listed[i], n) == 0;
        T_CHECK(found, "%s/%s is not listed in MANIFEST", dir, n);
    }
    if (d)
        closedir(d);
}

/* Every prefix of a good file is rejected cleanly (never a crash, never success). */
static void test_truncations(void)
{
    const char *src = "foreign.safetensors";
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/tests/fixtures/st/%s", t_src_root(), src);
    char *buf = NULL;
    size_t n = 0;
    T_CHECK(read_all(p, &buf, &n) == 0, "read %s", p);
    if (!buf)
        return;
    char *cut = tmp_path("cut.safetensors");
    for (size_t k = 0; k < n; k++) {
        dfl_err e;
        T_CHECK(write_plain(cut, buf, k) == 0, "write");
        dfl_st_file *f = NULL;
        int rc = dfl_st_open(&f, cut, &e);
        T_CHECK(rc == DFL_ETRUNC, "prefix of %zu bytes: %s %s", k, dfl_code_name(rc), e.msg);
        T_CHECK(f == NULL, "no file");
        if (rc != DFL_ETRUNC)
            break;
    }
    free(cut);
    free(buf);
}

/* Every byte of a small file's header set to a few values: each result is either a clean open
 * or DFL_EDATA / DFL_ETRUNC, never a crash (run under SAN=1 to catch memory errors). */
static void test_header_mutations(void)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/tests/fixtures/st/foreign.safetensors", t_src_root());
    char *buf = NULL;
    size_t n = 0;
    T_CHECK(read_all(p, &buf, &n) == 0, "read %s", p);
    if (!buf)
        return;
    static const uint8_t vals[] = {0x00, 0x01, ' ', '"', '-', '0', '9', '[', ']', '{', '}', ',', ':',
                                   'e', '.', 0x7f, 0x80, 0xc3, 0xff};
    char *mut = tmp_path("mut.safetensors");
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--)
        hl = hl << 8 | (uint8_t)buf[i];
    size_t ok = 0, bad = 0;
    for (size_t i = 0; i < 8 + hl && i < n; i++) {
        for (size_t v = 0; v < DFL_ARRAY_LEN(vals); v++) {
            char save = buf[i];
            if ((uint8_t)save == vals[v])
                continue;
            buf[i] = (char)vals[v];
            dfl_err e;
            dfl_st_file *f = NULL;
            if (write_plain(mut, buf, n) != 0) {
                buf[i] = save;
                continue;
            }
            int rc = dfl_st_open(&f, mut, &e);
            buf[i] = save;
            if (rc == 0) {
                ok++;
                for (size_t k = 0; k < f->n; k++)
                    T_CHECK(f->t[k].offset + f->t[k].nbytes <= f->map.size &&
                                (const uint8_t *)f->t[k].data == f->map.data + f->t[k].offset,
                            "accepted mutation at byte %zu: tensor '%s' within the file", i, f->t[k].name);
                dfl_st_close(f);
            } else {
                bad++;
                T_CHECK(rc == DFL_EDATA || rc == DFL_ETRUNC, "byte %zu = 0x%02x: %s %s", i, vals[v],
                        dfl_code_name(rc), e.msg);
                T_CHECK(f == NULL && strstr(e.msg, "mut.safetensors"), "message names the file: %s", e.msg);
            }
        }
    }
    T_CHECK(bad > 1000, "most mutations are rejected (%zu rejected, %zu accepted)", bad, ok);
    free(mut);
    free(buf);
}

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    T_RUN(test_roundtrip);
    T_RUN(test_deterministic);
    T_RUN(test_exact_layout);
    T_RUN(test_empty_file);
    T_RUN(test_writer_errors);
    T_RUN(test_writer_abort);
    T_RUN(test_oracle_target);
    T_RUN(test_oracle_ref);
    T_RUN(test_oracle_golden);
    T_RUN(test_sharded);
    T_RUN(test_fixtures);
    T_RUN(test_bad_corpus);
    T_RUN(test_truncations);
    T_RUN(test_header_mutations);
    return t_done();
}
