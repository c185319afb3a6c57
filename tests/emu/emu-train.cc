/* emu-train.cc: runs the kernels of kernels/train_kernels.cuh (rmsnorm_bwd, qknorm_rope_bwd,
 * swiglu_bwd, sumsq, adamw, uniform_noise and lmce's row and sum kernels) in the SIMT emulator
 * (simt.h) on small random inputs and compares them with the CPU ops (lib/backends/be_cpu_train.c). The
 * launch configurations are chosen here (the GPU test covers the backend's own choices); lmce's
 * GEMMs are done on the host. Built and run by tests/emu/run. Exit 0 when everything agrees. */
#include "simt.h"

#include <string>

extern "C" {
#include "backend.h"
#include "dtype.h"
}

#include "../../kernels/train_kernels.cuh"

static int failures;

#define EMU_SEED 0x243F6A8885A308D3ull
#include "emu-rng.h"

template <typename T> static std::vector<T> conv(const std::vector<float> &v)
{
    std::vector<T> r(v.size());
    for (size_t i = 0; i < v.size(); i++)
        r[i] = from_f32<T>(v[i]);
    return r;
}
template <typename T> static std::vector<float> back(const std::vector<T> &v)
{
    std::vector<float> r(v.size());
    for (size_t i = 0; i < v.size(); i++)
        r[i] = to_f32(v[i]);
    return r;
}
static std::vector<float> rvec(size_t n, float sc, float off, bool bf)
{
    std::vector<float> v(n);
    for (auto &x : v) {
        x = off + sc * rnorm();
        if (bf)
            x = rb(x);
    }
    return v;
}

static void cmp(const char *what, const float *got, const float *ref, int64_t R, int64_t n, double rt, double cm)
{
    double wr = 0, wc = 1;
    int64_t bad = 0;
    for (int64_t r = 0; r < R; r++) {
        double e2 = 0, r2 = 0, g2 = 0, dot = 0;
        bool nf = false;
        for (int64_t j = 0; j < n; j++) {
            double g = got[r * n + j], f = ref[r * n + j];
            if (!std::isfinite(g))
                nf = true;
            e2 += (g - f) * (g - f);
            r2 += f * f;
            g2 += g * g;
            dot += g * f;
        }
        double rel = (r2 == 0 && e2 == 0) ? 0 : sqrt(e2) / std::max(sqrt(r2), 1e-30);
        double cs = (r2 == 0 && g2 == 0) ? 1 : dot / sqrt(std::max(r2 * g2, 1e-300));
        wr = std::max(wr, rel);
        wc = std::min(wc, cs);
        if (nf || !(rel <= rt) || !(cs >= cm)) {
            if (bad < 4)
                fprintf(stderr, "    %s: row %lld: rel %.3g cos %.7f%s\n", what, (long long)r, rel, cs, nf ? " non-finite" : "");
            bad++;
        }
    }
    printf("  %-72s rows %-6lld max rel %.3g min cos %.7f%s\n", what, (long long)R, wr, wc, bad ? "  FAIL" : "");
    if (bad)
        failures++;
}

static void check(bool ok, const char *what)
{
    printf("  %-72s %s\n", what, ok ? "ok" : "FAIL");
    if (!ok)
        failures++;
}

/* ---- rmsnorm_bwd ---- */
/* random inputs of rmsnorm_bwd: x, w, dy, the old dx and dw, and x's rstd */
struct RmsIn {
    std::vector<float> x, w, dy, dx0, dw0, rstd;
};
static RmsIn rms_inputs(int64_t R, int64_t n, bool bf)
{
    RmsIn in;
    in.x = rvec((size_t)(R * n), 1, 0, bf), in.w = rvec((size_t)n, 0.3f, 1, bf), in.dy = rvec((size_t)(R * n), 1, 0, bf);
    in.dx0 = rvec((size_t)(R * n), 1, 0, bf), in.dw0 = rvec((size_t)n, 0.1f, 0, false);
    in.rstd.resize((size_t)R);
    for (int64_t r = 0; r < R; r++) {
        float ss = 0;
        for (int64_t i = 0; i < n; i++)
            ss += in.x[(size_t)(r * n + i)] * in.x[(size_t)(r * n + i)];
        in.rstd[(size_t)r] = 1.0f / sqrtf(ss / n + 1e-6f);
    }
    return in;
}

