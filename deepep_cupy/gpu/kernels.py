"""Finding and compiling the project's CUDA kernels, and what the host knows of their parameters.

The CUDA C++ sources live in ``kernels/`` (shipped in the wheel as ``deepep_cupy/_kernels``).
Each ``.cu`` file is one stage; its template instances are listed in :data:`SOURCES`, and each
instance is a module of its own, compiled by ``cupy.RawModule(name_expressions=...)`` for the
device's own architecture (:func:`warm_up` compiles those a Buffer needs in threads at once). Local
``#include "x.cuh"`` lines are inlined here, before compiling, so that CuPy's on-disk kernel
cache (keyed by the source text) sees header edits too; ``constants.cuh`` is not a file but
:func:`deepep_cupy.constants.cuda_header`, the numbers the host shares with the kernels.

:data:`SIGNATURES` mirrors every kernel's parameter list (checked against the sources on CPU);
:mod:`deepep_cupy.gpu.launch` lays out the parameter blocks from it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Sequence, Tuple

from ..constants import BLOCK_THREADS, MAX_RANKS, cuda_header
from ..errors import KernelBuildError

RANK_COUNTS = tuple(range(2, MAX_RANKS + 1))

#: C element type of each combine dtype name (the tag types are defined in kernels/common.cuh).
COMBINE_ELEMENTS = {"bfloat16": "bf16_t", "float16": "fp16_t", "float32": "float"}

#: Template instances compiled from each source file.
SOURCES: Dict[str, Tuple[str, ...]] = {
    "layout.cu": ("dispatch_layout_kernel",),
    "notify.cu": ("notify_dispatch_kernel", "barrier_kernel"),
    # <ranks, strided FP8 scales, rows in place in the receivers' buffers>
    "dispatch.cu": tuple(f"dispatch_kernel<{r}>" for r in RANK_COUNTS)
    + tuple(f"dispatch_kernel<{r}, true>" for r in RANK_COUNTS)
    + tuple(f"dispatch_kernel<{r}, {s}, true>" for s in ("false", "true") for r in RANK_COUNTS),
    # <element, ranks, x in place where a dispatch with rows in place put recv_x>
    "combine.cu": tuple(f"combine_kernel<{t}, {r}>" for t in COMBINE_ELEMENTS.values() for r in RANK_COUNTS)
    + tuple(f"combine_kernel<{t}, {r}, true>" for t in COMBINE_ELEMENTS.values() for r in RANK_COUNTS),
    "expand.cu": ("expand_kernel",),
    # Across nodes: the records of the rail (<element> of the sums).
    "internode.cu": ("deepep_cupy::internode::notify", "deepep_cupy::internode::dispatch",
                     "deepep_cupy::internode::forward")
    + tuple(f"deepep_cupy::internode::{k}<{t}>" for k in ("combine", "sum_nodes") for t in COMBINE_ELEMENTS.values()),
    # Across nodes with no host wait: fixed-size blocks, and the local rail that graphs can hold.
    "internode_blocks.cu": tuple(f"deepep_cupy::blocks::{k}" for k in ("route", "number_rows", "stage_counts",
                                                                      "deepep_order", "take_rows")),
    "rail.cu": ("deepep_cupy::rail::post", "deepep_cupy::rail::pull"),
    # Decode (DeepEP's low-latency API): the settings are run-time arguments, so one instance each.
    # Namespaced as DeepEP's are: its bench_kineto finds them by "::dispatch" / "::combine".
    "low_latency.cu": ("deepep_cupy::low_latency::dispatch", "deepep_cupy::low_latency::combine",
                       "deepep_cupy::low_latency::barrier"),
    # Decode across nodes: around the node's decode kernels and the rail's blocks.
    "low_latency_nodes.cu": tuple(f"deepep_cupy::ll_nodes::{k}" for k in ("relay_tokens", "relay_routing",
                                                                         "global_handle", "sum_partials",
                                                                         "rail_failed")),
}
#: Kernels only an option uses (``dispatch(..., expand=True)``): compiled on first use.
OPTIONAL_KERNELS = ("expand_kernel",)
#: Sources whose kernels the path that uses them loads itself (the low-latency path, when a Buffer
#: is made with ``low_latency_mode``; the internode path, across nodes: :func:`load`), never
#: :func:`warm_up`: the FP8 conversions of the decode kernels need sm_89, and no other Buffer
#: should pay for either.
OWN_WARM_UP = ("low_latency.cu", "low_latency_nodes.cu", "internode.cu", "internode_blocks.cu", "rail.cu")

#: NVRTC options shared by the run-time build and the CPU compile check (the arch is added per device).
NVRTC_OPTIONS: Tuple[str, ...] = ("-std=c++17",)

#: The include that stands for the constants shared with Python (generated, not a file).
GENERATED_HEADER = "constants.cuh"

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def kernel_dir() -> Path:
    """The folder holding the ``.cu``/``.cuh`` sources (source checkout or installed wheel)."""
    here = Path(__file__).resolve().parent.parent  # the package's root
    override = os.environ.get("DEEPEP_CUPY_KERNEL_DIR")  # for trying kernel variants side by side
    candidates = [Path(override)] if override else [here / "_kernels", here.parent / "kernels"]
    for candidate in candidates:
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"deepep_cupy: CUDA sources not found next to {here}")


def read_source(name: str) -> str:
    """Return the text of ``name`` with every local ``#include "..."`` inlined (each header once)."""
    seen: set = set()

    def expand(file_name: str) -> str:
        if file_name in seen:
            return ""
        seen.add(file_name)
        if file_name == GENERATED_HEADER:
            return cuda_header()
        text = (kernel_dir() / file_name).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


