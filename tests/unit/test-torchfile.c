/* test-torchfile.c: the torch.save reader on the stand-in fixtures (tests/fixtures/torch, each
 * with its .expect list of names, dtypes, shapes and content hashes), on real torch files when
 * tests/fixtures/torch/real/ has some, on the bad corpus (tests/bad/torch/EXPECT), and on every
 * truncation and many byte mutations of a pickle (rewrapped into a valid zip so that the
 * interpreter, not the zip CRC, meets them): never a crash, always a clean error. */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdint.h>
#include <unistd.h>

#include "torchfile.h"
#include "util.h"
#include "t.h"

/* The source tree: $DFL_SRCDIR, else three levels above this binary (build/tests/test-x). */
static const char *src_dir(void)
{
    static char dir[PATH_MAX];
    if (dir[0])
        return dir;
    const char *env = getenv("DFL_SRCDIR");
    if (env && *env) {
        snprintf(dir, sizeof dir, "%s", env);
        return dir;
    }
    ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
    if (n <= 0) {
        snprintf(dir, sizeof dir, ".");
        return dir;
    }
    dir[n] = 0;
    for (int i = 0; i < 3; i++) {
        char *s = strrchr(dir, '/');
        if (s)
            *s = 0;
    }
    return dir;
}

static char *src_path(const char *rel)
{
    static char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/%s", src_dir(), rel);
    return p;
}

