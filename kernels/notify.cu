// The small kernels around the bulk transfers: the cross-rank barrier, the exchange of receive
// counts before a dispatch, and the settings checks and resets before a cached dispatch or a combine.
#include "common.cuh"

// Zero `count` ints at byte offset `offset` of `base`, with all threads of the block.
__device__ __forceinline__ void zero_ints(void* base, int64_t_ offset, int count) {
    int* ints = reinterpret_cast<int*>(reinterpret_cast<char*>(base) + offset);
    for (int i = threadIdx.x; i < count; i += blockDim.x)
        ints[i] = 0;
}

// The rank's call counters in its own NVLink buffer (BARRIERS_INT, NOTIFY_CALLS_INT): the numbers
// of this call's barriers and its notify area come from them, not from the host, so that a call
// captured in a CUDA graph replays in step with its peers. Block 0 reads them on entry and
// advances them when it leaves; the next call, later on the same stream, reads the new values.
struct CallCounters {
    int* words;
    int first_epoch;
    int64_t_ notify_off;
    __device__ __forceinline__ CallCounters(void* const* buffer_ptrs, int rank)
        : words(reinterpret_cast<int*>(buffer_ptrs[rank])) {
        first_epoch = ld_volatile(words + BARRIERS_INT) + 1;
        notify_off = NOTIFY_AREA_OFFSET + (int64_t_)(ld_volatile(words + NOTIFY_CALLS_INT) & 1) * NOTIFY_AREA_BYTES;
    }
    // All threads of the block, once they are done with the numbers.
    __device__ __forceinline__ void advance(int barriers, int notify_calls) {
        __syncthreads();
        if (threadIdx.x == 0) {
            words[BARRIERS_INT] = first_epoch - 1 + barriers;
            words[NOTIFY_CALLS_INT] += notify_calls;
        }
    }
};

// Write this rank's settings row (SIGNATURE_INTS - 1 values, then `invalid`) into the signature
// table of every peer's notify area at `notify_off`. All threads of the block.
__device__ __forceinline__ void publish_signature(void* const* buffer_ptrs, int num_ranks, int rank,
                                                  int64_t_ notify_off, const int* values, int invalid) {
    for (int i = threadIdx.x; i < num_ranks * SIGNATURE_INTS; i += blockDim.x) {
        const int peer = i / SIGNATURE_INTS, j = i % SIGNATURE_INTS;
        int* area = reinterpret_cast<int*>(reinterpret_cast<char*>(buffer_ptrs[peer]) + notify_off);
        area[rank * SIGNATURE_INTS + j] = j < SIGNATURE_INTS - 1 ? values[j] : invalid;
    }
}

// The verdict on a call, from the signature table of this rank's notify area after a barrier;
// every rank reads the same table, so every rank comes to the same verdict:
// 0 = all agree, p + 1 = rank p's settings differ from rank 0's, -(p + 1) = rank p's input was invalid.
__device__ __forceinline__ int settings_verdict(void* const* buffer_ptrs, int num_ranks, int rank,
                                                int64_t_ notify_off) {
    const int* area = reinterpret_cast<const int*>(reinterpret_cast<const char*>(buffer_ptrs[rank]) + notify_off);
    for (int peer = 0; peer < num_ranks; ++peer) {
        const int* row = area + peer * SIGNATURE_INTS;
        if (row[SIGNATURE_INTS - 1] != 0)
            return -(peer + 1);
        for (int j = 0; j < SIGNATURE_INTS - 1; ++j)
            if (row[j] != area[j])
                return peer + 1;
    }
    return 0;
}

