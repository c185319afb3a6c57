/* draft_ckpt.c: writing, finding and reading drafter checkpoints (see draft_ckpt.h). */
#include "draft_ckpt.h"

#include <dirent.h>
#include <fcntl.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"
#include "log.h"
#include "safetensors.h"
#include "scan.h"
#include "util.h"

#define STEP_FMT "step-%07lld"

/* In pieces over the threads (a checkpoint scans the 3 x 1.7e9 values of a 27B-target drafter);
 * the first non-finite index is the least over the pieces, whatever the threads. */
#define FINITE_PIECE (1 << 18)

bool dfl_draft_all_finite(const float *x, int64_t n, int64_t *first)
{
    int64_t bad = n;
#pragma omp parallel for schedule(static) reduction(min : bad) if (n > 4 * FINITE_PIECE)
    for (int64_t p = 0; p < n; p += FINITE_PIECE) {
        const int64_t end = n - p < FINITE_PIECE ? n : p + FINITE_PIECE;
        for (int64_t i = p; i < end; i++)
            if (!isfinite(x[i])) {
                bad = bad < i ? bad : i;
                break;
            }
    }
    if (bad == n)
        return true;
    if (first)
        *first = bad;
    return false;
}

/* Test hook, for the fault-injection tests (tests/bats/faults.bats) only. When the environment
 * has DFL_TEST_FAULT=POINT@STEP, writing the checkpoint of step STEP kills the process with
 * SIGKILL on reaching POINT (with DFL_TEST_FAULT=POINT@STEP:stop it stops itself with SIGSTOP
 * instead, for the test to send a signal of its choice by PID and then SIGCONT). Points:
 *   ckpt-begin          the temporary directory exists, empty
 *   ckpt-after-model    model.safetensors is written in it, nothing else
 *   ckpt-before-rename  every file is written and synced, under the temporary name
 *   ckpt-before-latest  renamed into place, latest not yet pointed at it
 *   ckpt-prune          (STEP: the checkpoint --keep removes) renamed to .step-N.old, its files
 *                       not yet removed
 * Without the variable, or with any other value, it does nothing but read the environment: it
 * cannot change what a checkpoint is or how it is written. */
static void fault_point(const char *point, int64_t step)
{
    const char *v = getenv("DFL_TEST_FAULT");
    size_t n = strlen(point);
    if (!v || strncmp(v, point, n) != 0 || v[n] != '@')
        return;
    char *end;
    errno = 0;
    long long s = strtoll(v + n + 1, &end, 10);
    bool stop = strcmp(end, ":stop") == 0;
    if (errno || end == v + n + 1 || s != step || (*end && !stop))
        return;
    dfl_warn("DFL_TEST_FAULT: %s at %s of the checkpoint of step %lld", stop ? "stopping" : "dying",
             point, (long long)step);
    raise(stop ? SIGSTOP : SIGKILL);
}

/* rm -r of a checkpoint directory (flat: files only). */
static int remove_dir(const char *dir, dfl_err *e)
{
    DIR *d = opendir(dir);
    if (!d)
        return errno == ENOENT ? DFL_OK : dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open", dir);
    struct dirent *de;
    int rc = DFL_OK;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        char *p = dfl_path_join(dir, de->d_name);
        if (!p || unlink(p) != 0)
            rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot remove", p ? p : dir);
        free(p);
    }
    closedir(d);
    if (!rc && rmdir(dir) != 0)
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot remove", dir);
    return rc;
}

static bool is_dir(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static int point_latest(const char *run, const char *name, dfl_err *e)
{
    char *tmp = dfl_path_join(run, ".latest.tmp"), *lat = dfl_path_join(run, "latest");
    int rc = DFL_OK;
    if (!tmp || !lat) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        goto out;
    }
    unlink(tmp);
    if (symlink(name, tmp) != 0) {
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot create a symlink", tmp);
        goto out;
    }
    if (rename(tmp, lat) != 0) {
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot rename to %s", tmp, lat);
        unlink(tmp);
        goto out;
    }
    rc = dfl_fsync_dir(run, e);
out:
    free(tmp);
    free(lat);
    return rc;
}

