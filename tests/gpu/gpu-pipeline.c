/* gpu-pipeline.c: dfl-target --device cuda end to end through its pipeline (reader thread,
 * output slots, copies on the copy stream, writer thread), against --device cpu on the same
 * batches. A random qwen3 model with 128-wide heads (the tiled attention, the vector qknorm_rope
 * path) runs over batches of varied lengths and packings, with --inflight 1 and 3, written to a
 * pipe in each --output-mode (also to a reader that starts late and reads slowly, so that spliced
 * slots wait for it), and to files with --file-io write, map and register, in bf16
 * and f32. Checked: every batch's lengths, ids and mask exactly; its layers within bf16 tolerance
 * of the CPU's f32 (per row relative error and cosine, NaN failing); and the layers of every GPU
 * run bit-identical to the first GPU run's (a slot or capture buffer overwritten too early, or a
 * batch in the wrong place, shows here). Also: sizing from the index, from the first batch (and
 * the error when a later batch is larger), --profile, several inputs, and --tune-file (its
 * second run bit-identical to its first).
 *
 * Under a sanitizer: DFL_GPU_WRAP is put before every GPU dfl-target command; the sanitizer's
 * report must go to a file (on stdout it would mix into the stream), e.g.
 *   DFL_GPU_WRAP="compute-sanitizer --tool memcheck --error-exitcode 99 --log-file /tmp/mc.%p.log" \
 *       build/tests/gpu-pipeline
 * and the same with --tool racecheck.
 * with a smaller model and batches and four of the output paths (a sanitizer slows kernels down a
 * hundredfold).
 * DFL_TEST_DEVICE=cpu runs the same comparisons with --device cpu in place of the GPU (a check of
 * this test itself, without a GPU; the sizing test is skipped there: the CPU grows its buffers).
 * Skips without a GPU (exit 77). */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "backend.h"
#include "dtype.h"
#include "frame.h"
#include "../unit/t.h"
#include "gpu-e2e.h"

static const char *wrap = "";
static bool small;

/* ---- comparing streams ---- */

typedef struct cmp {
    double rel, cos;       /* worst per-row figures against the reference */
    int batches;
    bool structure_ok;     /* same batches, lengths, ids, mask */
} cmp;