template <typename T, int VEC, int P>
static void t_rmsnorm(dfl_be *cpu, int64_t R, int64_t n, int threads, int nb, bool acc)
{
    const bool bf = sizeof(T) == 2;
    RmsIn in = rms_inputs(R, n, bf);
    auto &x = in.x, &w = in.w, &dy = in.dy, &dx0 = in.dx0, &dw0 = in.dw0, &rstd = in.rstd;
    auto rdx = dx0, rdw = dw0;
    cpu->ops->rmsnorm_bwd(cpu, rdx.data(), rdw.data(), dy.data(), x.data(), w.data(), rstd.data(), R, n, acc);
    auto gx = conv<T>(x), gw = conv<T>(w), gdy = conv<T>(dy), gdx = conv<T>(dx0);
    auto gdw = dw0;
    const int64_t rpb = (R + nb - 1) / nb;
    nb = (int)((R + rpb - 1) / rpb);
    std::vector<double> part((size_t)(nb * n), NAN);
    emu::launch(dim3((unsigned)nb), dim3((unsigned)threads), 0, [&] {
        rmsnorm_bwd_kernel<T, VEC, P>(gdx.data(), part.data(), gdy.data(), gx.data(), gw.data(), rstd.data(), R, n, rpb, acc);
    });
    emu::launch(dim3((unsigned)((n + 255) / 256)), dim3(256), 0, [&] { tr_colsum_kernel<1>(gdw.data(), part.data(), nb, n); });
    char wh[160];
    snprintf(wh, sizeof wh, "rmsnorm_bwd %s R%lld n%lld VEC %d P %d threads %d blocks %d%s", bf ? "bf16" : "f32",
             (long long)R, (long long)n, VEC, P, threads, nb, acc ? " acc" : "");
    auto got = back(gdx);
    cmp(wh, got.data(), rdx.data(), R, n, bf ? 8e-3 : 2e-5, bf ? 0.99995 : 0.9999999);
    std::string w2 = std::string(wh) + ": dw";
    cmp(w2.c_str(), gdw.data(), rdw.data(), 1, n, 2e-5, 0.9999999);
}

/* ---- qknorm_rope_bwd ---- */
/* random inputs of qknorm_rope_bwd: x_in, dx, w, the old dw, the heads' rstd and positions */
struct QkIn {
    std::vector<float> xin, dx, w, dw0, rstd;
    std::vector<int32_t> pos;
};
static QkIn qk_inputs(int64_t R, int heads, int d, int64_t ld, bool bf, float eps)
{
    QkIn in;
    in.xin = rvec((size_t)(R * ld), 1, 0, bf), in.dx = rvec((size_t)(R * ld), 1, 0, bf), in.w = rvec((size_t)d, 0.3f, 1, bf);
    in.dw0 = rvec((size_t)d, 0.1f, 0, false);
    in.rstd.resize((size_t)(R * heads));
    in.pos.resize((size_t)R);
    for (int64_t r = 0; r < R; r++) {
        in.pos[(size_t)r] = (int32_t)(rnext() % 5000);
        for (int h = 0; h < heads; h++) {
            float ss = 0;
            for (int i = 0; i < d; i++)
                ss += in.xin[(size_t)(r * ld + h * d + i)] * in.xin[(size_t)(r * ld + h * d + i)];
            in.rstd[(size_t)(r * heads + h)] = 1.0f / sqrtf(ss / d + eps);
        }
    }
    return in;
}

template <typename T, int P, int MAXJ>
static void t_qknorm(dfl_be *cpu, int64_t R, int heads, int d, int64_t ld, bool use_w, bool use_rstd, int nb)
{
    const bool bf = sizeof(T) == 2;
    const float eps = 1e-6f, theta = 1e6f;
    QkIn in = qk_inputs(R, heads, d, ld, bf, eps);
    auto &xin = in.xin, &dx = in.dx, &w = in.w, &dw0 = in.dw0, &rstd = in.rstd;
    auto &pos = in.pos;
    auto rdx = dx, rdw = dw0;
    cpu->ops->qknorm_rope_bwd(cpu, rdx.data(), ld, rdw.data(), xin.data(), use_w ? w.data() : nullptr,
                              use_rstd ? rstd.data() : nullptr, pos.data(), R, heads, d, eps, theta);
    std::vector<float> inv((size_t)d / 2);
    dfl_rope_inv_freq(inv.data(), d, theta, DFL_F32);
    auto gx = conv<T>(xin), gdx = conv<T>(dx), gw = conv<T>(w);
    auto gdw = dw0;
    const int64_t items = R * heads, ipb = (items + nb - 1) / nb;
    nb = (int)((items + ipb - 1) / ipb);
    std::vector<double> part((size_t)(nb * d), NAN);
    emu::launch(dim3((unsigned)nb), dim3(QKB_WARPS * 32), 0, [&] {
        qknorm_rope_bwd_kernel<T, P, MAXJ>(gdx.data(), ld, use_w ? part.data() : nullptr, gx.data(),
                                           use_w ? gw.data() : nullptr, use_rstd ? rstd.data() : nullptr, pos.data(),
                                           inv.data(), R, heads, d, eps, ipb);
    });
    if (use_w)
        emu::launch(dim3((unsigned)((d + 255) / 256)), dim3(256), 0, [&] { tr_colsum_kernel<1>(gdw.data(), part.data(), nb, d); });
    char wh[160];
    snprintf(wh, sizeof wh, "qknorm_rope_bwd %s R%lld h%d d%d ld%lld P %d%s%s blocks %d", bf ? "bf16" : "f32",
             (long long)R, heads, d, (long long)ld, P, use_w ? "" : " no-w", use_rstd ? "" : " recompute", nb);
    auto got = back(gdx);
    /* compare whole rows (padding columns must be unchanged too) */
    cmp(wh, got.data(), rdx.data(), R, ld, bf ? 8e-3 : 2e-5, bf ? 0.99995 : 0.9999999);
    std::string w2 = std::string(wh) + ": dw";
    cmp(w2.c_str(), gdw.data(), rdw.data(), 1, d, 2e-5, 0.9999999);
}

