// expand: a dispatch's received rows regrouped per local expert, the layout a grouped GEMM reads.
#include "common.cuh"

// Block e writes the group of local expert e: one row for every top-k entry (row i, slot k) of
// recv_topk_idx that names e, in the order of i then k, then zero rows up to a multiple of
// `expert_alignment`. Groups follow each other in expert order; group e starts at the sum of the
// aligned sizes of the groups before it, which every block counts for itself (a histogram of all
// entries), so that nothing has to come from the host. `expanded_rows[j]` is the received row that
// expanded row j copies, or -1 for padding.
extern "C" __global__ void __launch_bounds__(EXPAND_THREADS) expand_kernel(
        int4* expanded_x, float* expanded_scales, int* expanded_rows, const int4* recv_x, const float* recv_scales,
        const int64_t_* recv_topk_idx, int num_recv, int num_topk, int hidden_int4, int num_scales,
        int num_local_experts, int expert_alignment) {
    __shared__ int group_sizes[MAX_LOCAL_EXPERTS];
    __shared__ int warp_hits[EXPAND_THREADS / 32];
    __shared__ int hit_rows[EXPAND_THREADS];
    __shared__ int group_begin;
    const int expert = blockIdx.x, thread = threadIdx.x, lane = thread % 32, warp = thread / 32;
    constexpr int kWarps = EXPAND_THREADS / 32;

    for (int e = thread; e < num_local_experts; e += EXPAND_THREADS)
        group_sizes[e] = 0;
    __syncthreads();
    const int64_t_ num_entries = (int64_t_)num_recv * num_topk;
    for (int64_t_ i = thread; i < num_entries; i += EXPAND_THREADS) {
        const int64_t_ id = recv_topk_idx[i];
        if (id >= 0 && id < num_local_experts)
            atomicAdd(&group_sizes[id], 1);
    }
    __syncthreads();
    if (thread == 0) {
        int begin = 0;
        for (int e = 0; e < expert; ++e)
            begin += (group_sizes[e] + expert_alignment - 1) / expert_alignment * expert_alignment;
        group_begin = begin;
    }
    __syncthreads();
    const int64_t_ begin = group_begin;
    const int size = group_sizes[expert];
    const int aligned = (size + expert_alignment - 1) / expert_alignment * expert_alignment;

    // The entries naming this expert, in order, one chunk of EXPAND_THREADS entries at a time.
    int written = 0;
    for (int64_t_ chunk = 0; chunk < num_entries && written < size; chunk += EXPAND_THREADS) {
        const int64_t_ i = chunk + thread;
        const bool hit = i < num_entries && recv_topk_idx[i] == expert;
        int total;
        const int place = block_hit_place<kWarps>(hit, warp_hits, total);
        if (hit)
            hit_rows[place] = (int)(i / num_topk);
        __syncthreads();
        for (int h = warp; h < total; h += kWarps) {
            const int row = hit_rows[h];
            const int64_t_ out = begin + written + h;
            warp_copy<8>(expanded_x + out * hidden_int4, recv_x + (int64_t_)row * hidden_int4, hidden_int4, lane);
            for (int s = lane; s < num_scales; s += 32)
                expanded_scales[out * num_scales + s] = recv_scales[(int64_t_)row * num_scales + s];
            if (lane == 0)
                expanded_rows[out] = row;
        }
        written += total;
        __syncthreads();  // hit_rows and warp_hits are rewritten by the next chunk
    }
    // Padding: zero rows that copy nothing.
    for (int pad = size + warp; pad < aligned; pad += kWarps) {
        const int64_t_ out = begin + pad;
        for (int j = lane; j < hidden_int4; j += 32)
            expanded_x[out * hidden_int4 + j] = make_int4(0, 0, 0, 0);
        for (int s = lane; s < num_scales; s += 32)
            expanded_scales[out * num_scales + s] = 0.0f;
        if (lane == 0)
            expanded_rows[out] = -1;
    }
}
