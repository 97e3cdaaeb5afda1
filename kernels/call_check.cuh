// What every call checks and resets before it moves tokens: the call counters, the settings
// that ranks compare, and the reset of the transfer metadata. The notify kernel of a fresh
// dispatch does it among its count exchange; a cached dispatch and a combine do it at the start of
// their transfer kernel (check_call, then grid_sync).
#pragma once
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
// 0 = all agree, p + 1 = rank p's settings differ from rank 0's, -(p + 1) = rank p's input was invalid,
// VERDICT_HOST_FAILED + p * HOST_FAILURE_FLAG + code = rank p's host failed (code: what) and only
// takes part to refuse the call (first: its other settings may be anything).
__device__ __forceinline__ int settings_verdict(void* const* buffer_ptrs, int num_ranks, int rank,
                                                int64_t_ notify_off) {
    const int* area = reinterpret_cast<const int*>(reinterpret_cast<const char*>(buffer_ptrs[rank]) + notify_off);
    for (int peer = 0; peer < num_ranks; ++peer) {
        const int flag = area[peer * SIGNATURE_INTS + SIGNATURE_INTS - 1];
        if (flag >= HOST_FAILURE_FLAG)
            return VERDICT_HOST_FAILED + peer * HOST_FAILURE_FLAG + (flag - HOST_FAILURE_FLAG);
    }
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

// Before a cached dispatch or a combine moves anything: compare the call's settings across ranks
// and reset the transfer metadata (`zero_off`, `zero_count` ints), with one barrier. Block 0, all
// of it. The reset may come before the barrier: every store a peer made into this rank's metadata
// in the last call was seen by this rank's receivers (a tail is stored only when it grows, and the
// last one is the one they wait for), and no peer writes this call's before the barrier, which it
// passes only after this rank's reset. A disagreement is left in this rank's verdict word for
// the transfer and in the error record for the host. So is a handle that routes more tokens from
// one rank to another than a region of this call holds (`region_tokens`): every rank reads the
// same rank prefix matrix, so every rank refuses alike. `dispatch_verdict` (null when its host
// checked it) is the verdict of the dispatch whose handle the call uses: a refused one (reported
// then) makes this call move nothing too, on every rank alike. A rank whose host failed before
// the call (settings[0], the operation, is then minus the HOST_FAILURES code) takes part only to
// refuse it: every rank records ERROR_HOST_FAILED naming it, and nothing moves.
__device__ __forceinline__ void check_call(void* const* buffer_ptrs, int num_ranks, int rank, const int* settings,
                                           int64_t_ zero_off, int zero_count, const int* rank_prefix_matrix,
                                           int region_tokens, const int* dispatch_verdict, int64_t_ timeout_ns,
                                           int* error_record, int kernel) {
    CallCounters counters(buffer_ptrs, rank);
    const int64_t_ notify_off = counters.notify_off;
    publish_signature(buffer_ptrs, num_ranks, rank, notify_off, settings,
                      settings[0] < 0 ? HOST_FAILURE_FLAG - settings[0] : 0);
    zero_ints(buffer_ptrs[rank], zero_off, zero_count);
    if (!rank_barrier(buffer_ptrs, num_ranks, rank, counters.first_epoch, timeout_ns, error_record, kernel))
        return;
    if (threadIdx.x == 0) {
        int verdict = settings_verdict(buffer_ptrs, num_ranks, rank, notify_off);
        if (verdict >= VERDICT_HOST_FAILED) {
            const int failed = verdict - VERDICT_HOST_FAILED;
            report_error(error_record, ERROR_HOST_FAILED, kernel, rank, -1, failed / HOST_FAILURE_FLAG,
                         failed % HOST_FAILURE_FLAG);
        } else if (verdict != 0) {
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
    counters.advance(1, 1);
}

// Every block of the grid waits here until all have arrived (the transfer kernels' grids are
// resident at once: see deepep_cupy.comm.check_sm_budget). The arrival word (GRID_SYNC_INT of
// the rank's own buffer) resets itself: block 0 adds 2^31 - (blocks - 1), every other block 1,
// so its low bits come back to 0 and its top bit flips when the last block arrives (and only then:
// a block still spinning on one sync cannot miss its flip because others arrived at the next, so
// a kernel may sync twice, as an in-place dispatch does). False on
// every thread of a block whose wait timed out (the rank then gives up on the Buffer).
__device__ __forceinline__ bool grid_sync(void* const* buffer_ptrs, int num_ranks, int rank, int64_t_ timeout_ns,
                                          int* error_record, int kernel) {
    __syncthreads();
    int ok = 1;
    if (threadIdx.x == 0) {
        unsigned* word = reinterpret_cast<unsigned*>(buffer_ptrs[rank]) + GRID_SYNC_INT;
        const unsigned arrival = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
        __threadfence();
        const unsigned before = atomicAdd(word, arrival);
        const Deadline deadline(timeout_ns);
        while (((before ^ (unsigned)ld_volatile(reinterpret_cast<const int*>(word))) & 0x80000000u) == 0) {
            if (deadline.expired()) {
                give_up(buffer_ptrs, num_ranks, error_record, kernel, rank, -1, rank, (int)blockIdx.x);
                ok = 0;
                break;
            }
        }
        __threadfence();
    }
    return __syncthreads_and(ok) != 0;
}

// The end of a transfer kernel whose ranks write or read each other's areas in place: every block
// arrives, then block 0 meets the other ranks (its barrier numbered by the call counters, as a
// check's is), so that no rank's next call touches an area before every rank is done with this
// one. True on the threads of block 0 once the barrier has passed; false elsewhere and when a
// wait timed out.
__device__ __forceinline__ bool end_barrier(void* const* buffer_ptrs, int num_ranks, int rank, int64_t_ timeout_ns,
                                            int* error_record, int kernel) {
    if (!grid_sync(buffer_ptrs, num_ranks, rank, timeout_ns, error_record, kernel) || blockIdx.x != 0)
        return false;
    CallCounters counters(buffer_ptrs, rank);
    if (!rank_barrier(buffer_ptrs, num_ranks, rank, counters.first_epoch, timeout_ns, error_record, kernel))
        return false;
    counters.advance(1, 0);
    return true;
}

// The start of a transfer kernel, on every thread. With `check` (a cached dispatch, a combine),
// block 0 first runs check_call with `settings` while the other blocks wait for it. Then false
// when nothing may move: the ranks disagree on this call (the verdict) or a rank gave up on the
// Buffer.
__device__ __forceinline__ bool start_transfer(bool check, void* const* buffer_ptrs, int num_ranks, int rank,
                                               const int* settings, int64_t_ zero_off, int zero_count,
                                               const int* rank_prefix_matrix, int region_tokens,
                                               const int* dispatch_verdict, int64_t_ timeout_ns, int* error_record,
                                               int check_kernel, int transfer_kernel) {
    if (check) {
        if (blockIdx.x == 0)
            check_call(buffer_ptrs, num_ranks, rank, settings, zero_off, zero_count, rank_prefix_matrix,
                       region_tokens, dispatch_verdict, timeout_ns, error_record, check_kernel);
        if (!grid_sync(buffer_ptrs, num_ranks, rank, timeout_ns, error_record, check_kernel))
            return false;
    }
    return transfer_may_start(buffer_ptrs, rank, error_record, transfer_kernel);
}
