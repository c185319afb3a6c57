/* torchfile.c: torch.save zip files, read without executing anything (see torchfile.h).
 *
 * Three steps: (1) list the zip entries and read <prefix>/data.pkl; (2) interpret the pickle with
 * a stack machine whose values are plain data (ints, strings, tuples, lists, dicts, allowlisted
 * names, storage records, tensor records), then walk the result into a flat list of named
 * tensors; (3) read the referenced storages and make the views. */
#include "torchfile.h"

#include <archive.h>
#include <archive_entry.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bytes.h"
#include "util.h"

#define MAX_STACK (1u << 20)       /* pickle stack entries */
#define MAX_MARKS 1024             /* open MARKs */
#define MAX_MEMO (1u << 22)        /* memo slots */
#define MAX_ARENA (512u << 20)     /* bytes of interpreter values */
#define MAX_VISITS (1u << 20)      /* nodes visited while flattening (checks included) */
#define MAX_GLOBAL_NAME 256

/* ---------------------------------------------------------------- small string hash map */

typedef struct strmap {
    size_t cap, n;          /* cap is 0 or a power of two */
    const char **keys;      /* borrowed */
    size_t *vals;
} strmap;

static uint64_t hash_str(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static bool strmap_get(const strmap *m, const char *k, size_t *v)
{
    if (!m->cap)
        return false;
    for (size_t i = hash_str(k) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (!m->keys[i])
            return false;
        if (strcmp(m->keys[i], k) == 0) {
            if (v)
                *v = m->vals[i];
            return true;
        }
    }
}

/* Inserts k -> v; returns 1 if k was already there (nothing changed), 0 if added, -1 on OOM. */
static int strmap_put(strmap *m, const char *k, size_t v)
{
    if (strmap_get(m, k, NULL))
        return 1;
    if ((m->n + 1) * 2 > m->cap) {
        size_t ncap = m->cap ? m->cap * 2 : 64;
        const char **nk = calloc(ncap, sizeof *nk);
        size_t *nv = calloc(ncap, sizeof *nv);
        if (!nk || !nv) {
            free(nk);
            free(nv);
            return -1;
        }
        for (size_t i = 0; i < m->cap; i++) {
            if (!m->keys[i])
                continue;
            size_t j = hash_str(m->keys[i]) & (ncap - 1);
            while (nk[j])
                j = (j + 1) & (ncap - 1);
            nk[j] = m->keys[i];
            nv[j] = m->vals[i];
        }
        free(m->keys);
        free(m->vals);
        m->keys = nk;
        m->vals = nv;
        m->cap = ncap;
    }
    size_t i = hash_str(k) & (m->cap - 1);
    while (m->keys[i])
        i = (i + 1) & (m->cap - 1);
    m->keys[i] = k;
    m->vals[i] = v;
    m->n++;
    return 0;
}

static void strmap_free(strmap *m)
{
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof *m);
}

/* ---------------------------------------------------------------- arena */

typedef struct arena_block {
    struct arena_block *next;
    size_t used, size;
    _Alignas(16) uint8_t data[];
} arena_block;

typedef struct arena {
    arena_block *head;
    size_t total;
} arena;

static void *arena_alloc(arena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (!a->head || a->head->size - a->head->used < n) {
        size_t size = n > (1u << 20) ? n : (1u << 20);
        if (a->total + size > MAX_ARENA)
            return NULL;
        arena_block *b = malloc(sizeof *b + size);
        if (!b)
            return NULL;
        b->next = a->head;
        b->used = 0;
        b->size = size;
        a->head = b;
        a->total += size;
    }
    void *p = a->head->data + a->head->used;
    a->head->used += n;
    return p;
}

static void arena_free(arena *a)
{
    for (arena_block *b = a->head, *nb; b; b = nb) {
        nb = b->next;
        free(b);
    }
    a->head = NULL;
    a->total = 0;
}

/* ---------------------------------------------------------------- pickle values */

typedef enum pv_kind {
    PV_NONE, PV_BOOL, PV_INT, PV_FLOAT, PV_STR, PV_BYTES,
    PV_TUPLE, PV_LIST, PV_DICT, PV_GLOBAL, PV_STORAGE, PV_TENSOR,
} pv_kind;

static const char *const pv_kind_name[] = {
    "None", "bool", "int", "float", "str", "bytes",
    "tuple", "list", "dict", "global", "storage", "tensor",
};

/* The names we understand. Everything else is refused when the pickle names it. */
typedef enum g_kind {
    G_ORDERED_DICT,
    G_REBUILD_V2,
    G_REBUILD_V3,
    G_REBUILD_PARAM,
    G_REBUILD_PARAM_STATE,
    G_REBUILD_FROM_TYPE,
    G_TENSOR_TYPE,          /* torch.Tensor, torch.nn.parameter.Parameter (as a type argument) */
    G_STORAGE,              /* typed storage class, dtype in g.dtype */
    G_UNTYPED_STORAGE,
    G_DTYPE,                /* a torch dtype object */
} g_kind;

typedef struct pv pv;
struct pv {
    pv_kind kind;
    union {
        bool b;
        int64_t i;
        double f;
        struct { const char *s; size_t len; } str;    /* NUL-terminated copy; bytes too */
        struct { pv **items; size_t n, cap; } seq;     /* tuple, list; dict: 2n items k,v */
        struct { g_kind kind; dfl_dtype dtype; const char *name; } g;
        size_t storage;                                /* index into storages */
        struct { size_t rec; bool param; } tensor;     /* index into records */
    } u;
};

typedef struct storage_rec {
    char *key;
    char *location;
    dfl_dtype dtype;        /* element type of the record; U8 for an untyped storage */
    bool untyped;
    uint64_t numel;         /* as the record says */
    uint64_t nbytes;
    bool needed;            /* a named tensor uses it */
    bool loaded;
    void *data;             /* nbytes, 64-byte aligned (NULL when nbytes == 0 or not loaded) */
} storage_rec;

typedef struct tensor_rec {
    size_t storage;
    dfl_dtype dtype;
    int ndim;
    int64_t shape[DFL_MAX_DIMS];
    int64_t stride[DFL_MAX_DIMS];
    uint64_t offset;        /* elements */
    uint64_t numel;
    bool contiguous;
} tensor_rec;

struct dfl_torch_file {
    char *path;
    char *prefix;
    uint64_t file_size;
    size_t n;
    dfl_torch_tensor *t;
    strmap by_name;
    size_t nstorages, cap_storages;
    storage_rec *storages;
    strmap storage_by_key;
    size_t nrecs, cap_recs;
    tensor_rec *recs;
    void **gathered;        /* per tensor: its gathered copy, or NULL */
};

/* ---------------------------------------------------------------- the interpreter */

typedef struct unpickler {
    dfl_torch_file *f;
    const char *what;       /* "<path>: <prefix>/data.pkl" */
    const uint8_t *buf;
    size_t len, pos, op_pos;
    arena ar;
    pv **stack;
    size_t sp, stack_cap;
    size_t marks[MAX_MARKS];
    size_t nmarks;
    pv **memo;
    size_t memo_cap, memo_len;
    dfl_err *e;
} unpickler;

#define UFAIL(u, code, ...) pk_fail((u), (code), __VA_ARGS__)

