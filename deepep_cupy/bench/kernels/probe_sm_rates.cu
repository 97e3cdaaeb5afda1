// Probe-only kernels (scripts/sm_rates_probe.py): how many bytes per second an SM moves with
// 16-byte register copies and with bulk asynchronous copies (TMA: cp.async.bulk between global
// and shared memory, mbarrier completion). Compiled by the script with cupy.RawModule, not one of
// the library's kernels (not in deepep_cupy.gpu.kernels.SOURCES).
typedef long long int64_t_;

__device__ __forceinline__ int4 ld_stream(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ void st_stream(int4* p, const int4& v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// BF16 pairs to float32 and back (round to nearest even), as combine_kernel sums them.
__device__ __forceinline__ void unpack_bf16(const int4& v, float (&f)[8]) {
    const unsigned w[4] = {(unsigned)v.x, (unsigned)v.y, (unsigned)v.z, (unsigned)v.w};
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ unsigned bf16_bits(float f) {
    const unsigned u = __float_as_uint(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ int4 pack_bf16(const float (&f)[8]) {
    return make_int4(bf16_bits(f[0]) | (bf16_bits(f[1]) << 16), bf16_bits(f[2]) | (bf16_bits(f[3]) << 16),
                     bf16_bits(f[4]) | (bf16_bits(f[5]) << 16), bf16_bits(f[6]) | (bf16_bits(f[7]) << 16));
}

__device__ __forceinline__ unsigned smem_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void mbarrier_init(unsigned bar, int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(arrivals));
}

__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}

// Arrive on `bar` expecting `bytes` more to land, then wait for them (the phase of `parity`).
__device__ __forceinline__ void mbarrier_expect(unsigned bar, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

// A deadline of its own: a probe that hangs traps after ~2 s instead.
__device__ __forceinline__ void mbarrier_wait(unsigned bar, int parity) {
    const long long start = clock64();
    unsigned done = 0;
    while (!done) {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        if (!done && clock64() - start > 4000000000LL)
            __trap();
    }
}

__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, int bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ void bulk_store(void* dst, unsigned src, int bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst), "r"(src), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Every bulk group but the last has finished reading shared memory.
__device__ __forceinline__ void bulk_wait_read_all_but_last() {
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
}

__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// The tokens [begin, end) of global warp `warp` of `warps`, in equal contiguous shares.
__device__ __forceinline__ void warp_share(int n, int warps, int warp, int& begin, int& end) {
    const int per = (n + warps - 1) / warps;
    begin = min(n, warp * per);
    end = min(n, begin + per);
}

// Row t of x to row t of d0 and of d1 (when not null), as the in-place dispatch fans a token out:
// each lane keeps 8 loads in flight, then stores them to every destination.
extern "C" __global__ void __launch_bounds__(768, 1)
fan_out_registers(const int4* x, int4* d0, int4* d1, int n, int hidden_int4) {
    const int lane = threadIdx.x % 32;
    int begin, end;
    warp_share(n, gridDim.x * blockDim.x / 32, blockIdx.x * blockDim.x / 32 + threadIdx.x / 32, begin, end);
    for (int64_t_ t = begin; t < end; ++t) {
        const int4* src = x + t * hidden_int4;
        int4* const dsts[2] = {d0 + t * hidden_int4, d1 == nullptr ? nullptr : d1 + t * hidden_int4};
        for (int i = lane; i < hidden_int4; i += 8 * 32) {
            int4 v[8];
            #pragma unroll
            for (int u = 0; u < 8; ++u)
                if (i + u * 32 < hidden_int4)
                    v[u] = ld_stream(src + i + u * 32);
            #pragma unroll
            for (int d = 0; d < 2; ++d) {
                if (dsts[d] == nullptr)
                    continue;
                #pragma unroll
                for (int u = 0; u < 8; ++u)
                    if (i + u * 32 < hidden_int4)
                        st_stream(dsts[d] + i + u * 32, v[u]);
            }
        }
    }
}

// The same with bulk copies: lane 0 of every warp reads each row once into one of its `slots`
// rows of shared memory and stores it from there to every destination; up to `slots` rows are
// read ahead. Dynamic shared memory: warps * slots * row_bytes, then warps * slots mbarriers.
extern "C" __global__ void fan_out_bulk(const char* x, char* d0, char* d1, int n, int row_bytes, int slots) {
    extern __shared__ __align__(128) char smem[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (lane != 0)
        return;
    char* rows = smem + (int64_t_)warp * slots * row_bytes;
    unsigned long long* bars =
        reinterpret_cast<unsigned long long*>(smem + (int64_t_)warps * slots * row_bytes) + warp * slots;
    for (int s = 0; s < slots; ++s)
        mbarrier_init(smem_address(bars + s), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    int begin, end;
    warp_share(n, gridDim.x * warps, blockIdx.x * warps + warp, begin, end);
    auto read_ahead = [&](int k) {  // the warp's k-th row into slot k % slots
        const int s = k % slots;
        mbarrier_expect(smem_address(bars + s), row_bytes);
        bulk_load(smem_address(rows + (int64_t_)s * row_bytes), x + (int64_t_)(begin + k) * row_bytes, row_bytes,
                  smem_address(bars + s));
    };
    const int count = end - begin;
    for (int k = 0; k < slots && k < count; ++k)
        read_ahead(k);
    for (int k = 0; k < count; ++k) {
        const int s = k % slots;
        mbarrier_wait(smem_address(bars + s), (k / slots) & 1);
        const int64_t_ offset = (int64_t_)(begin + k) * row_bytes;
        bulk_store(d0 + offset, smem_address(rows + (int64_t_)s * row_bytes), row_bytes);
        if (d1 != nullptr)
            bulk_store(d1 + offset, smem_address(rows + (int64_t_)s * row_bytes), row_bytes);
        bulk_commit();
        // The previous row's slot is free once its stores have read it (needs slots >= 2).
        if (k >= 1 && k - 1 + slots < count) {
            bulk_wait_read_all_but_last();
            read_ahead(k - 1 + slots);
        }
    }
    bulk_wait_all();
}

// out row t = a row t + b row t (BF16 summed in float32), as the in-place combine reduces two
// copies: each lane keeps 4 pieces of both rows in flight. Tokens dealt to the warps in turn.
extern "C" __global__ void __launch_bounds__(768, 1)
sum_registers(const int4* a, const int4* b, int4* out, int n, int hidden_int4) {
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * blockDim.x / 32;
    for (int64_t_ t = blockIdx.x + gridDim.x * (threadIdx.x / 32); t < n; t += warps) {
        const int4* const src[2] = {a + t * hidden_int4, b + t * hidden_int4};
        for (int i0 = lane; i0 < hidden_int4; i0 += 4 * 32) {
            int4 loaded[4][2];
            #pragma unroll
            for (int u = 0; u < 4; ++u)
                #pragma unroll
                for (int j = 0; j < 2; ++j)
                    if (i0 + u * 32 < hidden_int4)
                        loaded[u][j] = ld_stream(src[j] + i0 + u * 32);
            #pragma unroll
            for (int u = 0; u < 4; ++u) {
                if (i0 + u * 32 >= hidden_int4)
                    break;
                float sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                #pragma unroll
                for (int j = 0; j < 2; ++j) {
                    float f[8];
                    unpack_bf16(loaded[u][j], f);
                    #pragma unroll
                    for (int q = 0; q < 8; ++q)
                        sum[q] += f[q];
                }
                out[t * hidden_int4 + i0 + u * 32] = pack_bf16(sum);
            }
        }
    }
}

// The same with bulk loads: lane 0 of warp 0 reads both rows of the block's next tokens into
// `stages` stages of shared memory; every other warp sums its slice of each stage's rows and
// stores it. Dynamic shared memory: stages * 2 * row_bytes, then 2 * stages mbarriers.
extern "C" __global__ void __launch_bounds__(768, 1)
sum_bulk(const char* a, const char* b, int4* out, int n, int row_bytes, int stages) {
    extern __shared__ __align__(128) char smem[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const int stage_bytes = 2 * row_bytes;
    unsigned long long* full = reinterpret_cast<unsigned long long*>(smem + (int64_t_)stages * stage_bytes);
    unsigned long long* empty = full + stages;
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            mbarrier_init(smem_address(full + s), 1);
            mbarrier_init(smem_address(empty + s), warps - 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int count = n > (int)blockIdx.x ? (n - (int)blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    if (warp == 0) {
        if (lane == 0)
            for (int k = 0; k < count; ++k) {
                const int s = k % stages;
                if (k >= stages)
                    mbarrier_wait(smem_address(empty + s), (k / stages - 1) & 1);
                const int64_t_ offset = (blockIdx.x + (int64_t_)k * gridDim.x) * row_bytes;
                const unsigned bar = smem_address(full + s);
                mbarrier_expect(bar, stage_bytes);
                bulk_load(smem_address(smem + (int64_t_)s * stage_bytes), a + offset, row_bytes, bar);
                bulk_load(smem_address(smem + (int64_t_)s * stage_bytes + row_bytes), b + offset, row_bytes, bar);
            }
        return;
    }
    const int hidden_int4 = row_bytes / 16;
    for (int k = 0; k < count; ++k) {
        const int s = k % stages;
        mbarrier_wait(smem_address(full + s), (k / stages) & 1);
        const int64_t_ t = blockIdx.x + (int64_t_)k * gridDim.x;
        const int4* rows = reinterpret_cast<const int4*>(smem + (int64_t_)s * stage_bytes);
        for (int i = (warp - 1) * 32 + lane; i < hidden_int4; i += 32 * (warps - 1)) {
            float sum[8] = {0, 0, 0, 0, 0, 0, 0, 0}, f[8];
            unpack_bf16(rows[i], f);
            #pragma unroll
            for (int q = 0; q < 8; ++q)
                sum[q] += f[q];
            unpack_bf16(rows[hidden_int4 + i], f);
            #pragma unroll
            for (int q = 0; q < 8; ++q)
                sum[q] += f[q];
            out[t * hidden_int4 + i] = pack_bf16(sum);
        }
        __syncwarp();
        if (lane == 0)
            mbarrier_arrive(smem_address(empty + s));
    }
}
