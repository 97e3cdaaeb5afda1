// dispatch: every rank sends each of its tokens once to every rank that owns one of its experts.
#include "count_exchange.cuh"

// Regions. A receiver's NVLink buffer holds one region per other rank s (region_index(s, receiver)),
// of `region_tokens` slots. Slot j of the region of s holds the j-th token, in token order, that
// s sends to the receiver: the region is, row for row, the block of recv_x that comes from s, so
// nothing ever waits for free space. Byte offsets from the buffer base (deepep_cupy/layout.py):
//   meta_off:          int start[C][R], end[C][R], tail[C][R]       index channel * R + s
//                      start/end: the channel's slot range, stored as -value-1 so that 0 means
//                      "not written yet"; tail: the slot after the last one written (0: none)
//   x_off:             int4  x[R-1][region_tokens][hidden_int4]
//   src_idx_off:       int   src_idx[R-1][region_tokens]
//   topk_idx_off:      int   topk_idx[R-1][region_tokens][K]   (local expert ids, -1 elsewhere)
//   topk_weights_off:  float topk_weights[R-1][region_tokens][K]
//   scales_off:        float scales[R-1][region_tokens][S]
//
// Grid: `num_senders` sender blocks, then receiver blocks. Every sender warp is one channel: a
// contiguous range of the rank's tokens (C = num_senders * warps per block). It reads each token
// once and writes it to the region of every other rank that takes it, publishing its tail every
// `send_chunk` tokens (and after each of its last ones, for large rows); that is all senders do,
// so that few SMs keep the links busy. Receiver warps take the (channel, source) queues in turn:
// a queue from another rank is copied into recv_x as its tail advances (the block of recv_x from
// a source is contiguous, as its region is); the queue from this rank itself is its own tokens of
// that channel, copied from x.
//
// kRowsInBuffer (recv_x_in_buffer): the outputs live in the receivers' NVLink buffers and every
// block writes rows there (`num_senders` of them to the peers); see send_in_place below.
constexpr int kDispatchWarps = DISPATCH_THREADS / 32;
// 16-byte loads each lane keeps in flight while copying (latency hiding over NVLink); halved for
// more than 4 ranks, whose destination addresses take the registers.
#define DISPATCH_UNROLL 8
// Rows of at least this many 16-byte words (8 KiB) end each channel with single-token tails.
constexpr int kPublishSinglyRowInt4 = 512;

// A token's FP8 scales into `out`: `scale0`, `scale1` (already loaded by lanes 0..63), then any
// beyond 64 (rows wider than 8192 FP8 values) read now.
__device__ __forceinline__ void write_scales(float* out, int num_scales, float scale0, float scale1,
                                             const float* token_scales, int64_t_ scale_stride, int lane) {
    if (lane < num_scales)
        out[lane] = scale0;
    if (lane + 32 < num_scales)
        out[lane + 32] = scale1;
    for (int i = lane + 64; i < num_scales; i += 32)
        out[i] = token_scales[i * scale_stride];
}

struct DispatchRegions {
    char* base;  // one rank's NVLink buffer
    int num_channels, region_tokens, hidden_int4, num_topk, num_scales;
    int64_t_ meta_off, x_off, src_idx_off, topk_idx_off, topk_weights_off, scales_off;

