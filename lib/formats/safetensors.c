/* safetensors.c: the safetensors reader (mapped, every field checked), Hugging Face model
 * directories (single file or sharded), and the deterministic atomic writer (see safetensors.h). */
#include "safetensors.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bytes.h"
#include "json.h"

#if JANSSON_VERSION_HEX < 0x020800
#error "jansson >= 2.8 is needed (objects keep insertion order, which the writer relies on)"
#endif

#define ST_INDEX_NAME "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"

/* "[2, 3, 4]" into buf; for messages. */
static const char *fmt_shape(char *buf, size_t n, int ndim, const int64_t *shape)
{
    size_t k = 0;
    k += (size_t)snprintf(buf + k, n - k, "[");
    for (int i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (k < n)
        snprintf(buf + k, n - k, "]");
    return buf;
}

/* ------------------------------------------------------------------------------------------ */
/* Reader */

/* A non-negative JSON integer (reals, even 4.0, are refused: safetensors writes integers). */
static bool json_u63(const json_t *v, uint64_t *out)
{
    if (!json_is_integer(v))
        return false;
    json_int_t x = json_integer_value(v);
    if (x < 0)
        return false;
    *out = (uint64_t)x;
    return true;
}

static const char *json_kind(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "a list";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a real number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "unknown";
}

/* Checks one header entry and fills t (except data and file). */
static int parse_entry(const char *path, const char *name, const json_t *v,
                       dfl_st_tensor *t, dfl_err *e)
{
    if (!*name)
        return dfl_fail(e, DFL_EDATA, "%s: a tensor has an empty name", path);
    if (!json_is_object(v))
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': entry is %s, expected an object with "
                        "dtype, shape and data_offsets", path, name, json_kind(v));
    const char *key;
    json_t *x;
    json_object_foreach((json_t *)v, key, x) {
        if (strcmp(key, "dtype") && strcmp(key, "shape") && strcmp(key, "data_offsets"))
            return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': unknown key '%s' (expected dtype, "
                            "shape and data_offsets)", path, name, key);
    }
    const json_t *jd = json_object_get(v, "dtype");
    const json_t *js = json_object_get(v, "shape");
    const json_t *jo = json_object_get(v, "data_offsets");
    if (!jd)
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': missing dtype", path, name);
    if (!js)
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': missing shape", path, name);
    if (!jo)
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': missing data_offsets", path, name);

    if (!json_is_string(jd))
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': dtype is %s, expected a string such as "
                        "\"BF16\"", path, name, json_kind(jd));
    const char *ds = json_string_value(jd);
    dfl_dtype dt = dfl_dtype_from_name(ds);
    if (dt == DFL_DT_INVALID || strcmp(ds, dfl_dtype_name(dt)) != 0)
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': unknown dtype '%s' (known: BF16, F16, "
                        "F32, F64, I8, I16, I32, I64, U8, U16, U32, U64, BOOL, F8_E4M3, F8_E5M2)",
                        path, name, ds);
    t->dtype = dt;

    if (!json_is_array(js))
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': shape is %s, expected a list of "
                        "non-negative integers", path, name, json_kind(js));
    size_t nd = json_array_size(js);
    if (nd > DFL_MAX_DIMS)
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': shape has %zu dimensions, more than the "
                        "limit of %d", path, name, nd, DFL_MAX_DIMS);
    t->ndim = (int)nd;
    uint64_t numel = 1;
    bool zero = false, overflow = false;
    for (size_t i = 0; i < nd; i++) {
        const json_t *d = json_array_get(js, i);
        uint64_t u;
        if (!json_u63(d, &u)) {
            if (json_is_integer(d))
                return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': shape dimension %zu is negative "
                                "(%lld)", path, name, i, (long long)json_integer_value(d));
            return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': shape dimension %zu is %s, expected "
                            "a non-negative integer", path, name, i, json_kind(d));
        }
        t->shape[i] = (int64_t)u;
        if (u == 0)
            zero = true;
        else if (!dfl_mul_u64(numel, u, &numel))
            overflow = true;
    }
    for (size_t i = nd; i < DFL_MAX_DIMS; i++)
        t->shape[i] = 0;
    char sb[256];
    if (zero)
        numel = 0;
    else if (overflow)
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': shape %s has more elements than fit in "
                        "64 bits", path, name, fmt_shape(sb, sizeof sb, t->ndim, t->shape));
    t->numel = numel;

    if (!json_is_array(jo) || json_array_size(jo) != 2)
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': data_offsets must be a list of two "
                        "integers [begin, end]", path, name);
    uint64_t b, en;
    if (!json_u63(json_array_get(jo, 0), &b) || !json_u63(json_array_get(jo, 1), &en))
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': data_offsets must be two non-negative "
                        "integers [begin, end]", path, name);
    if (b > en)
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': data_offsets [%llu, %llu] end before "
                        "they begin", path, name, (unsigned long long)b, (unsigned long long)en);
    uint64_t want;
    if (!dfl_mul_u64(numel, dfl_dtype_size(dt), &want))
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': shape %s of %s is more bytes than fit in "
                        "64 bits", path, name, fmt_shape(sb, sizeof sb, t->ndim, t->shape), ds);
    if (want != en - b)
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': shape %s of %s is %llu bytes but "
                        "data_offsets [%llu, %llu] span %llu bytes", path, name,
                        fmt_shape(sb, sizeof sb, t->ndim, t->shape), ds, (unsigned long long)want,
                        (unsigned long long)b, (unsigned long long)en,
                        (unsigned long long)(en - b));
    t->offset = b;  /* relative to the data section for now */
    t->nbytes = en - b;
    return DFL_OK;
}

