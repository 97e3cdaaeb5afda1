"""What every engine of a Buffer answers: the Buffer chooses one engine in ``__init__`` (intranode,
internode or low-latency) and delegates each public operation and property to it.

An engine that lacks an operation or a property inherits the answer here: a
:class:`deepep_cupy.errors.BufferKindError` naming the Buffer's kind and the kind that has it.
"""

from __future__ import annotations

from typing import Any, NoReturn, Optional

from .errors import BufferKindError

#: How to make a Buffer that has each family of operations.
_HOW = {
    "normal": "dispatch and combine need num_nvl_bytes > 0 (deepep_cupy.get_nvl_buffer_size_hint)",
    "low-latency": "create it as Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(...), "
                   "low_latency_mode=True)",
    "intranode": "an intranode Buffer has it (num_rdma_bytes=0, or a group of one node)",
    "internode": "an internode Buffer has it (num_rdma_bytes > 0 on a group of several nodes)",
}


class Engine:
    """The operations and properties of a Buffer, each refused with a clear error unless the engine
    of this kind has it (:attr:`kind`: ``"intranode"``, ``"internode"`` or ``"low-latency"``)."""

    kind = "unknown"
    #: An internode engine's node shape; None for the other kinds.
    topology: Any = None

    def unsupported(self, what: str, family: str) -> NoReturn:
        raise BufferKindError(f"{what}: not available on this {self.kind} Buffer; {_HOW[family]}")

    # What every engine has
    def barrier(self) -> None:
        raise NotImplementedError

    def check_kernel_errors(self) -> None:
        raise NotImplementedError

    def destroy(self) -> None:
        raise NotImplementedError

    # Normal (prefill) operations
    def get_dispatch_layout(self, *args, **kwargs) -> Any:
        self.unsupported("get_dispatch_layout", "normal")

    def dispatch(self, *args, **kwargs) -> Any:
        self.unsupported("dispatch", "normal")

    def combine(self, *args, **kwargs) -> Any:
        self.unsupported("combine", "normal")

    # Decode operations
    def low_latency_dispatch(self, *args, **kwargs) -> Any:
        self.unsupported("low_latency_dispatch", "low-latency")

    def low_latency_combine(self, *args, **kwargs) -> Any:
        self.unsupported("low_latency_combine", "low-latency")

    def get_next_low_latency_combine_buffer(self, handle) -> Any:
        self.unsupported("get_next_low_latency_combine_buffer", "low-latency")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        self.unsupported("low_latency_update_mask_buffer", "low-latency")

    def low_latency_query_mask_buffer(self, mask_status) -> None:
        self.unsupported("low_latency_query_mask_buffer", "low-latency")

    def low_latency_clean_mask_buffer(self) -> None:
        self.unsupported("low_latency_clean_mask_buffer", "low-latency")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self.unsupported("clean_low_latency_buffer", "low-latency")

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False) -> Any:
        self.unsupported("get_local_buffer_tensor", "intranode")

    def release(self) -> None:
        """Free what the engine holds without waiting or meeting the other ranks (the Buffer's
        ``__del__``, a safety net: ``destroy`` is the contract)."""

    @property
    def internode_transport(self) -> Optional[str]:
        """An internode engine's rail transport's name; None for the other kinds."""
        return None

    @property
    def last_internode_rows(self) -> int:
        self.unsupported("last_internode_rows", "internode")

    # Properties of one kind
    @property
    def comm_stream(self) -> Any:
        self.unsupported("comm_stream", "intranode")

    @property
    def allocate_ahead(self) -> bool:
        self.unsupported("allocate_ahead", "intranode")

    @allocate_ahead.setter
    def allocate_ahead(self, value: bool) -> None:
        self.unsupported("allocate_ahead", "intranode")

    @property
    def last_dispatch_allocation(self) -> Optional[str]:
        self.unsupported("last_dispatch_allocation", "intranode")

    @property
    def last_dispatch_rows_allocated(self) -> Optional[int]:
        self.unsupported("last_dispatch_rows_allocated", "intranode")

    @property
    def last_count_wait_s(self) -> float:
        self.unsupported("last_count_wait_s", "intranode")