static uint64_t fnv1a64(const void *data, uint64_t n)
{
    const uint8_t *p = data;
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint64_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

/* fopen(path, "r"), checked: NULL (a failed check) when it cannot be opened. */
static FILE *open_text(const char *path)
{
    FILE *fp = fopen(path, "r");
    T_CHECK(fp != NULL, "cannot open %s", path);
    return fp;
}

/* Compares f against an .expect file: same tensors in the same order, dtype, shape, hash. */
static void check_expect(const dfl_torch_file *f, const char *expect_path, bool with_data)
{
    FILE *fp = open_text(expect_path);
    if (!fp)
        return;
    char line[8192];
    size_t i = 0;
    while (fgets(line, sizeof line, fp)) {
        char name[4096], dtype[32], shape[256];
        unsigned long long hash;
        if (sscanf(line, "%4095s %31s %255s %llx", name, dtype, shape, &hash) != 4)
            continue;
        const dfl_torch_tensor *t = dfl_torch_get(f, i);
        T_CHECK(t != NULL, "%s: tensor %zu (%s) missing", expect_path, i, name);
        if (!t)
            break;
        T_CHECK(strcmp(t->v.name, name) == 0, "%s: tensor %zu is '%s', expected '%s'", expect_path, i,
                t->v.name, name);
        T_CHECK(t->v.dtype == dfl_dtype_from_name(dtype), "%s: dtype %s, expected %s", name,
                dfl_dtype_lower(t->v.dtype), dtype);
        char got[256];
        size_t k = 0;
        got[0] = 0;
        for (int d = 0; d < t->v.ndim; d++)
            k += (size_t)snprintf(got + k, sizeof got - k, "%s%" PRId64, d ? "," : "", t->v.shape[d]);
        if (t->v.ndim == 0)
            snprintf(got, sizeof got, "-");
        T_CHECK(strcmp(got, shape) == 0, "%s: shape %s, expected %s", name, got, shape);
        if (with_data) {
            T_CHECK(t->v.data != NULL, "%s: no data", name);
            if (t->v.data)
                T_CHECK(fnv1a64(t->v.data, t->v.nbytes) == hash, "%s: content hash differs", name);
        } else {
            T_CHECK(t->v.data == NULL, "%s: data loaded with DFL_TORCH_NO_DATA", name);
        }
        T_EQ_INT(t->v.nbytes, t->v.numel * dfl_dtype_size(t->v.dtype), "nbytes");
        T_CHECK(dfl_torch_find(f, name) == t, "find %s", name);
        i++;
    }
    fclose(fp);
    T_EQ_INT(dfl_torch_count(f), i, "tensor count");
}

static const char *fixtures[] = {"state_dict", "checkpoint", "proto4", "tensor"};

static void test_fixtures(void)
{
    for (size_t k = 0; k < DFL_ARRAY_LEN(fixtures); k++) {
        for (int with_data = 1; with_data >= 0; with_data--) {
            char pt[PATH_MAX], ex[PATH_MAX];
            snprintf(pt, sizeof pt, "%s/%s.pt", src_path("tests/fixtures/torch"), fixtures[k]);
            snprintf(ex, sizeof ex, "%s/%s.expect", src_path("tests/fixtures/torch"), fixtures[k]);
            dfl_torch_file *f;
            dfl_err e = {0};
            int rc = dfl_torch_open(&f, pt, with_data ? 0 : DFL_TORCH_NO_DATA, &e);
            T_CHECK(rc == 0, "open %s: %s", pt, e.msg);
            if (rc)
                continue;
            check_expect(f, ex, with_data);
            dfl_torch_close(f);
        }
    }
}

static void test_views(void)
{
    dfl_torch_file *f;
    dfl_err e;
    char pt[PATH_MAX];
    snprintf(pt, sizeof pt, "%s/state_dict.pt", src_path("tests/fixtures/torch"));
    int rc = dfl_torch_open(&f, pt, 0, &e);
    T_CHECK(rc == 0, "open: %s", e.msg);
    if (rc)
        return;
    T_CHECK(strcmp(dfl_torch_prefix(f), "archive") == 0, "prefix %s", dfl_torch_prefix(f));
    const dfl_torch_tensor *base = dfl_torch_find(f, "view.base"), *tr = dfl_torch_find(f, "view.t"),
                           *row = dfl_torch_find(f, "view.row"), *col = dfl_torch_find(f, "view.col");
    T_CHECK(base && tr && row && col, "views present");
    if (base && tr && row && col) {
        T_CHECK(!base->gathered && !row->gathered && tr->gathered && col->gathered, "gathered flags");
        T_CHECK(strcmp(base->storage, tr->storage) == 0, "one storage");
        /* a contiguous view points into its storage */
        T_CHECK((const float *)row->v.data == (const float *)base->v.data + 3, "row points into the storage");
        const float *t = tr->v.data;
        const float want[6] = {0, 3, 1, 4, 2, 5};
        for (int i = 0; i < 6; i++)
            T_NEAR(t[i], want[i], 0, "transposed element");
        const float *c = col->v.data;
        T_NEAR(c[0], 1, 0, "column 0");
        T_NEAR(c[1], 4, 0, "column 1");
        T_EQ_INT(tr->stride[0], 1, "stride kept");
        T_EQ_INT(tr->stride[1], 3, "stride kept");
    }
    const dfl_torch_tensor *sc = dfl_torch_find(f, "scalar"), *em = dfl_torch_find(f, "empty");
    T_CHECK(sc && sc->v.ndim == 0 && sc->v.numel == 1 && *(const float *)sc->v.data == 42.0f, "0-dim");
    T_CHECK(em && em->v.ndim == 1 && em->v.numel == 0 && em->v.nbytes == 0 && em->v.data, "empty");
    const dfl_torch_tensor *nan = dfl_torch_find(f, "nan");
    T_CHECK(nan && ((const uint16_t *)nan->v.data)[2] == 0x7fc0 &&
                ((const uint16_t *)nan->v.data)[5] == 0x7f80, "NaN and Inf kept bit for bit");
    T_EQ_INT(dfl_torch_storage_count(f), 14, "storages");
    dfl_torch_close(f);

    snprintf(pt, sizeof pt, "%s/checkpoint.pt", src_path("tests/fixtures/torch"));
    rc = dfl_torch_open(&f, pt, 0, &e);
    T_CHECK(rc == 0, "open: %s", e.msg);
    if (rc)
        return;
    T_CHECK(strcmp(dfl_torch_prefix(f), "checkpoint") == 0, "prefix %s", dfl_torch_prefix(f));
    const dfl_torch_tensor *w = dfl_torch_find(f, "model.w"), *ema = dfl_torch_find(f, "ema.0");
    T_CHECK(w && w->parameter, "model.w is a Parameter");
    T_CHECK(ema && !ema->parameter, "ema.0 is a plain tensor");
    T_CHECK(w && ema && w->v.data == ema->v.data, "a tensor referenced twice shares its data");
    T_CHECK(w && strcmp(w->location, "cpu") == 0, "location");
    T_CHECK(dfl_torch_find(f, "epoch") == NULL, "scalars are not tensors");
    dfl_torch_close(f);
}

/* Every file of tests/bad/torch/EXPECT is rejected with its code and message. */
static void test_bad_corpus(void)
{
    char ex[PATH_MAX], line[1024];
    int n = 0;
    snprintf(ex, sizeof ex, "%s/EXPECT", src_path("tests/bad/torch"));
    FILE *fp = open_text(ex);
    if (!fp)
        return;
    while (fgets(line, sizeof line, fp)) {
        if (line[0] == '#' || line[0] == '\n')
            continue;
        line[strcspn(line, "\n")] = 0;
        char *file = strtok(line, "\t"), *code = strtok(NULL, "\t"), *text = strtok(NULL, "\t");
        if (!file || !code || !text)
            continue;
        char pt[PATH_MAX];
        snprintf(pt, sizeof pt, "%s/%s", src_path("tests/bad/torch"), file);
        dfl_torch_file *f = NULL;
        dfl_err e = {0};
        int rc = dfl_torch_open(&f, pt, 0, &e);
        T_CHECK(rc != 0 && f == NULL, "%s: accepted", file);
        T_CHECK(strcmp(dfl_code_name(rc), code) == 0, "%s: code %s, expected %s (%s)", file,
                dfl_code_name(rc), code, e.msg);
        T_CHECK(strstr(e.msg, text) != NULL, "%s: message '%s' lacks '%s'", file, e.msg, text);
        T_CHECK(strstr(e.msg, file) != NULL, "%s: message '%s' does not name the file", file, e.msg);
        T_EQ_INT(dfl_exit_code(rc), 2, file);
        if (f)
            dfl_torch_close(f);
        n++;
    }
    fclose(fp);
    T_CHECK(n >= 40, "only %d bad files", n);
}

/* --- a minimal stored-zip writer, to wrap mutated pickles in archives with valid CRCs */

static uint32_t crc32_of(const uint8_t *p, size_t n)
{
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
    }
    return ~c;
}