    // The same regions in the buffer at `other_base` (a peer's).
    __device__ __forceinline__ DispatchRegions in(void* other_base) const {
        DispatchRegions other = *this;
        other.base = reinterpret_cast<char*>(other_base);
        return other;
    }
    __device__ __forceinline__ int* start(int channel, int source, int num_ranks) const {
        return reinterpret_cast<int*>(base + meta_off) + channel * num_ranks + source;
    }
    __device__ __forceinline__ int* end(int channel, int source, int num_ranks) const {
        return start(channel, source, num_ranks) + num_channels * num_ranks;
    }
    __device__ __forceinline__ int* tail(int channel, int source, int num_ranks) const {
        return start(channel, source, num_ranks) + 2 * num_channels * num_ranks;
    }
    // Slot j of region `region`, counted from the first slot of the first region.
    __device__ __forceinline__ int64_t_ slot(int region, int j) const {
        return (int64_t_)region * region_tokens + j;
    }
    __device__ __forceinline__ int4* x(int64_t_ slot) const {
        return reinterpret_cast<int4*>(base + x_off) + slot * hidden_int4;
    }
    __device__ __forceinline__ int* src_idx(int64_t_ slot) const {
        return reinterpret_cast<int*>(base + src_idx_off) + slot;
    }
    __device__ __forceinline__ int* topk_idx(int64_t_ slot) const {
        return reinterpret_cast<int*>(base + topk_idx_off) + slot * num_topk;
    }
    __device__ __forceinline__ float* topk_weights(int64_t_ slot) const {
        return reinterpret_cast<float*>(base + topk_weights_off) + slot * num_topk;
    }
    __device__ __forceinline__ float* scales(int64_t_ slot) const {
        return reinterpret_cast<float*>(base + scales_off) + slot * num_scales;
    }
};

// A token's top-k entries (lane k holds entry k) and FP8 scales (lanes hold scales lane and
// lane + 32), loaded before its row so that their latency hides behind the row's copy.
struct TokenSide {
    int64_t_ expert;
    float weight, scale0, scale1;
    const float* scales;  // the token's scales in x_scales
    int64_t_ scale_stride;

    template <bool kStridedScales>
    __device__ __forceinline__ void load(int token, const int64_t_* topk_idx, const float* topk_weights, int num_topk,
                                         const float* x_scales, int num_scales, int scale_token_stride,
                                         int scale_hidden_stride, int lane) {
        expert = -1;
        weight = scale0 = scale1 = 0.0f;
        if (topk_idx != nullptr && lane < num_topk) {
            expert = ld_stream(topk_idx + (int64_t_)token * num_topk + lane);
            if (topk_weights != nullptr)
                weight = ld_stream(topk_weights + (int64_t_)token * num_topk + lane);
        }
        const int64_t_ token_stride = kStridedScales ? scale_token_stride : num_scales;
        scale_stride = kStridedScales ? scale_hidden_stride : 1;
        scales = x_scales + (int64_t_)token * token_stride;
        if (lane < num_scales)
            scale0 = ld_stream(scales + lane * scale_stride);
        if (lane + 32 < num_scales)
            scale1 = ld_stream(scales + (lane + 32) * scale_stride);
    }

    // Lane k's entry as rank `owner` sees it: its local expert id (-1 when another rank's).
    __device__ __forceinline__ int local_expert(int owner, int experts_per_rank) const {
        const bool local = expert >= (int64_t_)owner * experts_per_rank &&
                           expert < (int64_t_)(owner + 1) * experts_per_rank;
        return local ? (int)(expert - (int64_t_)owner * experts_per_rank) : -1;
    }

    // The top-k entries (ids as `int_t`) and scales, as rank `owner` receives them.
    template <typename int_t>
    __device__ __forceinline__ void write(int owner, int experts_per_rank, int num_topk, int_t* ids, float* weights,
                                          int num_scales, float* out_scales, int lane) const {
        const int id = local_expert(owner, experts_per_rank);
        if (ids != nullptr && lane < num_topk) {
            ids[lane] = id;
            if (weights != nullptr)
                weights[lane] = id >= 0 ? weight : 0.0f;
        }
        write_scales(out_scales, num_scales, scale0, scale1, scales, scale_stride, lane);
    }
};