def source_of(name_expression: str) -> str:
    """The source file that holds ``name_expression``."""
    for file_name, expressions in SOURCES.items():
        if name_expression in expressions:
            return file_name
    raise KeyError(f"deepep_cupy: no kernel instance named {name_expression!r}")


# ---------------------------------------------------------------------------------------------
# Run-time compilation (needs a GPU)

#: At most this many kernel instances compile at once (an NVRTC compile holds 100-150 MB of host memory).
MAX_COMPILE_THREADS = 16

_functions: Dict[Tuple[int, str], object] = {}
# One lock per instance, not per device: ranks of one process on several GPUs wait for the first
# build of an instance and then find it in CuPy's disk cache instead of compiling it again.
_build_locks: Dict[str, threading.Lock] = {}
_build_locks_lock = threading.Lock()


def get_kernel(name_expression: str):
    """Return the ``cupy.RawKernel`` for ``name_expression`` on the current device.

    Each instance is its own module, compiled on first use (CuPy caches the binary on disk), so
    a 2-rank job never pays for the 8-rank instances.
    """
    key = (_current_device(), name_expression)
    function = _functions.get(key)
    if function is None:
        with _build_lock(name_expression):
            function = _functions.get(key)
            if function is None:
                function = _functions[key] = _build(name_expression)
    return function


def _build_lock(name_expression: str) -> threading.Lock:
    with _build_locks_lock:
        return _build_locks.setdefault(name_expression, threading.Lock())


def _current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


def _use_device(device: int) -> None:
    """Make ``device`` current in this thread (a compile thread's own: nothing to restore after)."""
    import cupy

    cupy.cuda.runtime.setDevice(device)


def _build(name_expression: str):
    """Compile (or read from CuPy's disk cache) and load one instance on the current device."""
    import cupy

    module = cupy.RawModule(code=read_source(source_of(name_expression)), options=NVRTC_OPTIONS,
                            name_expressions=(name_expression,))
    function = module.get_function(name_expression)
    _load_now(function.kernel.ptr)
    return function