static int cmp_offset(const void *a, const void *b)
{
    const dfl_st_tensor *x = a, *y = b;
    if (x->offset != y->offset)
        return x->offset < y->offset ? -1 : 1;
    if (x->nbytes != y->nbytes)
        return x->nbytes < y->nbytes ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* qsort of indices by name needs the tensor array: sort pointers instead. */
static int cmp_tensor_ptr_name(const void *a, const void *b)
{
    const dfl_st_tensor *const *x = a, *const *y = b;
    return strcmp((*x)->name, (*y)->name);
}

static int check_metadata(const char *path, const json_t *m, dfl_err *e)
{
    if (!json_is_object(m))
        return dfl_fail(e, DFL_EDATA, "%s: __metadata__ is %s, expected an object of strings",
                        path, json_kind(m));
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)m, k, v) {
        if (!json_is_string(v))
            return dfl_fail(e, DFL_EDATA, "%s: __metadata__ key '%s' is %s, expected a string",
                            path, k, json_kind(v));
    }
    return DFL_OK;
}

static int st_parse(dfl_st_file *f, dfl_err *e)
{
    const char *path = f->path;
    size_t size = f->map.size;
    if (size == 0)
        return dfl_fail_empty(e, path);
    if (size < 8)
        return dfl_fail(e, DFL_ETRUNC, "%s: file of %zu bytes is too short for the 8-byte header "
                        "length (truncated, or not a safetensors file)", path, size);
    uint64_t n = dfl_get_le64(f->map.data);
    if (n > DFL_ST_MAX_HEADER)
        return dfl_fail(e, DFL_EDATA, "%s: header length %llu is over the limit of %u bytes (not "
                        "a safetensors file?)", path, (unsigned long long)n, DFL_ST_MAX_HEADER);
    if (n > size - 8)
        return dfl_fail(e, DFL_ETRUNC, "%s: header length %llu runs past the end of the file "
                        "(%zu bytes; truncated?)", path, (unsigned long long)n, size);
    if (n < 2)
        return dfl_fail(e, DFL_EDATA, "%s: header length %llu is too short for a JSON object",
                        path, (unsigned long long)n);
    f->header_len = n;
    f->data_start = 8 + n;
    const char *h = (const char *)f->map.data + 8;
    if (h[0] != '{')
        return dfl_fail(e, DFL_EDATA, "%s: header is not a JSON object (it must start with '{'; "
                        "not a safetensors file?)", path);
    json_t *root;
    char what[4200];
    snprintf(what, sizeof what, "%s: header", path);
    int rc = dfl_json_parse(h, (size_t)n, &root, what, e);
    if (rc)
        return rc;
    if (!json_is_object(root)) {
        json_decref(root);
        return dfl_fail(e, DFL_EDATA, "%s: header is not a JSON object", path);
    }
    uint64_t data_len = size - f->data_start;

    size_t cap = json_object_size(root);
    f->t = calloc(cap ? cap : 1, sizeof *f->t);
    if (!f->t) {
        json_decref(root);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory for %zu tensors", path, cap);
    }
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "__metadata__") == 0) {
            rc = check_metadata(path, v, e);
            if (rc)
                break;
            f->metadata = json_incref(v);
            continue;
        }
        dfl_st_tensor *t = &f->t[f->n];
        rc = parse_entry(path, key, v, t, e);
        if (rc)
            break;
        t->name = dfl_strdup(key);
        if (!t->name) {
            rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
            break;
        }
        t->file = f->path;
        f->n++;
    }
    json_decref(root);
    if (rc)
        return rc;

    /* Ranges: sorted by offset they must tile [0, data_len) exactly. */
    qsort(f->t, f->n, sizeof *f->t, cmp_offset);
    uint64_t end = 0;
    const dfl_st_tensor *prev = NULL;
    for (size_t i = 0; i < f->n; i++) {
        dfl_st_tensor *t = &f->t[i];
        if (t->offset > end) {
            if (prev)
                return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': hole of %llu bytes before its "
                                "data_offsets [%llu, %llu] (the previous tensor '%s' ends at %llu)",
                                path, t->name, (unsigned long long)(t->offset - end),
                                (unsigned long long)t->offset,
                                (unsigned long long)(t->offset + t->nbytes), prev->name,
                                (unsigned long long)end);
            return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': data does not start at offset 0 "
                            "(first data_offsets [%llu, %llu]; hole of %llu bytes)", path, t->name,
                            (unsigned long long)t->offset,
                            (unsigned long long)(t->offset + t->nbytes),
                            (unsigned long long)t->offset);
        }
        if (t->offset < end)
            return dfl_fail(e, DFL_EDATA, "%s: tensor '%s': data_offsets [%llu, %llu] overlap "
                            "tensor '%s' [%llu, %llu]", path, t->name,
                            (unsigned long long)t->offset,
                            (unsigned long long)(t->offset + t->nbytes), prev->name,
                            (unsigned long long)prev->offset,
                            (unsigned long long)(prev->offset + prev->nbytes));
        end = t->offset + t->nbytes;
        prev = t;
    }
    if (end > data_len) {
        /* the last tensor whose range passes the end names the problem */
        const dfl_st_tensor *t = prev;
        for (size_t i = 0; i < f->n; i++)
            if (f->t[i].offset + f->t[i].nbytes > data_len) {
                t = &f->t[i];
                break;
            }
        return dfl_fail(e, DFL_ETRUNC, "%s: tensor '%s': data_offsets [%llu, %llu] run past the "
                        "end of the data (%llu bytes after the header; file truncated?)", path,
                        t->name, (unsigned long long)t->offset,
                        (unsigned long long)(t->offset + t->nbytes),
                        (unsigned long long)data_len);
    }
    if (end < data_len)
        return dfl_fail(e, DFL_EDATA, "%s: %llu trailing bytes after the last tensor's data (the "
                        "header describes %llu data bytes, the file holds %llu)", path,
                        (unsigned long long)(data_len - end), (unsigned long long)end,
                        (unsigned long long)data_len);

    f->by_name = malloc((f->n ? f->n : 1) * sizeof *f->by_name);
    if (!f->by_name)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    for (size_t i = 0; i < f->n; i++) {
        dfl_st_tensor *t = &f->t[i];
        t->data = f->map.data + f->data_start + t->offset;
        t->offset += f->data_start;
        f->by_name[i] = t;
    }
    qsort(f->by_name, f->n, sizeof *f->by_name, cmp_tensor_ptr_name);
    return DFL_OK;
}