static int pk_fail(unpickler *u, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int pk_fail(unpickler *u, int code, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (u->op_pos >= u->len)
        return dfl_fail(u->e, code, "%s: offset %zu (the end): %s", u->what, u->op_pos, msg);
    return dfl_fail(u->e, code, "%s: offset %zu (opcode 0x%02x): %s", u->what, u->op_pos,
                    u->buf[u->op_pos], msg);
}

static pv *pv_new(unpickler *u, pv_kind k)
{
    pv *v = arena_alloc(&u->ar, sizeof *v);
    if (v) {
        memset(v, 0, sizeof *v);
        v->kind = k;
    }
    return v;
}

static int oom(unpickler *u)
{
    return UFAIL(u, DFL_EDATA, "the pickle needs more than %u MB of values (limit)", MAX_ARENA >> 20);
}

static int push(unpickler *u, pv *v)
{
    if (!v)
        return oom(u);
    if (u->sp == u->stack_cap) {
        if (u->stack_cap >= MAX_STACK)
            return UFAIL(u, DFL_EDATA, "pickle stack deeper than %u entries", MAX_STACK);
        if (!dfl_grow(&u->stack, &u->stack_cap, u->sp, sizeof *u->stack, 256))
            return UFAIL(u, DFL_ENOMEM, "out of memory");
    }
    u->stack[u->sp++] = v;
    return DFL_OK;
}

static int pop(unpickler *u, pv **v)
{
    size_t floor = u->nmarks ? u->marks[u->nmarks - 1] : 0;
    if (u->sp <= floor)
        return UFAIL(u, DFL_EDATA, "stack underflow");
    *v = u->stack[--u->sp];
    return DFL_OK;
}

static int top(unpickler *u, pv **v)
{
    size_t floor = u->nmarks ? u->marks[u->nmarks - 1] : 0;
    if (u->sp <= floor)
        return UFAIL(u, DFL_EDATA, "stack underflow");
    *v = u->stack[u->sp - 1];
    return DFL_OK;
}

/* top(), which must be of kind want: else "<op> a <kind>" (op e.g. "APPEND to"). */
static int top_kind(unpickler *u, pv_kind want, const char *op, pv **v)
{
    int rc = top(u, v);
    if (!rc && (*v)->kind != want)
        rc = UFAIL(u, DFL_EDATA, "%s a %s", op, pv_kind_name[(*v)->kind]);
    return rc;
}

/* Pops everything above the last MARK: *items points into the stack (valid until the next push). */
static int pop_mark(unpickler *u, pv ***items, size_t *n)
{
    if (!u->nmarks)
        return UFAIL(u, DFL_EDATA, "no MARK on the stack");
    size_t m = u->marks[--u->nmarks];
    *items = m < u->sp ? u->stack + m : NULL; /* no stack yet (a MARK before any push) */
    *n = u->sp - m;
    u->sp = m;
    return DFL_OK;
}

static int seq_append(unpickler *u, pv *s, pv *item)
{
    if (s->u.seq.n == s->u.seq.cap) {
        size_t ncap = s->u.seq.cap ? s->u.seq.cap * 2 : 4;
        pv **ni = arena_alloc(&u->ar, ncap * sizeof *ni);
        if (!ni)
            return oom(u);
        if (s->u.seq.n)
            memcpy(ni, s->u.seq.items, s->u.seq.n * sizeof *ni);
        s->u.seq.items = ni;
        s->u.seq.cap = ncap;
    }
    s->u.seq.items[s->u.seq.n++] = item;
    return DFL_OK;
}

static pv *seq_from(unpickler *u, pv_kind k, pv **items, size_t n)
{
    pv *s = pv_new(u, k);
    if (!s)
        return NULL;
    if (n) {
        s->u.seq.items = arena_alloc(&u->ar, n * sizeof(pv *));
        if (!s->u.seq.items)
            return NULL;
        memcpy(s->u.seq.items, items, n * sizeof(pv *));
        s->u.seq.n = s->u.seq.cap = n;
    }
    return s;
}

static int need(unpickler *u, size_t n)
{
    if (n > u->len - u->pos)
        return UFAIL(u, DFL_ETRUNC, "truncated: %zu bytes needed, %zu left", n, u->len - u->pos);
    return DFL_OK;
}

/* need(u, n), then the next n bytes as a little-endian integer, consumed. */
static int take_le(unpickler *u, size_t n, uint64_t *x)
{
    int rc = need(u, n);
    if (!rc) {
        *x = dfl_get_le(u->buf + u->pos, (int)n);
        u->pos += n;
    }
    return rc;
}

static int pk_string(unpickler *u, pv_kind k, uint64_t n)
{
    if (n > u->len - u->pos)
        return UFAIL(u, DFL_ETRUNC, "string of %" PRIu64 " bytes runs past the end of the pickle", n);
    pv *v = pv_new(u, k);
    char *s = v ? arena_alloc(&u->ar, n + 1) : NULL;
    if (!s)
        return oom(u);
    memcpy(s, u->buf + u->pos, n);
    s[n] = 0;
    u->pos += n;
    v->u.str.s = s;
    v->u.str.len = n;
    return push(u, v);
}

static int memo_put(unpickler *u, uint64_t idx)
{
    pv *v = NULL;
    int rc = top(u, &v);
    if (rc)
        return rc;
    if (idx >= MAX_MEMO || idx >= u->len)
        return UFAIL(u, DFL_EDATA, "memo index %" PRIu64 " out of range", idx);
    if (idx >= u->memo_cap) {
        size_t ncap = u->memo_cap ? u->memo_cap : 64;
        while (ncap <= idx)
            ncap *= 2;
        pv **nm = realloc(u->memo, ncap * sizeof *nm);
        if (!nm)
            return UFAIL(u, DFL_ENOMEM, "out of memory");
        memset(nm + u->memo_cap, 0, (ncap - u->memo_cap) * sizeof *nm);
        u->memo = nm;
        u->memo_cap = ncap;
    }
    if (!u->memo[idx])
        u->memo_len++;
    u->memo[idx] = v;
    return DFL_OK;
}

static int memo_get(unpickler *u, uint64_t idx)
{
    if (idx >= u->memo_cap || !u->memo[idx])
        return UFAIL(u, DFL_EDATA, "memo index %" PRIu64 " was never stored", idx);
    return push(u, u->memo[idx]);
}

/* --- allowlisted names */

static const struct { const char *name; dfl_dtype dtype; } storage_classes[] = {
    {"DoubleStorage", DFL_F64}, {"FloatStorage", DFL_F32}, {"HalfStorage", DFL_F16},
    {"BFloat16Storage", DFL_BF16}, {"LongStorage", DFL_I64}, {"IntStorage", DFL_I32},
    {"ShortStorage", DFL_I16}, {"CharStorage", DFL_I8}, {"ByteStorage", DFL_U8},
    {"BoolStorage", DFL_BOOL},
};

static const struct { const char *name; dfl_dtype dtype; } dtype_names[] = {
    {"float64", DFL_F64}, {"double", DFL_F64}, {"float32", DFL_F32}, {"float", DFL_F32},
    {"float16", DFL_F16}, {"half", DFL_F16}, {"bfloat16", DFL_BF16}, {"int64", DFL_I64},
    {"long", DFL_I64}, {"int32", DFL_I32}, {"int", DFL_I32}, {"int16", DFL_I16},
    {"short", DFL_I16}, {"int8", DFL_I8}, {"uint8", DFL_U8}, {"uint16", DFL_U16},
    {"uint32", DFL_U32}, {"uint64", DFL_U64}, {"bool", DFL_BOOL},
    {"float8_e4m3fn", DFL_F8_E4M3}, {"float8_e5m2", DFL_F8_E5M2},
};

static int pk_global(unpickler *u, const char *mod, const char *name)
{
    pv *v = pv_new(u, PV_GLOBAL);
    if (!v)
        return oom(u);
    v->u.g.dtype = DFL_DT_INVALID;
    bool ok = true;
    if (strcmp(mod, "collections") == 0 && strcmp(name, "OrderedDict") == 0) {
        v->u.g.kind = G_ORDERED_DICT;
    } else if (strcmp(mod, "torch._utils") == 0) {
        if (strcmp(name, "_rebuild_tensor_v2") == 0)
            v->u.g.kind = G_REBUILD_V2;
        else if (strcmp(name, "_rebuild_tensor_v3") == 0)
            v->u.g.kind = G_REBUILD_V3;
        else if (strcmp(name, "_rebuild_parameter") == 0)
            v->u.g.kind = G_REBUILD_PARAM;
        else if (strcmp(name, "_rebuild_parameter_with_state") == 0)
            v->u.g.kind = G_REBUILD_PARAM_STATE;
        else
            ok = false;
    } else if (strcmp(mod, "torch._tensor") == 0 && strcmp(name, "_rebuild_from_type_v2") == 0) {
        v->u.g.kind = G_REBUILD_FROM_TYPE;
    } else if ((strcmp(mod, "torch") == 0 && strcmp(name, "Tensor") == 0) ||
               (strcmp(mod, "torch.nn.parameter") == 0 && strcmp(name, "Parameter") == 0)) {
        v->u.g.kind = G_TENSOR_TYPE;
    } else if ((strcmp(mod, "torch") == 0 || strcmp(mod, "torch.storage") == 0) &&
               strcmp(name, "UntypedStorage") == 0) {
        v->u.g.kind = G_UNTYPED_STORAGE;
        v->u.g.dtype = DFL_U8;
    } else if (strcmp(mod, "torch") == 0) {
        ok = false;
        for (size_t i = 0; i < DFL_ARRAY_LEN(storage_classes) && !ok; i++)
            if (strcmp(name, storage_classes[i].name) == 0) {
                v->u.g.kind = G_STORAGE;
                v->u.g.dtype = storage_classes[i].dtype;
                ok = true;
            }
        for (size_t i = 0; i < DFL_ARRAY_LEN(dtype_names) && !ok; i++)
            if (strcmp(name, dtype_names[i].name) == 0) {
                v->u.g.kind = G_DTYPE;
                v->u.g.dtype = dtype_names[i].dtype;
                ok = true;
            }
        if (!ok) {
            size_t nl = strlen(name);
            if (nl > 7 && strcmp(name + nl - 7, "Storage") == 0)
                return UFAIL(u, DFL_EUNSUP, "torch.%s: tensors of this type are not supported "
                             "(supported: float, integer and bool dtypes)", name);
            return UFAIL(u, DFL_EUNSUP, "torch.%s is not supported here (not a tensor record "
                         "torch.save writes for a plain dtype)", name);
        }
    } else {
        ok = false;
    }
    if (!ok)
        return UFAIL(u, DFL_EDATA, "refusing the global %s.%s: only torch tensor records are "
                     "understood (nothing in the file is executed)", mod, name);
    size_t ml = strlen(mod), nl = strlen(name);
    char *full = arena_alloc(&u->ar, ml + nl + 2);
    if (!full)
        return oom(u);
    memcpy(full, mod, ml);
    full[ml] = '.';
    memcpy(full + ml + 1, name, nl + 1);
    v->u.g.name = full;
    return push(u, v);
}

static int read_line(unpickler *u, char *out, size_t cap)
{
    size_t max = u->len - u->pos;
    const uint8_t *nl = memchr(u->buf + u->pos, '\n', max < cap ? max : cap);
    if (!nl)
        return UFAIL(u, DFL_EDATA, "GLOBAL name not terminated within %zu bytes", cap - 1);
    size_t n = (size_t)(nl - (u->buf + u->pos));
    if (n >= cap)
        return UFAIL(u, DFL_EDATA, "GLOBAL name too long");
    memcpy(out, u->buf + u->pos, n);
    out[n] = 0;
    if (memchr(out, 0, n))
        return UFAIL(u, DFL_EDATA, "GLOBAL name contains a NUL byte");
    u->pos += n + 1;
    return DFL_OK;
}

/* --- storages and tensors */

static bool key_ok(const char *k, size_t n)
{
    if (n == 0 || n > 64)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = k[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              c == '_' || c == '-' || (c == '.' && i > 0)))
            return false;
    }
    return true;
}

