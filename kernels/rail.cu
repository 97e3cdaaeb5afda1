// rail: the local rail transport's all-to-all of equal blocks between the threads of one process,
// with no host in the loop, so that a CUDA graph can hold it.
//
// Each rank has a mailbox (RAIL_MAILBOX_WORDS int64 words in its own device memory) that its peers
// read and add to. A call is two kernels on the rank's stream: `post` numbers the call (the
// rank's own call counter, so that a replayed graph counts on) and publishes its send buffer;
// `pull` copies, from every peer once that peer's post of the same call number is visible, the
// peer's block for this rank, tells each peer it is done with its buffer, and waits until every
// peer is done with this rank's (the send buffer may be reused once the kernel ends). Every wait
// has a deadline: on expiry the error word of the mailbox is set and the kernel ends.
#include "common.cuh"

namespace deepep_cupy {
namespace rail {

__device__ __forceinline__ bool wait_at_least(const int64_t_* word, int64_t_ value, const Deadline& deadline,
                                              int64_t_* error, int64_t_ code) {
    while (ld_acquire_sys(word) < value) {
        if (deadline.expired()) {
            atomicExch_system(reinterpret_cast<unsigned long long*>(error), (unsigned long long)code);
            return false;
        }
    }
    return true;
}

__global__ void __launch_bounds__(RAIL_POST_THREADS) post(int64_t_* mailbox, int64_t_ send_ptr) {
    if (threadIdx.x != 0)
        return;
    const int64_t_ call = mailbox[RAIL_CALLS] + 1;
    mailbox[RAIL_CALLS] = call;
    mailbox[RAIL_SEND_PTR] = send_ptr;
    __threadfence_system();
    st_release_sys(mailbox + RAIL_READY, call);
}

// Block b copies part b of every peer's block for this rank into recv (peer p's at p * block_bytes).
__global__ void __launch_bounds__(RAIL_PULL_THREADS) pull(
        int64_t_* const* mailboxes, int rank, int num_peers, unsigned char* recv, int64_t_ block_bytes,
        int64_t_ timeout_ns) {
    __shared__ int ok;
    int64_t_* own = mailboxes[rank];
    const int64_t_ call = ld_volatile(own + RAIL_CALLS);
    const Deadline deadline(timeout_ns);
    const int64_t_ part = (block_bytes / 16 + gridDim.x - 1) / gridDim.x * 16;
    const int64_t_ begin = min(block_bytes, (int64_t_)blockIdx.x * part);
    const int64_t_ end = min(block_bytes, begin + part);
    for (int step = 0; step < num_peers; ++step) {
        const int p = (rank + step) % num_peers;
        int64_t_* peer = mailboxes[p];
        if (threadIdx.x == 0)
            ok = wait_at_least(peer + RAIL_READY, call, deadline, own + RAIL_ERROR, 1 + p);
        __syncthreads();
        if (!ok)
            return;
        const unsigned char* src = reinterpret_cast<const unsigned char*>(ld_volatile(peer + RAIL_SEND_PTR)) +
                                   (int64_t_)rank * block_bytes;
        unsigned char* dst = recv + (int64_t_)p * block_bytes;
        for (int64_t_ c = begin / 16 + threadIdx.x; c < end / 16; c += blockDim.x)
            reinterpret_cast<int4*>(dst)[c] = reinterpret_cast<const int4*>(src)[c];
        __syncthreads();
    }
    if (threadIdx.x != 0)
        return;
    __threadfence_system();
    const unsigned long long done = atomicAdd(reinterpret_cast<unsigned long long*>(own + RAIL_BLOCKS_DONE), 1ull);
    if ((int64_t_)done != call * gridDim.x - 1)
        return;
    // The last block of this rank: every read of this call is done.
    for (int p = 0; p < num_peers; ++p)
        atomicAdd_system(reinterpret_cast<unsigned long long*>(mailboxes[p] + RAIL_PULLED), 1ull);
    __threadfence_system();
    wait_at_least(own + RAIL_PULLED, call * num_peers, deadline, own + RAIL_ERROR, 1 + num_peers + rank);
}

}  // namespace rail
}  // namespace deepep_cupy
