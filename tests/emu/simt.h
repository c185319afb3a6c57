/* simt.h: a small SIMT emulator that runs CUDA kernel code on the CPU, for checking the index
 * arithmetic of the tensor-core kernels on a machine without a GPU (tests/emu/README). One CTA
 * at a time; every CUDA thread is a fiber (ucontext) that runs until it reaches a barrier or a
 * warp-collective operation (the fibers in turn, or on a random schedule: EMU_SCHED, sched_seed
 * below). Emulated: __syncthreads(_or/_and), __syncwarp, __shfl_xor_sync,
 * __shfl_sync, __shfl_up_sync, __any_sync, __all_sync, __ballot_sync, __popc, atomicAdd (int),
 * threadIdx/blockIdx/blockDim/gridDim, __shared__ variables (function statics: one CTA runs at
 * a time), dynamic shared memory, and the PTX helpers of kernels/dflash_ptx.cuh:
 * cp.async (landing at the issuing thread's wait for its group, or at its cp.async mbarrier
 * arrival: as late as the GPU may; see emu_cp),
 * mbarriers (tests/emu/wgmma.h: a waiting thread polls, letting the others run), ldmatrix .x4 (.trans), mma.sync
 * m16n8k16 bf16 -> f32 (float sums in k order) and ex2.approx (exp2f), built from the fragment
 * layouts of the PTX ISA, independently of how the kernels use them. Shared-memory addresses are
 * offsets into the CTA's dynamic buffer and are bounds-checked; a warp whose lanes reach
 * different collectives, or a barrier some threads never reach, aborts with a message.
 *
 * Not emulated: timing, the asynchrony of wgmma (a read of an accumulator before its wait goes
 * unnoticed), bank conflicts, register limits. */
#ifndef DFL_SIMT_H
#define DFL_SIMT_H

#include <cuda_bf16.h>
#include <vector_types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <ucontext.h>
#include <vector>

#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)
#define __trap() emu::die("trap")
#ifndef __forceinline__
#define __forceinline__ inline
#endif

using std::max;
using std::min;

/* Fiber switch: on x86-64 a few instructions saving the callee-saved registers (glibc's
 * swapcontext also saves the signal mask with a system call, 100 times slower); elsewhere
 * ucontext. */
