// get_dispatch_layout: from top-k expert choices to per-rank / per-expert counts and the
// token-to-rank membership matrix that dispatch routes by.
#include "common.cuh"

// One block does it all: the work is a few hundred KB of reads, and a single block can count
// in shared memory and write the totals directly (no zeroing launch, no global atomics).
// Dynamic shared memory: int expert_counts[num_experts], then int rank_counts[num_ranks].
// Expert ids outside [0, num_experts) are skipped here (memory safety); dispatch reports them.
extern "C" __global__ void __launch_bounds__(DISPATCH_LAYOUT_THREADS) dispatch_layout_kernel(
        const int64_t_* topk_idx, int* num_tokens_per_rank, int* num_tokens_per_expert,
        bool* is_token_in_rank, int num_tokens, int num_topk, int num_experts, int num_ranks) {
    extern __shared__ int shared_counts[];
    int* expert_counts = shared_counts;
    int* rank_counts = shared_counts + num_experts;
    for (int i = threadIdx.x; i < num_experts + num_ranks; i += blockDim.x)
        shared_counts[i] = 0;
    __syncthreads();

    const int experts_per_rank = num_experts / num_ranks;
    for (int token = threadIdx.x; token < num_tokens; token += blockDim.x) {
        unsigned int rank_mask = 0;
        for (int k = 0; k < num_topk; ++k) {
            const int64_t_ expert = topk_idx[(int64_t_)token * num_topk + k];
            if (expert < 0 || expert >= num_experts)
                continue;
            atomicAdd(&expert_counts[expert], 1);
            rank_mask |= 1u << (int)(expert / experts_per_rank);
        }
        for (int r = 0; r < num_ranks; ++r) {
            const bool in_rank = (rank_mask >> r) & 1u;
            is_token_in_rank[(int64_t_)token * num_ranks + r] = in_rank;
            if (in_rank)
                atomicAdd(&rank_counts[r], 1);
        }
    }
    __syncthreads();

    for (int i = threadIdx.x; i < num_experts; i += blockDim.x)
        num_tokens_per_expert[i] = expert_counts[i];
    for (int i = threadIdx.x; i < num_ranks; i += blockDim.x)
        num_tokens_per_rank[i] = rank_counts[i];
}
