"""The host path alone, on one GPU: what each call costs the host, without peers.

    python3 scripts/host_path_alone.py [--libs cupy,torch] [--tokens 128] [--rounds 3] [--breakdown]

Rank 0 of a 2-rank group whose peer is played by this script: the Buffer's host path runs as it
does under mpirun (real CuPy arrays or PyTorch tensors, real allocations, stream order, mapped
slots and ``cuLaunchKernel`` calls with the real parameter blocks), but every kernel is an empty
one and the count exchange's results are written into the slots by the host when the kernel
making it is launched. The count wait then returns at once, so a fresh dispatch's time here is
its host work besides the wait (issue 11's "<= 40 us"). Prints the median host time per call of
each op and library, libraries alternating within each round; ``--breakdown`` then times the
pieces (each timer adds ~0.3 us to the piece it wraps). Loop times need the peers: see the
benchmark.

``--exchange-us E`` instead plays the peer on the GPU, as a model of the loop: the kernel that
makes the count exchange spins E us (from its start) before it writes the counts into the slots,
and every transfer kernel spins ``--transfer-us`` more; a call's time then includes the wait for
the count, as it would with a peer whose exchange takes E us. On 2 x H200 the count reached the
host 17-18 us after notify_dispatch's launch at 128 tokens (scripts/fresh_host_timeline.py); E
counts from the kernel's start, after a launch latency of 4-5 us, so E = 12 reproduces that span.
Use it to compare host-path variants that move work across the wait; measured loop times still
need two GPUs. Beside each loop figure, in brackets: the host work besides the count wait (the
call's time less ``Buffer.last_count_wait_s``, as the benchmark reports it; no host time is
spent playing the peer), and the host work on the loop's path (the call's time less the span
from the launch making the exchange to the count on the host: what the host does before that
launch and after the count; two timers add ~0.5 us to it).
"""
import argparse
import collections
import sys
import time
from types import SimpleNamespace
from typing import Tuple
from unittest import mock

import cupy
import numpy as np
from _host_timing import OPS, PieceTimers, host_ops, host_times
from _mpi_timing import NUM_EXPERTS, NUM_TOPK

import deepep_cupy as ep
from deepep_cupy import buffer as buffer_module
from deepep_cupy import tensors
from deepep_cupy.bench.timing import interpreter_us
from deepep_cupy.constants import VERDICT_OVER_CAPACITY
from deepep_cupy.gpu import kernels, launch, slots, streams
from deepep_cupy.gpu.check import exit_unless_gpu
from deepep_cupy.groups.group import Group
from deepep_cupy.intranode.engine import IntranodeEngine

CONFIG = ep.Config(24, 4, 256)
WARMUP = 20
NVL_BYTES = 1 << 30


class HostPlayedPeer(Group):
    """Rank 0 of 2; the host path makes no collective calls."""
    in_process = False
    rank, size = 0, 2

    def allgather(self, obj):
        raise AssertionError("no collective calls on the host path")

    barrier = allgather


C_TYPES = {"ptr": "void*", "i32": "int", "i64": "long long", "f32": "float"}
PLAYED_SOURCE = """
__device__ __forceinline__ unsigned long long now_ns() {{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}}
extern "C" __global__ void played({parameters}) {{
    if (blockIdx.x != 0 || threadIdx.x != 0)
        return;
    const unsigned long long start = now_ns();
{exchange}    while (now_ns() - start < {total_ns}ull)
        ;
}}
"""
PLAYED_EXCHANGE = """    if ({condition}) {{
        while (now_ns() - start < {exchange_ns}ull)
            ;
        for (int e = 0; e < {num_local_experts}; ++e)
            ((volatile int*)recv_expert_counter)[e] = {expert_count};
        *(volatile int*)mismatch_flag = {num_recv} > recv_capacity ? {over_capacity} : 0;
        __threadfence_system();
        *(volatile int*)recv_counter = {num_recv};
    }}
"""


