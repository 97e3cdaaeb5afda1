// combine: the reverse of dispatch. Every rank sends back its copy of each token it received,
// and the token's original owner sums the copies (in float32, ranks in ascending order).
#include "call_check.cuh"

// Regions. The owner's NVLink buffer holds one region per other rank s (region_index(s, owner)),
// of `region_tokens` slots: slot j holds s's copy of the j-th token the owner sent s in the
// dispatch, i.e. the owner's send_head entry for s. The rows s returns to an owner are one
// contiguous block of s's x, and land as one contiguous block of the region. Byte offsets:
//   meta_off:          int tail[C][R]          index channel * R + s: the slot after the last one
//                                              s has written of the owner's dispatch channel
//   x_off:             int4  x[R-1][region_tokens][hidden_int4]
//   topk_weights_off:  float topk_weights[R-1][region_tokens][K]
// Channels are those of the dispatch that made the handle (`num_channels` token ranges of the
// owner). The owner's own copies are not sent: they are rows of its own x.
//
// Grid: `num_senders` sender blocks, then reducer blocks. Sender warps take the (channel, owner)
// blocks in turn and publish a tail every `send_chunk` rows; reducer warps take the owner's
// tokens in the order their copies arrive, wait for each token's copies and sum them.
//
// kInPlace (x written where a dispatch with rows in place put recv_x): nothing is sent. Every rank's
// x is the area at `x_off` of its own NVLink buffer, its rows in that dispatch's receive order, and
// `topk_weights_off` its recv_topk_weights; every block reduces, reading each copy where it lies
// (over NVLink for the other ranks'). The settings check at the start is also the barrier after
// which every rank's rows are written; one barrier at the end keeps each rank's area unchanged
// until every rank has read it.

constexpr int kCombineWarps = COMBINE_THREADS / 32;
#define COMBINE_SEND_UNROLL 8

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

// Sums the copies of `token` (`source_x[r]`: rank r's copy of its row, null where it did not go)
// after its biases, in float32, into its row of `combined_x`; the same for its top-k weights when
// `combined_topk_weights` is not null. One warp.
template <typename T, int kNumRanks>
__device__ __forceinline__ void sum_copies(int64_t_ token, int4* combined_x, float* combined_topk_weights,
                                           const int4* const (&source_x)[kNumRanks],
                                           const float* const (&source_weights)[kNumRanks], const int4* bias_0,
                                           const int4* bias_1, int hidden_int4, int num_topk, int lane) {
    constexpr int kPerInt4 = Elem<T>::kPerInt4;
    int4* out_row = combined_x + token * hidden_int4;
    float* out_weights = combined_topk_weights == nullptr ? nullptr : combined_topk_weights + token * num_topk;
    const int4* bias_0_row = bias_0 == nullptr ? nullptr : bias_0 + token * hidden_int4;
    const int4* bias_1_row = bias_1 == nullptr ? nullptr : bias_1 + token * hidden_int4;
    // Row pieces in flight per lane, within the register budget.
    constexpr int kUnroll = kNumRanks <= 2 ? 4 : (kNumRanks <= 4 ? 2 : 1);
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
    if (out_weights != nullptr && lane < num_topk) {
        float sum = 0.0f;
        #pragma unroll
        for (int j = 0; j < kNumRanks; ++j)
            if (source_weights[j] != nullptr)
                sum += ld_stream(source_weights[j] + lane);
        out_weights[lane] = sum;
    }
}

