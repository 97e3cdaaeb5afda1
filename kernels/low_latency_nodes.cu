// low_latency_nodes: the decode calls across nodes, around the node's own low-latency kernels.
//
// A token crosses to each node once, to its rail peer there (the rank with its local index), which
// dispatches it to the node's experts over NVLink as if it were one of its own tokens; the
// combine comes back the same way, one partial sum per (token, node). These kernels are what
// happens on either side of the node's kernels and of the rail's fixed-size blocks:
//   relay_tokens:   this rank's tokens into one block per node (top-k ids made that node's, the rows);
//   relay_routing:  the combine's top-k ids and weights into one block per node;
//   global_handle:  the node's receive layout (source = node rank l, token n * M + t of its rail's
//                   node n) as DeepEP's (source = rank n * L + l, token t);
//   sum_partials:   a token's partial sums from every node, added in node order;
//   rail_failed:    a timed-out wait of the rail's block exchange made this rank's giving up on the
//                   node's decode buffer, so that no node call moves the blocks it never got.
// deepep_cupy/low_latency/across_nodes.py lays out the blocks; deepep_cupy/reference/
// low_latency_nodes.py states the results.
#include "common.cuh"

namespace deepep_cupy {
namespace ll_nodes {

// Expert id `e` of this rank's token as node `n` sees it: its index among node n's experts when
// node n owns it, else -1; ids outside [-1, num_experts) stay as they are in the block for this
// rank's own node (whose node stage then reports them, as one node's calls do).
__device__ __forceinline__ int64_t_ node_expert(int64_t_ e, int n, int own_node, int num_experts, int num_nodes) {
    const int64_t_ per_node = num_experts / num_nodes;
    if (e >= 0 && e < num_experts)
        return e / per_node == n ? e - n * per_node : -1;
    return n == own_node ? e : -1;
}

// Block n of `send` (block_bytes each): top-k ids [num_max][num_topk] at 0 (rows past num_tokens
// -1), then from x_off the rows [num_max][hidden] BF16 (rows past num_tokens not written).
__global__ void __launch_bounds__(LL_NODES_RELAY_TOKENS_THREADS) relay_tokens(
        const int4* x, const int64_t_* topk, int num_tokens, int num_max, int num_topk, int hidden_int4,
        int num_experts, int num_nodes, int own_node, unsigned char* send, int64_t_ block_bytes, int64_t_ x_off) {
    const int64_t_ ids = (int64_t_)num_nodes * num_max * num_topk;
    for (int64_t_ i = (int64_t_)blockIdx.x * blockDim.x + threadIdx.x; i < ids; i += (int64_t_)gridDim.x * blockDim.x) {
        const int n = (int)(i / ((int64_t_)num_max * num_topk));
        const int64_t_ slot = i % ((int64_t_)num_max * num_topk);
        const int t = (int)(slot / num_topk);
        const int64_t_ e = t < num_tokens ? topk[slot] : -1;
        reinterpret_cast<int64_t_*>(send + n * block_bytes)[slot] =
            t < num_tokens ? node_expert(e, n, own_node, num_experts, num_nodes) : -1;
    }
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    const int warps = gridDim.x * blockDim.x / 32;
    for (int w = warp; w < num_nodes * num_tokens; w += warps) {
        const int n = w / num_tokens, t = w % num_tokens;
        int4* dst = reinterpret_cast<int4*>(send + n * block_bytes + x_off) + (int64_t_)t * hidden_int4;
        const int4* src = x + (int64_t_)t * hidden_int4;
        for (int c = lane; c < hidden_int4; c += 32)
            dst[c] = ld_stream(src + c);
    }
}

// Block n of `send`: the combine's top-k ids made node n's [num_max][num_topk] at 0, the weights
// [num_max][num_topk] float32 at weights_off (rows past num_tokens: -1 and 0).
__global__ void __launch_bounds__(LL_NODES_RELAY_ROUTING_THREADS) relay_routing(
        const int64_t_* topk, const float* weights, int num_tokens, int num_max, int num_topk, int num_experts,
        int num_nodes, int own_node, unsigned char* send, int64_t_ block_bytes, int64_t_ weights_off) {
    const int64_t_ ids = (int64_t_)num_nodes * num_max * num_topk;
    for (int64_t_ i = (int64_t_)blockIdx.x * blockDim.x + threadIdx.x; i < ids; i += (int64_t_)gridDim.x * blockDim.x) {
        const int n = (int)(i / ((int64_t_)num_max * num_topk));
        const int64_t_ slot = i % ((int64_t_)num_max * num_topk);
        const bool valid = slot / num_topk < num_tokens;
        unsigned char* block = send + n * block_bytes;
        reinterpret_cast<int64_t_*>(block)[slot] =
            valid ? node_expert(topk[slot], n, own_node, num_experts, num_nodes) : -1;
        reinterpret_cast<float*>(block + weights_off)[slot] = valid ? weights[slot] : 0.0f;
    }
}

// The node stage's handle as DeepEP's. Rows of local expert le from node rank l are in token order
// n * num_max + t (n the node of the rail): the rows of global source n * ranks_per_node + l are a
// run of them, found by two binary searches.
__global__ void __launch_bounds__(LL_NODES_GLOBAL_HANDLE_THREADS) global_handle(
        const int* node_src_info, const int64_t_* node_layout_range, int* src_info, int64_t_* layout_range,
        int num_local_experts, int ranks_per_node, int num_nodes, int num_max) {
    const int num_ranks = ranks_per_node * num_nodes, rows = num_ranks * num_max;
    const int64_t_ cells = (int64_t_)num_local_experts * rows;
    for (int64_t_ i = (int64_t_)blockIdx.x * blockDim.x + threadIdx.x; i < cells; i += (int64_t_)gridDim.x * blockDim.x) {
        const int v = node_src_info[i];
        src_info[i] = v >= 0 ? v % num_max : v;
    }
    const int pairs = num_local_experts * num_ranks;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += gridDim.x * blockDim.x) {
        const int le = i / num_ranks, s = i % num_ranks, n = s / ranks_per_node, l = s % ranks_per_node;
        const int64_t_ range = node_layout_range[le * ranks_per_node + l];
        const int begin = (int)(range >> 32);
        int count = (int)(range & 0xFFFFFFFF);
        // A receive that timed out left its range unwritten: read nothing outside the rows then.
        if (begin < 0 || count < 0 || begin > rows - count)
            count = 0;
        const int* row = node_src_info + (int64_t_)le * rows + begin;
        int bounds[2];
        for (int b = 0; b < 2; ++b) {
            const int key = (n + b) * num_max;
            int lo = 0, hi = count;
            while (lo < hi) {
                const int mid = (lo + hi) / 2;
                if (row[mid] < key)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            bounds[b] = lo;
        }
        layout_range[i] = ((int64_t_)(begin + bounds[0]) << 32) | (int64_t_)(bounds[1] - bounds[0]);
    }
}

// out[t] = bf16(sum over nodes n in order of float(partials[n][t])), from 0, for t < num_tokens.
__global__ void __launch_bounds__(LL_NODES_SUM_PARTIALS_THREADS) sum_partials(
        int4* out, const int4* partials, int num_tokens, int num_max, int num_nodes, int hidden_int4) {
    const int64_t_ chunks = (int64_t_)num_tokens * hidden_int4;
    const int64_t_ node_chunks = (int64_t_)num_max * hidden_int4;
    for (int64_t_ i = (int64_t_)blockIdx.x * blockDim.x + threadIdx.x; i < chunks; i += (int64_t_)gridDim.x * blockDim.x) {
        float acc[8];
        for (int j = 0; j < 8; ++j)
            acc[j] = 0.0f;
        for (int n = 0; n < num_nodes; ++n) {
            const int4 v = partials[n * node_chunks + i];
            const unsigned words[4] = {(unsigned)v.x, (unsigned)v.y, (unsigned)v.z, (unsigned)v.w};
            for (int j = 0; j < 4; ++j) {
                acc[2 * j] = __fadd_rn(acc[2 * j], __uint_as_float(words[j] << 16));
                acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __uint_as_float(words[j] & 0xFFFF0000u));
            }
        }
        unsigned w[4];
        for (int j = 0; j < 4; ++j)
            w[j] = (unsigned)float_to_bf16(acc[2 * j]) | ((unsigned)float_to_bf16(acc[2 * j + 1]) << 16);
        out[i] = make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]);
    }
}

