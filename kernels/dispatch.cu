// dispatch: every rank sends each of its tokens once to every rank that owns one of its experts.
#include "common.cuh"

// Queues. For channel c and sender s, the queue lives in the RECEIVER's NVLink buffer at index
// q = c * R + s of each region below (byte offsets from the buffer base, computed by
// deepep_cupy/layout.py and passed in):
//   meta_off:          int start[C*R], end[C*R], head[C*R], tail[C*R]
//                      start/end: the channel's token range within the block the receiver gets
//                      from s, stored as -value-1 so that 0 means "not written yet";
//                      tail: slots filled (written by the sender); head: slots consumed (receiver)
//   x_off:             int4 x[C*R][Q][hidden_int4]
//   src_idx_off:       int  src_idx[C*R][Q]
//   topk_idx_off:      int  topk_idx[C*R][Q][K]      (already local expert ids, -1 elsewhere)
//   topk_weights_off:  float topk_weights[C*R][Q][K]
//   scales_off:        float scales[C*R][Q][S]
// Head and tail only grow; slot = position % Q.
//
// Grid: 2 * C blocks; block 2c sends channel c, block 2c+1 receives channel c. In both, the
// threads form one group of kWarpsPerRank warps per peer rank, synchronised by named barrier
// (peer + 1).

// 16-byte loads each lane keeps in flight while copying a token (latency hiding over NVLink).
#define DISPATCH_UNROLL 8

struct DispatchQueues {
    int *start, *end, *head, *tail;
    int4* x;
    int* src_idx;
    int* topk_idx;
    float* topk_weights;
    float* scales;

    __device__ __forceinline__ DispatchQueues(void* base, int queue, int num_queues, int queue_tokens,
                                              int hidden_int4, int num_topk, int num_scales,
                                              int64_t_ meta_off, int64_t_ x_off, int64_t_ src_idx_off,
                                              int64_t_ topk_idx_off, int64_t_ topk_weights_off,
                                              int64_t_ scales_off) {
        char* b = reinterpret_cast<char*>(base);
        int* meta = reinterpret_cast<int*>(b + meta_off);
        start = meta + queue;
        end = meta + num_queues + queue;
        head = meta + 2 * num_queues + queue;
        tail = meta + 3 * num_queues + queue;
        const int64_t_ first_slot = (int64_t_)queue * queue_tokens;
        x = reinterpret_cast<int4*>(b + x_off) + first_slot * hidden_int4;
        src_idx = reinterpret_cast<int*>(b + src_idx_off) + first_slot;
        topk_idx = reinterpret_cast<int*>(b + topk_idx_off) + first_slot * num_topk;
        topk_weights = reinterpret_cast<float*>(b + topk_weights_off) + first_slot * num_topk;
        scales = reinterpret_cast<float*>(b + scales_off) + first_slot * num_scales;
    }
};