// kInPlace: each warp of the grid takes tokens in turn (neighbouring tokens on different blocks)
// and sums the copies where they lie: rank r's copy of a token this rank sent it is row
// (first row of this rank's block on r) + (its slot among the tokens r got from this rank) of the
// area at `x_off` of r's buffer (`topk_weights_off` for its weights).
template <typename T, int kNumRanks>
__device__ __forceinline__ void reduce_in_place(int4* combined_x, float* combined_topk_weights, const int4* bias_0,
                                                const int4* bias_1, const int* rank_prefix_matrix,
                                                const int* send_head, int num_tokens, int hidden_int4, int num_topk,
                                                void* const* buffer_ptrs, int rank, int64_t_ x_off,
                                                int64_t_ topk_weights_off) {
    const int lane = threadIdx.x % 32;
    const int first_row = lane < kNumRanks ? block_row(rank_prefix_matrix, kNumRanks, rank, lane) : 0;
    const int num_warps = gridDim.x * kCombineWarps;
    for (int token = blockIdx.x + gridDim.x * (threadIdx.x / 32); token < num_tokens; token += num_warps) {
        const int slot = lane < kNumRanks ? send_head[(int64_t_)token * kNumRanks + lane] : -1;
        const int4* source_x[kNumRanks];
        const float* source_weights[kNumRanks];
        #pragma unroll
        for (int r = 0; r < kNumRanks; ++r) {
            const int position = __shfl_sync(0xffffffffu, slot, r);
            const int64_t_ row = (int64_t_)__shfl_sync(0xffffffffu, first_row, r) + position;
            const char* base = reinterpret_cast<const char*>(buffer_ptrs[r]);
            source_x[r] = position < 0 ? nullptr : reinterpret_cast<const int4*>(base + x_off) + row * hidden_int4;
            source_weights[r] = position < 0 || combined_topk_weights == nullptr
                                    ? nullptr
                                    : reinterpret_cast<const float*>(base + topk_weights_off) + row * num_topk;
        }
        sum_copies<T, kNumRanks>(token, combined_x, combined_topk_weights, source_x, source_weights, bias_0, bias_1,
                                 hidden_int4, num_topk, lane);
    }
}