static int pk_persid(unpickler *u, pv *pid)
{
    dfl_torch_file *f = u->f;
    if (pid->kind != PV_TUPLE || pid->u.seq.n != 5)
        return UFAIL(u, DFL_EDATA, "persistent id is not a 5-tuple ('storage', class, key, "
                     "location, numel)");
    pv **it = pid->u.seq.items;
    if (it[0]->kind != PV_STR || strcmp(it[0]->u.str.s, "storage") != 0)
        return UFAIL(u, DFL_EDATA, "persistent id does not start with 'storage'");
    if (it[1]->kind != PV_GLOBAL || (it[1]->u.g.kind != G_STORAGE && it[1]->u.g.kind != G_UNTYPED_STORAGE))
        return UFAIL(u, DFL_EDATA, "persistent id: the second item is not a storage class");
    if (it[2]->kind != PV_STR || !key_ok(it[2]->u.str.s, it[2]->u.str.len))
        return UFAIL(u, DFL_EDATA, "persistent id: bad storage key");
    if (it[3]->kind != PV_STR)
        return UFAIL(u, DFL_EDATA, "persistent id: the location is not a string");
    if (it[4]->kind != PV_INT || it[4]->u.i < 0)
        return UFAIL(u, DFL_EDATA, "persistent id: the element count is not a non-negative integer");
    dfl_dtype dt = it[1]->u.g.dtype;
    uint64_t numel = (uint64_t)it[4]->u.i, nbytes;
    if (!dfl_mul_u64(numel, dfl_dtype_size(dt), &nbytes) || nbytes > (1ull << 62))
        return UFAIL(u, DFL_EDATA, "storage '%s': %" PRIu64 " elements is too large", it[2]->u.str.s, numel);
    size_t idx;
    if (strmap_get(&f->storage_by_key, it[2]->u.str.s, &idx)) {
        storage_rec *s = &f->storages[idx];
        if (s->dtype != dt || s->numel != numel)
            return UFAIL(u, DFL_EDATA, "storage '%s' is described twice with different types or sizes",
                         s->key);
    } else {
        if (f->nstorages >= DFL_TORCH_MAX_TENSORS)
            return UFAIL(u, DFL_EDATA, "more than %u storages", DFL_TORCH_MAX_TENSORS);
        /* the key map borrows the key strings, which do not move */
        if (!dfl_grow(&f->storages, &f->cap_storages, f->nstorages, sizeof *f->storages, 16))
            return UFAIL(u, DFL_ENOMEM, "out of memory");
        storage_rec *s = &f->storages[f->nstorages];
        memset(s, 0, sizeof *s);
        s->key = dfl_strdup(it[2]->u.str.s);
        s->location = dfl_strdup(it[3]->u.str.s);
        if (!s->key || !s->location) {
            free(s->key);
            free(s->location);
            return UFAIL(u, DFL_ENOMEM, "out of memory");
        }
        s->dtype = dt;
        s->untyped = it[1]->u.g.kind == G_UNTYPED_STORAGE;
        s->numel = numel;
        s->nbytes = nbytes;
        idx = f->nstorages++;
        if (strmap_put(&f->storage_by_key, s->key, idx) < 0)
            return UFAIL(u, DFL_ENOMEM, "out of memory");
    }
    pv *v = pv_new(u, PV_STORAGE);
    if (!v)
        return oom(u);
    v->u.storage = idx;
    return push(u, v);
}

static int int_tuple(unpickler *u, const pv *t, const char *what, int *n, int64_t *out)
{
    if (t->kind != PV_TUPLE)
        return UFAIL(u, DFL_EDATA, "tensor record: %s is a %s, not a tuple", what, pv_kind_name[t->kind]);
    if (t->u.seq.n > DFL_MAX_DIMS)
        return UFAIL(u, DFL_EUNSUP, "tensor record: %zu dimensions (at most %d are supported)",
                     t->u.seq.n, DFL_MAX_DIMS);
    for (size_t i = 0; i < t->u.seq.n; i++) {
        if (t->u.seq.items[i]->kind != PV_INT)
            return UFAIL(u, DFL_EDATA, "tensor record: %s has a non-integer item", what);
        out[i] = t->u.seq.items[i]->u.i;
        if (out[i] < 0)
            return UFAIL(u, DFL_EDATA, "tensor record: negative %s %" PRId64, what, out[i]);
    }
    *n = (int)t->u.seq.n;
    return DFL_OK;
}

/* _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata]) and
 * _rebuild_tensor_v3(..., hooks, dtype[, metadata]): checks the view against its storage. */
