/* emu-dflash.cc: runs the DFlash attention kernels (kernels/dflash_kernels.cuh; the forward, pass
 * Q and pass KV of kernels/dflash_wgmma.cu on wgmma.h) in the SIMT emulator (simt.h) on small random
 * batches and compares them with the CPU ops (lib/backends/be_cpu_train.c), the way
 * tests/gpu/gpu-train-ops.c does on a GPU; first it checks the
 * emulator itself by running the target's flash-attention kernel (kernels/attn.cu, verified on
 * an H200) against the CPU attention, then the target's wgmma attention (kernels/attn_wgmma.cu:
 * the overlapped kernel and its warp-specialized persistent form on mbarriers, which must give
 * the same bits; --only attn runs these alone). Built and run by tests/emu/run (not by make check: it
 * takes a minute or more). Exit 0 when everything agrees. */
#include "simt.h"

#include <string>

extern "C" {
#include "backend.h"
#include "dtype.h"
}

#include "../../kernels/dflash_kernels.cuh"
#include "../../kernels/attn_tiled.cuh"   /* kernels/attn.cu's tiled kernel */
/* the wgmma kernels of kernels/dflash_wgmma.cu (sm_90a code: the forward, pass Q and pass KV) on
 * the emulated wgmma of wgmma.h (pass Q's, verified on an H200, check the emulator's wgmma
 * layouts); simt.h stands in for the file's CUDA includes (and gives pass KV's static shared row
 * tables shared addresses, for their cp.async) */
#define DFL_BE_CUDA_CUH 1
#define DFL_DFLASH_PTX_CUH 1
#define __CUDA_ARCH_FEAT_SM90_ALL 1
#include "wgmma.h"
#include "../../kernels/dflash_wgmma.cu"
/* and the target's wgmma attention (kernels/attn_wgmma.cu: its kernels, not its host side, whose
 * header would bring in cuda_runtime.h) */
#define DFL_ATTN_WGMMA_CUH 1
#include "../../kernels/attn_wgmma.cu"

static int failures;

#define EMU_SEED 0x9E3779B97F4A7C15ull
#include "emu-rng.h"

static std::vector<float> rvec(size_t n, float sc)
{
    std::vector<float> v(n);
    for (auto &x : v)
        x = rb(sc * rnorm());
    return v;
}
static std::vector<bf16> tobf(const std::vector<float> &v)
{
    std::vector<bf16> b(v.size());
    for (size_t i = 0; i < v.size(); i++)
        b[i] = __float2bfloat16_rn(v[i]);
    return b;
}
static std::vector<float> fromb(const std::vector<bf16> &b)
{
    std::vector<float> v(b.size());
    for (size_t i = 0; i < b.size(); i++)
        v[i] = __bfloat162float(b[i]);
    return v;
}

/* per-row relative error and cosine, as the GPU test */
/* With M: rows pass when ||diff|| <= rt ||ref|| + 4e-6 M[r] (M: the size of the row's terms, see
 * tests/gpu/gpu-train-ops.c df_cond), the cosine checked only where ||ref|| dominates. */
static void cmp(const char *what, const float *got, const float *ref, int64_t R, int64_t n, double rt, double cm,
                const std::function<std::string(int64_t)> &desc = nullptr, const double *M = nullptr)
{
    double wr = 0, wc = 1;
    int64_t bad = 0;
    for (int64_t r = 0; r < R; r++) {
        double e2 = 0, r2 = 0, g2 = 0, dot = 0;
        int64_t nf = 0, mj = 0;
        double md = -1;
        for (int64_t j = 0; j < n; j++) {
            double g = got[r * n + j], f = ref[r * n + j];
            if (!std::isfinite(g)) {
                nf++;
                continue;
            }
            double d = fabs(g - f);
            e2 += d * d;
            r2 += f * f;
            g2 += g * g;
            dot += g * f;
            if (d > md) {
                md = d;
                mj = j;
            }
        }
        double rel = (r2 == 0 && g2 == 0) ? 0 : sqrt(e2) / std::max(sqrt(r2), 1e-30);
        double cs = (r2 == 0 && g2 == 0) ? 1 : (r2 == 0 ? 0 : dot / sqrt(std::max(r2 * g2, 1e-300)));
        bool ok;
        if (M) {
            const double bound = rt * sqrt(r2) + 4e-6 * M[r];
            const bool well = 4e-6 * M[r] <= rt * sqrt(r2);
            ok = sqrt(e2) <= bound && (!well || cs >= cm);
            rel = bound > 0 ? sqrt(e2) / bound * rt : (e2 > 0 ? INFINITY : 0);   /* in units of rt */
            if (!well)
                cs = 1;
        } else {
            ok = rel <= rt && cs >= cm;
        }
        if (rel > wr)
            wr = rel;
        if (cs < wc)
            wc = cs;
        if (nf || !ok) {
            if (bad < 5)
                fprintf(stderr, "    %s: row %lld %s: rel %.3g cos %.7f nonfinite %lld; worst [%lld] got %.7g ref %.7g\n",
                        what, (long long)r, desc ? desc(r).c_str() : "", rel, cs, (long long)nf, (long long)mj,
                        got[r * n + mj], ref[r * n + mj]);
            bad++;
        }
    }
    printf("  %-78s rows %-6lld max rel %.3g min cos %.7f%s\n", what, (long long)R, wr, wc, bad ? "  FAIL" : "");
    if (bad)
        failures++;
}

/* ------------------------------------------------------------------------------------------ */
/* the emulator against kernels/attn.cu (hardware-verified) */

/* A batch for the target's attention: random q, k, v (nh / nkv heads of D) over the sequences of
 * cu, the CPU attention's output (ref), the bf16 inputs and the kernels' parameters (output into
 * ob, filled with NaN so that a row never written fails) */