/* Puts the complete directory tmp in the place of the existing directory final. Where the file
 * system can exchange two names atomically, final never goes missing (tmp then holds the old
 * directory, which is removed); elsewhere the old one is moved aside to RUN/.NAME.old first.
 * A leftover old directory (a crash in between) is removed by dfl_draft_ckpt_clean. */
static int replace_dir(const char *run, const char *tmp, const char *final, dfl_err *e)
{
    if (renameat2(AT_FDCWD, tmp, AT_FDCWD, final, RENAME_EXCHANGE) == 0) {
        remove_dir(tmp, NULL);
        return DFL_OK;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot exchange with %s", tmp, final);
    const char *b = strrchr(final, '/');
    char old[300];
    snprintf(old, sizeof old, ".%s.old", b ? b + 1 : final);
    char *po = dfl_path_join(run, old);
    int rc = DFL_OK;
    if (!po)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    if ((rc = remove_dir(po, e)))
        goto out;
    if (rename(final, po) != 0) {
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot rename to %s", final, po);
        goto out;
    }
    if (rename(tmp, final) != 0) {
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot rename to %s", tmp, final);
        rename(po, final);
        goto out;
    }
    remove_dir(po, NULL);
out:
    free(po);
    return rc;
}

/* A buffer of n bytes for the checkpoint's copies, in 2 MiB pages where the kernel gives them
 * (transparent huge pages on request): filling gigabytes of fresh 4 KiB pages costs a page fault
 * each. */
static void *big_alloc(size_t n)
{
    const size_t align = (size_t)2 << 20, size = (n + align - 1) / align * align;
    void *p = NULL;
    if (posix_memalign(&p, align, size))
        return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, size, MADV_HUGEPAGE);
#endif
    return p;
}