// The routing of tokens [batch, batch + 32) (before `token_end`): lane i reads token batch + i's,
// ballots give every lane all of it (bit i of routed[d]: the token goes to rank d). With a
// `send_head`, each of those tokens' slot at every destination (counted on from `next_slot`),
// -1 where it does not go. Only the destinations in `dest_mask` (bit d: rank d) are routed and
// written; the others are left to another warp.
template <int kNumRanks>
__device__ __forceinline__ void route_batch(unsigned (&routed)[kNumRanks], const bool* is_token_in_rank, int batch,
                                            int token_end, int* send_head, const int (&next_slot)[kNumRanks],
                                            int lane, unsigned dest_mask = 0xffffffffu) {
    const int lane_token = batch + lane;
    #pragma unroll
    for (int d = 0; d < kNumRanks; ++d)
        routed[d] = __ballot_sync(0xffffffffu, lane_token < token_end && ((dest_mask >> d) & 1u) &&
                                  is_token_in_rank[(int64_t_)lane_token * kNumRanks + d]);
    if (send_head != nullptr && lane_token < token_end) {
        const unsigned below = (1u << lane) - 1u;
        #pragma unroll
        for (int d = 0; d < kNumRanks; ++d)
            if ((dest_mask >> d) & 1u)
                send_head[(int64_t_)lane_token * kNumRanks + d] =
                    (routed[d] >> lane) & 1u ? next_slot[d] + __popc(routed[d] & below) : -1;
    }
}

// A dispatch whose outputs are views of the receivers' NVLink buffers, the x area (layout.py):
//   x_off:             int4      x[R * region_tokens][hidden_int4]      recv_x
//   src_idx_off:       int       src_idx[R * region_tokens]              (copied into the handle)
//   topk_idx_off:      int64     topk_idx[R * region_tokens][K]          recv_topk_idx
//   topk_weights_off:  float     topk_weights[R * region_tokens][K]      recv_topk_weights
//   scales_off:        float     scales[R * region_tokens][S]            recv_x_scales
//   meta_off:          int       start[C][R]: channel c of source s starts at row start[c][s] of s's block
// Every warp of a group of blocks takes an equal share of the rank's tokens and writes each token,
// with its per-token data, straight into its row at every rank of the group's destinations that
// takes it: nobody waits for anybody while rows move, and no SM copies them out. With
// `num_peer_blocks` below the grid, the last `num_peer_blocks` blocks write the rows for the other
// ranks and the first ones this rank's own rows (an SM's stores to its own memory slow its NVLink
// pushes: apart, the pushing blocks fill the links); otherwise one group, every destination. The
// row is the token's position among those the rank sends that destination, after the rows of
// lower ranks, so it is known from the channel prefix matrix and a count of the channel's tokens
// before the warp's.
// The receivers learn that every row has landed from one barrier at the end (every block fences
// its stores and arrives at a grid sync; block 0 then meets the other ranks), after which block 0
// copies the source indices and channel starts into the handle.
struct InPlaceDispatch {
    const int4* x;
    const float* x_scales;
    const int64_t_* topk_idx;
    const float* topk_weights;
    const bool* is_token_in_rank;
    const int* channel_prefix_matrix;
    const int* rank_prefix_matrix;
    int* send_head;
    int* recv_src_idx;
    int* recv_channel_prefix_matrix;
    void* const* buffer_ptrs;
    int rank, num_tokens, num_channels, num_peer_blocks, hidden_int4, num_topk, num_experts, num_scales;
    int scale_token_stride, scale_hidden_stride;
    int64_t_ meta_off, x_off, src_idx_off, topk_idx_off, topk_weights_off, scales_off, timeout_ns;
    int* error_record;

    __device__ __forceinline__ char* base(int r) const { return reinterpret_cast<char*>(buffer_ptrs[r]); }
};

