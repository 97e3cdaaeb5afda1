// Benchmark-only kernel (deepep_cupy.bench, NCCL baseline's permute): compiled by the bench with
// cupy.RawKernel, not one of the library's kernels (not in deepep_cupy.gpu.kernels.SOURCES).
extern "C" __global__ void gather_rows_int4(unsigned long long src_addr, unsigned long long dst_addr,
                                            const long long* __restrict__ rows, long long num_rows,
                                            long long row_vecs) {
    // dst row r = src row rows[r]; one block per row at a time, 16-byte vectors.
    const int4* __restrict__ src = reinterpret_cast<const int4*>(src_addr);
    int4* __restrict__ dst = reinterpret_cast<int4*>(dst_addr);
    for (long long r = blockIdx.x; r < num_rows; r += gridDim.x) {
        const int4* s = src + rows[r] * row_vecs;
        int4* d = dst + r * row_vecs;
        for (long long i = threadIdx.x; i < row_vecs; i += blockDim.x) d[i] = s[i];
    }
}