/* The same bits: dx (T) and dw (f32) of two runs */
template <typename T>
static void same_bits(const char *what, const std::vector<T> &a, const std::vector<T> &b, const std::vector<float> &dwa,
                      const std::vector<float> &dwb)
{
    int64_t dx = 0, dw = 0;
    for (size_t i = 0; i < a.size(); i++)
        dx += memcmp(&a[i], &b[i], sizeof(T)) != 0;
    for (size_t i = 0; i < dwa.size(); i++)
        dw += memcmp(&dwa[i], &dwb[i], 4) != 0;
    char wh[256];
    snprintf(wh, sizeof wh, "%s: the first kernel's bits (dx %lld, dw %lld differ)", what, (long long)dx, (long long)dw);
    check(dx == 0 && dw == 0, wh);
}

/* ---- rmsnorm_bwd_pf_kernel (and tr_colsum_kernel<TR_COLSUM_AHEAD>): against the CPU, and the same bits as
 * rmsnorm_bwd_kernel with tr_colsum_kernel on the same launch ---- */
template <typename T, int VEC, int P>
static void t_rmsnorm_pf(dfl_be *cpu, int64_t R, int64_t n, int threads, int nb, bool acc, bool inplace)
{
    const bool bf = sizeof(T) == 2;
    RmsIn in = rms_inputs(R, n, bf);
    auto &x = in.x, &w = in.w, &dy = in.dy, &dx0 = in.dx0, &dw0 = in.dw0, &rstd = in.rstd;
    if (inplace)
        dx0 = dy;
    auto rdx = dx0, rdw = dw0;
    cpu->ops->rmsnorm_bwd(cpu, rdx.data(), rdw.data(), inplace ? rdx.data() : dy.data(), x.data(), w.data(), rstd.data(),
                          R, n, acc);
    auto gx = conv<T>(x), gw = conv<T>(w), gdy = conv<T>(dy), gdx = conv<T>(dx0), odx = gdx, ody = gdy;
    auto gdw = dw0, odw = dw0;
    const int64_t rpb = (R + nb - 1) / nb;
    nb = (int)((R + rpb - 1) / rpb);
    std::vector<double> part((size_t)(nb * n), NAN);
    emu::launch(dim3((unsigned)nb), dim3((unsigned)threads), rb_pf_smem_bytes(P, VEC, threads), [&] {
        rmsnorm_bwd_pf_kernel<T, VEC, P>(inplace ? gdy.data() : gdx.data(), part.data(), gdy.data(), gx.data(),
                                                gw.data(), rstd.data(), R, n, rpb, acc);
    });
    emu::launch(dim3((unsigned)((n + 63) / 64)), dim3(64), 0,
                [&] { tr_colsum_kernel<TR_COLSUM_AHEAD>(gdw.data(), part.data(), nb, n); });
    std::vector<double> opart((size_t)(nb * n), NAN);
    emu::launch(dim3((unsigned)nb), dim3((unsigned)threads), 0, [&] {
        rmsnorm_bwd_kernel<T, VEC, P>(inplace ? ody.data() : odx.data(), opart.data(), ody.data(), gx.data(), gw.data(),
                                      rstd.data(), R, n, rpb, acc);
    });
    emu::launch(dim3((unsigned)((n + 255) / 256)), dim3(256), 0, [&] { tr_colsum_kernel<1>(odw.data(), opart.data(), nb, n); });
    char wh[160];
    snprintf(wh, sizeof wh, "rmsnorm_bwd_pf %s R%lld n%lld VEC %d P %d threads %d blocks %d%s%s", bf ? "bf16" : "f32",
             (long long)R, (long long)n, VEC, P, threads, nb, acc ? " acc" : "",
             inplace ? " in place" : "");
    auto got = back(inplace ? gdy : gdx);
    cmp(wh, got.data(), rdx.data(), R, n, bf ? 8e-3 : 2e-5, bf ? 0.99995 : 0.9999999);
    std::string w2 = std::string(wh) + ": dw";
    cmp(w2.c_str(), gdw.data(), rdw.data(), 1, n, 2e-5, 0.9999999);
    same_bits(wh, inplace ? gdy : gdx, inplace ? ody : odx, gdw, odw);
}

/* ---- qknorm_rope_bwd_row_kernel: against the CPU, and dx the same bits as qknorm_rope_bwd_kernel
 * <T, 2, 1> (dw sums in another order: against the CPU only) ---- */
