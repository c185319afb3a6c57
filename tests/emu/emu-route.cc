/* emu-route.cc: runs the routing kernels of kernels/moe_route.cuh (the CUDA backend's
 * moe_route) in the SIMT emulator (simt.h), both forms: moe_topk_kernel counting the choices
 * then moe_place_fast_kernel (offsets and placement in one kernel, MP_L x MP_THREADS tokens a
 * pass, stopping once an expert's count is placed), and the four-kernel form (top-k, count,
 * offsets, place). Checks, for shapes with several passes of tokens, empty experts, more experts
 * than tokens, odd sizes and k of 1: expert ids, counts, offsets, rows (with the -1 of every
 * padding row) and slots equal to the CPU backend's moe_route (lib/backends/be_cpu_moe.c) value
 * for value, the weights within 1e-6; and the grouped rows after the last expert's left as they
 * were. The launches are the ones of kernels/moe.cu. Built and run by tests/emu/run (route).
 * Exit 0 when everything agrees. */
#include "simt.h"

extern "C" {
#include "backend.h"
}

#include "../../kernels/moe_route.cuh"

#define EMU_SEED 0x9E3779B97F4A7C15ull
#include "emu-rng.h"

static int failures;

struct Route {
    std::vector<int32_t> idx, counts, offsets, rows, slot;
    std::vector<float> weight;
};

/* kernels/moe.cu's cuda_moe_route on the emulator: fast form or the four kernels */
static Route run_route(const std::vector<float> &logits, int64_t T, int E, int k, int64_t cap,
                       bool fast)
{
    Route r;
    r.idx.assign((size_t)(T * k), -7);
    r.weight.assign((size_t)(T * k), -7.0f);
    r.counts.assign((size_t)E, fast ? 0 : -7); /* the fast form's memset */
    r.offsets.assign((size_t)E + 1, -7);
    r.rows.assign((size_t)cap, -7);
    r.slot.assign((size_t)(T * k), -7);
    const unsigned blocks = (unsigned)((T + 7) / 8);
    emu::launch(dim3(blocks), dim3(256), 0, [&] {
        moe_topk_kernel(logits.data(), T, E, k, true, r.idx.data(), r.weight.data(),
                        fast ? r.counts.data() : nullptr);
    });
    if (fast) {
        emu::launch(dim3((unsigned)E), dim3(MP_THREADS), 0, [&] {
            moe_place_fast_kernel(r.idx.data(), T, k, r.counts.data(), E, r.offsets.data(),
                                  r.rows.data(), r.slot.data());
        });
        return r;
    }
    emu::launch(dim3((unsigned)E), dim3(256), 0,
                [&] { moe_count_kernel(r.idx.data(), T * k, r.counts.data()); });
    emu::launch(dim3(1), dim3(32), 0,
                [&] { moe_offsets_kernel(r.counts.data(), E, r.offsets.data()); });
    emu::launch(dim3((unsigned)E), dim3(256), 0, [&] {
        moe_place_kernel(r.idx.data(), T, k, r.offsets.data(), r.counts.data(), r.rows.data(),
                         r.slot.data());
    });
    return r;
}

static void route_case(dfl_be *cpu, int64_t T, int E, int k, float spread, int hot)
{
    const int64_t cap = dfl_moe_cap(T, E, k);
    /* logits: noise, experts below hot favoured (uneven counts; with hot < E - k some empty) */
    std::vector<float> logits((size_t)(T * E));
    for (int64_t t = 0; t < T; t++)
        for (int e = 0; e < E; e++)
            logits[(size_t)(t * E + e)] = spread * runi() + (e < hot ? 4.0f : 0.0f);
    Route ref;
    ref.idx.resize((size_t)(T * k));
    ref.weight.resize((size_t)(T * k));
    ref.counts.resize((size_t)E);
    ref.offsets.resize((size_t)E + 1);
    ref.rows.assign((size_t)cap, -7);
    ref.slot.resize((size_t)(T * k));
    dfl_moe_route r = {};
    r.logits = logits.data();
    r.T = T;
    r.E = E;
    r.k = k;
    r.norm_topk = true;
    r.idx = ref.idx.data();
    r.weight = ref.weight.data();
    r.counts = ref.counts.data();
    r.offsets = ref.offsets.data();
    r.rows = ref.rows.data();
    r.slot = ref.slot.data();
    r.cap = cap;
    if (cpu->ops->moe_route(cpu, &r) != 0) {
        printf("  T %lld E %d k %d: the CPU route failed  FAIL\n", (long long)T, E, k);
        failures++;
        return;
    }
    const size_t used = (size_t)ref.offsets[(size_t)E];
    int empty = 0;
    for (int e = 0; e < E; e++)
        empty += ref.counts[(size_t)e] == 0;
    for (int fast = 1; fast >= 0; fast--) {
        Route g = run_route(logits, T, E, k, cap, fast);
        const bool ids = g.idx == ref.idx, cnt = g.counts == ref.counts,
                   off = g.offsets == ref.offsets, slots = g.slot == ref.slot;
        bool rows = true, past = true;
        for (size_t i = 0; i < (size_t)cap; i++) {
            if (i < used)
                rows &= g.rows[i] == ref.rows[i];
            else
                past &= g.rows[i] == -7;
        }
        double werr = 0;
        for (size_t i = 0; i < g.weight.size(); i++)
            werr = std::max(werr, (double)fabsf(g.weight[i] - ref.weight[i]));
        const bool ok = ids && cnt && off && slots && rows && past && werr <= 1e-6;
        printf("  %-5s T %5lld E %4d k %2d (%3d empty): ids %s, counts %s, offsets %s, rows %s, "
               "slots %s, past the last expert %s, weights %.2g%s\n",
               fast ? "fast" : "four", (long long)T, E, k, empty, ids ? "ok" : "FAIL",
               cnt ? "ok" : "FAIL", off ? "ok" : "FAIL", rows ? "ok" : "FAIL",
               slots ? "ok" : "FAIL", past ? "untouched" : "WRITTEN", werr, ok ? "" : "  FAIL");
        if (!ok)
            failures++;
    }
}

int main()
{
    printf("emu-route: kernels/moe_route.cuh in the SIMT emulator\n");
    dfl_err e = {};
    dfl_be *cpu = NULL;
    if (dfl_be_open(&cpu, "cpu", DFL_DT_INVALID, &e) != 0) {
        fprintf(stderr, "emu-route: cpu backend: %s\n", e.msg);
        return 1;
    }
    route_case(cpu, 37, 8, 2, 2.0f, 0);       /* one pass, a partial warp of tokens */
    route_case(cpu, 5000, 16, 4, 2.0f, 3);    /* three passes of 2048 tokens, uneven counts */
    route_case(cpu, 4200, 12, 3, 1.0f, 4);    /* hot experts, the others nearly empty or empty */
    route_case(cpu, 300, 512, 10, 2.0f, 0);   /* more experts than tokens: many empty */
    route_case(cpu, 2049, 7, 1, 2.0f, 0);     /* k 1; one token in the second pass */
    route_case(cpu, 1000, 128, 8, 2.0f, 0);   /* the Qwen3-30B-A3B routing shape */
    dfl_be_close(cpu);
    printf("emu-route: %s\n", failures ? "FAIL" : "ok");
    return failures ? 1 : 0;
}
