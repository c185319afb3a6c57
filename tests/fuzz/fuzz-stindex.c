/* fuzz-stindex.c: libFuzzer harness for sharded model directories (lib/formats/safetensors.c,
 * dfl_st_model_open through model.safetensors.index.json).
 *
 * The input is the index JSON. It is written into a scratch model directory that holds a few
 * fixed shards (made once with the writer): model-00001-of-00002.safetensors (a, b),
 * model-00002-of-00002.safetensors (c, d), model-00001-of-00001.safetensors (a), a truncated
 * shard broken.safetensors, a subdirectory sub/ and, outside the model directory, a valid shard
 * ../outside.safetensors that no index may reach. An accepted index must list exactly the
 * tensors of the shards it names, each in its shard, all inside the model directory. */
#include <stdbool.h>
#include <sys/stat.h>

#include "fuzz.h"
#include "json.h"
#include "safetensors.h"

static char model_dir[512];

static void make_shard(const char *dir, const char *name, int n, const char *const *names, const dfl_dtype *dts)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    dfl_st_writer *w = dfl_st_writer_new();
    dfl_err e;
    static const uint8_t zeros[64];
    for (int i = 0; i < n; i++) {
        int64_t shape[2] = {2, i + 1};
        if (dfl_st_writer_add(w, names[i], dts[i], 2, shape, zeros, &e))
            fz_die("%s", e.msg);
    }
    if (dfl_st_write(w, path, &e))
        fz_die("%s", e.msg);
    dfl_st_writer_free(w);
}

static void setup(void)
{
    const char *top = fz_scratch_dir();
    snprintf(model_dir, sizeof model_dir, "%s/model", top);
    if (mkdir(model_dir, 0755) != 0)
        fz_die("mkdir %s: %s", model_dir, strerror(errno));
    const char *ab[] = {"a", "b"}, *cd[] = {"c", "model.embed_tokens.weight"}, *a[] = {"a"}, *x[] = {"x"};
    const dfl_dtype d2[] = {DFL_F32, DFL_BF16}, d2b[] = {DFL_F16, DFL_I64}, d1[] = {DFL_F32};
    make_shard(model_dir, "model-00001-of-00002.safetensors", 2, ab, d2);
    make_shard(model_dir, "model-00002-of-00002.safetensors", 2, cd, d2b);
    make_shard(model_dir, "model-00001-of-00001.safetensors", 1, a, d1);
    make_shard(top, "outside.safetensors", 1, x, d1);
    char path[1024];
    snprintf(path, sizeof path, "%s/broken.safetensors", model_dir);
    fz_write_file(path, (const uint8_t *)"\x40\0\0\0\0\0\0\0{\"a\":", 13);
    snprintf(path, sizeof path, "%s/sub", model_dir);
    if (mkdir(path, 0755) != 0)
        fz_die("mkdir %s: %s", path, strerror(errno));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!model_dir[0])
        setup();
    char index[600];
    snprintf(index, sizeof index, "%s/model.safetensors.index.json", model_dir);
    fz_write_file(index, data, size);
    dfl_st_model *m;
    dfl_err e;
    int rc = dfl_st_model_open(&m, model_dir, &e);
    fz_check_err(rc, &e, "dfl_st_model_open");
    if (rc) {
        FZ_ASSERT(m == NULL, "model returned on failure");
        /* a directory named as a shard cannot be mapped: that one is an I/O error */
        FZ_ASSERT(rc == DFL_EDATA || rc == DFL_ETRUNC || (rc == DFL_EIO && strstr(e.msg, "/sub")),
                  "code %s: %s", dfl_code_name(rc), e.msg);
        return 0;
    }
    /* accepted: the weight_map and the tensors agree exactly, and no file is outside */
    json_t *root;
    rc = dfl_json_parse((const char *)data, size, &root, "index", &e);
    FZ_ASSERT(rc == DFL_OK, "the model reader accepted an index that does not parse: %s", e.msg);
    json_t *wm = json_object_get(root, "weight_map");
    FZ_ASSERT(json_is_object(wm) && json_object_size(wm) == m->n, "weight_map of %zu, model of %zu tensors",
              json_object_size(wm), m->n);
    size_t dl = strlen(model_dir);
    for (size_t i = 0; i < m->n; i++) {
        const dfl_st_tensor *t = m->t[i];
        FZ_ASSERT(i == 0 || strcmp(m->t[i - 1]->name, t->name) < 0, "tensors not sorted");
        FZ_ASSERT(dfl_st_model_find(m, t->name) == t, "find %s", t->name);
        const char *shard = json_string_value(json_object_get(wm, t->name));
        FZ_ASSERT(shard != NULL, "tensor %s is not in the weight_map", t->name);
        FZ_ASSERT(strncmp(t->file, model_dir, dl) == 0 && t->file[dl] == '/' && strcmp(t->file + dl + 1, shard) == 0,
                  "tensor %s read from %s, the weight_map says %s", t->name, t->file, shard);
        fz_touch(t->data, t->nbytes);
    }
    json_decref(root);
    dfl_st_model_close(m);
    return 0;
}
