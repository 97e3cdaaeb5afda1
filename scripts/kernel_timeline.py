"""Where a transfer kernel's time goes: globaltimer stamps patched into dispatch and combine.

    mpirun -n 2 python3 scripts/kernel_timeline.py [--tokens 128,4096] [--config 24:4:256] [--calls 40]

The kernels are compiled from a copy of their source with a few stamps added (the tree is not
changed): each block's entry, the moment it passes the call's start (settings check and grid
sync, or the transfer-may-start test), each sender warp's end and each receiver/reducer warp's
end, folded per call into the earliest and the latest of each (atomicMin / atomicMax into a
``__device__`` table indexed by the call's barrier count). Calls run back to back as in a
training loop. Per op, token count and rank, the medians over the calls, in us:

    loop        GPU time per call (events around all calls)
    gap         from the latest warp end of a call to the first block entry of the next
    check       first block entry -> first block past the start (the barrier waits for the peer)
    send_last   past the start -> the last sender warp done (the push)
    recv_last   past the start -> the last receiver warp done (push + copy-out or reduction tail)

Stamps are GPU-local (globaltimer): compare phases within one rank, not across ranks. The atomics
add well under a microsecond per warp. :func:`patch_source` raises when the kernels no longer
have the places it patches (tests/test_kernel_timeline.py checks that on the CPU).
"""
from __future__ import annotations

import argparse
from typing import Dict, List

from deepep_cupy.gpu.check import exit_unless_gpu

STAMP_TABLE = """
extern "C" __device__ unsigned long long timeline_first[64][4];
extern "C" __device__ unsigned long long timeline_last[64][4];
__device__ __forceinline__ void timeline_stamp(int call, int slot, unsigned long long t) {
    atomicMin(&timeline_first[call][slot], t);
    atomicMax(&timeline_last[call][slot], t);
}
"""
# Slots of the table: 0 block entry, 1 past the start, 2 sender warp done, 3 receiver warp done.
PAST_START = ("    const int timeline_call =\n"
              "        ld_volatile(reinterpret_cast<int*>(buffer_ptrs[rank]) + BARRIERS_INT) & 63;\n"
              "    if (threadIdx.x == 0) { timeline_stamp(timeline_call, 0, timeline_entry); "
              "timeline_stamp(timeline_call, 1, now_ns()); }\n")
ENTRY = "    const unsigned long long timeline_entry = now_ns();\n"
SENDER_DONE = "        if (threadIdx.x % 32 == 0) timeline_stamp(timeline_call, 2, now_ns());\n"
RECEIVER_DONE = "    if (threadIdx.x % 32 == 0) timeline_stamp(timeline_call, 3, now_ns());\n"

# (anchor, text inserted before it) per kernel source; each anchor must occur exactly once.
_PATCHES = {
    "dispatch.cu": [
        ("constexpr int kDispatchWarps", STAMP_TABLE),
        ("    if (exchange) {", ENTRY),
        ("    constexpr int kUnroll = kNumRanks <= 4", PAST_START),
        ("        return;\n    }\n\n    // Receiver warps", SENDER_DONE),
    ],
    "combine.cu": [
        ("constexpr int kCombineWarps", STAMP_TABLE),
        ("    const int settings[SIGNATURE_INTS - 1]", ENTRY),
        ("    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;\n    auto tail_word", PAST_START),
        ("        return;\n    }\n\n    char* base = reinterpret_cast<char*>(buffer_ptrs[rank]);", SENDER_DONE),
    ],
}


def patch_source(name: str, text: str) -> str:
    """``text`` (the expanded source of kernel file ``name``) with the timeline stamps added."""
    if name not in _PATCHES:
        return text
    for anchor, insert in _PATCHES[name]:
        if text.count(anchor) != 1:
            raise RuntimeError(f"kernel_timeline: {name} has {text.count(anchor)} places like {anchor!r}, "
                               "not one: update scripts/kernel_timeline.py")
        text = text.replace(anchor, insert + anchor)
    end = text.rstrip().rindex("}")  # the kernel is the file's last function
    return text[:end] + RECEIVER_DONE + "}\n"


