// internode: the records that cross the rail between nodes, packed and unpacked on the GPU.
//
// A record is one token's row, its FP8 scales, its int64 top-k ids, its float32 weights and its
// is_token_in_rank row, each part at the offset the host's RecordLayout (deepep_cupy/
// internode/records.py) gives it, the record padded to 16 bytes. A send buffer holds the records
// of every destination node in node order; a receive buffer the records from every source node,
// in node order too.
//
// The kernels carry DeepEP's stage names, so that a profiler (DeepEP's bench_kineto) finds exactly
// one `notify`, `dispatch` or `combine` per call: `notify` packs what goes over the rail; the
// kernel that writes a call's outputs is `dispatch` or `combine`, unless the node's NVLink stage
// writes them, in which case the same code runs as `forward` (the NVLink stage's inputs) or
// `sum_nodes` (the combine's last sum, after the node's own combine kernel).
#include "common.cuh"

namespace deepep_cupy {
namespace internode {

// Copies `count` elements of `elem_bytes` (1, 4 or 8) bytes, `src_stride` bytes apart, to `dst`
// (packed), with the block's threads.
__device__ __forceinline__ void copy_elements(unsigned char* dst, const unsigned char* src, int count, int elem_bytes,
                                              int64_t_ src_stride) {
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const unsigned char* from = src + i * src_stride;
        unsigned char* to = dst + i * elem_bytes;
        if (elem_bytes == 8) {
            *reinterpret_cast<int64_t_*>(to) = *reinterpret_cast<const int64_t_*>(from);
        } else if (elem_bytes == 4) {
            *reinterpret_cast<int*>(to) = *reinterpret_cast<const int*>(from);
        } else {
            *to = *from;
        }
    }
}

__device__ __forceinline__ void copy_row(unsigned char* dst, const unsigned char* src, int row_bytes) {
    const int4* from = reinterpret_cast<const int4*>(src);
    int4* to = reinterpret_cast<int4*>(dst);
    for (int i = threadIdx.x; i < row_bytes / 16; i += blockDim.x)
        to[i] = ld_stream(from + i);
}

// Record i of `records` holds token `token_ids[i]` (or i without token_ids). Parts with a null
// source are not written. Strides are in bytes; the row is 16-byte aligned and contiguous.
__global__ void __launch_bounds__(INTERNODE_NOTIFY_THREADS) notify(
        unsigned char* records, int record_bytes, const int64_t_* token_ids, int num_records,
        const unsigned char* x, int64_t_ x_token_stride, int row_bytes,
        const unsigned char* scales, int64_t_ scale_token_stride, int64_t_ scale_stride, int num_scales, int scales_off,
        const unsigned char* topk, int64_t_ topk_token_stride, int num_topk, int topk_off,
        const unsigned char* weights, int64_t_ weights_token_stride, int num_weights, int weights_off,
        const unsigned char* in_rank, int64_t_ in_rank_token_stride, int64_t_ in_rank_stride, int num_in_rank,
        int in_rank_off) {
    for (int i = blockIdx.x; i < num_records; i += gridDim.x) {
        const int64_t_ t = token_ids == nullptr ? i : token_ids[i];
        if (t < 0)  // no token for this record (a fixed-size block's gap)
            continue;
        unsigned char* record = records + (int64_t_)i * record_bytes;
        copy_row(record, x + t * x_token_stride, row_bytes);
        if (scales != nullptr)
            copy_elements(record + scales_off, scales + t * scale_token_stride, num_scales, 4, scale_stride);
        if (topk != nullptr)
            copy_elements(record + topk_off, topk + t * topk_token_stride, num_topk, 8, 8);
        if (weights != nullptr)
            copy_elements(record + weights_off, weights + t * weights_token_stride, num_weights, 4, 4);
        if (in_rank != nullptr)
            copy_elements(record + in_rank_off, in_rank + t * in_rank_token_stride, num_in_rank, 1, in_rank_stride);
    }
}

// The parts of `num_records` records into C-contiguous outputs (null outputs are skipped): record
// i into row row_of[i] (i without row_of; -1: not a row); top-k ids in [first_expert, first_expert
// + num_local_experts) become local (minus first_expert), the others -1 with weight 0;
// is_token_in_rank keeps the `num_in_rank` entries from `in_rank_from`. Rows from the rows written
// (*num_valid with it, else num_records) to num_out_rows - 1 (a num_worst_tokens output) get top-k ids -1.
__device__ __forceinline__ void unpack(
        const unsigned char* records, int record_bytes, int num_records,
        unsigned char* rows_out, int row_bytes, float* scales_out, int num_scales, int scales_off,
        int64_t_* topk_out, float* weights_out, int num_topk, int topk_off, int weights_off,
        int64_t_ first_expert, int64_t_ num_local_experts,
        bool* in_rank_out, int in_rank_from, int num_in_rank, int in_rank_off, int num_out_rows,
        const int64_t_* row_of, const int* num_valid) {
    const int first_pad = num_valid != nullptr ? *num_valid : num_records;
    for (int i = blockIdx.x; i < num_records + num_out_rows; i += gridDim.x) {
        if (i >= num_records) {
            const int64_t_ row = i - num_records;
            for (int k = threadIdx.x; row >= first_pad && topk_out != nullptr && k < num_topk; k += blockDim.x)
                topk_out[row * num_topk + k] = -1;
            continue;
        }
        const int64_t_ row = row_of != nullptr ? row_of[i] : i;
        if (row < 0 || row >= num_out_rows)
            continue;
        const unsigned char* record = records + (int64_t_)i * record_bytes;
        copy_row(rows_out + row * row_bytes, record, row_bytes);
        if (scales_out != nullptr)
            copy_elements(reinterpret_cast<unsigned char*>(scales_out + row * num_scales), record + scales_off,
                          num_scales, 4, 4);
        for (int k = threadIdx.x; topk_out != nullptr && k < num_topk; k += blockDim.x) {
            const int64_t_ e = reinterpret_cast<const int64_t_*>(record + topk_off)[k];
            const bool mine = e >= first_expert && e < first_expert + num_local_experts;
            topk_out[row * num_topk + k] = mine ? e - first_expert : -1;
            if (weights_out != nullptr)
                weights_out[row * num_topk + k] = mine ? reinterpret_cast<const float*>(record + weights_off)[k] : 0.0f;
        }
        if (in_rank_out != nullptr)
            copy_elements(reinterpret_cast<unsigned char*>(in_rank_out + row * num_in_rank),
                          record + in_rank_off + in_rank_from, num_in_rank, 1, 1);
    }
}

// The received records into a dispatch's outputs (one rank per node).
__global__ void __launch_bounds__(INTERNODE_DISPATCH_THREADS) dispatch(
        const unsigned char* records, int record_bytes, int num_records,
        unsigned char* rows_out, int row_bytes, float* scales_out, int num_scales, int scales_off,
        int64_t_* topk_out, float* weights_out, int num_topk, int topk_off, int weights_off,
        int64_t_ first_expert, int64_t_ num_local_experts,
        bool* in_rank_out, int in_rank_from, int num_in_rank, int in_rank_off, int num_out_rows,
        const int64_t_* row_of, const int* num_valid) {
    unpack(records, record_bytes, num_records, rows_out, row_bytes, scales_out, num_scales, scales_off, topk_out,
           weights_out, num_topk, topk_off, weights_off, first_expert, num_local_experts, in_rank_out, in_rank_from,
           num_in_rank, in_rank_off, num_out_rows, row_of, num_valid);
}

// The received records into the inputs of the node's NVLink dispatch.
__global__ void __launch_bounds__(INTERNODE_FORWARD_THREADS) forward(
        const unsigned char* records, int record_bytes, int num_records,
        unsigned char* rows_out, int row_bytes, float* scales_out, int num_scales, int scales_off,
        int64_t_* topk_out, float* weights_out, int num_topk, int topk_off, int weights_off,
        int64_t_ first_expert, int64_t_ num_local_experts,
        bool* in_rank_out, int in_rank_from, int num_in_rank, int in_rank_off, int num_out_rows,
        const int64_t_* row_of, const int* num_valid) {
    unpack(records, record_bytes, num_records, rows_out, row_bytes, scales_out, num_scales, scales_off, topk_out,
           weights_out, num_topk, topk_off, weights_off, first_expert, num_local_experts, in_rank_out, in_rank_from,
           num_in_rank, in_rank_off, num_out_rows, row_of, num_valid);
}

// out[t] = the float32 sum of bias_0[t], bias_1[t] (each optional), then the rows that came back
// from each node for token t, in node order (slots[n * num_tokens + t]: its record, -1 for none),
// rounded to T; out_weights[t] likewise, in float32, from the records' weights part.
template <typename T>
__device__ __forceinline__ void sum_node_rows(
        int4* out, float* out_weights, const unsigned char* records, int record_bytes, const int* slots,
        int num_tokens, int num_nodes, int row_bytes, int num_weights, int weights_off, const int4* bias_0,
        const int4* bias_1) {
    constexpr int kPer = Elem<T>::kPerInt4;
    const int chunks = row_bytes / 16;
    for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
        for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
            float acc[kPer], part[kPer];
            #pragma unroll
            for (int j = 0; j < kPer; ++j) acc[j] = 0.0f;
            const int4* biases[2] = {bias_0, bias_1};
            for (int b = 0; b < 2; ++b) {
                if (biases[b] == nullptr) continue;
                Elem<T>::unpack(ld_stream(biases[b] + (int64_t_)t * chunks + c), part);
                #pragma unroll
                for (int j = 0; j < kPer; ++j) acc[j] += part[j];
            }
            for (int n = 0; n < num_nodes; ++n) {
                const int slot = slots[(int64_t_)n * num_tokens + t];
                if (slot < 0) continue;
                const int4* row = reinterpret_cast<const int4*>(records + (int64_t_)slot * record_bytes);
                Elem<T>::unpack(ld_stream(row + c), part);
                #pragma unroll
                for (int j = 0; j < kPer; ++j) acc[j] += part[j];
            }
            out[(int64_t_)t * chunks + c] = Elem<T>::pack(acc);
        }
        for (int k = threadIdx.x; out_weights != nullptr && k < num_weights; k += blockDim.x) {
            float acc = 0.0f;
            for (int n = 0; n < num_nodes; ++n) {
                const int slot = slots[(int64_t_)n * num_tokens + t];
                if (slot >= 0)
                    acc += reinterpret_cast<const float*>(records + (int64_t_)slot * record_bytes + weights_off)[k];
            }
            out_weights[(int64_t_)t * num_weights + k] = acc;
        }
    }
}

// The combine's outputs from the rows the nodes sent back (one rank per node).
template <typename T>
__global__ void __launch_bounds__(INTERNODE_COMBINE_THREADS) combine(
        int4* out, float* out_weights, const unsigned char* records, int record_bytes, const int* slots,
        int num_tokens, int num_nodes, int row_bytes, int num_weights, int weights_off, const int4* bias_0,
        const int4* bias_1) {
    sum_node_rows<T>(out, out_weights, records, record_bytes, slots, num_tokens, num_nodes, row_bytes, num_weights, weights_off,
                     bias_0, bias_1);
}

// The same, after the node's NVLink combine made each node's partial sums.
template <typename T>
__global__ void __launch_bounds__(INTERNODE_SUM_NODES_THREADS) sum_nodes(
        int4* out, float* out_weights, const unsigned char* records, int record_bytes, const int* slots,
        int num_tokens, int num_nodes, int row_bytes, int num_weights, int weights_off, const int4* bias_0,
        const int4* bias_1) {
    sum_node_rows<T>(out, out_weights, records, record_bytes, slots, num_tokens, num_nodes, row_bytes, num_weights, weights_off,
                     bias_0, bias_1);
}

}  // namespace internode
}  // namespace deepep_cupy
