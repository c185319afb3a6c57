/* oracle-ref.h: the oracle's reference directories as the target tests (test-target.c,
 * gpu-target.c) read them. Header-only; include after t.h. */
#ifndef DFL_ORACLE_REF_H
#define DFL_ORACLE_REF_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"

#include "safetensors.h"

/* A reference directory: ref.safetensors with seq{i}.input_ids and seq{i}.layer{k}. */
typedef struct ref {
    dfl_st_file *f;
    int n_seqs, n_layers;
    const int32_t *ids[16];
    int64_t len[16];
} ref;

static bool ref_open(ref *r, const char *dir, dfl_err *e) __attribute__((unused));
static bool ref_open(ref *r, const char *dir, dfl_err *e)
{
    memset(r, 0, sizeof *r);
    char p[4096];
    snprintf(p, sizeof p, "%s/ref.safetensors", dir);
    if (dfl_st_open(&r->f, p, e))
        return false;
    for (int i = 0; i < 16; i++) {
        char name[64];
        snprintf(name, sizeof name, "seq%d.input_ids", i);
        const dfl_st_tensor *t = dfl_st_find(r->f, name);
        if (!t)
            break;
        r->ids[i] = t->data;
        r->len[i] = t->shape[0];
        r->n_seqs = i + 1;
    }
    for (int k = 0; k < 256; k++) {
        char name[64];
        snprintf(name, sizeof name, "seq0.layer%d", k);
        if (!dfl_st_find(r->f, name))
            break;
        r->n_layers = k + 1;
    }
    return r->n_seqs > 0 && r->n_layers > 0;
}

static const float *ref_layer(const ref *r, int s, int k) __attribute__((unused));
static const float *ref_layer(const ref *r, int s, int k)
{
    char name[64];
    snprintf(name, sizeof name, "seq%d.layer%d", s, k);
    const dfl_st_tensor *t = dfl_st_find(r->f, name);
    return t ? t->data : NULL;
}

/* ref_open, failing the test case with the reason when it fails. */
static bool ref_load(ref *r, const char *dir) __attribute__((unused));
static bool ref_load(ref *r, const char *dir)
{
    dfl_err e = {0};
    if (ref_open(r, dir, &e))
        return true;
    T_CHECK(0, "%s: %s", dir, e.msg);
    return false;
}

/* A host f32 copy of a model tensor (NULL if absent). */
static float *tensor_f32(const dfl_st_model *m, const char *name, int64_t *n) __attribute__((unused));
static float *tensor_f32(const dfl_st_model *m, const char *name, int64_t *n)
{
    const dfl_st_tensor *t = dfl_st_model_find(m, name);
    if (!t)
        return NULL;
    float *v = malloc((size_t)t->numel * sizeof *v);
    if (v && !dfl_convert(v, DFL_F32, t->data, t->dtype, (size_t)t->numel)) {
        free(v);
        return NULL;
    }
    *n = (int64_t)t->numel;
    return v;
}

#endif
