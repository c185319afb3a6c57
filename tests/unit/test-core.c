/* test-core.c: errors, size and number parsing, dtype conversions, atomic files. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bytes.h"
#include "dtype.h"
#include "err.h"
#include "json.h"
#include "util.h"
#include "t.h"

static void test_exit_codes(void)
{
    T_EQ_INT(dfl_exit_code(DFL_OK), 0, "ok");
    T_EQ_INT(dfl_exit_code(DFL_EUSAGE), 1, "usage");
    T_EQ_INT(dfl_exit_code(DFL_EIO), 1, "io");
    T_EQ_INT(dfl_exit_code(DFL_EDATA), 2, "data");
    T_EQ_INT(dfl_exit_code(DFL_ETRUNC), 2, "trunc");
    T_EQ_INT(dfl_exit_code(DFL_ENAN), 2, "nan");
    dfl_err e;
    T_EQ_INT(dfl_fail(&e, DFL_EDATA, "x %d", 3), DFL_EDATA, "fail returns code");
    dfl_err_prefix(&e, "file.bin: ");
    T_CHECK(strcmp(e.msg, "file.bin: x 3") == 0, "msg '%s'", e.msg);
}

static void test_sizes(void)
{
    dfl_err e;
    uint64_t v;
    T_CHECK(dfl_parse_size("512", &v, "s", &e) == 0 && v == 512, "512");
    T_CHECK(dfl_parse_size("64K", &v, "s", &e) == 0 && v == 65536, "64K");
    T_CHECK(dfl_parse_size("2G", &v, "s", &e) == 0 && v == (2ull << 30), "2G");
    T_CHECK(dfl_parse_size("3MiB", &v, "s", &e) == 0 && v == (3ull << 20), "3MiB");
    T_CHECK(dfl_parse_size("1T", &v, "s", &e) == 0 && v == (1ull << 40), "1T");
    T_CHECK(dfl_parse_size("16777216T", &v, "s", &e) == DFL_EUSAGE, "overflow by suffix");
    T_CHECK(dfl_parse_size("99999999999999999999", &v, "s", &e) == DFL_EUSAGE, "overflow digits");
    T_CHECK(dfl_parse_size("12Q", &v, "--max-tokens", &e) == DFL_EUSAGE && strstr(e.msg, "--max-tokens"),
            "bad suffix names the option: %s", e.msg);
    T_CHECK(dfl_parse_size("-1", &v, "s", &e) == DFL_EUSAGE, "negative");
    T_CHECK(dfl_parse_size("", &v, "s", &e) == DFL_EUSAGE, "empty");
}

static void test_numbers(void)
{
    dfl_err e;
    int64_t v;
    T_CHECK(dfl_parse_i64("-5", -10, 10, &v, "n", &e) == 0 && v == -5, "-5");
    T_CHECK(dfl_parse_i64("11", -10, 10, &v, "n", &e) == DFL_EUSAGE, "range");
    T_CHECK(dfl_parse_i64("1x", -10, 10, &v, "n", &e) == DFL_EUSAGE, "junk");
    T_CHECK(dfl_parse_i64(" 1", -10, 10, &v, "n", &e) == DFL_EUSAGE, "leading space");
    int64_t *l;
    size_t n;
    T_CHECK(dfl_parse_i64_list("1,9,17", 0, 100, 8, &l, &n, "--layers", &e) == 0 && n == 3 &&
                l[0] == 1 && l[1] == 9 && l[2] == 17, "list");
    free(l);
    T_CHECK(dfl_parse_i64_list("1,,2", 0, 100, 8, &l, &n, "--layers", &e) == DFL_EUSAGE, "empty field");
    T_CHECK(dfl_parse_i64_list("1,2,3", 0, 100, 2, &l, &n, "--layers", &e) == DFL_EUSAGE, "too many");
    double d;
    T_CHECK(dfl_parse_double("6e-4", &d, "lr", &e) == 0 && d == 6e-4, "double");
    T_CHECK(dfl_parse_double("nan", &d, "lr", &e) == DFL_EUSAGE, "nan refused");
}

/* Reference conversion: exact rounding of a float to bf16 through double arithmetic. */
static uint16_t ref_bf16(float f)
{
    if (isnan(f))
        return 0x7fc0;
    uint32_t u = dfl_f32_bits(f);
    uint32_t lo = u & 0xffff0000u, hi = lo + 0x10000u;
    double dl = dfl_bits_f32(lo), dh = dfl_bits_f32(hi), df = f;
    if ((hi & 0x7fffffffu) == 0x7f800000u)
        dh = copysign(0x1p128, df); /* the value "one unit past the largest" */
    if ((lo & 0x7f800000u) == 0x7f800000u)
        return (uint16_t)(lo >> 16); /* inf */
    if (fabs(df - dl) < fabs(dh - df))
        return (uint16_t)(lo >> 16);
    if (fabs(df - dl) > fabs(dh - df))
        return (uint16_t)(hi >> 16);
    return (uint16_t)(((lo >> 16) & 1) ? hi >> 16 : lo >> 16);
}

