// combine: the reverse of dispatch. Every rank sends back its copy of each token it received,
// and the token's original owner sums the copies (in float32, ranks in ascending order).
#include "common.cuh"

// Queues. For channel c and returning rank s, the queue lives in the buffer of the rank that
// owns the tokens (the receiver of the combine), at index q = c * R + s of each region:
//   meta_off:          int head[C*R], tail[C*R]
//   x_off:             int4 x[C*R][Q][hidden_int4]
//   topk_weights_off:  float topk_weights[C*R][Q][K]
// A channel's tokens travel back through the same channel they went out on, in the same order,
// so a token's slot in the combine queue from rank s is its dispatch `send_head` entry for s.
//
// Grid: 2 * C blocks; block 2c sends channel c, block 2c+1 receives and reduces channel c.
// Sender blocks form one group of warps per destination rank (named barrier peer + 1).
// Receiver blocks: warp 0 keeps the queues (polls tails, publishes heads), the other warps
// reduce tokens round-robin and report how far each queue has been consumed.

#define COMBINE_SEND_UNROLL 4

// sum += piece i of `row` (nothing for a null row).
template <typename T>
__device__ __forceinline__ void add_row_piece(float* sum, const int4* row, int i) {
    if (row == nullptr)
        return;
    float values[Elem<T>::kPerInt4];
    Elem<T>::unpack(ld_stream(row + i), values);
    #pragma unroll
    for (int k = 0; k < Elem<T>::kPerInt4; ++k)
        sum[k] += values[k];
}