#if defined(__x86_64__)
extern "C" void emu_switch(void **save_sp, void *new_sp);
asm(R"(
    .text
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");
#define EMU_FAST_SWITCH 1
#endif

namespace emu {

/* a cp.async in flight: its bytes (read at issue), where they land, its commit group */
struct CpPending {
    uint32_t dst;
    unsigned n;
    int group;
    unsigned char data[16];
};

struct Fiber {
    ucontext_t ctx;
    void *sp;
    uint3 tid;
    int lin;          /* linear thread index */
    bool done;
    int wait;         /* 0 runnable, 1 block barrier, 2 warp collective */
    std::vector<CpPending> cp;   /* this thread's cp.async not yet landed */
    int group = 0;    /* the open (uncommitted) group's number; groups below it are committed */
};

struct WarpSlot {
    int arrived = 0;
    int op = -1;
    unsigned char in[32][96];
    unsigned char out[32][96];
};

struct Cta {
    std::vector<Fiber> f;
    ucontext_t main;
    void *main_sp;
    int cur = 0, live = 0;
    std::vector<unsigned char> smem;
    int bar_arrived = 0, bar_mode = 0, bar_acc = 0, bar_result = 0;
    std::vector<WarpSlot> warps;
    uint3 bidx;
    dim3 bdim, gdim;
    std::function<void()> body;
};

inline Cta *&cta()
{
    static Cta *c = nullptr;
    return c;
}

/* the thread running now */
inline Fiber &cur_fiber() { return cta()->f[(size_t)cta()->cur]; }

/* fiber stacks, reused by every CTA. Under AddressSanitizer (tests/emu/run with EMU_SANITIZE=1)
 * a stack's shadow still holds the redzones of the frames of the fiber that last ran on it:
 * cleared before the stack is handed out again. */
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif
inline char *stack_of(int t, size_t bytes)
{
    static std::vector<char *> st;
    while ((int)st.size() <= t)
        st.push_back((char *)malloc(bytes));
#if defined(__SANITIZE_ADDRESS__)
    __asan_unpoison_memory_region(st[(size_t)t], bytes);
#endif
    return st[(size_t)t];
}

[[noreturn]] inline void die(const char *msg)
{
    Cta *c = cta();
    fprintf(stderr, "simt: %s (block %u,%u thread %d)\n", msg, c ? c->bidx.x : 0, c ? c->bidx.y : 0,
            c ? c->cur : -1);
    abort();
}

inline long &spins()   /* spin() calls since a fiber last stopped for anything else */
{
    static long n = 0;
    return n;
}

/* the running fiber hands the CPU back to the scheduler */
inline void to_scheduler()
{
    Cta *c = cta();
#ifdef EMU_FAST_SWITCH
    emu_switch(&c->f[c->cur].sp, c->main_sp);
#else
    swapcontext(&c->f[c->cur].ctx, &c->main);
#endif
}

inline void yield()
{
    spins() = 0;
    to_scheduler();
}

/* A thread polling for a condition that other threads will make true (an mbarrier's phase):
 * it stays runnable and lets the others run. Only polling threads left, for long: a deadlock. */
inline void spin()
{
    if (++spins() > 100000000L)
        die("deadlock: every live thread polls an mbarrier that no thread will complete");
    to_scheduler();
}

inline void cp_land(Fiber &f, int below);

inline void trampoline()
{
    Cta *c = cta();
    c->body();
    cp_land(cur_fiber(), 1 << 30);   /* what is still in flight lands before the block ends */
    cur_fiber().done = true;
    c->live--;
    /* a barrier may now be complete without this thread */
    if (c->live > 0 && c->bar_arrived > 0 && c->bar_arrived == c->live) {
        c->bar_result = c->bar_acc;
        for (auto &x : c->f)
            if (x.wait == 1)
                x.wait = 0;
        c->bar_arrived = 0;
    }
    yield();
    abort();   /* a finished fiber is never resumed */
}

/* Block barrier; mode 0 plain, 1 or, 2 and. */
inline int sync_block(int pred, int mode)
{
    Cta *c = cta();
    if (c->bar_arrived == 0) {
        c->bar_mode = mode;
        c->bar_acc = mode == 2 ? 1 : 0;
    } else if (c->bar_mode != mode) {
        die("threads of a block reached different kinds of barrier");
    }
    if (mode == 1)
        c->bar_acc |= pred != 0;
    else if (mode == 2)
        c->bar_acc &= pred != 0;
    c->bar_arrived++;
    if (c->bar_arrived == c->live) {
        c->bar_result = c->bar_acc;
        for (auto &x : c->f)
            if (x.wait == 1)
                x.wait = 0;
        c->bar_arrived = 0;
        return c->bar_result;
    }
    c->f[c->cur].wait = 1;
    yield();
    return c->bar_result;
}

/* Warp collective: every lane deposits `in`; the last one to arrive runs fn(in, out) for all
 * lanes; each lane gets its `out`. op identifies the operation (all lanes must agree). */
template <class F>
inline void warp_op(int op, const void *in, size_t insz, void *out, size_t outsz, F fn)
{
    Cta *c = cta();
    const int lin = c->cur, w = lin / 32, lane = lin % 32;
    WarpSlot &s = c->warps[w];
    int lanes = std::min(32, (int)(c->bdim.x * c->bdim.y * c->bdim.z) - w * 32);
    if (s.arrived == 0)
        s.op = op;
    else if (s.op != op)
        die("lanes of a warp reached different collective operations");
    if (insz)   /* a collective without data (__syncwarp) passes no buffer */
        memcpy(s.in[lane], in, insz);
    s.arrived++;
    if (s.arrived == lanes) {
        fn(s.in, s.out, lanes);
        s.arrived = 0;
        for (int l = 0; l < lanes; l++)
            if (c->f[w * 32 + l].wait == 2)
                c->f[w * 32 + l].wait = 0;
    } else {
        c->f[lin].wait = 2;
        yield();
    }
    if (out)
        memcpy(out, s.out[lane], outsz);
}

/* EMU_SCHED=N (N > 0) in the environment: a random schedule (seed N) instead of round robin.
 * Each CTA gives each warp a speed from 1/8 to 1; in each pass of the scheduler a warp's threads
 * run with that probability, so that warps drift apart as they may on a GPU: a missing wait of
 * one warp for another (an mbarrier not waited on) then shows up as a wrong result or a
 * deadlock, which round robin, keeping the warps in step, can hide. Unset or 0: round robin. */
inline uint64_t sched_seed()
{
    static const uint64_t s = [] {
        const char *e = getenv("EMU_SCHED");
        return e ? (uint64_t)strtoull(e, nullptr, 10) : 0ull;
    }();
    return s;
}

/* Run kernel body() for every block of grid with `block` threads and `dyn` bytes of dynamic
 * shared memory. */
inline void launch(dim3 grid, dim3 block, size_t dyn, const std::function<void()> &body)
{
    const int nt = (int)(block.x * block.y * block.z);
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                Cta c;
                cta() = &c;
                c.bidx = make_uint3(bx, by, bz);
                c.bdim = block;
                c.gdim = grid;
                c.body = body;
                c.smem.assign(dyn + 16, 0xCD);   /* garbage, like real shared memory */
                c.warps.resize((size_t)(nt + 31) / 32);
                c.f.resize((size_t)nt);
                c.live = nt;
                for (int t = 0; t < nt; t++) {
                    Fiber &f = c.f[(size_t)t];
                    const size_t ss = 256 * 1024;
                    f.lin = t;
                    f.tid = make_uint3((unsigned)(t % (int)block.x), (unsigned)((t / (int)block.x) % (int)block.y),
                                       (unsigned)(t / (int)(block.x * block.y)));
                    f.done = false;
                    f.wait = 0;
#ifdef EMU_FAST_SWITCH
                    /* a stack that "returns" into trampoline: six saved registers, then its
                     * address, 16-byte aligned as after a call */
                    uintptr_t top = ((uintptr_t)stack_of(t, ss) + ss) & ~(uintptr_t)15;
                    void **sp = (void **)(top - 64);
                    for (int i = 0; i < 6; i++)
                        sp[i] = nullptr;
                    sp[6] = (void *)trampoline;
                    sp[7] = nullptr;
                    f.sp = sp;
#else
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = stack_of(t, ss);
                    f.ctx.uc_stack.ss_size = ss;
                    f.ctx.uc_link = nullptr;
                    makecontext(&f.ctx, trampoline, 0);
#endif
                }
                const uint64_t seed = sched_seed();
                std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + ((uint64_t)bz << 42) + ((uint64_t)by << 21) + bx);
                std::uniform_real_distribution<double> u01(0.0, 1.0);
                std::vector<double> speed(c.warps.size(), 1.0);
                std::vector<char> go(c.warps.size(), 1);
                if (seed)
                    for (auto &x : speed)
                        x = 0.125 + 0.875 * u01(rng);
                for (;;) {
                    bool any = false, alive = false;
                    if (seed)
                        for (size_t w = 0; w < go.size(); w++)
                            go[w] = u01(rng) < speed[w];
                    for (int t = 0; t < nt; t++) {
                        Fiber &f = c.f[(size_t)t];
                        if (f.done)
                            continue;
                        alive = true;
                        if (f.wait)
                            continue;
                        any = true;
                        if (!go[(size_t)t / 32])
                            continue;   /* runnable, but its warp sits this pass out */
                        c.cur = t;
#ifdef EMU_FAST_SWITCH
                        emu_switch(&c.main_sp, f.sp);
#else
                        swapcontext(&c.main, &f.ctx);
#endif
                    }
                    if (!alive)
                        break;
                    if (!any) {
                        c.cur = -1;
                        die("deadlock: every live thread waits, at a barrier or a warp collective that "
                            "some threads do not reach");
                    }
                }
                cta() = nullptr;
            }
}