template <typename T>
static void t_qknorm_row(dfl_be *cpu, int64_t R, int heads, int64_t ld, bool use_w, bool use_rstd, bool use_dw)
{
    const bool bf = sizeof(T) == 2;
    const int d = QKV_D;
    const float eps = 1e-6f, theta = 1e6f;
    QkIn in = qk_inputs(R, heads, d, ld, bf, eps);
    auto rdx = in.dx, rdw = in.dw0;
    cpu->ops->qknorm_rope_bwd(cpu, rdx.data(), ld, use_dw ? rdw.data() : nullptr, in.xin.data(), use_w ? in.w.data() : nullptr,
                              use_rstd ? in.rstd.data() : nullptr, in.pos.data(), R, heads, d, eps, theta);
    std::vector<float> inv((size_t)d / 2);
    dfl_rope_inv_freq(inv.data(), d, theta, DFL_F32);
    auto gx = conv<T>(in.xin), gdx = conv<T>(in.dx), gw = conv<T>(in.w), odx = gdx;
    auto gdw = in.dw0;
    const bool dwp = use_w && use_dw;
    const int nb = (int)((R + QKR_ROWS - 1) / QKR_ROWS);
    std::vector<double> part((size_t)(nb * d), NAN);
    const float *rs = use_rstd ? in.rstd.data() : nullptr;
    emu::launch(dim3((unsigned)nb), dim3(QKR_WARPS * 32), 0, [&] {
        qknorm_rope_bwd_row_kernel<T>(gdx.data(), ld, dwp ? part.data() : nullptr, gx.data(), use_w ? gw.data() : nullptr,
                                          rs, in.pos.data(), inv.data(), R, heads, eps);
    });
    if (dwp)
        emu::launch(dim3((unsigned)((d + 63) / 64)), dim3(64), 0,
                    [&] { tr_colsum_kernel<TR_COLSUM_AHEAD>(gdw.data(), part.data(), nb, d); });
    /* the first kernel's dx: 64 items a block */
    const int64_t items = R * heads, ipb = 64, onb = (items + ipb - 1) / ipb;
    std::vector<double> opart((size_t)(onb * d), NAN);
    emu::launch(dim3((unsigned)onb), dim3(QKB_WARPS * 32), 0, [&] {
        qknorm_rope_bwd_kernel<T, 2, 1>(odx.data(), ld, dwp ? opart.data() : nullptr, gx.data(), use_w ? gw.data() : nullptr,
                                        rs, in.pos.data(), inv.data(), R, heads, d, eps, ipb);
    });
    char wh[160];
    snprintf(wh, sizeof wh, "qknorm_rope_bwd_row %s R%lld h%d ld%lld%s%s%s blocks %d", bf ? "bf16" : "f32", (long long)R, heads, (long long)ld, use_w ? "" : " no-w", use_rstd ? "" : " recompute",
             use_dw ? "" : " no-dw", nb);
    auto got = back(gdx);
    cmp(wh, got.data(), rdx.data(), R, ld, bf ? 8e-3 : 2e-5, bf ? 0.99995 : 0.9999999);
    std::string w2 = std::string(wh) + ": dw";
    cmp(w2.c_str(), gdw.data(), rdw.data(), 1, d, 2e-5, 0.9999999);
    int64_t diff = 0;
    for (size_t i = 0; i < gdx.size(); i++)
        diff += memcmp(&gdx[i], &odx[i], sizeof(T)) != 0;
    char wb[256];
    snprintf(wb, sizeof wb, "%s: dx the first kernel's bits (%lld differ)", wh, (long long)diff);
    check(diff == 0, wb);
}

/* ---- swiglu_bwd ---- */
template <typename T, int VEC>
static void t_swiglu(dfl_be *cpu, int64_t R, int64_t I)
{
    const bool bf = sizeof(T) == 2;
    auto gu = rvec((size_t)(R * 2 * I), 2, 0, bf), dout = rvec((size_t)(R * I), 1, 0, bf);
    std::vector<float> ref((size_t)(R * 2 * I));
    cpu->ops->swiglu_bwd(cpu, ref.data(), dout.data(), gu.data(), R, I);
    auto ggu = conv<T>(gu), gdo = conv<T>(dout);
    std::vector<T> gd((size_t)(R * 2 * I));
    emu::launch(dim3(3), dim3(64), 0, [&] { swiglu_bwd_kernel<T, VEC>(gd.data(), gdo.data(), ggu.data(), R, I); });
    char wh[120];
    snprintf(wh, sizeof wh, "swiglu_bwd %s R%lld I%lld VEC %d", bf ? "bf16" : "f32", (long long)R, (long long)I, VEC);
    auto got = back(gd);
    cmp(wh, got.data(), ref.data(), R, 2 * I, bf ? 8e-3 : 2e-5, bf ? 0.99995 : 0.9999999);
}

/* ---- sumsq ---- */
static void t_sumsq(dfl_be *cpu, int64_t n, int64_t cs, bool vec)
{
    auto x = rvec((size_t)n, 0.1f, 0, false);
    double ref = 0.25, got = 0.25;
    cpu->ops->sumsq(cpu, &ref, x.data(), n);
    const int nb = (int)((n + cs - 1) / cs);
    std::vector<double> part((size_t)nb);
    emu::launch(dim3((unsigned)nb), dim3(SUMSQ_THREADS), 0, [&] { sumsq_part_kernel(part.data(), x.data(), n, cs, vec); });
    emu::launch(dim3(1), dim3(32), 0, [&] { sumsq_final_kernel(&got, part.data(), nb); });
    char wh[120];
    snprintf(wh, sizeof wh, "sumsq n%lld chunk %lld%s: %.17g vs %.17g", (long long)n, (long long)cs, vec ? " vec" : "",
             got, ref);
    check(fabs(got - ref) <= 1e-12 * fabs(ref), wh);
}