int dfl_st_open(dfl_st_file **out, const char *path, dfl_err *e)
{
    *out = NULL;
    dfl_st_file *f = calloc(1, sizeof *f);
    if (!f)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    f->map.fd = -1;
    f->path = dfl_strdup(path);
    if (!f->path) {
        free(f);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    }
    int rc = dfl_map_open(&f->map, path, e);
    if (!rc)
        rc = st_parse(f, e);
    if (rc) {
        dfl_st_close(f);
        return rc;
    }
    *out = f;
    return DFL_OK;
}

void dfl_st_close(dfl_st_file *f)
{
    if (!f)
        return;
    for (size_t i = 0; i < f->n; i++)
        free((char *)f->t[i].name);
    free(f->t);
    free(f->by_name);
    json_decref(f->metadata);
    if (f->map.fd >= 0 || f->map.data)
        dfl_map_close(&f->map);
    free(f->path);
    free(f);
}

static const dfl_st_tensor *find_sorted(const dfl_st_tensor *const *v, size_t n, const char *name)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(v[mid]->name, name);
        if (c == 0)
            return v[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

const dfl_st_tensor *dfl_st_find(const dfl_st_file *f, const char *name)
{
    return find_sorted((const dfl_st_tensor *const *)f->by_name, f->n, name);
}

const char *dfl_st_meta(const dfl_st_file *f, const char *key)
{
    if (!f->metadata)
        return NULL;
    return json_string_value(json_object_get(f->metadata, key));
}

/* ------------------------------------------------------------------------------------------ */
/* Model directories */

static bool is_dir(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static bool exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0;
}

static int model_add_file(dfl_st_model *m, const char *path, dfl_err *e)
{
    dfl_st_file **nf = realloc(m->files, (m->nfiles + 1) * sizeof *nf);
    if (!nf)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    m->files = nf;
    dfl_st_file *f;
    int rc = dfl_st_open(&f, path, e);
    if (rc)
        return rc;
    m->files[m->nfiles++] = f;
    return DFL_OK;
}

/* Collects the tensors of all files, sorted by name; names must be unique. */
static int model_index(dfl_st_model *m, dfl_err *e)
{
    size_t n = 0;
    for (size_t i = 0; i < m->nfiles; i++)
        n += m->files[i]->n;
    m->t = malloc((n ? n : 1) * sizeof *m->t);
    if (!m->t)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", m->dir);
    for (size_t i = 0; i < m->nfiles; i++)
        for (size_t j = 0; j < m->files[i]->n; j++)
            m->t[m->n++] = &m->files[i]->t[j];
    qsort(m->t, m->n, sizeof *m->t, cmp_tensor_ptr_name);
    for (size_t i = 1; i < m->n; i++)
        if (strcmp(m->t[i - 1]->name, m->t[i]->name) == 0)
            return dfl_fail(e, DFL_EDATA, "%s: tensor '%s' is in both %s and %s", m->dir,
                            m->t[i]->name, m->t[i - 1]->file, m->t[i]->file);
    return DFL_OK;
}

static bool shard_name_ok(const char *s)
{
    return *s && !strchr(s, '/') && !strstr(s, "..") && strcmp(s, ".") != 0;
}

static int cmp_str_ptr(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int model_open_index(dfl_st_model *m, const char *index, dfl_err *e)
{
    json_t *root;
    int rc = dfl_json_load_file(index, &root, e);
    if (rc)
        return rc;
    const char **shards = NULL;
    size_t nshards = 0;
    json_t *wm = json_is_object(root) ? json_object_get(root, "weight_map") : NULL;
    if (!json_is_object(root)) {
        rc = dfl_fail(e, DFL_EDATA, "%s: not a JSON object", index);
        goto out;
    }
    if (!wm) {
        rc = dfl_fail(e, DFL_EDATA, "%s: missing \"weight_map\"", index);
        goto out;
    }
    if (!json_is_object(wm)) {
        rc = dfl_fail(e, DFL_EDATA, "%s: \"weight_map\" is %s, expected an object of tensor "
                      "name -> shard file name", index, json_kind(wm));
        goto out;
    }
    if (json_object_size(wm) == 0) {
        rc = dfl_fail(e, DFL_EDATA, "%s: \"weight_map\" is empty", index);
        goto out;
    }
    shards = malloc(json_object_size(wm) * sizeof *shards);
    if (!shards) {
        rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory", index);
        goto out;
    }
    const char *name;
    json_t *v;
    json_object_foreach(wm, name, v) {
        if (!json_is_string(v)) {
            rc = dfl_fail(e, DFL_EDATA, "%s: weight_map entry '%s' is %s, expected a shard "
                          "file name", index, name, json_kind(v));
            goto out;
        }
        const char *s = json_string_value(v);
        if (!shard_name_ok(s)) {
            rc = dfl_fail(e, DFL_EDATA, "%s: weight_map entry '%s' names shard '%s': shard names "
                          "must be plain file names inside the model directory (no '/' or '..')",
                          index, name, s);
            goto out;
        }
        shards[nshards++] = s;
    }
    qsort(shards, nshards, sizeof *shards, cmp_str_ptr);
    size_t k = 0;
    for (size_t i = 0; i < nshards; i++)
        if (k == 0 || strcmp(shards[k - 1], shards[i]) != 0)
            shards[k++] = shards[i];
    nshards = k;
    for (size_t i = 0; i < nshards; i++) {
        char *p = dfl_path_join(m->dir, shards[i]);
        if (!p) {
            rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory", index);
            goto out;
        }
        if (!exists(p)) {
            rc = dfl_fail(e, DFL_EDATA, "%s: shard '%s' named by the weight_map does not exist "
                          "(%s)", index, shards[i], p);
            free(p);
            goto out;
        }
        rc = model_add_file(m, p, e);
        free(p);
        if (rc)
            goto out;
    }
    /* Every weight_map entry in the shard it names... */
    json_object_foreach(wm, name, v) {
        const char *s = json_string_value(v);
        for (size_t i = 0; i < m->nfiles; i++) {
            if (strcmp(shards[i], s) != 0)
                continue;
            if (!dfl_st_find(m->files[i], name)) {
                rc = dfl_fail(e, DFL_EDATA, "%s: tensor '%s' is listed in shard '%s', but %s has "
                              "no such tensor", index, name, s, m->files[i]->path);
                goto out;
            }
        }
    }
    /* ...and every shard tensor listed, for that shard. */
    for (size_t i = 0; i < m->nfiles; i++) {
        const dfl_st_file *f = m->files[i];
        for (size_t j = 0; j < f->n; j++) {
            json_t *w = json_object_get(wm, f->t[j].name);
            if (!w) {
                rc = dfl_fail(e, DFL_EDATA, "%s: tensor '%s' is not listed in the weight_map of %s",
                              f->path, f->t[j].name, index);
                goto out;
            }
            if (strcmp(json_string_value(w), shards[i]) != 0) {
                rc = dfl_fail(e, DFL_EDATA, "%s: tensor '%s' is also in %s, but the weight_map "
                              "places it in '%s'", index, f->t[j].name, f->path,
                              json_string_value(w));
                goto out;
            }
        }
    }
    rc = model_index(m, e);
out:
    free(shards);
    json_decref(root);
    return rc;
}

int dfl_st_model_open(dfl_st_model **out, const char *path, dfl_err *e)
{
    *out = NULL;
    dfl_st_model *m = calloc(1, sizeof *m);
    if (!m)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    int rc;
    if (!exists(path)) {
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open model", path);
        goto fail;
    }
    if (!is_dir(path)) {
        /* a single .safetensors file; dir is the directory holding it */
        m->dir = dfl_strdup(path);
        if (!m->dir) {
            rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
            goto fail;
        }
        char *slash = strrchr(m->dir, '/');
        if (!slash)
            strcpy(m->dir, ".");
        else if (slash == m->dir)
            slash[1] = 0;
        else
            *slash = 0;
        rc = model_add_file(m, path, e);
        if (!rc)
            rc = model_index(m, e);
        if (rc)
            goto fail;
        *out = m;
        return DFL_OK;
    }
    m->dir = dfl_strdup(path);
    char *single = dfl_path_join(path, ST_SINGLE_NAME);
    char *index = dfl_path_join(path, ST_INDEX_NAME);
    if (!m->dir || !single || !index) {
        free(single);
        free(index);
        rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
        goto fail;
    }
    /* Like transformers: a single model.safetensors wins over an index beside it. */
    if (exists(single)) {
        rc = model_add_file(m, single, e);
        if (!rc)
            rc = model_index(m, e);
    } else if (exists(index)) {
        rc = model_open_index(m, index, e);
    } else {
        rc = dfl_fail(e, DFL_EIO, "%s: no %s or %s in this directory", path, ST_SINGLE_NAME,
                      ST_INDEX_NAME);
    }
    free(single);
    free(index);
    if (rc)
        goto fail;
    *out = m;
    return DFL_OK;
fail:
    dfl_st_model_close(m);
    return rc;
}

void dfl_st_model_close(dfl_st_model *m)
{
    if (!m)
        return;
    for (size_t i = 0; i < m->nfiles; i++)
        dfl_st_close(m->files[i]);
    free(m->files);
    free(m->t);
    free(m->dir);
    free(m);
}

const dfl_st_tensor *dfl_st_model_find(const dfl_st_model *m, const char *name)
{
    return find_sorted(m->t, m->n, name);
}

int dfl_st_model_get(const dfl_st_model *m, const char *name, int ndim, const int64_t *shape,
                     const dfl_st_tensor **out, dfl_err *e)
{
    *out = NULL;
    const dfl_st_tensor *t = dfl_st_model_find(m, name);
    if (!t)
        return dfl_fail(e, DFL_EDATA, "%s: no tensor '%s' in the model", m->dir, name);
    if (!dfl_dtype_is_float(t->dtype))
        return dfl_fail(e, DFL_EDATA, "%s: tensor '%s' has dtype %s, expected a float type "
                        "(BF16, F16, F32, F64)", t->file, name, dfl_dtype_name(t->dtype));
    bool same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++)
        same = t->shape[i] == shape[i];
    if (!same) {
        char want[256], got[256];
        return dfl_fail(e, DFL_EMISMATCH, "%s: tensor '%s' has shape %s, expected %s", t->file,
                        name, fmt_shape(got, sizeof got, t->ndim, t->shape),
                        fmt_shape(want, sizeof want, ndim < 0 ? 0 : ndim, shape));
    }
    *out = t;
    return DFL_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* Writer */

typedef struct st_entry {
    char *name;
    dfl_dtype dtype;
    int ndim;
    int64_t shape[DFL_MAX_DIMS];
    uint64_t nbytes;
    const void *data;
} st_entry;

struct dfl_st_writer {
    size_t n, cap;
    st_entry *v;
    json_t *names;  /* set of names added (values null), for duplicate checks */
    json_t *meta;   /* key -> string */
};

dfl_st_writer *dfl_st_writer_new(void)
{
    dfl_st_writer *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    w->names = json_object();
    w->meta = json_object();
    if (!w->names || !w->meta) {
        dfl_st_writer_free(w);
        return NULL;
    }
    return w;
}

void dfl_st_writer_free(dfl_st_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n; i++)
        free(w->v[i].name);
    free(w->v);
    json_decref(w->names);
    json_decref(w->meta);
    free(w);
}

int dfl_st_writer_add(dfl_st_writer *w, const char *name, dfl_dtype dtype, int ndim,
                      const int64_t *shape, const void *data, dfl_err *e)
{
    if (!name || !*name)
        return dfl_fail(e, DFL_EUSAGE, "safetensors writer: empty tensor name");
    if (strcmp(name, "__metadata__") == 0)
        return dfl_fail(e, DFL_EUSAGE, "safetensors writer: '__metadata__' is not a tensor name");
    if (dfl_dtype_size(dtype) == 0)
        return dfl_fail(e, DFL_EUSAGE, "safetensors writer: tensor '%s': invalid dtype %d", name,
                        (int)dtype);
    if (ndim < 0 || ndim > DFL_MAX_DIMS)
        return dfl_fail(e, DFL_EUSAGE, "safetensors writer: tensor '%s': %d dimensions (at most "
                        "%d)", name, ndim, DFL_MAX_DIMS);
    uint64_t numel = 1;
    bool zero = false, overflow = false;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return dfl_fail(e, DFL_EUSAGE, "safetensors writer: tensor '%s': dimension %d is "
                            "negative (%lld)", name, i, (long long)shape[i]);
        if (shape[i] == 0)
            zero = true;
        else if (!dfl_mul_u64(numel, (uint64_t)shape[i], &numel))
            overflow = true;
    }
    uint64_t nbytes = 0;
    if (!zero && (overflow || !dfl_mul_u64(numel, dfl_dtype_size(dtype), &nbytes) ||
                  nbytes > (uint64_t)INT64_MAX))
        return dfl_fail(e, DFL_EUSAGE, "safetensors writer: tensor '%s': size overflows", name);
    if (nbytes > 0 && !data)
        return dfl_fail(e, DFL_EUSAGE, "safetensors writer: tensor '%s': no data", name);
    if (json_object_get(w->names, name))
        return dfl_fail(e, DFL_EUSAGE, "safetensors writer: duplicate tensor name '%s'", name);
    if (w->n == w->cap) {
        size_t nc = w->cap ? 2 * w->cap : 64;
        st_entry *nv = realloc(w->v, nc * sizeof *nv);
        if (!nv)
            return dfl_fail(e, DFL_ENOMEM, "safetensors writer: out of memory");
        w->v = nv;
        w->cap = nc;
    }
    if (json_object_set_new(w->names, name, json_null()) != 0)
        return dfl_fail(e, DFL_EUSAGE, "safetensors writer: tensor name '%s' is not valid UTF-8 "
                        "(or out of memory)", name);
    st_entry *t = &w->v[w->n];
    memset(t, 0, sizeof *t);
    t->name = dfl_strdup(name);
    if (!t->name) {
        json_object_del(w->names, name);
        return dfl_fail(e, DFL_ENOMEM, "safetensors writer: out of memory");
    }
    t->dtype = dtype;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++)
        t->shape[i] = shape[i];
    t->nbytes = nbytes;
    t->data = data;
    w->n++;
    return DFL_OK;
}