static void test_bf16(void)
{
    T_EQ_INT(dfl_f32_to_bf16(1.0f), 0x3f80, "1.0");
    T_EQ_INT(dfl_f32_to_bf16(-2.0f), 0xc000, "-2");
    /* ties to even: 1 + 2^-8 is halfway between 1 and 1+2^-7 -> 1.0 */
    T_EQ_INT(dfl_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80, "tie to even (down)");
    T_EQ_INT(dfl_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82, "tie to even (up)");
    T_CHECK(isnan(dfl_bf16_to_f32(dfl_f32_to_bf16(NAN))), "NaN stays NaN");
    /* a NaN with payload only in the low bits must not become inf */
    T_CHECK(isnan(dfl_bf16_to_f32(dfl_f32_to_bf16(dfl_bits_f32(0x7f800001u)))), "low-payload NaN");
    T_CHECK(isinf(dfl_bf16_to_f32(dfl_f32_to_bf16(INFINITY))), "inf");
    T_CHECK(isinf(dfl_bf16_to_f32(dfl_f32_to_bf16(3.4e38f))), "overflow rounds to inf");
    uint32_t seed = 12345;
    int bad = 0;
    for (int i = 0; i < 1000000; i++) {
        seed = seed * 1664525u + 1013904223u;
        float f = dfl_bits_f32(seed);
        if (isnan(f))
            continue;
        if (dfl_f32_to_bf16(f) != ref_bf16(f))
            bad++;
    }
    T_EQ_INT(bad, 0, "random f32 -> bf16 mismatches");
}

static void test_f16(void)
{
    /* every f16 value round-trips through f32 */
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = dfl_f16_to_f32((uint16_t)h);
        uint16_t back = dfl_f32_to_f16(f);
        if (isnan(f)) {
            if ((back & 0x7c00) != 0x7c00 || !(back & 0x3ff))
                bad++;
        } else if (back != h) {
            bad++;
        }
    }
    T_EQ_INT(bad, 0, "f16 round trips");
    T_NEAR(dfl_f16_to_f32(0x3c00), 1.0, 0, "1.0");
    T_NEAR(dfl_f16_to_f32(0x0001), 0x1p-24, 0, "smallest subnormal");
    T_EQ_INT(dfl_f32_to_f16(65520.0f), 0x7c00, "65520 -> inf");
    T_EQ_INT(dfl_f32_to_f16(65504.0f), 0x7bff, "max");
    T_EQ_INT(dfl_f32_to_f16(1.0f + 0x1p-11f), 0x3c00, "tie to even");
    T_EQ_INT(dfl_f32_to_f16(0x1p-25f), 0x0000, "half of smallest subnormal -> 0 (even)");
    T_EQ_INT(dfl_f32_to_f16(0x1.8p-24f), 0x0002, "1.5 units -> 2 (even)");
}

