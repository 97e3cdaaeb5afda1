// Low-latency (decode) dispatch and combine: DeepEP's low-latency API over NVLink.
//
// Every rank's low-latency buffer (deepep_cupy/low_latency/layout.py carves it):
//   int header[]                       at 0: the shared words of common.cuh (abort mark at
//                                      ABORT_INT), then this rank's call counters
//                                      (LL_CALLS_INT + op * 2 + {0 send, 1 receive}), the exit
//                                      counters of its grids (LL_EXITS_INT + op * 4 + phases) and the
//                                      release words (LL_RELEASED_INT + (op * 2 + half) * MAX_RANKS + r:
//                                      the epoch up to which rank r has read its area `half` of op
//                                      `op` filled by this rank)
//   int64 counts[2][MAX_EXPERTS]       at LL_DISPATCH_COUNTS_OFFSET: per half, index le * R + s:
//                                      (epoch << 32) | rows rank s sent local expert le
//   int flags[2][MAX_EXPERTS]          at LL_COMBINE_FLAGS_OFFSET: per half, per global expert e:
//                                      the epoch of the combine whose rows e's owner has all sent
//   int sent_pieces[MAX_EXPERTS]       at LL_SENT_PIECES_OFFSET: this rank's own, per global expert:
//                                      the pieces of its rows the current dispatch send has written
//   then five equal data areas at places the buffer's size alone sets (a call of other sizes
//   indexes them differently but never crosses into another):
//   dispatch halves, [L][R][M] records at dispatch_off + half * half_bytes: record = the row
//                                      (BF16, or FP8 then float scales[hidden / 128]), the source
//                                      token index at record_bytes - 16
//   combine halves, [E][M][hidden] bf16 at combine_off + half * half_bytes: the row expert e
//                                      returns for token t of this rank
//   zero-copy rows [L][R * M][hidden]  (the host passes them as x of a zero-copy combine)
//
// Calls: op 0 is dispatch, 1 combine. The n-th send of an op (counted by the kernel in the
// sender's header, so a replayed CUDA graph counts on) uses half n & 1 and epoch n + 1 in every
// signal; the n-th receive waits for the n-th sends. Signals carry the epoch, so nothing is reset
// between calls. Before the n-th send writes into a peer's half, it waits until that peer has
// released the same half of call n - 2 (its receive of it is over): two calls may be in flight.
//
// Grids: the work goes to warps (see each kernel): dispatch sends (token, part of its row) pieces
// and receives per local expert; combine sends per local expert and receives (token, 256 channels)
// pieces. The last block to leave advances the call counters and, after a receive, releases the
// half.
#include "common.cuh"