static float elem(const void *p, dfl_dtype dt, uint64_t i)
{
    if (dt == DFL_BF16)
        return dfl_bf16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* Compares stream `got` with the reference `ref` batch by batch. When `same` is given, the layers
 * of got must also be bit-identical to those of `same` (another GPU run, same dtype). */
static void compare(const char *what, const char *got, const char *ref, const char *same, cmp *c)
{
    dfl_err e = {0};
    dfl_reader *rg = NULL, *rr = NULL, *rs = NULL;
    memset(c, 0, sizeof *c);
    c->cos = 1;
    c->structure_ok = true;
    if (dfl_reader_open(&rg, got, NULL, &e) || dfl_reader_open(&rr, ref, NULL, &e) ||
        (same && dfl_reader_open(&rs, same, NULL, &e))) {
        T_CHECK(0, "%s: %s", what, e.msg);
        c->structure_ok = false;
        goto out;
    }
    const dfl_stream_info *ig = dfl_reader_info(rg), *ir = dfl_reader_info(rr);
    T_CHECK(ig->n_layers == ir->n_layers && ig->hidden_size == ir->hidden_size &&
                strcmp(ig->fingerprint, ir->fingerprint) == 0,
            "%s: header differs from the CPU run's", what);
    bool identical = true;
    for (;;) {
        dfl_batch bg, br, bs;
        memset(&bg, 0, sizeof bg);
        memset(&br, 0, sizeof br);
        memset(&bs, 0, sizeof bs);
        bool eg = false, er = false, es = false;
        if (dfl_reader_next(rg, &bg, &eg, &e) || dfl_reader_next(rr, &br, &er, &e) ||
            (rs && dfl_reader_next(rs, &bs, &es, &e))) {
            T_CHECK(0, "%s: %s", what, e.msg);
            c->structure_ok = false;
            break;
        }
        if (eg || er) {
            if (eg != er)
                c->structure_ok = false;
            T_CHECK(eg == er, "%s: %d batches in one stream, more in the other", what, c->batches);
            break;
        }
        c->batches++;
        bool st = bg.n_tokens == br.n_tokens && bg.n_seqs == br.n_seqs &&
                  memcmp(bg.seq_lens, br.seq_lens, (size_t)bg.n_seqs * 4) == 0 &&
                  memcmp(bg.input_ids, br.input_ids, (size_t)bg.n_tokens * 4) == 0 &&
                  memcmp(bg.loss_mask, br.loss_mask, (size_t)bg.n_tokens) == 0;
        if (!st) {
            c->structure_ok = false;
            T_CHECK(0, "%s: batch %d: lengths, ids or mask differ from the CPU run's", what, c->batches - 1);
        }
        int64_t H = (int64_t)bg.hidden;
        for (uint32_t k = 0; st && k < bg.n_layers; k++) {
            for (uint64_t r = 0; r < bg.n_tokens; r++) {
                rowcmp rc = {0};
                for (int64_t i = 0; i < H; i++)
                    rowcmp_add(&rc, elem(bg.layers[k], bg.dtype, r * (uint64_t)H + (uint64_t)i),
                               elem(br.layers[k], br.dtype, r * (uint64_t)H + (uint64_t)i));
                double rel = rowcmp_rel(&rc), cs = rowcmp_cos(&rc);
                if (!(rel <= c->rel))
                    c->rel = rel;
                if (!(cs >= c->cos))
                    c->cos = cs;
            }
            if (rs) {
                size_t n = (size_t)bg.n_tokens * (size_t)H * dfl_dtype_size(bg.dtype);
                if (bs.n_tokens != bg.n_tokens || bs.dtype != bg.dtype ||
                    memcmp(bs.layers[k], bg.layers[k], n) != 0)
                    identical = false;
            }
        }
        dfl_batch_free(&bg);
        dfl_batch_free(&br);
        dfl_batch_free(&bs);
    }
    printf("# %-44s %3d batches: rel %.3g cos %.6f%s\n", what, c->batches, c->rel, c->cos,
           rs ? (identical ? ", layers identical to the first GPU run" : ", LAYERS DIFFER from the first GPU run") : "");
    T_CHECK(c->rel <= 5e-2 && c->cos >= 0.998, "%s: rel %.3g cos %.6f against the CPU", what, c->rel, c->cos);
    if (rs)
        T_CHECK(identical, "%s: layers differ from the first GPU run (a race in the pipeline?)", what);
out:
    dfl_reader_close(rg);
    dfl_reader_close(rr);
    dfl_reader_close(rs);
}

/* ---- fixtures ---- */

static char model[4300], tok[4300], tok_b[4300], cpu32[4300], cpu2[4300];
static int n_batches;

/* A text batch file for mktokens: batches of varied lengths and packings (some sequences of one
 * token, a long one, many short ones, masks off here and there), token ids spread over vocab. */
static bool make_tokens(const char *path, int vocab, int scale, int *nb)
{
    static const int shapes[][12] = {
        /* sequence lengths of each batch, 0-terminated */
        {1, 0},
        {17, 300, 0},
        {1024, 0},
        {5, 6, 7, 8, 9, 10, 11, 12, 0},
        {700, 200, 100, 1, 0},
        {64, 64, 64, 64, 64, 64, 64, 64, 0},
        {1000, 24, 0},
        {3, 0},
        {513, 257, 129, 65, 33, 17, 9, 5, 3, 2, 1, 0},
        {900, 0},
    };
    FILE *f = fopen(path, "w");
    if (!f)
        return false;
    uint64_t x = 12345;
    int b;
    for (b = 0; b < (int)(sizeof shapes / sizeof shapes[0]); b++) {
        for (int s = 0; shapes[b][s]; s++) {
            int len = shapes[b][s] / scale;
            if (len < 1)
                len = 1;
            for (int j = 0; j < len; j++) {
                x = x * 6364136223846793005ull + 1442695040888963407ull;
                int id = (int)((x >> 33) % (uint64_t)vocab);
                fprintf(f, "%s%s%d", j ? " " : "", (x >> 20) % 7 == 0 ? "!" : "", id);
            }
            fputc('\n', f);
        }
        fputs("--\n", f);
    }
    *nb = b;
    return fclose(f) == 0;
}

static bool setup(void)
{
    snprintf(model, sizeof model, "%s/model", dir);
    snprintf(tok, sizeof tok, "%s/tok.dfl", dir);
    snprintf(tok_b, sizeof tok_b, "%s/tok-b.dfl", dir);
    snprintf(cpu32, sizeof cpu32, "%s/cpu32.dfl", dir);
    snprintf(cpu2, sizeof cpu2, "%s/cpu2.dfl", dir);
    char txt[4300];
    snprintf(txt, sizeof txt, "%s/tok.txt", dir);
    int vocab = 1000;
    if (!make_tokens(txt, vocab, small ? 8 : 1, &n_batches))
        return false;
    int layers = small ? 3 : 6, hidden = small ? 256 : 512;
    if (sh("'%s/mktarget' -o '%s' --hidden %d --heads 4 --kv-heads 2 --head-dim 128 "
           "--intermediate %d --vocab %d --layers %d", tools, model, hidden, 2 * hidden, vocab, layers) ||
        sh("'%s/mktokens' --vocab %d -o '%s' '%s'", tools, vocab, tok, txt) ||
        sh("head -6 '%s' | '%s/mktokens' --vocab %d -o '%s'", txt, tools, vocab, tok_b))
        return false;
    const char *ly = small ? "0,2" : "0,2,5";
    if (sh("'%s/dfl-target' -q -m '%s' --layers %s --dtype f32 -o '%s' '%s'", bin, model, ly, cpu32, tok) ||
        sh("'%s/dfl-target' -q -m '%s' --layers %s --dtype f32 -o '%s' '%s' '%s'", bin, model, ly,
           cpu2, tok, tok_b))
        return false;
    return true;
}

static const char *layers_arg(void) { return small ? "0,2" : "0,2,5"; }

/* ---- tests ---- */

/* Every output path (pipes in each --output-mode, also to a reader that starts late and reads
 * slowly, so that spliced slots wait for it; files in each --file-io) and --inflight 1 / 3, bf16
 * and f32, against the CPU. */
static void test_outputs(void)
{
    if (!have_device())
        T_SKIP("no CUDA GPU");
    static const struct {
        const char *name, *dtype, *opts;
        bool pipe, sanitized; /* sanitized: also run under DFL_GPU_WRAP (the rest is skipped there) */
        bool slow;            /* the pipe's reader starts late and reads slowly (slowread): the
                                 slots are reused only as the reader gets through the pipe */
    } runs[] = {
        {"f32 pipe (auto: vmsplice) --inflight 1", "f32", "--inflight 1", true, true, false},
        {"f32 pipe --output-mode write --inflight 3", "f32", "--inflight 3 --output-mode write", true, false, false},
        {"f32 pipe --vmsplice --inflight 1", "f32", "--inflight 1 --vmsplice", true, false, false},
        {"f32 pipe (auto, 4 slots) to a slow reader", "f32", "", true, true, true},
        {"f32 pipe --output-mode write to a slow reader", "f32", "--output-mode write", true, false, true},
        {"f32 file --file-io write --inflight 3", "f32", "--inflight 3 --file-io write", false, false, false},
        {"f32 file --file-io map --inflight 1", "f32", "--inflight 1 --file-io map", false, false, false},
        {"f32 file --file-io map --inflight 3", "f32", "--inflight 3 --file-io map", false, true, false},
        {"f32 file --file-io register --inflight 1", "f32", "--inflight 1 --file-io register", false, false, false},
        {"f32 file --file-io register --inflight 3", "f32", "--inflight 3 --file-io register", false, true, false},
        {"bf16 pipe --vmsplice --inflight 2", "bf16", "--inflight 2 --vmsplice", true, true, false},
        {"bf16 pipe --output-mode write --inflight 2", "bf16", "--inflight 2 --output-mode write", true, false, false},
        {"bf16 file --file-io register --inflight 3", "bf16", "--inflight 3 --file-io register", false, false, false},
    };
    char first32[4300] = "", first16[4300] = "";
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        if (*wrap && !runs[i].sanitized)
            continue;
        char out[4300];
        snprintf(out, sizeof out, "%s/gpu-%zu.dfl", dir, i);
        int st;
        char reader[4400];
        if (runs[i].slow)
            snprintf(reader, sizeof reader, "{ sleep 0.3; '%s/slowread' --chunk 65536 --sleep-us 1000; }", tools);
        else
            snprintf(reader, sizeof reader, "cat");
        if (runs[i].pipe)
            st = sh("( %s '%s/dfl-target' -q -m '%s' --device %s --layers %s --dtype %s %s '%s'; "
                    "echo $? >'%s.st' ) | %s >'%s'; exit $(cat '%s.st')", wrap, bin, model, device,
                    layers_arg(), runs[i].dtype, runs[i].opts, tok, out, reader, out, out);
        else
            st = sh("%s '%s/dfl-target' -q -m '%s' --device %s --layers %s --dtype %s %s -o '%s' '%s'",
                    wrap, bin, model, device, layers_arg(), runs[i].dtype, runs[i].opts, out, tok);
        T_CHECK(st == 0, "%s: exit %d", runs[i].name, st);
        if (st)
            continue;
        bool f32 = strcmp(runs[i].dtype, "f32") == 0;
        char *first = f32 ? first32 : first16;
        cmp c;
        compare(runs[i].name, out, cpu32, first[0] ? first : NULL, &c);
        T_CHECK(c.structure_ok && c.batches == n_batches, "%s: %d batches, expected %d", runs[i].name,
                c.batches, n_batches);
        if (!first[0])
            snprintf(first, 4300, "%s", out);
    }
}

