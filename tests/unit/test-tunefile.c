/* test-tunefile.c: dfl-target's --tune-file (lib/train/tune_file.h): stored algorithms come back
 * byte for byte under their key and scope and under nothing else; a put that changes nothing
 * does not rewrite the file; a product of another scope empties the file first; an absent file is
 * an empty one and is written only when something is put; the bad files of tests/bad/tune (and a
 * few more made here) are refused with DFL_EDATA naming the file, and the file is left alone. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tune_file.h"
#include "util.h"
#include "t.h"

static char dir[4096];

static void algo(dfl_mm_algo *a, const char *key, const char *scope, uint8_t seed)
{
    memset(a, 0, sizeof *a);
    snprintf(a->key, sizeof a->key, "%s", key);
    snprintf(a->scope, sizeof a->scope, "%s", scope);
    for (int i = 0; i < DFL_MM_ALGO_BYTES; i++)
        a->bytes[i] = (uint8_t)(seed * 37 + i * 11);   /* every byte value pattern, 0x00 and 0xff among them */
}

static bool exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0;
}

static void test_round_trip(void)
{
    char p[4200];
    snprintf(p, sizeof p, "%s/rt.json", dir);
    const char *s1 = "NVIDIA H200 sm_90 cuBLASLt 120805";
    dfl_err e = {0};
    dfl_tune_file *f = NULL;
    T_CHECK(dfl_tune_file_open(&f, p, &e) == 0, "an absent file opens: %s", e.msg);
    if (!f)
        return;
    dfl_mm_algo a, b, q;
    algo(&a, "16384x6144x4096 ld 4096,4096,6144", s1, 1);
    algo(&b, "16384x4096x4096 ld 4096,4096,4096 beta 1", s1, 2);
    q = a;
    memset(q.bytes, 0, sizeof q.bytes);
    T_CHECK(!dfl_tune_file_get(f, &q) && dfl_tune_file_count(f, s1) == 0, "empty");
    bool written = true;
    T_CHECK(dfl_tune_file_save(f, &written, &e) == 0 && !written && !exists(p), "nothing put: nothing written");
    T_CHECK(dfl_tune_file_put(f, &a, &e) == 0 && dfl_tune_file_put(f, &b, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_tune_file_save(f, &written, &e) == 0 && written && exists(p), "written: %s", e.msg);
    dfl_tune_file_close(f);

    T_CHECK(dfl_tune_file_open(&f, p, &e) == 0, "reopened: %s", e.msg);
    if (!f)
        return;
    T_CHECK(strcmp(dfl_tune_file_scope(f), s1) == 0 && dfl_tune_file_count(f, s1) == 2, "scope and count");
    T_CHECK(dfl_tune_file_get(f, &q) && memcmp(q.bytes, a.bytes, sizeof a.bytes) == 0, "a's bytes back");
    q = b;
    memset(q.bytes, 0, sizeof q.bytes);
    T_CHECK(dfl_tune_file_get(f, &q) && memcmp(q.bytes, b.bytes, sizeof b.bytes) == 0, "b's bytes back");
    /* another key, or the same key under another scope: nothing */
    dfl_mm_algo other;
    algo(&other, "1x2x3", s1, 0);
    T_CHECK(!dfl_tune_file_get(f, &other), "an unknown key gives nothing");
    algo(&other, a.key, "NVIDIA H100 sm_90 cuBLASLt 120805", 0);
    T_CHECK(!dfl_tune_file_get(f, &other), "another scope gives nothing");
    /* the same bytes again: no change, no write */
    struct stat st0, st1;
    stat(p, &st0);
    T_CHECK(dfl_tune_file_put(f, &a, &e) == 0 && dfl_tune_file_save(f, &written, &e) == 0 && !written,
            "an unchanged put is not written");
    /* another scope's product replaces the file's contents */
    algo(&other, "16384x24576x4096", "NVIDIA H100 sm_90 cuBLASLt 120805", 3);
    T_CHECK(dfl_tune_file_put(f, &other, &e) == 0 && dfl_tune_file_save(f, &written, &e) == 0 && written,
            "%s", e.msg);
    dfl_tune_file_close(f);
    stat(p, &st1);
    T_CHECK(dfl_tune_file_open(&f, p, &e) == 0, "%s", e.msg);
    if (!f)
        return;
    T_CHECK(dfl_tune_file_count(f, s1) == 0 && dfl_tune_file_count(f, other.scope) == 1, "only the new scope's");
    q = other;
    memset(q.bytes, 0, sizeof q.bytes);
    T_CHECK(dfl_tune_file_get(f, &q) && memcmp(q.bytes, other.bytes, sizeof q.bytes) == 0, "its bytes");
    dfl_tune_file_close(f);
    /* a put without a key or scope is a usage error */
    T_CHECK(dfl_tune_file_open(&f, p, &e) == 0, "%s", e.msg);
    if (f) {
        dfl_mm_algo none;
        memset(&none, 0, sizeof none);
        T_CHECK(dfl_tune_file_put(f, &none, &e) == DFL_EUSAGE, "no key: usage error");
        dfl_tune_file_close(f);
    }
}

/* Every file of tests/bad/tune, and a few more: DFL_EDATA naming the file, the file unchanged. */
static void test_bad_files(void)
{
    char list[4200];
    snprintf(list, sizeof list, "%s/tests/bad/tune/EXPECT", t_src_root());
    FILE *fp = fopen(list, "r");
    T_CHECK(fp != NULL, "%s", list);
    if (!fp)
        return;
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof line, fp)) {
        if (line[0] == '#' || line[0] == '\n')
            continue;
        char *bar = strchr(line, '|');
        if (!bar)
            continue;
        *bar = 0;
        char *code = bar + 1, *text = strchr(code, '|');
        if (!text)
            continue;
        *text++ = 0;
        text[strcspn(text, "\n")] = 0;
        char p[4600];
        snprintf(p, sizeof p, "%s/tests/bad/tune/%s", t_src_root(), line);
        dfl_err e = {0};
        dfl_tune_file *f = NULL;
        int rc = dfl_tune_file_open(&f, p, &e);
        T_CHECK(rc == DFL_EDATA && !f, "%s: rc %d, expected DFL_EDATA", line, rc);
        T_CHECK(strstr(e.msg, p) && strstr(e.msg, text), "%s: message '%s' lacks the file or '%s'", line,
                e.msg, text);
        dfl_tune_file_close(f);
        n++;
    }
    fclose(fp);
    T_CHECK(n >= 11, "%d bad files", n);
    /* a product key too long, a scope too long */
    char p[4200], big[400];
    memset(big, 'k', sizeof big - 1);
    big[sizeof big - 1] = 0;
    snprintf(p, sizeof p, "%s/long.json", dir);
    for (int which = 0; which < 2; which++) {
        FILE *w = fopen(p, "w");
        if (!w) {
            T_CHECK(0, "%s", p);
            return;
        }
        if (which == 0)
            fprintf(w, "{\"format\": \"dfl-tune 1\", \"scope\": \"x\", \"products\": {\"%s\": \"%0128d\"}}\n", big, 0);
        else
            fprintf(w, "{\"format\": \"dfl-tune 1\", \"scope\": \"%s\", \"products\": {}}\n", big);
        fclose(w);
        dfl_err e = {0};
        dfl_tune_file *f = NULL;
        T_CHECK(dfl_tune_file_open(&f, p, &e) == DFL_EDATA,
                which ? "a scope of 399 characters is refused" : "a key of 399 characters is refused");
        dfl_tune_file_close(f);
    }
}

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    snprintf(dir, sizeof dir, "%s", t_tmpdir());
    T_RUN(test_round_trip);
    T_RUN(test_bad_files);
    return t_done();
}