template <int kNumRanks, bool kStridedScales, int kUnroll>
__device__ __forceinline__ void send_in_place(const InPlaceDispatch& p) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int num_own_blocks = gridDim.x - p.num_peer_blocks;
    const bool split = num_own_blocks > 0;
    const bool own_rows = (int)blockIdx.x < num_own_blocks;
    const int group_blocks = !split ? gridDim.x : own_rows ? num_own_blocks : p.num_peer_blocks;
    const int group_block = own_rows ? blockIdx.x : blockIdx.x - num_own_blocks;
    const unsigned dest_mask = !split ? 0xffffffffu : own_rows ? 1u << p.rank : ~(1u << p.rank);
    // Consecutive shares on different blocks, so that every block gets some of every channel's.
    const int share = warp * group_blocks + group_block;
    int token_begin, token_end;
    channel_task_range(p.num_tokens, group_blocks * kDispatchWarps, share, token_begin, token_end);
    // Per destination, the row (within this rank's block there) of the next token routed to it.
    int next_slot[kNumRanks];
    if (token_begin < token_end) {
        const int per_channel = (p.num_tokens + p.num_channels - 1) / p.num_channels;
        const int channel = token_begin / per_channel;
        #pragma unroll
        for (int d = 0; d < kNumRanks; ++d)
            next_slot[d] = channel > 0 ? p.channel_prefix_matrix[d * p.num_channels + channel - 1] : 0;
        for (int t = channel * per_channel; t < token_begin; t += 32) {
            const bool mine = t + lane < token_begin;
            #pragma unroll
            for (int d = 0; d < kNumRanks; ++d)
                next_slot[d] += __popc(__ballot_sync(0xffffffffu, mine &&
                                                     p.is_token_in_rank[(int64_t_)(t + lane) * kNumRanks + d]));
        }
    }
    __shared__ int first_row[kNumRanks];
    if (threadIdx.x < kNumRanks)
        first_row[threadIdx.x] = block_row(p.rank_prefix_matrix, kNumRanks, p.rank, threadIdx.x);
    __syncthreads();
    const int experts_per_rank = p.num_experts / kNumRanks;

    for (int batch = token_begin; batch < token_end; batch += 32) {
        unsigned routed[kNumRanks];
        route_batch<kNumRanks>(routed, p.is_token_in_rank, batch, token_end, p.send_head, next_slot, lane, dest_mask);
        const int batch_end = min(batch + 32, token_end);
        for (int token = batch; token < batch_end; ++token) {
            const int bit = token - batch;
            TokenSide side;
            side.load<kStridedScales>(token, p.topk_idx, p.topk_weights, p.num_topk, p.x_scales, p.num_scales,
                                      p.scale_token_stride, p.scale_hidden_stride, lane);
            int4* rows[kNumRanks];
            #pragma unroll
            for (int d = 0; d < kNumRanks; ++d) {
                rows[d] = nullptr;
                if ((routed[d] >> bit) & 1u)
                    rows[d] = reinterpret_cast<int4*>(p.base(d) + p.x_off) +
                              (int64_t_)(first_row[d] + next_slot[d]) * p.hidden_int4;
            }
            warp_fan_out<kUnroll, kNumRanks>(rows, p.x + (int64_t_)token * p.hidden_int4, p.hidden_int4, lane);
            #pragma unroll
            for (int d = 0; d < kNumRanks; ++d) {
                if (!((routed[d] >> bit) & 1u))
                    continue;
                const int64_t_ row = first_row[d] + next_slot[d];
                char* base = p.base(d);
                if (lane == 0 && p.send_head != nullptr)  // a cached dispatch's handle has them
                    reinterpret_cast<int*>(base + p.src_idx_off)[row] = token;
                side.write(d, experts_per_rank, p.num_topk,
                           p.topk_idx != nullptr ? reinterpret_cast<int64_t_*>(base + p.topk_idx_off) + row * p.num_topk
                                                 : nullptr,
                           p.topk_weights != nullptr
                               ? reinterpret_cast<float*>(base + p.topk_weights_off) + row * p.num_topk
                               : nullptr,
                           p.num_scales, reinterpret_cast<float*>(base + p.scales_off) + row * p.num_scales, lane);
                ++next_slot[d];
            }
        }
    }
    // Where each of this rank's channels starts in every destination's block (for the handle).
    if (p.send_head != nullptr)
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.num_channels * kNumRanks; i += gridDim.x * blockDim.x) {
            const int channel = i / kNumRanks, d = i % kNumRanks;
            reinterpret_cast<int*>(p.base(d) + p.meta_off)[channel * kNumRanks + p.rank] =
                channel > 0 ? p.channel_prefix_matrix[d * p.num_channels + channel - 1] : 0;
        }

    // Every thread's stores are out before its block arrives at the end barrier.
    __threadfence_system();
    if (!end_barrier(p.buffer_ptrs, kNumRanks, p.rank, p.timeout_ns, p.error_record, KERNEL_DISPATCH_RECEIVER))
        return;
    const int num_received = p.rank_prefix_matrix[(kNumRanks - 1) * kNumRanks + p.rank];
    if (p.recv_src_idx != nullptr)
        for (int i = threadIdx.x; i < num_received; i += blockDim.x)
            p.recv_src_idx[i] = ld_stream(reinterpret_cast<const int*>(p.base(p.rank) + p.src_idx_off) + i);
    if (p.recv_channel_prefix_matrix != nullptr)
        for (int i = threadIdx.x; i < p.num_channels * kNumRanks; i += blockDim.x) {
            const int source = i / p.num_channels, channel = i % p.num_channels;
            p.recv_channel_prefix_matrix[i] =
                ld_volatile(reinterpret_cast<const int*>(p.base(p.rank) + p.meta_off) + channel * kNumRanks + source);
        }
}