/* Sizing: from the index of a file input (no --max-tokens needed); from the first batch of a
 * pipe, where a later, larger batch is an error that names the batch and the size to give; and
 * a --max-tokens too small for a batch. */
static void test_sizing(void)
{
    if (!have_device())
        T_SKIP("no CUDA GPU");
    if (strcmp(device, "cpu") == 0)
        T_SKIP("the CPU grows its buffers");
    char out[4300], err[4300];
    snprintf(out, sizeof out, "%s/size.dfl", dir);
    snprintf(err, sizeof err, "%s/size.err", dir);
    int st = sh("%s '%s/dfl-target' -v -m '%s' --device %s --layers %s -o '%s' '%s' 2>'%s'", wrap,
                bin, model, device, layers_arg(), out, tok, err);
    T_CHECK(st == 0, "sized from the index: exit %d", st);
    T_CHECK(sh("grep -q 'warm-up: a batch of' '%s'", err) == 0, "a warm-up ran before the first batch");
    T_CHECK(sh("grep -q 'allocation frozen' '%s'", err) == 0, "device allocation frozen");
    remove(out);
    /* through a pipe: the first batch (1 token) sizes the buffers; batch 1 is larger */
    st = sh("cat '%s' | %s '%s/dfl-target' -q -m '%s' --device %s --layers %s -o '%s' - 2>'%s'",
            tok, wrap, bin, model, device, layers_arg(), out, err);
    T_CHECK(st == 1, "a larger batch than the first through a pipe: exit %d, expected 1", st);
    T_CHECK(sh("grep -q 'rerun with --max-tokens' '%s'", err) == 0, "the message says --max-tokens");
    T_CHECK(!exists(out), "no output left behind");
    st = sh("%s '%s/dfl-target' -q -m '%s' --device %s --max-tokens 64 --layers %s -o '%s' '%s' 2>'%s'",
            wrap, bin, model, device, layers_arg(), out, tok, err);
    T_CHECK(st == 1, "--max-tokens 64: exit %d, expected 1", st);
    T_CHECK(sh("grep -q 'more than the buffers were sized for (64 tokens' '%s'", err) == 0,
            "the message names the buffers' size");
    T_CHECK(!exists(out), "no output left behind");
}