static int pk_rebuild(unpickler *u, bool v3, const pv *args, pv **out)
{
    dfl_torch_file *f = u->f;
    size_t n = args->u.seq.n, nmin = v3 ? 7 : 6;
    if (n != nmin && n != nmin + 1)
        return UFAIL(u, DFL_EDATA, "_rebuild_tensor_v%d takes %zu or %zu arguments, not %zu",
                     v3 ? 3 : 2, nmin, nmin + 1, n);
    pv **a = args->u.seq.items;
    if (a[0]->kind != PV_STORAGE)
        return UFAIL(u, DFL_EDATA, "tensor record: the first argument is a %s, not a storage",
                     pv_kind_name[a[0]->kind]);
    if (a[1]->kind != PV_INT || a[1]->u.i < 0)
        return UFAIL(u, DFL_EDATA, "tensor record: the storage offset is not a non-negative integer");
    if (a[4]->kind != PV_BOOL)
        return UFAIL(u, DFL_EDATA, "tensor record: requires_grad is not a bool");
    if (a[5]->kind != PV_DICT)
        return UFAIL(u, DFL_EDATA, "tensor record: backward hooks are not an OrderedDict");
    storage_rec *s = &f->storages[a[0]->u.storage];
    tensor_rec r;
    memset(&r, 0, sizeof r);
    r.storage = a[0]->u.storage;
    r.offset = (uint64_t)a[1]->u.i;
    int nd_stride;
    int rc = int_tuple(u, a[2], "size", &r.ndim, r.shape);
    if (!rc)
        rc = int_tuple(u, a[3], "stride", &nd_stride, r.stride);
    if (rc)
        return rc;
    if (nd_stride != r.ndim)
        return UFAIL(u, DFL_EDATA, "tensor record: %d sizes but %d strides", r.ndim, nd_stride);
    if (v3) {
        if (a[6]->kind != PV_GLOBAL || a[6]->u.g.kind != G_DTYPE)
            return UFAIL(u, DFL_EDATA, "tensor record: the dtype argument is not a torch dtype");
        r.dtype = a[6]->u.g.dtype;
    } else {
        if (s->untyped)
            return UFAIL(u, DFL_EDATA, "_rebuild_tensor_v2 on an untyped storage (no dtype)");
        r.dtype = s->dtype;
    }
    uint64_t es = dfl_dtype_size(r.dtype);
    uint64_t cap = s->nbytes / es;          /* elements of r.dtype the storage holds */
    if (s->nbytes % es)
        return UFAIL(u, DFL_EDATA, "storage '%s' of %" PRIu64 " bytes is not a whole number of %s",
                     s->key, s->nbytes, dfl_dtype_lower(r.dtype));
    uint64_t numel = 1, last = r.offset, expect = 1;
    bool contig = true;
    for (int i = r.ndim - 1; i >= 0; i--) {
        uint64_t d = (uint64_t)r.shape[i], span;
        if (!dfl_mul_u64(numel, d, &numel) || numel > (1ull << 62))
            return UFAIL(u, DFL_EDATA, "tensor record: the shape overflows");
        if (d > 1 && (uint64_t)r.stride[i] != expect)
            contig = false;
        if (!dfl_mul_u64(expect, d, &expect))
            expect = UINT64_MAX; /* only compared against strides; numel check catches real overflow */
        if (d > 0 && (!dfl_mul_u64(d - 1, (uint64_t)r.stride[i], &span) || !dfl_add_u64(last, span, &last)))
            return UFAIL(u, DFL_EDATA, "tensor record: offset and strides overflow");
    }
    if (numel > 0 ? last >= cap : r.offset > cap)
        return UFAIL(u, DFL_EDATA, "tensor record: the view (offset %" PRIu64 ", shape and strides "
                     "reaching element %" PRIu64 ") lies outside storage '%s' of %" PRIu64 " elements",
                     r.offset, last, s->key, cap);
    r.numel = numel;
    r.contiguous = contig;
    uint64_t nbytes;
    if (!contig && (!dfl_mul_u64(numel, es, &nbytes) || nbytes > s->nbytes))
        return UFAIL(u, DFL_EUNSUP, "tensor record: an overlapping view (e.g. expanded) larger than "
                     "its storage '%s'", s->key);
    if (f->nrecs >= DFL_TORCH_MAX_TENSORS)
        return UFAIL(u, DFL_EDATA, "more than %u tensor records", DFL_TORCH_MAX_TENSORS);
    if (!dfl_grow(&f->recs, &f->cap_recs, f->nrecs, sizeof *f->recs, 64))
        return UFAIL(u, DFL_ENOMEM, "out of memory");
    f->recs[f->nrecs] = r;
    pv *v = pv_new(u, PV_TENSOR);
    if (!v)
        return oom(u);
    v->u.tensor.rec = f->nrecs++;
    *out = v;
    return DFL_OK;
}

static int pk_apply(unpickler *u, const pv *fn, const pv *args, pv **out)
{
    if (fn->kind != PV_GLOBAL)
        return UFAIL(u, DFL_EDATA, "REDUCE on a %s, not a callable name", pv_kind_name[fn->kind]);
    if (args->kind != PV_TUPLE)
        return UFAIL(u, DFL_EDATA, "REDUCE arguments are a %s, not a tuple", pv_kind_name[args->kind]);
    size_t n = args->u.seq.n;
    pv **a = args->u.seq.items;
    switch (fn->u.g.kind) {
    case G_ORDERED_DICT:
        if (n != 0)
            return UFAIL(u, DFL_EDATA, "OrderedDict called with arguments");
        *out = pv_new(u, PV_DICT);
        return *out ? DFL_OK : oom(u);
    case G_REBUILD_V2:
    case G_REBUILD_V3:
        return pk_rebuild(u, fn->u.g.kind == G_REBUILD_V3, args, out);
    case G_REBUILD_PARAM:
    case G_REBUILD_PARAM_STATE:
        if (n != (fn->u.g.kind == G_REBUILD_PARAM ? 3u : 4u) || a[0]->kind != PV_TENSOR ||
            a[1]->kind != PV_BOOL)
            return UFAIL(u, DFL_EDATA, "%s: bad arguments (expected a tensor, requires_grad, hooks%s)",
                         fn->u.g.name, fn->u.g.kind == G_REBUILD_PARAM ? "" : ", state");
        *out = pv_new(u, PV_TENSOR);
        if (!*out)
            return oom(u);
        (*out)->u.tensor.rec = a[0]->u.tensor.rec;
        (*out)->u.tensor.param = true;
        return DFL_OK;
    case G_REBUILD_FROM_TYPE:
        /* _rebuild_from_type_v2(func, type, args, state): a plain tensor with Python state */
        if (n != 4 || a[0]->kind != PV_GLOBAL ||
            (a[0]->u.g.kind != G_REBUILD_V2 && a[0]->u.g.kind != G_REBUILD_V3) ||
            a[1]->kind != PV_GLOBAL || a[1]->u.g.kind != G_TENSOR_TYPE || a[2]->kind != PV_TUPLE)
            return UFAIL(u, DFL_EDATA, "%s: bad arguments (expected a tensor rebuild function, "
                         "torch.Tensor, its arguments and a state)", fn->u.g.name);
        return pk_rebuild(u, a[0]->u.g.kind == G_REBUILD_V3, a[2], out);
    default:
        return UFAIL(u, DFL_EDATA, "refusing to call %s (it is not a tensor rebuild function)",
                     fn->u.g.name);
    }
}

enum {
    OP_MARK = '(', OP_STOP = '.', OP_BINFLOAT = 'G', OP_BININT = 'J', OP_BININT1 = 'K',
    OP_BININT2 = 'M', OP_NONE = 'N', OP_BINPERSID = 'Q', OP_REDUCE = 'R', OP_BINUNICODE = 'X',
    OP_EMPTY_LIST = ']', OP_APPEND = 'a', OP_BUILD = 'b', OP_GLOBAL = 'c', OP_DICT = 'd',
    OP_EMPTY_DICT = '}', OP_APPENDS = 'e', OP_BINGET = 'h', OP_LONG_BINGET = 'j', OP_LIST = 'l',
    OP_BINPUT = 'q', OP_LONG_BINPUT = 'r', OP_SETITEM = 's', OP_TUPLE = 't', OP_EMPTY_TUPLE = ')',
    OP_SETITEMS = 'u', OP_BINBYTES = 'B', OP_SHORT_BINBYTES = 'C',
    OP_PROTO = 0x80, OP_TUPLE1 = 0x85, OP_TUPLE2 = 0x86, OP_TUPLE3 = 0x87, OP_NEWTRUE = 0x88,
    OP_NEWFALSE = 0x89, OP_LONG1 = 0x8a, OP_SHORT_BINUNICODE = 0x8c, OP_BINUNICODE8 = 0x8d,
    OP_BINBYTES8 = 0x8e, OP_STACK_GLOBAL = 0x93, OP_MEMOIZE = 0x94, OP_FRAME = 0x95,
};