inline uint3 thread_idx() { return cur_fiber().tid; }

/* __shared__ variables are function statics here (one CTA runs at a time), outside the dynamic
 * shared memory: df_smem gives them shared addresses with the top bit set, the rest their signed
 * distance from this anchor in the same image (aligned, so that an address's alignment is its
 * distance's), for cp.async into them (pass KV's row tables) */
alignas(1024) inline unsigned char static_anchor[1024];
constexpr uint32_t STATIC_SMEM = 0x80000000u;

inline unsigned char *smem_at(uint32_t off, size_t n)
{
    if (off & STATIC_SMEM)
        return static_anchor + ((int32_t)(off << 1) >> 1);   /* the sign-extended 31-bit distance */
    Cta *c = cta();
    if ((size_t)off + n > c->smem.size() - 16)
        die("shared memory access out of bounds");
    return c->smem.data() + off;
}

} /* namespace emu */

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::cta()->bidx)
#define blockDim (emu::cta()->bdim)
#define gridDim (emu::cta()->gdim)

inline void __syncthreads() { emu::sync_block(0, 0); }
inline int __syncthreads_or(int p) { return emu::sync_block(p, 1); }
inline int __syncthreads_and(int p) { return emu::sync_block(p, 2); }
inline void __syncwarp(unsigned = 0xffffffffu)
{
    emu::warp_op(1, nullptr, 0, nullptr, 0, [](auto &, auto &, int) {});
}