// kStridedScales: the FP8 scales are read with the strides passed (DeepEP passes them
// column-major); otherwise as row-major [num_tokens][num_scales]. kRowsInBuffer: send_in_place.
template <int kNumRanks, bool kStridedScales = false, bool kRowsInBuffer = false>
__global__ void __launch_bounds__(DISPATCH_THREADS, 1) dispatch_kernel(
        int4* recv_x, float* recv_x_scales, int* recv_src_idx, int64_t_* recv_topk_idx,
        float* recv_topk_weights, int* recv_channel_prefix_matrix, int* send_head,
        const int4* x, const float* x_scales, const int64_t_* topk_idx, const float* topk_weights,
        const bool* is_token_in_rank, int* channel_prefix_matrix, int* rank_prefix_matrix,
        int num_tokens, int hidden_int4, int num_topk, int num_experts, int num_scales,
        int scale_token_stride, int scale_hidden_stride, void* const* buffer_ptrs, int rank,
        int64_t_ meta_off, int64_t_ x_off, int64_t_ src_idx_off, int64_t_ topk_idx_off,
        int64_t_ topk_weights_off, int64_t_ scales_off,
        int region_tokens, int num_channels, int num_senders, int send_chunk, int check_op, int row_bytes, int row_detail,
        int num_sms, int recv_chunk, int64_t_ zero_off, int zero_count, const int* dispatch_verdict,
        int exchange, const int* num_tokens_per_rank, const int* num_tokens_per_expert, int recv_capacity,
        int* recv_counter, int* mismatch_flag, int* recv_expert_counter, int report_refusal, int topk_code,
        int expert_alignment, int64_t_ timeout_ns, int* error_record) {
    if (exchange) {
        // A fresh dispatch in one launch: block 0 makes the count exchange while the others count
        // each channel's tokens per destination, then every block waits for both.
        const CountExchange counts{num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, rank_prefix_matrix,
                                   channel_prefix_matrix, recv_capacity, recv_counter, mismatch_flag,
                                   recv_expert_counter, report_refusal, topk_idx, num_topk, num_tokens, num_experts,
                                   num_channels, expert_alignment, zero_off, zero_count,
                                   region_tokens};
        if (blockIdx.x == 0) {
            const int signature[SIGNATURE_INTS - 1] = {row_bytes, topk_code, num_scales, num_experts, num_sms,
                                                       send_chunk, recv_chunk};
            exchange_counts(counts, signature, buffer_ptrs, kNumRanks, rank, timeout_ns, error_record);
        } else {
            for (int dst = blockIdx.x - 1; dst < kNumRanks; dst += gridDim.x - 1)
                count_channel_tokens(counts, kNumRanks, dst);
        }
        if (!grid_sync(buffer_ptrs, kNumRanks, rank, timeout_ns, error_record, KERNEL_NOTIFY_DISPATCH) ||
            !transfer_may_start(buffer_ptrs, rank, error_record, KERNEL_DISPATCH_SENDER))
            return;
    } else {
        // A cached dispatch (check_op != 0) checks its settings here; otherwise notify_dispatch
        // made the count exchange.
        const int settings[SIGNATURE_INTS - 1] = {check_op, row_bytes, row_detail, num_sms, send_chunk, recv_chunk,
                                                  kRowsInBuffer ? SIGNATURE_ROWS_IN_BUFFER : 0};
        if (!start_transfer(check_op != 0, buffer_ptrs, kNumRanks, rank, settings, zero_off, zero_count,
                            rank_prefix_matrix, region_tokens, dispatch_verdict, timeout_ns, error_record,
                            KERNEL_CACHED_DISPATCH_CHECK, KERNEL_DISPATCH_SENDER))
            return;  // the ranks disagree on this call, or one gave up on the Buffer: every rank stops here
    }
    constexpr int kUnroll = kNumRanks <= 4 ? DISPATCH_UNROLL : DISPATCH_UNROLL / 2;
    if (kRowsInBuffer) {
        const InPlaceDispatch in_place{x, x_scales, topk_idx, topk_weights, is_token_in_rank, channel_prefix_matrix,
                                       rank_prefix_matrix, send_head, recv_src_idx, recv_channel_prefix_matrix,
                                       buffer_ptrs, rank, num_tokens, num_channels, num_senders, hidden_int4,
                                       num_topk, num_experts, num_scales, scale_token_stride, scale_hidden_stride,
                                       meta_off, x_off, src_idx_off, topk_idx_off, topk_weights_off, scales_off,
                                       timeout_ns, error_record};
        send_in_place<kNumRanks, kStridedScales, kUnroll>(in_place);
        return;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    DispatchRegions regions{nullptr, num_channels, region_tokens, hidden_int4, num_topk, num_scales,
                            meta_off, x_off, src_idx_off, topk_idx_off, topk_weights_off, scales_off};

    if (blockIdx.x < num_senders) {
        const int channel = blockIdx.x * kDispatchWarps + warp;
        int token_begin, token_end;
        channel_task_range(num_tokens, num_channels, channel, token_begin, token_end);
        // Per destination, the next slot this channel writes (every lane holds all of them).
        int next_slot[kNumRanks];
        #pragma unroll
        for (int d = 0; d < kNumRanks; ++d)
            next_slot[d] = channel > 0 ? channel_prefix_matrix[d * num_channels + channel - 1] : 0;
        // The last tail this channel stored for each destination (in shared memory: registers are
        // short here). A tail is stored only when it grows, so that the receiver sees the last
        // store (check_call relies on it).
        __shared__ int published[kDispatchWarps][kNumRanks];
        if (lane < kNumRanks) {
            const int first = channel > 0 ? channel_prefix_matrix[lane * num_channels + channel - 1] : 0;
            published[warp][lane] = first;
            if (lane == rank) {
                if (recv_channel_prefix_matrix != nullptr)
                    recv_channel_prefix_matrix[rank * num_channels + channel] = first;
            } else {
                const DispatchRegions peer = regions.in(buffer_ptrs[lane]);
                st_relaxed_sys(peer.start(channel, rank, kNumRanks), -first - 1);
                st_relaxed_sys(peer.end(channel, rank, kNumRanks),
                               -channel_prefix_matrix[lane * num_channels + channel] - 1);
            }
        }
        const int experts_per_rank = num_experts / kNumRanks;
        int unpublished = 0;
        // What arrives last is copied out after the senders are done, with nothing left to
        // overlap: a channel's last `send_chunk` tokens of large rows are published one by one.
        // (With small rows the extra tail stores cost the senders more than they save.)
        const int publish_singly_from = token_end - (hidden_int4 >= kPublishSinglyRowInt4 ? send_chunk : 1);

        for (int batch = token_begin; batch < token_end; batch += 32) {
            unsigned routed[kNumRanks];
            route_batch<kNumRanks>(routed, is_token_in_rank, batch, token_end, send_head, next_slot, lane);
            // This rank's own copies are the receivers' work.
            #pragma unroll
            for (int d = 0; d < kNumRanks; ++d) {
                if (d == rank) {
                    next_slot[d] += __popc(routed[d]);
                    routed[d] = 0;
                }
            }

            const int batch_end = min(batch + 32, token_end);
            for (int token = batch; token < batch_end; ++token) {
                const int bit = token - batch;
                TokenSide side;
                side.load<kStridedScales>(token, topk_idx, topk_weights, num_topk, x_scales, num_scales,
                                          scale_token_stride, scale_hidden_stride, lane);
                int4* rows[kNumRanks];
                #pragma unroll
                for (int d = 0; d < kNumRanks; ++d) {
                    rows[d] = nullptr;
                    if ((routed[d] >> bit) & 1u) {
                        const DispatchRegions peer = regions.in(buffer_ptrs[d]);
                        rows[d] = peer.x(peer.slot(region_index(rank, d, kNumRanks), next_slot[d]));
                    }
                }
                warp_fan_out<kUnroll, kNumRanks>(rows, x + (int64_t_)token * hidden_int4, hidden_int4, lane);

                #pragma unroll
                for (int d = 0; d < kNumRanks; ++d) {
                    if (!((routed[d] >> bit) & 1u))
                        continue;
                    const DispatchRegions peer = regions.in(buffer_ptrs[d]);
                    const int64_t_ slot = peer.slot(region_index(rank, d, kNumRanks), next_slot[d]);
                    if (lane == 0 && send_head != nullptr)  // a cached dispatch's receivers take no indices
                        *peer.src_idx(slot) = token;
                    side.write(d, experts_per_rank, num_topk, topk_idx != nullptr ? peer.topk_idx(slot) : nullptr,
                               topk_weights != nullptr ? peer.topk_weights(slot) : nullptr, num_scales,
                               peer.scales(slot), lane);
                    ++next_slot[d];
                }

                if (++unpublished == send_chunk || token >= publish_singly_from) {
                    // The whole warp's writes of these tokens come before the tails that cover them.
                    unpublished = 0;
                    __syncwarp();
                    #pragma unroll
                    for (int d = 0; d < kNumRanks; ++d) {
                        if (d != rank && lane == d && next_slot[d] != published[warp][d]) {
                            const DispatchRegions peer = regions.in(buffer_ptrs[d]);
                            st_release_sys(peer.tail(channel, rank, kNumRanks), next_slot[d]);
                            published[warp][d] = next_slot[d];
                        }
                    }
                }
            }
        }
        return;
    }

    // Receiver warps: queue q = (channel q / R, rank (rank + q) % R): first this rank's own tokens
    // of the channel (ready at once), then the queues of the other ranks.
    regions = regions.in(buffer_ptrs[rank]);
    const int experts_per_rank = num_experts / kNumRanks;
    const int own_row = block_row(rank_prefix_matrix, kNumRanks, rank, rank);
    const int num_receiver_warps = (gridDim.x - num_senders) * kDispatchWarps;
    for (int q = (blockIdx.x - num_senders) * kDispatchWarps + warp; q < num_channels * kNumRanks;
         q += num_receiver_warps) {
        const int channel = q / kNumRanks;
        const int source = (rank + q) % kNumRanks;
        if (source == rank) {
            int token_begin, token_end;
            channel_task_range(num_tokens, num_channels, channel, token_begin, token_end);
            int64_t_ row = own_row + (channel > 0 ? channel_prefix_matrix[rank * num_channels + channel - 1] : 0);
            for (int batch = token_begin; batch < token_end; batch += 32) {
                const int lane_token = batch + lane;
                unsigned mine = __ballot_sync(0xffffffffu, lane_token < token_end &&
                                              is_token_in_rank[(int64_t_)lane_token * kNumRanks + rank]);
                for (; mine != 0; mine &= mine - 1, ++row) {
                    const int token = batch + __ffs(mine) - 1;
                    TokenSide side;
                    side.load<kStridedScales>(token, topk_idx, topk_weights, num_topk, x_scales, num_scales,
                                              scale_token_stride, scale_hidden_stride, lane);
                    warp_copy<kUnroll>(recv_x + row * hidden_int4, x + (int64_t_)token * hidden_int4, hidden_int4,
                                       lane);
                    if (lane == 0 && recv_src_idx != nullptr)
                        recv_src_idx[row] = token;
                    side.write(rank, experts_per_rank, num_topk,
                               recv_topk_idx != nullptr ? recv_topk_idx + row * num_topk : nullptr,
                               recv_topk_weights != nullptr ? recv_topk_weights + row * num_topk : nullptr,
                               num_scales, recv_x_scales + row * num_scales, lane);
                }
            }
            continue;
        }
        int begin = 0, end = 0, failed = 0;
        if (lane == 0) {
            PeerWait wait(buffer_ptrs, kNumRanks, rank, timeout_ns, error_record, KERNEL_DISPATCH_RECEIVER, channel);
            int start_code = 0, end_code = 0;
            while ((start_code = ld_volatile(regions.start(channel, source, kNumRanks))) == 0 ||
                   (end_code = ld_volatile(regions.end(channel, source, kNumRanks))) == 0) {
                if (wait.failed(source, -1)) {
                    failed = 1;
                    break;
                }
            }
            begin = -start_code - 1;
            end = -end_code - 1;
        }
        if (__shfl_sync(0xffffffffu, failed, 0))
            return;
        begin = __shfl_sync(0xffffffffu, begin, 0);
        end = __shfl_sync(0xffffffffu, end, 0);
        if (lane == 0 && recv_channel_prefix_matrix != nullptr)
            recv_channel_prefix_matrix[source * num_channels + channel] = begin;

        const int region = region_index(source, rank, kNumRanks);
        // The row of recv_x for slot 0 of the region.
        const int64_t_ out = block_row(rank_prefix_matrix, kNumRanks, source, rank);
        const int* tail_word = regions.tail(channel, source, kNumRanks);
        for (int done = begin; done < end;) {
            int tail = 0;
            if (lane == 0) {
                PeerWait wait(buffer_ptrs, kNumRanks, rank, timeout_ns, error_record, KERNEL_DISPATCH_RECEIVER,
                              channel);
                while ((tail = ld_acquire_sys(tail_word)) <= done) {
                    if (wait.failed(source, end - done)) {
                        failed = 1;
                        break;
                    }
                }
            }
            if (__shfl_sync(0xffffffffu, failed, 0))
                return;
            tail = __shfl_sync(0xffffffffu, tail, 0);
            // Slots [done, tail) are rows out + done .. out + tail of recv_x, contiguous on both sides.
            const int count = tail - done;
            const int64_t_ first = regions.slot(region, done);
            warp_copy<kUnroll>(recv_x + (out + done) * hidden_int4, regions.x(first), count * hidden_int4, lane);
            if (recv_src_idx != nullptr)
                for (int i = lane; i < count; i += 32)
                    recv_src_idx[out + done + i] = ld_stream(regions.src_idx(first) + i);
            if (recv_topk_idx != nullptr) {
                const int* ids = regions.topk_idx(first);
                const float* weights = regions.topk_weights(first);
                for (int i = lane; i < count * num_topk; i += 32) {
                    recv_topk_idx[(out + done) * num_topk + i] = ld_stream(ids + i);
                    if (recv_topk_weights != nullptr)
                        recv_topk_weights[(out + done) * num_topk + i] = ld_stream(weights + i);
                }
            }
            const float* scales = regions.scales(first);
            for (int i = lane; i < count * num_scales; i += 32)
                recv_x_scales[(out + done) * num_scales + i] = ld_stream(scales + i);
            done = tail;
        }
    }
}