/* Runs the pickle to its STOP; *result is the value it returns. */
static int unpickle(unpickler *u, pv **result)
{
    int rc = DFL_OK;
    while (!rc) {
        u->op_pos = u->pos;
        if (u->pos >= u->len)
            return UFAIL(u, DFL_ETRUNC, "the pickle ends without STOP");
        uint8_t op = u->buf[u->pos++];
        pv *v = NULL, *k = NULL, *t = NULL;
        pv **items = NULL;
        size_t n = 0;
        switch (op) {
        case OP_PROTO:
            if (!(rc = need(u, 1))) {
                uint8_t p = u->buf[u->pos++];
                if (p < 2 || p > 5)
                    rc = UFAIL(u, DFL_EUNSUP, "pickle protocol %u (torch.save writes 2)", p);
            }
            break;
        case OP_FRAME:
            if (!(rc = need(u, 8)))
                u->pos += 8; /* framing is advisory: the opcodes carry their own lengths */
            break;
        case OP_STOP:
            if (!(rc = pop(u, &v))) {
                *result = v;
                return DFL_OK;
            }
            break;
        case OP_MARK:
            if (u->nmarks == MAX_MARKS)
                rc = UFAIL(u, DFL_EDATA, "more than %d nested MARKs", MAX_MARKS);
            else
                u->marks[u->nmarks++] = u->sp;
            break;
        case OP_EMPTY_DICT:
        case OP_EMPTY_LIST:
        case OP_EMPTY_TUPLE:
        case OP_NONE:
            rc = push(u, pv_new(u, op == OP_EMPTY_DICT    ? PV_DICT
                                   : op == OP_EMPTY_LIST  ? PV_LIST
                                   : op == OP_EMPTY_TUPLE ? PV_TUPLE
                                                          : PV_NONE));
            break;
        case OP_TUPLE:
        case OP_LIST:
            if (!(rc = pop_mark(u, &items, &n)))
                rc = push(u, seq_from(u, op == OP_TUPLE ? PV_TUPLE : PV_LIST, items, n));
            break;
        case OP_TUPLE1:
        case OP_TUPLE2:
        case OP_TUPLE3:
            n = (size_t)(op - OP_TUPLE1 + 1);
            {
                size_t floor = u->nmarks ? u->marks[u->nmarks - 1] : 0;
                if (u->sp - floor < n) {
                    rc = UFAIL(u, DFL_EDATA, "stack underflow");
                    break;
                }
                u->sp -= n;
                rc = push(u, seq_from(u, PV_TUPLE, u->stack + u->sp, n));
            }
            break;
        case OP_DICT:
            if ((rc = pop_mark(u, &items, &n)))
                break;
            if (n % 2) {
                rc = UFAIL(u, DFL_EDATA, "DICT with an odd number of items");
                break;
            }
            rc = push(u, seq_from(u, PV_DICT, items, n));
            break;
        case OP_APPEND:
            if (!(rc = pop(u, &v)) && !(rc = top_kind(u, PV_LIST, "APPEND to", &t)))
                rc = seq_append(u, t, v);
            break;
        case OP_APPENDS:
            if ((rc = pop_mark(u, &items, &n)) || (rc = top_kind(u, PV_LIST, "APPENDS to", &t)))
                break;
            for (size_t i = 0; i < n && !rc; i++)
                rc = seq_append(u, t, items[i]);
            break;
        case OP_SETITEM:
            if (!(rc = pop(u, &v)) && !(rc = pop(u, &k)) && !(rc = top_kind(u, PV_DICT, "SETITEM on", &t)) &&
                !(rc = seq_append(u, t, k)))
                rc = seq_append(u, t, v);
            break;
        case OP_SETITEMS:
            if ((rc = pop_mark(u, &items, &n)) || (rc = top_kind(u, PV_DICT, "SETITEMS on", &t)))
                break;
            if (n % 2) {
                rc = UFAIL(u, DFL_EDATA, "SETITEMS with an odd number of items");
                break;
            }
            for (size_t i = 0; i < n && !rc; i++)
                rc = seq_append(u, t, items[i]);
            break;
        case OP_BININT:
        case OP_BININT1:
        case OP_BININT2:
            n = op == OP_BININT ? 4 : op == OP_BININT1 ? 1 : 2;
            uint64_t iv;
            if ((rc = take_le(u, n, &iv)))
                break;
            v = pv_new(u, PV_INT);
            if (v)
                v->u.i = op == OP_BININT ? (int64_t)(int32_t)(uint32_t)iv : (int64_t)iv;
            rc = push(u, v);
            break;
        case OP_LONG1:
            if ((rc = need(u, 1)))
                break;
            n = u->buf[u->pos++];
            if ((rc = need(u, n)))
                break;
            if (n > 8) {
                rc = UFAIL(u, DFL_EUNSUP, "integer of %zu bytes", n);
                break;
            }
            v = pv_new(u, PV_INT);
            if (v) {
                uint64_t x = n ? dfl_get_le(u->buf + u->pos, (int)n) : 0;
                if (n > 0 && n < 8 && (u->buf[u->pos + n - 1] & 0x80))
                    x |= ~0ull << (8 * n); /* sign-extend */
                v->u.i = (int64_t)x;
            }
            u->pos += n;
            rc = push(u, v);
            break;
        case OP_BINFLOAT:
            if ((rc = need(u, 8)))
                break;
            v = pv_new(u, PV_FLOAT);
            if (v) {
                uint64_t x = 0;
                for (int i = 0; i < 8; i++)
                    x = (x << 8) | u->buf[u->pos + i]; /* big-endian */
                memcpy(&v->u.f, &x, 8);
            }
            u->pos += 8;
            rc = push(u, v);
            break;
        case OP_NEWTRUE:
        case OP_NEWFALSE:
            v = pv_new(u, PV_BOOL);
            if (v)
                v->u.b = op == OP_NEWTRUE;
            rc = push(u, v);
            break;
        case OP_SHORT_BINUNICODE:
        case OP_SHORT_BINBYTES:
        case OP_BINUNICODE:
        case OP_BINBYTES:
        case OP_BINUNICODE8:
        case OP_BINBYTES8: {
            bool str = op == OP_SHORT_BINUNICODE || op == OP_BINUNICODE || op == OP_BINUNICODE8;
            size_t w = op == OP_SHORT_BINUNICODE || op == OP_SHORT_BINBYTES ? 1
                       : op == OP_BINUNICODE || op == OP_BINBYTES ? 4 : 8;
            uint64_t len;
            if (!(rc = take_le(u, w, &len)))
                rc = pk_string(u, str ? PV_STR : PV_BYTES, len);
            break;
        }
        case OP_BINPUT:
        case OP_LONG_BINPUT:
        case OP_BINGET:
        case OP_LONG_BINGET: {
            uint64_t idx;
            if (!(rc = take_le(u, op == OP_BINPUT || op == OP_BINGET ? 1 : 4, &idx)))
                rc = op == OP_BINPUT || op == OP_LONG_BINPUT ? memo_put(u, idx) : memo_get(u, idx);
            break;
        }
        case OP_MEMOIZE:
            rc = memo_put(u, u->memo_len);
            break;
        case OP_GLOBAL: {
            char mod[MAX_GLOBAL_NAME], name[MAX_GLOBAL_NAME];
            if (!(rc = read_line(u, mod, sizeof mod)) && !(rc = read_line(u, name, sizeof name)))
                rc = pk_global(u, mod, name);
            break;
        }
        case OP_STACK_GLOBAL:
            if ((rc = pop(u, &v)) || (rc = pop(u, &k)))
                break;
            if (k->kind != PV_STR || v->kind != PV_STR || k->u.str.len >= MAX_GLOBAL_NAME ||
                v->u.str.len >= MAX_GLOBAL_NAME || strlen(k->u.str.s) != k->u.str.len ||
                strlen(v->u.str.s) != v->u.str.len)
                rc = UFAIL(u, DFL_EDATA, "STACK_GLOBAL needs two short strings");
            else
                rc = pk_global(u, k->u.str.s, v->u.str.s);
            break;
        case OP_REDUCE:
            if ((rc = pop(u, &v)) || (rc = pop(u, &k)))
                break;
            if (!(rc = pk_apply(u, k, v, &t)))
                rc = push(u, t);
            break;
        case OP_BUILD:
            if ((rc = pop(u, &v)) || (rc = top(u, &t)))
                break;
            /* the state of an OrderedDict (state_dict's _metadata) or of a tensor is not needed */
            if (t->kind != PV_DICT && t->kind != PV_TENSOR)
                rc = UFAIL(u, DFL_EUNSUP, "BUILD on a %s", pv_kind_name[t->kind]);
            break;
        case OP_BINPERSID:
            if (!(rc = pop(u, &v)))
                rc = pk_persid(u, v);
            break;
        default:
            if (op >= 0x20 && op < 0x7f)
                rc = UFAIL(u, DFL_EUNSUP, "unsupported pickle opcode '%c' (not one torch.save writes)", op);
            else
                rc = UFAIL(u, DFL_EUNSUP, "unsupported pickle opcode (not one torch.save writes)");
            break;
        }
    }
    return rc;
}

/* ---------------------------------------------------------------- flattening */

typedef struct flattener {
    dfl_torch_file *f;
    const char *what;
    char name[DFL_TORCH_MAX_NAME + 1];
    size_t visits;
    size_t cap;
    dfl_err *e;
} flattener;