template <class T> inline T __shfl_xor_sync(unsigned, T v, int o)
{
    static_assert(sizeof(T) <= 8, "shfl");
    T r;
    emu::warp_op(2, &v, sizeof v, &r, sizeof r, [o](auto &in, auto &out, int lanes) {
        for (int l = 0; l < lanes; l++)
            memcpy(out[l], in[(l ^ o) < lanes ? (l ^ o) : l], sizeof(T));
    });
    return r;
}

template <class T> inline T __shfl_sync(unsigned, T v, int src)
{
    static_assert(sizeof(T) <= 8, "shfl");
    T r;
    emu::warp_op(4, &v, sizeof v, &r, sizeof r, [src](auto &in, auto &out, int lanes) {
        for (int l = 0; l < lanes; l++)
            memcpy(out[l], in[src & 31], sizeof(T));
    });
    return r;
}

template <class T> inline T __shfl_up_sync(unsigned, T v, int d)
{
    static_assert(sizeof(T) <= 8, "shfl");
    T r;
    emu::warp_op(5, &v, sizeof v, &r, sizeof r, [d](auto &in, auto &out, int lanes) {
        for (int l = 0; l < lanes; l++)
            memcpy(out[l], in[l >= d ? l - d : l], sizeof(T));
    });
    return r;
}

namespace emu {
/* a warp vote: every lane gets the lanes' predicates folded with `any` (or) or not (and) */
inline bool vote(int op, int pred, bool any)
{
    int p = pred != 0, r;
    warp_op(op, &p, sizeof p, &r, sizeof r, [any](auto &in, auto &out, int lanes) {
        int a = any ? 0 : 1;
        for (int l = 0; l < lanes; l++) {
            int x;
            memcpy(&x, in[l], sizeof x);
            a = any ? (a | x) : (a & x);
        }
        for (int l = 0; l < lanes; l++)
            memcpy(out[l], &a, sizeof a);
    });
    return r != 0;
}
} /* namespace emu */

inline bool __any_sync(unsigned, int pred) { return emu::vote(3, pred, true); }
inline bool __all_sync(unsigned, int pred) { return emu::vote(8, pred, false); }

inline unsigned __ballot_sync(unsigned, int pred)
{
    int p = pred != 0;
    unsigned r;
    emu::warp_op(7, &p, sizeof p, &r, sizeof r, [](auto &in, auto &out, int lanes) {
        unsigned b = 0;
        for (int l = 0; l < lanes; l++) {
            int x;
            memcpy(&x, in[l], sizeof x);
            b |= (unsigned)(x != 0) << l;
        }
        for (int l = 0; l < lanes; l++)
            memcpy(out[l], &b, sizeof b);
    });
    return r;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }

/* one CTA runs at a time and its threads are fibers that switch only at collectives: a plain
 * read-modify-write is atomic */
inline int atomicAdd(int *p, int v)
{
    const int old = *p;
    *p = old + v;
    return old;
}

/* ---- the PTX helpers of kernels/dflash_ptx.cuh ---- */

#define DF_DYN_SMEM(name) unsigned char *name = emu::cta()->smem.data()

