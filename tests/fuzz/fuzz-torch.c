/* fuzz-torch.c: libFuzzer harness for the torch.save reader (lib/formats/torchfile.c: zip through
 * libarchive, and the pickle interpreter).
 *
 * Two kinds of input:
 *   - a zip file ("PK\3\4..."), passed as it is: the zip structure itself is fuzzed;
 *   - anything else is a list of archive members, each introduced by the separator "\0\0ENTRY:"
 *     and a name ending at '\n', the rest up to the next separator being its bytes. The harness
 *     builds a consistent zip of them (stored members, right CRCs and sizes), so that mutations
 *     reach the pickle interpreter and the storage checks instead of dying on a zip CRC.
 *     corpus/make.sh turns the torch fixtures into such lists.
 * The file is opened twice, with and without DFL_TORCH_NO_DATA; a file that reads with its data
 * must read without. An accepted file is checked against what the reader promises (sizes agree
 * with shapes, data readable in full, names found). Nothing in a pickle is ever executed: a
 * pickle that reaches a name outside the allowlist must be refused. */
#include <stdbool.h>

#include "bytes.h"
#include "fuzz.h"
#include "torchfile.h"

static const char SEP[] = "\0\0ENTRY:";
#define SEP_LEN 8
#define MAX_MEMBERS 64

static uint32_t crc_table[256];

static uint32_t crc32_of(const uint8_t *p, size_t n)
{
    if (!crc_table[1])
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int k = 0; k < 8; k++)
                c = c & 1 ? 0xedb88320u ^ (c >> 1) : c >> 1;
            crc_table[i] = c;
        }
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++)
        c = crc_table[(c ^ p[i]) & 0xff] ^ (c >> 8);
    return c ^ 0xffffffffu;
}

typedef struct buf {
    uint8_t *p;
    size_t n, cap;
} buf;

static void put(buf *b, const void *s, size_t n)
{
    if (!dfl_reserve(&b->p, &b->cap, b->n + n, 1, 4096))
        fz_die("out of memory");
    memcpy(b->p + b->n, s, n);
    b->n += n;
}

static void put16(buf *b, uint32_t v) { uint8_t x[2] = {(uint8_t)v, (uint8_t)(v >> 8)}; put(b, x, 2); }
static void put32(buf *b, uint32_t v)
{
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    put(b, x, 4);
}

typedef struct member {
    const uint8_t *name, *data;
    size_t name_len, len;
    uint32_t crc, offset;
} member;

/* A zip of stored members (what torch.save writes, without its alignment padding). */
static buf make_zip(const uint8_t *d, size_t n)
{
    member m[MAX_MEMBERS];
    int k = 0;
    const uint8_t *p = d, *end = d + n;
    const uint8_t *s = memmem(p, n, SEP, SEP_LEN);
    while (s && k < MAX_MEMBERS) {
        const uint8_t *name = s + SEP_LEN;
        const uint8_t *nl = memchr(name, '\n', (size_t)(end - name));
        if (!nl)
            break;
        const uint8_t *body = nl + 1;
        const uint8_t *next = memmem(body, (size_t)(end - body), SEP, SEP_LEN);
        const uint8_t *stop = next ? next : end;
        m[k].name = name;
        m[k].name_len = (size_t)(nl - name) > 0xffff ? 0xffff : (size_t)(nl - name);
        m[k].data = body;
        m[k].len = (size_t)(stop - body);
        m[k].crc = crc32_of(body, m[k].len);
        k++;
        s = next;
    }
    buf z = {0};
    for (int i = 0; i < k; i++) {
        m[i].offset = (uint32_t)z.n;
        put32(&z, 0x04034b50);
        put16(&z, 20), put16(&z, 0), put16(&z, 0), put16(&z, 0), put16(&z, 0x21);
        put32(&z, m[i].crc), put32(&z, (uint32_t)m[i].len), put32(&z, (uint32_t)m[i].len);
        put16(&z, (uint32_t)m[i].name_len), put16(&z, 0);
        put(&z, m[i].name, m[i].name_len);
        put(&z, m[i].data, m[i].len);
    }
    size_t cd = z.n;
    for (int i = 0; i < k; i++) {
        put32(&z, 0x02014b50);
        put16(&z, 20), put16(&z, 20), put16(&z, 0), put16(&z, 0), put16(&z, 0), put16(&z, 0x21);
        put32(&z, m[i].crc), put32(&z, (uint32_t)m[i].len), put32(&z, (uint32_t)m[i].len);
        put16(&z, (uint32_t)m[i].name_len), put16(&z, 0), put16(&z, 0), put16(&z, 0), put16(&z, 0);
        put32(&z, 0), put32(&z, m[i].offset);
        put(&z, m[i].name, m[i].name_len);
    }
    size_t cd_len = z.n - cd;
    put32(&z, 0x06054b50);
    put16(&z, 0), put16(&z, 0), put16(&z, (uint32_t)k), put16(&z, (uint32_t)k);
    put32(&z, (uint32_t)cd_len), put32(&z, (uint32_t)cd), put16(&z, 0);
    return z;
}