int dfl_draft_ckpt_save(dfl_draft *m, const char *run, int64_t step, const json_t *state,
                        dfl_dtype model_dt, char **out_dir, dfl_err *e)
{
    if (out_dir)
        *out_dir = NULL;
    if (model_dt != DFL_BF16 && model_dt != DFL_F32)
        return dfl_fail(e, DFL_EUSAGE, "checkpoint weights must be bf16 or f32");
    char name[64], tname[80];
    snprintf(name, sizeof name, STEP_FMT, (long long)step);
    snprintf(tname, sizeof tname, ".%s.tmp", name);
    char *final = dfl_path_join(run, name), *tmp = dfl_path_join(run, tname);
    int64_t flat = dfl_draft_flat_len(m);
    float *buf[3] = {big_alloc((size_t)flat * 4), big_alloc((size_t)flat * 4), big_alloc((size_t)flat * 4)};
    void *mdl = big_alloc((size_t)flat * 4);
    dfl_st_writer *wm = dfl_st_writer_new(), *wo = dfl_st_writer_new();
    char *p = NULL;
    json_t *cfg = NULL;
    int rc = DFL_OK;
    if (!final || !tmp || !buf[0] || !buf[1] || !buf[2] || !mdl || !wm || !wo) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        goto out;
    }
    /* A step directory that exists already was left by a run that went further than the
     * checkpoint this one resumed from (killed before latest named it, or resumed from an earlier
     * step on purpose): it holds another run's state, so this run's replaces it. */
    bool replace = is_dir(final);
    if ((rc = dfl_draft_download(m, DFL_DRAFT_MASTER, buf[0], e)) ||
        (rc = dfl_draft_download(m, DFL_DRAFT_ADAM_M, buf[1], e)) ||
        (rc = dfl_draft_download(m, DFL_DRAFT_ADAM_V, buf[2], e)))
        goto out;
    int nt;
    const dfl_draft_tensor *t = dfl_draft_tensor_list(m, &nt);
    static const char *const what[3] = {"master weight", "AdamW exp_avg", "AdamW exp_avg_sq"};
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < nt; i++) {
            int64_t bad;
            if (!dfl_draft_all_finite(buf[k] + t[i].offset, t[i].numel, &bad)) {
                rc = dfl_fail(e, DFL_ENAN, "step %lld: %s '%s' element %lld is %g: checkpoint not "
                              "written", (long long)step, what[k], t[i].name, (long long)bad,
                              buf[k][t[i].offset + bad]);
                goto out;
            }
        }
    /* model.safetensors: the weights in the dtype written, scanned as written: an f32 weight
     * beyond the range of bf16 (|x| > 3.39e38) is finite in the master but +-Inf when saved */
    size_t es = dfl_dtype_size(model_dt);
    for (int i = 0; i < nt; i++) {
        void *dst = (char *)mdl + (size_t)t[i].offset * es;
        dfl_convert(dst, model_dt, buf[0] + t[i].offset, DFL_F32, (size_t)t[i].numel);
        dfl_scan_result sr;
        if ((rc = dfl_scan_nonfinite(dst, model_dt, (uint64_t)t[i].numel, 0, &sr, e)))
            goto out;
        if (sr.nonfinite > 0) {
            rc = dfl_fail(e, DFL_ENAN, "step %lld: model weight '%s' element %llu is %g, which is %g "
                          "in %s (beyond its range): checkpoint not written", (long long)step,
                          t[i].name, (unsigned long long)sr.first, buf[0][t[i].offset + (int64_t)sr.first],
                          dfl_load_f64(dst, model_dt, sr.first), dfl_dtype_name(model_dt));
            goto out;
        }
    }
    if ((rc = remove_dir(tmp, e)))
        goto out;
    if (mkdir(tmp, 0777) != 0) {
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot create", tmp);
        goto out;
    }
    fault_point("ckpt-begin", step);
    for (int i = 0; i < nt && !rc; i++)
        rc = dfl_st_writer_add(wm, t[i].name, model_dt, t[i].ndim, t[i].shape,
                               (char *)mdl + (size_t)t[i].offset * es, e);
    if (!rc)
        rc = dfl_st_writer_meta(wm, "format", "pt", e);
    if (!rc && !(p = dfl_path_join(tmp, "model.safetensors")))
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
    if (rc || (rc = dfl_st_write(wm, p, e)))
        goto fail;
    free(p);
    p = NULL;
    fault_point("ckpt-after-model", step);
    /* optimizer.safetensors */
    static const char *const pre[3] = {"master.", "exp_avg.", "exp_avg_sq."};
    for (int k = 0; k < 3 && !rc; k++)
        for (int i = 0; i < nt && !rc; i++) {
            char nm[128];
            snprintf(nm, sizeof nm, "%s%s", pre[k], t[i].name);
            rc = dfl_st_writer_add(wo, nm, DFL_F32, t[i].ndim, t[i].shape, buf[k] + t[i].offset, e);
        }
    if (!rc)
        rc = dfl_st_writer_meta(wo, "format", "dfl-draft-optimizer-1", e);
    if (!rc && !(p = dfl_path_join(tmp, "optimizer.safetensors")))
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
    if (rc || (rc = dfl_st_write(wo, p, e)))
        goto fail;
    free(p);
    /* config.json, trainer_state.json */
    cfg = dfl_draft_config_to_json(dfl_draft_cfg(m));
    json_object_set_new(cfg, "dtype", json_string(model_dt == DFL_BF16 ? "bfloat16" : "float32"));
    p = dfl_path_join(tmp, "config.json");
    if (!p || (rc = dfl_json_write_file(p, cfg, e)))
        goto fail;
    free(p);
    p = dfl_path_join(tmp, "trainer_state.json");
    if (!p || (rc = dfl_json_write_file(p, state, e)))
        goto fail;
    if ((rc = dfl_fsync_dir(tmp, e)))
        goto fail;
    fault_point("ckpt-before-rename", step);
    if (replace) {
        if ((rc = replace_dir(run, tmp, final, e)))
            goto fail;
    } else if (rename(tmp, final) != 0) {
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot rename to %s", tmp, final);
        goto fail;
    }
    if ((rc = dfl_fsync_dir(run, e)))
        goto out;
    fault_point("ckpt-before-latest", step);
    if ((rc = point_latest(run, name, e)))
        goto out;
    if (out_dir) {
        *out_dir = final;
        final = NULL;
    }
    goto out;