static int add_tensor(flattener *fl, const pv *v, size_t len)
{
    dfl_torch_file *f = fl->f;
    const char *nm = len ? fl->name : "tensor";
    if (f->n >= DFL_TORCH_MAX_TENSORS)
        return dfl_fail(fl->e, DFL_EDATA, "%s: more than %u tensors", fl->what, DFL_TORCH_MAX_TENSORS);
    if (!dfl_grow(&f->t, &fl->cap, f->n, sizeof *f->t, 64))
        return dfl_fail(fl->e, DFL_ENOMEM, "%s: out of memory", fl->what);
    const tensor_rec *r = &f->recs[v->u.tensor.rec];
    storage_rec *s = &f->storages[r->storage];
    dfl_torch_tensor *t = &f->t[f->n];
    memset(t, 0, sizeof *t);
    char *name = dfl_strdup(nm);
    if (!name)
        return dfl_fail(fl->e, DFL_ENOMEM, "%s: out of memory", fl->what);
    t->v.name = name;
    t->v.fd = -1;
    f->n++; /* owns name from here on */
    t->v.dtype = r->dtype;
    t->v.ndim = r->ndim;
    memcpy(t->v.shape, r->shape, sizeof t->v.shape);
    memcpy(t->stride, r->stride, sizeof t->stride);
    t->v.numel = r->numel;
    t->v.nbytes = r->numel * dfl_dtype_size(r->dtype);
    t->storage = s->key;
    t->location = s->location;
    t->storage_offset = r->offset;
    t->gathered = !r->contiguous;
    t->parameter = v->u.tensor.param;
    s->needed = true;
    int put = strmap_put(&f->by_name, name, f->n - 1);
    if (put < 0)
        return dfl_fail(fl->e, DFL_ENOMEM, "%s: out of memory", fl->what);
    if (put > 0)
        return dfl_fail(fl->e, DFL_EDATA, "%s: two tensors are named '%s'", fl->what, name);
    return DFL_OK;
}

/* Appends ".key" (or "key" at the root) to fl->name at len; returns the new length or 0 when the
 * key cannot name anything (bad type), with *bad set. */
static int push_key(flattener *fl, size_t len, const pv *k, size_t *nlen, const char **bad)
{
    char num[32];
    const char *s;
    size_t n;
    *bad = NULL;
    if (k->kind == PV_STR) {
        s = k->u.str.s;
        n = k->u.str.len;
        if (strlen(s) != n) {
            *bad = "a string with a NUL byte";
            return DFL_OK;
        }
    } else if (k->kind == PV_INT) {
        n = (size_t)snprintf(num, sizeof num, "%" PRId64, k->u.i);
        s = num;
    } else {
        *bad = pv_kind_name[k->kind];
        return DFL_OK;
    }
    size_t need_len = len + (len ? 1 : 0) + n;
    if (need_len > DFL_TORCH_MAX_NAME)
        return dfl_fail(fl->e, DFL_EDATA, "%s: a tensor name longer than %d bytes", fl->what,
                        DFL_TORCH_MAX_NAME);
    if (len)
        fl->name[len++] = '.';
    memcpy(fl->name + len, s, n);
    fl->name[len + n] = 0;
    *nlen = len + n;
    return DFL_OK;
}

static bool has_tensor(const pv *v, int depth, size_t *visits)
{
    if (depth > DFL_TORCH_MAX_DEPTH || ++*visits > MAX_VISITS)
        return true; /* let the main walk report it */
    if (v->kind == PV_TENSOR)
        return true;
    if (v->kind == PV_DICT || v->kind == PV_LIST || v->kind == PV_TUPLE)
        for (size_t i = v->kind == PV_DICT ? 1 : 0; i < v->u.seq.n; i += v->kind == PV_DICT ? 2 : 1)
            if (has_tensor(v->u.seq.items[i], depth + 1, visits))
                return true;
    return false;
}

static int flatten(flattener *fl, const pv *v, size_t len, int depth)
{
    if (depth > DFL_TORCH_MAX_DEPTH)
        return dfl_fail(fl->e, DFL_EDATA, "%s: nesting deeper than %d levels at '%.60s...'", fl->what,
                        DFL_TORCH_MAX_DEPTH, fl->name);
    if (++fl->visits > MAX_VISITS)
        return dfl_fail(fl->e, DFL_EDATA, "%s: the saved object has more than %u nodes (shared "
                        "references multiply them)", fl->what, MAX_VISITS);
    switch (v->kind) {
    case PV_TENSOR:
        return add_tensor(fl, v, len);
    case PV_DICT:
    case PV_LIST:
    case PV_TUPLE: {
        bool dict = v->kind == PV_DICT;
        for (size_t i = 0; i < v->u.seq.n; i += dict ? 2 : 1) {
            const pv *child = v->u.seq.items[dict ? i + 1 : i];
            if (child->kind != PV_TENSOR && child->kind != PV_DICT && child->kind != PV_LIST &&
                child->kind != PV_TUPLE)
                continue;
            size_t nlen = 0;
            const char *bad = NULL;
            pv idx = {.kind = PV_INT, .u.i = (int64_t)(dict ? i / 2 : i)};
            int rc = push_key(fl, len, dict ? v->u.seq.items[i] : &idx, &nlen, &bad);
            if (rc)
                return rc;
            if (bad) {   /* its visits count toward the same bound: sharing cannot multiply them */
                bool t = has_tensor(child, depth + 1, &fl->visits);
                if (fl->visits > MAX_VISITS)
                    return dfl_fail(fl->e, DFL_EDATA, "%s: the saved object has more than %u nodes "
                                    "(shared references multiply them)", fl->what, MAX_VISITS);
                if (t)
                    return dfl_fail(fl->e, DFL_EUNSUP, "%s: a dict key of type %s under '%s' "
                                    "cannot name a tensor", fl->what, bad, len ? fl->name : "(root)");
                continue;
            }
            rc = flatten(fl, child, nlen, depth + 1);
            if (rc)
                return rc;
            fl->name[len] = 0;
        }
        return DFL_OK;
    }
    default:
        return DFL_OK; /* numbers, strings, None, dtypes: not tensors */
    }
}

/* ---------------------------------------------------------------- the zip */

typedef struct zip_entry {
    char *name;
    int64_t size;           /* -1 when the archive does not say */
} zip_entry;

typedef struct zip_list {
    size_t n, cap;
    zip_entry *e;
    strmap by_name;
} zip_list;

static void zip_list_free(zip_list *z)
{
    for (size_t i = 0; i < z->n; i++)
        free(z->e[i].name);
    free(z->e);
    strmap_free(&z->by_name);
}

static int zip_open(struct archive **out, const char *path, dfl_err *e)
{
    struct archive *a = archive_read_new();
    if (!a)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    archive_read_support_format_zip(a);
    if (archive_read_open_filename(a, path, 1 << 16) != ARCHIVE_OK) {
        int rc = dfl_fail(e, DFL_EDATA, "%s: not a readable zip archive: %s", path,
                          archive_error_string(a) ? archive_error_string(a) : "unknown error");
        archive_read_free(a);
        return rc;
    }
    *out = a;
    return DFL_OK;
}

static int zip_fail(struct archive *a, dfl_err *e, const char *path, const char *what)
{
    const char *m = archive_error_string(a);
    int errn = archive_errno(a);
    return dfl_fail(e, errn == EIO ? DFL_EIO : DFL_EDATA, "%s: %s: corrupt or truncated zip: %s", path,
                    what, m ? m : "unknown error");
}

/* Reads the current entry's data: exactly want bytes into buf and then the end of the entry
 * (a longer entry is an error: *got = want + 1). */
static int zip_read_exact(struct archive *a, void *buf, uint64_t want, uint64_t *got, const char *path,
                          const char *ename, dfl_err *e)
{
    uint64_t done = 0;
    uint8_t extra;
    *got = 0;
    while (done < want) {
        size_t chunk = want - done > (1u << 30) ? (1u << 30) : (size_t)(want - done);
        la_ssize_t r = archive_read_data(a, (uint8_t *)buf + done, chunk);
        if (r < 0)
            return zip_fail(a, e, path, ename);
        if (r == 0)
            break;
        done += (uint64_t)r;
    }
    *got = done;
    if (done == want) {
        la_ssize_t r = archive_read_data(a, &extra, 1);
        if (r < 0)
            return zip_fail(a, e, path, ename);
        if (r > 0)
            *got = want + 1;
    }
    return DFL_OK;
}