typedef struct zentry {
    char name[128];
    const uint8_t *data;
    size_t len;
} zentry;

static void put16(FILE *f, unsigned v) { fputc(v & 0xff, f); fputc((v >> 8) & 0xff, f); }
static void put32(FILE *f, uint32_t v) { put16(f, v & 0xffff); put16(f, v >> 16); }

static int write_zip(const char *path, const zentry *ents, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    uint32_t offs[64];
    for (size_t i = 0; i < n; i++) {
        offs[i] = (uint32_t)ftell(f);
        size_t nl = strlen(ents[i].name);
        put32(f, 0x04034b50u); put16(f, 20); put16(f, 0); put16(f, 0); put16(f, 0); put16(f, 0x21);
        put32(f, crc32_of(ents[i].data, ents[i].len)); put32(f, (uint32_t)ents[i].len);
        put32(f, (uint32_t)ents[i].len); put16(f, (unsigned)nl); put16(f, 0);
        fwrite(ents[i].name, 1, nl, f);
        fwrite(ents[i].data, 1, ents[i].len, f);
    }
    uint32_t cd = (uint32_t)ftell(f);
    for (size_t i = 0; i < n; i++) {
        size_t nl = strlen(ents[i].name);
        put32(f, 0x02014b50u); put16(f, 20); put16(f, 20); put16(f, 0); put16(f, 0); put16(f, 0);
        put16(f, 0x21); put32(f, crc32_of(ents[i].data, ents[i].len)); put32(f, (uint32_t)ents[i].len);
        put32(f, (uint32_t)ents[i].len); put16(f, (unsigned)nl); put16(f, 0); put16(f, 0); put16(f, 0);
        put16(f, 0); put32(f, 0); put32(f, offs[i]);
        fwrite(ents[i].name, 1, nl, f);
    }
    uint32_t cdlen = (uint32_t)ftell(f) - cd;
    put32(f, 0x06054b50u); put16(f, 0); put16(f, 0); put16(f, (unsigned)n); put16(f, (unsigned)n);
    put32(f, cdlen); put32(f, cd); put16(f, 0);
    return fclose(f);
}