template <typename T, int kNumRanks, bool kInPlace = false>
__global__ void __launch_bounds__(COMBINE_THREADS, 1) combine_kernel(
        int4* combined_x, float* combined_topk_weights,
        const int4* x, const float* topk_weights, const int4* bias_0, const int4* bias_1,
        const int* rank_prefix_matrix, const int* recv_channel_prefix_matrix,
        const int* send_head, int num_tokens, int num_channels, int hidden_int4, int num_topk,
        void* const* buffer_ptrs, int rank, int64_t_ meta_off, int64_t_ x_off, int64_t_ topk_weights_off,
        int region_tokens, int num_senders, int send_chunk, int check_op, int row_bytes, int row_detail, int num_sms,
        int recv_chunk, int64_t_ zero_off, int zero_count, const int* dispatch_verdict, int64_t_ timeout_ns,
        int* error_record) {
    const int settings[SIGNATURE_INTS - 1] = {check_op, row_bytes, row_detail, num_sms, send_chunk, recv_chunk, 0};
    if (!start_transfer(true, buffer_ptrs, kNumRanks, rank, settings, zero_off, zero_count, rank_prefix_matrix,
                        region_tokens, dispatch_verdict, timeout_ns, error_record, KERNEL_COMBINE_CHECK,
                        KERNEL_COMBINE_SENDER))
        return;  // the ranks disagree on this call, or one gave up on the Buffer: every rank stops here
    if constexpr (kInPlace) {
        reduce_in_place<T, kNumRanks>(combined_x, combined_topk_weights, bias_0, bias_1, rank_prefix_matrix, send_head,
                                      num_tokens, hidden_int4, num_topk, buffer_ptrs, rank, x_off, topk_weights_off);
        end_barrier(buffer_ptrs, kNumRanks, rank, timeout_ns, error_record, KERNEL_COMBINE_RECEIVER);
        return;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    auto tail_word = [&](char* base, int channel, int source) {
        return reinterpret_cast<int*>(base + meta_off) + channel * kNumRanks + source;
    };
    auto region_x = [&](char* base, int region, int slot) {
        return reinterpret_cast<int4*>(base + x_off) + ((int64_t_)region * region_tokens + slot) * hidden_int4;
    };
    auto region_weights = [&](char* base, int region, int slot) {
        return reinterpret_cast<float*>(base + topk_weights_off) + ((int64_t_)region * region_tokens + slot) * num_topk;
    };

    if (blockIdx.x < num_senders) {
        // Work item w: channel w / (R - 1) of the (w % (R - 1))-th rank after this one. Items are
        // dealt to the blocks in turn: there may be fewer items than sender warps, and every
        // sender block's SM adds its own store bandwidth.
        const int num_sender_warps = num_senders * kCombineWarps;
        const int num_items = num_channels * (kNumRanks - 1);
        for (int w = warp * num_senders + blockIdx.x; w < num_items; w += num_sender_warps) {
            const int channel = w / (kNumRanks - 1);
            const int owner = (rank + 1 + w % (kNumRanks - 1)) % kNumRanks;
            const int from_owner = rank_prefix_matrix[owner * kNumRanks + rank] -
                                   block_row(rank_prefix_matrix, kNumRanks, owner, rank);
            const int begin = recv_channel_prefix_matrix[owner * num_channels + channel];
            const int end = channel + 1 < num_channels ? recv_channel_prefix_matrix[owner * num_channels + channel + 1]
                                                       : from_owner;
            const int64_t_ row = block_row(rank_prefix_matrix, kNumRanks, owner, rank);  // row of x for slot 0
            char* base = reinterpret_cast<char*>(buffer_ptrs[owner]);
            const int region = region_index(rank, owner, kNumRanks);
            for (int done = begin; done < end;) {
                const int count = min(send_chunk, end - done);
                warp_copy<COMBINE_SEND_UNROLL>(region_x(base, region, done), x + (row + done) * hidden_int4,
                                               count * hidden_int4, lane);
                if (topk_weights != nullptr) {
                    float* weights = region_weights(base, region, done);
                    for (int i = lane; i < count * num_topk; i += 32)
                        weights[i] = ld_stream(topk_weights + (row + done) * num_topk + i);
                }
                done += count;
                // The whole warp's rows come before the tail that covers them.
                __syncwarp();
                if (lane == 0)
                    st_release_sys(tail_word(base, channel, rank), done);
            }
        }
        return;
    }

    char* base = reinterpret_cast<char*>(buffer_ptrs[rank]);
    const int own_row = block_row(rank_prefix_matrix, kNumRanks, rank, rank);
    const int num_reducer_warps = (gridDim.x - num_senders) * kCombineWarps;
    // Reducer warps take the tokens in the order their copies arrive: the k-th token of every
    // channel before the (k + 1)-th of any (item k * C + c), each waiting for its channel's tails.
    const int per_channel = (num_tokens + num_channels - 1) / num_channels;
    const int num_items = per_channel * num_channels;
    for (int item = (blockIdx.x - num_senders) * kCombineWarps + warp; item < num_items; item += num_reducer_warps) {
        const int channel = item % num_channels;
        int token_begin, token_end;
        channel_task_range(num_tokens, num_channels, channel, token_begin, token_end);
        const int token = token_begin + item / num_channels;
        if (token >= token_end)
            continue;
        const int* tail = tail_word(base, channel, lane < kNumRanks ? lane : 0);
        const int slot = lane < kNumRanks ? send_head[(int64_t_)token * kNumRanks + lane] : -1;
        int failed = 0;
        if (lane < kNumRanks && lane != rank && slot >= 0) {
            PeerWait wait(buffer_ptrs, kNumRanks, rank, timeout_ns, error_record, KERNEL_COMBINE_RECEIVER, channel);
            while (ld_acquire_sys(tail) <= slot) {
                if (wait.failed(lane, slot)) {
                    failed = 1;
                    break;
                }
            }
        }
        if (__any_sync(0xffffffffu, failed))
            return;

        // The copies of this token; null where it was not sent to that rank. (Indexed by
        // rank, a compile-time index after unrolling, so the arrays stay in registers.)
        const int4* source_x[kNumRanks];
        const float* source_weights[kNumRanks];
        #pragma unroll
        for (int r = 0; r < kNumRanks; ++r) {
            const int position = __shfl_sync(0xffffffffu, slot, r);
            source_x[r] = nullptr;
            source_weights[r] = nullptr;
            if (position >= 0 && r == rank) {
                source_x[r] = x + (int64_t_)(own_row + position) * hidden_int4;
                source_weights[r] = topk_weights + (int64_t_)(own_row + position) * num_topk;
            } else if (position >= 0) {
                source_x[r] = region_x(base, region_index(r, rank, kNumRanks), position);
                source_weights[r] = region_weights(base, region_index(r, rank, kNumRanks), position);
            }
        }

        sum_copies<T, kNumRanks>(token, combined_x, combined_topk_weights, source_x, source_weights, bias_0, bias_1,
                                 hidden_int4, num_topk, lane);
    }
}