// The kernels are deepep_cupy::low_latency::dispatch and ::combine: DeepEP's benchmark
// (bench_kineto) finds its low-latency kernels by `::dispatch` / `::combine` in their names.
namespace deepep_cupy {
namespace low_latency {

// Timeline stamps: nothing here; scripts/decode_timeline.py defines LL_STAMP(op, call, slot) to
// record when the warps of a call reach 0 their entry, 1 their send, 2 their send's end, 3 the
// peers' signals, 4 their end, 5 a dispatch piece's places, 6 a piece's or a team's rows written.
#ifndef LL_STAMP
#define LL_STAMP(op, call, slot) ((void)0)
#endif

// Nanoseconds a receive sleeps between two polls of a signal not there yet (0: none): every warp
// of a receive polls, and the polls share cache lines with the signals they wait for. A knob for
// scripts/decode_timeline.py (--define), which measures it.
#ifndef LL_POLL_SLEEP_NS
#define LL_POLL_SLEEP_NS 0
#endif

// Loads per lane a row copy keeps in flight (a dispatch receive's rows, a combine send's pieces): at
// 128 tokens the copies of two ranks sharing a GPU move about 1.7 TB/s, which 4 in flight at HBM
// latency cap (docs/PERFORMANCE.md, decode). A combine send cuts its rows into pieces of one such
// round.
constexpr int kCopyUnroll = 8;

#define LL_THREADS LOW_LATENCY_DISPATCH_THREADS
static_assert(LOW_LATENCY_DISPATCH_THREADS == LOW_LATENCY_COMBINE_THREADS, "one block size for both kernels");
constexpr int kLLWarps = LL_THREADS / 32;

// Two float32 -> two e4m3 bytes (`lo` in the low byte): round to nearest even, saturating to +-448.
__device__ __forceinline__ unsigned e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ int* ll_words(void* const* buffer_ptrs, int rank) {
    return reinterpret_cast<int*>(buffer_ptrs[rank]);
}

__device__ __forceinline__ int* released_word(void* const* buffer_ptrs, int owner, int op, int half, int reader) {
    return ll_words(buffer_ptrs, owner) + LL_RELEASED_INT + (op * 2 + half) * DEEPEP_MAX_RANKS + reader;
}

// The scale of a group whose largest magnitude is `amax`, and the factor its values are multiplied
// by, as DeepEP's calculate_fp8_scales computes them (bit for bit: the scale is amax times the
// float 1 / 448, not amax / 448); deepep_cupy/reference/low_latency.py states the same rules.
constexpr float kFP8MaxInv = 1.0f / FP8_E4M3_MAX;
__device__ __forceinline__ void fp8_scale(float amax, bool round_scale, float& scale, float& inv) {
    amax = fmaxf(amax, FP8_AMAX_FLOOR);
    scale = __fmul_rn(amax, kFP8MaxInv);
    inv = __fdiv_rn(FP8_E4M3_MAX, amax);
    if (round_scale) {
        const int bits = __float_as_int(scale);
        const int exponent = ((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffff) != 0 ? 1 : 0);
        scale = __int_as_float((exponent + 127) << 23);
        inv = __int_as_float((127 - exponent) << 23);
    }
}

// Shrink mode (DeepEP's enable_shrink): this rank's mask words (LL_MASK_INT + r: rank r is masked
// when not 0), or null without it. Nothing is sent to a masked rank nor waited for from it, and a
// wait for a rank that times out masks it (DeepEP's behaviour) instead of failing the call.
__device__ __forceinline__ int* mask_words(void* const* buffer_ptrs, int rank, int shrink) {
    return shrink ? ll_words(buffer_ptrs, rank) + LL_MASK_INT : nullptr;
}

__device__ __forceinline__ bool is_masked(const int* mask, int r) {
    return mask != nullptr && ld_volatile(mask + r) != 0;
}

// The block's view of the mask, read once (every thread of the block then decides alike).
__device__ __forceinline__ void snapshot_mask(const int* mask, int num_ranks, int* masked) {
    if (threadIdx.x < num_ranks)
        masked[threadIdx.x] = is_masked(mask, threadIdx.x) ? 1 : 0;
    __syncthreads();
}

constexpr int kKeepWaiting = 0, kGoOnWithout = 1, kStop = 2;

// A wait for a peer: keep waiting, go on without the peer (it is masked, or masked now because the
// wait timed out in shrink mode), or stop the kernel (the wait failed; recorded by PeerWait).
struct LLWait {
    PeerWait wait;
    int* mask;
    __device__ __forceinline__ LLWait(void* const* buffer_ptrs, int num_ranks, int rank, int64_t_ timeout_ns,
                                      int* error_record, int kernel, int channel, int* mask_)
        : wait(buffer_ptrs, num_ranks, rank, timeout_ns, error_record, kernel, channel), mask(mask_) {}
    __device__ __forceinline__ int poll(int peer, int detail) {
        if (mask == nullptr)
            return wait.failed(peer, detail) ? kStop : kKeepWaiting;
        if (ld_volatile(mask + peer) != 0)
            return kGoOnWithout;
        if (!wait.deadline.expired())
            return kKeepWaiting;
        atomicExch(mask + peer, 1);
        printf("deepep_cupy: rank %d masks rank %d: a low-latency wait (kernel %d) timed out\n", wait.rank, peer,
               wait.kernel);
        return kGoOnWithout;
    }
};

// Threads `peer < num_ranks` of the block wait until `peer` has released our area `half` of call
// n - 2 of `op` (epoch n - 1); false on every thread when a wait failed. Masked peers are not
// waited for.
__device__ __forceinline__ bool wait_released(void* const* buffer_ptrs, int num_ranks, int rank, int op, int n,
                                              int64_t_ timeout_ns, int* error_record, int kernel, int* mask) {
    bool ok = true;
    const int peer = threadIdx.x;
    if (n >= 2 && peer < num_ranks && !is_masked(mask, peer)) {
        LLWait wait(buffer_ptrs, num_ranks, rank, timeout_ns, error_record, kernel, -1, mask);
        const int* word = released_word(buffer_ptrs, rank, op, n & 1, peer);
        while (ld_acquire_sys(word) - (n - 1) < 0) {
            const int state = wait.poll(peer, n - 1);
            if (state != kKeepWaiting) {
                ok = state != kStop;
                break;
            }
        }
    }
    return __syncthreads_and(ok) != 0;
}

// The start of a grid of `op`: this rank's call numbers of `op` (sends, receives), and whether to
// stop at once because a rank gave up (thread 0 of block 0 records it; every thread of a block
// calls it and gets the same answer).
__device__ __forceinline__ bool enter(void* const* buffer_ptrs, int rank, int op, int kernel, int* error_record,
                                      int& send_call, int& recv_call) {
    const int* words = ll_words(buffer_ptrs, rank);
    send_call = ld_volatile(words + LL_CALLS_INT + op * 2);
    recv_call = ld_volatile(words + LL_CALLS_INT + op * 2 + 1);
    const bool stop = stop_if_a_rank_gave_up(buffer_ptrs, blockIdx.x == 0 && threadIdx.x == 0 ? error_record : nullptr,
                                             kernel, rank, -1, send_call);
    // Block-wide: a mark set between two threads' reads must not split the block at its barriers.
    return __syncthreads_or(stop) != 0;
}

// The end of a grid: the last block to leave advances this rank's call counters of `op` for the
// phases it ran and, after a receive, tells every sender that our area `half` is free again.
__device__ __forceinline__ void leave(void* const* buffer_ptrs, int num_ranks, int rank, int op, int phases,
                                      int send_call, int recv_call, const int* mask) {
    __syncthreads();
    if (threadIdx.x != 0)
        return;
    int* words = ll_words(buffer_ptrs, rank);
    int* exits = words + LL_EXITS_INT + op * 4 + phases;
    __threadfence();  // the block's reads before the last block's releases (system scope)
    if (atomicAdd(exits, 1) != (int)gridDim.x - 1)
        return;
    *exits = 0;
    if (phases & 1)
        words[LL_CALLS_INT + op * 2] = send_call + 1;
    if (phases & 2) {
        words[LL_CALLS_INT + op * 2 + 1] = recv_call + 1;
        for (int r = 0; r < num_ranks; ++r)
            if (!is_masked(mask, r))
                st_release_sys(released_word(buffer_ptrs, r, op, recv_call & 1, rank), recv_call + 1);
    }
}

// ---------------------------------------------------------------------------------------------
// Work of the grid's warps
//
// Both kernels hand out work per warp, not per block: at decode sizes there are fewer tokens and
// rows than warps, and a block-wide step (a barrier, a fence) in each piece of work would put the
// pieces one after another instead of side by side.

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int grid_warp() { return blockIdx.x * kLLWarps + threadIdx.x / 32; }
__device__ __forceinline__ int grid_warps() { return gridDim.x * kLLWarps; }

// Whether token `t` has `expert` among its top-k.
__device__ __forceinline__ bool routes_to(const int64_t_* topk_idx, int t, int num_topk, int expert) {
    bool hit = false;
    for (int k = 0; k < num_topk; ++k)
        hit |= __ldg(topk_idx + (int64_t_)t * num_topk + k) == expert;
    return hit;
}

// Tokens of [0, end) that have `expert` among their top-k (lanes split the tokens; every lane
// returns the count).
__device__ __forceinline__ int tokens_routed_to(const int64_t_* topk_idx, int end, int num_topk, int expert,
                                                int lane) {
    int count = 0;
    for (int base = 0; base < end; base += 32) {
        const int t = base + lane;
        count += __popc(__ballot_sync(kFullMask, t < end && routes_to(topk_idx, t, num_topk, expert)));
    }
    return count;
}

// Lane k's expert of token t's top-k, or -1 where the id is outside [0, E) (sent nowhere) or
// repeats an earlier k (sent once).
__device__ __forceinline__ int token_expert(const int64_t_* topk_idx, int t, int num_topk, int num_experts,
                                           int lane) {
    int expert = -1;
    if (lane < num_topk) {
        const int64_t_ e = topk_idx[(int64_t_)t * num_topk + lane];
        expert = e >= 0 && e < num_experts ? (int)e : -1;
    }
    for (int k = 0; k + 1 < num_topk; ++k) {
        const int earlier = __shfl_sync(kFullMask, expert, k);
        if (lane > k && expert == earlier)
            expert = -1;
    }
    return expert;
}

// The experts and places of a send round's tokens [t_first, t_end) (at most one per warp of the
// block), counted by the block's warps together, once per round instead of once per piece:
// experts[j][k] is expert k of token t_first + j (token_expert), places[j][k] the tokens of
// [0, t_first + j) routed to it. Warps split the earlier tokens 32 at a time; a lane reads its
// token's ids and matches them against each round token's experts. Every thread of the block calls
// it (block barriers).
__device__ __forceinline__ void count_round_places(const int64_t_* topk_idx, int t_first, int t_end, int num_topk,
                                                   int num_experts, int (*experts)[32], int (*places)[32]) {
    const int lane = threadIdx.x % 32, block_warp = threadIdx.x / 32;
    const int round_tokens = t_end - t_first;
    __syncthreads();  // the previous round has read its experts and places
    if (block_warp < round_tokens)
        experts[block_warp][lane] = token_expert(topk_idx, t_first + block_warp, num_topk, num_experts, lane);
    for (int i = threadIdx.x; i < round_tokens * 32; i += blockDim.x)
        places[i / 32][i % 32] = 0;
    __syncthreads();
    for (int u0 = block_warp * 32; u0 < t_end - 1; u0 += kLLWarps * 32) {
        const int u = u0 + lane;
        for (int j = max(0, u0 + 1 - t_first); j < round_tokens; ++j) {  // the round tokens after u0
            const int t = t_first + j;
            unsigned hits = 0;  // bit k: token u (earlier than t) is routed to expert k of t
            for (int c = 0; c < num_topk && u < t; ++c) {
                const int64_t_ id = __ldg(topk_idx + (int64_t_)u * num_topk + c);
                for (int k = 0; k < num_topk; ++k) {
                    const int e = experts[j][k];
                    if (e >= 0 && id == e)
                        hits |= 1u << k;
                }
            }
            for (int k = 0; k < num_topk; ++k) {
                const int routed = __popc(__ballot_sync(kFullMask, (hits >> k) & 1u));
                if (lane == 0 && routed > 0)
                    atomicAdd(&places[j][k], routed);
            }
        }
    }
    __syncthreads();
}

// The sum of `value` over lanes 0..lane of the warp.
__device__ __forceinline__ int warp_inclusive_sum(int value, int lane) {
    #pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int v = __shfl_up_sync(kFullMask, value, offset);
        if (lane >= offset)
            value += v;
    }
    return value;
}

// Lane `s < R` holds `count` (rows from source s); returns the rows before source s and sets
// `total`.
__device__ __forceinline__ int rows_before(int count, int num_ranks, int lane, int& total) {
    const int inclusive = warp_inclusive_sum(count, lane);
    total = __shfl_sync(kFullMask, inclusive, num_ranks - 1);
    return inclusive - count;
}

// One warp copies piece `piece` of `pieces` (equal, the last one shorter or empty) of a row of
// `row_int4` int4.
__device__ __forceinline__ void copy_piece(int4* dst, const int4* src, int row_int4, int piece, int pieces,
                                           int lane) {
    const int piece_int4 = (row_int4 + pieces - 1) / pieces;
    const int begin = piece * piece_int4, n = min(row_int4 - begin, piece_int4);
    if (n > 0)
        warp_copy<kCopyUnroll>(dst + begin, src + begin, n, lane);
}

// One thread: wait until the warps' piece count `*counter` reaches `expected` (acquiring what they
// wrote before their counts), then zero it for the next send; false when the wait failed (recorded
// for `kernel` and `channel`).
__device__ __forceinline__ bool take_pieces(int* counter, int expected, void* const* buffer_ptrs, int num_ranks,
                                            int rank, int64_t_ timeout_ns, int* error_record, int kernel,
                                            int channel) {
    PeerWait wait(buffer_ptrs, num_ranks, rank, timeout_ns, error_record, kernel, channel);
    bool ok = true;
    while (ld_acquire_gpu(counter) != expected)
        if (wait.failed(rank, channel)) {
            ok = false;
            break;
        }
    *counter = 0;
    return ok;
}

// The source (lane s < R, rows before it `before`) of row `row`: the last one starting at or
// before it (a source of no rows starts where the next does).
__device__ __forceinline__ int source_of_row(int before, int row, int num_ranks, int lane) {
    return 31 - __clz(__ballot_sync(kFullMask, lane < num_ranks && before <= row));
}

// ---------------------------------------------------------------------------------------------
// Dispatch

// One step of a token's row (lane's 16 bytes at int4 index `i`, 8 channels) as it travels: the
// BF16 bytes, or their FP8 cast with the scale of its 128-channel group (16 lanes).
static_assert(FP8_SCALE_BLOCK == 16 * 8, "a scale group is 16 lanes of 8 channels");
__device__ __forceinline__ void cast_step(const int4& raw, bool round_scale, uint2& packed, float& scale) {
    float v[8];
    Elem<bf16_t>::unpack(raw, v);
    float amax = 0.0f;
    #pragma unroll
    for (int j = 0; j < 8; ++j)
        amax = fmaxf(amax, fabsf(v[j]));
    #pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1)
        amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, offset));
    float inv;
    fp8_scale(amax, round_scale, scale, inv);
    packed.x = e4m3x2(__fmul_rn(v[0], inv), __fmul_rn(v[1], inv)) | (e4m3x2(__fmul_rn(v[2], inv), __fmul_rn(v[3], inv)) << 16);
    packed.y = e4m3x2(__fmul_rn(v[4], inv), __fmul_rn(v[5], inv)) | (e4m3x2(__fmul_rn(v[6], inv), __fmul_rn(v[7], inv)) << 16);
}