/* Reads the stored entries of a zip written by make_torch_like.py (local headers in order). */
static size_t read_entries(const uint8_t *b, size_t len, zentry *ents, size_t max)
{
    size_t pos = 0, n = 0;
    while (n < max && pos + 30 <= len && b[pos] == 'P' && b[pos + 1] == 'K' && b[pos + 2] == 3 && b[pos + 3] == 4) {
        uint32_t size = (uint32_t)b[pos + 18] | (uint32_t)b[pos + 19] << 8 | (uint32_t)b[pos + 20] << 16 |
                        (uint32_t)b[pos + 21] << 24;
        unsigned nl = b[pos + 26] | b[pos + 27] << 8, xl = b[pos + 28] | b[pos + 29] << 8;
        if (pos + 30 + nl + xl + size > len || nl >= sizeof ents[n].name)
            break;
        memcpy(ents[n].name, b + pos + 30, nl);
        ents[n].name[nl] = 0;
        ents[n].data = b + pos + 30 + nl + xl;
        ents[n].len = size;
        pos += 30 + nl + xl + size;
        n++;
    }
    return n;
}

static bool clean_error(int rc)
{
    return rc == DFL_OK || rc == DFL_EDATA || rc == DFL_ETRUNC || rc == DFL_EUNSUP;
}

/* The fixture checkpoint.pt read whole (NULL, checked, when it cannot be), and tmp set to
 * name in the scratch directory. */
static char *read_checkpoint(char *tmp, const char *name, size_t *len)
{
    char pt[PATH_MAX];
    snprintf(pt, sizeof pt, "%s/checkpoint.pt", src_path("tests/fixtures/torch"));
    snprintf(tmp, PATH_MAX, "%s/%s", t_tmpdir(), name);
    char *buf = NULL;
    dfl_err e;
    *len = 0;
    T_CHECK(dfl_read_file(pt, 1 << 20, &buf, len, &e) == 0, "read %s", e.msg);
    return buf;
}

static void test_truncations(void)
{
    char tmp[PATH_MAX];
    size_t len;
    char *buf = read_checkpoint(tmp, "cut.pt", &len);
    dfl_err e;
    int bad = 0;
    for (size_t cut = 0; cut < len; cut++) {
        FILE *fp = fopen(tmp, "wb");
        if (!fp || fwrite(buf, 1, cut, fp) != cut || fclose(fp) != 0)
            break;
        dfl_torch_file *f = NULL;
        int rc = dfl_torch_open(&f, tmp, 0, &e);
        if (rc == 0 || !clean_error(rc) || !strstr(e.msg, tmp)) {
            if (bad++ < 5)
                T_CHECK(0, "cut at %zu: rc %d (%s)", cut, rc, rc ? e.msg : "accepted");
        }
        dfl_torch_close(f);
    }
    free(buf);
}