int dfl_st_writer_meta(dfl_st_writer *w, const char *key, const char *value, dfl_err *e)
{
    if (!key || !value)
        return dfl_fail(e, DFL_EUSAGE, "safetensors writer: metadata key and value are needed");
    if (json_object_get(w->meta, key))
        return dfl_fail(e, DFL_EUSAGE, "safetensors writer: duplicate metadata key '%s'", key);
    json_t *s = json_string(value);
    if (!s)
        return dfl_fail(e, DFL_EUSAGE, "safetensors writer: metadata '%s': value is not valid "
                        "UTF-8", key);
    if (json_object_set_new(w->meta, key, s) != 0)
        return dfl_fail(e, DFL_EUSAGE, "safetensors writer: metadata key '%s' is not valid UTF-8",
                        key);
    return DFL_OK;
}

/* Data order: element size descending (so every tensor is aligned to its element size), then
 * name. */
static int cmp_entry_data(const void *a, const void *b)
{
    const st_entry *const *x = a, *const *y = b;
    size_t sx = dfl_dtype_size((*x)->dtype), sy = dfl_dtype_size((*y)->dtype);
    if (sx != sy)
        return sx > sy ? -1 : 1;
    return strcmp((*x)->name, (*y)->name);
}

static int cmp_entry_name(const void *a, const void *b)
{
    const st_entry *const *x = a, *const *y = b;
    return strcmp((*x)->name, (*y)->name);
}

