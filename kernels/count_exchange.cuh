// The count exchange of a fresh dispatch, made by notify_dispatch_kernel (when the host waits for
// the counts: it starts while the host allocates the outputs) or at the start of dispatch_kernel
// itself (one launch: when the host does not wait, num_worst_tokens; or, with a rank per
// process, when the outputs exist before the launch: rows in place, or allocated by the call before).
#pragma once
#include "call_check.cuh"

// What the exchange reads and writes, besides the Buffer's shared arguments.
struct CountExchange {
    const int* num_tokens_per_rank;
    const int* num_tokens_per_expert;
    const bool* is_token_in_rank;
    int* rank_prefix_matrix;
    int* channel_prefix_matrix;
    int recv_capacity;
    int* recv_counter;
    int* mismatch_flag;
    int* recv_expert_counter;
    int report_refusal;
    const int64_t_* topk_idx;
    int num_topk, num_tokens, num_experts, num_channels, expert_alignment;
    int64_t_ zero_off;
    int zero_count, region_tokens;
};

// Notify area of a dispatch, at `notify_off` in every rank's NVLink buffer (two areas used in
// turn by consecutive calls, picked by the call counters; see deepep_cupy/layout.py); row `src` of each table is written
// only by rank `src`:
//   int signature[R][SIGNATURE_INTS]     the settings every rank must share; the last int is
//                                        instead 1 when the rank found its own input invalid
//   int rank_counts[R][R]                [src][dst] = tokens src sends to dst
//   int expert_counts[R][E / R]          [src][e]   = tokens src sends to local expert e
//   int recv_capacity[R]                 [src]      = rows src allocated for what it receives
//
// Block 0 scatters this rank's rows into every peer's area, then after a barrier sums the tables
// into the rank prefix matrix and the receive counts (`recv_counter`, `recv_expert_counter`:
// host-mapped memory for a host that sizes the outputs from them, or device memory of the handle
// for a dispatch the host does not wait for). It zeroes the dispatch metadata (`zero_off`,
// `zero_count` ints) before the barrier, as check_call does and for the same reasons, so that no
// sender publishes into metadata that is not yet reset. No barrier is needed before the scatter:
// the areas alternate, and a peer can only come back to this one after this rank has passed the
// barrier of the next call, long after reading it.
// A host that allocated the outputs before knowing the counts (and launched the dispatch right
// behind this kernel) states how many rows it allocated; if any rank receives more, every rank
// sees it in the same table, and the verdict VERDICT_OVER_CAPACITY makes every rank's dispatch
// move nothing, so that the hosts can redo the call with exact sizes (each host is given its
// receive count then, not 0). A host that failed before the call (out of memory for the
// outputs, say) states minus the failure's code as its capacity: it takes part only so that every
// rank refuses the call together (VERDICT_HOST_FAILED, settings_verdict). A refused call publishes
// zero counts and a zero rank prefix matrix (a combine with its handle then moves nothing), and
// with `report_refusal` also leaves the verdict in the error record: a host that does not wait
// for the counts (num_worst_tokens, CUDA graphs) learns of it there at its next check. So is a
// call in which one rank sends another more tokens than a transfer region holds (`region_tokens`):
// VERDICT_BUFFER_TOO_SMALL, decided alike on every rank from the same table.
// The settings ranks compare (`row_bytes` .. `recv_chunk`, with num_experts) are arguments, not
// host memory, so that a captured call replays with its own.
// `signature`: the settings every rank must share (SIGNATURE_INTS - 1 ints). One block, all of it.
__device__ __forceinline__ void exchange_counts(const CountExchange& c, const int* signature, void* const* buffer_ptrs,
                                                int num_ranks, int rank, int64_t_ timeout_ns, int* error_record) {
    const int thread = threadIdx.x, num_threads = blockDim.x;
    const int experts_per_rank = c.num_experts / num_ranks;
    CallCounters counters(buffer_ptrs, rank);
    const int64_t_ notify_off = counters.notify_off;
    // Validate this rank's expert ids while waiting costs nothing: every rank learns the
    // verdict from the exchanged signatures and refuses the dispatch together.
    int invalid = 0;
    if (c.topk_idx != nullptr) {
        // Several loads in flight per thread: one at a time, the scan of a 4096 x 8 table
        // costs a memory latency per element and dominated the whole kernel.
        constexpr int kInFlight = 8;
        const int64_t_ total = (int64_t_)c.num_tokens * c.num_topk;
        for (int64_t_ base = thread; base < total; base += (int64_t_)num_threads * kInFlight) {
            int64_t_ expert[kInFlight];
            #pragma unroll
            for (int u = 0; u < kInFlight; ++u) {
                const int64_t_ i = base + (int64_t_)u * num_threads;
                expert[u] = i < total ? ld_stream(c.topk_idx + i) : -1;
            }
            #pragma unroll
            for (int u = 0; u < kInFlight; ++u)
                invalid |= (expert[u] < -1 || expert[u] >= c.num_experts) ? 1 : 0;
        }
    }
    invalid = __syncthreads_or(invalid);

    // Scatter this rank's row of every table into every peer's notify area. A negative capacity
    // is a host that failed before the call and takes part only to refuse it (HOST_FAILURES code).
    publish_signature(buffer_ptrs, num_ranks, rank, notify_off, signature,
                      c.recv_capacity < 0 ? HOST_FAILURE_FLAG - c.recv_capacity : invalid);
    const int row_ints = num_ranks + experts_per_rank + 1;
    for (int i = thread; i < num_ranks * row_ints; i += num_threads) {
        const int peer = i / row_ints, j = i % row_ints;
        int* area = reinterpret_cast<int*>(reinterpret_cast<char*>(buffer_ptrs[peer]) + notify_off);
        int* rank_counts = area + num_ranks * SIGNATURE_INTS;
        int* expert_counts = rank_counts + num_ranks * num_ranks;
        int* capacities = expert_counts + num_ranks * experts_per_rank;
        if (j < num_ranks)
            rank_counts[rank * num_ranks + j] = c.num_tokens_per_rank[j];
        else if (j < num_ranks + experts_per_rank)
            expert_counts[rank * experts_per_rank + (j - num_ranks)] =
                c.num_tokens_per_expert[peer * experts_per_rank + (j - num_ranks)];
        else
            capacities[rank] = c.recv_capacity;
    }
    zero_ints(buffer_ptrs[rank], c.zero_off, c.zero_count);
    if (!rank_barrier(buffer_ptrs, num_ranks, rank, counters.first_epoch, timeout_ns, error_record,
                      KERNEL_NOTIFY_DISPATCH))
        return;

    const int* area = reinterpret_cast<const int*>(reinterpret_cast<char*>(buffer_ptrs[rank]) + notify_off);
    const int* rank_counts = area + num_ranks * SIGNATURE_INTS;
    const int* expert_counts = rank_counts + num_ranks * num_ranks;
    const int* capacities = expert_counts + num_ranks * experts_per_rank;
    __shared__ int num_recv_tokens, call_verdict;
    if (thread == 0) {
        // The word is written even when it is 0, to clear a disagreement left by an earlier
        // cached call.
        int verdict = settings_verdict(buffer_ptrs, num_ranks, rank, notify_off);
        for (int i = 0; i < num_ranks * num_ranks && verdict == 0; ++i)
            if (rank_counts[i] > c.region_tokens)
                verdict = VERDICT_BUFFER_TOO_SMALL;
        for (int dst = 0; dst < num_ranks && verdict == 0; ++dst) {
            int received = 0;
            for (int src = 0; src < num_ranks; ++src)
                received += rank_counts[src * num_ranks + dst];
            if (received > capacities[dst])
                verdict = VERDICT_OVER_CAPACITY;
        }
        call_verdict = verdict;
        *verdict_word(buffer_ptrs, rank) = verdict;
        if (c.mismatch_flag != nullptr)
            *reinterpret_cast<volatile int*>(c.mismatch_flag) = verdict;
        if (verdict != 0 && c.report_refusal)
            report_error(error_record, ERROR_DISPATCH_REFUSED, KERNEL_NOTIFY_DISPATCH, rank, -1, -1, verdict);
    }
    __syncthreads();
    const bool refused = call_verdict != 0;
    if (thread < num_ranks) {
        int running = 0, received = 0;
        for (int src = 0; src < num_ranks; ++src) {
            received += rank_counts[src * num_ranks + thread];
            running += refused ? 0 : rank_counts[src * num_ranks + thread];
            c.rank_prefix_matrix[src * num_ranks + thread] = running;
        }
        // A host that waits for the count of a call refused for want of rows learns the rows it
        // needs, to allocate them before it redoes the call.
        if (thread == rank)
            num_recv_tokens = call_verdict == VERDICT_OVER_CAPACITY && !c.report_refusal ? received : running;
    }
    for (int e = thread; e < experts_per_rank; e += num_threads) {
        int sum = 0;
        for (int src = 0; src < num_ranks && !refused; ++src)
            sum += expert_counts[src * experts_per_rank + e];
        sum = (sum + c.expert_alignment - 1) / c.expert_alignment * c.expert_alignment;
        reinterpret_cast<volatile int*>(c.recv_expert_counter)[e] = sum;
    }
    __syncthreads();
    if (thread == 0) {
        // The count goes last: the host reads the expert counts once it sees it.
        __threadfence_system();
        *reinterpret_cast<volatile int*>(c.recv_counter) = num_recv_tokens;
    }
    counters.advance(1, 1);
}

// The sender-side channel prefix matrix's row for destination `dst`: per channel, the tokens it
// sends `dst`, summed over the channels before. One block, all of it.
__device__ __forceinline__ void count_channel_tokens(const CountExchange& c, int num_ranks, int dst) {
    const int thread = threadIdx.x, num_threads = blockDim.x;
    const int lane = thread % 32, warp = thread / 32, num_warps = num_threads / 32;
    for (int channel = warp; channel < c.num_channels; channel += num_warps) {
        int begin, end;
        channel_task_range(c.num_tokens, c.num_channels, channel, begin, end);
        int count = 0;
        for (int token = begin + lane; token < end; token += 32)
            count += c.is_token_in_rank[(int64_t_)token * num_ranks + dst] ? 1 : 0;
        count = warp_sum(count);
        if (lane == 0)
            c.channel_prefix_matrix[dst * c.num_channels + channel] = count;
    }
    __syncthreads();
    if (thread == 0)
        for (int channel = 1; channel < c.num_channels; ++channel)
            c.channel_prefix_matrix[dst * c.num_channels + channel] +=
                c.channel_prefix_matrix[dst * c.num_channels + channel - 1];
}