inline uint32_t df_smem(const void *p)
{
    const unsigned char *b = emu::cta()->smem.data();
    const unsigned char *q = (const unsigned char *)p;
    if (q >= b && q <= b + emu::cta()->smem.size())
        return (uint32_t)(q - b);
    /* a __shared__ variable (a function static): see emu::smem_at */
    const ptrdiff_t d = q - emu::static_anchor;
    if (d < -((ptrdiff_t)1 << 30) || d >= ((ptrdiff_t)1 << 30))
        emu::die("df_smem of a pointer outside shared memory");
    return emu::STATIC_SMEM | ((uint32_t)d & 0x7FFFFFFFu);
}

/* cp.async of n bytes (16 or 4): destination and source n-byte aligned; zero-filled when !ok.
 * Asynchronous as on the GPU, at its latest: the source is read at issue, but the bytes land in
 * shared memory only when the issuing thread waits for their group (df_wait), arrives on an
 * mbarrier through cp.async.mbarrier.arrive (everything it issued), or ends. A read of the stage
 * before that (a missing wait, or a barrier that does not follow every loading thread's wait)
 * sees the old bytes. */
inline void emu_cp(uint32_t dst, const void *src, bool ok, unsigned n)
{
    emu::smem_at(dst, n);   /* bounds */
    if (dst % n)
        emu::die("cp.async destination not aligned to its size");
    emu::Fiber &f = emu::cur_fiber();
    emu::CpPending c;
    c.dst = dst;
    c.n = n;
    c.group = f.group;
    if (ok) {
        if ((uintptr_t)src % n)
            emu::die("cp.async source not aligned to its size");
        memcpy(c.data, src, n);
    } else {
        memset(c.data, 0, n);
    }
    f.cp.push_back(c);
}
namespace emu {
/* the thread's cp.async of the groups below group `below` land, in issue order */
inline void cp_land(Fiber &f, int below)
{
    size_t k = 0;
    for (size_t i = 0; i < f.cp.size(); i++) {
        if (f.cp[i].group < below)
            memcpy(smem_at(f.cp[i].dst, f.cp[i].n), f.cp[i].data, f.cp[i].n);
        else
            f.cp[k++] = f.cp[i];
    }
    f.cp.resize(k);
}
} /* namespace emu */
inline void df_cp16(uint32_t dst, const void *src, bool ok) { emu_cp(dst, src, ok, 16); }
inline void df_cp4(uint32_t dst, const void *src, bool ok) { emu_cp(dst, src, ok, 4); }
inline void df_commit() { emu::cur_fiber().group++; }
/* every committed group but the N most recent lands (uncommitted ones do not) */
template <int N> inline void df_wait()
{
    emu::Fiber &f = emu::cur_fiber();
    emu::cp_land(f, f.group - N);
}

/* ldmatrix .x4: lane 8i + r gives the address of row r of matrix i; lane l receives, of matrix
 * i, the two elements at (row l/4, cols 2 (l%4), +1) (.trans: (rows 2 (l%4), +1, col l/4)). */
inline void df_ldm_impl(uint32_t (&r)[4], uint32_t addr, bool trans)
{
    uint32_t out[4];
    emu::warp_op(trans ? 5 : 4, &addr, sizeof addr, out, sizeof out, [trans](auto &in, auto &o, int lanes) {
        if (lanes != 32)
            emu::die("ldmatrix with a partial warp");
        uint32_t a[32];
        for (int l = 0; l < 32; l++) {
            memcpy(&a[l], in[l], 4);
            if (a[l] % 16)
                emu::die("ldmatrix row address not 16-byte aligned");
            emu::smem_at(a[l], 16);
        }
        for (int l = 0; l < 32; l++) {
            uint32_t v[4];
            for (int i = 0; i < 4; i++) {
                uint16_t lo, hi;
                if (!trans) {
                    const unsigned char *row = emu::smem_at(a[8 * i + l / 4], 16);
                    memcpy(&lo, row + 4 * (l % 4), 2);
                    memcpy(&hi, row + 4 * (l % 4) + 2, 2);
                } else {
                    const unsigned char *r0 = emu::smem_at(a[8 * i + 2 * (l % 4)], 16);
                    const unsigned char *r1 = emu::smem_at(a[8 * i + 2 * (l % 4) + 1], 16);
                    memcpy(&lo, r0 + 2 * (l / 4), 2);
                    memcpy(&hi, r1 + 2 * (l / 4), 2);
                }
                v[i] = (uint32_t)lo | ((uint32_t)hi << 16);
            }
            memcpy(o[l], v, sizeof v);
        }
    });
    memcpy(r, out, sizeof out);
}
inline void df_ldm(uint32_t (&r)[4], uint32_t addr) { df_ldm_impl(r, addr, false); }
inline void df_ldm_t(uint32_t (&r)[4], uint32_t addr) { df_ldm_impl(r, addr, true); }