fail:
    if (!rc)
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
    remove_dir(tmp, NULL);
out:
    json_decref(cfg);
    free(p);
    dfl_st_writer_free(wm);
    dfl_st_writer_free(wo);
    free(mdl);
    for (int k = 0; k < 3; k++)
        free(buf[k]);
    free(final);
    free(tmp);
    return rc;
}

int dfl_draft_run_lock(const char *run, int *fd, dfl_err *e)
{
    *fd = -1;
    char *p = dfl_path_join(run, "dfl-draft.lock");
    if (!p)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    int rc = DFL_OK, f = open(p, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (f < 0) {
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open the lock of the run directory", p);
    } else if (flock(f, LOCK_EX | LOCK_NB) != 0) {
        int err = errno;
        if (err == EWOULDBLOCK) {   /* the holder wrote its PID after taking the lock */
            char buf[32] = "";
            ssize_t n = pread(f, buf, sizeof buf - 1, 0);
            long long pid = n > 0 ? strtoll(buf, NULL, 10) : 0;
            char who[48] = "another process";
            if (pid > 0)
                snprintf(who, sizeof who, "process %lld", pid);
            rc = dfl_fail(e, DFL_EUSAGE, "%s: the run directory is in use by %s (it holds %s): two "
                          "runs in one directory would mix their checkpoints and metrics; wait for "
                          "it to end, or give another --out", run, who, p);
        } else if (err == ENOLCK || err == ENOTSUP || err == EINVAL) {
            dfl_warn("%s: cannot lock (%s): nothing keeps a second run out of %s", p, strerror(err), run);
        } else {
            rc = dfl_fail_errno(e, DFL_EIO, err, "%s: cannot lock", p);
        }
        close(f);
        f = -1;
    } else {
        char pid[24];
        int n = snprintf(pid, sizeof pid, "%lld\n", (long long)getpid());
        if (ftruncate(f, 0) != 0 || pwrite(f, pid, (size_t)n, 0) != n)
            dfl_verbose("%s: cannot write the PID into it: %s", p, strerror(errno));
        *fd = f;
    }
    free(p);
    return rc;
}

/* True for the names of what an interrupted save leaves: .step-NNNNNNN.tmp, .step-NNNNNNN.old. */
static bool leftover_name(const char *n)
{
    size_t len = strlen(n);
    if (strncmp(n, ".step-", 6) != 0 || len < 11)
        return false;
    const char *suf = n + len - 4;
    if (strcmp(suf, ".tmp") != 0 && strcmp(suf, ".old") != 0)
        return false;
    for (const char *c = n + 6; c < suf; c++)
        if (*c < '0' || *c > '9')
            return false;
    return suf > n + 6;
}

int dfl_draft_ckpt_clean(const char *run, dfl_err *e)
{
    DIR *d = opendir(run);
    if (!d)
        return errno == ENOENT ? DFL_OK : dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open", run);
    struct dirent *de;
    int rc = DFL_OK;
    while ((de = readdir(d)) && !rc) {
        if (!leftover_name(de->d_name))
            continue;
        char *p = dfl_path_join(run, de->d_name);
        if (!p) {
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
            break;
        }
        if (is_dir(p) && !(rc = remove_dir(p, e)))
            dfl_warn("%s: removed what an interrupted checkpoint left (%s)", p,
                     strstr(de->d_name, ".tmp") ? "never completed" : "being replaced or pruned");
        free(p);
    }
    closedir(d);
    return rc;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int dfl_draft_ckpt_prune(const char *run, int keep, dfl_err *e)
{
    if (keep <= 0)
        return DFL_OK;
    DIR *d = opendir(run);
    if (!d)
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open", run);
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        long long s;
        char tail;
        if (sscanf(de->d_name, "step-%lld%c", &s, &tail) != 1 || strlen(de->d_name) < 12)
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            char **nn = realloc(names, cap * sizeof *nn);
            if (!nn)
                break;
            names = nn;
        }
        names[n++] = dfl_strdup(de->d_name);
    }
    closedir(d);
    char latest[256] = "";
    char *lat = dfl_path_join(run, "latest");
    ssize_t k = lat ? readlink(lat, latest, sizeof latest - 1) : -1;
    latest[k > 0 ? k : 0] = 0;
    free(lat);
    qsort(names, n, sizeof *names, cmp_str);   /* zero-padded: name order is step order */
    int rc = DFL_OK;
    for (size_t i = 0; i + (size_t)keep < n; i++) {
        if (names[i] && strcmp(names[i], latest) != 0) {
            /* renamed out of the way first, so that a crash while its files are removed never
             * leaves a step directory that looks complete but is not */
            char old[300];
            snprintf(old, sizeof old, ".%s.old", names[i]);
            char *p = dfl_path_join(run, names[i]), *po = dfl_path_join(run, old);
            int r = p && po ? DFL_OK : dfl_fail(e, DFL_ENOMEM, "out of memory");
            if (!r && (r = remove_dir(po, e)) == DFL_OK && rename(p, po) != 0)
                r = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot rename to %s", p, po);
            if (!r) {
                fault_point("ckpt-prune", strtoll(names[i] + 5, NULL, 10));
                r = remove_dir(po, e);
            }
            if (r && !rc)
                rc = r;
            free(p);
            free(po);
        }
    }
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    return rc;
}