// Steps (32 lanes x 16 bytes) whose loads a warp issues before it writes them out.
constexpr int kSendBatch = 4;

// Parts of a token's row the send hands to warps of their own: the grid's warps spread over the
// tokens, so that one token alone still keeps up to `steps` warps busy.
__device__ __forceinline__ int send_parts(int num_tokens, int steps) {
    return num_tokens > 0 ? max(1, min(grid_warps() / num_tokens, steps)) : 1;
}

// The local experts' rows (`rows_of(le)`) exclusive-scanned into `prefix[0..num_local]` (shared
// memory): prefix[le] is the rows of the local experts before le, prefix[num_local] all of them.
// Every thread of the block calls it (block barriers); `warp_sums`: kLLWarps ints of shared memory.
template <typename RowsOf>
__device__ __forceinline__ void scan_rows(int num_local, RowsOf rows_of, int* prefix, int* warp_sums) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int per = (num_local + blockDim.x - 1) / blockDim.x;
    const int lo = min(num_local, threadIdx.x * per), hi = min(num_local, lo + per);
    int sum = 0;
    for (int le = lo; le < hi; ++le)
        sum += rows_of(le);
    const int inclusive = warp_inclusive_sum(sum, lane);
    if (lane == 31)
        warp_sums[warp] = inclusive;
    __syncthreads();
    int base = inclusive - sum;
    for (int w = 0; w < warp; ++w)
        base += warp_sums[w];
    for (int le = lo; le < hi; ++le) {
        prefix[le] = base;
        base += rows_of(le);
    }
    if (threadIdx.x == 0) {
        int total = 0;
        for (int w = 0; w < kLLWarps; ++w)
            total += warp_sums[w];
        prefix[num_local] = total;
    }
    __syncthreads();
}