static void check_file(const dfl_torch_file *f, bool with_data)
{
    size_t n = dfl_torch_count(f);
    FZ_ASSERT(dfl_torch_prefix(f) != NULL, "no prefix");
    for (size_t i = 0; i < n; i++) {
        const dfl_torch_tensor *t = dfl_torch_get(f, i);
        FZ_ASSERT(t && t->v.name, "tensor %zu", i);
        FZ_ASSERT(t->v.ndim >= 0 && t->v.ndim <= DFL_MAX_DIMS, "ndim %d", t->v.ndim);
        uint64_t numel = 1;
        for (int d = 0; d < t->v.ndim; d++) {
            FZ_ASSERT(t->v.shape[d] >= 0, "negative dim");
            numel *= (uint64_t)t->v.shape[d];
        }
        FZ_ASSERT(numel == t->v.numel && t->v.nbytes == numel * dfl_dtype_size(t->v.dtype), "%s: sizes", t->v.name);
        if (with_data)
            FZ_ASSERT(t->v.data || t->v.nbytes == 0, "%s: no data", t->v.name);
        else
            FZ_ASSERT(t->v.data == NULL, "%s: data with NO_DATA", t->v.name);
        if (t->v.data)
            fz_touch(t->v.data, t->v.nbytes);
        const dfl_torch_tensor *u = dfl_torch_find(f, t->v.name);
        FZ_ASSERT(u && strcmp(u->v.name, t->v.name) == 0, "%s: not found by name", t->v.name);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    buf z = {0};
    const uint8_t *bytes = data;
    size_t n = size;
    if (!(size >= 4 && memcmp(data, "PK\3\4", 4) == 0)) {
        z = make_zip(data, size);
        bytes = z.p, n = z.n;
    }
    int fd = fz_memfd(bytes, n, 0);
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int rcs[2];
    for (int nodata = 0; nodata <= 1; nodata++) {
        dfl_torch_file *f = NULL;
        dfl_err e;
        int rc = dfl_torch_open(&f, path, nodata ? DFL_TORCH_NO_DATA : 0, &e);
        fz_check_err(rc, &e, "dfl_torch_open");
        rcs[nodata] = rc;
        if (rc) {
            FZ_ASSERT(f == NULL, "file returned on failure");
            FZ_ASSERT(rc == DFL_EDATA || rc == DFL_ETRUNC || rc == DFL_EUNSUP, "code %s: %s", dfl_code_name(rc), e.msg);
            continue;
        }
        check_file(f, !nodata);
        dfl_torch_close(f);
    }
    FZ_ASSERT(rcs[0] != DFL_OK || rcs[1] == DFL_OK, "reads with its data, not without");
    if (n >= 4)
        (void)dfl_torch_magic(bytes, n);
    close(fd);
    free(z.p);
    return 0;
}