int dfl_draft_ckpt_resolve(const char *path, char **dir, dfl_err *e)
{
    *dir = NULL;
    char *st = dfl_path_join(path, "trainer_state.json");
    char *lat = dfl_path_join(path, "latest");
    int rc = DFL_OK;
    if (!st || !lat) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
    } else if (access(st, F_OK) == 0) {
        char base[256] = "";   /* the last name of path, trailing slashes ignored */
        size_t n = strlen(path);
        while (n > 1 && path[n - 1] == '/')
            n--;
        size_t b = n;
        while (b > 0 && path[b - 1] != '/')
            b--;
        if (n - b < sizeof base)
            memcpy(base, path + b, n - b);
        if (leftover_name(base))
            rc = dfl_fail(e, DFL_EDATA, "%s: %s checkpoint left by an interrupted save: resume from "
                          "the run directory (its latest) instead", path,
                          strstr(base, ".tmp") ? "an incomplete (temporary)" : "a replaced");
        else
            *dir = dfl_strdup(path);
    } else if (is_dir(lat)) {
        char *t = dfl_path_join(lat, "trainer_state.json");
        if (t && access(t, F_OK) == 0)
            *dir = dfl_strdup(lat);
        else
            rc = dfl_fail(e, DFL_EDATA, "%s: latest has no trainer_state.json (not a checkpoint)", path);
        free(t);
    } else {
        rc = dfl_fail(e, DFL_EIO, "%s: not a checkpoint (no trainer_state.json) nor a run "
                      "directory (no latest)", path);
    }
    free(st);
    free(lat);
    if (!rc && !*dir)
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
    return rc;
}

int dfl_draft_ckpt_config(const char *dir, dfl_draft_config *c, dfl_err *e)
{
    char *p = dfl_path_join(dir, "config.json");
    json_t *j = NULL;
    int rc = p ? dfl_json_load_file(p, &j, e) : dfl_fail(e, DFL_ENOMEM, "out of memory");
    if (!rc)
        rc = dfl_draft_config_from_json(c, j, p, e);
    json_decref(j);
    free(p);
    return rc;
}

