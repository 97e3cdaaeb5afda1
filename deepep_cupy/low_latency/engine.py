"""The low-latency engine: DeepEP's decode calls on the ranks of one node, beside the normal
operations of the node's intranode engine (whose host slots and stream order it shares)."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..engine import Engine
from ..errors import BufferKindError, DeepEPError
from ..gpu.local_buffer import local_buffer_tensor
from .path import LowLatencyPath, clean_arguments


class LowLatencyEngine(Engine):
    """A low-latency Buffer's engine (``Buffer``'s docstrings are the contract).

    Args:
        intranode: the node's intranode engine (its normal operations, slots and stream order; its
            NVLink buffer may be absent, ``num_nvl_bytes=0``).
        path: the :class:`deepep_cupy.low_latency.path.LowLatencyPath` of the decode calls.
        group_barrier: the group's host barrier (a clean is collective).
        across_nodes: the group spans nodes (``path`` is a
            :class:`deepep_cupy.low_latency.across_nodes.LowLatencyAcrossNodes` and ``intranode`` the
            node's): the normal operations, which would stay inside the node, are refused.
    """

    kind = "low-latency"

    def __init__(self, intranode: Any, path: Any, group_barrier: Callable[[], None], across_nodes: bool = False):
        self.intranode = intranode
        self.path: Optional[Any] = path  # None once released
        self._group_barrier = group_barrier
        self.across_nodes = across_nodes

    @classmethod
    def create(cls, intranode: Any, group, num_rdma_bytes: int, *, enable_shrink: bool) -> "LowLatencyEngine":
        """Map the low-latency buffers of every rank of ``group`` (collective) beside ``intranode``."""
        path = LowLatencyPath.create(group, num_rdma_bytes, order=intranode.order, slots=intranode.slots,
                                     timeout_s=intranode.timeout_s, device_id=intranode.device_id,
                                     on_device=intranode.on_device, ranks_on_gpu=intranode.ranks_on_gpu(),
                                     enable_shrink=enable_shrink)
        intranode.mapped_beside.append(path)
        return cls(intranode, path, group.barrier)

    # The normal operations are the node's (on one node only).
    def _normal(self, what: str) -> Any:
        if self.across_nodes:
            raise BufferKindError(f"{what}: a low-latency Buffer across nodes has the decode calls only; make a "
                                  "Buffer with low_latency_mode=False for the normal calls across nodes")
        return self.intranode

    def get_dispatch_layout(self, *args, **kwargs):
        return self._normal("get_dispatch_layout").get_dispatch_layout(*args, **kwargs)

    def dispatch(self, *args, **kwargs):
        return self._normal("dispatch").dispatch(*args, **kwargs)

    def combine(self, *args, **kwargs):
        return self._normal("combine").combine(*args, **kwargs)

    def barrier(self) -> None:
        if not self.across_nodes:
            self.intranode.barrier()
            return
        # Across nodes the device barrier would meet the node's ranks alone: this rank's calls are
        # waited for, then the whole group meets on the host.
        self.intranode.slots.raise_if_failed()
        with self.intranode.on_device:
            self.intranode.order.synchronize()
        self._group_barrier()

    def check_kernel_errors(self) -> None:
        # The rail's first: a timed-out exchange across nodes is why the node's calls then failed.
        if self.path is not None:
            self.path.check()
        self.intranode.check_kernel_errors()

    # Decode
    def _live_path(self) -> LowLatencyPath:
        """The decode calls' path; raises as the released slots would once the Buffer let it go."""
        if self.path is None:
            raise DeepEPError("Buffer unusable: the Buffer was destroyed (its low-latency buffer is freed)")
        return self.path

    def low_latency_dispatch(self, *args, **kwargs):
        return self._live_path().dispatch(*args, **kwargs)

    def low_latency_combine(self, *args, **kwargs):
        return self._live_path().combine(*args, **kwargs)

    def get_next_low_latency_combine_buffer(self, handle):
        return self._live_path().next_combine_buffer(handle)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        self._live_path().update_mask(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status) -> None:
        self._live_path().query_mask(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        self._live_path().clean_mask()

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        clean_arguments(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        self._live_path().clean(self._group_barrier)

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        return local_buffer_tensor(self.path if use_rdma_buffer else self.intranode.nvl, dtype, size, offset)

    # Properties are the node engine's.
    @property
    def comm_stream(self):
        return self.intranode.comm_stream

    @property
    def allocate_ahead(self) -> bool:
        return self.intranode.allocate_ahead

    @allocate_ahead.setter
    def allocate_ahead(self, value: bool) -> None:
        self.intranode.allocate_ahead = value

    @property
    def last_dispatch_allocation(self):
        return self.intranode.last_dispatch_allocation

    @property
    def last_dispatch_rows_allocated(self):
        return self.intranode.last_dispatch_rows_allocated

    @property
    def last_count_wait_s(self) -> float:
        return self.intranode.last_count_wait_s

    def release(self) -> None:
        self.path = None
        self.intranode.release()  # closes the low-latency buffer first (mapped beside it)

    def destroy(self) -> None:
        """Wait for the Buffer's calls, meet the other ranks (no peer may still write into a buffer
        being freed), then free the low-latency buffer and the node engine's resources: the node
        engine's destroy, which holds the low-latency buffer as one mapped beside its own."""
        self.path = None
        self.intranode.destroy()