struct AttnBatch {
    std::vector<int32_t> cu;
    int nseq, T, max_len, nh, D;
    std::vector<float> ref;
    std::vector<bf16> qb, kb, vb, ob;
    AttnParams p;
    AttnBatch(dfl_be *cpu, std::vector<int32_t> cu_, int max_len_, int nh_, int nkv, int D_)
        : cu(std::move(cu_)), nseq((int)cu.size() - 1), T(cu.back()), max_len(max_len_), nh(nh_), D(D_)
    {
        auto q = rvec((size_t)T * nh * D, 1), k = rvec((size_t)T * nkv * D, 1), v = rvec((size_t)T * nkv * D, 1);
        ref.resize((size_t)T * nh * D);
        dfl_attn_varlen a = {};
        a.q = q.data(), a.ldq = nh * D, a.k = k.data(), a.ldk = nkv * D, a.v = v.data(), a.ldv = nkv * D;
        a.o = ref.data(), a.ldo = nh * D, a.cu_seqlens = cu.data(), a.n_seqs = nseq, a.max_len = max_len;
        a.T = T, a.n_heads = nh, a.n_kv = nkv, a.d = D, a.scale = 1.0f / sqrtf((float)D);
        cpu->ops->attn_varlen(cpu, &a);
        qb = tobf(q), kb = tobf(k), vb = tobf(v);
        ob.assign((size_t)T * nh * D, __float2bfloat16_rn(NAN));
        p.q = qb.data(), p.k = kb.data(), p.v = vb.data(), p.o = ob.data();
        p.ldq = nh * D, p.ldk = nkv * D, p.ldv = nkv * D, p.ldo = nh * D, p.cu = cu.data();
        p.n_seqs = nseq, p.n_heads = nh, p.group = nh / nkv, p.d = D, p.T = T;
        p.scale = a.scale, p.scale_log2 = a.scale * 1.4426950408889634f;
    }
    void check(const char *name)
    {
        auto got = fromb(ob);
        cmp(name, got.data(), ref.data(), (int64_t)T * nh, D, 1e-2, 0.9999);
    }
};

template <int D, int MT, int NW, int BN, bool QREG>
static void check_attn_varlen(dfl_be *cpu, const char *name)
{
    AttnBatch b(cpu, {0, 70, 100, 133}, 70, 4, 2, D);
    typedef AttnCfg<D, MT, NW, BN, QREG, 0> C;
    emu::launch(dim3(b.nseq * b.nh, (b.max_len + C::BM - 1) / C::BM), dim3(C::THREADS), C::SMEM,
                [&] { attn_fwd_bf16_kernel<D, MT, NW, BN, QREG, 0>(b.p); });
    b.check(name);
}

/* kernels/attn_wgmma.cu's kernel which (0: overlapped, 1: plain, both verified on an H200; 2:
 * warp-specialized and persistent, run on nb blocks so that each goes through several work
 * items, its mbarrier phases running on across them) against the CPU attention: sequences of
 * several query and key tiles, a partial last tile, GQA 2; and, after kernel 0, against its bits */