// The local expert whose rows hold row `row` (< prefix[num_local]) of them all: the last le with
// prefix[le] <= row.
__device__ __forceinline__ int expert_of_row(const int* prefix, int num_local, int row) {
    int lo = 0, hi = num_local - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (prefix[mid] <= row)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

// Where a dispatch receive puts what it reads: the received records of this rank's area (half
// `half`) and the outputs, with the sizes that place a row.
struct ReceivedRows {
    const char* area;  // this rank's dispatch area of the call's half
    void* recv_x;
    void* recv_scales;
    int* src_info;
    int num_ranks, num_max, hidden, fp8_mode, num_groups, rows_per_expert;
    int64_t_ record_bytes, row_bytes;
};

// Piece `piece` of `pieces` of received row `row` of local expert `local` (lane s < R: the rows
// before source s, `before`): its bytes into recv_x; with piece 0 also its scales and source index.
__device__ __forceinline__ void receive_piece(const ReceivedRows& r, int local, int row, int piece, int pieces,
                                              int before, int lane) {
    const int source = source_of_row(before, row, r.num_ranks, lane);
    const int first = __shfl_sync(kFullMask, before, source);
    const char* record = r.area + ((int64_t_)(local * r.num_ranks + source) * r.num_max + (row - first)) * r.record_bytes;
    const int64_t_ out_row = (int64_t_)local * r.rows_per_expert + row;
    copy_piece(reinterpret_cast<int4*>(reinterpret_cast<char*>(r.recv_x) + out_row * r.row_bytes),
               reinterpret_cast<const int4*>(record), (int)(r.row_bytes / 16), piece, pieces, lane);
    if (piece != 0)
        return;  // the scales and the source index: piece 0's
    if (r.fp8_mode == 1 || r.fp8_mode == 2) {
        const float* scales = reinterpret_cast<const float*>(record + r.hidden);
        float* out = reinterpret_cast<float*>(r.recv_scales);
        for (int g = lane; g < r.num_groups; g += 32)
            out[((int64_t_)local * r.num_groups + g) * r.rows_per_expert + row] = ld_stream(scales + g);
    } else if (r.fp8_mode == 3) {
        const int* scale_bits = reinterpret_cast<const int*>(record + r.hidden);
        int* out = reinterpret_cast<int*>(r.recv_scales);
        const int num_words = r.num_groups / UE8M0_PER_INT;
        for (int w = lane; w < num_words; w += 32) {
            unsigned packed = 0;
            #pragma unroll
            for (int j = 0; j < UE8M0_PER_INT; ++j)
                packed |= (((unsigned)ld_stream(scale_bits + UE8M0_PER_INT * w + j) >> 23) & 0xffu) << (8 * j);
            out[((int64_t_)local * num_words + w) * r.rows_per_expert + row] = (int)packed;
        }
    }
    if (lane == 0)
        r.src_info[out_row] = ld_stream(reinterpret_cast<const int*>(record + r.record_bytes - 16));
}

// fp8_mode: 0 BF16, 1 FP8, 2 FP8 with power-of-two scales, 3 FP8 with UE8M0-packed scales.
// phases: 1 send, 2 receive, 3 both. recv_scales: float [L][hidden / 128][R * M] (column-major
// per expert), or with UE8M0 int [L][hidden / 512][R * M].
//
// Send: warps take (token, part of its row): the part is loaded once, cast, and written into the
// token's record at each of its experts' owners; its place there is the number of earlier tokens
// routed to that expert (so records keep source token order). Each warp then counts its piece in
// this rank's LL_SENT_PIECES word of each expert; the warp that owns expert e (e = warp, warp + W,
// ...) waits until every piece of e's rows is counted and signals the count to e's owner.
// Receive: per local expert a group of warps; each waits for the R counts itself and copies its
// share of the rows.
__global__ void __launch_bounds__(LL_THREADS) dispatch(
        void* recv_x, void* recv_scales, int* recv_count, int* src_info, int64_t_* layout_range,
        int* cumulative_recv_stats, int64_t_* wait_recv_cost_stats, const void* x, const int64_t_* topk_idx,
        int num_tokens, int num_topk, int hidden, int num_max, int num_experts, int fp8_mode, int phases,
        int shrink, int64_t_ record_bytes, int64_t_ dispatch_off, int64_t_ half_bytes,
        void* const* buffer_ptrs, int num_ranks, int rank, int64_t_ timeout_ns, int* error_record) {
    __shared__ int masked[DEEPEP_MAX_RANKS];
    const int lane = threadIdx.x % 32;
    const int warp_id = grid_warp(), num_warps = grid_warps();
    const int num_local = num_experts / num_ranks;
    const int row_int4 = hidden / 8;
    int* mask = mask_words(buffer_ptrs, rank, shrink);
    int send_call, recv_call;
    if (enter(buffer_ptrs, rank, 0, KERNEL_LOW_LATENCY_DISPATCH_SEND, error_record, send_call, recv_call))
        return;
    LL_STAMP(0, (phases & 1) ? send_call : recv_call, 0);
    bool failed = false;

    if (phases & 1) {
        const int half = send_call & 1;
        const int64_t_ epoch = send_call + 1;
        // Expert ids outside [-1, E) are sent nowhere; the host hears of them.
        if (blockIdx.x == 0) {
            for (int i = threadIdx.x; i < num_tokens * num_topk; i += blockDim.x) {
                const int64_t_ e = topk_idx[i];
                if (e < -1 || e >= num_experts)
                    report_error(error_record, ERROR_BAD_EXPERT_ID, KERNEL_LOW_LATENCY_DISPATCH_SEND, rank, -1, -1, (int)e);
            }
        }
        if (!wait_released(buffer_ptrs, num_ranks, rank, 0, send_call, timeout_ns, error_record,
                           KERNEL_LOW_LATENCY_DISPATCH_SEND, mask))
            return;
        LL_STAMP(0, send_call, 1);
        snapshot_mask(mask, num_ranks, masked);
        int* sent_pieces = reinterpret_cast<int*>(reinterpret_cast<char*>(buffer_ptrs[rank]) + LL_SENT_PIECES_OFFSET);
        const int steps = (row_int4 + 31) / 32;
        const int parts = send_parts(num_tokens, steps);
        const int steps_per_part = (steps + parts - 1) / parts;
        const bool fp8 = fp8_mode != 0, round_scale = fp8_mode >= 2;
        // Rounds: the block's warps take the consecutive items [base, base + warps of a block), a
        // few tokens whose experts and places the block counts together first.
        __shared__ int round_experts[kLLWarps][32];
        __shared__ int round_places[kLLWarps][32];
        const int total_items = num_tokens * parts;
        for (int base = blockIdx.x * kLLWarps; base < total_items; base += num_warps) {
            const int t_first = base / parts, t_end = (min(total_items, base + kLLWarps) - 1) / parts + 1;
            count_round_places(topk_idx, t_first, t_end, num_topk, num_experts, round_experts, round_places);
            const int item = base + threadIdx.x / 32;
            if (item >= total_items)
                continue;
            const int t = item / parts, part = item % parts;
            const int expert = round_experts[t - t_first][lane];
            const int place = round_places[t - t_first][lane];
            LL_STAMP(0, send_call, 5);
            const bool writes = expert >= 0 && !masked[expert / num_local];
            char* record = nullptr;
            if (writes)
                record = reinterpret_cast<char*>(buffer_ptrs[expert / num_local]) + dispatch_off + half * half_bytes
                         + ((int64_t_)((expert % num_local) * num_ranks + rank) * num_max + place) * record_bytes;
            const unsigned writers = __ballot_sync(kFullMask, writes);
            const int4* x_row = reinterpret_cast<const int4*>(x) + (int64_t_)t * row_int4;
            const int step_end = min(steps, (part + 1) * steps_per_part);
            for (int s0 = part * steps_per_part; s0 < step_end && writers != 0; s0 += kSendBatch) {
                int4 raw[kSendBatch];
                #pragma unroll
                for (int j = 0; j < kSendBatch; ++j) {
                    const int i = (s0 + j) * 32 + lane;
                    raw[j] = s0 + j < step_end && i < row_int4 ? ld_stream(x_row + i) : make_int4(0, 0, 0, 0);
                }
                #pragma unroll
                for (int j = 0; j < kSendBatch; ++j) {
                    if (s0 + j >= step_end)
                        break;
                    const int i = (s0 + j) * 32 + lane;
                    uint2 packed = make_uint2(0, 0);
                    float scale = 0.0f;
                    if (fp8)
                        cast_step(raw[j], round_scale, packed, scale);
                    for (unsigned left = writers; left != 0; left &= left - 1) {
                        const int k = __ffs(left) - 1;
                        char* to = reinterpret_cast<char*>(
                            __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(record), k));
                        if (i >= row_int4)
                            continue;
                        if (!fp8) {
                            st_stream(reinterpret_cast<int4*>(to) + i, raw[j]);
                        } else {
                            st_stream(reinterpret_cast<uint2*>(to) + i, packed);
                            if (lane % 16 == 0)
                                reinterpret_cast<float*>(to + hidden)[i / 16] = scale;
                        }
                    }
                }
            }
            if (part == 0 && writes)
                *reinterpret_cast<int*>(record + record_bytes - 16) = t;
            LL_STAMP(0, send_call, 6);
            // The warp's writes are ordered before its count (release), the count before the
            // expert's signal (acquire, then a system-scope release, which carries them along).
            __syncwarp();
            if (expert >= 0)
                add_release_gpu(sent_pieces + expert, 1);  // a masked owner's pieces count too (none written)
        }
        // Signals: the count of expert e's rows, once every piece of them is written.
        for (int e = warp_id; e < num_experts && !failed; e += num_warps) {
            const int rows = tokens_routed_to(topk_idx, num_tokens, num_topk, e, lane);
            if (lane == 0) {
                failed = !take_pieces(sent_pieces + e, rows * parts, buffer_ptrs, num_ranks, rank, timeout_ns,
                                      error_record, KERNEL_LOW_LATENCY_DISPATCH_SEND, e);
                const int dst = e / num_local;
                if (!failed && !masked[dst]) {
                    int64_t_* count_word = reinterpret_cast<int64_t_*>(reinterpret_cast<char*>(buffer_ptrs[dst])
                                                                      + LL_DISPATCH_COUNTS_OFFSET)
                                           + half * MAX_EXPERTS + (e % num_local) * num_ranks + rank;
                    st_release_sys(count_word, (epoch << 32) | (int64_t_)rows);
                }
            }
            failed = __shfl_sync(kFullMask, failed, 0);
        }
        // Block-wide: a warp whose wait failed must not skip the receive's block barriers alone.
        failed = __syncthreads_or(failed) != 0;
        LL_STAMP(0, send_call, 2);
    }

    if ((phases & 2) && !failed) {
        const int half = recv_call & 1;
        const int64_t_ epoch = recv_call + 1;
        const int rows_per_expert = num_ranks * num_max;
        const int num_groups = hidden / FP8_SCALE_BLOCK;
        const int64_t_ row_bytes = fp8_mode == 0 ? (int64_t_)hidden * 2 : hidden;
        const int64_t_* my_counts = reinterpret_cast<const int64_t_*>(reinterpret_cast<const char*>(buffer_ptrs[rank])
                                                                      + LL_DISPATCH_COUNTS_OFFSET) + half * MAX_EXPERTS;
        const ReceivedRows received{reinterpret_cast<const char*>(buffer_ptrs[rank]) + dispatch_off + half * half_bytes,
                                    recv_x, recv_scales, src_info, num_ranks, num_max, hidden, fp8_mode, num_groups,
                                    rows_per_expert, record_bytes, row_bytes};
        __shared__ int recv_prefix[MAX_EXPERTS + 1];
        __shared__ int recv_sums[kLLWarps];
        // The low half of a count word: the rows source s sent local expert le (once its epoch came).
        auto count_of = [&](int le, int s) {
            return ld_volatile(reinterpret_cast<const int*>(my_counts + le * num_ranks + s));
        };
        if (!shrink) {
            // Every block waits for all the counts (a thread per word), then takes its share of all
            // the rows: rows per local expert vary, and a team per expert waits for the busiest.
            bool ok = true;
            for (int i = threadIdx.x; i < num_local * num_ranks && ok; i += blockDim.x) {
                const int source = i % num_ranks;
                const long long start = clock64();
                long long cost = 0;  // DeepEP's wait_recv_cost, counted once (block 0's pollers)
                LLWait wait(buffer_ptrs, num_ranks, rank, timeout_ns, error_record,
                            KERNEL_LOW_LATENCY_DISPATCH_RECEIVE, i / num_ranks, mask);
                while ((ld_acquire_sys(my_counts + i) >> 32) != epoch) {
                    if (LL_POLL_SLEEP_NS > 0)
                        __nanosleep(LL_POLL_SLEEP_NS);
                    cost = clock64() - start;
                    if (wait.poll(source, (int)epoch) != kKeepWaiting) {
                        ok = false;
                        break;
                    }
                }
                if (blockIdx.x == 0 && wait_recv_cost_stats != nullptr)
                    atomicAdd(reinterpret_cast<unsigned long long*>(wait_recv_cost_stats + source),
                              (unsigned long long)cost);
            }
            if (!__syncthreads_and(ok)) {
                failed = true;
            } else {
                LL_STAMP(0, recv_call, 3);
                scan_rows(num_local, [&](int le) {
                    int rows = 0;
                    for (int s = 0; s < num_ranks; ++s)
                        rows += count_of(le, s);
                    return rows;
                }, recv_prefix, recv_sums);
                if (blockIdx.x == 0) {
                    for (int le = threadIdx.x; le < num_local; le += blockDim.x) {
                        int before = 0;
                        for (int s = 0; s < num_ranks; ++s) {
                            const int count = count_of(le, s);
                            layout_range[le * num_ranks + s] = ((int64_t_)before << 32) | (int64_t_)count;
                            before += count;
                        }
                        recv_count[le] = before;
                        if (cumulative_recv_stats != nullptr)
                            cumulative_recv_stats[le] += before;
                    }
                }
                const int all_rows = recv_prefix[num_local];
                const int pieces = max(1, min(num_warps / max(1, all_rows), (int)(row_bytes / 16) / 32));
                for (int item = warp_id; item < all_rows * pieces; item += num_warps) {
                    const int row = item / pieces;
                    const int local = expert_of_row(recv_prefix, num_local, row);
                    int total;
                    const int before = rows_before(lane < num_ranks ? count_of(local, lane) : 0, num_ranks, lane, total);
                    receive_piece(received, local, row - recv_prefix[local], item % pieces, pieces, before, lane);
                }
            }
        } else {
            // Shrink mode: a team of warps per local expert, each waiting for the expert's counts
            // itself (its lanes skip masked sources).
            const int per_expert = max(1, num_warps / num_local);
            const int num_teams = num_warps / per_expert, team = warp_id / per_expert, member = warp_id % per_expert;
            for (int local = team; local < num_local && team < num_teams && !failed; local += num_teams) {
                bool ok = true;
                int count = 0;
                long long cost = 0;  // DeepEP's wait_recv_cost: the clock64 cycles polled without the count
                if (lane < num_ranks && !is_masked(mask, lane)) {
                    const long long start = clock64();
                    LLWait wait(buffer_ptrs, num_ranks, rank, timeout_ns, error_record,
                                KERNEL_LOW_LATENCY_DISPATCH_RECEIVE, local, mask);
                    const int64_t_* word = my_counts + local * num_ranks + lane;
                    int64_t_ value;
                    while (((value = ld_acquire_sys(word)) >> 32) != epoch) {
                        if (LL_POLL_SLEEP_NS > 0)
                            __nanosleep(LL_POLL_SLEEP_NS);
                        cost = clock64() - start;
                        const int state = wait.poll(lane, (int)epoch);
                        if (state != kKeepWaiting) {
                            ok = state != kStop;
                            value = 0;  // a masked source sent nothing
                            break;
                        }
                    }
                    count = (int)(value & 0xffffffff);
                }
                if (!__all_sync(kFullMask, ok)) {
                    failed = true;
                    break;
                }
                LL_STAMP(0, recv_call, 3);
                int total;
                const int before = rows_before(count, num_ranks, lane, total);
                if (member == 0) {
                    if (lane < num_ranks) {
                        layout_range[local * num_ranks + lane] = ((int64_t_)before << 32) | (int64_t_)count;
                        if (wait_recv_cost_stats != nullptr)
                            atomicAdd(reinterpret_cast<unsigned long long*>(wait_recv_cost_stats + lane),
                                      (unsigned long long)cost);
                    }
                    if (lane == 0) {
                        recv_count[local] = total;
                        if (cumulative_recv_stats != nullptr)
                            cumulative_recv_stats[local] += total;
                    }
                }
                // Fewer rows than warps: each row in pieces, one per warp (more rows: whole rows, each
                // warp's copies one after another cost less than a piece's fixed cost per row).
                const int pieces = total < per_expert ? per_expert : 1;
                for (int item = member; item < total * pieces; item += per_expert)
                    receive_piece(received, local, item / pieces, item % pieces, pieces, before, lane);
            }
        }
    }
    if (__syncthreads_or(failed))
        return;
    LL_STAMP(0, (phases & 1) ? send_call : recv_call, 4);
    leave(buffer_ptrs, num_ranks, rank, 0, phases, send_call, recv_call, mask);
}

