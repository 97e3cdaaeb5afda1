// Shared device helpers for the deepep-cupy kernels.
//
// No system headers: every source must compile with NVRTC alone (the CPU-only CI has no CUDA
// toolkit headers), so fixed-width types, memory-order primitives and the 16-bit float
// conversions are written here with inline PTX.
#pragma once

typedef long long int64_t_;
typedef unsigned long long uint64_t_;

#include "constants.cuh"

// ---------------------------------------------------------------------------------------------
// Error record (host-mapped pinned memory, int[8]), written by the first thread that gives up.
//   [0] code (0 = fine, ERROR_TIMEOUT, ERROR_MISMATCH, ERROR_PEER_ABORTED)   [1] kernel id (KERNEL_*)
//   [2] rank   [3] channel   [4] peer rank (for ERROR_MISMATCH: the rank that differs; for
//   ERROR_PEER_ABORTED: the rank that gave up)   [5] detail (tokens still expected, or the value waited for)
//   [6] for ERROR_PEER_ABORTED: why that rank gave up (0: a wait of its timed out; else the
//   HOST_FAILURES code of a failure of its host after it had launched kernels)
// The host reads it after a wait and raises a Python exception naming rank, kernel and channel.
//
// Every rank's NVLink buffer holds, at int VERDICT_INT, the rank's verdict on the current call's
// settings (0: all ranks agree; VERDICT_OVER_CAPACITY: a rank would receive more tokens than its
// host allocated rows for). Written only by the rank itself; the transfer kernels read it first
// and move nothing when it is not 0, so ranks that disagree all stop instead of waiting for
// each other.
//
// And at int ABORT_INT, the abort mark: 0, or r + 1 once rank r gave up on the Buffer (a wait of
// its timed out). The rank that gives up writes it into every rank's buffer, its own included,
// and every later wait on any rank sees it and stops at once: a late rank must not wait out its
// own timeout, nor pass a barrier on an epoch that the rank which gave up stored before it left.
// Never reset: a Buffer that a rank gave up on is unusable, and a new Buffer's memory starts zeroed.
// Beside it, at int ABORT_REASON_INT, why (written before the mark; by the host when it is its
// host that failed: deepep_cupy/ipc.py).

__device__ __forceinline__ int* verdict_word(void* const* buffer_ptrs, int rank) {
    return reinterpret_cast<int*>(buffer_ptrs[rank]) + VERDICT_INT;
}

__device__ __forceinline__ int* abort_word(void* const* buffer_ptrs, int rank) {
    return reinterpret_cast<int*>(buffer_ptrs[rank]) + ABORT_INT;
}

__device__ __forceinline__ int* abort_reason_word(void* const* buffer_ptrs, int rank) {
    return reinterpret_cast<int*>(buffer_ptrs[rank]) + ABORT_REASON_INT;
}