// kStridedScales: the FP8 scales are read with the strides passed (DeepEP passes them
// column-major); otherwise as row-major [num_tokens][num_scales], which keeps the token loop's
// code as fast as it was (a general stride there cost 40 us at 4096 tokens, docs/PERF_NOTES.md).
template <int kNumRanks, bool kStridedScales = false>
__global__ void __launch_bounds__(DISPATCH_THREADS, 1) dispatch_kernel(
        int4* recv_x, float* recv_x_scales, int* recv_src_idx, int64_t_* recv_topk_idx,
        float* recv_topk_weights, int* recv_channel_prefix_matrix, int* send_head,
        const int4* x, const float* x_scales, const int64_t_* topk_idx, const float* topk_weights,
        const bool* is_token_in_rank, const int* channel_prefix_matrix, const int* rank_prefix_matrix,
        int num_tokens, int hidden_int4, int num_topk, int num_experts, int num_scales,
        int scale_token_stride, int scale_hidden_stride, void* const* buffer_ptrs, int rank,
        int64_t_ meta_off, int64_t_ x_off, int64_t_ src_idx_off, int64_t_ topk_idx_off,
        int64_t_ topk_weights_off, int64_t_ scales_off,
        int max_send_tokens, int queue_tokens, int64_t_ timeout_ns, int* error_record) {
    if (!transfer_may_start(buffer_ptrs, rank, error_record, KERNEL_DISPATCH_SENDER))
        return;  // the ranks disagree on this call, or one gave up on the Buffer: every rank stops here
    constexpr int kWarpsPerRank = DISPATCH_THREADS / 32 / kNumRanks;
    constexpr int kGroupThreads = kWarpsPerRank * 32;
    const int thread = threadIdx.x, lane = thread % 32;
    const int peer = thread / kGroupThreads;
    if (peer >= kNumRanks)
        return;  // leftover warps when 16 warps do not split evenly over the ranks
    const int warp_in_group = (thread % kGroupThreads) / 32;
    const int thread_in_group = thread % kGroupThreads;
    const int barrier_id = peer + 1;
    const int num_channels = gridDim.x / 2, channel = blockIdx.x / 2;
    const bool is_sender = blockIdx.x % 2 == 0;
    const int num_queues = num_channels * kNumRanks;

    __shared__ int group_abort[kNumRanks];
    __shared__ int group_tail[kNumRanks];
    if (thread_in_group == 0)
        group_abort[peer] = 0;
    group_sync(barrier_id, kGroupThreads);

    if (is_sender) {
        // Our queue for this channel in the peer's buffer.
        DispatchQueues q(buffer_ptrs[peer], channel * kNumRanks + rank, num_queues, queue_tokens,
                         hidden_int4, num_topk, num_scales, meta_off, x_off, src_idx_off,
                         topk_idx_off, topk_weights_off, scales_off);
        const int experts_per_rank = num_experts / kNumRanks;
        const int expert_begin = peer * experts_per_rank, expert_end = expert_begin + experts_per_rank;

        if (thread_in_group == 0) {
            const int before = channel > 0 ? channel_prefix_matrix[peer * num_channels + channel - 1] : 0;
            const int through = channel_prefix_matrix[peer * num_channels + channel];
            st_relaxed_sys(q.start, -before - 1);
            st_relaxed_sys(q.end, -through - 1);
        }

        int token_begin, token_end;
        channel_task_range(num_tokens, num_channels, channel, token_begin, token_end);
        int tail = 0;
        int known_head = 0;  // last head read from the peer: reading it again costs an NVLink round trip
        for (int token = token_begin; token < token_end;) {
            // Wait until a whole chunk fits (counting the worst case: every token selected).
            if (lane == 0 && queue_tokens - (tail - known_head) < max_send_tokens) {
                PeerWait wait(buffer_ptrs, kNumRanks, rank, timeout_ns, error_record, KERNEL_DISPATCH_SENDER, channel);
                while (queue_tokens - (tail - (known_head = ld_volatile(q.head))) < max_send_tokens) {
                    if (wait.failed(peer, tail)) {
                        group_abort[peer] = 1;
                        break;
                    }
                }
            }
            __syncwarp();
            const bool aborting = group_abort[peer] != 0;

            for (int sent = 0; sent < max_send_tokens && token < token_end; ++token) {
                const bool selected = is_token_in_rank[(int64_t_)token * kNumRanks + peer];
                if (send_head != nullptr && lane == 0 && token % kWarpsPerRank == warp_in_group)
                    send_head[(int64_t_)token * kNumRanks + peer] = selected ? tail : -1;
                if (!selected)
                    continue;
                // Warps take the selected tokens round-robin. The side data is loaded before the
                // row so that its latency hides behind the row copy instead of following it.
                if (!aborting && tail % kWarpsPerRank == warp_in_group) {
                    const int slot = tail % queue_tokens;
                    int local_expert = -1;
                    float weight = 0.0f, scale0 = 0.0f, scale1 = 0.0f;
                    if (lane < num_topk) {
                        const int64_t_ expert = ld_stream(topk_idx + (int64_t_)token * num_topk + lane);
                        if (topk_weights != nullptr)
                            weight = ld_stream(topk_weights + (int64_t_)token * num_topk + lane);
                        const bool local = expert >= expert_begin && expert < expert_end;
                        local_expert = local ? (int)(expert - expert_begin) : -1;
                        weight = local ? weight : 0.0f;
                    }
                    const int64_t_ token_stride = kStridedScales ? scale_token_stride : num_scales;
                    const int64_t_ scale_stride = kStridedScales ? scale_hidden_stride : 1;
                    const float* token_scales = x_scales + (int64_t_)token * token_stride;
                    if (lane < num_scales)
                        scale0 = ld_stream(token_scales + lane * scale_stride);
                    if (lane + 32 < num_scales)
                        scale1 = ld_stream(token_scales + (lane + 32) * scale_stride);
                    warp_copy<DISPATCH_UNROLL>(q.x + (int64_t_)slot * hidden_int4, x + (int64_t_)token * hidden_int4,
                                               hidden_int4, lane);
                    if (lane == 0)
                        q.src_idx[slot] = token;
                    if (lane < num_topk) {
                        q.topk_idx[slot * num_topk + lane] = local_expert;
                        if (topk_weights != nullptr)
                            q.topk_weights[slot * num_topk + lane] = weight;
                    }
                    float* slot_scales = q.scales + (int64_t_)slot * num_scales;
                    if (lane < num_scales)
                        slot_scales[lane] = scale0;
                    if (lane + 32 < num_scales)
                        slot_scales[lane + 32] = scale1;
                    for (int i = lane + 64; i < num_scales; i += 32)  // rows wider than 8192 FP8 values
                        slot_scales[i] = token_scales[i * scale_stride];
                }
                ++tail, ++sent;
            }

            // All warps of the group have written their tokens of the chunk: publish the tail.
            group_sync(barrier_id, kGroupThreads);
            if (group_abort[peer] != 0)
                break;
            if (thread_in_group == 0)
                st_release_sys(q.tail, tail);
        }
    } else {
        // The sender `peer`'s queue for this channel, in our own buffer.
        DispatchQueues q(buffer_ptrs[rank], channel * kNumRanks + peer, num_queues, queue_tokens,
                         hidden_int4, num_topk, num_scales, meta_off, x_off, src_idx_off,
                         topk_idx_off, topk_weights_off, scales_off);
        int begin = 0, end = 0;
        if (thread_in_group == 0) {
            PeerWait wait(buffer_ptrs, kNumRanks, rank, timeout_ns, error_record, KERNEL_DISPATCH_RECEIVER, channel);
            int start_code = 0, end_code = 0;
            while ((start_code = ld_volatile(q.start)) == 0 || (end_code = ld_volatile(q.end)) == 0) {
                if (wait.failed(peer, -1)) {
                    group_abort[peer] = 1;
                    break;
                }
            }
            begin = -start_code - 1;
            end = -end_code - 1;
            group_tail[peer] = begin;
            if (recv_channel_prefix_matrix != nullptr && group_abort[peer] == 0)
                recv_channel_prefix_matrix[peer * num_channels + channel] = begin;
        }
        __shared__ int group_end[kNumRanks];
        if (thread_in_group == 0)
            group_end[peer] = end;
        group_sync(barrier_id, kGroupThreads);
        if (group_abort[peer] != 0)
            return;
        begin = group_tail[peer];
        end = group_end[peer];
        group_sync(barrier_id, kGroupThreads);

        const int rank_offset = peer > 0 ? rank_prefix_matrix[(peer - 1) * kNumRanks + rank] : 0;
        int64_t_ out = rank_offset + begin;  // row of recv_x for the next token
        int remaining = end - begin;
        int head = 0;
        while (remaining > 0) {
            if (thread_in_group == 0) {
                PeerWait wait(buffer_ptrs, kNumRanks, rank, timeout_ns, error_record, KERNEL_DISPATCH_RECEIVER,
                              channel);
                int tail;
                while ((tail = ld_acquire_sys(q.tail)) == head) {
                    if (wait.failed(peer, remaining)) {
                        group_abort[peer] = 1;
                        break;
                    }
                }
                group_tail[peer] = tail;
            }
            group_sync(barrier_id, kGroupThreads);
            if (group_abort[peer] != 0)
                break;
            const int count = group_tail[peer] - head;

            // One warp per token: side data loads first, then the row, then the side data stores.
            for (int i = warp_in_group; i < count; i += kWarpsPerRank) {
                const int slot = (head + i) % queue_tokens;
                const int64_t_ row = out + i;
                int src = 0, expert = -1;
                float weight = 0.0f, scale0 = 0.0f, scale1 = 0.0f;
                if (lane == 0 && recv_src_idx != nullptr)
                    src = ld_stream(q.src_idx + slot);
                if (lane < num_topk && recv_topk_idx != nullptr) {
                    expert = ld_stream(q.topk_idx + slot * num_topk + lane);
                    if (recv_topk_weights != nullptr)
                        weight = ld_stream(q.topk_weights + slot * num_topk + lane);
                }
                const float* slot_scales = q.scales + (int64_t_)slot * num_scales;
                if (lane < num_scales)
                    scale0 = ld_stream(slot_scales + lane);
                if (lane + 32 < num_scales)
                    scale1 = ld_stream(slot_scales + lane + 32);
                warp_copy<DISPATCH_UNROLL>(recv_x + row * hidden_int4, q.x + (int64_t_)slot * hidden_int4,
                                           hidden_int4, lane);
                if (lane == 0 && recv_src_idx != nullptr)
                    recv_src_idx[row] = src;
                if (lane < num_topk && recv_topk_idx != nullptr) {
                    recv_topk_idx[row * num_topk + lane] = expert;
                    if (recv_topk_weights != nullptr)
                        recv_topk_weights[row * num_topk + lane] = weight;
                }
                float* row_scales = recv_x_scales + row * num_scales;
                if (lane < num_scales)
                    row_scales[lane] = scale0;
                if (lane + 32 < num_scales)
                    row_scales[lane + 32] = scale1;
                for (int j = lane + 64; j < num_scales; j += 32)
                    row_scales[j] = ld_stream(slot_scales + j);
            }

            head += count;
            out += count;
            remaining -= count;
            // Every warp is done reading these slots: hand them back to the sender.
            group_sync(barrier_id, kGroupThreads);
            if (thread_in_group == 0)
                st_relaxed_sys(q.head, head);
        }
    }
}