/* Pass 1: entry names and sizes, data.pkl and byteorder. */
static int zip_scan(dfl_torch_file *f, zip_list *z, uint8_t **pkl, size_t *pkl_len, char *byteorder,
                    dfl_err *e)
{
    struct archive *a;
    int rc = zip_open(&a, f->path, e);
    if (rc)
        return rc;
    struct archive_entry *ent;
    int r;
    char *pkl_name = NULL;
    *pkl = NULL;
    byteorder[0] = 0;
    char *bo_name = NULL;
    char bo_buf[16];
    while ((r = archive_read_next_header(a, &ent)) == ARCHIVE_OK || r == ARCHIVE_WARN) {
        const char *name = archive_entry_pathname(ent);
        if (!name) {
            rc = dfl_fail(e, DFL_EDATA, "%s: a zip entry without a readable name", f->path);
            break;
        }
        if (z->n >= DFL_TORCH_MAX_ENTRIES) {
            rc = dfl_fail(e, DFL_EDATA, "%s: more than %u zip entries", f->path, DFL_TORCH_MAX_ENTRIES);
            break;
        }
        if (!dfl_grow(&z->e, &z->cap, z->n, sizeof *z->e, 64)) {
            rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory", f->path);
            break;
        }
        zip_entry *ze = &z->e[z->n];
        ze->name = dfl_strdup(name);
        ze->size = archive_entry_size_is_set(ent) ? archive_entry_size(ent) : -1;
        if (!ze->name) {
            rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory", f->path);
            break;
        }
        z->n++;
        int put = strmap_put(&z->by_name, ze->name, z->n - 1);
        if (put) {
            rc = put < 0 ? dfl_fail(e, DFL_ENOMEM, "%s: out of memory", f->path)
                         : dfl_fail(e, DFL_EDATA, "%s: the zip holds two entries named '%s'", f->path, name);
            break;
        }
        const char *slash = strchr(name, '/');
        bool top_level = slash && slash > name && !strchr(slash + 1, '/');
        if (top_level && strcmp(slash + 1, "data.pkl") == 0) {
            if (*pkl) {
                rc = dfl_fail(e, DFL_EDATA, "%s: two pickles ('%s' and '%s'): not a torch.save file",
                              f->path, pkl_name, name);
                break;
            }
            if (ze->size > (int64_t)DFL_TORCH_MAX_PICKLE) {
                rc = dfl_fail(e, DFL_EDATA, "%s: %s is %" PRId64 " bytes, over the limit of %u MB",
                              f->path, name, ze->size, DFL_TORCH_MAX_PICKLE >> 20);
                break;
            }
            size_t cap = ze->size >= 0 ? (size_t)ze->size : DFL_TORCH_MAX_PICKLE;
            uint8_t *b = malloc(cap + 1);
            if (!b) {
                rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory", f->path);
                break;
            }
            uint64_t got;
            rc = zip_read_exact(a, b, cap, &got, f->path, name, e);
            if (!rc && ze->size >= 0 && got != (uint64_t)ze->size)
                rc = dfl_fail(e, DFL_EDATA, "%s: %s holds %" PRIu64 "%s bytes, the zip says %" PRId64,
                              f->path, name, got > cap ? cap : got, got > cap ? "+" : "", ze->size);
            if (!rc && ze->size < 0 && got > cap)
                rc = dfl_fail(e, DFL_EDATA, "%s: %s is over the limit of %u MB", f->path, name,
                              DFL_TORCH_MAX_PICKLE >> 20);
            if (rc) {
                free(b);
                break;
            }
            *pkl = b;
            *pkl_len = (size_t)got;
            pkl_name = ze->name;
            f->prefix = malloc((size_t)(slash - name) + 1);
            if (!f->prefix) {
                rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory", f->path);
                break;
            }
            memcpy(f->prefix, name, (size_t)(slash - name));
            f->prefix[slash - name] = 0;
        } else if (top_level && strcmp(slash + 1, "byteorder") == 0) {
            uint64_t got;
            rc = zip_read_exact(a, bo_buf, sizeof bo_buf - 1, &got, f->path, name, e);
            if (rc)
                break;
            if (got >= sizeof bo_buf - 1) {
                rc = dfl_fail(e, DFL_EDATA, "%s: %s is not 'little' or 'big'", f->path, name);
                break;
            }
            bo_buf[got] = 0;
            bo_name = ze->name;
            snprintf(byteorder, 16, "%s", bo_buf);
        } else if (archive_read_data_skip(a) != ARCHIVE_OK) {
            rc = zip_fail(a, e, f->path, name);
            break;
        }
    }
    if (!rc && r != ARCHIVE_EOF)
        rc = zip_fail(a, e, f->path, z->n ? z->e[z->n - 1].name : "reading the entries");
    archive_read_free(a);
    if (!rc && !*pkl)
        rc = dfl_fail(e, DFL_EDATA, "%s: a zip archive without <prefix>/data.pkl: not a torch.save file",
                      f->path);
    if (!rc && bo_name) {
        /* only the byteorder beside our data.pkl counts */
        size_t pl = strlen(f->prefix);
        if (strncmp(bo_name, f->prefix, pl) != 0 || bo_name[pl] != '/')
            byteorder[0] = 0;
    }
    return rc;
}

static char *storage_entry_name(const dfl_torch_file *f, const char *key)
{
    size_t n = strlen(f->prefix) + strlen(key) + 8;
    char *s = malloc(n);
    if (s)
        snprintf(s, n, "%s/data/%s", f->prefix, key);
    return s;
}

/* Checks every needed storage against its zip entry (present, size) before anything is read. */
static int check_storages(dfl_torch_file *f, const zip_list *z, dfl_err *e)
{
    for (size_t i = 0; i < f->nstorages; i++) {
        storage_rec *s = &f->storages[i];
        if (!s->needed)
            continue;
        char *en = storage_entry_name(f, s->key);
        if (!en)
            return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", f->path);
        size_t zi;
        int rc = DFL_OK;
        if (s->nbytes > f->file_size)
            rc = dfl_fail(e, DFL_EDATA, "%s: storage '%s' of %" PRIu64 " bytes is larger than the file "
                          "(compressed zip entries are not supported)", f->path, s->key, s->nbytes);
        else if (!strmap_get(&z->by_name, en, &zi))
            rc = dfl_fail(e, DFL_EDATA, "%s: storage '%s' is missing (no entry %s)", f->path, s->key, en);
        else if (z->e[zi].size >= 0 && (uint64_t)z->e[zi].size != s->nbytes)
            rc = dfl_fail(e, DFL_EDATA, "%s: storage '%s' (%s) has %" PRId64 " bytes, its record says "
                          "%" PRIu64 " x %s = %" PRIu64, f->path, s->key, en, z->e[zi].size, s->numel,
                          dfl_dtype_lower(s->dtype), s->nbytes);
        free(en);
        if (rc)
            return rc;
    }
    return DFL_OK;
}

/* Pass 2: reads every needed storage. */
static int load_storages(dfl_torch_file *f, dfl_err *e)
{
    size_t pl = strlen(f->prefix);
    struct archive *a;
    struct archive_entry *ent;
    int r, rc = zip_open(&a, f->path, e);
    if (rc)
        return rc;
    while ((r = archive_read_next_header(a, &ent)) == ARCHIVE_OK || r == ARCHIVE_WARN) {
        const char *name = archive_entry_pathname(ent);
        size_t idx;
        if (!name || strncmp(name, f->prefix, pl) != 0 || strncmp(name + pl, "/data/", 6) != 0 ||
            !strmap_get(&f->storage_by_key, name + pl + 6, &idx) || !f->storages[idx].needed ||
            f->storages[idx].loaded) {
            if (archive_read_data_skip(a) != ARCHIVE_OK) {
                rc = zip_fail(a, e, f->path, name ? name : "an entry");
                break;
            }
            continue;
        }
        storage_rec *s = &f->storages[idx];
        if (s->nbytes) {
            if (posix_memalign(&s->data, 64, (size_t)s->nbytes) != 0) {
                s->data = NULL;
                rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory reading storage '%s' (%" PRIu64 " bytes)",
                              f->path, s->key, s->nbytes);
                break;
            }
        }
        uint64_t got;
        rc = zip_read_exact(a, s->data, s->nbytes, &got, f->path, name, e);
        if (rc)
            break;
        if (got != s->nbytes) {
            rc = dfl_fail(e, DFL_EDATA, "%s: storage '%s' (%s) has %s%" PRIu64 " bytes, its record says %" PRIu64,
                          f->path, s->key, name, got > s->nbytes ? "more than " : "", got > s->nbytes ? s->nbytes : got,
                          s->nbytes);
            break;
        }
        s->loaded = true;
    }
    if (!rc && r != ARCHIVE_EOF)
        rc = zip_fail(a, e, f->path, "reading the storages");
    archive_read_free(a);
    for (size_t i = 0; i < f->nstorages && !rc; i++)
        if (f->storages[i].needed && !f->storages[i].loaded)
            rc = dfl_fail(e, DFL_EDATA, "%s: storage '%s' is missing", f->path, f->storages[i].key);
    return rc;
}