/* ---- adamw, uniform_noise ---- */
static void t_adamw(dfl_be *cpu, int64_t n, bool vec)
{
    auto p = rvec((size_t)n, 0.05f, 0, false), g = rvec((size_t)n, 1e-3f, 0, false), m = rvec((size_t)n, 1e-4f, 0, false);
    std::vector<float> v((size_t)n);
    for (auto &x : v)
        x = 1e-7f * fabsf(rnorm());
    float gs = 0.37f;
    int32_t skip = 0;
    auto rp = p, rm = m, rv = v;
    dfl_adamw a = {};
    a.p = rp.data(), a.g = g.data(), a.m = rm.data(), a.v = rv.data(), a.n = n, a.lr = 1e-3f, a.beta1 = 0.9f;
    a.beta2 = 0.95f, a.eps = 1e-8f, a.weight_decay = 0.01f, a.step = 7, a.grad_scale = &gs, a.skip = &skip;
    cpu->ops->adamw(cpu, &a);
    dfl_adam_scalars c;
    const double bc1 = 1.0 - pow(0.9, 7.0), bc2 = 1.0 - pow((double)0.95f, 7.0);
    c.step_size = (float)((double)1e-3f / (1.0 - pow((double)0.9f, 7.0)));
    (void)bc1;
    c.bc2_sqrt = (float)sqrt(bc2);
    c.decay = 1.0f - 1e-3f * 0.01f;
    c.b1w = 1.0f - 0.9f;
    c.b2 = 0.95f;
    c.b2w = 1.0f - 0.95f;
    c.eps = 1e-8f;
    std::vector<bf16> pa((size_t)n);
    emu::launch(dim3(2), dim3(64), 0, [&] {
        adamw_kernel<bf16>(p.data(), g.data(), m.data(), v.data(), pa.data(), n, c, c, nullptr, &gs, &skip, vec);
    });
    int64_t diff = 0, pab = 0;
    for (int64_t i = 0; i < n; i++) {
        diff += memcmp(&p[(size_t)i], &rp[(size_t)i], 4) != 0 || memcmp(&m[(size_t)i], &rm[(size_t)i], 4) != 0 ||
                memcmp(&v[(size_t)i], &rv[(size_t)i], 4) != 0;
        pab += __bfloat16_as_ushort(pa[(size_t)i]) != __bfloat16_as_ushort(__float2bfloat16_rn(p[(size_t)i]));
    }
    char wh[120];
    snprintf(wh, sizeof wh, "adamw n%lld%s: %lld elements not bit-identical, %lld p_act wrong", (long long)n,
             vec ? " vec" : "", (long long)diff, (long long)pab);
    check(diff == 0 && pab == 0, wh);
}

static void t_noise(dfl_be *cpu, int64_t n)
{
    auto x = rvec((size_t)n, 1, 0, false);
    auto ref = x;
    cpu->ops->uniform_noise(cpu, ref.data(), n, 0.3f, 12345);
    emu::launch(dim3(2), dim3(64), 0, [&] { uniform_noise_kernel<float>(x.data(), n, 0.3f, 12345); });
    check(memcmp(x.data(), ref.data(), (size_t)n * 4) == 0, "uniform_noise f32: bit-identical to the CPU");
}

/* ---- block_metrics ---- */
static void t_block_metrics(dfl_be *cpu, int64_t nb, int bs)
{
    std::vector<uint8_t> ok((size_t)(nb * bs));
    std::vector<float> w((size_t)(nb * bs));
    for (size_t i = 0; i < w.size(); i++) {
        w[i] = (i % (size_t)bs == 0 || rnext() % 5 == 0) ? 0.0f : 0.7f;
        ok[i] = w[i] > 0 && rnext() % 4 != 0;
    }
    std::vector<double> ref((size_t)(2 * bs + 2), 1.0), got = ref;
    cpu->ops->block_metrics(cpu, ref.data(), ok.data(), w.data(), nb, bs);
    emu::launch(dim3(1), dim3(BM_THREADS), 0, [&] { block_metrics_kernel(got.data(), ok.data(), w.data(), nb, bs); });
    char wh[100];
    snprintf(wh, sizeof wh, "block_metrics %lld blocks of %d: acceptance %g/%g", (long long)nb, bs, got[(size_t)(2 * bs)],
             got[(size_t)(2 * bs + 1)]);
    check(got == ref, wh);
}

/* ---- lmce rows ---- */
/* cuda_lmce's row work (lmce_rows) of the chunk of rows [r0, r0 + nr) over its logits x, on the
 * emulator: statistics, finish, gradient */
template <typename X>
static void emu_lmce_rows(const LmceWork &wl, X *x, int64_t V, int64_t r0, int64_t nr, const int32_t *lab,
                          const float *wt, float gscale, uint8_t *corr, float *ce)
{
    emu::launch(lmce_stats_grid(wl, nr), dim3(LMCE_THREADS), 0,
                [&] { lmce_stats_kernel(x, V, wl.ldx, r0, wt, wl.part, wl.S); });
    emu::launch(lmce_finish_grid(nr), dim3(LMCE_FIN_WARPS * 32), 0, [&] {
        lmce_finish_kernel(x, wl.ldx, r0, nr, lab, wt, wl.part, wl.S, wl.lse, corr, ce, wl.row_wce, wl.row_hit);
    });
    emu::launch(lmce_grad_grid<X>(V, nr), dim3(LMCE_THREADS), 0,
                [&] { lmce_grad_kernel(x, V, wl.ldx, r0, lab, wt, gscale, wl.lse); });
}

