/* fuzz-jsonl.c: libFuzzer harness for the JSON Lines sample reader (lib/formats/jsonl.c).
 *
 * The input is a data file: plain JSON Lines, or compressed, or a tar/zip archive of them (the
 * seeds hold some of each). It is opened with dfl_input_open as dfl-bucket opens its inputs,
 * and every part is read (mapped, or streamed through dfl_input_read, at most 4 MiB). Every line
 * of every part is parsed three ways, which must agree: dfl_sample_parse (what dfl-bucket uses),
 * the fast scanner alone (which may decline a line but, when it accepts one, must give exactly
 * what the jansson path gives) and the jansson path alone; the fast scanner is also run on the
 * rest of the part (dfl_sample_parse_fast_eol), which must stop at the line's end. Part names
 * must be sanitized (no control characters). */
#include <stdbool.h>

#include "fuzz.h"
#include "jsonl.h"

#define MAX_STREAM (4u << 20)

static bool same_sample(const dfl_sample *a, const dfl_sample *b)
{
    return a->n == b->n && memcmp(a->ids, b->ids, a->n * sizeof *a->ids) == 0 &&
           memcmp(a->mask, b->mask, a->n) == 0;
}

static void check_sample(const dfl_sample *s)
{
    FZ_ASSERT(s->n >= 1, "an empty sample accepted");
    for (size_t i = 0; i < s->n; i++) {
        FZ_ASSERT(s->ids[i] >= 0, "id %d accepted", s->ids[i]);
        FZ_ASSERT(s->mask[i] <= 1, "mask %u accepted", s->mask[i]);
    }
}

static void lines(const uint8_t *data, size_t n)
{
    if (n == 0)
        return; /* an empty mapped part has no data pointer */
    dfl_sample a = {0}, f = {0}, j = {0}, g = {0};
    const char *p = (const char *)data, *end = p + n;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t len = nl ? (size_t)(nl - p) : (size_t)(end - p);
        bool blank = false;
        dfl_err e, ej;
        int rc = dfl_sample_parse(&a, p, len, &blank, &e);
        fz_check_err(rc, &e, "dfl_sample_parse");
        FZ_ASSERT(rc == DFL_OK || rc == DFL_EDATA, "code %s: %s", dfl_code_name(rc), e.msg);
        int fast = dfl_sample_parse_fast(&f, p, len);
        FZ_ASSERT(fast == 0 || fast == 1, "fast path: %d", fast);
        if (!blank) {
            int rj = dfl_sample_parse_json(&j, p, len, &ej);
            fz_check_err(rj, &ej, "dfl_sample_parse_json");
            FZ_ASSERT(rj == rc, "dfl_sample_parse %s, the jansson path %s", dfl_code_name(rc), dfl_code_name(rj));
            if (rc == DFL_OK) {
                check_sample(&a);
                FZ_ASSERT(same_sample(&a, &j), "dfl_sample_parse and the jansson path give different samples");
            }
            if (fast == 1) {
                FZ_ASSERT(rj == DFL_OK, "the fast path accepts a line the jansson path refuses: %s", ej.msg);
                FZ_ASSERT(same_sample(&f, &j), "the fast path and the jansson path give different samples");
            }
        }
        const char *eol = NULL;
        int fe = dfl_sample_parse_fast_eol(&g, p, end, &eol);
        FZ_ASSERT(fe == fast, "fast_eol %d, fast %d", fe, fast);
        if (fe == 1) {
            FZ_ASSERT(eol == p + len, "fast_eol stops at %td, the line ends at %zu", eol - p, len);
            FZ_ASSERT(same_sample(&f, &g), "fast_eol and fast give different samples");
        }
        p += len + (nl != NULL);
    }
    dfl_sample_free(&a);
    dfl_sample_free(&f);
    dfl_sample_free(&j);
    dfl_sample_free(&g);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int fd = fz_memfd(data, size, 0);
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    dfl_input *in;
    dfl_err e;
    int rc = dfl_input_open(&in, path, NULL, &e);
    fz_check_err(rc, &e, "dfl_input_open");
    if (rc) {
        close(fd);
        return 0;
    }
    static uint8_t *buf; /* once: a large malloc and free per run would cost more than the run */
    if (!buf && !(buf = malloc(MAX_STREAM)))
        fz_die("out of memory");
    for (int parts = 0; parts < 64; parts++) {
        dfl_part p;
        bool eof;
        rc = dfl_input_next_part(in, &p, &eof, &e);
        fz_check_err(rc, &e, "dfl_input_next_part");
        if (rc || eof)
            break;
        FZ_ASSERT(p.name != NULL, "a part without a name");
        for (const char *c = p.name; *c; c++)
            FZ_ASSERT((unsigned char)*c >= 0x20 && *c != 0x7f, "part name with a control character");
        if (p.mapped) {
            fz_touch(p.data, p.size);
            lines(p.data, p.size);
            continue;
        }
        size_t n = 0;
        for (;;) {
            size_t got;
            rc = dfl_input_read(in, buf + n, MAX_STREAM - n, &got, &e);
            fz_check_err(rc, &e, "dfl_input_read");
            if (rc || got == 0)
                break;
            n += got;
            if (n == MAX_STREAM)
                break;
        }
        if (rc)
            break;
        lines(buf, n);
    }
    dfl_input_close(in);
    close(fd);
    return 0;
}