// ---------------------------------------------------------------------------------------------
// LogFMT: DeepEP's LogFMT-10 compression of the combine's rows (use_logfmt=True)
//
// The format and rounding are DeepEP's (csrc/kernels/internode_ll.cu, logfmt_encode and
// decode_and_accumulate). A row's slot holds one (amax, amin) BF16 pair per 128 channels (meta,
// hidden / 128 words), then the row in chunks of 32 * unroll int4 (1024 channels with unroll 4
// when hidden % 1024 == 0, else 512 with unroll 2), each either as its BF16 values or, when every
// 128-channel group of the chunk has amax < 1 and log2(amin) < log2(amax), as 10 bits per value:
// the sign and a 9-bit code. Per group: log_amin = max(log2(amin), log2(amax) - 32), step =
// (log2(amax) - log_amin) / 510; a value's code is floor(max(log2|x| / step + rounding -
// log_amin / step, 0)) where rounding = 2 - log2((1 + 2^step) / 2) / step (the level nearest in
// linear scale), and it decodes to 0 (code 0) or 2^((code - 1) * step + log_amin). Lane l of a
// chunk owns its int4 [l * unroll, (l + 1) * unroll): 2 * unroll * 8 bytes of BF16, or 10 * unroll
// bytes of codes (per 16 values 5 words: 16 9-bit codes, then the 16 signs in the upper half).
//
// Unlike DeepEP's (lg2.approx / ex2.approx), log2 and exp2 are computed with IEEE round-to-nearest
// float operations only, so that deepep_cupy/reference/low_latency.py states every bit.

__device__ __forceinline__ float repro_log2(float x) {  // x >= 0 (0 -> -inf)
    if (x == 0.0f)
        return __int_as_float(0xff800000);
    int bits = __float_as_int(x);
    int e = 0;
    if ((bits >> 23) == 0) {  // subnormal: scale by 2^23 (exact)
        bits = __float_as_int(__fmul_rn(x, 0x1p+23f));
        e = -23;
    }
    e += (bits >> 23) - 127;
    float m = __int_as_float((bits & 0x7fffff) | 0x3f800000);
    if (m > 0x1.6a09e6p+0f) {  // into [sqrt(1/2), sqrt(2)]
        m = __fmul_rn(m, 0.5f);
        e += 1;
    }
    // log2(m) = 2 / ln 2 * atanh(s), s = (m - 1) / (m + 1): s + s^3 / 3 + ... + s^9 / 9
    const float s = __fdiv_rn(__fsub_rn(m, 1.0f), __fadd_rn(m, 1.0f));
    const float s2 = __fmul_rn(s, s);
    float p = 0x1.484b14p-2f;
    p = __fadd_rn(__fmul_rn(p, s2), 0x1.a61762p-2f);
    p = __fadd_rn(__fmul_rn(p, s2), 0x1.2776c6p-1f);
    p = __fadd_rn(__fmul_rn(p, s2), 0x1.ec709ep-1f);
    p = __fadd_rn(__fmul_rn(p, s2), 0x1.715476p+1f);
    return __fadd_rn((float)e, __fmul_rn(p, s));
}