// The local rail's error word (kernels/rail.cu: 0, or the code of the wait that timed out) after an
// exchange: when set, this rank gives up on the node's decode buffer (as a timed-out wait of its own
// decode kernels would), so that the node call reading the blocks stops at its entry instead of moving
// stale ones, the node's other ranks stop too, and the host raises the rail's timeout. The peer named
// is the global rank of the rail rank waited for (code 1 + p), or -1 when this rank waited for its
// peers to finish reading its blocks.
__global__ void __launch_bounds__(LL_NODES_RAIL_FAILED_THREADS) rail_failed(
        const int64_t_* rail_error, int rail_size, int ranks_per_node, void* const* buffer_ptrs, int num_ranks,
        int rank, int* error_record) {
    if (threadIdx.x != 0 || blockIdx.x != 0)
        return;
    const int64_t_ code = ld_volatile(rail_error);
    if (code == 0 || rank_that_gave_up(buffer_ptrs, rank) >= 0)
        return;
    const int peer = code <= rail_size ? (int)(code - 1) * ranks_per_node + rank : -1;
    give_up(buffer_ptrs, num_ranks, error_record, KERNEL_RAIL_BLOCK_EXCHANGE, rank, -1, peer, (int)code);
}

}  // namespace ll_nodes
}  // namespace deepep_cupy
