"""Numbers the host code and the CUDA kernels must agree on, defined once.

Python imports them from here. The kernels see them as ``#define``s: every ``#include
"constants.cuh"`` in ``kernels/`` is replaced, when a source is read for compiling, by
:func:`cuda_header` (there is no such file to drift out of date; ``python -m
deepep_cupy.constants`` prints it). Tuning knobs private to one kernel (unroll depths) stay in
that kernel's source.
"""

from __future__ import annotations

from typing import Dict, Union

#: The most ranks a group may have (the transfer kernels are instantiated for 2..MAX_RANKS).
MAX_RANKS = 8
#: The most experts per rank (sizes the notify areas and the host-mapped receive counters).
MAX_LOCAL_EXPERTS = 4096
#: The most experts in all (the layout kernel counts them in shared memory).
MAX_EXPERTS = 8192
#: The most top-k entries per token (one warp lane each).
MAX_TOPK = 32
#: FP8 values per float32 scale in the ``[num_tokens, hidden // FP8_SCALE_BLOCK]`` scale layout.
FP8_SCALE_BLOCK = 128
#: UE8M0 scales (one exponent byte per block) packed per int32, as DeepEP packs them.
UE8M0_PER_INT = 4
#: The largest finite e4m3 magnitude: FP8 casts saturate to it, and a block's scale is amax / it.
FP8_E4M3_MAX = 448.0
#: The smallest amax a decode cast computes a scale from (a block of zeros gets 1e-4 / 448).
FP8_AMAX_FLOOR = 1e-4
#: Ints per rank in the settings table that ranks compare before moving tokens (the last one
#: flags the rank's own input as invalid).
SIGNATURE_INTS = 8
#: Added to a fresh dispatch's top-k setting, and a cached dispatch's last setting, in that table
#: when the call writes its rows straight into the receivers' recv_x inside their NVLink buffers
#: (``recv_x_in_buffer``): the buffer is carved differently then, so the ranks must agree on it.
SIGNATURE_ROWS_IN_BUFFER = 1 << 12

#: Codes of a kernel error record (``[0]`` of it; 0 = no error).
ERROR_TIMEOUT = 1
ERROR_MISMATCH = 2  # ranks called a cached dispatch or a combine with different settings
#: A rank stopped because another rank had given up on the Buffer (the record's peer names it).
ERROR_PEER_ABORTED = 3
#: A dispatch the host did not wait for (``num_worst_tokens``) was refused on every rank; the
#: record's detail is notify_dispatch's verdict.
ERROR_DISPATCH_REFUSED = 4
#: A cached dispatch or a combine was refused on every rank: its handle routes more tokens from one
#: rank to another than a transfer region of the NVLink buffer holds; the detail is that count.
ERROR_BUFFER_TOO_SMALL = 5
#: A cached dispatch or a combine was refused on every rank because one rank's host failed before
#: it could take part (its outputs could not be allocated, say): the record's peer names that rank,
#: its detail the failure (:data:`HOST_FAILURES`).
ERROR_HOST_FAILED = 6