def played_source(kernel: str, num_recv: int, expert_counts, exchange_us: float, transfer_us: float) -> str:
    """A stand-in for ``kernel`` (``extern "C" played``) with its parameter list: the kernel that
    makes the count exchange writes ``num_recv`` and ``expert_counts`` into the slots after
    ``exchange_us``, and a transfer spins ``transfer_us`` more."""
    makes_exchange = {"notify_dispatch_kernel": "true", "dispatch_kernel": "exchange && recv_counter"}.get(kernel)
    transfer = transfer_us if kernel in ("dispatch_kernel", "combine_kernel") else 0.0
    exchange = "" if makes_exchange is None else PLAYED_EXCHANGE.format(
        condition=makes_exchange, exchange_ns=int(exchange_us * 1e3), num_local_experts=len(expert_counts),
        expert_count=expert_counts[0], num_recv=num_recv, over_capacity=VERDICT_OVER_CAPACITY)
    return PLAYED_SOURCE.format(
        parameters=", ".join(f"{C_TYPES[kind]} {name}" for name, kind in kernels.SIGNATURES[kernel]),
        exchange=exchange, total_ns=int(((exchange_us if makes_exchange else 0) + transfer) * 1e3))


def played_kernel(*args):
    """:func:`played_source` compiled."""
    function = cupy.RawKernel(played_source(*args), "played")
    function.compile()
    return function


def alone_buffer(num_recv: int, expert_counts, exchange_us: float = 0.0, transfer_us: float = 0.0) -> ep.Buffer:
    """A Buffer whose kernels are empty and whose count exchange the host plays; with
    ``exchange_us``, whose kernels play the peer on the GPU (see the docstring)."""
    memory = cupy.empty(NVL_BYTES, cupy.uint8)  # a dispatch with rows in place returns views of it
    engine = IntranodeEngine(HostPlayedPeer(), NVL_BYTES, 30.0, 0, True)
    engine.nvl = SimpleNamespace(local_ptr=memory.data.ptr, num_bytes=NVL_BYTES, memory=memory)
    host_slots = slots.HostSlots(0, 30.0, False)
    if exchange_us:
        played = {}

        def get_kernel(name):
            base = name.split("<")[0]
            if base not in played:
                played[base] = played_kernel(base, num_recv, expert_counts, exchange_us, transfer_us)
            return played[base]

        kernels.get_kernel = get_kernel
        exchange_window = ExchangeWindow(host_slots)
    else:
        empty = cupy.RawKernel('extern "C" __global__ void empty_kernel() {}', "empty_kernel")
        empty.compile()
        kernels.get_kernel = lambda name: SimpleNamespace(kernel=SimpleNamespace(ptr=empty.kernel.ptr))
        launch.launch = host_playing_the_peer(launch.launch, host_slots, num_recv, expert_counts)
    engine.attach(host_slots, streams.StreamOrder.create(0, False), 0)
    with mock.patch.object(buffer_module, "make_engine", lambda group, settings: engine):
        buf = ep.Buffer(engine.group, NVL_BYTES, timeout_s=30.0, device=0)
    if exchange_us:
        buf.exchange_window = exchange_window
    return buf


def exchange_for_host(host_slots: slots.HostSlots):
    """Whether a launched ``launch.KernelCall`` makes the count exchange whose results the host
    waits for in ``host_slots`` (notify_dispatch, or a transfer making it for its host)."""
    counts_to_host = host_slots.device_ptr(slots.RECV_COUNT)
    return lambda call: getattr(call.params.values, "recv_counter", 0) == counts_to_host


class ExchangeWindow:
    """With the peer played on the GPU: when, in the last call, the launch of the kernel making the
    count exchange returned and when the host had the count. Between the two the host waits, or
    works while the exchange runs; the rest of the call is the host work on the loop's path."""

    def __init__(self, host_slots: slots.HostSlots):
        self.launched = self.counted = 0.0
        makes_exchange = exchange_for_host(host_slots)
        real_launch, real_wait = launch.launch, host_slots.wait_for_count

        def launch_and_note(call, stream_ptr):
            real_launch(call, stream_ptr)
            if makes_exchange(call):
                self.launched = time.perf_counter()

        def wait_and_note(*args):
            count = real_wait(*args)
            self.counted = time.perf_counter()
            return count

        launch.launch, host_slots.wait_for_count = launch_and_note, wait_and_note


def host_playing_the_peer(real_launch, host_slots: slots.HostSlots, num_recv: int, expert_counts):
    """``real_launch``, after which the host writes the count exchange's results into the slots
    when the kernel launched is the one making it (:func:`exchange_for_host`)."""
    values, makes_exchange = host_slots.values, exchange_for_host(host_slots)
    # The counts as an int32 array made once: writing them costs ~0.5 us, where a list of 128
    # Python ints costs several, which the op's host time would include.
    counts_at = slice(slots.EXPERT_COUNTS, slots.EXPERT_COUNTS + len(expert_counts))
    counts = np.asarray(expert_counts, np.int32)

    def launch_and_play_peer(call, stream_ptr):
        real_launch(call, stream_ptr)
        if makes_exchange(call):
            values[counts_at] = counts
            values[slots.VERDICT] = VERDICT_OVER_CAPACITY if num_recv > call.params.values.recv_capacity else 0
            values[slots.RECV_COUNT] = num_recv

    return launch_and_play_peer