__device__ __forceinline__ float repro_exp2(float y) {  // y finite, y < 128
    const float n = floorf(y);
    const float f = __fsub_rn(y, n);  // exact, in [0, 1)
    float p = 0x1.b5253ep-24f;        // ln(2)^k / k!, k = 9 .. 1
    p = __fadd_rn(__fmul_rn(p, f), 0x1.62c022p-20f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.ffcbfcp-17f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.430912p-13f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.5d87fep-10f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.3b2ab6p-7f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.c6b08ep-5f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.ebfbe0p-3f);
    p = __fadd_rn(__fmul_rn(p, f), 0x1.62e430p-1f);
    p = __fadd_rn(__fmul_rn(p, f), 1.0f);
    const int k = max((int)n, -252);
    if (k >= -126)
        return __fmul_rn(p, __int_as_float((k + 127) << 23));
    return __fmul_rn(__fmul_rn(p, 0x1p-126f), __int_as_float((k + 126 + 127) << 23));  // one rounding
}

// A group's LogFMT parameters from its amax and amin (exact BF16 values); false if it stays BF16.
struct LogFmtGroup {
    float log_amin, step, step_inv;
    bool cast;
    __device__ __forceinline__ LogFmtGroup(float amax, float amin) {
        const float log_amax = repro_log2(amax);
        log_amin = fmaxf(repro_log2(amin), __fsub_rn(log_amax, 32.0f));
        cast = log_amax < 0.0f && log_amin < log_amax;
        step = __fdiv_rn(__fsub_rn(log_amax, log_amin), 510.0f);
        step_inv = __fdiv_rn(1.0f, step);
    }
    // floor(max(log2(a) / step + rounding - log_amin / step, 0)), at most 511
    __device__ __forceinline__ unsigned encode(float a, float fused) const {
        const float v = fmaxf(__fadd_rn(__fmul_rn(repro_log2(a), step_inv), fused), 0.0f);
        return min((unsigned)floorf(v), 511u);
    }
    __device__ __forceinline__ float fused_rounding() const {
        const float mean = __fmul_rn(__fadd_rn(1.0f, repro_exp2(step)), 0.5f);
        const float rounding = __fsub_rn(2.0f, __fmul_rn(repro_log2(mean), step_inv));
        return __fsub_rn(rounding, __fmul_rn(log_amin, step_inv));
    }
    __device__ __forceinline__ float decode(unsigned code) const {
        return code == 0 ? 0.0f : repro_exp2(__fadd_rn(__fmul_rn((float)(code - 1), step), log_amin));
    }
};

__device__ __forceinline__ float bf16_bits_to_float(unsigned bits) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ unsigned ld_word(const unsigned* p) { return (unsigned)ld_stream(reinterpret_cast<const int*>(p)); }

// One warp writes the BF16 row `x_row` into `slot` in LogFMT (see above).
template <int kUnroll>
__device__ __forceinline__ void logfmt_write_row(char* slot, const int4* x_row, int hidden, int lane) {
    constexpr int kChunkInt4 = 32 * kUnroll;
    constexpr int kLanesPerGroup = FP8_SCALE_BLOCK / (8 * kUnroll);  // 128 channels
    const int num_groups = hidden / 128;
    unsigned* meta = reinterpret_cast<unsigned*>(slot);
    char* data = slot + num_groups * 4;
    int64_t_ offset = 0;
    for (int chunk = 0; chunk < hidden / 8; chunk += kChunkInt4) {
        int4 v[kUnroll];
        #pragma unroll
        for (int j = 0; j < kUnroll; ++j)
            v[j] = ld_stream(x_row + chunk + lane * kUnroll + j);
        const unsigned* words = reinterpret_cast<const unsigned*>(v);
        float amax = 0.0f, amin = __int_as_float(0x7f800000);
        unsigned signs = 0;
        #pragma unroll
        for (int k = 0; k < kUnroll * 4; ++k) {
            signs |= ((words[k] >> 15) & 1u) << (k * 2);
            signs |= ((words[k] >> 31) & 1u) << (k * 2 + 1);
            const float lo = bf16_bits_to_float(words[k] & 0x7fffu), hi = bf16_bits_to_float((words[k] >> 16) & 0x7fffu);
            amax = fmaxf(amax, fmaxf(lo, hi));
            amin = fminf(amin, fminf(lo, hi));
        }
        #pragma unroll
        for (int o = 1; o < kLanesPerGroup; o <<= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
            amin = fminf(amin, __shfl_xor_sync(0xffffffffu, amin, o));
        }
        const LogFmtGroup group(amax, amin);
        const bool cast = __all_sync(0xffffffffu, group.cast);
        if (lane % kLanesPerGroup == 0)
            meta[(chunk * 8 + lane * kUnroll * 8) / 128] = (__float_as_uint(amax) >> 16) | (__float_as_uint(amin) & 0xffff0000u);
        if (cast) {
            const float fused = group.fused_rounding();
            unsigned* out = reinterpret_cast<unsigned*>(data + offset + lane * kUnroll * 10);
            #pragma unroll
            for (int i = 0; i < kUnroll / 2; ++i) {
                unsigned e[16];
                #pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const unsigned w = words[i * 8 + k];
                    e[k * 2 + 0] = group.encode(bf16_bits_to_float(w & 0x7fffu), fused);
                    e[k * 2 + 1] = group.encode(bf16_bits_to_float((w >> 16) & 0x7fffu), fused);
                }
                out[i * 5 + 0] = (e[0] >> 0) | (e[1] << 9) | (e[2] << 18) | (e[3] << 27);
                out[i * 5 + 1] = (e[3] >> 5) | (e[4] << 4) | (e[5] << 13) | (e[6] << 22) | (e[7] << 31);
                out[i * 5 + 2] = (e[7] >> 1) | (e[8] << 8) | (e[9] << 17) | (e[10] << 26);
                out[i * 5 + 3] = (e[10] >> 6) | (e[11] << 3) | (e[12] << 12) | (e[13] << 21) | (e[14] << 30);
                out[i * 5 + 4] = (e[14] >> 2) | (e[15] << 7) | (i == 0 ? (signs << 16) : (signs & 0xffff0000u));
            }
            offset += 32 * kUnroll * 10;
        } else {
            int4* out = reinterpret_cast<int4*>(data + offset) + lane * kUnroll;
            #pragma unroll
            for (int j = 0; j < kUnroll; ++j)
                out[j] = v[j];
            offset += 32 * kUnroll * 16;
        }
    }
}

