/* tensorview.c: tensor views, and opening any tensor file (safetensors, model and checkpoint
 * directories, torch.save files) as views (see tensorview.h). */
#include "tensorview.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"
#include "safetensors.h"
#include "torchfile.h"
#include "util.h"

const char *dfl_shape_str(int ndim, const int64_t *shape, char *buf, size_t n)
{
    size_t k = 0;
    if (n == 0)
        return buf;
    buf[0] = 0;
    k += (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%" PRId64, i ? ", " : "", shape[i]);
    if (k < n)
        snprintf(buf + k, n - k, "]");
    return buf;
}

/* ---------------------------------------------------------------- inputs */

const char *dfl_input_kind_name(dfl_input_kind k)
{
    switch (k) {
    case DFL_INPUT_SAFETENSORS: return "safetensors";
    case DFL_INPUT_MODEL_DIR: return "model-dir";
    case DFL_INPUT_CKPT_DIR: return "dfl-checkpoint";
    case DFL_INPUT_TORCH: return "torch";
    case DFL_INPUT_STREAM: return "dfl-stream";
    default: return "unknown";
    }
}

static bool member_exists(const char *dir, const char *name)
{
    char *p = dfl_path_join(dir, name);
    struct stat st;
    bool ok = p && stat(p, &st) == 0 && S_ISREG(st.st_mode);
    free(p);
    return ok;
}

int dfl_input_detect(const char *path, dfl_input_kind *kind, dfl_err *e)
{
    *kind = DFL_INPUT_UNKNOWN;
    if (strcmp(path, "-") == 0) {
        *kind = DFL_INPUT_STREAM;
        return DFL_OK;
    }
    struct stat st;
    if (stat(path, &st) != 0)
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open", path);
    if (S_ISDIR(st.st_mode)) {
        bool model = member_exists(path, "model.safetensors");
        if (model && (member_exists(path, "trainer_state.json") || member_exists(path, "optimizer.safetensors")))
            *kind = DFL_INPUT_CKPT_DIR;
        else if (model || member_exists(path, "model.safetensors.index.json"))
            *kind = DFL_INPUT_MODEL_DIR;
        else if (member_exists(path, "pytorch_model.bin"))
            *kind = DFL_INPUT_TORCH;
        else
            return dfl_fail(e, DFL_EDATA, "%s: not a checkpoint or model directory (no model.safetensors, "
                            "model.safetensors.index.json or pytorch_model.bin in it)", path);
        return DFL_OK;
    }
    if (!S_ISREG(st.st_mode)) {
        *kind = DFL_INPUT_STREAM; /* a pipe or a device can only carry a stream */
        return DFL_OK;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open", path);
    uint8_t b[16];
    size_t got = 0;
    dfl_err ignore;
    int rc = dfl_read_full(fd, b, sizeof b, &got, path, &ignore);
    close(fd);
    if (rc && rc != DFL_ETRUNC)
        return dfl_fail(e, DFL_EIO, "%s", ignore.msg);
    if (got == 0) /* whatever it was meant to be, it is cut short: the stream reader's message */
        return dfl_fail_empty(e, path);
    if (got >= 4 && memcmp(b, "\x89" "DFL", 4) == 0)
        *kind = DFL_INPUT_STREAM;
    else if (got >= 4 && b[0] == 'P' && b[1] == 'K' && ((b[2] == 3 && b[3] == 4) || (b[2] == 5 && b[3] == 6)))
        *kind = DFL_INPUT_TORCH;
    else if (got >= 2 && b[0] == 0x80 && b[1] >= 2 && b[1] <= 5)
        *kind = DFL_INPUT_TORCH; /* a pickle: the legacy torch format, refused by the reader */
    else if (got >= 9 && b[8] == '{')
        *kind = DFL_INPUT_SAFETENSORS; /* 8-byte length, then the JSON header */
    /* Content that fits no kind: a name that says what the file should be gets that reader, and
     * its precise message about what is wrong. */
    if (*kind == DFL_INPUT_UNKNOWN) {
        size_t n = strlen(path);
        static const struct { const char *ext; dfl_input_kind kind; } by_ext[] = {
            {".safetensors", DFL_INPUT_SAFETENSORS}, {".pt", DFL_INPUT_TORCH}, {".pth", DFL_INPUT_TORCH},
            {".bin", DFL_INPUT_TORCH}, {".dfl", DFL_INPUT_STREAM},
        };
        for (size_t i = 0; i < sizeof by_ext / sizeof by_ext[0]; i++) {
            size_t k = strlen(by_ext[i].ext);
            if (n > k && strcmp(path + n - k, by_ext[i].ext) == 0)
                *kind = by_ext[i].kind;
        }
    }
    if (*kind == DFL_INPUT_UNKNOWN)
        return dfl_fail(e, DFL_EDATA, "%s: not a checkpoint (neither a safetensors file, a torch.save "
                        "zip nor a .dfl stream)", path);
    return DFL_OK;
}

static int set_from_model(dfl_tensor_set *s, const char *label, const char *path, dfl_err *e)
{
    dfl_st_model *m;
    int rc = dfl_st_model_open(&m, path, e);
    if (rc)
        return rc;
    s->reader = m;
    s->label = dfl_strdup(label);
    s->t = calloc(m->n ? m->n : 1, sizeof *s->t);
    if (!s->label || !s->t)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    s->n = m->n;
    for (size_t i = 0; i < m->n; i++) {
        const dfl_st_tensor *t = m->t[i];
        dfl_tensor_view *v = &s->t[i];
        v->name = t->name;
        v->dtype = t->dtype;
        v->ndim = t->ndim;
        memcpy(v->shape, t->shape, sizeof v->shape);
        v->numel = t->numel;
        v->nbytes = t->nbytes;
        v->data = t->data;
        v->fd = -1;
        v->file_offset = t->offset;
        for (size_t k = 0; k < m->nfiles; k++)
            if (m->files[k]->path == t->file)
                v->fd = m->files[k]->map.fd;
    }
    return DFL_OK;
}

static int set_from_torch(dfl_tensor_set *s, const char *label, const char *path, unsigned flags, dfl_err *e)
{
    dfl_torch_file *f;
    int rc = dfl_torch_open(&f, path, (flags & DFL_TS_NO_DATA) ? DFL_TORCH_NO_DATA : 0, e);
    if (rc)
        return rc;
    s->reader = f;
    size_t n = dfl_torch_count(f);
    s->label = dfl_strdup(label);
    s->t = calloc(n ? n : 1, sizeof *s->t);
    if (!s->label || !s->t)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    s->n = n;
    for (size_t i = 0; i < n; i++)
        s->t[i] = dfl_torch_get(f, i)->v;
    return DFL_OK;
}

static int check_json_member(const char *dir, const char *name, bool required, dfl_err *e)
{
    char *p = dfl_path_join(dir, name);
    if (!p)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    int rc = DFL_OK;
    if (!member_exists(dir, name)) {
        if (required)
            rc = dfl_fail(e, DFL_EDATA, "%s: checkpoint directory without %s", dir, name);
    } else {
        json_t *j = NULL;
        rc = dfl_json_load_file(p, &j, e);
        if (!rc && !json_is_object(j))
            rc = dfl_fail(e, DFL_EDATA, "%s: not a JSON object", p);
        json_decref(j);
    }
    free(p);
    return rc;
}

int dfl_tensor_sets_open(const char *path, unsigned flags, dfl_tensor_set **sets, size_t *n, dfl_err *e)
{
    *sets = NULL;
    *n = 0;
    dfl_input_kind kind;
    int rc = dfl_input_detect(path, &kind, e);
    if (rc)
        return rc;
    if (kind == DFL_INPUT_STREAM)
        return dfl_fail(e, DFL_EUSAGE, "%s: a .dfl stream is not a tensor file", path);
    dfl_tensor_set *s = calloc(2, sizeof *s);
    if (!s)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    size_t k = 0;
    struct stat st;
    bool dir = stat(path, &st) == 0 && S_ISDIR(st.st_mode);
    if (kind == DFL_INPUT_CKPT_DIR) {
        rc = check_json_member(path, "config.json", true, e);
        if (!rc)
            rc = check_json_member(path, "trainer_state.json", false, e);
        const char *members[2] = {"model.safetensors", "optimizer.safetensors"};
        for (int i = 0; i < 2 && !rc; i++) {
            if (!member_exists(path, members[i]))
                continue;
            char *p = dfl_path_join(path, members[i]);
            if (!p) {
                rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
                break;
            }
            s[k].kind = DFL_INPUT_SAFETENSORS;
            k++;
            rc = set_from_model(&s[k - 1], p, p, e);
            free(p);
        }
    } else if (kind == DFL_INPUT_TORCH) {
        s[0].kind = DFL_INPUT_TORCH;
        k = 1;
        if (dir) {
            char *p = dfl_path_join(path, "pytorch_model.bin");
            rc = p ? set_from_torch(&s[0], p, p, flags, e) : dfl_fail(e, DFL_ENOMEM, "out of memory");
            free(p);
        } else {
            rc = set_from_torch(&s[0], path, path, flags, e);
        }
    } else {
        s[0].kind = kind;
        k = 1;
        rc = set_from_model(&s[0], path, path, e);
    }
    if (rc) {
        dfl_tensor_sets_close(s, k);
        return rc;
    }
    *sets = s;
    *n = k;
    return DFL_OK;
}

void dfl_tensor_sets_close(dfl_tensor_set *sets, size_t n)
{
    if (!sets)
        return;
    for (size_t i = 0; i < n; i++) {
        if (sets[i].kind == DFL_INPUT_TORCH)
            dfl_torch_close(sets[i].reader);
        else
            dfl_st_model_close(sets[i].reader);
        free(sets[i].label);
        free(sets[i].t);
    }
    free(sets);
}