def median_us(fn, calls: int) -> float:
    return float(np.median(host_times(fn, calls, WARMUP))) * 1e6


def loop_and_work_us(fn, calls: int, buf: ep.Buffer) -> Tuple[float, float, float]:
    """Median us per call of ``fn`` back to back; of its host work besides the count wait (the
    call's time less ``buf.last_count_wait_s``: what the host does other than wait, the work it
    does while the exchange runs included); and, with the peer played on the GPU, of its host
    work on the loop's path (the call's time less the span from the exchange's launch to the count
    on the host: the work before the launch and after the count)."""
    for _ in range(WARMUP):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    slots_of_buf, window = buf._engine.slots, getattr(buf, "exchange_window", None)
    walls, works, on_path = np.empty(calls), np.empty(calls), np.empty(calls)
    for i in range(calls):
        slots_of_buf.last_wait_s = 0.0  # only a fresh dispatch waits
        if window is not None:
            window.launched = window.counted = 0.0
        start = time.perf_counter()
        fn()
        walls[i] = time.perf_counter() - start
        works[i] = walls[i] - slots_of_buf.last_wait_s
        on_path[i] = walls[i] - (window.counted - window.launched if window is not None and window.counted else 0.0)
    cupy.cuda.runtime.deviceSynchronize()
    return tuple(float(np.median(t)) * 1e6 for t in (walls, works, on_path))


def breakdown(fn, calls: int) -> None:
    timers = PieceTimers()
    undo = timers.wrap_host_path({tensors.library("cupy"), tensors.library("torch")},
                                 launch_label="cuLaunchKernel (+ played peer)")
    whole = median_us(fn, calls)
    for u in undo:
        u()
    print(f"      whole call with timers: {whole:.1f} us (median)")
    timers.print_per_call(calls + WARMUP, indent="      ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--libs", default="cupy,torch")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--exchange-us", type=float, default=0.0,
                        help="play the peer on the GPU: the count exchange takes this long (0: the host plays it)")
    parser.add_argument("--transfer-us", type=float, default=0.0, help="with --exchange-us: each transfer's time")
    parser.add_argument("--caller-stream", default="default", choices=("default", "own"),
                        help="the caller's current stream: the legacy default stream, or a non-blocking one")
    args = parser.parse_args()
    exit_unless_gpu("scripts/host_path_alone.py")
    cupy.cuda.Device(0).use()
    if args.caller_stream == "own":
        import torch

        torch_stream = torch.cuda.Stream()
        torch.cuda.set_stream(torch_stream)
        cupy.cuda.ExternalStream(torch_stream.cuda_stream).use()
    n = args.tokens
    num_recv = 2 * n  # both ranks send about every token to both (top-8 of 256 over 2 ranks)
    num_local_experts = NUM_EXPERTS // 2
    buf = alone_buffer(num_recv, [num_recv * NUM_TOPK // num_local_experts] * num_local_experts, args.exchange_us,
                       args.transfer_us)
    libs = args.libs.split(",")
    ops = {lib: host_ops(buf, lib, n, CONFIG, seed=0) for lib in libs}
    names = args.ops.split(",")
    results = collections.defaultdict(list)
    for _ in range(args.rounds):
        for name in names:
            for lib in libs:
                results[name, lib].append(loop_and_work_us(ops[lib][name], args.calls, buf))
    what = (f"modelled loop (exchange {args.exchange_us:g} us, transfer {args.transfer_us:g} us) [host work besides "
            "the count wait, on the loop's path]" if args.exchange_us else "host time")
    print(f"{what} per call, median us, {n} tokens, {args.rounds} rounds (python {sys.version.split()[0]}, "
          f"sum(range(200)) {interpreter_us():.2f} us):")
    for name in names:
        print(f"  {name:14s} " + "   ".join(
            f"{lib} " + " / ".join(f"{loop:.1f}" + (f" [{work:.1f}, {path:.1f}]" if args.exchange_us else "")
                                   for loop, work, path in results[name, lib]) for lib in libs))
    if args.breakdown:
        for name in names:
            for lib in libs:
                print(f"  breakdown: {name}, {lib}")
                breakdown(ops[lib][name], args.calls)


if __name__ == "__main__":
    main()