static void test_pickle_mutations(void)
{
    char tmp[PATH_MAX];
    size_t len;
    char *buf = read_checkpoint(tmp, "mut.pt", &len);
    dfl_err e;
    zentry ents[64];
    size_t n = read_entries((const uint8_t *)buf, len, ents, 64);
    T_CHECK(n >= 5 && strcmp(ents[0].name, "checkpoint/data.pkl") == 0, "entries: %zu", n);
    if (n < 5) {
        free(buf);
        return;
    }
    /* unchanged: the rewrapped file reads */
    T_CHECK(write_zip(tmp, ents, n) == 0, "write");
    dfl_torch_file *f = NULL;
    T_CHECK(dfl_torch_open(&f, tmp, 0, &e) == 0, "rewrapped: %s", e.msg);
    dfl_torch_close(f);
    const uint8_t *orig = ents[0].data;
    size_t plen = ents[0].len;
    uint8_t *mut = malloc(plen);
    int accepted = 0, rejected = 0, bad = 0;
    for (size_t i = 0; i < plen; i++) {
        static const int delta[] = {1, 0x80};
        for (size_t d = 0; d <= DFL_ARRAY_LEN(delta); d++) {
            memcpy(mut, orig, plen);
            ents[0].data = mut;
            ents[0].len = plen;
            if (d < DFL_ARRAY_LEN(delta))
                mut[i] = (uint8_t)(mut[i] + delta[d]);
            else
                ents[0].len = i; /* cut the pickle at i */
            write_zip(tmp, ents, n);
            f = NULL;
            int rc = dfl_torch_open(&f, tmp, 0, &e);
            if (rc == 0)
                accepted++;
            else
                rejected++;
            if (!clean_error(rc) && bad++ < 5)
                T_CHECK(0, "byte %zu mutation %zu: rc %s (%s)", i, d, dfl_code_name(rc), e.msg);
            dfl_torch_close(f);
        }
    }
    fprintf(stderr, "  %d mutated pickles rejected, %d still valid\n", rejected, accepted);
    T_CHECK(rejected > accepted, "most mutations must be rejected");
    free(mut);
    free(buf);
}

/* Files written by real torch (tests/fixtures/torch/make_real.py): read and, where an .expect is
 * beside them, compared. Skipped while there are none. */
static void test_real(void)
{
    const char *dir = src_path("tests/fixtures/torch/real");
    char dcopy[PATH_MAX];
    snprintf(dcopy, sizeof dcopy, "%s", dir);
    DIR *d = opendir(dcopy);
    if (!d)
        T_SKIP("no %s (run make_real.py with torch to make them)", dcopy);
    struct dirent *de;
    int n = 0;
    while ((de = readdir(d))) {
        size_t nl = strlen(de->d_name);
        bool pt = nl > 3 && strcmp(de->d_name + nl - 3, ".pt") == 0;
        bool bin = nl > 4 && strcmp(de->d_name + nl - 4, ".bin") == 0;
        if (!pt && !bin)
            continue;
        char path[PATH_MAX], ex[PATH_MAX];
        snprintf(path, sizeof path, "%s/%s", dcopy, de->d_name);
        snprintf(ex, sizeof ex, "%s/%.*s.expect", dcopy, (int)(nl - (pt ? 3 : 4)), de->d_name);
        dfl_torch_file *f;
        dfl_err e;
        int rc = dfl_torch_open(&f, path, 0, &e);
        T_CHECK(rc == 0, "%s: %s", path, e.msg);
        if (rc)
            continue;
        T_CHECK(dfl_torch_count(f) > 0, "%s: no tensors", path);
        if (access(ex, R_OK) == 0)
            check_expect(f, ex, true);
        dfl_torch_close(f);
        n++;
    }
    closedir(d);
    if (n == 0)
        T_SKIP("no real torch files in %s", dcopy);
}

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    T_RUN(test_fixtures);
    T_RUN(test_views);
    T_RUN(test_bad_corpus);
    T_RUN(test_truncations);
    T_RUN(test_pickle_mutations);
    T_RUN(test_real);
    return t_done();
}