inline float emu_bf(uint32_t v, int hi)
{
    uint16_t h = (uint16_t)(hi ? v >> 16 : v & 0xFFFF);
    uint32_t f = (uint32_t)h << 16;
    float x;
    memcpy(&x, &f, 4);
    return x;
}

/* mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32, fragments as in the PTX ISA (g = lane/4,
 * t = lane%4): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..);
 * b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g); c0, c1 (g, 2t / 2t+1), c2, c3 (g+8, 2t / 2t+1). */
inline void df_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
    struct In {
        uint32_t a[4], b[2];
        float c[4];
    } in;
    memcpy(in.a, a, sizeof in.a);
    in.b[0] = b0;
    in.b[1] = b1;
    memcpy(in.c, c, sizeof in.c);
    float out[4];
    emu::warp_op(6, &in, sizeof in, out, sizeof out, [](auto &ins, auto &o, int lanes) {
        if (lanes != 32)
            emu::die("mma with a partial warp");
        float A[16][16], B[16][8], C[16][8];
        for (int l = 0; l < 32; l++) {
            In x;
            memcpy(&x, ins[l], sizeof x);
            int g = l / 4, t = l % 4;
            A[g][2 * t] = emu_bf(x.a[0], 0);
            A[g][2 * t + 1] = emu_bf(x.a[0], 1);
            A[g + 8][2 * t] = emu_bf(x.a[1], 0);
            A[g + 8][2 * t + 1] = emu_bf(x.a[1], 1);
            A[g][2 * t + 8] = emu_bf(x.a[2], 0);
            A[g][2 * t + 9] = emu_bf(x.a[2], 1);
            A[g + 8][2 * t + 8] = emu_bf(x.a[3], 0);
            A[g + 8][2 * t + 9] = emu_bf(x.a[3], 1);
            B[2 * t][g] = emu_bf(x.b[0], 0);
            B[2 * t + 1][g] = emu_bf(x.b[0], 1);
            B[2 * t + 8][g] = emu_bf(x.b[1], 0);
            B[2 * t + 9][g] = emu_bf(x.b[1], 1);
            C[g][2 * t] = x.c[0];
            C[g][2 * t + 1] = x.c[1];
            C[g + 8][2 * t] = x.c[2];
            C[g + 8][2 * t + 1] = x.c[3];
        }
        for (int l = 0; l < 32; l++) {
            int g = l / 4, t = l % 4;
            float d[4];
            const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
            for (int e = 0; e < 4; e++) {
                float s = C[rows[e]][cols[e]];
                for (int k = 0; k < 16; k++)
                    s += A[rows[e]][k] * B[k][cols[e]];
                d[e] = s;
            }
            memcpy(o[l], d, sizeof d);
        }
    });
    memcpy(c, out, sizeof out);
}

inline float df_exp2(float x) { return exp2f(x); }

/* the bf16 in the low / high half of a 32-bit word, as f32 */
inline float df_bf_lo(uint32_t w)
{
    uint32_t f = w << 16;
    float x;
    memcpy(&x, &f, 4);
    return x;
}
inline float df_bf_hi(uint32_t w)
{
    uint32_t f = w & 0xFFFF0000u;
    float x;
    memcpy(&x, &f, 4);
    return x;
}

inline uint32_t df_pack(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    uint32_t r;
    memcpy(&r, &v, 4);
    return r;
}

/* device arithmetic intrinsics (the emulator is built with -ffp-contract=off: one rounding each) */
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }

/* element helpers of kernels/be_cuda.cuh */
template <typename T, int N> struct alignas(sizeof(T) * N) Pack {
    T v[N];
};
typedef __nv_bfloat16 bf16;
inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return __bfloat162float(x); }
template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16 from_f32<bf16>(float x) { return __float2bfloat16_rn(x); }

#endif
