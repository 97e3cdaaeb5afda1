"""The low-latency (decode) path: DeepEP's low_latency_dispatch and low_latency_combine.

:mod:`.path` makes the calls; :mod:`.layout` places their data in the buffer and sizes it,
:mod:`.checks` checks their sizes, :mod:`.handle` is what a dispatch hands its combine,
:mod:`.receive_hooks` keeps the receive halves in order, :mod:`.rank_mask` is shrink mode's mask
and :mod:`.local_buffer` gives a rank's buffer as an array.
"""

from ..gpu.local_buffer import local_buffer_tensor
from .arguments import clean_arguments
from .handle import LowLatencyHandle
from .layout import LowLatencyLayout, get_low_latency_rdma_size_hint
from .path import LowLatencyPath

__all__ = ["LowLatencyHandle", "LowLatencyLayout", "LowLatencyPath", "clean_arguments",
           "get_low_latency_rdma_size_hint", "local_buffer_tensor"]