template <bool BF>
static void t_lmce(dfl_be *cpu, int64_t Q, int64_t H, int64_t V, int64_t CR, float gscale)
{
    auto z = rvec((size_t)(Q * H), 1, 0, BF), W = rvec((size_t)(V * H), 0.2f, 0, BF);
    std::vector<int32_t> lab((size_t)Q);
    std::vector<float> wt((size_t)Q);
    for (int64_t q = 0; q < Q; q++) {
        lab[(size_t)q] = (int32_t)(rnext() % (uint64_t)V);
        if (q % 2) {   /* the argmax: accuracy counts something */
            double best = -INFINITY;
            for (int64_t v = 0; v < V; v++) {
                double s = 0;
                for (int64_t i = 0; i < H; i++)
                    s += (double)z[(size_t)(q * H + i)] * W[(size_t)(v * H + i)];
                if (s > best) {
                    best = s;
                    lab[(size_t)q] = (int32_t)v;
                }
            }
        }
        int r = (int)(rnext() % 10);
        wt[(size_t)q] = r < 2 ? 0.0f : r < 4 ? 1.0f : 0.5f;
    }
    std::vector<float> work((size_t)(CR * (V + 2))), ce((size_t)Q), dz((size_t)(Q * H));
    std::vector<uint8_t> corr((size_t)Q);
    double sums[DFL_SUM_COUNT] = {0};
    dfl_lmce a = {};
    a.z = z.data(), a.w_lm = W.data(), a.labels = lab.data(), a.weight = wt.data(), a.Q = Q, a.H = H, a.V = V;
    a.sums = sums, a.correct = corr.data(), a.ce_out = ce.data(), a.dz = dz.data(), a.grad_scale = gscale;
    a.work = work.data(), a.chunk_rows = CR;
    cpu->ops->lmce(cpu, &a);
    /* the GPU op's kernels on host-computed logits */
    std::vector<float> gwork((size_t)dfl_lmce_work_act(CR, V, BF ? DFL_BF16 : DFL_F32), NAN), gce((size_t)Q, NAN), gdz((size_t)(Q * H), 0);
    std::vector<uint8_t> gcorr((size_t)Q, 7);
    double gsums[DFL_SUM_COUNT] = {0};
    /* cuda_lmce's layout of work (lmce_work_layout) and its launches */
    const LmceWork wl = lmce_work_layout(gwork.data(), CR, V, BF);
    bf16 *const xg = (bf16 *)wl.x;     /* the logits of the mode, then G */
    float *const xf = (float *)wl.x;
    check((const char *)wl.end <= (const char *)(gwork.data() + dfl_lmce_work_act(CR, V, BF ? DFL_BF16 : DFL_F32)) &&
              dfl_lmce_work_act(CR, V, BF ? DFL_BF16 : DFL_F32) <= (int64_t)gwork.size(),
          "lmce work layout within dfl_lmce_work_act");
    /* bf16 mode: the kernels get bf16 logits (the GEMM's output there), so the reference is this
     * one, on the same rounded logits: ce, the hit, the sums and dz (G = gscale w (p - onehot)) */
    double rsums[DFL_SUM_COUNT] = {0};
    std::vector<double> xr((size_t)V);
    for (int64_t r0 = 0; r0 < Q; r0 += CR) {
        const int64_t nr = std::min(CR, Q - r0);
        for (int64_t r = 0; r < nr; r++) {
            const int64_t q = r0 + r;
            for (int64_t v = 0; v < V; v++) {
                float s = 0;
                for (int64_t i = 0; i < H; i++)
                    s += z[(size_t)(q * H + i)] * W[(size_t)(v * H + i)];
                if (BF)
                    xg[r * wl.ldx + v] = __float2bfloat16_rn(s);
                else
                    xf[r * wl.ldx + v] = s;
                xr[(size_t)v] = BF ? (double)__bfloat162float(__float2bfloat16_rn(s)) : s;
            }
            const double w = wt[(size_t)q];
            if (!BF || !(w > 0))
                continue;
            double m = -INFINITY, se = 0;
            int64_t am = 0;
            for (int64_t v = 0; v < V; v++)
                if (xr[(size_t)v] > m) {
                    m = xr[(size_t)v];
                    am = v;
                }
            for (int64_t v = 0; v < V; v++)
                se += exp(xr[(size_t)v] - m);
            const double l = m + log(se), c = l - xr[(size_t)lab[(size_t)q]];
            ce[(size_t)q] = (float)c;
            corr[(size_t)q] = am == lab[(size_t)q];
            rsums[DFL_SUM_LOSS_NUM] += w * c;
            rsums[DFL_SUM_LOSS_DEN] += w;
            rsums[DFL_SUM_ACC_NUM] += corr[(size_t)q];
            rsums[DFL_SUM_ACC_DEN] += 1;
            for (int64_t i = 0; i < H; i++) {
                double a = 0;
                for (int64_t v = 0; v < V; v++)
                    a += gscale * w * (exp(xr[(size_t)v] - l) - (v == lab[(size_t)q] ? 1.0 : 0.0)) * W[(size_t)(v * H + i)];
                dz[(size_t)(q * H + i)] = (float)a;
            }
        }
        if (BF)
            emu_lmce_rows(wl, xg, V, r0, nr, lab.data(), wt.data(), gscale, gcorr.data(), gce.data());
        else
            emu_lmce_rows(wl, xf, V, r0, nr, lab.data(), wt.data(), gscale, gcorr.data(), gce.data());
        emu::launch(dim3(1), dim3(32), 0, [&] { lmce_sums_kernel(gsums, wl.row_wce, wl.row_hit, wt.data(), r0, nr); });
        for (int64_t r = 0; r < nr; r++)
            for (int64_t i = 0; i < H; i++) {
                double s = 0;
                for (int64_t v = 0; v < V; v++) {
                    float gv;
                    if (BF)
                        gv = __bfloat162float(xg[r * wl.ldx + v]);
                    else
                        gv = xf[r * wl.ldx + v];
                    s += (double)gv * W[(size_t)(v * H + i)];
                }
                gdz[(size_t)((r0 + r) * H + i)] = (float)s;
            }
    }
    if (BF)
        std::copy(rsums, rsums + DFL_SUM_COUNT, sums);
    char wh[160];
    snprintf(wh, sizeof wh, "lmce %s Q%lld H%lld V%lld chunk %lld scale %g", BF ? "bf16" : "f32", (long long)Q,
             (long long)H, (long long)V, (long long)CR, (double)gscale);
    int64_t cbad = 0, cebad = 0;
    for (int64_t q = 0; q < Q; q++) {
        cbad += gcorr[(size_t)q] != corr[(size_t)q];
        cebad += !(fabs((double)gce[(size_t)q] - ce[(size_t)q]) <= 1e-4 + 1e-5 * fabs(ce[(size_t)q]));
    }
    std::string w = std::string(wh) + ": correct, ce";
    check(cbad == 0 && cebad == 0, w.c_str());
    char ws[300];
    snprintf(ws, sizeof ws, "%s: sums %.9g %.9g %g %g (cpu %.9g %.9g %g %g)", wh, gsums[0], gsums[1], gsums[2], gsums[3],
             sums[0], sums[1], sums[2], sums[3]);
    check(fabs(gsums[0] - sums[0]) <= 1e-5 * fabs(sums[0]) && fabs(gsums[1] - sums[1]) <= 1e-12 * sums[1] &&
              gsums[2] == sums[2] && gsums[3] == sums[3],
          ws);
    w = std::string(wh) + ": dz";
    cmp(w.c_str(), gdz.data(), dz.data(), Q, H, BF ? 1e-2 : 1e-4, BF ? 0.9999 : 0.9999999);
}

