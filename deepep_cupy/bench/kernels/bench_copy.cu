// Benchmark-only kernel (deepep_cupy.bench, copy-kernel ceiling): compiled by the bench with
// cupy.RawKernel, not one of the library's kernels (not in deepep_cupy.gpu.kernels.SOURCES).
extern "C" __global__ void __launch_bounds__(1024)
copy_int4(unsigned long long src_addr, unsigned long long dst_addr, unsigned long long n_vec) {
    // Grid-stride copy of n_vec 16-byte vectors; four loads in flight per thread before the stores.
    const int4* __restrict__ src = reinterpret_cast<const int4*>(src_addr);
    int4* __restrict__ dst = reinterpret_cast<int4*>(dst_addr);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n_vec; i += 4 * stride) {
        int4 v0 = src[i], v1 = src[i + stride], v2 = src[i + 2 * stride], v3 = src[i + 3 * stride];
        dst[i] = v0; dst[i + stride] = v1; dst[i + 2 * stride] = v2; dst[i + 3 * stride] = v3;
    }
    for (; i < n_vec; i += stride) dst[i] = src[i];
}
