/* fuzz-safetensors.c: libFuzzer harness for the safetensors reader (lib/formats/safetensors.c).
 *
 * The input is a .safetensors file. It is opened with dfl_st_open (through /proc/self/fd of an
 * in-memory file, so the real mapping path runs) and as a one-file model with dfl_st_model_open;
 * both must agree. An accepted file is checked against what the reader promises: tensors in
 * offset order tiling the data exactly, sizes matching shapes, every name found by dfl_st_find,
 * data inside the mapping (every byte is read). Every eighth accepted file is also written back
 * with the deterministic writer and read again: the same tensors, dtypes, shapes, bytes and
 * metadata must come back. */
#include <stdbool.h>
#include <xxhash.h>

#include "fuzz.h"
#include "safetensors.h"

static void check_file(const dfl_st_file *f)
{
    uint64_t end = f->data_start;
    for (size_t i = 0; i < f->n; i++) {
        const dfl_st_tensor *t = &f->t[i];
        FZ_ASSERT(t->name && t->name[0], "tensor %zu has no name", i);
        FZ_ASSERT(t->ndim >= 0 && t->ndim <= DFL_MAX_DIMS, "ndim %d", t->ndim);
        uint64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            FZ_ASSERT(t->shape[d] >= 0, "negative dim");
            numel *= (uint64_t)t->shape[d]; /* checked for overflow by the reader */
        }
        FZ_ASSERT(numel == t->numel, "%s: numel %llu, shape gives %llu", t->name, (unsigned long long)t->numel,
                  (unsigned long long)numel);
        FZ_ASSERT(t->nbytes == t->numel * dfl_dtype_size(t->dtype), "%s: nbytes", t->name);
        FZ_ASSERT(t->offset == end, "%s: offset %llu, previous end %llu", t->name, (unsigned long long)t->offset,
                  (unsigned long long)end);
        end = t->offset + t->nbytes;
        FZ_ASSERT(end <= f->map.size, "%s: data past the mapping", t->name);
        FZ_ASSERT((const uint8_t *)t->data == f->map.data + t->offset, "%s: data pointer", t->name);
        fz_touch(t->data, t->nbytes);
        FZ_ASSERT(dfl_st_find(f, t->name) == t, "%s: not found by name", t->name);
    }
    FZ_ASSERT(end == f->map.size, "data ends at %llu, file of %zu bytes", (unsigned long long)end, f->map.size);
    FZ_ASSERT(dfl_st_find(f, "") == NULL, "empty name found");
    if (f->metadata) {
        const char *k;
        json_t *v;
        json_object_foreach(f->metadata, k, v) {
            FZ_ASSERT(dfl_st_meta(f, k) && strcmp(dfl_st_meta(f, k), json_string_value(v)) == 0, "metadata %s", k);
        }
    }
}

/* Writes f with the deterministic writer into dir and reads it back. */
static void round_trip(const dfl_st_file *f, const char *dir)
{
    char path[512];
    snprintf(path, sizeof path, "%s/rt.safetensors", dir);
    dfl_err e;
    dfl_st_writer *w = dfl_st_writer_new();
    FZ_ASSERT(w != NULL, "writer");
    int rc = DFL_OK;
    for (size_t i = 0; i < f->n && !rc; i++) {
        const dfl_st_tensor *t = &f->t[i];
        rc = dfl_st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data, &e);
    }
    if (f->metadata && !rc) {
        const char *k;
        json_t *v;
        json_object_foreach(f->metadata, k, v) {
            if ((rc = dfl_st_writer_meta(w, k, json_string_value(v), &e)))
                break;
        }
    }
    /* the writer refuses names and keys that are not UTF-8, which the reader cannot produce
     * (jansson checks UTF-8): anything refused here is a finding */
    FZ_ASSERT(rc == DFL_OK, "the writer refuses what the reader accepted: %s", e.msg);
    rc = dfl_st_write(w, path, &e);
    dfl_st_writer_free(w);
    FZ_ASSERT(rc == DFL_OK, "write: %s", e.msg);
    dfl_st_file *g;
    rc = dfl_st_open(&g, path, &e);
    FZ_ASSERT(rc == DFL_OK, "the writer's file does not read back: %s", e.msg);
    FZ_ASSERT(g->n == f->n, "%zu tensors back, %zu written", g->n, f->n);
    for (size_t i = 0; i < f->n; i++) {
        const dfl_st_tensor *t = &f->t[i], *u = dfl_st_find(g, t->name);
        FZ_ASSERT(u && u->dtype == t->dtype && u->ndim == t->ndim &&
                      memcmp(u->shape, t->shape, sizeof t->shape) == 0 && u->nbytes == t->nbytes &&
                      memcmp(u->data, t->data, t->nbytes) == 0, "tensor %s differs after a round trip", t->name);
    }
    size_t fm = f->metadata ? json_object_size(f->metadata) : 0;
    size_t gm = g->metadata ? json_object_size(g->metadata) : 0;
    FZ_ASSERT(fm == gm && (fm == 0 || json_equal(f->metadata, g->metadata)), "metadata differs after a round trip");
    dfl_st_close(g);
    unlink(path);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int fd = fz_memfd(data, size, 0);
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    dfl_err e;
    dfl_st_file *f;
    int rc = dfl_st_open(&f, path, &e);
    fz_check_err(rc, &e, "dfl_st_open");
    if (rc) {
        FZ_ASSERT(f == NULL, "file returned on failure");
        FZ_ASSERT(rc == DFL_EDATA || rc == DFL_ETRUNC, "code %s for bytes: %s", dfl_code_name(rc), e.msg);
        FZ_ASSERT(strstr(e.msg, path) != NULL, "the message does not name the file: %s", e.msg);
    } else {
        check_file(f);
        if ((XXH3_64bits(data, size) & 7) == 0)
            round_trip(f, fz_scratch_dir());
    }
    dfl_st_model *m;
    dfl_err e2;
    int rc2 = dfl_st_model_open(&m, path, &e2);
    fz_check_err(rc2, &e2, "dfl_st_model_open");
    FZ_ASSERT(rc2 == rc, "dfl_st_open gives %s, dfl_st_model_open %s", dfl_code_name(rc), dfl_code_name(rc2));
    if (!rc2) {
        FZ_ASSERT(m->n == f->n, "model of %zu tensors, file of %zu", m->n, f->n);
        for (size_t i = 0; i < m->n; i++) {
            FZ_ASSERT(i == 0 || strcmp(m->t[i - 1]->name, m->t[i]->name) < 0, "model tensors not sorted");
            FZ_ASSERT(dfl_st_model_find(m, m->t[i]->name) == m->t[i], "model find");
        }
        dfl_st_model_close(m);
    }
    dfl_st_close(f);
    close(fd);
    return 0;
}
