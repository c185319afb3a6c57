/* moe_route.cuh: the routing kernels of the CUDA MoE path (kernels/moe.cu's moe_route): the
 * router's softmax and top-k fused in f32 (one warp per token), then the grouping by expert,
 * deterministic (ascending token order within each expert, no order-dependent atomics). Two
 * forms: moe_topk_kernel counting the choices (integer atomics) then moe_place_fast_kernel
 * (offsets and placement in one kernel); or the four-kernel form (top-k, count per expert, padded
 * offsets, placement). Device code only; needs from the including file the CUDA runtime (or the
 * SIMT emulator, tests/emu/emu-route.cc, which checks both forms against the CPU's route). */
#ifndef DFL_MOE_ROUTE_CUH
#define DFL_MOE_ROUTE_CUH

#define MOE_MAX_E 2048        /* experts: 64 per lane of a warp */
#define MOE_MAX_K 32

/* One warp per token: softmax over E logits (f32), the top k (ties to the lower id), weights
 * renormalised over the k when norm. */
__global__ void moe_topk_kernel(const float *logits, int64_t T, int E, int k, bool norm,
                                int32_t *idx, float *weight, int32_t *counts)
{
    int64_t t = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T)
        return;
    int lane = threadIdx.x & 31;
    const float *z = logits + t * E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32)
        mx = fmaxf(mx, z[e]);
    for (int o = 16; o > 0; o >>= 1)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.0f;
    for (int e = lane; e < E; e += 32)
        sum += expf(z[e] - mx);
    for (int o = 16; o > 0; o >>= 1)
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    uint64_t taken = 0; /* bit i: element lane + 32 i was chosen */
    float wsum = 0.0f, wj[MOE_MAX_K];
    for (int j = 0; j < k; j++) {
        float bv = -INFINITY;
        int be = -1;
        for (int i = 0, e = lane; e < E; i++, e += 32)
            if (!(taken >> i & 1) && (be < 0 || z[e] > bv)) {
                bv = z[e];
                be = e;
            }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (oe >= 0 && (be < 0 || ov > bv || (ov == bv && oe < be))) {
                bv = ov;
                be = oe;
            }
        }
        if ((be & 31) == lane)
            taken |= 1ull << (be >> 5);
        wj[j] = expf(bv - mx) / sum;
        wsum += wj[j];
        if (lane == 0) {
            idx[t * k + j] = be;
            if (counts) /* zeroed before; integer sums: the same in any order */
                atomicAdd(&counts[be], 1);
        }
    }
    if (lane == 0)
        for (int j = 0; j < k; j++)
            weight[t * k + j] = norm ? wj[j] / wsum : wj[j];
}

/* Block b counts the choices of expert b. */
__global__ void moe_count_kernel(const int32_t *idx, int64_t n, int32_t *counts)
{
    __shared__ int part[32];
    int e = blockIdx.x, c = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        c += idx[i] == e;
    for (int o = 16; o > 0; o >>= 1)
        c += __shfl_xor_sync(0xffffffffu, c, o);
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++)
            s += part[w];
        counts[e] = s;
    }
}

__global__ void moe_offsets_kernel(const int32_t *counts, int E, int32_t *offsets)
{
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    int32_t o = 0;
    for (int e = 0; e < E; e++) {
        offsets[e] = o;
        o += (counts[e] + DFL_MOE_PAD - 1) / DFL_MOE_PAD * DFL_MOE_PAD;
    }
    offsets[E] = o;
}

/* Block b places the tokens that chose expert b, in ascending token order: a block-wide
 * exclusive scan of the flags of each chunk of blockDim tokens. Then marks its padding rows. */