// One warp sums token `t`'s LogFMT rows (the slots of its top-k experts in `area`) with their
// weights into its BF16 row of combined_x, as the BF16 receive does (products and sums rounded,
// in top-k order).
template <int kUnroll>
__device__ __forceinline__ void logfmt_sum_token(void* combined_x, const char* area, const int64_t_* topk_idx,
                                                 const float* topk_weights, int t, int num_topk, int hidden,
                                                 int num_max, int64_t_ slot_bytes, int lane, unsigned used) {
    constexpr int kChunkInt4 = 32 * kUnroll;
    constexpr int kGroupsPerChunk = kChunkInt4 * 8 / 128;
    constexpr int kCastBytes = 32 * kUnroll * 10, kRawBytes = 32 * kUnroll * 16;
    const int num_groups = hidden / 128;
    const int num_chunks = hidden / 8 / kChunkInt4;
    // Which chunks of each row are LogFMT (lane c decides chunk c from the row's meta).
    unsigned cast_chunks[MAX_TOPK];
    for (int k = 0; k < num_topk; ++k) {
        const int64_t_ expert = topk_idx[(int64_t_)t * num_topk + k];
        bool cast = false;
        if (((used >> k) & 1u) && lane < num_chunks) {
            const unsigned* meta = reinterpret_cast<const unsigned*>(area + (expert * num_max + t) * slot_bytes);
            cast = true;
            for (int g = lane * kGroupsPerChunk; g < (lane + 1) * kGroupsPerChunk; ++g) {
                const unsigned m = ld_word(meta + g);
                cast = cast && LogFmtGroup(bf16_bits_to_float(m & 0xffffu), bf16_bits_to_float(m >> 16)).cast;
            }
        }
        cast_chunks[k] = __ballot_sync(0xffffffffu, cast);
    }
    for (int c = 0; c < num_chunks; ++c) {
        float sum[kUnroll * 8];
        #pragma unroll
        for (int j = 0; j < kUnroll * 8; ++j)
            sum[j] = 0.0f;
        const int group = (c * kChunkInt4 + lane * kUnroll) * 8 / 128;
        for (int k = 0; k < num_topk; ++k) {
            const int64_t_ expert = topk_idx[(int64_t_)t * num_topk + k];
            if (!((used >> k) & 1u))
                continue;
            const float weight = topk_weights[(int64_t_)t * num_topk + k];
            const char* slot = area + (expert * num_max + t) * slot_bytes;
            const int cast_before = __popc(cast_chunks[k] & ((1u << c) - 1u));
            const char* data = slot + num_groups * 4 + (int64_t_)cast_before * kCastBytes
                               + (int64_t_)(c - cast_before) * kRawBytes;
            float v[kUnroll * 8];
            if ((cast_chunks[k] >> c) & 1u) {
                const unsigned m = ld_word(reinterpret_cast<const unsigned*>(slot) + group);
                const LogFmtGroup g(bf16_bits_to_float(m & 0xffffu), bf16_bits_to_float(m >> 16));
                const unsigned* in = reinterpret_cast<const unsigned*>(data + lane * kUnroll * 10);
                #pragma unroll
                for (int i = 0; i < kUnroll / 2; ++i) {
                    unsigned w[5];
                    #pragma unroll
                    for (int q = 0; q < 5; ++q)
                        w[q] = ld_word(in + i * 5 + q);
                    unsigned concat[6];
                    concat[0] = w[0];
                    #pragma unroll
                    for (int q = 1; q < 5; ++q)
                        concat[q] = (w[q - 1] >> (32 - q * 5)) | (w[q] << (q * 5));
                    concat[5] = w[4] >> 7;
                    const unsigned signs = w[4] >> 16;
                    #pragma unroll
                    for (int j = 0; j < 16; ++j) {
                        const unsigned code = (concat[j / 3] >> ((j % 3) * 9)) & 0x1ffu;
                        const float d = g.decode(code);
                        v[i * 16 + j] = ((signs >> j) & 1u) ? -d : d;
                    }
                }
            } else {
                #pragma unroll
                for (int j = 0; j < kUnroll; ++j)
                    Elem<bf16_t>::unpack(ld_stream(reinterpret_cast<const int4*>(data) + lane * kUnroll + j), v + j * 8);
            }
            #pragma unroll
            for (int j = 0; j < kUnroll * 8; ++j)
                sum[j] = __fadd_rn(sum[j], __fmul_rn(weight, v[j]));
        }
        int4* out = reinterpret_cast<int4*>(combined_x) + (int64_t_)t * (hidden / 8) + c * kChunkInt4 + lane * kUnroll;
        #pragma unroll
        for (int j = 0; j < kUnroll; ++j)
            st_stream(out + j, Elem<bf16_t>::pack(sum + j * 8));
    }
}

// ---------------------------------------------------------------------------------------------
// Combine

// Warps that send one local expert's rows together: a power of two that divides the block's
// warps (a team lies in one block and meets at a named barrier before its flags), as many as the
// grid has per local expert.
__device__ __forceinline__ int combine_team_warps(int num_local) {
    int team = 1;
    while (team * 2 <= kLLWarps && team * 2 * num_local <= grid_warps())
        team *= 2;
    return team;
}

__device__ __forceinline__ void team_sync(int team_warps) {
    if (team_warps == 1) {
        __syncwarp();
        return;
    }
    const int id = 1 + (threadIdx.x / 32) / team_warps;  // barrier 0 is __syncthreads'
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(team_warps * 32) : "memory");
}


// Rows whose loads one lane of the BF16 receive issues before it adds them (in top-k order).
constexpr int kSumBatch = 8;

// One warp sums the rows `used` (bit k: top-k entry k) of token t, 256 channels (chunk `chunk`),
// with their weights into its BF16 row of combined_x: products and sums rounded, in top-k order.
__device__ __forceinline__ void sum_chunk(void* combined_x, const char* area, const int64_t_* topk_idx,
                                          const float* topk_weights, int t, int chunk, int num_topk, int row_int4,
                                          int num_max, int64_t_ slot_bytes, int lane, unsigned used) {
    const int i = chunk * 32 + lane;
    float sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k0 = 0; k0 < num_topk; k0 += kSumBatch) {
        int4 v[kSumBatch];
        float weight[kSumBatch];
        #pragma unroll
        for (int b = 0; b < kSumBatch; ++b) {
            const int k = k0 + b;
            v[b] = make_int4(0, 0, 0, 0);
            weight[b] = 0.0f;
            if (k < num_topk && ((used >> k) & 1u) && i < row_int4) {
                const int64_t_ expert = __ldg(topk_idx + (int64_t_)t * num_topk + k);
                weight[b] = __ldg(topk_weights + (int64_t_)t * num_topk + k);
                v[b] = ld_stream(reinterpret_cast<const int4*>(area + (expert * num_max + t) * slot_bytes) + i);
            }
        }
        #pragma unroll
        for (int b = 0; b < kSumBatch; ++b) {
            if (k0 + b >= num_topk || !((used >> (k0 + b)) & 1u))
                continue;
            float f[8];
            Elem<bf16_t>::unpack(v[b], f);
            #pragma unroll
            for (int j = 0; j < 8; ++j)
                sum[j] = __fadd_rn(sum[j], __fmul_rn(weight[b], f[j]));
        }
    }
    if (i < row_int4)
        st_stream(reinterpret_cast<int4*>(combined_x) + (int64_t_)t * row_int4 + i, Elem<bf16_t>::pack(sum));
}