/* lmce's row kernels keep a NaN logit: the row's ce and its G are NaN, whether the NaN is one
 * logit among finite ones or a whole statistics slice (a thread that sees only NaN); rows without
 * a NaN keep their ce and hit (against a double reference on the same logits). */
template <bool BF>
static void t_lmce_nan()
{
    const int64_t V = 70000, nr = 3;   /* three statistics slices a row, the last one partial */
    std::vector<float> work((size_t)dfl_lmce_work_act(nr, V, BF ? DFL_BF16 : DFL_F32), 0.0f), ce((size_t)nr, 0.0f);
    std::vector<float> wt((size_t)nr, 1.0f);
    std::vector<int32_t> lab = {5, 100, 69999};   /* labels outside the NaN logits */
    std::vector<uint8_t> corr((size_t)nr, 7);
    const LmceWork wl = lmce_work_layout(work.data(), nr, V, BF);
    bf16 *const xg = (bf16 *)wl.x;
    float *const xf = (float *)wl.x;
    std::vector<float> xs((size_t)(nr * V));
    for (int64_t r = 0; r < nr; r++)
        for (int64_t v = 0; v < V; v++) {
            float x = 4.0f * runi();
            if ((r == 0 && v == 50001) || (r == 1 && v >= LMCE_SLICE && v < 2 * LMCE_SLICE))
                x = NAN;
            if (BF)
                xg[r * wl.ldx + v] = __float2bfloat16_rn(x);
            else
                xf[r * wl.ldx + v] = x;
            xs[(size_t)(r * V + v)] = BF ? __bfloat162float(__float2bfloat16_rn(x)) : x;
        }
    if (BF)
        emu_lmce_rows(wl, xg, V, 0, nr, lab.data(), wt.data(), 1.0f, corr.data(), ce.data());
    else
        emu_lmce_rows(wl, xf, V, 0, nr, lab.data(), wt.data(), 1.0f, corr.data(), ce.data());
    int64_t gnan[3] = {0, 0, 0};
    for (int64_t r = 0; r < nr; r++)
        for (int64_t v = 0; v < V; v++)
            gnan[r] += std::isnan(BF ? __bfloat162float(xg[r * wl.ldx + v]) : xf[r * wl.ldx + v]);
    /* the clean row against a double reference */
    const float *x2 = xs.data() + 2 * V;
    double m = -INFINITY, se = 0;
    int64_t am = 0;
    for (int64_t v = 0; v < V; v++)
        if (x2[v] > m) {
            m = x2[v];
            am = v;
        }
    for (int64_t v = 0; v < V; v++)
        se += exp(x2[v] - m);
    const double c2 = m + log(se) - x2[lab[2]];
    char w[200];
    snprintf(w, sizeof w, "lmce %s NaN logits: ce %g %g %g (row 2: %g), G rows with NaN %lld %lld %lld", BF ? "bf16" : "f32",
             ce[0], ce[1], ce[2], c2, (long long)gnan[0], (long long)gnan[1], (long long)gnan[2]);
    check(std::isnan(ce[0]) && std::isnan(ce[1]) && fabs(ce[2] - c2) <= 1e-5 && corr[2] == (am == lab[2]) &&
              gnan[0] == V && gnan[1] == V && gnan[2] == 0,
          w);
}