static void test_dtype_names(void)
{
    T_EQ_INT(dfl_dtype_from_name("BF16"), DFL_BF16, "BF16");
    T_EQ_INT(dfl_dtype_from_name("bf16"), DFL_BF16, "bf16");
    T_EQ_INT(dfl_dtype_from_name("F8_E4M3"), DFL_F8_E4M3, "fp8");
    T_EQ_INT(dfl_dtype_from_name("Q4_K"), DFL_DT_INVALID, "unknown");
    T_EQ_INT(dfl_dtype_size(DFL_I64), 8, "i64 size");
    T_CHECK(!dfl_dtype_is_float(DFL_I32) && dfl_dtype_is_float(DFL_F16), "is_float");
}

static void test_atomic(void)
{
    dfl_err e;
    char path[4200];
    snprintf(path, sizeof path, "%s/a.txt", t_tmpdir());
    T_CHECK(dfl_write_file_atomic(path, "one", 3, &e) == 0, "%s", e.msg);
    dfl_atomic a;
    T_CHECK(dfl_atomic_open(&a, path, &e) == 0, "%s", e.msg);
    T_CHECK(write(a.fd, "two", 3) == 3, "write");
    dfl_atomic_abort(&a);
    char *buf;
    size_t n;
    T_CHECK(dfl_read_file(path, 100, &buf, &n, &e) == 0 && n == 3 && memcmp(buf, "one", 3) == 0,
            "abort leaves the old content");
    free(buf);
    T_CHECK(dfl_read_file(path, 2, &buf, &n, &e) == DFL_EDATA, "size cap");
    T_CHECK(dfl_read_file("/nonexistent/x", 100, &buf, &n, &e) == DFL_EIO && strstr(e.msg, "/nonexistent/x"),
            "missing file named: %s", e.msg);
    unlink(path);
    rmdir(t_tmpdir());
}

static void test_json(void)
{
    dfl_err e;
    json_t *v;
    const char *ok = "{\"a\": 3, \"b\": 4096.0, \"s\": \"x\", \"t\": true}";
    T_CHECK(dfl_json_parse(ok, strlen(ok), &v, "cfg", &e) == 0, "%s", e.msg);
    int64_t i;
    const char *s;
    bool b;
    T_CHECK(dfl_json_int(v, "a", true, &i, "cfg", &e) == 0 && i == 3, "int");
    T_CHECK(dfl_json_int(v, "b", true, &i, "cfg", &e) == 0 && i == 4096, "int as real");
    T_CHECK(dfl_json_int(v, "s", true, &i, "cfg", &e) == DFL_EDATA && strstr(e.msg, "'s'"), "type");
    T_CHECK(dfl_json_int(v, "zz", true, &i, "cfg", &e) == DFL_EDATA && strstr(e.msg, "zz"), "missing");
    T_CHECK(dfl_json_int(v, "zz", false, &i, "cfg", &e) == 0, "optional");
    T_CHECK(dfl_json_str(v, "s", true, &s, "cfg", &e) == 0 && strcmp(s, "x") == 0, "str");
    T_CHECK(dfl_json_bool(v, "t", true, &b, "cfg", &e) == 0 && b, "bool");
    json_decref(v);
    const char *dup = "{\"a\": 1, \"a\": 2}";
    T_CHECK(dfl_json_parse(dup, strlen(dup), &v, "cfg", &e) == DFL_EDATA, "duplicate keys");
    char deep[300];
    memset(deep, '[', 200);
    T_CHECK(dfl_json_parse(deep, 200, &v, "cfg", &e) == DFL_EDATA && strstr(e.msg, "nested"), "depth: %s", e.msg);
}

static void test_json_depth(void)
{
    const char *ok = "{\"a\": [[1, {\"b\": 2}]]}";
    T_CHECK(dfl_json_depth_ok(ok, strlen(ok), 4), "4 deep, limit 4");
    T_CHECK(!dfl_json_depth_ok(ok, strlen(ok), 3), "4 deep, limit 3");
    const char *str = "[\"[[[[\\\"[[\", \"}}}\"]";   /* brackets (and an escaped quote) in strings */
    T_CHECK(dfl_json_depth_ok(str, strlen(str), 1), "strings skipped: %s", str);
    T_CHECK(!dfl_json_depth_ok("[[", 2, 1), "unclosed still counts");
    T_CHECK(dfl_json_depth_ok("[[", 1, 1), "only n bytes read");
    T_CHECK(dfl_json_depth_ok("", 0, 0) && dfl_json_depth_ok("1", 1, 0), "scalars have depth 0");
}