def compile_threads() -> int:
    """How many instances :func:`warm_up` compiles at once: one per CPU this process may use."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_COMPILE_THREADS))


def _get_kernel_on(device: int, name_expression: str) -> None:
    _use_device(device)
    get_kernel(name_expression)


@functools.lru_cache(maxsize=None)
def _cu_func_load():
    """The driver's ``cuFuncLoad`` (CUDA 12.4+), or None with an older driver."""
    try:
        func_load = ctypes.CDLL("libcuda.so.1").cuFuncLoad
    except (OSError, AttributeError):
        return None
    func_load.argtypes = [ctypes.c_void_p]
    return func_load


def _load_now(function_ptr: int) -> None:
    """Load a kernel onto the GPU now rather than at its first launch.

    Under CUDA's lazy module loading (the default since CUDA 12.2) the first launch of a kernel
    loads it, and loading may wait for the kernels already running on the device. When ranks share
    a GPU, those include a co-located peer's kernel that spins until this rank's kernel runs: a
    deadlock that only the kernels' timeout ends. ``cuFuncLoad`` (CUDA 12.4+) loads eagerly.
    """
    func_load = _cu_func_load()
    if func_load is None:
        return  # a driver before CUDA 12.4: nothing to force
    status = func_load(ctypes.c_void_p(function_ptr))
    if status != 0:
        raise KernelBuildError(f"deepep_cupy: cuFuncLoad failed with CUresult {status}")


def warm_up_instances(num_ranks: int, every_instance: bool = False) -> Tuple[str, ...]:
    """The instances :func:`warm_up` loads, those that take longest to compile first.

    What a ``num_ranks`` group uses on its hot path: the untemplated kernels, dispatch and the BF16
    combine; with ``every_instance`` also the other instances of its rank count (strided FP8
    scales, rows in place, the other combine dtypes, combine in place) and the optional kernels.
    """
    dispatch = [name_expression("dispatch_kernel", (num_ranks,))]
    combine = [name_expression("combine_kernel", (COMBINE_ELEMENTS["bfloat16"], num_ranks))]
    if every_instance:
        dispatch += [name_expression("dispatch_kernel", args)
                     for args in ((num_ranks, "true"), (num_ranks, "false", "true"), (num_ranks, "true", "true"))]
        combine = [name_expression("combine_kernel", (element, num_ranks) + in_place)
                   for in_place in ((), ("true",)) for element in COMBINE_ELEMENTS.values()]
    untemplated = [expression for file_name, expressions in SOURCES.items() if file_name not in OWN_WARM_UP
                   for expression in expressions
                   if "<" not in expression and (every_instance or expression not in OPTIONAL_KERNELS)]
    untemplated.sort(key=lambda expression: expression == "dispatch_layout_kernel")  # the quickest, last
    return tuple(dispatch + combine + untemplated)


def warm_up(num_ranks: int, every_instance: bool = False) -> None:
    """Compile (or load from CuPy's cache) what a ``num_ranks`` group uses on its hot path
    (:func:`warm_up_instances`); the other instances and the optional kernels compile on first
    use, unless ``every_instance``.

    Ranks that share a GPU need ``every_instance``: loading a module waits for the kernels running
    on the device, among them a co-located peer's that waits for this rank (see :func:`_load_now`).

    The instances missing from this process build in :func:`compile_threads` threads at once:
    NVRTC compiles one instance on one CPU core and runs without the GIL, so an empty kernel
    cache costs about the longest compile rather than the sum of all of them. Instances already
    loaded on this device cost a dictionary look-up each, and no thread is started.
    """
    load(warm_up_instances(num_ranks, every_instance))


def load(expressions: Sequence[str]) -> None:
    """Compile (or load from CuPy's cache) ``expressions`` on the current device, in
    :func:`compile_threads` threads at once (see :func:`warm_up`)."""
    device = _current_device()
    missing = [e for e in expressions if (device, e) not in _functions]
    threads = min(len(missing), compile_threads())
    if threads <= 1:
        for expression in missing:
            get_kernel(expression)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="deepep_cupy-compile") as pool:
        builds = [pool.submit(_get_kernel_on, device, expression) for expression in missing]
    for build in builds:
        build.result()  # the first failure, if any, once every build has ended