__global__ void moe_place_kernel(const int32_t *idx, int64_t T, int k, const int32_t *offsets,
                                 const int32_t *counts, int32_t *rows, int32_t *slot)
{
    __shared__ int wtot[32];
    int e = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int32_t base = offsets[e], run = 0;
    for (int64_t t0 = 0; t0 < T; t0 += blockDim.x) {
        int64_t t = t0 + threadIdx.x;
        int j = -1;
        if (t < T)
            for (int q = 0; q < k; q++)
                if (idx[t * k + q] == e)
                    j = q;
        unsigned ball = __ballot_sync(0xffffffffu, j >= 0);
        if (lane == 0)
            wtot[w] = __popc(ball);
        __syncthreads();
        int before = 0, total = 0;
        for (int q = 0; q < nw; q++) {
            before += q < w ? wtot[q] : 0;
            total += wtot[q];
        }
        if (j >= 0) {
            int32_t g = base + run + before + __popc(ball & ((1u << lane) - 1));
            rows[g] = (int32_t)t;
            slot[t * k + j] = g;
        }
        run += total;
        __syncthreads(); /* wtot is rewritten by the next chunk */
    }
    for (int32_t g = base + counts[e] + threadIdx.x; g < offsets[e + 1]; g += blockDim.x)
        rows[g] = -1;
}

/* The same placement in one kernel after moe_topk_kernel's counts (DFL_CUDA_MOE_ROUTE unset):
 * block b first sums the padded counts of the experts before b (its offset, which it writes;
 * the last block also writes offsets[E]), then goes through the tokens MP_L x MP_THREADS at a
 * time, MP_L tokens a thread (layer i: token t0 + i MP_THREADS + thread), all their ballots
 * counted behind one barrier (the old kernel had two barriers for every MP_THREADS tokens), and
 * stops once its count is placed. The same rows and slots as moe_place_kernel. */
#define MP_THREADS 256
#define MP_L 8
#define MP_PAD(c) (((c) + DFL_MOE_PAD - 1) / DFL_MOE_PAD * DFL_MOE_PAD)

__global__ void __launch_bounds__(MP_THREADS)
    moe_place_fast_kernel(const int32_t *idx, int64_t T, int k, const int32_t *counts, int E,
                          int32_t *offsets, int32_t *rows, int32_t *slot)
{
    constexpr int NW = MP_THREADS / 32;
    __shared__ int wtot[MP_L][NW];
    __shared__ int32_t sbase;
    const int e = blockIdx.x, lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int32_t part = 0;
    for (int q = threadIdx.x; q < e; q += MP_THREADS)
        part += MP_PAD(counts[q]);
    for (int o = 16; o > 0; o >>= 1)
        part += __shfl_xor_sync(0xffffffffu, part, o);
    if (lane == 0)
        wtot[0][w] = part;
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t b = 0;
        for (int q = 0; q < NW; q++)
            b += wtot[0][q];
        sbase = b;
        offsets[e] = b;
        if (e == E - 1)
            offsets[E] = b + MP_PAD(counts[e]);
    }
    __syncthreads();
    const int32_t base = sbase, cnt = counts[e];
    int32_t run = 0;
    for (int64_t t0 = 0; t0 < T && run < cnt; t0 += (int64_t)MP_L * MP_THREADS) {
        int j[MP_L];
        unsigned ball[MP_L];
#pragma unroll
        for (int i = 0; i < MP_L; i++) {
            const int64_t t = t0 + i * MP_THREADS + threadIdx.x;
            j[i] = -1;
            if (t < T)
                for (int q = 0; q < k; q++)
                    if (idx[t * k + q] == e)
                        j[i] = q;
        }
#pragma unroll
        for (int i = 0; i < MP_L; i++) {
            ball[i] = __ballot_sync(0xffffffffu, j[i] >= 0);
            if (lane == 0)
                wtot[i][w] = __popc(ball[i]);
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < MP_L; i++) {
            int before = 0, total = 0;
#pragma unroll
            for (int q = 0; q < NW; q++) {
                before += q < w ? wtot[i][q] : 0;
                total += wtot[i][q];
            }
            if (j[i] >= 0) {
                const int64_t t = t0 + i * MP_THREADS + threadIdx.x;
                const int32_t g = base + run + before + __popc(ball[i] & ((1u << lane) - 1));
                rows[g] = (int32_t)t;
                slot[t * k + j[i]] = g;
            }
            run += total;
        }
        __syncthreads(); /* wtot is rewritten by the next chunk */
    }
    for (int32_t g = base + cnt + threadIdx.x; g < base + MP_PAD(cnt); g += MP_THREADS)
        rows[g] = -1;
}

#endif