/* Copies a strided view into a contiguous buffer (offsets were checked against the storage). */
static void gather(void *dst, const void *src, size_t es, int ndim, const int64_t *shape,
                   const int64_t *stride, uint64_t offset, uint64_t numel)
{
    int64_t idx[DFL_MAX_DIMS] = {0};
    uint64_t pos = offset;
    uint8_t *d = dst;
    const uint8_t *s = src;
    for (uint64_t n = 0; n < numel; n++) {
        memcpy(d + n * es, s + pos * es, es);
        for (int i = ndim - 1; i >= 0; i--) {
            if (++idx[i] < shape[i]) {
                pos += (uint64_t)stride[i];
                break;
            }
            pos -= (uint64_t)stride[i] * (uint64_t)(shape[i] - 1);
            idx[i] = 0;
        }
    }
}

static int make_views(dfl_torch_file *f, dfl_err *e)
{
    f->gathered = calloc(f->n ? f->n : 1, sizeof *f->gathered);
    if (!f->gathered)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", f->path);
    for (size_t i = 0; i < f->n; i++) {
        dfl_torch_tensor *t = &f->t[i];
        size_t si;
        strmap_get(&f->storage_by_key, t->storage, &si);
        const storage_rec *s = &f->storages[si];
        size_t es = dfl_dtype_size(t->v.dtype);
        if (t->v.numel == 0) {
            t->v.data = s->data ? s->data : (const void *)"";
            continue;
        }
        if (!t->gathered) {
            t->v.data = (const uint8_t *)s->data + t->storage_offset * es;
            continue;
        }
        void *buf;
        if (posix_memalign(&buf, 64, (size_t)t->v.nbytes) != 0)
            return dfl_fail(e, DFL_ENOMEM, "%s: %s: out of memory gathering a view", f->path, t->v.name);
        gather(buf, s->data, es, t->v.ndim, t->v.shape, t->stride, t->storage_offset, t->v.numel);
        f->gathered[i] = buf;
        t->v.data = buf;
    }
    return DFL_OK;
}

/* ---------------------------------------------------------------- API */

bool dfl_torch_magic(const void *buf, size_t n)
{
    const uint8_t *b = buf;
    return n >= 4 && b[0] == 'P' && b[1] == 'K' &&
           ((b[2] == 3 && b[3] == 4) || (b[2] == 5 && b[3] == 6));
}

/* Recognizes what is not a zip before libarchive sees it: the legacy format, empty files. */
static int sniff(dfl_torch_file *f, dfl_err *e)
{
    int fd = open(f->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open", f->path);
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int err = errno;
        close(fd);
        return dfl_fail_errno(e, DFL_EIO, err, "%s: cannot stat", f->path);
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return dfl_fail(e, DFL_EIO, "%s: not a regular file", f->path);
    }
    f->file_size = (uint64_t)st.st_size;
    uint8_t head[8] = {0};
    size_t got = 0;
    dfl_err ignore;
    dfl_read_full(fd, head, sizeof head, &got, f->path, &ignore);
    if (got == 0) {
        close(fd);
        return dfl_fail_empty(e, f->path);
    }
    if (dfl_torch_magic(head, got)) {
        /* A complete zip ends with its end-of-central-directory record (22 bytes and a comment
         * of at most 64 KiB): without it the file was cut, even where the entries before the cut
         * would read. */
        size_t tail_len = f->file_size < 22 + 65535 ? (size_t)f->file_size : 22 + 65535;
        uint8_t *tail = malloc(tail_len);
        if (!tail) {
            close(fd);
            return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", f->path);
        }
        bool found = false;
        if (pread(fd, tail, tail_len, (off_t)(f->file_size - tail_len)) == (ssize_t)tail_len) {
            for (size_t i = tail_len >= 22 ? tail_len - 22 + 1 : 0; i-- > 0 && !found;)
                if (tail[i] == 'P' && tail[i + 1] == 'K' && tail[i + 2] == 5 && tail[i + 3] == 6 &&
                    i + 22 + ((size_t)tail[i + 20] | (size_t)tail[i + 21] << 8) == tail_len)
                    found = true;
        }
        free(tail);
        close(fd);
        if (!found)
            return dfl_fail(e, DFL_EDATA, "%s: corrupt or truncated zip: no end-of-central-directory "
                            "record at the end of the file", f->path);
        return DFL_OK;
    }
    close(fd);
    if (got >= 2 && head[0] == 0x80 && head[1] >= 2 && head[1] <= 5)
        return dfl_fail(e, DFL_EUNSUP, "%s: legacy torch.save format is not supported; re-save with "
                        "torch>=1.6", f->path);
    return dfl_fail(e, DFL_EDATA, "%s: not a torch.save file (no zip signature)", f->path);
}

void dfl_torch_close(dfl_torch_file *f)
{
    if (!f)
        return;
    for (size_t i = 0; i < f->n; i++) {
        free((char *)f->t[i].v.name);
        if (f->gathered)
            free(f->gathered[i]);
    }
    free(f->gathered);
    free(f->t);
    for (size_t i = 0; i < f->nstorages; i++) {
        free(f->storages[i].key);
        free(f->storages[i].location);
        free(f->storages[i].data);
    }
    free(f->storages);
    free(f->recs);
    strmap_free(&f->by_name);
    strmap_free(&f->storage_by_key);
    free(f->prefix);
    free(f->path);
    free(f);
}

int dfl_torch_open(dfl_torch_file **out, const char *path, unsigned flags, dfl_err *e)
{
    *out = NULL;
    dfl_torch_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = dfl_strdup(path))) {
        free(f);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    }
    zip_list z;
    memset(&z, 0, sizeof z);
    uint8_t *pkl = NULL;
    size_t pkl_len = 0;
    char byteorder[16];
    int rc = sniff(f, e);
    if (!rc)
        rc = zip_scan(f, &z, &pkl, &pkl_len, byteorder, e);
    if (!rc && byteorder[0] && strcmp(byteorder, "little") != 0)
        rc = dfl_fail(e, DFL_EUNSUP, "%s: byte order '%s': only little-endian torch files are supported",
                      path, byteorder);
    if (!rc) {
        char what[1024];
        snprintf(what, sizeof what, "%s: %s/data.pkl", path, f->prefix);
        unpickler u = {.f = f, .what = what, .buf = pkl, .len = pkl_len, .e = e};
        pv *root = NULL;
        rc = unpickle(&u, &root);
        if (!rc) {
            flattener *fl = calloc(1, sizeof *fl);
            if (!fl) {
                rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
            } else {
                fl->f = f;
                fl->what = what;
                fl->e = e;
                rc = flatten(fl, root, 0, 0);
                free(fl);
            }
        }
        arena_free(&u.ar);
        free(u.stack);
        free(u.memo);
    }
    free(pkl);
    if (!rc)
        rc = check_storages(f, &z, e);
    zip_list_free(&z);
    if (!rc && !(flags & DFL_TORCH_NO_DATA)) {
        rc = load_storages(f, e);
        if (!rc)
            rc = make_views(f, e);
    }
    if (rc) {
        dfl_torch_close(f);
        return rc;
    }
    *out = f;
    return DFL_OK;
}

size_t dfl_torch_count(const dfl_torch_file *f) { return f->n; }

const dfl_torch_tensor *dfl_torch_get(const dfl_torch_file *f, size_t i)
{
    return i < f->n ? &f->t[i] : NULL;
}

const dfl_torch_tensor *dfl_torch_find(const dfl_torch_file *f, const char *name)
{
    size_t i;
    return strmap_get(&f->by_name, name, &i) ? &f->t[i] : NULL;
}

const char *dfl_torch_prefix(const dfl_torch_file *f) { return f->prefix; }
size_t dfl_torch_storage_count(const dfl_torch_file *f) { return f->nstorages; }