int main()
{
    setvbuf(stdout, nullptr, _IOLBF, 0);
    dfl_be *cpu = nullptr;
    dfl_err e = {};
    if (dfl_be_cpu_open(&cpu, 1, &e)) {
        fprintf(stderr, "cpu backend: %s\n", e.msg);
        return 1;
    }
    t_rmsnorm<bf16, 8, 2>(cpu, 37, 4096, 256, 10, false);
    t_rmsnorm<bf16, 8, 1>(cpu, 9, 512, 64, 3, true);
    t_rmsnorm<float, 4, 2>(cpu, 20, 1000, 128, 4, true);
    t_rmsnorm<float, 1, 8>(cpu, 5, 1000, 128, 2, false);
    t_rmsnorm<bf16, 1, 1>(cpu, 6, 7, 64, 6, true);
    t_qknorm<bf16, 2, 1>(cpu, 13, 4, 128, 4 * 128, true, true, 3);
    t_qknorm<float, 2, 1>(cpu, 11, 3, 128, 3 * 128 + 8, true, false, 2);
    t_qknorm<bf16, 1, 1>(cpu, 9, 4, 6, 25, true, true, 2);
    t_qknorm<float, 2, 4>(cpu, 5, 2, 512, 1024, true, true, 1);
    t_qknorm<bf16, 2, 1>(cpu, 7, 4, 64, 256, false, false, 2);
    t_rmsnorm_pf<bf16, 8, 2>(cpu, 37, 4096, 256, 10, false, false);
    t_rmsnorm_pf<bf16, 8, 2>(cpu, 37, 4096, 256, 10, true, false);
    t_rmsnorm_pf<bf16, 8, 1>(cpu, 9, 512, 64, 3, true, true);
    t_rmsnorm_pf<float, 4, 2>(cpu, 20, 1000, 128, 4, true, false);
    t_rmsnorm_pf<float, 4, 1>(cpu, 5, 248, 64, 2, false, true);
    /* a row's heads over several blocks and groups, rows not aligned to blocks, partial last steps */
    /* rows over several blocks (a partial last one), heads not a multiple of a warp's step */
    t_qknorm_row<bf16>(cpu, 70, 32, 32 * 128, true, true, true);
    t_qknorm_row<bf16>(cpu, 37, 8, 8 * 128 + 8, true, false, true);
    t_qknorm_row<bf16>(cpu, 9, 5, 5 * 128, true, true, true);
    t_qknorm_row<float>(cpu, 40, 3, 3 * 128 + 4, true, false, true);
    t_qknorm_row<float>(cpu, 7, 4, 4 * 128, true, true, false);
    t_qknorm_row<bf16>(cpu, 7, 6, 6 * 128, false, false, true);
    t_swiglu<bf16, 8>(cpu, 5, 1024);
    t_swiglu<float, 1>(cpu, 4, 99);
    t_sumsq(cpu, 100003, 16384, true);
    t_sumsq(cpu, 5, 4, false);
    t_adamw(cpu, 1001, true);
    t_adamw(cpu, 37, false);
    t_noise(cpu, 1000);
    t_block_metrics(cpu, 1000, 16);
    t_block_metrics(cpu, 37, 256);
    t_block_metrics(cpu, 3, 2);
    t_lmce<true>(cpu, 13, 64, 1000, 5, 1.0f);
    t_lmce<false>(cpu, 9, 32, 4100, 4, 0.5f);
    t_lmce<true>(cpu, 3, 32, 9000, 3, 2.0f);
    t_lmce<true>(cpu, 4, 32, 5003, 2, 1.0f);   /* V not a multiple of 8: scalar loads and stores */
    t_lmce<true>(cpu, 3, 32, 4100, 2, 1.0f);   /* a multiple of 4, not of 8: scalar in bf16 */
    t_lmce<false>(cpu, 3, 32, 1001, 2, 1.0f);  /* odd V in f32 */
    /* rows of several statistics slices (32768 logits) and gradient blocks (8192 bf16 or 4096 f32
     * logits), the last one partial; 16-byte and scalar groups */
    t_lmce<true>(cpu, 3, 8, 70000, 2, 1.0f);
    t_lmce<true>(cpu, 2, 8, 70001, 1, 0.5f);
    t_lmce<false>(cpu, 2, 8, 40004, 2, 1.0f);
    t_lmce<false>(cpu, 2, 8, 65539, 1, 1.0f);
    t_lmce<true>(cpu, 40, 8, 8190, 40, 1.0f);   /* more rows than a grid of finish warps */
    t_lmce_nan<true>();
    t_lmce_nan<false>();
    printf(failures ? "FAILED: %d checks\n" : "all checks passed\n", failures);
    dfl_be_close(cpu);
    return failures ? 1 : 0;
}
