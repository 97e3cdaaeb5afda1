"""deepep-cupy: expert-parallel dispatch and combine over NVLink inside a node and NCCL or MPI
across nodes, with DeepEP's low-latency (decode) calls, on CuPy and mpi4py.

Public surface (DeepEP-compatible names; ``import deepep_cupy as deep_ep`` runs DeepEP's intranode
scripts): :class:`Buffer`, :class:`Config`, :class:`EventOverlap`, ``topk_idx_t``,
:func:`get_dispatch_config`, :func:`get_combine_config`, :func:`get_nvl_buffer_size_hint`, the
node shape of a group (:class:`NodeTopology`, :func:`discover_topology`), and the exceptions.
:mod:`deepep_cupy.reference` (``intranode``, ``internode``, ``low_latency``) is the NumPy model every GPU
result is checked against.
"""

from .buffer import Buffer
from .config import Config, get_combine_config, get_dispatch_config, get_nvl_buffer_size_hint
from .errors import (
    BufferKindError,
    DeepEPError,
    DeepEPTimeoutError,
    GpuUnavailableError,
    GroupAbortedError,
    KernelBuildError,
    PeerAbortedError,
    PeerFailedError,
    RankFailed,
    RankMismatchError,
)
from .events import EventOverlap
from .gpu.sm_budget import check_sm_budget
from .groups.group import Group, MPIGroup, TorchGroup, as_group
from .groups.local import ThreadGroup, run_local_group
from .groups.nodes import NodeTopology, discover_topology
from .intranode.handle import DispatchHandle

__all__ = [
    "Buffer", "Config", "DispatchHandle", "EventOverlap", "Group", "MPIGroup", "TorchGroup", "as_group",
    "get_combine_config", "get_dispatch_config", "get_nvl_buffer_size_hint",
    "BufferKindError",
    "DeepEPError", "DeepEPTimeoutError", "PeerAbortedError", "PeerFailedError", "RankMismatchError", "KernelBuildError",
    "GpuUnavailableError",
    "ThreadGroup", "run_local_group", "RankFailed", "GroupAbortedError", "check_sm_budget",
    "NodeTopology", "discover_topology",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    # DeepEP's ``topk_idx_t`` is a torch dtype: resolved on first use so importing this package
    # never imports torch.
    if name == "topk_idx_t":
        from .compat import topk_idx_dtype

        return topk_idx_dtype()
    raise AttributeError(f"module 'deepep_cupy' has no attribute {name!r}")