#: Int index, in every rank's NVLink buffer, of its verdict on the running call (0: go ahead).
VERDICT_INT = 16
#: Int indices, in every rank's NVLink buffer, of the rank's call counters: the barriers it has
#: passed (the next barrier's number is that + 1) and the calls that used a notify area (their
#: parity picks the next one). Kept and advanced by the kernels themselves, so that a call
#: captured in a CUDA graph replays with fresh numbers; written only by the rank itself.
BARRIERS_INT = 28
NOTIFY_CALLS_INT = 29
#: Int index, in every rank's NVLink buffer, of the arrival word with which the blocks of a
#: transfer kernel wait for its settings check (kernels/call_check.cuh, ``grid_sync``).
GRID_SYNC_INT = 30
#: Bytes before the first notify area (the header of signals, verdict and counters), and of each
#: of the two notify areas (sized for MAX_RANKS ranks and MAX_LOCAL_EXPERTS experts per rank).
NOTIFY_AREA_OFFSET = 128
NOTIFY_AREA_BYTES = -(-4 * MAX_RANKS * (SIGNATURE_INTS + MAX_RANKS + MAX_LOCAL_EXPERTS + 1) // 128) * 128
#: The verdict when a rank receives more tokens than its host allocated rows for: nothing moves
#: and the hosts redo the call with exact sizes.
VERDICT_OVER_CAPACITY = 1024
#: The verdict when a rank sends another more tokens than a transfer region of the NVLink buffer
#: holds (deepep_cupy/gpu/layout.py): nothing moves and the call raises.
VERDICT_BUFFER_TOO_SMALL = 1025
#: What a rank's host failed at, when it takes part in a call only to refuse it (the call then moves
#: nothing on any rank, and every rank raises, naming the rank and the failure). The rank states it
#: as ``HOST_FAILURE_FLAG + code`` in the last int of its settings row, where a rank whose own input
#: is invalid states 1, and, when its host gives up on the Buffer after it launched kernels, in the
#: reason word beside the abort mark (0 there: a kernel's wait timed out).
HOST_FAILURES: Dict[int, str] = {
    1: "allocating the call's outputs failed",
    2: "a Python exception in the call",
    3: "the call was interrupted (KeyboardInterrupt)",
}
HOST_FAILED_ALLOCATION, HOST_FAILED_EXCEPTION, HOST_FAILED_INTERRUPT = 1, 2, 3
HOST_FAILURE_FLAG = 16
#: The verdict on a call that rank ``p``'s host refused with failure ``code``:
#: ``VERDICT_HOST_FAILED + p * HOST_FAILURE_FLAG + code`` (nothing moves on any rank).
VERDICT_HOST_FAILED = 2048
#: Int index, in every rank's NVLink buffer, of its abort mark: 0 while every rank is in, ``r + 1``
#: once rank ``r`` gave up on the Buffer (timed out). The rank that gives up writes it into every
#: rank's buffer, its own included; it is never reset (a new Buffer's buffer starts zeroed).
ABORT_INT = 24
#: Int index beside the abort mark: why the rank gave up (0: a wait of its kernels timed out; else a
#: :data:`HOST_FAILURES` code: its host failed after the call had launched kernels). Written before
#: the mark.
ABORT_REASON_INT = 25
#: A low-latency dispatch met expert ids outside [-1, num_experts) (sent nowhere); the record's
#: detail is one of them.
ERROR_BAD_EXPERT_ID = 7

#: The low-latency buffer (deepep_cupy/low_latency/path.py, kernels/low_latency.cu): int indices of the
#: rank's call counters (op * 2 + {send, receive}; op 0 dispatch, 1 combine), of the exit counters
#: of its grids (op * 4 + phases) and of the release words ((op * 2 + half) * MAX_RANKS + reader);
#: byte offsets of the dispatch counts (int64, per half MAX_EXPERTS), of the combine flags (int,
#: per half MAX_EXPERTS) and of the first data area. The signal words sit at fixed places whatever
#: the call's sizes, so that no call's data lands on them.
LL_CALLS_INT = 64
LL_EXITS_INT = 72
LL_RELEASED_INT = 128
#: Shrink mode (DeepEP's enable_shrink): the rank's mask words (LL_MASK_INT + r: rank r is masked when
#: not 0; the rank's own, never written by peers) and the counts of the masked clean barrier
#: (LL_SYNC_INT + r: rank r's count, written by r). A clean zeroes neither.
LL_MASK_INT = 192
LL_SYNC_INT = 200
LL_DISPATCH_COUNTS_OFFSET = 1024
LL_COMBINE_FLAGS_OFFSET = LL_DISPATCH_COUNTS_OFFSET + 2 * 8 * MAX_EXPERTS
#: The rank's own piece counts of a dispatch send (int, per global expert: the warps that have
#: written their part of a token's row for that expert; the warp that signals the expert's count
#: waits for all of them, then zeroes its word for the next call).
LL_SENT_PIECES_OFFSET = LL_COMBINE_FLAGS_OFFSET + 2 * 4 * MAX_EXPERTS
LL_SIGNALS_END = LL_SENT_PIECES_OFFSET + 4 * MAX_EXPERTS
LL_DATA_OFFSET = -(-LL_SIGNALS_END // 4096) * 4096

#: Stage names as error records and exceptions name them, by the id the kernels report.
KERNEL_STAGES: Dict[int, str] = {
    1: "barrier", 2: "notify_dispatch", 3: "cached dispatch check", 4: "dispatch sender",
    5: "dispatch receiver", 6: "combine check", 7: "combine sender", 8: "combine receiver",
    9: "low-latency dispatch send", 10: "low-latency dispatch receive", 11: "low-latency combine send",
    12: "low-latency combine receive", 13: "rail block exchange",
}

#: The local rail transport's mailbox (kernels/rail.cu): int64 words per rank, and what each holds
#: (the rank's call count, its last posted call, its send buffer, the peers done with it, its
#: pull blocks done, a timed-out wait's code).
RAIL_MAILBOX_WORDS = 8
RAIL_CALLS, RAIL_READY, RAIL_SEND_PTR, RAIL_PULLED, RAIL_BLOCKS_DONE, RAIL_ERROR = range(6)
#: Blocks of the local rail's pull kernel (a call's count of them tells its last block).
RAIL_PULL_BLOCKS = 16

#: Threads per block of every kernel (the launch uses it; the kernels use it in their launch
#: bounds and their warp-role split).
BLOCK_THREADS: Dict[str, int] = {
    "dispatch_layout_kernel": 1024,
    "notify_dispatch_kernel": 1024,
    "barrier_kernel": 32,
    # Every sender warp of a dispatch is one channel: the handle's channel count is the sender
    # blocks times these threads / 32 (deepep_cupy.config.Config.num_channels).
    "dispatch_kernel": 768,
    "combine_kernel": 768,
    "expand_kernel": 512,
    "deepep_cupy::internode::notify": 256,
    "deepep_cupy::internode::dispatch": 256,
    "deepep_cupy::internode::forward": 256,
    "deepep_cupy::internode::combine": 256,
    "deepep_cupy::internode::sum_nodes": 256,
    "deepep_cupy::blocks::route": 256,
    "deepep_cupy::blocks::number_rows": 1024,
    "deepep_cupy::blocks::stage_counts": 256,
    "deepep_cupy::blocks::deepep_order": 1024,
    "deepep_cupy::blocks::take_rows": 256,
    "deepep_cupy::rail::post": 32,
    "deepep_cupy::rail::pull": 256,
    "deepep_cupy::low_latency::dispatch": 512,
    "deepep_cupy::low_latency::combine": 512,
    "deepep_cupy::low_latency::barrier": 32,
    "deepep_cupy::ll_nodes::relay_tokens": 256,
    "deepep_cupy::ll_nodes::relay_routing": 256,
    "deepep_cupy::ll_nodes::global_handle": 256,
    "deepep_cupy::ll_nodes::sum_partials": 256,
    "deepep_cupy::ll_nodes::rail_failed": 32,
}


def _macro(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).upper()


def _threads_macro(kernel: str) -> str:
    """``dispatch_kernel`` -> ``DISPATCH_THREADS``; ``deepep_cupy::low_latency::dispatch`` ->
    ``LOW_LATENCY_DISPATCH_THREADS`` (the namespaced decode kernels)."""
    name = (kernel[len("deepep_cupy::"):] if kernel.startswith("deepep_cupy::") else kernel).replace("::", "_")
    name = name[:-len("_kernel")] if name.endswith("_kernel") else name
    return _macro(name) + "_THREADS"


def cuda_defines() -> Dict[str, Union[int, str]]:
    """Every constant the kernels use, by its C macro name (a str: a literal written as C reads it)."""
    defines: Dict[str, Union[int, str]] = {
        "DEEPEP_MAX_RANKS": MAX_RANKS,
        "MAX_LOCAL_EXPERTS": MAX_LOCAL_EXPERTS,
        "SIGNATURE_INTS": SIGNATURE_INTS,
        "SIGNATURE_ROWS_IN_BUFFER": SIGNATURE_ROWS_IN_BUFFER,
        "ERROR_TIMEOUT": ERROR_TIMEOUT,
        "ERROR_MISMATCH": ERROR_MISMATCH,
        "ERROR_PEER_ABORTED": ERROR_PEER_ABORTED,
        "ERROR_DISPATCH_REFUSED": ERROR_DISPATCH_REFUSED,
        "ERROR_BUFFER_TOO_SMALL": ERROR_BUFFER_TOO_SMALL,
        "ERROR_HOST_FAILED": ERROR_HOST_FAILED,
        "HOST_FAILURE_FLAG": HOST_FAILURE_FLAG,
        "VERDICT_HOST_FAILED": VERDICT_HOST_FAILED,
        "ABORT_REASON_INT": ABORT_REASON_INT,
        "VERDICT_INT": VERDICT_INT,
        "ABORT_INT": ABORT_INT,
        "BARRIERS_INT": BARRIERS_INT,
        "NOTIFY_CALLS_INT": NOTIFY_CALLS_INT,
        "GRID_SYNC_INT": GRID_SYNC_INT,
        "NOTIFY_AREA_OFFSET": NOTIFY_AREA_OFFSET,
        "NOTIFY_AREA_BYTES": NOTIFY_AREA_BYTES,
        "VERDICT_OVER_CAPACITY": VERDICT_OVER_CAPACITY,
        "VERDICT_BUFFER_TOO_SMALL": VERDICT_BUFFER_TOO_SMALL,
        "MAX_EXPERTS": MAX_EXPERTS,
        "MAX_TOPK": MAX_TOPK,
        "FP8_SCALE_BLOCK": FP8_SCALE_BLOCK,
        "UE8M0_PER_INT": UE8M0_PER_INT,
        # float32 literals, as the kernels compute in float32
        "FP8_E4M3_MAX": f"{FP8_E4M3_MAX!r}f",
        "FP8_AMAX_FLOOR": f"{FP8_AMAX_FLOOR!r}f",
        "ERROR_BAD_EXPERT_ID": ERROR_BAD_EXPERT_ID,
        "LL_CALLS_INT": LL_CALLS_INT,
        "LL_EXITS_INT": LL_EXITS_INT,
        "LL_RELEASED_INT": LL_RELEASED_INT,
        "LL_MASK_INT": LL_MASK_INT,
        "LL_SYNC_INT": LL_SYNC_INT,
        "LL_DISPATCH_COUNTS_OFFSET": LL_DISPATCH_COUNTS_OFFSET,
        "LL_COMBINE_FLAGS_OFFSET": LL_COMBINE_FLAGS_OFFSET,
        "LL_SENT_PIECES_OFFSET": LL_SENT_PIECES_OFFSET,
        "RAIL_CALLS": RAIL_CALLS,
        "RAIL_READY": RAIL_READY,
        "RAIL_SEND_PTR": RAIL_SEND_PTR,
        "RAIL_PULLED": RAIL_PULLED,
        "RAIL_BLOCKS_DONE": RAIL_BLOCKS_DONE,
        "RAIL_ERROR": RAIL_ERROR,
    }
    defines.update({f"KERNEL_{_macro(stage)}": kernel_id for kernel_id, stage in KERNEL_STAGES.items()})
    defines.update({_threads_macro(kernel): n for kernel, n in BLOCK_THREADS.items()})
    return defines


def cuda_header() -> str:
    """The text that stands for ``#include "constants.cuh"`` in the kernel sources."""
    lines = ["// Generated from deepep_cupy/constants.py: numbers shared by the host and the kernels.",
             "#pragma once"]
    lines += [f"#define {name} {value}" for name, value in cuda_defines().items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - a convenience for reading the generated header
    print(cuda_header(), end="")