def phases(first, last) -> List[Dict[str, float]]:
    """Per call (in call order) the phases in us, from the stamp tables (ns, shape [64, 4])."""
    calls = sorted((c for c in range(64) if last[c, 3] > 0), key=lambda c: first[c, 0])
    rows = []
    for i, c in enumerate(calls):
        row = {"check": first[c, 1] - first[c, 0], "send_last": last[c, 2] - first[c, 1],
               "recv_last": last[c, 3] - first[c, 1]}
        if i + 1 < len(calls):
            row["gap"] = first[calls[i + 1], 0] - max(last[c, 2], last[c, 3])
        rows.append({k: v / 1e3 for k, v in row.items()})
    return rows


def main() -> None:  # pragma: no cover - needs GPUs and mpirun
    import cupy
    import numpy as np
    from _stamped_kernels import compile_patched
    from mpi4py import MPI

    import deepep_cupy as ep
    from deepep_cupy.reference import intranode as ref

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="128,4096")
    parser.add_argument("--config", default="24:4:256")
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    exit_unless_gpu("scripts/kernel_timeline.py")

    modules = compile_patched(patch_source)

    comm = MPI.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    hidden, num_topk, num_experts = 7168, 8, 256
    config = ep.Config(*(int(v) for v in args.config.split(":")))
    buffer = ep.Buffer(comm, ep.get_nvl_buffer_size_hint(hidden * 2, num_ranks, config), timeout_s=20)
    stream = cupy.cuda.get_current_stream()

    def tables(kernel):
        for expression, module in modules.items():
            if expression.startswith(kernel):
                yield (cupy.ndarray((64, 4), cupy.uint64, module.get_global("timeline_first")),
                       cupy.ndarray((64, 4), cupy.uint64, module.get_global("timeline_last")))

    keys = ["loop", "gap", "check", "send_last", "recv_last"]
    lines = []
    for num_tokens in (int(n) for n in args.tokens.split(",")):
        rng = np.random.default_rng(rank + num_tokens)
        topk = cupy.asarray(ref.random_routing(rng, num_tokens, num_experts, num_topk))
        x = cupy.asarray(ref.float32_to_bfloat16_bits(rng.standard_normal((num_tokens, hidden), dtype=np.float32)))
        x_fp8 = (cupy.asarray(rng.integers(0, 255, (num_tokens, hidden), dtype=np.uint8)),
                 cupy.asarray(rng.random((num_tokens, hidden // 128), dtype=np.float32) + 0.5))
        weights = cupy.asarray(rng.random((num_tokens, num_topk), dtype=np.float32))
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
        routing = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=topk, topk_weights=weights, config=config)
        recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(x, **routing)
        ops = {"fresh dispatch BF16": ("dispatch_kernel", lambda: buffer.dispatch(x, **routing)),
               "cached dispatch BF16": ("dispatch_kernel", lambda: buffer.dispatch(x, handle=handle, config=config)),
               "cached dispatch FP8": ("dispatch_kernel", lambda: buffer.dispatch(x_fp8, handle=handle, config=config)),
               "combine BF16": ("combine_kernel",
                                lambda: buffer.combine(recv_x, handle, topk_weights=recv_weights, config=config))}
        for name, (kernel, call) in ops.items():
            for _ in range(3):
                call()
            stream.synchronize()
            for first, last in tables(kernel):
                first.fill(np.uint64(2**64 - 1))
                last.fill(0)
            stream.synchronize()
            comm.Barrier()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            for _ in range(args.calls):
                call()
            end.record(stream)
            end.synchronize()
            loop = cupy.cuda.get_elapsed_time(start, end) * 1e3 / args.calls
            rows = []
            for first, last in tables(kernel):
                if int(last.max()) > 0:
                    rows = phases(first.get().astype(np.float64), last.get().astype(np.float64))
            medians = {k: float(np.median([r[k] for r in rows if k in r])) for k in keys[1:]}
            medians["loop"] = loop
            lines.append(f"{num_tokens:6d}  {name:21s} {rank:4d} " + " ".join(f"{medians[k]:9.1f}" for k in keys))
    every = comm.gather(lines)
    if rank == 0:
        print(f"tokens  {'op':21s} rank " + " ".join(f"{k:>9s}" for k in keys))
        for rank_lines in zip(*every):
            print("\n".join(rank_lines))
    buffer.destroy()


if __name__ == "__main__":
    main()