# ---------------------------------------------------------------------------------------------
# Parameters

def _signature(text: str) -> Tuple[Tuple[str, str], ...]:
    pairs = []
    for item in text.split():
        name, kind = item.split(":")    # exactly one colon: a typo fails at import
        pairs.append((name, kind))
    return tuple(pairs)


#: Each kernel's parameters in order, as ``name:kind`` (kind: ptr, i32, i64, f32); they mirror
#: the ``__global__`` declarations in kernels/*.cu.
# What a transfer kernel takes for its settings check (kernels/call_check.cuh), after send_chunk.
_CALL_CHECK = ("check_op:i32 row_bytes:i32 row_detail:i32 num_sms:i32 recv_chunk:i32 zero_off:i64 zero_count:i32 "
               "dispatch_verdict:ptr ")
# What the dispatch kernel takes for a count exchange of its own (kernels/count_exchange.cuh).
_COUNT_EXCHANGE = ("exchange:i32 num_tokens_per_rank:ptr num_tokens_per_expert:ptr recv_capacity:i32 recv_counter:ptr "
                   "mismatch_flag:ptr recv_expert_counter:ptr report_refusal:i32 topk_code:i32 expert_alignment:i32 ")
_DEADLINE = "timeout_ns:i64 error_record:ptr"
# The internode kernels that write records' parts into arrays, and that sum the nodes' rows.
_INTERNODE_UNPACK = _signature(
    "records:ptr record_bytes:i32 num_records:i32 rows_out:ptr row_bytes:i32 scales_out:ptr "
    "num_scales:i32 scales_off:i32 topk_out:ptr weights_out:ptr num_topk:i32 topk_off:i32 weights_off:i32 "
    "first_expert:i64 num_local_experts:i64 in_rank_out:ptr in_rank_from:i32 num_in_rank:i32 in_rank_off:i32 "
    "num_out_rows:i32 row_of:ptr num_valid:ptr")
_INTERNODE_SUM = _signature(
    "out:ptr out_weights:ptr records:ptr record_bytes:i32 slots:ptr num_tokens:i32 num_nodes:i32 row_bytes:i32 "
    "num_weights:i32 weights_off:i32 bias_0:ptr bias_1:ptr")