// x: BF16 [L][R * M][hidden], the rows of the dispatch whose handle gives src_info and
// layout_range (the zero-copy area when the caller wrote its rows there). combined_x: BF16
// [num_tokens][hidden]. phases as for dispatch. logfmt_unroll: 0 for BF16 rows, else the rows
// travel in LogFMT with that unroll (2 or 4, see above). slot_bytes: a row's slot in the combine
// area (hidden * 2, or with LogFMT hidden * 2 + hidden / 32 for its meta).
//
// Send: per local expert a team of warps writes its rows (BF16 rows cut in pieces of one round of
// kCopyUnroll loads, at most one per warp; LogFMT rows whole) into their tokens' slots at the
// tokens' ranks, then flags the expert at every rank. Receive: each warp takes a run of (token, 256
// channels) pieces, waits for the flags of the token's experts and sums their rows (LogFMT: whole
// tokens).
__global__ void __launch_bounds__(LL_THREADS) combine(
        void* combined_x, const void* x, const int64_t_* topk_idx, const float* topk_weights, const int* src_info,
        const int64_t_* layout_range, int64_t_* wait_recv_cost_stats, int num_tokens, int num_topk, int hidden,
        int num_max, int num_experts, int phases, int shrink, int logfmt_unroll, int64_t_ slot_bytes,
        int64_t_ combine_off, int64_t_ half_bytes,
        void* const* buffer_ptrs, int num_ranks, int rank, int64_t_ timeout_ns, int* error_record) {
    const int lane = threadIdx.x % 32;
    const int warp_id = grid_warp(), num_warps = grid_warps();
    const int num_local = num_experts / num_ranks;
    const int row_int4 = hidden / 8;
    __shared__ int masked[DEEPEP_MAX_RANKS];
    int* mask = mask_words(buffer_ptrs, rank, shrink);
    int send_call, recv_call;
    if (enter(buffer_ptrs, rank, 1, KERNEL_LOW_LATENCY_COMBINE_SEND, error_record, send_call, recv_call))
        return;
    LL_STAMP(1, (phases & 1) ? send_call : recv_call, 0);
    bool failed = false;

    if (phases & 1) {
        const int half = send_call & 1;
        if (!wait_released(buffer_ptrs, num_ranks, rank, 1, send_call, timeout_ns, error_record,
                           KERNEL_LOW_LATENCY_COMBINE_SEND, mask))
            return;
        LL_STAMP(1, send_call, 1);
        snapshot_mask(mask, num_ranks, masked);
        const int rows_per_expert = num_ranks * num_max;
        const int team_warps = combine_team_warps(num_local);
        const int num_teams = num_warps / team_warps, team = warp_id / team_warps, member = warp_id % team_warps;
        // LogFMT rows are written whole: where a chunk lands depends on every chunk before it.
        const int pieces = logfmt_unroll != 0 ? 1 : min(team_warps, (row_int4 + 32 * kCopyUnroll - 1) / (32 * kCopyUnroll));
        for (int local = team; local < num_local; local += num_teams) {
            const int expert = rank * num_local + local;
            // The rows for rank s are [before_s, before_s + count_s) (the dispatch's layout).
            const int64_t_ range = lane < num_ranks ? layout_range[local * num_ranks + lane] : 0;
            const int before = (int)(range >> 32);
            const int total = __shfl_sync(kFullMask, before + (int)(range & 0xffffffff), num_ranks - 1);
            for (int item = member; item < total * pieces; item += team_warps) {
                const int row = item / pieces, piece = item % pieces;
                const int dst = source_of_row(before, row, num_ranks, lane);
                if (masked[dst])
                    continue;  // nothing for a masked rank
                const int64_t_ x_row = (int64_t_)local * rows_per_expert + row;
                const int token = src_info[x_row];
                char* slot = reinterpret_cast<char*>(buffer_ptrs[dst]) + combine_off + half * half_bytes
                             + ((int64_t_)expert * num_max + token) * slot_bytes;
                const int4* x_int4 = reinterpret_cast<const int4*>(x) + x_row * row_int4;
                if (logfmt_unroll == 4) {
                    logfmt_write_row<4>(slot, x_int4, hidden, lane);
                } else if (logfmt_unroll == 2) {
                    logfmt_write_row<2>(slot, x_int4, hidden, lane);
                } else {
                    copy_piece(reinterpret_cast<int4*>(slot), x_int4, row_int4, piece, pieces, lane);
                }
            }
            LL_STAMP(1, send_call, 6);
            team_sync(team_warps);  // the team's rows before its flags (each a system-scope release)
            if (member == 0 && lane < num_ranks && !masked[lane]) {
                int* flag = reinterpret_cast<int*>(reinterpret_cast<char*>(buffer_ptrs[lane]) + LL_COMBINE_FLAGS_OFFSET)
                            + half * MAX_EXPERTS + expert;
                st_release_sys(flag, send_call + 1);
            }
        }
        LL_STAMP(1, send_call, 2);
    }

    if ((phases & 2) && !failed) {
        const int half = recv_call & 1;
        const int epoch = recv_call + 1;
        const int* flags = reinterpret_cast<const int*>(reinterpret_cast<const char*>(buffer_ptrs[rank])
                                                        + LL_COMBINE_FLAGS_OFFSET) + half * MAX_EXPERTS;
        const char* area = reinterpret_cast<const char*>(buffer_ptrs[rank]) + combine_off + half * half_bytes;
        const int chunks = logfmt_unroll != 0 ? 1 : (row_int4 + 31) / 32;
        // A run of consecutive pieces per warp: mostly one token's, whose flags it waits for once.
        const int num_items = num_tokens * chunks;
        const int run = (num_items + num_warps - 1) / num_warps;
        int waited_token = -1;
        unsigned used = 0;
        for (int item = warp_id * run; item < min(num_items, (warp_id + 1) * run); ++item) {
            const int t = item / chunks, chunk = item % chunks;
            if (t != waited_token) {
                int expert = -1;
                if (lane < num_topk) {
                    const int64_t_ e = topk_idx[(int64_t_)t * num_topk + lane];
                    expert = e >= 0 && e < num_experts ? (int)e : -1;
                }
                bool ok = true;
                if (expert >= 0 && !is_masked(mask, expert / num_local)) {
                    // DeepEP's wait_recv_cost: the clock64 cycles polled without the flag, per owner.
                    const int owner = expert / num_local;
                    const long long start = clock64();
                    long long cost = 0;
                    LLWait wait(buffer_ptrs, num_ranks, rank, timeout_ns, error_record,
                                KERNEL_LOW_LATENCY_COMBINE_RECEIVE, expert, mask);
                    while (ld_acquire_sys(flags + expert) != epoch) {
                        if (LL_POLL_SLEEP_NS > 0)
                            __nanosleep(LL_POLL_SLEEP_NS);
                        cost = clock64() - start;
                        const int state = wait.poll(owner, epoch);
                        if (state != kKeepWaiting) {
                            ok = state != kStop;
                            break;
                        }
                    }
                    if (wait_recv_cost_stats != nullptr)
                        atomicAdd(reinterpret_cast<unsigned long long*>(wait_recv_cost_stats + owner),
                                  (unsigned long long)cost);
                }
                if (!__all_sync(kFullMask, ok)) {
                    failed = true;
                    break;
                }
                LL_STAMP(1, recv_call, 3);
                // The rows summed: those whose owner is unmasked now.
                used = __ballot_sync(kFullMask, expert >= 0 && !is_masked(mask, expert / num_local));
                waited_token = t;
            }
            if (logfmt_unroll == 4)
                logfmt_sum_token<4>(combined_x, area, topk_idx, topk_weights, t, num_topk, hidden, num_max,
                                    slot_bytes, lane, used);
            else if (logfmt_unroll == 2)
                logfmt_sum_token<2>(combined_x, area, topk_idx, topk_weights, t, num_topk, hidden, num_max,
                                    slot_bytes, lane, used);
            else
                sum_chunk(combined_x, area, topk_idx, topk_weights, t, chunk, num_topk, row_int4, num_max,
                          slot_bytes, lane, used);
        }
    }
    if (__syncthreads_or(failed))
        return;
    LL_STAMP(1, (phases & 1) ? send_call : recv_call, 4);
    leave(buffer_ptrs, num_ranks, rank, 1, phases, send_call, recv_call, mask);
}

// ---------------------------------------------------------------------------------------------
// Barrier of a shrink-mode clean (DeepEP's masked barrier): one block; this rank counts its
// barriers down in its LL_SYNC_INT + rank word, writes the count into every unmasked peer's word
// for it and waits until each unmasked peer's count has reached ours; a peer that does not arrive
// in time is masked.
__global__ void __launch_bounds__(LOW_LATENCY_BARRIER_THREADS) barrier(
        void* const* buffer_ptrs, int num_ranks, int rank, int64_t_ timeout_ns, int* error_record) {
    int* sync = ll_words(buffer_ptrs, rank) + LL_SYNC_INT;
    int* mask = mask_words(buffer_ptrs, rank, 1);
    __shared__ int count;
    if (threadIdx.x == 0)
        count = atomicAdd(sync + rank, -1) - 1;
    __syncthreads();
    const int peer = threadIdx.x;
    if (peer < num_ranks && peer != rank && !is_masked(mask, peer)) {
        st_release_sys(ll_words(buffer_ptrs, peer) + LL_SYNC_INT + rank, count);
        LLWait wait(buffer_ptrs, num_ranks, rank, timeout_ns, error_record, KERNEL_LOW_LATENCY_DISPATCH_SEND, -1, mask);
        while (ld_acquire_sys(sync + peer) - count > 0)  // counts go down; a peer may be one barrier ahead
            if (wait.poll(peer, count) != kKeepWaiting)
                break;
    }
}

}  // namespace low_latency
}  // namespace deepep_cupy