// Before a cached dispatch or a combine: compare the call's settings across ranks, then reset the
// transfer metadata (`zero_off`, `zero_count` ints) between two barriers (nobody may still use the
// old metadata, nobody may start before the reset). Block 0, all of it. A disagreement is left in
// this rank's verdict word for the transfer kernel and in the error record for the host. So is a
// handle that routes more tokens from one rank to another than a region of this call holds
// (`region_tokens`): every rank reads the same rank prefix matrix, so every rank refuses alike.
// `dispatch_verdict` (null when its host checked it) is the verdict of the dispatch whose handle
// the call uses: a refused one (reported then) makes this call move nothing too, on every rank alike.
__device__ __forceinline__ void check_and_reset(void* const* buffer_ptrs, int num_ranks, int rank,
                                                const int* settings, int64_t_ zero_off, int zero_count,
                                                const int* rank_prefix_matrix, int region_tokens,
                                                const int* dispatch_verdict, int64_t_ timeout_ns,
                                                int* error_record, int kernel) {
    CallCounters counters(buffer_ptrs, rank);
    const int epoch = counters.first_epoch;
    const int64_t_ notify_off = counters.notify_off;
    publish_signature(buffer_ptrs, num_ranks, rank, notify_off, settings, 0);
    if (!rank_barrier(buffer_ptrs, num_ranks, rank, epoch, timeout_ns, error_record, kernel))
        return;
    if (threadIdx.x == 0) {
        int verdict = settings_verdict(buffer_ptrs, num_ranks, rank, notify_off);
        if (verdict != 0) {
            report_error(error_record, ERROR_MISMATCH, kernel, rank, -1, verdict - 1, verdict);
        } else {
            const int largest = largest_rank_count(rank_prefix_matrix, num_ranks);
            if (largest > region_tokens) {
                verdict = VERDICT_BUFFER_TOO_SMALL;
                report_error(error_record, ERROR_BUFFER_TOO_SMALL, kernel, rank, -1, -1, largest);
            } else if (dispatch_verdict != nullptr) {
                verdict = *dispatch_verdict;
            }
        }
        *verdict_word(buffer_ptrs, rank) = verdict;
    }
    zero_ints(buffer_ptrs[rank], zero_off, zero_count);
    if (rank_barrier(buffer_ptrs, num_ranks, rank, epoch + 1, timeout_ns, error_record, kernel))
        counters.advance(2, 1);
}

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
// for a dispatch the host does not wait for), and zeroes the dispatch metadata (`zero_off`, `zero_count`
// ints) before a second barrier, so that no sender publishes into metadata that is not yet reset. No barrier
// is needed before the scatter: the area alternates, and a peer can only come back to this one
// after this rank has passed the second barrier of the next dispatch, long after reading it.
// A host that allocated the outputs before knowing the counts (and launched the dispatch right
// behind this kernel) states how many rows it allocated; if any rank receives more, every rank
// sees it in the same table, and the verdict VERDICT_OVER_CAPACITY makes every rank's dispatch
// move nothing, so that the hosts can redo the call with exact sizes. A refused call publishes
// zero counts and a zero rank prefix matrix (a combine with its handle then moves nothing), and
// with `report_refusal` also leaves the verdict in the error record: a host that does not wait
// for the counts (num_worst_tokens, CUDA graphs) learns of it there at its next check. So is a
// call in which one rank sends another more tokens than a transfer region holds (`region_tokens`):
// VERDICT_BUFFER_TOO_SMALL, decided alike on every rank from the same table.
// The settings ranks compare (`row_bytes` .. `recv_chunk`, with num_experts) are arguments, not
// host memory, so that a captured call replays with its own.
// Blocks 1..R count, per destination rank, the tokens of each channel (the sender-side channel
// prefix matrix).
extern "C" __global__ void __launch_bounds__(NOTIFY_DISPATCH_THREADS) notify_dispatch_kernel(
        const int* num_tokens_per_rank, const int* num_tokens_per_expert, const bool* is_token_in_rank,
        int* rank_prefix_matrix, int* channel_prefix_matrix, int recv_capacity,
        int* recv_counter, int* mismatch_flag, int* recv_expert_counter, int report_refusal,
        int row_bytes, int topk_code, int num_scales, int num_sms, int send_chunk, int recv_chunk,
        const int64_t_* topk_idx, int num_topk, int num_tokens, int num_experts, int num_channels, int expert_alignment,
        void* const* buffer_ptrs, int num_ranks, int rank, int64_t_ zero_off, int zero_count, int region_tokens,
        int64_t_ timeout_ns, int* error_record) {
    const int thread = threadIdx.x, num_threads = blockDim.x;
    const int experts_per_rank = num_experts / num_ranks;

    if (blockIdx.x == 0) {
        const int signature[SIGNATURE_INTS - 1] = {row_bytes, topk_code, num_scales, num_experts, num_sms,
                                                   send_chunk, recv_chunk};
        CallCounters counters(buffer_ptrs, rank);
        const int epoch = counters.first_epoch;
        const int64_t_ notify_off = counters.notify_off;
        // Validate this rank's expert ids while waiting costs nothing: every rank learns the
        // verdict from the exchanged signatures and refuses the dispatch together.
        int invalid = 0;
        if (topk_idx != nullptr) {
            // Several loads in flight per thread: one at a time, the scan of a 4096 x 8 table
            // costs a memory latency per element and dominated the whole kernel.
            constexpr int kInFlight = 8;
            const int64_t_ total = (int64_t_)num_tokens * num_topk;
            for (int64_t_ base = thread; base < total; base += (int64_t_)num_threads * kInFlight) {
                int64_t_ expert[kInFlight];
                #pragma unroll
                for (int u = 0; u < kInFlight; ++u) {
                    const int64_t_ i = base + (int64_t_)u * num_threads;
                    expert[u] = i < total ? ld_stream(topk_idx + i) : -1;
                }
                #pragma unroll
                for (int u = 0; u < kInFlight; ++u)
                    invalid |= (expert[u] < -1 || expert[u] >= num_experts) ? 1 : 0;
            }
        }
        invalid = __syncthreads_or(invalid);

        // Scatter this rank's row of every table into every peer's notify area.
        publish_signature(buffer_ptrs, num_ranks, rank, notify_off, signature, invalid);
        const int row_ints = num_ranks + experts_per_rank + 1;
        for (int i = thread; i < num_ranks * row_ints; i += num_threads) {
            const int peer = i / row_ints, j = i % row_ints;
            int* area = reinterpret_cast<int*>(reinterpret_cast<char*>(buffer_ptrs[peer]) + notify_off);
            int* rank_counts = area + num_ranks * SIGNATURE_INTS;
            int* expert_counts = rank_counts + num_ranks * num_ranks;
            int* capacities = expert_counts + num_ranks * experts_per_rank;
            if (j < num_ranks)
                rank_counts[rank * num_ranks + j] = num_tokens_per_rank[j];
            else if (j < num_ranks + experts_per_rank)
                expert_counts[rank * experts_per_rank + (j - num_ranks)] =
                    num_tokens_per_expert[peer * experts_per_rank + (j - num_ranks)];
            else
                capacities[rank] = recv_capacity;
        }
        if (!rank_barrier(buffer_ptrs, num_ranks, rank, epoch, timeout_ns, error_record,
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
                if (rank_counts[i] > region_tokens)
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
            if (mismatch_flag != nullptr)
                *reinterpret_cast<volatile int*>(mismatch_flag) = verdict;
            if (verdict != 0 && report_refusal)
                report_error(error_record, ERROR_DISPATCH_REFUSED, KERNEL_NOTIFY_DISPATCH, rank, -1, -1, verdict);
        }
        __syncthreads();
        const bool refused = call_verdict != 0;
        if (thread < num_ranks) {
            int running = 0;
            for (int src = 0; src < num_ranks; ++src) {
                running += refused ? 0 : rank_counts[src * num_ranks + thread];
                rank_prefix_matrix[src * num_ranks + thread] = running;
            }
            if (thread == rank)
                num_recv_tokens = running;
        }
        for (int e = thread; e < experts_per_rank; e += num_threads) {
            int sum = 0;
            for (int src = 0; src < num_ranks && !refused; ++src)
                sum += expert_counts[src * experts_per_rank + e];
            sum = (sum + expert_alignment - 1) / expert_alignment * expert_alignment;
            reinterpret_cast<volatile int*>(recv_expert_counter)[e] = sum;
        }
        zero_ints(buffer_ptrs[rank], zero_off, zero_count);
        __syncthreads();
        if (thread == 0) {
            // The count goes last: the host reads the expert counts once it sees it.
            __threadfence_system();
            *reinterpret_cast<volatile int*>(recv_counter) = num_recv_tokens;
        }
        if (rank_barrier(buffer_ptrs, num_ranks, rank, epoch + 1, timeout_ns, error_record,
                         KERNEL_NOTIFY_DISPATCH))
            counters.advance(2, 1);
    } else {
        const int dst = blockIdx.x - 1;
        const int lane = thread % 32, warp = thread / 32, num_warps = num_threads / 32;
        for (int channel = warp; channel < num_channels; channel += num_warps) {
            int begin, end;
            channel_task_range(num_tokens, num_channels, channel, begin, end);
            int count = 0;
            for (int token = begin + lane; token < end; token += 32)
                count += is_token_in_rank[(int64_t_)token * num_ranks + dst] ? 1 : 0;
            count = warp_sum(count);
            if (lane == 0)
                channel_prefix_matrix[dst * num_channels + channel] = count;
        }
        __syncthreads();
        if (thread == 0)
            for (int channel = 1; channel < num_channels; ++channel)
                channel_prefix_matrix[dst * num_channels + channel] +=
                    channel_prefix_matrix[dst * num_channels + channel - 1];
    }
}

// Before a cached dispatch: the layout is known; check the settings and reset the metadata. The
// settings a cached dispatch and a combine compare across ranks: which operation (`op`), row
// bytes, scales per token (dispatch) or element type and top-k (combine) in `row_detail`,
// num_sms, and the two chunk sizes.
extern "C" __global__ void __launch_bounds__(CACHED_NOTIFY_DISPATCH_THREADS) cached_notify_dispatch_kernel(
        void* const* buffer_ptrs, int num_ranks, int rank,
        int op, int row_bytes, int row_detail, int num_sms, int send_chunk, int recv_chunk,
        int64_t_ zero_off, int zero_count, const int* rank_prefix_matrix, int region_tokens,
        const int* dispatch_verdict, int64_t_ timeout_ns, int* error_record) {
    const int settings[SIGNATURE_INTS - 1] = {op, row_bytes, row_detail, num_sms, send_chunk, recv_chunk, 0};
    check_and_reset(buffer_ptrs, num_ranks, rank, settings, zero_off, zero_count, rank_prefix_matrix, region_tokens,
                    dispatch_verdict, timeout_ns, error_record, KERNEL_CACHED_NOTIFY_DISPATCH);
}

extern "C" __global__ void __launch_bounds__(BARRIER_THREADS) barrier_kernel(
        void* const* buffer_ptrs, int num_ranks, int rank, int64_t_ timeout_ns, int* error_record) {
    CallCounters counters(buffer_ptrs, rank);
    if (rank_barrier(buffer_ptrs, num_ranks, rank, counters.first_epoch, timeout_ns, error_record, KERNEL_BARRIER))
        counters.advance(1, 0);
}

// Before a combine: as before a cached dispatch (its own stage in error records).
extern "C" __global__ void __launch_bounds__(CACHED_NOTIFY_COMBINE_THREADS) cached_notify_combine_kernel(
        void* const* buffer_ptrs, int num_ranks, int rank,
        int op, int row_bytes, int row_detail, int num_sms, int send_chunk, int recv_chunk,
        int64_t_ zero_off, int zero_count, const int* rank_prefix_matrix, int region_tokens,
        const int* dispatch_verdict, int64_t_ timeout_ns, int* error_record) {
    const int settings[SIGNATURE_INTS - 1] = {op, row_bytes, row_detail, num_sms, send_chunk, recv_chunk, 0};
    check_and_reset(buffer_ptrs, num_ranks, rank, settings, zero_off, zero_count, rank_prefix_matrix, region_tokens,
                    dispatch_verdict, timeout_ns, error_record, KERNEL_CACHED_NOTIFY_COMBINE);
}