/* The header: {"__metadata__":{sorted keys},"<name>":{"data_offsets":[b,e],"dtype":"..",
 * "shape":[..]},...} with tensors sorted by name, compact, no spaces. */
static char *build_header(dfl_st_writer *w, st_entry **by_data, const uint64_t *begin, dfl_err *e)
{
    json_t *root = json_object();
    st_entry **by_name = malloc((w->n ? w->n : 1) * sizeof *by_name);
    char *text = NULL;
    if (!root || !by_name)
        goto oom;
    if (json_object_size(w->meta) > 0) {
        /* metadata keys in sorted order: rebuild through a sorted dump of the key list */
        json_t *m = json_object();
        if (!m || json_object_set_new(root, "__metadata__", m) != 0)
            goto oom;
        size_t nk = json_object_size(w->meta), k = 0;
        const char **keys = malloc(nk * sizeof *keys);
        if (!keys)
            goto oom;
        const char *key;
        json_t *v;
        json_object_foreach(w->meta, key, v) keys[k++] = key;
        qsort(keys, nk, sizeof *keys, cmp_str_ptr);
        for (k = 0; k < nk; k++)
            if (json_object_set(m, keys[k], json_object_get(w->meta, keys[k])) != 0) {
                free(keys);
                goto oom;
            }
        free(keys);
    }
    /* begin[] is indexed like by_data; map entry -> offset through a parallel sort */
    for (size_t i = 0; i < w->n; i++)
        by_name[i] = by_data[i];
    qsort(by_name, w->n, sizeof *by_name, cmp_entry_name);
    for (size_t i = 0; i < w->n; i++) {
        st_entry *t = by_name[i];
        size_t j = (size_t)(t - w->v);  /* entry index into w->v; begin[] is indexed by it */
        json_t *o = json_object(), *off = json_array(), *shp = json_array();
        if (!o || !off || !shp || json_object_set_new(root, t->name, o) != 0) {
            json_decref(o);
            json_decref(off);
            json_decref(shp);
            goto oom;
        }
        json_array_append_new(off, json_integer((json_int_t)begin[j]));
        json_array_append_new(off, json_integer((json_int_t)(begin[j] + t->nbytes)));
        for (int d = 0; d < t->ndim; d++)
            json_array_append_new(shp, json_integer((json_int_t)t->shape[d]));
        if (json_object_set_new(o, "data_offsets", off) != 0 ||
            json_object_set_new(o, "dtype", json_string(dfl_dtype_name(t->dtype))) != 0 ||
            json_object_set_new(o, "shape", shp) != 0 ||
            json_array_size(off) != 2 || json_array_size(shp) != (size_t)t->ndim)
            goto oom;
    }
    text = json_dumps(root, JSON_COMPACT);  /* insertion order, kept by jansson >= 2.8 */
    if (!text)
        goto oom;
    free(by_name);
    json_decref(root);
    return text;
oom:
    free(by_name);
    json_decref(root);
    dfl_fail(e, DFL_ENOMEM, "safetensors writer: out of memory building the header");
    return NULL;
}