template <typename T, int kNumRanks>
__global__ void __launch_bounds__(COMBINE_THREADS, 1) combine_kernel(
        int4* combined_x, float* combined_topk_weights,
        const int4* x, const float* topk_weights, const int4* bias_0, const int4* bias_1,
        const int* rank_prefix_matrix, const int* recv_channel_prefix_matrix, const int* combine_head,
        int num_tokens, int hidden_int4, int num_topk,
        void* const* buffer_ptrs, int rank,
        int64_t_ meta_off, int64_t_ x_off, int64_t_ topk_weights_off,
        int max_send_tokens, int queue_tokens, int64_t_ timeout_ns, int* error_record) {
    if (!transfer_may_start(buffer_ptrs, rank, error_record, KERNEL_COMBINE_SENDER))
        return;  // the ranks disagree on this call, or one gave up on the Buffer: every rank stops here
    const int thread = threadIdx.x, lane = thread % 32;
    const int num_channels = gridDim.x / 2, channel = blockIdx.x / 2;
    const int num_queues = num_channels * kNumRanks;
    const int64_t_ queue_x_ints = (int64_t_)queue_tokens * hidden_int4;

    if (blockIdx.x % 2 == 0) {
        constexpr int kWarpsPerRank = COMBINE_THREADS / 32 / kNumRanks;
        constexpr int kGroupThreads = kWarpsPerRank * 32;
        const int peer = thread / kGroupThreads;
        if (peer >= kNumRanks)
            return;
        const int warp_in_group = (thread % kGroupThreads) / 32;
        const int thread_in_group = thread % kGroupThreads;
        const int barrier_id = peer + 1;
        __shared__ int group_abort[kNumRanks];
        if (thread_in_group == 0)
            group_abort[peer] = 0;
        group_sync(barrier_id, kGroupThreads);

        // Our queue in the peer's buffer.
        const int queue = channel * kNumRanks + rank;
        char* base = reinterpret_cast<char*>(buffer_ptrs[peer]);
        int* head_ptr = reinterpret_cast<int*>(base + meta_off) + queue;
        int* tail_ptr = reinterpret_cast<int*>(base + meta_off) + num_queues + queue;
        int4* queue_x = reinterpret_cast<int4*>(base + x_off) + queue * queue_x_ints;
        float* queue_weights = reinterpret_cast<float*>(base + topk_weights_off) + (int64_t_)queue * queue_tokens * num_topk;

        // The rows of x that came from `peer` through this channel.
        const int rank_offset = peer > 0 ? rank_prefix_matrix[(peer - 1) * kNumRanks + rank] : 0;
        const int from_peer = rank_prefix_matrix[peer * kNumRanks + rank] - rank_offset;
        const int channel_begin = recv_channel_prefix_matrix[peer * num_channels + channel];
        const int channel_end = channel + 1 < num_channels
                                ? recv_channel_prefix_matrix[peer * num_channels + channel + 1] : from_peer;
        const int row_end = rank_offset + channel_end;

        int tail = 0;
        int known_head = 0;  // last head read from the peer: reading it again costs an NVLink round trip
        for (int row = rank_offset + channel_begin; row < row_end;) {
            const int chunk = min(max_send_tokens, row_end - row);
            if (lane == 0 && queue_tokens - (tail - known_head) < chunk) {
                PeerWait wait(buffer_ptrs, kNumRanks, rank, timeout_ns, error_record, KERNEL_COMBINE_SENDER, channel);
                while (queue_tokens - (tail - (known_head = ld_volatile(head_ptr))) < chunk) {
                    if (wait.failed(peer, tail)) {
                        group_abort[peer] = 1;
                        break;
                    }
                }
            }
            __syncwarp();
            if (group_abort[peer] == 0) {
                for (int i = warp_in_group; i < chunk; i += kWarpsPerRank) {
                    const int slot = (tail + i) % queue_tokens;
                    // The weight is loaded before the row so that its latency hides behind the copy.
                    float weight = 0.0f;
                    if (topk_weights != nullptr && lane < num_topk)
                        weight = ld_stream(topk_weights + (int64_t_)(row + i) * num_topk + lane);
                    warp_copy<COMBINE_SEND_UNROLL>(queue_x + (int64_t_)slot * hidden_int4,
                                                   x + (int64_t_)(row + i) * hidden_int4, hidden_int4, lane);
                    if (topk_weights != nullptr && lane < num_topk)
                        queue_weights[slot * num_topk + lane] = weight;
                }
            }
            row += chunk;
            tail += chunk;
            group_sync(barrier_id, kGroupThreads);
            if (group_abort[peer] != 0)
                break;
            if (thread_in_group == 0)
                st_release_sys(tail_ptr, tail);
        }
        return;
    }

    constexpr int kNumWarps = COMBINE_THREADS / 32;
    const int warp = thread / 32;
    __shared__ volatile int warp_head[kNumWarps][kNumRanks];  // per reducer warp: slots it no longer needs
    __shared__ volatile int queue_tail[kNumRanks];
    __shared__ volatile int warp_retired[kNumWarps];
    __shared__ volatile int abort_flag;
    if (thread < kNumWarps)
        warp_retired[thread] = 0;
    if (lane < kNumRanks)
        warp_head[warp][lane] = 0;
    if (thread < kNumRanks)
        queue_tail[thread] = 0;
    if (thread == 0)
        abort_flag = 0;
    __syncthreads();

    char* base = reinterpret_cast<char*>(buffer_ptrs[rank]);
    if (warp == 0) {
        // Queue keeper: lane r follows the queue from rank r.
        if (lane >= kNumRanks)
            return;
        int* head_ptr = reinterpret_cast<int*>(base + meta_off) + channel * kNumRanks + lane;
        int* tail_ptr = head_ptr + num_queues;
        int published_head = 0;
        unsigned polls = 0;
        while (true) {
            bool all_retired = true;
            int min_head = 0x7fffffff;
            for (int w = 1; w < kNumWarps; ++w) {
                if (!warp_retired[w]) {
                    all_retired = false;
                    min_head = min(min_head, warp_head[w][lane]);
                }
            }
            if (all_retired)
                break;
            queue_tail[lane] = ld_acquire_sys(tail_ptr);
            if (min_head != 0x7fffffff && min_head > published_head)
                st_relaxed_sys(head_ptr, published_head = min_head);
            // A rank that gave up mid-transfer stops the reducers now, not at their own deadline.
            if (lane == 0 && ++polls % kPollsPerAbortCheck == 0 && !abort_flag &&
                stop_if_a_rank_gave_up(buffer_ptrs, error_record, KERNEL_COMBINE_RECEIVER, rank, channel, -1))
                abort_flag = 1;
        }
        return;
    }

    constexpr int kPerInt4 = Elem<T>::kPerInt4;
    // Row pieces in flight per lane, within the register budget of 768 threads.
    constexpr int kUnroll = kNumRanks <= 2 ? 4 : (kNumRanks <= 4 ? 2 : 1);
    int token_begin, token_end;
    channel_task_range(num_tokens, num_channels, channel, token_begin, token_end);
    for (int token = token_begin + warp - 1; token < token_end; token += kNumWarps - 1) {
        const int expected = lane < kNumRanks ? combine_head[(int64_t_)token * kNumRanks + lane] : -1;
        // Before waiting, say which slot this warp needs now: the head the keeper publishes is the
        // smallest slot any warp still needs, so the senders may fill every slot up to a queue
        // ahead of it. (Saying only what a warp has finished lags by a round of warps: with fewer
        // queue slots than reducer warps the senders then wait for a head that never moves.)
        if (lane < kNumRanks)
            warp_head[warp][lane] = expected >= 0 ? expected : -expected - 1;
        bool gave_up = false;
        if (expected >= 0) {
            Deadline deadline(timeout_ns);
            while (queue_tail[lane] <= expected) {
                if (abort_flag) {
                    gave_up = true;
                    break;
                }
                if (deadline.expired()) {
                    give_up(buffer_ptrs, kNumRanks, error_record, KERNEL_COMBINE_RECEIVER, rank, channel, lane,
                            expected);
                    abort_flag = 1;
                    gave_up = true;
                    break;
                }
            }
        }
        if (__any_sync(0xffffffffu, gave_up))
            break;

        // The queued copies of this token; null where the token was not sent to that rank.
        // (Indexed by rank, a compile-time index after unrolling, so the arrays stay in registers.)
        const int4* source_x[kNumRanks];
        const float* source_weights[kNumRanks];
        #pragma unroll
        for (int r = 0; r < kNumRanks; ++r) {
            const int position = __shfl_sync(0xffffffffu, expected, r);
            source_x[r] = nullptr;
            source_weights[r] = nullptr;
            if (position >= 0) {
                const int64_t_ slot = (int64_t_)(channel * kNumRanks + r) * queue_tokens + position % queue_tokens;
                source_x[r] = reinterpret_cast<const int4*>(base + x_off) + slot * hidden_int4;
                source_weights[r] = reinterpret_cast<const float*>(base + topk_weights_off) + slot * num_topk;
            }
        }

        int4* out_row = combined_x + (int64_t_)token * hidden_int4;
        const int4* bias_0_row = bias_0 == nullptr ? nullptr : bias_0 + (int64_t_)token * hidden_int4;
        const int4* bias_1_row = bias_1 == nullptr ? nullptr : bias_1 + (int64_t_)token * hidden_int4;
        for (int i0 = lane; i0 < hidden_int4; i0 += 32 * kUnroll) {
            int4 loaded[kUnroll][kNumRanks];
            #pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = i0 + u * 32;
                #pragma unroll
                for (int j = 0; j < kNumRanks; ++j)
                    if (source_x[j] != nullptr && i < hidden_int4)
                        loaded[u][j] = ld_stream(source_x[j] + i);
            }
            #pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = i0 + u * 32;
                if (i >= hidden_int4)
                    break;
                // The biases come first in the sum (the reference's order).
                float sum[kPerInt4];
                #pragma unroll
                for (int k = 0; k < kPerInt4; ++k)
                    sum[k] = 0.0f;
                add_row_piece<T>(sum, bias_0_row, i);
                add_row_piece<T>(sum, bias_1_row, i);
                #pragma unroll
                for (int j = 0; j < kNumRanks; ++j) {
                    if (source_x[j] != nullptr) {
                        float values[kPerInt4];
                        Elem<T>::unpack(loaded[u][j], values);
                        #pragma unroll
                        for (int k = 0; k < kPerInt4; ++k)
                            sum[k] += values[k];
                    }
                }
                out_row[i] = Elem<T>::pack(sum);
            }
        }
        if (combined_topk_weights != nullptr && lane < num_topk) {
            float sum = 0.0f;
            #pragma unroll
            for (int j = 0; j < kNumRanks; ++j)
                if (source_weights[j] != nullptr)
                    sum += ld_stream(source_weights[j] + lane);
            combined_topk_weights[(int64_t_)token * num_topk + lane] = sum;
        }

        if (lane < kNumRanks)
            warp_head[warp][lane] = expected >= 0 ? expected + 1 : -expected - 1;
    }
    __syncwarp();
    if (lane == 0)
        warp_retired[warp] = 1;
}