/* --profile prints stage times with the GPU's busy fraction; several inputs (and stdin) make one
 * stream. */
static void test_profile_and_inputs(void)
{
    if (!have_device())
        T_SKIP("no CUDA GPU");
    char out[4300], err[4300];
    snprintf(out, sizeof out, "%s/multi.dfl", dir);
    snprintf(err, sizeof err, "%s/multi.err", dir);
    int st = sh("%s '%s/dfl-target' -m '%s' --device %s --layers %s --dtype f32 --max-tokens 2048 "
                "--profile=4 -o '%s' '%s' - <'%s' 2>'%s'", wrap, bin, model, device, layers_arg(), out,
                tok, tok_b, err);
    T_CHECK(st == 0, "two inputs: exit %d", st);
    T_CHECK(sh("grep -q 'profile: batches 0-3: .* busy [0-9]*%%' '%s'", err) == 0,
            "--profile=4 reports batches 0-3 with the GPU's busy fraction");
    T_CHECK(sh("grep -q 'profile: all batches' '%s'", err) == 0, "--profile ends with a total");
    cmp c;
    compare("f32 two inputs --max-tokens 2048", out, cpu2, NULL, &c);
    T_CHECK(c.structure_ok, "same batches as the CPU run over the same two inputs");
}

/* --tune-file: the first run times the four products and stores its choices in the file; the
 * second takes them from it, times nothing and writes the same bits; a file stored for another
 * GPU or library is timed again and rewritten for this one. */
