// internode_blocks: an internode call in fixed-size blocks, so that the host never waits.
//
// With num_worst_tokens the outputs' size is fixed, so the rail's blocks can be too: every rank
// sends every node a block of `block_tokens` records (the group's largest token count), record t
// being its token t, and the receiver learns on the device which records are meant for it (their
// is_token_in_rank row). These kernels do what the host did from the counts otherwise: route the
// tokens, number the received rows (one rank per node), count the node stage's inputs and put its
// outputs in DeepEP's order. One block scans where an order depends on every record before.
#include "common.cuh"

namespace deepep_cupy {
namespace blocks {

// Per token t (a thread each, in steps of the grid): its is_token_in_rank row (given, or from the
// experts of its top-k ids, `topk_stride` ids apart per token; ids outside [0, num_experts) route
// nowhere), the per-rank, per-node and per-expert counts (added to zeroed arrays; any may be
// null) and slots[n * num_tokens + t] = n * block_tokens + t
// where t goes to node n, -1 elsewhere (where the combine finds its row in node n's block).
__global__ void __launch_bounds__(BLOCKS_ROUTE_THREADS) route(
        const int64_t_* topk, int64_t_ topk_stride, int num_topk, const bool* in_rank_in, int64_t_ in_rank_token_stride,
        int64_t_ in_rank_stride, int num_tokens, int num_experts, int num_ranks, int ranks_per_node,
        int block_tokens, bool* in_rank_out, int* per_rank, int* per_node, int* per_expert, int* slots) {
    const int experts_per_rank = num_experts / num_ranks, num_nodes = num_ranks / ranks_per_node;
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += gridDim.x * blockDim.x) {
        bool in_rank[DEEPEP_MAX_RANKS];
        for (int r = 0; r < num_ranks; ++r)
            in_rank[r] = false;
        for (int k = 0; k < num_topk; ++k) {
            const int64_t_ e = topk[t * topk_stride + k];
            if (e < 0 || e >= num_experts)
                continue;
            if (per_expert != nullptr)
                atomicAdd(per_expert + e, 1);
            if (in_rank_in == nullptr)
                in_rank[e / experts_per_rank] = true;
        }
        if (in_rank_in != nullptr)
            for (int r = 0; r < num_ranks; ++r)
                in_rank[r] = in_rank_in[t * in_rank_token_stride + r * in_rank_stride];
        for (int n = 0; n < num_nodes; ++n) {
            bool in_node = false;
            for (int r = n * ranks_per_node; r < (n + 1) * ranks_per_node; ++r) {
                in_node |= in_rank[r];
                if (in_rank_out != nullptr)
                    in_rank_out[(int64_t_)t * num_ranks + r] = in_rank[r];
                if (per_rank != nullptr && in_rank[r])
                    atomicAdd(per_rank + r, 1);
            }
            if (per_node != nullptr && in_node)
                atomicAdd(per_node + n, 1);
            if (slots != nullptr)
                slots[(int64_t_)n * num_tokens + t] = in_node ? n * block_tokens + t : -1;
        }
    }
}

// The exclusive prefix of `flag` over the block's threads, and the block's total (all threads).
__device__ __forceinline__ int block_exclusive_scan(int flag, int* total) {
    __shared__ int warp_sums[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const unsigned ballot = __ballot_sync(0xffffffffu, flag);
    const int in_warp = __popc(ballot & ((1u << lane) - 1));
    if (lane == 0)
        warp_sums[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, sum = 0;
    for (int w = 0; w < warps; ++w) {
        before += w < warp ? warp_sums[w] : 0;
        sum += warp_sums[w];
    }
    __syncthreads();
    *total = sum;
    return before + in_warp;
}

// One rank per node: which received records are this rank's rows. Records lie in blocks of
// `block_tokens`, one per source rank (= node), in order; record i is rank `rank`'s when its
// is_token_in_rank entry says so, and becomes row row_of[i] (-1: not a row), rows numbered in
// record order, which is DeepEP's (source rank, then token). counts[b] = the rows from blocks
// 0..b (at most num_rows), counts[num_blocks] = the rows wanted, even past num_rows;
// block_prefix[b] = the records in blocks 0..b. When more rows are wanted than num_rows, overflow
// (host-mapped) gets [rows wanted, num_rows] for the host to raise at its next call. One block.
__global__ void __launch_bounds__(BLOCKS_NUMBER_ROWS_THREADS) number_rows(
        const unsigned char* records, int record_bytes, int in_rank_off, int rank, int num_blocks,
        int block_tokens, int num_rows, int64_t_* row_of, int* counts, int* block_prefix, int* overflow) {
    const int num_records = num_blocks * block_tokens;
    int running = 0;
    for (int base = 0; base < num_records; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const bool mine = i < num_records && records[(int64_t_)i * record_bytes + in_rank_off + rank] != 0;
        int total;
        const int before = block_exclusive_scan(mine ? 1 : 0, &total);
        if (i < num_records) {
            const int row = running + before;
            row_of[i] = mine && row < num_rows ? row : -1;
            if (i % block_tokens == block_tokens - 1)
                counts[i / block_tokens] = min(row + (mine ? 1 : 0), num_rows);
        }
        running += total;
    }
    if (threadIdx.x == 0) {
        counts[num_blocks] = running;
        if (running > num_rows && overflow != nullptr) {
            overflow[1] = num_rows;
            __threadfence_system();  // the host reads [0] first
            overflow[0] = running;
        }
    }
    for (int b = threadIdx.x; b < num_blocks; b += blockDim.x)
        block_prefix[b] = (b + 1) * block_tokens;
}

// The node stage's input counts (a thread per forwarded record, in steps of the grid): rows per local rank from the
// is_token_in_rank part [num_rows, ranks_per_node], and per local expert of the node from the
// top-k ids made node-local (-1: none) of the rows some rank takes, added to zeroed arrays.
__global__ void __launch_bounds__(BLOCKS_STAGE_COUNTS_THREADS) stage_counts(
        const bool* in_rank, const int64_t_* topk, int num_rows, int ranks_per_node, int num_topk,
        int num_node_experts, int* per_rank, int* per_expert) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < num_rows; i += gridDim.x * blockDim.x) {
        bool routed = false;
        for (int j = 0; j < ranks_per_node; ++j)
            if (in_rank[(int64_t_)i * ranks_per_node + j]) {
                routed = true;
                atomicAdd(per_rank + j, 1);
            }
        for (int k = 0; routed && topk != nullptr && k < num_topk; ++k) {
            const int64_t_ e = topk[(int64_t_)i * num_topk + k];
            if (e >= 0 && e < num_node_experts)
                atomicAdd(per_expert + e, 1);
        }
    }
}

// DeepEP's order of the node stage's outputs. The stage's rows come by forwarding local rank j,
// then in j's input order (source node m, then token t: its blocks of `block_tokens`); DeepEP's
// come by source rank g = m * ranks_per_node + j, then token. From the stage's rank_prefix_matrix
// ([j][receiver], inclusive) and recv_src_idx: order[p] = the stage row of DeepEP row p,
// inverse[i] the other way (rows past the received ones map to themselves), gbl_prefix[g] = the
// rows from source ranks 0..g, block_prefix[m] = the records in blocks 0..m. One block.
__global__ void __launch_bounds__(BLOCKS_DEEPEP_ORDER_THREADS) deepep_order(
        const int* rank_prefix, const int* recv_src_idx, int local_rank, int ranks_per_node, int num_nodes,
        int block_tokens, int num_rows, int64_t_* order, int64_t_* inverse, int* gbl_prefix, int* block_prefix) {
    __shared__ int count[DEEPEP_MAX_RANKS], deepep_start[DEEPEP_MAX_RANKS], stage_start[DEEPEP_MAX_RANKS];
    const int L = ranks_per_node, R = ranks_per_node * num_nodes;
    const int received = min(rank_prefix[(L - 1) * L + local_rank], num_rows);
    if (threadIdx.x < R)
        count[threadIdx.x] = 0;
    if (threadIdx.x < num_nodes)
        block_prefix[threadIdx.x] = (threadIdx.x + 1) * block_tokens;
    __syncthreads();
    for (int i = threadIdx.x; i < received; i += blockDim.x) {
        int j = 0;
        while (j < L - 1 && rank_prefix[j * L + local_rank] <= i)
            ++j;
        atomicAdd(count + (recv_src_idx[i] / block_tokens) * L + j, 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int deepep = 0, stage = 0;
        for (int g = 0; g < R; ++g) {
            deepep_start[g] = deepep;
            deepep += count[g];
            gbl_prefix[g] = deepep;
        }
        for (int j = 0; j < L; ++j)
            for (int m = 0; m < num_nodes; ++m) {
                stage_start[m * L + j] = stage;
                stage += count[m * L + j];
            }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < num_rows; i += blockDim.x) {
        int64_t_ p = i;
        if (i < received) {
            int j = 0;
            while (j < L - 1 && rank_prefix[j * L + local_rank] <= i)
                ++j;
            const int g = (recv_src_idx[i] / block_tokens) * L + j;
            p = deepep_start[g] + (i - stage_start[g]);
        }
        order[p] = i;
        inverse[i] = p;
    }
}

// dst row p = src row order[p] (rows of `row_bytes`, both C-contiguous), a block per row at a time.
__global__ void __launch_bounds__(BLOCKS_TAKE_ROWS_THREADS) take_rows(
        unsigned char* dst, const unsigned char* src, const int64_t_* order, int num_rows, int64_t_ row_bytes) {
    for (int p = blockIdx.x; p < num_rows; p += gridDim.x) {
        const unsigned char* from = src + order[p] * row_bytes;
        unsigned char* to = dst + (int64_t_)p * row_bytes;
        if (row_bytes % 16 == 0) {
            for (int64_t_ c = threadIdx.x; c < row_bytes / 16; c += blockDim.x)
                reinterpret_cast<int4*>(to)[c] = reinterpret_cast<const int4*>(from)[c];
        } else if (row_bytes % 4 == 0) {
            for (int64_t_ c = threadIdx.x; c < row_bytes / 4; c += blockDim.x)
                reinterpret_cast<int*>(to)[c] = reinterpret_cast<const int*>(from)[c];
        } else {
            for (int64_t_ c = threadIdx.x; c < row_bytes; c += blockDim.x)
                to[c] = from[c];
        }
    }
}

}  // namespace blocks
}  // namespace deepep_cupy