static bool same_config(const dfl_draft_config *a, const dfl_draft_config *b, char *what, size_t n)
{
#define CMP(f, nm)                                                                     \
    if (a->f != b->f) {                                                                \
        snprintf(what, n, "%s %lld vs %lld", nm, (long long)a->f, (long long)b->f);    \
        return false;                                                                  \
    }
    CMP(hidden, "hidden_size");
    CMP(vocab, "vocab_size");
    CMP(intermediate, "intermediate_size");
    CMP(n_layers, "num_hidden_layers");
    CMP(n_heads, "num_attention_heads");
    CMP(n_kv, "num_key_value_heads");
    CMP(head_dim, "head_dim");
    CMP(block_size, "block_size");
    CMP(mask_token_id, "mask_token_id");
    CMP(n_feat, "number of target layers");
    for (int i = 0; i < a->n_feat; i++)
        CMP(target_layers[i], "target layer id");
    for (int i = 0; i < a->n_layers && i < DFL_DRAFT_MAX_LAYERS; i++)
        CMP(sliding[i], "sliding layer (layer_types)");
    if (dfl_draft_n_sliding(a) > 0)
        CMP(sliding_window, "sliding_window");
#undef CMP
    return true;
}

int dfl_draft_ckpt_load(dfl_draft *m, const char *dir, json_t **state, dfl_err *e)
{
    *state = NULL;
    dfl_draft_config c = *dfl_draft_cfg(m);
    char what[128];
    int rc = dfl_draft_ckpt_config(dir, &c, e);
    if (rc)
        return rc;
    if (!same_config(&c, dfl_draft_cfg(m), what, sizeof what))
        return dfl_fail(e, DFL_EMISMATCH, "%s: the checkpoint's drafter differs from this run's "
                        "(%s)", dir, what);
    int64_t flat = dfl_draft_flat_len(m);
    float *buf = calloc((size_t)flat, 4);
    char *p = dfl_path_join(dir, "optimizer.safetensors");
    char *pm = dfl_path_join(dir, "model.safetensors");
    char *ps = dfl_path_join(dir, "trainer_state.json");
    dfl_st_file *f = NULL, *fm = NULL;
    if (!buf || !p || !pm || !ps) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = dfl_st_open(&fm, pm, e)) || (rc = dfl_st_open(&f, p, e)))
        goto out;
    /* every tensor of both files must be finite (model.safetensors is what gets served) */
    dfl_st_file *files[2] = {fm, f};
    for (int k = 0; k < 2; k++)
        for (size_t i = 0; i < files[k]->n; i++) {
            const dfl_st_tensor *t = &files[k]->t[i];
            if (!dfl_dtype_is_float(t->dtype))
                continue;
            for (uint64_t j = 0; j < t->numel; j++)
                if (!isfinite(dfl_load_f64(t->data, t->dtype, j))) {
                    rc = dfl_fail(e, DFL_ENAN, "%s: tensor '%s' element %llu is not finite: refusing "
                                  "to resume from it", files[k]->path, t->name, (unsigned long long)j);
                    goto out;
                }
        }
    static const char *const pre[3] = {"master.", "exp_avg.", "exp_avg_sq."};
    static const int which[3] = {DFL_DRAFT_MASTER, DFL_DRAFT_ADAM_M, DFL_DRAFT_ADAM_V};
    for (int k = 0; k < 3; k++) {
        if ((rc = dfl_draft_load_weights(m, f, pre[k], e)))
            goto out;
        if (k > 0) {   /* load_weights fills the master; move it to the moment buffer */
            if ((rc = dfl_draft_download(m, DFL_DRAFT_MASTER, buf, e)) ||
                (rc = dfl_draft_upload(m, which[k], buf, e)))
                goto out;
        }
    }
    /* the master last, so that the compute weights are the master's */
    if ((rc = dfl_draft_load_weights(m, f, "master.", e)))
        goto out;
    rc = dfl_json_load_file(ps, state, e);
out:
    dfl_st_close(f);
    dfl_st_close(fm);
    free(buf);
    free(p);
    free(pm);
    free(ps);
    return rc;
}