int dfl_st_write(dfl_st_writer *w, const char *path, dfl_err *e)
{
    st_entry **order = malloc((w->n ? w->n : 1) * sizeof *order);
    uint64_t *begin = malloc((w->n ? w->n : 1) * sizeof *begin);
    if (!order || !begin) {
        free(order);
        free(begin);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    }
    for (size_t i = 0; i < w->n; i++)
        order[i] = &w->v[i];
    qsort(order, w->n, sizeof *order, cmp_entry_data);
    uint64_t off = 0;
    int rc = DFL_OK;
    for (size_t i = 0; i < w->n; i++) {
        begin[order[i] - w->v] = off;
        if (!dfl_add_u64(off, order[i]->nbytes, &off) || off > (uint64_t)INT64_MAX) {
            rc = dfl_fail(e, DFL_EUSAGE, "%s: total tensor data overflows", path);
            break;
        }
    }
    char *hdr = rc ? NULL : build_header(w, order, begin, e);
    if (!hdr) {
        free(order);
        free(begin);
        return rc ? rc : (e ? e->code : DFL_ENOMEM);
    }
    size_t hlen = strlen(hdr);
    size_t padded = (size_t)DFL_ALIGN_UP(8 + hlen, 64) - 8;
    if (padded > DFL_ST_MAX_HEADER) {
        free(hdr);
        free(order);
        free(begin);
        return dfl_fail(e, DFL_EUSAGE, "%s: header of %zu bytes would be over the limit of %u that "
                        "readers accept (too many tensors)", path, padded, DFL_ST_MAX_HEADER);
    }
    uint8_t *head = malloc(8 + padded);
    if (!head) {
        free(hdr);
        free(order);
        free(begin);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    }
    dfl_put_le64(head, padded);
    memcpy(head + 8, hdr, hlen);
    memset(head + 8 + hlen, ' ', padded - hlen);
    free(hdr);

    dfl_atomic a;
    rc = dfl_output_open(&a, path, e);
    if (!rc) {
        rc = dfl_write_all(a.fd, head, 8 + padded, path, e);
        for (size_t i = 0; !rc && i < w->n; i++)
            if (order[i]->nbytes > 0)
                rc = dfl_write_all(a.fd, order[i]->data, order[i]->nbytes, path, e);
        if (rc)
            dfl_atomic_abort(&a);
        else
            rc = dfl_atomic_commit(&a, e);
    }
    free(head);
    free(order);
    free(begin);
    return rc;
}