static void test_tune_file(void)
{
    if (!have_device())
        T_SKIP("no CUDA GPU");
    if (strcmp(device, "cpu") == 0)
        T_SKIP("the CPU has nothing to tune");
    if (*wrap)
        T_SKIP("not under a sanitizer (three runs with tuning)");
    char tf[4300], o1[4300], o2[4300], err[4300];
    snprintf(tf, sizeof tf, "%s/tune.json", dir);
    snprintf(o1, sizeof o1, "%s/tune1.dfl", dir);
    snprintf(o2, sizeof o2, "%s/tune2.dfl", dir);
    snprintf(err, sizeof err, "%s/tune.err", dir);
    remove(tf);
    int st = sh("'%s/dfl-target' -m '%s' --device %s --layers %s --dtype f32 --tune-file '%s' -o '%s' '%s' "
                "2>'%s'", bin, model, device, layers_arg(), tf, o1, tok, err);
    T_CHECK(st == 0, "first run: exit %d", st);
    T_CHECK(exists(tf), "the tune file was written");
    T_CHECK(sh("grep -q -- '--tune-file .*: 0 products from the file, [1-4] timed and stored in it' '%s'",
               err) == 0, "first run: timed and stored");
    st = sh("'%s/dfl-target' -m '%s' --device %s --layers %s --dtype f32 --tune-file '%s' -o '%s' '%s' 2>'%s'",
            bin, model, device, layers_arg(), tf, o2, tok, err);
    T_CHECK(st == 0, "second run: exit %d", st);
    T_CHECK(sh("grep -q -- '--tune-file .*: [1-4] products* from the file, 0 timed$' '%s'", err) == 0,
            "second run: every product from the file, none timed");
    cmp c;
    compare("--tune-file, second run", o2, cpu32, o1, &c);   /* bit-identical to the first run */
    T_CHECK(c.structure_ok && c.batches == n_batches, "second run: %d batches", c.batches);
    /* stored for another GPU: timed again, rewritten */
    T_CHECK(sh("sed -i 's/\"scope\": \"[^\"]*\"/\"scope\": \"another GPU\"/' '%s'", tf) == 0, "sed");
    st = sh("'%s/dfl-target' -m '%s' --device %s --layers %s --dtype f32 --tune-file '%s' -o '%s' '%s' 2>'%s'",
            bin, model, device, layers_arg(), tf, o2, tok, err);
    T_CHECK(st == 0, "third run: exit %d", st);
    T_CHECK(sh("grep -q -- 'timed and stored in it (it was written for another GPU or library' '%s'", err) == 0,
            "another GPU's file: timed again and rewritten");
    T_CHECK(sh("grep -q 'another GPU' '%s'", tf) != 0, "the file's scope is this GPU's again");
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    sh_report_exit = true;
    e2e_init(argv[0]);
    const char *w = getenv("DFL_GPU_WRAP");
    if (w && *w) {
        wrap = w;
        small = true;
    }
    if (getenv("DFL_GPU_SMALL"))
        small = true;
    if (have_device() && !setup()) {
        printf("not ok - setup (model, tokens, CPU reference)\n");
        return 1;
    }
    T_RUN(test_outputs);
    T_RUN(test_sizing);
    T_RUN(test_profile_and_inputs);
    T_RUN(test_tune_file);
    return t_done();
}