static std::vector<bf16> attn_wgmma_first;   /* kernel 0's output on the same inputs */
static void check_attn_wgmma(dfl_be *cpu, int which, unsigned nb, const char *name)
{
    rs = EMU_SEED ^ 0xA77Eull;   /* the same inputs for every kernel */
    AttnBatch b(cpu, {0, 300, 429, 469, 725}, 300, 4, 2, AW_D);
    const int64_t gx = (int64_t)b.nseq * b.nh, gy = (b.max_len + AW_BM - 1) / AW_BM;
    const AttnParams p = b.p;
    if (which == 2)
        emu::launch(dim3(nb), dim3(AW_WS_THREADS), AW_WS_SMEM, [&] { attn_fwd_ws_kernel(p, gx, gx * gy); });
    else
        emu::launch(dim3((unsigned)gx, (unsigned)gy), dim3(AW_THREADS), AW_SMEM,
                    [&] { which == 0 ? attn_fwd_wgmma_kernel<true>(p) : attn_fwd_wgmma_kernel<false>(p); });
    b.check(name);
    if (which == 0) {
        attn_wgmma_first = b.ob;
    } else if (!attn_wgmma_first.empty()) {   /* the same operations: the same bits */
        size_t diff = 0;
        for (size_t i = 0; i < b.ob.size(); i++)
            diff += memcmp(&b.ob[i], &attn_wgmma_first[i], sizeof(bf16)) != 0;
        printf("  %-78s %zu of %zu outputs differ from kernel 0's%s\n", name, diff, b.ob.size(), diff ? "  FAIL" : "");
        failures += diff != 0;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* DFlash */

struct Case {
    const char *name;
    int nh, nkv, d, bs, nseq;
    std::vector<int> lens, nanch;
    int mode;   /* 0 random sorted, 1 zero, 2 near the end, 3 unsorted, 4 dense */
    float qs;
    int window = 0;   /* sliding window (0: full attention) */
};

struct Batch {
    int64_t T = 0, Q = 0;
    int nb = 0;
    std::vector<int32_t> cs, an;
    std::vector<int> bseq;
};

static Batch make_batch(const Case &c)
{
    Batch b;
    int64_t start = 0;
    for (int s = 0; s < c.nseq; s++) {
        const int L = c.lens[s], n = c.nanch[s];
        std::vector<int32_t> a((size_t)n);
        for (int i = 0; i < n; i++)
            a[(size_t)i] = c.mode == 1 ? 0 : c.mode == 2 ? L - 1 - (i % 2) : c.mode == 4 ? i % (L - 1) : rint_(0, L - 2);
        if (c.mode == 0 || c.mode == 4)
            std::sort(a.begin(), a.end());
        for (int i = 0; i < n; i++) {
            b.cs.push_back((int32_t)start);
            b.an.push_back(a[(size_t)i]);
            b.bseq.push_back(s);
        }
        start += L;
    }
    b.T = start;
    b.nb = (int)b.cs.size();
    b.Q = (int64_t)b.nb * c.bs;
    return b;
}

static DfP base_params(const Case &c, const Batch &b)
{
    DfP p;
    memset(&p, 0, sizeof p);
    p.n_blocks = b.nb;
    p.bs = c.bs;
    p.nh = c.nh;
    p.nkv = c.nkv;
    p.group = c.nh / c.nkv;
    p.d = c.d;
    p.rb = p.group * c.bs;
    p.T_ctx = b.T;
    p.ldq = (int64_t)c.nh * c.d;
    p.ldk = (int64_t)c.nkv * c.d;
    p.scale = 1.0f / sqrtf((float)c.d);
    p.sl2 = p.scale * DF_LOG2E;
    p.cs = b.cs.data();
    p.an = b.an.data();
    p.window = c.window;
    return p;
}

template <int D, int MT, int NW, int BN, bool QREG>
static void run_fwd(DfP p)
{
    typedef FwdCfg<D, MT, NW, BN, QREG> C;
    p.nb = std::max(1, std::min(DF_NBMAX, C::MMAX / p.rb));
    p.n_bg = (p.n_blocks + p.nb - 1) / p.nb;
    emu::launch(dim3((unsigned)(p.n_bg * p.nkv)), dim3(C::THREADS), C::SMEM, [&] { df_fwd_kernel<D, MT, NW, BN, QREG>(p); });
}

template <int D, int NW, int BN, bool QREG, int ST = 2>
static void run_bwd_q(DfP p)
{
    typedef BwdQCfg<D, NW, BN, QREG, ST> C;
    p.nb = std::max(1, std::min(DF_NBMAX, C::MMAX / p.rb));
    p.n_bg = (p.n_blocks + p.nb - 1) / p.nb;
    emu::launch(dim3((unsigned)(p.n_bg * p.nkv)), dim3(C::THREADS), C::SMEM, [&] { df_bwd_q_kernel<D, NW, BN, QREG, ST>(p); });
}

template <int D, int NW, int QC, bool PIPE = false, bool SP = false>
static void run_bwd_kv(DfP p)
{
    typedef BwdKVCfg<D, NW, QC, PIPE, SP> C;
    p.n_kt = (int)((p.T_ctx + C::BNK - 1) / C::BNK);
    std::vector<int> sched((size_t)p.n_kt * 3);
    p.sched = sched.data();
    emu::launch(dim3(1), dim3(1024), 0, [&] { df_sched_kernel(p, sched.data(), C::BNK); });
    /* the order must be a permutation */
    std::vector<int> seen((size_t)p.n_kt, 0);
    for (int i = 0; i < p.n_kt; i++)
        if (sched[(size_t)i] < 0 || sched[(size_t)i] >= p.n_kt || seen[(size_t)sched[(size_t)i]]++) {
            fprintf(stderr, "    schedule is not a permutation at %d\n", i);
            failures++;
            return;
        }
    emu::launch(dim3((unsigned)(p.n_kt * p.nkv)), dim3(C::THREADS), C::SMEM, [&] { df_bwd_kv_kernel<D, NW, QC, PIPE, SP>(p); });
}

/* pass KV's wgmma kernel K (DW_BNK keys a CTA), after the schedule */
template <void (*K)(const DfP), size_t SMEM>
static void run_kv_wg(DfP p)
{
    p.n_kt = (int)((p.T_ctx + DW_BNK - 1) / DW_BNK);
    std::vector<int> sched((size_t)p.n_kt * 3);
    p.sched = sched.data();
    emu::launch(dim3(1), dim3(1024), 0, [&] { df_sched_kernel(p, sched.data(), DW_BNK); });
    emu::launch(dim3((unsigned)(p.n_kt * p.nkv)), dim3(DW_THREADS), SMEM, [&] { K(p); });
}

/* a kernel on the query-stationary CTAs of MMAX rows (forward, pass Q) */
template <void (*K)(const DfP), int MMAX, int THREADS, size_t SMEM>
static void run_qs(DfP p)
{
    p.nb = std::max(1, std::min(DF_NBMAX, MMAX / p.rb));
    p.n_bg = (p.n_blocks + p.nb - 1) / p.nb;
    emu::launch(dim3((unsigned)(p.n_bg * p.nkv)), dim3(THREADS), SMEM, [&] { K(p); });
}

/* The backward with dS kept (dflash_attn.cu: delta, the schedule, the plan of the slots, pass KV
 * writing dS, pass Q reading it), with ds as the backend sizes it from the host arrays; returns
 * false where the shape does not take it (blocks of other than DF_DS_ROWS rows a kv head) */
static bool run_ds_flow(DfP p, const std::vector<int32_t> &cs, const std::vector<int32_t> &an)
{
    if (p.rb != DF_DS_ROWS || p.d != DW_D)
        return false;
    int64_t slots = 0;
    for (size_t b = 0; b < cs.size(); b++) {
        int lo;
        slots += df_ds_tiles(p.window, cs[b], an[b], &lo) - lo;
    }
    std::vector<bf16> ds((size_t)(slots * p.nkv * DF_DS_KEYS * DF_DS_ROWS), __float2bfloat16_rn(NAN));
    std::vector<int4> blk(cs.size());
    int64_t total = -1;
    p.ds = ds.data();
    p.ds_cap = slots;
    p.ds_blk = blk.data();
    p.n_kt = (int)((p.T_ctx + DW_BNK - 1) / DW_BNK);
    std::vector<int> sched((size_t)p.n_kt * 3);
    p.sched = sched.data();
    const int64_t items = (int64_t)p.n_blocks * p.bs * p.nh;
    emu::launch(dim3((unsigned)((items + 7) / 8)), dim3(256), 0, [&] { df_delta_kernel<DW_D>(p); });
    emu::launch(dim3(1), dim3(1024), 0, [&] { df_sched_kernel(p, sched.data(), DW_BNK); });
    emu::launch(dim3(1), dim3(DF_PLAN_THREADS), 0, [&] { df_ds_plan_kernel(p, blk.data(), &total); });
    if (total != slots) {
        fprintf(stderr, "    dS kept: the plan lays out %lld slots, the host counts %lld\n", (long long)total,
                (long long)slots);
        failures++;
    }
    emu::launch(dim3((unsigned)(p.n_kt * p.nkv)), dim3(DW_THREADS), DW_SMEM(true), [&] { df_bwd_kv_wg_ds_kernel(p); });
    run_qs<df_bwd_q_wg_ds_kernel, DQW_MMAX, DQW_THREADS, DQW_DS_SMEM>(p);
    return true;
}

struct Variant {
    const char *name;
    void (*fn)(DfP);
    int mmax;   /* query rows per CTA (fwd, bwd-q): blocks of more rows take the exact kernels */
};

template <int D> struct Vars;
template <> struct Vars<32> {
    static std::vector<Variant> fwd() { return {{"fwd 4x32 BN64 Qreg", run_fwd<32, 2, 4, 64, true>, 16 * 2 * 4}, {"fwd 4x16 BN64", run_fwd<32, 1, 4, 64, true>, 16 * 1 * 4}}; }
    static std::vector<Variant> bq()
    {
        return {{"bwd-q 8w BN64 regs", run_bwd_q<32, 8, 64, true>, 16 * 8}, {"bwd-q 8w BN64 smem", run_bwd_q<32, 8, 64, false>, 16 * 8},
                {"bwd-q 4w BN64 regs", run_bwd_q<32, 4, 64, true>, 16 * 4}};
    }
    static std::vector<Variant> bkv() { return {{"bwd-kv 4w QC64", run_bwd_kv<32, 4, 64>, 1 << 30}, {"bwd-kv 8w QC64", run_bwd_kv<32, 8, 64>, 1 << 30}}; }
};
template <> struct Vars<64> {
    static std::vector<Variant> fwd() { return {{"fwd 4x32 BN64 Qreg", run_fwd<64, 2, 4, 64, true>, 16 * 2 * 4}, {"fwd 8x16 BN64", run_fwd<64, 1, 8, 64, true>, 16 * 1 * 8}}; }
    static std::vector<Variant> bq()
    {
        return {{"bwd-q 8w BN32 regs", run_bwd_q<64, 8, 32, true>, 16 * 8}, {"bwd-q 8w BN32 smem", run_bwd_q<64, 8, 32, false>, 16 * 8},
                {"bwd-q 4w BN32 regs", run_bwd_q<64, 4, 32, true>, 16 * 4}};
    }
    static std::vector<Variant> bkv() { return {{"bwd-kv 4w QC64", run_bwd_kv<64, 4, 64>, 1 << 30}, {"bwd-kv 8w QC64", run_bwd_kv<64, 8, 64>, 1 << 30}}; }
};
template <> struct Vars<128> {
    static std::vector<Variant> fwd()
    {
        return {{"fwd 4x32 BN32 Qsmem", run_fwd<128, 2, 4, 32, false>, 16 * 2 * 4}, {"fwd 8x16 BN64 Qreg", run_fwd<128, 1, 8, 64, true>, 16 * 1 * 8},
                {"fwd 4x16 BN64 Qreg", run_fwd<128, 1, 4, 64, true>, 16 * 1 * 4},
                {"fwd wgmma overlapped 3 stages", run_qs<df_fwd_wg_ovl3_kernel, DQW_MMAX, DQW_THREADS, DFW_SMEM(3, 64)>, DQW_MMAX},
                {"fwd wgmma overlapped 4 stages", run_qs<df_fwd_wg_ovl4_kernel, DQW_MMAX, DQW_THREADS, DFW_SMEM(4, 64)>, DQW_MMAX},
                {"fwd wgmma 3 stages", run_qs<df_fwd_wg_kernel, DQW_MMAX, DQW_THREADS, DFW_SMEM(3, 64)>, DQW_MMAX},
                {"fwd wgmma BN128 overlapped 3 stages", run_qs<df_fwd_wg128_ovl3_kernel, DQW_MMAX, DQW_THREADS, DFW_SMEM(3, 128)>, DQW_MMAX},
                {"fwd wgmma warp-specialized", run_qs<df_fwd_ws_kernel, DQW_MMAX, DFWS_THREADS, DFWS_SMEM>, DQW_MMAX}};
    }
    static std::vector<Variant> bq()
    {
        return {{"bwd-q 8w BN32 regs", run_bwd_q<128, 8, 32, true>, 16 * 8}, {"bwd-q 8w BN32 smem", run_bwd_q<128, 8, 32, false>, 16 * 8},
                {"bwd-q 4w BN32 regs", run_bwd_q<128, 4, 32, true>, 16 * 4},
                {"bwd-q 4w BN32 regs 3 stages", run_bwd_q<128, 4, 32, true, 3>, 16 * 4},
                {"bwd-q 8w BN32 regs 3 stages", run_bwd_q<128, 8, 32, true, 3>, 16 * 8},
                {"bwd-q wgmma 3 stages, pipelined", run_qs<df_bwd_q_wg3p_kernel, DQW_MMAX, DQW_THREADS, DQW_SMEM(3)>, DQW_MMAX},
                {"bwd-q wgmma 3 stages, pipelined, mbarriers", run_qs<df_bwd_q_wg3m_kernel, DQW_MMAX, DQW_THREADS, DQW_SMEM(3)>, DQW_MMAX},
                {"bwd-q wgmma 3 stages", run_qs<df_bwd_q_wg3_kernel, DQW_MMAX, DQW_THREADS, DQW_SMEM(3)>, DQW_MMAX},
                {"bwd-q wgmma 2 stages", run_qs<df_bwd_q_wg_kernel, DQW_MMAX, DQW_THREADS, DQW_SMEM(2)>, DQW_MMAX}};
    }
    static std::vector<Variant> bkv()
    {
        return {{"bwd-kv 4w QC64", run_bwd_kv<128, 4, 64>, 1 << 30}, {"bwd-kv 8w QC64", run_bwd_kv<128, 8, 64>, 1 << 30},
                {"bwd-kv 4w QC32", run_bwd_kv<128, 4, 32>, 1 << 30},
                {"bwd-kv 4w QC64 rows prefetched", run_bwd_kv<128, 4, 64, true>, 1 << 30},
                {"bwd-kv 8w QC64 rows prefetched", run_bwd_kv<128, 8, 64, true>, 1 << 30},
                {"bwd-kv 4w QC32 rows prefetched", run_bwd_kv<128, 4, 32, true>, 1 << 30},
                {"bwd-kv 8w QC64 rows prefetched, P via smem", run_bwd_kv<128, 8, 64, true, true>, 1 << 30},
                {"bwd-kv 4w QC64 rows prefetched, P via smem", run_bwd_kv<128, 4, 64, true, true>, 1 << 30},
                {"bwd-kv wgmma 3 stages", run_kv_wg<df_bwd_kv_wg_ovl_kernel, DW_SMEM(true)>, 1 << 30},
                {"bwd-kv wgmma 2 stages", run_kv_wg<df_bwd_kv_wg_kernel, DW_SMEM(false)>, 1 << 30}};
    }
};

template <int D>
static void run_case(dfl_be *cpu, const Case &c)
{
    Batch b = make_batch(c);
    const int64_t T = b.T, Q = b.Q, nq = (int64_t)c.nh * D, nk = (int64_t)c.nkv * D;
    printf("case %s: %d blocks, %lld context rows, bs %d, heads %d/%d, d %d, window %d\n", c.name, b.nb,
           (long long)T, c.bs, c.nh, c.nkv, D, c.window);
    auto q = rvec((size_t)(Q * nq), c.qs), kc = rvec((size_t)(T * nk), 1), vc = rvec((size_t)(T * nk), 1);
    auto kb = rvec((size_t)(Q * nk), 1), vb = rvec((size_t)(Q * nk), 1), dout = rvec((size_t)(Q * nq), 1);
    std::vector<float> o((size_t)(Q * nq)), lse((size_t)(Q * c.nh)), dq((size_t)(Q * nq)), dkc((size_t)(T * nk)),
        dvc((size_t)(T * nk)), dkb((size_t)(Q * nk)), dvb((size_t)(Q * nk)), delta((size_t)(Q * c.nh));
    dfl_dflash_attn a = {};
    a.q = q.data(), a.k_ctx = kc.data(), a.v_ctx = vc.data(), a.k_blk = kb.data(), a.v_blk = vb.data();
    a.o = o.data(), a.lse = lse.data(), a.ctx_start = b.cs.data(), a.anchor = b.an.data();
    a.n_blocks = b.nb, a.bs = c.bs, a.max_anchor = (int32_t)T, a.T_ctx = T, a.n_heads = c.nh, a.n_kv = c.nkv;
    a.window = c.window;
    a.d = D, a.scale = 1.0f / sqrtf((float)D), a.dout = dout.data(), a.delta = delta.data(), a.dq = dq.data();
    a.dk_ctx = dkc.data(), a.dv_ctx = dvc.data(), a.dk_blk = dkb.data(), a.dv_blk = dvb.data();
    cpu->ops->dflash_attn(cpu, &a);
    for (auto &x : o)
        x = rb(x);
    cpu->ops->dflash_attn_bwd(cpu, &a);

    /* sizes of the terms of each gradient row (as tests/gpu/gpu-train-ops.c df_cond) */
    std::vector<double> mdq((size_t)(Q * c.nh)), mdkc((size_t)(T * c.nkv)), mdvc((size_t)(T * c.nkv)),
        mdkb((size_t)(Q * c.nkv)), mdvb((size_t)(Q * c.nkv));
    {
        auto vn = [](const float *x) {
            double s2 = 0;
            for (int i = 0; i < D; i++)
                s2 += (double)x[i] * x[i];
            return sqrt(s2);
        };
        const int group = c.nh / c.nkv;
        for (int bl = 0; bl < b.nb; bl++)
            for (int hh = 0; hh < c.nh; hh++)
                for (int j = 0; j < c.bs; j++) {
                    const int64_t qr = (int64_t)bl * c.bs + j, g = hh / group;
                    const float *qv = &q[(size_t)(qr * nq + hh * D)], *dov = &dout[(size_t)(qr * nq + hh * D)];
                    const double L = lse[(size_t)(qr * c.nh + hh)], Dl = delta[(size_t)(qr * c.nh + hh)];
                    const double nqv = vn(qv), ndo = vn(dov);
                    for (int64_t t = 0; t < (int64_t)b.an[(size_t)bl] + c.bs; t++) {
                        const bool ctx = t < b.an[(size_t)bl];
                        if (c.window > 0 && (ctx ? t < (int64_t)b.an[(size_t)bl] + j - (c.window - 1)
                                                 : t - b.an[(size_t)bl] > j))
                            continue;   /* outside the sliding window */
                        const int64_t kr = ctx ? b.cs[(size_t)bl] + t : (int64_t)bl * c.bs + (t - b.an[(size_t)bl]);
                        const float *kv = &(ctx ? kc : kb)[(size_t)(kr * nk + g * D)], *vv = &(ctx ? vc : vb)[(size_t)(kr * nk + g * D)];
                        double sd = 0, pd = 0;
                        for (int i = 0; i < D; i++) {
                            sd += (double)qv[i] * kv[i];
                            pd += (double)dov[i] * vv[i];
                        }
                        const double P = exp(sd * a.scale - L), w = P * (fabs(pd) + fabs(Dl)) * a.scale;
                        mdq[(size_t)(qr * c.nh + hh)] += w * vn(kv);
                        (ctx ? mdkc : mdkb)[(size_t)(kr * c.nkv + g)] += w * nqv;
                        (ctx ? mdvc : mdvb)[(size_t)(kr * c.nkv + g)] += P * ndo;
                    }
                }
    }
    std::vector<double> mdelta((size_t)(Q * c.nh));   /* sum |dout o| */
    for (int64_t i = 0; i < Q * c.nh; i++)
        for (int j = 0; j < D; j++)
            mdelta[(size_t)i] += fabs((double)dout[(size_t)(i * D + j)] * o[(size_t)(i * D + j)]);
    auto qb = tobf(q), kcb = tobf(kc), vcb = tobf(vc), kbb = tobf(kb), vbb = tobf(vb), dob = tobf(dout), ob = tobf(o);
    auto qdesc = [&](int64_t r) {
        char s[160];
        int64_t qr = r / c.nh, bl = qr / c.bs;
        snprintf(s, sizeof s, "(block %lld slot %lld head %lld anchor %d)", (long long)bl, (long long)(qr % c.bs),
                 (long long)(r % c.nh), b.an[(size_t)bl]);
        return std::string(s);
    };
    auto kdesc = [&](int64_t r) {
        char s[160];
        snprintf(s, sizeof s, "(row %lld kv %lld)", (long long)(r / c.nkv), (long long)(r % c.nkv));
        return std::string(s);
    };
    DfP p0 = base_params(c, b);
    p0.q = qb.data(), p0.kc = kcb.data(), p0.vc = vcb.data(), p0.kb = kbb.data(), p0.vb = vbb.data();
    p0.dout = dob.data();
    const int rb = (c.nh / c.nkv) * c.bs;
    const bool rows_ok = rb <= 128;
    if (rows_ok)
        for (auto &v : Vars<D>::fwd()) {
            if (rb > v.mmax)
                continue;   /* the backend takes the exact kernels there */
            std::vector<bf16> og((size_t)(Q * nq), __float2bfloat16_rn(NAN));
            std::vector<float> lg((size_t)(Q * c.nh), NAN);
            DfP p = p0;
            p.o = og.data();
            p.lse = lg.data();
            v.fn(p);
            auto got = fromb(og);
            char w[200];
            snprintf(w, sizeof w, "%s: o [%s]", c.name, v.name);
            cmp(w, got.data(), o.data(), Q * c.nh, D, 1e-2, 0.9999, qdesc);
            snprintf(w, sizeof w, "%s: lse [%s]", c.name, v.name);
            cmp(w, lg.data(), lse.data(), Q * c.nh, 1, 1e-4, 0.0, qdesc);
        }
    /* backward: every pass-Q variant, then every pass-KV variant (with the delta of pass Q) */
    std::vector<float> delta_g((size_t)(Q * c.nh), NAN);
    if (rows_ok)
        for (auto &v : Vars<D>::bq()) {
            if (rb > v.mmax)
                continue;
            std::vector<bf16> dqg((size_t)(Q * nq), __float2bfloat16_rn(NAN)), dkbg((size_t)(Q * nk), __float2bfloat16_rn(NAN)),
                dvbg((size_t)(Q * nk), __float2bfloat16_rn(NAN));
            std::fill(delta_g.begin(), delta_g.end(), NAN);
            DfP p = p0;
            p.o_in = ob.data();
            p.lse = lse.data();
            p.delta = delta_g.data();
            p.dq = dqg.data();
            p.dkb = dkbg.data();
            p.dvb = dvbg.data();
            v.fn(p);
            char w[200];
            auto g1 = fromb(dqg), g2 = fromb(dkbg), g3 = fromb(dvbg);
            snprintf(w, sizeof w, "%s: dq [%s]", c.name, v.name);
            cmp(w, g1.data(), dq.data(), Q * c.nh, D, 3e-2, 0.9995, qdesc, mdq.data());
            snprintf(w, sizeof w, "%s: dk_blk [%s]", c.name, v.name);
            cmp(w, g2.data(), dkb.data(), Q * c.nkv, D, 3e-2, 0.9995, kdesc, mdkb.data());
            snprintf(w, sizeof w, "%s: dv_blk [%s]", c.name, v.name);
            cmp(w, g3.data(), dvb.data(), Q * c.nkv, D, 3e-2, 0.9995, kdesc, mdvb.data());
            if (getenv("EMU_DEBUG"))
                for (int r = 0; r < 4; r++) {
                    double hs = 0;
                    for (int j = 0; j < D; j++)
                        hs += (double)__bfloat162float(ob[(size_t)r * D + j]) * __bfloat162float(dob[(size_t)r * D + j]);
                    fprintf(stderr, "debug delta row %d: gpu %g cpu %g host %g\n", r, delta_g[(size_t)r], delta[(size_t)r], hs);
                }
            snprintf(w, sizeof w, "%s: delta [%s]", c.name, v.name);
            cmp(w, delta_g.data(), delta.data(), Q * c.nh, 1, 1e-3, 0.0, qdesc, mdelta.data());
        }
    else
        delta_g = delta;
    /* the exact f32 kernels (act F32 and odd shapes) on the same values, with the CPU's o */
    {
        std::vector<float> og((size_t)(Q * nq), NAN), lg((size_t)(Q * c.nh), NAN), dqg((size_t)(Q * nq), NAN),
            dkcg((size_t)(T * nk), NAN), dvcg((size_t)(T * nk), NAN), dkbg((size_t)(Q * nk), NAN),
            dvbg((size_t)(Q * nk), NAN), dg((size_t)(Q * c.nh), NAN);
        DfP p = base_params(c, b);
        p.q = q.data(), p.kc = kc.data(), p.vc = vc.data(), p.kb = kb.data(), p.vb = vb.data();
        p.dout = dout.data(), p.o = og.data(), p.lse = lg.data();
        auto grid = [](int64_t items) { return dim3((unsigned)((items + DS_WARPS - 1) / DS_WARPS)); };
        emu::launch(grid(Q * c.nh), dim3(DS_WARPS * 32), 0, [&] { ds_fwd_kernel<float, (D + 31) / 32>(p); });
        char w[200];
        snprintf(w, sizeof w, "%s: o [exact f32 kernel]", c.name);
        cmp(w, og.data(), o.data(), Q * c.nh, D, 4e-3, 0.99999, qdesc);   /* o was rounded to bf16 */
        snprintf(w, sizeof w, "%s: lse [exact f32 kernel]", c.name);
        cmp(w, lg.data(), lse.data(), Q * c.nh, 1, 2e-5, 0.0, qdesc);
        p.o_in = o.data(), p.lse = lse.data(), p.delta = dg.data(), p.dq = dqg.data();
        p.dkb = dkbg.data(), p.dvb = dvbg.data(), p.dkc = dkcg.data(), p.dvc = dvcg.data();
        emu::launch(grid(Q * c.nh), dim3(DS_WARPS * 32), 0, [&] { ds_bwd_q_kernel<float, (D + 31) / 32>(p); });
        emu::launch(grid(Q * c.nkv), dim3(DS_WARPS * 32), 0, [&] { ds_bwd_kvblk_kernel<float, (D + 31) / 32>(p); });
        emu::launch(grid(T * c.nkv), dim3(DS_WARPS * 32), 0, [&] { ds_bwd_kvctx_kernel<float, (D + 31) / 32>(p); });
        snprintf(w, sizeof w, "%s: dq [exact f32 kernel]", c.name);
        cmp(w, dqg.data(), dq.data(), Q * c.nh, D, 5e-5, 0.999999, qdesc, mdq.data());
        snprintf(w, sizeof w, "%s: dk_blk [exact f32 kernel]", c.name);
        cmp(w, dkbg.data(), dkb.data(), Q * c.nkv, D, 5e-5, 0.999999, kdesc, mdkb.data());
        snprintf(w, sizeof w, "%s: dv_blk [exact f32 kernel]", c.name);
        cmp(w, dvbg.data(), dvb.data(), Q * c.nkv, D, 5e-5, 0.999999, kdesc, mdvb.data());
        snprintf(w, sizeof w, "%s: dk_ctx [exact f32 kernel]", c.name);
        cmp(w, dkcg.data(), dkc.data(), T * c.nkv, D, 5e-5, 0.999999, kdesc, mdkc.data());
        snprintf(w, sizeof w, "%s: dv_ctx [exact f32 kernel]", c.name);
        cmp(w, dvcg.data(), dvc.data(), T * c.nkv, D, 5e-5, 0.999999, kdesc, mdvc.data());
        snprintf(w, sizeof w, "%s: delta [exact f32 kernel]", c.name);
        cmp(w, dg.data(), delta.data(), Q * c.nh, 1, 1e-4, 0.0, qdesc, mdelta.data());
    }
    for (auto &v : Vars<D>::bkv()) {
        std::vector<bf16> dkg((size_t)(T * nk), __float2bfloat16_rn(NAN)), dvg((size_t)(T * nk), __float2bfloat16_rn(NAN));
        DfP p = p0;
        p.lse = lse.data();
        p.delta = delta.data();   /* the CPU's: isolates pass KV */
        p.dkc = dkg.data();
        p.dvc = dvg.data();
        v.fn(p);
        char w[200];
        auto g1 = fromb(dkg), g2 = fromb(dvg);
        snprintf(w, sizeof w, "%s: dk_ctx [%s]", c.name, v.name);
        cmp(w, g1.data(), dkc.data(), T * c.nkv, D, 3e-2, 0.9995, kdesc, mdkc.data());
        snprintf(w, sizeof w, "%s: dv_ctx [%s]", c.name, v.name);
        cmp(w, g2.data(), dvc.data(), T * c.nkv, D, 3e-2, 0.9995, kdesc, mdvc.data());
    }
    /* the backward with dS kept: every output of both passes (delta its own) */
    {
        const bf16 nanb = __float2bfloat16_rn(NAN);
        std::vector<bf16> dqg((size_t)(Q * nq), nanb), dkbg((size_t)(Q * nk), nanb), dvbg((size_t)(Q * nk), nanb),
            dkcg((size_t)(T * nk), nanb), dvcg((size_t)(T * nk), nanb);
        std::vector<float> dg((size_t)(Q * c.nh), NAN);
        DfP p = p0;
        p.o_in = ob.data();
        p.lse = lse.data();
        p.delta = dg.data();
        p.dq = dqg.data(), p.dkb = dkbg.data(), p.dvb = dvbg.data(), p.dkc = dkcg.data(), p.dvc = dvcg.data();
        if (run_ds_flow(p, b.cs, b.an)) {
            const char *v = "bwd dS kept";
            char w[200];
            auto g1 = fromb(dqg), g2 = fromb(dkbg), g3 = fromb(dvbg), g4 = fromb(dkcg), g5 = fromb(dvcg);
            snprintf(w, sizeof w, "%s: dq [%s]", c.name, v);
            cmp(w, g1.data(), dq.data(), Q * c.nh, D, 3e-2, 0.9995, qdesc, mdq.data());
            snprintf(w, sizeof w, "%s: dk_blk [%s]", c.name, v);
            cmp(w, g2.data(), dkb.data(), Q * c.nkv, D, 3e-2, 0.9995, kdesc, mdkb.data());
            snprintf(w, sizeof w, "%s: dv_blk [%s]", c.name, v);
            cmp(w, g3.data(), dvb.data(), Q * c.nkv, D, 3e-2, 0.9995, kdesc, mdvb.data());
            snprintf(w, sizeof w, "%s: dk_ctx [%s]", c.name, v);
            cmp(w, g4.data(), dkc.data(), T * c.nkv, D, 3e-2, 0.9995, kdesc, mdkc.data());
            snprintf(w, sizeof w, "%s: dv_ctx [%s]", c.name, v);
            cmp(w, g5.data(), dvc.data(), T * c.nkv, D, 3e-2, 0.9995, kdesc, mdvc.data());
            snprintf(w, sizeof w, "%s: delta [%s]", c.name, v);
            cmp(w, dg.data(), delta.data(), Q * c.nh, 1, 1e-3, 0.0, qdesc, mdelta.data());
        }
    }
}

int main(int argc, char **argv)
{
    dfl_be *cpu = nullptr;
    dfl_err e = {};
    if (dfl_be_cpu_open(&cpu, 1, &e)) {
        fprintf(stderr, "cpu backend: %s\n", e.msg);
        return 1;
    }
    bool quick = false;
    const char *only = nullptr;   /* --only SUBSTRING: the cases whose name contains it */
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            quick = true;
        else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc)
            only = argv[++i];
    }
    setvbuf(stdout, nullptr, _IOLBF, 0);
    /* the target's attention kernels (--only attn: these alone) */
    auto want_t = [&](const char *name) { return !only || strstr(name, only); };
    if (want_t("attn_varlen"))
        printf("emulator check: kernels/attn.cu's forward against the CPU attention\n");
    if (want_t("attn_varlen d128"))
        check_attn_varlen<128, 2, 4, 32, false>(cpu, "attn_varlen d128 BM128 BN32 Q smem");
    if (want_t("attn_varlen d64"))
        check_attn_varlen<64, 2, 4, 64, true>(cpu, "attn_varlen d64 BM128 BN64 Q regs");
    if (want_t("attn_wgmma kernel 0"))
        check_attn_wgmma(cpu, 0, 0, "attn_wgmma kernel 0 (overlapped)");
    if (want_t("attn_wgmma kernel 2"))
        check_attn_wgmma(cpu, 2, 3, "attn_wgmma kernel 2 (warp-specialized, 3 blocks)");
    if (want_t("attn_wgmma kernel 2 many"))
        check_attn_wgmma(cpu, 2, 60, "attn_wgmma kernel 2 many (warp-specialized, more blocks than items)");
    if (failures) {
        printf("the emulator does not reproduce kernels/attn.cu: its PTX semantics are wrong\n");
        return 1;
    }
    std::vector<Case> c32 = {
        {"golden shape", 8, 4, 32, 8, 3, {40, 97, 61}, {13, 29, 14}, 0, 1},
        {"dense anchors, many blocks", 8, 2, 32, 8, 1, {150}, {100}, 4, 1},
        {"golden shape, window 24", 8, 4, 32, 8, 3, {40, 97, 61}, {13, 29, 14}, 0, 1, 24},
    };
    std::vector<Case> c64 = {
        {"one block, anchor 0", 2, 2, 64, 8, 1, {20}, {1}, 1, 1},
        {"GQA 1", 4, 4, 64, 8, 3, {130, 64, 65}, {10, 5, 6}, 0, 1},
        {"unsorted anchors, a sequence without blocks", 8, 2, 64, 8, 3, {150, 30, 90}, {12, 0, 9}, 3, 1},
        {"window 5 (< bs), unsorted", 8, 2, 64, 8, 3, {150, 30, 90}, {12, 0, 9}, 3, 1, 5},
        {"window 70, dense anchors", 4, 2, 64, 8, 1, {300}, {120}, 4, 1, 70},
    };
    std::vector<Case> c128 = {
        {"no context (anchors 0)", 4, 2, 128, 16, 2, {50, 30}, {3, 2}, 1, 1},
        {"27B drafter heads, window 96", 32, 8, 128, 16, 2, {300, 170}, {8, 5}, 0, 1, 96},
        {"8B heads", 32, 8, 128, 16, 2, {100, 70}, {6, 4}, 0, 1},
        {"anchors near the end", 8, 2, 128, 16, 2, {129, 64}, {3, 3}, 2, 1},
        {"unsorted anchors, GQA 4, bs 16", 8, 2, 128, 16, 2, {300, 170}, {7, 5}, 3, 1},
        {"anchors 0, GQA 4, bs 16: dS kept without context tiles", 8, 2, 128, 16, 2, {50, 30}, {3, 2}, 1, 1},
        {"bs 4, GQA 4", 8, 2, 128, 4, 2, {140, 77}, {20, 9}, 0, 1},
        {"bs 32, GQA 4", 8, 2, 128, 32, 1, {100}, {4}, 0, 1},
        {"bs 32, GQA 8: exact kernels for fwd/bwd-q", 8, 1, 128, 32, 1, {90}, {3}, 0, 1},
        {"large scores", 8, 2, 128, 16, 1, {97}, {5}, 0, 8},
        /* more key tiles a CTA than any kernel has stages: every ring wraps, and a loading warp
         * runs ahead until a stage comes back */
        {"long context, the stages wrap", 8, 2, 128, 16, 1, {700}, {6}, 0, 1},
    };
    auto want = [&](const Case &c) { return !only || strstr(c.name, only); };
    for (auto &c : c32)
        if (want(c))
            run_case<32>(cpu, c);
    for (auto &c : c64)
        if (want(c))
            run_case<64>(cpu, c);
    for (size_t i = 0; i < c128.size() && !(quick && i > 1); i++)
        if (want(c128[i]))
            run_case<128>(cpu, c128[i]);
    printf(failures ? "FAILED: %d comparisons\n" : "all comparisons passed\n", failures);
    dfl_be_close(cpu);
    return failures ? 1 : 0;
}
