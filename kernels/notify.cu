// The small kernels around the bulk transfers: the cross-rank barrier and the exchange of receive
// counts before a fresh dispatch. (A cached dispatch and a combine check their settings at the
// start of their transfer kernel: call_check.cuh.)
#include "count_exchange.cuh"

// The count exchange of a dispatch whose host waits for the counts (count_exchange.cuh): block 0
// exchanges, blocks 1..R count the tokens of each channel per destination.
extern "C" __global__ void __launch_bounds__(NOTIFY_DISPATCH_THREADS) notify_dispatch_kernel(
        const int* num_tokens_per_rank, const int* num_tokens_per_expert, const bool* is_token_in_rank,
        int* rank_prefix_matrix, int* channel_prefix_matrix, int recv_capacity,
        int* recv_counter, int* mismatch_flag, int* recv_expert_counter, int report_refusal,
        int row_bytes, int topk_code, int num_scales, int num_sms, int send_chunk, int recv_chunk,
        const int64_t_* topk_idx, int num_topk, int num_tokens, int num_experts, int num_channels, int expert_alignment,
        void* const* buffer_ptrs, int num_ranks, int rank, int64_t_ zero_off, int zero_count, int region_tokens,
        int64_t_ timeout_ns, int* error_record) {
    const CountExchange exchange{num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, rank_prefix_matrix,
                                 channel_prefix_matrix, recv_capacity, recv_counter, mismatch_flag,
                                 recv_expert_counter, report_refusal, topk_idx, num_topk, num_tokens, num_experts,
                                 num_channels, expert_alignment, zero_off, zero_count, region_tokens};
    if (blockIdx.x == 0) {
        const int signature[SIGNATURE_INTS - 1] = {row_bytes, topk_code, num_scales, num_experts, num_sms,
                                                   send_chunk, recv_chunk};
        exchange_counts(exchange, signature, buffer_ptrs, num_ranks, rank, timeout_ns, error_record);
    } else {
        count_channel_tokens(exchange, num_ranks, blockIdx.x - 1);
    }
}

extern "C" __global__ void __launch_bounds__(BARRIER_THREADS) barrier_kernel(
        void* const* buffer_ptrs, int num_ranks, int rank, int64_t_ timeout_ns, int* error_record) {
    CallCounters counters(buffer_ptrs, rank);
    if (rank_barrier(buffer_ptrs, num_ranks, rank, counters.first_epoch, timeout_ns, error_record, KERNEL_BARRIER))
        counters.advance(1, 0);
}