SIGNATURES: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "dispatch_layout_kernel": _signature(
        "topk_idx:ptr num_tokens_per_rank:ptr num_tokens_per_expert:ptr is_token_in_rank:ptr "
        "num_tokens:i32 num_topk:i32 num_experts:i32 num_ranks:i32"),
    "notify_dispatch_kernel": _signature(
        "num_tokens_per_rank:ptr num_tokens_per_expert:ptr is_token_in_rank:ptr "
        "rank_prefix_matrix:ptr channel_prefix_matrix:ptr recv_capacity:i32 recv_counter:ptr mismatch_flag:ptr "
        "recv_expert_counter:ptr report_refusal:i32 row_bytes:i32 topk_code:i32 num_scales:i32 num_sms:i32 "
        "send_chunk:i32 recv_chunk:i32 topk_idx:ptr num_topk:i32 num_tokens:i32 num_experts:i32 "
        "num_channels:i32 expert_alignment:i32 buffer_ptrs:ptr num_ranks:i32 rank:i32 "
        "zero_off:i64 zero_count:i32 region_tokens:i32 timeout_ns:i64 error_record:ptr"),
    "barrier_kernel": _signature(
        "buffer_ptrs:ptr num_ranks:i32 rank:i32 timeout_ns:i64 error_record:ptr"),
    "dispatch_kernel": _signature(
        "recv_x:ptr recv_x_scales:ptr recv_src_idx:ptr recv_topk_idx:ptr recv_topk_weights:ptr "
        "recv_channel_prefix_matrix:ptr send_head:ptr x:ptr x_scales:ptr topk_idx:ptr topk_weights:ptr "
        "is_token_in_rank:ptr channel_prefix_matrix:ptr rank_prefix_matrix:ptr num_tokens:i32 "
        "hidden_int4:i32 num_topk:i32 num_experts:i32 num_scales:i32 scale_token_stride:i32 "
        "scale_hidden_stride:i32 buffer_ptrs:ptr rank:i32 "
        "meta_off:i64 x_off:i64 src_idx_off:i64 topk_idx_off:i64 topk_weights_off:i64 scales_off:i64 "
        "region_tokens:i32 num_channels:i32 num_senders:i32 send_chunk:i32 " + _CALL_CHECK + _COUNT_EXCHANGE
        + _DEADLINE),
    "combine_kernel": _signature(
        "combined_x:ptr combined_topk_weights:ptr x:ptr topk_weights:ptr bias_0:ptr bias_1:ptr rank_prefix_matrix:ptr "
        "recv_channel_prefix_matrix:ptr send_head:ptr num_tokens:i32 num_channels:i32 hidden_int4:i32 num_topk:i32 "
        "buffer_ptrs:ptr rank:i32 meta_off:i64 x_off:i64 topk_weights_off:i64 region_tokens:i32 num_senders:i32 "
        "send_chunk:i32 " + _CALL_CHECK + _DEADLINE),
    "expand_kernel": _signature(
        "expanded_x:ptr expanded_scales:ptr expanded_rows:ptr recv_x:ptr recv_scales:ptr recv_topk_idx:ptr "
        "num_recv:i32 num_topk:i32 hidden_int4:i32 num_scales:i32 num_local_experts:i32 expert_alignment:i32"),
    "deepep_cupy::internode::notify": _signature(
        "records:ptr record_bytes:i32 token_ids:ptr num_records:i32 x:ptr x_token_stride:i64 row_bytes:i32 "
        "scales:ptr scale_token_stride:i64 scale_stride:i64 num_scales:i32 scales_off:i32 topk:ptr "
        "topk_token_stride:i64 num_topk:i32 topk_off:i32 weights:ptr weights_token_stride:i64 num_weights:i32 "
        "weights_off:i32 "
        "in_rank:ptr in_rank_token_stride:i64 in_rank_stride:i64 num_in_rank:i32 in_rank_off:i32"),
    "deepep_cupy::internode::dispatch": _INTERNODE_UNPACK,
    "deepep_cupy::internode::forward": _INTERNODE_UNPACK,
    "deepep_cupy::internode::combine": _INTERNODE_SUM,
    "deepep_cupy::internode::sum_nodes": _INTERNODE_SUM,
    "deepep_cupy::blocks::route": _signature(
        "topk:ptr topk_stride:i64 num_topk:i32 in_rank_in:ptr in_rank_token_stride:i64 in_rank_stride:i64 "
        "num_tokens:i32 num_experts:i32 num_ranks:i32 ranks_per_node:i32 block_tokens:i32 in_rank_out:ptr "
        "per_rank:ptr per_node:ptr per_expert:ptr slots:ptr"),
    "deepep_cupy::blocks::number_rows": _signature(
        "records:ptr record_bytes:i32 in_rank_off:i32 rank:i32 num_blocks:i32 block_tokens:i32 num_rows:i32 "
        "row_of:ptr counts:ptr block_prefix:ptr overflow:ptr"),
    "deepep_cupy::blocks::stage_counts": _signature(
        "in_rank:ptr topk:ptr num_rows:i32 ranks_per_node:i32 num_topk:i32 num_node_experts:i32 per_rank:ptr "
        "per_expert:ptr"),
    "deepep_cupy::blocks::deepep_order": _signature(
        "rank_prefix:ptr recv_src_idx:ptr local_rank:i32 ranks_per_node:i32 num_nodes:i32 block_tokens:i32 "
        "num_rows:i32 order:ptr inverse:ptr gbl_prefix:ptr block_prefix:ptr"),
    "deepep_cupy::blocks::take_rows": _signature("dst:ptr src:ptr order:ptr num_rows:i32 row_bytes:i64"),
    "deepep_cupy::rail::post": _signature("mailbox:ptr send_ptr:i64"),
    "deepep_cupy::rail::pull": _signature(
        "mailboxes:ptr rank:i32 num_peers:i32 recv:ptr block_bytes:i64 timeout_ns:i64"),
    "deepep_cupy::low_latency::dispatch": _signature(
        "recv_x:ptr recv_scales:ptr recv_count:ptr src_info:ptr layout_range:ptr cumulative_recv_stats:ptr "
        "wait_recv_cost_stats:ptr x:ptr topk_idx:ptr num_tokens:i32 num_topk:i32 hidden:i32 num_max:i32 "
        "num_experts:i32 fp8_mode:i32 phases:i32 shrink:i32 record_bytes:i64 dispatch_off:i64 half_bytes:i64 "
        "buffer_ptrs:ptr num_ranks:i32 rank:i32 " + _DEADLINE),
    "deepep_cupy::low_latency::combine": _signature(
        "combined_x:ptr x:ptr topk_idx:ptr topk_weights:ptr src_info:ptr layout_range:ptr "
        "wait_recv_cost_stats:ptr num_tokens:i32 num_topk:i32 hidden:i32 num_max:i32 num_experts:i32 phases:i32 "
        "shrink:i32 logfmt_unroll:i32 slot_bytes:i64 combine_off:i64 half_bytes:i64 "
        "buffer_ptrs:ptr num_ranks:i32 rank:i32 " + _DEADLINE),
    "deepep_cupy::low_latency::barrier": _signature("buffer_ptrs:ptr num_ranks:i32 rank:i32 " + _DEADLINE),
    "deepep_cupy::ll_nodes::relay_tokens": _signature(
        "x:ptr topk:ptr num_tokens:i32 num_max:i32 num_topk:i32 hidden_int4:i32 num_experts:i32 num_nodes:i32 "
        "own_node:i32 send:ptr block_bytes:i64 x_off:i64"),
    "deepep_cupy::ll_nodes::relay_routing": _signature(
        "topk:ptr weights:ptr num_tokens:i32 num_max:i32 num_topk:i32 num_experts:i32 num_nodes:i32 own_node:i32 "
        "send:ptr block_bytes:i64 weights_off:i64"),
    "deepep_cupy::ll_nodes::global_handle": _signature(
        "node_src_info:ptr node_layout_range:ptr src_info:ptr layout_range:ptr num_local_experts:i32 "
        "ranks_per_node:i32 num_nodes:i32 num_max:i32"),
    "deepep_cupy::ll_nodes::sum_partials": _signature(
        "out:ptr partials:ptr num_tokens:i32 num_max:i32 num_nodes:i32 hidden_int4:i32"),
    "deepep_cupy::ll_nodes::rail_failed": _signature(
        "rail_error:ptr rail_size:i32 ranks_per_node:i32 buffer_ptrs:ptr num_ranks:i32 rank:i32 error_record:ptr"),
}

def block_threads(kernel: str) -> int:
    """Threads per block that ``kernel`` is launched with (:data:`deepep_cupy.constants.BLOCK_THREADS`)."""
    return BLOCK_THREADS[kernel]


def name_expression(kernel: str, template_args: Sequence[object] = ()) -> str:
    """``kernel<arg, ...>`` as listed in :data:`SOURCES` (the bare name for non-templates)."""
    return f"{kernel}<{', '.join(str(a) for a in template_args)}>" if template_args else kernel