__device__ __forceinline__ uint64_t_ now_ns() {
    uint64_t_ t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void report_error(int* error_record, int code, int kernel, int rank,
                                             int channel, int peer, int detail, int reason = 0) {
    if (error_record == nullptr)
        return;
    // Only the first failure is kept: later ones are usually consequences of it.
    if (atomicCAS(error_record, 0, -1) == 0) {
        error_record[1] = kernel;
        error_record[2] = rank;
        error_record[3] = channel;
        error_record[4] = peer;
        error_record[5] = detail;
        error_record[6] = reason;
        __threadfence_system();
        atomicExch(error_record, code);
        __threadfence_system();
    }
}

// ---------------------------------------------------------------------------------------------
// Memory-order primitives. Peer buffers are reached over NVLink, so the flags that order a
// peer's data writes against our reads use system scope.

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
    int v;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ int64_t_ ld_acquire_sys(const int64_t_* p) {
    int64_t_ v;
    asm volatile("ld.acquire.sys.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// A count that warps of one GPU add to and one of them waits for (the signal that follows it to
// the peers is a system-scope release, which carries what the count ordered before it).
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void add_release_gpu(int* p, int v) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int ld_volatile(const int* p) {
    int v;
    asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ int64_t_ ld_volatile(const int64_t_* p) {
    int64_t_ v;
    asm volatile("ld.volatile.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(int* p, int v) {
    asm volatile("st.release.sys.global.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_release_sys(int64_t_* p, int64_t_ v) {
    asm volatile("st.release.sys.global.s64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(int* p, int v) {
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Giving up on peers.

// A deadline for one spin loop; `timeout_ns <= 0` never expires.
struct Deadline {
    uint64_t_ start, limit;
    __device__ __forceinline__ explicit Deadline(int64_t_ timeout_ns)
        : start(now_ns()), limit(timeout_ns > 0 ? (uint64_t_)timeout_ns : 0) {}
    __device__ __forceinline__ bool expired() const {
        return limit != 0 && now_ns() - start > limit;
    }
};

// The rank that gave up on this Buffer (its mark in our own buffer), or -1 while none has.
__device__ __forceinline__ int rank_that_gave_up(void* const* buffer_ptrs, int rank) {
    return ld_volatile(abort_word(buffer_ptrs, rank)) - 1;
}

// A wait of ours timed out: record it and tell every rank (ourselves included) that we gave up.
// The marks go first and are fenced before the record: once our host has seen the record and
// told a late peer so, that peer's kernels are sure to see the mark. (Our own waits that see our
// mark meanwhile stop without a record of their own: report_a_rank_gave_up.)
__device__ __forceinline__ void give_up(void* const* buffer_ptrs, int num_ranks, int* error_record, int kernel,
                                        int rank, int channel, int peer, int detail) {
    #pragma unroll 1  // a cold path: unrolled, it would hold every peer's address in registers
    for (int r = 0; r < num_ranks; ++r)
        st_relaxed_sys(abort_word(buffer_ptrs, r), rank + 1);
    __threadfence_system();
    report_error(error_record, ERROR_TIMEOUT, kernel, rank, channel, peer, detail);
}

// The record of a wait that stops because `quitter` gave up on the Buffer. Our own mark needs none:
// the thread of ours that gave up records its timeout itself, and that record must win (it names
// the stage and the peer that did not come), not a mere echo of it from a sibling wait.
__device__ __forceinline__ void report_a_rank_gave_up(void* const* buffer_ptrs, int* error_record, int kernel,
                                                      int rank, int channel, int quitter, int detail) {
    if (quitter != rank)
        report_error(error_record, ERROR_PEER_ABORTED, kernel, rank, channel, quitter, detail,
                     ld_volatile(abort_reason_word(buffer_ptrs, rank)));
}

// True (with ERROR_PEER_ABORTED recorded, naming the rank that gave up) when some rank has given
// up on the Buffer: the caller must stop waiting.
__device__ __forceinline__ bool stop_if_a_rank_gave_up(void* const* buffer_ptrs, int* error_record, int kernel,
                                                       int rank, int channel, int detail) {
    const int quitter = rank_that_gave_up(buffer_ptrs, rank);
    if (quitter < 0)
        return false;
    report_a_rank_gave_up(buffer_ptrs, error_record, kernel, rank, channel, quitter, detail);
    return true;
}

// Spin loops look at the abort mark once per this many polls: a load in every poll would delay
// their reaction to what they wait for, and an abort is seen soon enough this way.
constexpr unsigned kPollsPerAbortCheck = 32;

// One wait for peers, polled once per spin iteration: it ends when another rank has given up on
// the Buffer (a load of our own abort word every kPollsPerAbortCheck polls) or when its deadline
// passes (we then give up).
struct PeerWait {
    Deadline deadline;
    void* const* buffer_ptrs;
    int* error_record;
    int num_ranks, rank, kernel, channel;
    unsigned polls;

    __device__ __forceinline__ PeerWait(void* const* buffer_ptrs_, int num_ranks_, int rank_, int64_t_ timeout_ns,
                                        int* error_record_, int kernel_, int channel_)
        : deadline(timeout_ns), buffer_ptrs(buffer_ptrs_), error_record(error_record_), num_ranks(num_ranks_),
          rank(rank_), kernel(kernel_), channel(channel_), polls(0) {}

    // True when the wait must end; the reason is recorded. `peer`: the rank waited for.
    __device__ __forceinline__ bool failed(int peer, int detail) {
        if (++polls % kPollsPerAbortCheck == 0 &&
            stop_if_a_rank_gave_up(buffer_ptrs, error_record, kernel, rank, channel, detail))
            return true;
        if (!deadline.expired())
            return false;
        give_up(buffer_ptrs, num_ranks, error_record, kernel, rank, channel, peer, detail);
        return true;
    }
};

// The transfer kernels' first step, on every thread: false when nothing may move, because the
// ranks disagree on this call (the verdict) or because a rank gave up on the Buffer (recorded
// once, by the first thread of the grid).
__device__ __forceinline__ bool transfer_may_start(void* const* buffer_ptrs, int rank, int* error_record,
                                                   int kernel) {
    if (ld_volatile(verdict_word(buffer_ptrs, rank)) != 0)
        return false;
    const int quitter = rank_that_gave_up(buffer_ptrs, rank);
    if (quitter < 0)
        return true;
    if (blockIdx.x == 0 && threadIdx.x == 0)
        report_a_rank_gave_up(buffer_ptrs, error_record, kernel, rank, -1, quitter, -1);
    return false;
}

// Streaming 16-byte load that bypasses L1: ring slots are rewritten by peers, so a line must
// never be served from a stale L1 copy.
__device__ __forceinline__ int4 ld_stream(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ int ld_stream(const int* p) {
    int v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ int64_t_ ld_stream(const int64_t_* p) {
    int64_t_ v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.s64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ float ld_stream(const float* p) {
    float v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ void st_stream(int4* p, const int4& v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

__device__ __forceinline__ void st_stream(uint2* p, const uint2& v) {
    asm volatile("st.global.L1::no_allocate.v2.u32 [%0], {%1, %2};" :: "l"(p), "r"(v.x), "r"(v.y));
}

// One warp copies `n` 16-byte words. Each lane keeps kUnroll loads in flight before storing;
// the last, partial round is predicated rather than done word by word, which would cost a full
// memory latency per word.
template <int kUnroll>
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int n, int lane) {
    int i = lane;
    for (; i + (kUnroll - 1) * 32 < n; i += kUnroll * 32) {
        int4 v[kUnroll];
        #pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            v[u] = ld_stream(src + i + u * 32);
        #pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            st_stream(dst + i + u * 32, v[u]);
    }
    if (i < n) {
        int4 v[kUnroll - 1];
        #pragma unroll
        for (int u = 0; u < kUnroll - 1; ++u)
            if (i + u * 32 < n)
                v[u] = ld_stream(src + i + u * 32);
        #pragma unroll
        for (int u = 0; u < kUnroll - 1; ++u)
            if (i + u * 32 < n)
                st_stream(dst + i + u * 32, v[u]);
    }
}

// One warp copies `n` 16-byte words from `src` to every non-null entry of `dsts`: each word is
// loaded once and stored to every destination (a token fanned out to the ranks that take it).
template <int kUnroll, int kNumDsts>
__device__ __forceinline__ void warp_fan_out(int4* const (&dsts)[kNumDsts], const int4* src, int n, int lane) {
    for (int i = lane; i < n; i += kUnroll * 32) {
        int4 v[kUnroll];
        #pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            if (i + u * 32 < n)
                v[u] = ld_stream(src + i + u * 32);
        #pragma unroll
        for (int d = 0; d < kNumDsts; ++d) {
            if (dsts[d] == nullptr)
                continue;
            #pragma unroll
            for (int u = 0; u < kUnroll; ++u)
                if (i + u * 32 < n)
                    st_stream(dsts[d] + i + u * 32, v[u]);
        }
    }
}

// The transfer regions: a rank's NVLink buffer holds one region per other rank, the region of
// `source` in the buffer of `owner` being number (source - owner - 1) mod R, in 0 .. R - 2.
__device__ __forceinline__ int region_index(int source, int owner, int num_ranks) {
    return (source - owner - 1 + num_ranks) % num_ranks;
}

// The first row, in the receive order of `receiver`, of the block it receives from `source`.
__device__ __forceinline__ int block_row(const int* rank_prefix_matrix, int num_ranks, int source, int receiver) {
    return source > 0 ? rank_prefix_matrix[(source - 1) * num_ranks + receiver] : 0;
}

// The most tokens one rank sends another in a dispatch whose rank prefix matrix is given (the
// same matrix on every rank, so every rank finds the same). A combine sends the same rows back.
__device__ __forceinline__ int largest_rank_count(const int* rank_prefix_matrix, int num_ranks) {
    int largest = 0;
    for (int i = 0; i < num_ranks * num_ranks; ++i) {
        const int before = i >= num_ranks ? rank_prefix_matrix[i - num_ranks] : 0;
        largest = max(largest, rank_prefix_matrix[i] - before);
    }
    return largest;
}

// Named barrier over `num_threads` threads of the block (id 0 is __syncthreads').
__device__ __forceinline__ void group_sync(int barrier_id, int num_threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(barrier_id), "r"(num_threads) : "memory");
}

// ---------------------------------------------------------------------------------------------
// Work split: a rank's tokens are cut into `num_channels` contiguous ranges, one per channel.
__device__ __forceinline__ void channel_task_range(int num_tokens, int num_channels, int channel,
                                                   int& begin, int& end) {
    int per_channel = (num_tokens + num_channels - 1) / num_channels;
    begin = min(per_channel * channel, num_tokens);
    end = min(begin + per_channel, num_tokens);
}

// Stream compaction in a block, on all its threads: the place of this thread's `hit` among the
// block's hits in thread order (meaningful where `hit` holds), and their number in `total`.
// `warp_counts`: kWarps shared ints, which the block may reuse after its next __syncthreads.
template <int kWarps>
__device__ __forceinline__ int block_hit_place(bool hit, int* warp_counts, int& total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned hits = __ballot_sync(0xffffffffu, hit);
    if (lane == 0)
        warp_counts[warp] = __popc(hits);
    __syncthreads();
    int before = 0;
    total = 0;
    for (int w = 0; w < kWarps; ++w) {
        before += w < warp ? warp_counts[w] : 0;
        total += warp_counts[w];
    }
    return before + __popc(hits & ((1u << lane) - 1u));
}

__device__ __forceinline__ int warp_sum(int v) {
    #pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// ---------------------------------------------------------------------------------------------
// Cross-rank barrier on per-peer signal words.
//
// Every rank's NVLink buffer starts with `int signals[DEEPEP_MAX_RANKS]`; slot `src` is written
// only by rank `src`. A barrier with number `epoch` stores `epoch` into slot `rank` of every
// peer, then waits until each local slot has reached `epoch`. Epochs grow by one per barrier on
// every rank in the same order, so the words never need resetting (wrap-safe comparison).
// Once a rank has given up on the Buffer the words are stale (it may have stored an epoch before
// it left), so a barrier then fails at once, before it stores anything.
// Called by all threads of a block; returns false on every thread if any peer timed out or gave up.
__device__ __forceinline__ bool rank_barrier(void* const* buffer_ptrs, int num_ranks, int rank,
                                             int epoch, int64_t_ timeout_ns, int* error_record,
                                             int kernel) {
    __threadfence_system();
    __syncthreads();
    bool ok = true;
    int peer = threadIdx.x;
    if (peer < num_ranks) {
        PeerWait wait(buffer_ptrs, num_ranks, rank, timeout_ns, error_record, kernel, -1);
        if (stop_if_a_rank_gave_up(buffer_ptrs, error_record, kernel, rank, -1, epoch)) {
            ok = false;
        } else {
            st_release_sys(reinterpret_cast<int*>(buffer_ptrs[peer]) + rank, epoch);
            const int* mine = reinterpret_cast<const int*>(buffer_ptrs[rank]) + peer;
            while (ld_acquire_sys(mine) - epoch < 0) {
                if (wait.failed(peer, epoch)) {
                    ok = false;
                    break;
                }
            }
        }
    }
    return __syncthreads_and(ok) != 0;
}

// ---------------------------------------------------------------------------------------------
// 16-bit floating-point element types for combine, converted with PTX (no cuda_bf16.h).
struct bf16_t { unsigned short bits; };
struct fp16_t { unsigned short bits; };

template <typename T> struct Elem;

template <> struct Elem<float> {
    static constexpr int kPerInt4 = 4;
    __device__ __forceinline__ static void unpack(const int4& v, float* out) {
        out[0] = __int_as_float(v.x); out[1] = __int_as_float(v.y);
        out[2] = __int_as_float(v.z); out[3] = __int_as_float(v.w);
    }
    __device__ __forceinline__ static int4 pack(const float* in) {
        return make_int4(__float_as_int(in[0]), __float_as_int(in[1]),
                         __float_as_int(in[2]), __float_as_int(in[3]));
    }
};

__device__ __forceinline__ unsigned short float_to_bf16(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ unsigned short float_to_fp16(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float fp16_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

template <> struct Elem<bf16_t> {
    static constexpr int kPerInt4 = 8;
    __device__ __forceinline__ static void unpack(const int4& v, float* out) {
        const unsigned int w[4] = {(unsigned)v.x, (unsigned)v.y, (unsigned)v.z, (unsigned)v.w};
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = __uint_as_float(w[i] << 16);
            out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
    __device__ __forceinline__ static int4 pack(const float* in) {
        unsigned int w[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i)
            w[i] = (unsigned)float_to_bf16(in[2 * i]) | ((unsigned)float_to_bf16(in[2 * i + 1]) << 16);
        return make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
    }
};

template <> struct Elem<fp16_t> {
    static constexpr int kPerInt4 = 8;
    __device__ __forceinline__ static void unpack(const int4& v, float* out) {
        const unsigned int w[4] = {(unsigned)v.x, (unsigned)v.y, (unsigned)v.z, (unsigned)v.w};
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = fp16_to_float((unsigned short)(w[i] & 0xffffu));
            out[2 * i + 1] = fp16_to_float((unsigned short)(w[i] >> 16));
        }
    }
    __device__ __forceinline__ static int4 pack(const float* in) {
        unsigned int w[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i)
            w[i] = (unsigned)float_to_fp16(in[2 * i]) | ((unsigned)float_to_fp16(in[2 * i + 1]) << 16);
        return make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
    }
};