static void test_bytes(void)
{
    const uint8_t b[9] = {0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x88, 0xff};
    T_EQ_INT(dfl_get_le16(b), 0x0201, "le16");
    T_EQ_INT(dfl_get_le32(b + 1), 0x05040302, "le32 unaligned");
    T_CHECK(dfl_get_le64(b) == 0x8807060504030201ull, "le64 %llx", (unsigned long long)dfl_get_le64(b));
    T_CHECK(dfl_get_le64(b + 1) == 0xff88070605040302ull, "le64 top byte");
    T_EQ_INT(dfl_get_le(b, 0), 0, "le of 0 bytes");
    T_EQ_INT(dfl_get_le(b + 6, 3), 0xff8807, "le of 3 bytes");
    uint8_t o[10];
    memset(o, 0xaa, sizeof o);
    dfl_put_le64(o + 1, 0x8807060504030201ull);
    T_CHECK(memcmp(o + 1, b, 8) == 0 && o[0] == 0xaa && o[9] == 0xaa, "put_le64 bytes or bounds");
    memset(o, 0xaa, sizeof o);
    dfl_put_le32(o, 0xdeadbeefu);
    T_CHECK(o[0] == 0xef && o[1] == 0xbe && o[2] == 0xad && o[3] == 0xde && o[4] == 0xaa, "put_le32");
    dfl_put_le16(o, 0x1234);
    T_CHECK(o[0] == 0x34 && o[1] == 0x12 && o[2] == 0xad, "put_le16");
    dfl_put_le(o, 0x030201, 3);
    T_EQ_INT(dfl_get_le(o, 3), 0x030201, "put_le/get_le of 3 bytes");
}

static void test_grow(void)
{
    int *a = NULL;
    size_t n = 0, cap = 0;
    for (int i = 0; i < 100; i++) {
        T_CHECK(dfl_grow(&a, &cap, n, sizeof *a, 4), "grow at %d", i);
        if (!a)
            return;
        a[n++] = i;
    }
    T_EQ_INT(cap, 128, "capacity after 100 from 4, doubling");
    int sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += a[i];
    T_EQ_INT(sum, 4950, "elements kept across reallocations");
    int *before = a;
    T_CHECK(dfl_grow(&a, &cap, 50, sizeof *a, 4) && a == before && cap == 128, "room: unchanged");
    size_t big = SIZE_MAX / 4 + 1;
    T_CHECK(!dfl_grow(&a, &big, big, sizeof *a, 4) && a == before && big == SIZE_MAX / 4 + 1,
            "overflow refused, nothing changed");
    free(a);
    /* a byte buffer: from first, doubled until the request fits */
    char *b = NULL;
    size_t bcap = 0;
    T_CHECK(dfl_reserve(&b, &bcap, 10, 1, 4096) && b && bcap == 4096, "first %zu", bcap);
    T_CHECK(dfl_reserve(&b, &bcap, 4096, 1, 4096) && bcap == 4096, "fits: %zu", bcap);
    T_CHECK(dfl_reserve(&b, &bcap, 4097, 1, 4096) && bcap == 8192, "doubled: %zu", bcap);
    T_CHECK(dfl_reserve(&b, &bcap, 40000, 1, 4096) && bcap == 65536, "doubled until it fits: %zu", bcap);
    memset(b, 7, 40000);
    T_CHECK(!dfl_reserve(&b, &bcap, SIZE_MAX, 1, 4096) && bcap == 65536 && b[39999] == 7,
            "impossible request refused, nothing changed");
    free(b);
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    T_RUN(test_exit_codes);
    T_RUN(test_json_depth);
    T_RUN(test_bytes);
    T_RUN(test_grow);
    T_RUN(test_sizes);
    T_RUN(test_numbers);
    T_RUN(test_bf16);
    T_RUN(test_f16);
    T_RUN(test_dtype_names);
    T_RUN(test_atomic);
    T_RUN(test_json);
    return t_done();
}
