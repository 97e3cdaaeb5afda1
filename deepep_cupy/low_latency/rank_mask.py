"""Shrink mode's mask of ranks (DeepEP's ``low_latency_*_mask_buffer``): one int32 per rank in
this rank's low-latency buffer (constants.LL_MASK_INT); masked ranks are neither sent to nor waited
for by this rank's calls, and the kernels mask a rank whose wait times out."""

from __future__ import annotations

from typing import Any

from ..gpu import launch
from ..gpu.call_span import CallSpan
from ..tensors import check_array, check_int, describe

__all__ = ["RankMask"]


class RankMask:
    """This rank's mask of ranks, at device address ``ptr``, and the calls that read and write it.

    Args:
        ptr: the mask's first word (``num_ranks`` int32 words).
        rank, num_ranks, device_id: the rank's place.
        order, slots, on_device: the path's stream order, host slots and device context.
    """

    def __init__(self, ptr: int, *, rank: int, num_ranks: int, device_id: int, order: Any, slots: Any,
                 on_device: Any):
        self.ptr = ptr
        self.rank, self.num_ranks, self.device_id = rank, num_ranks, device_id
        self._order = order
        self._slots = slots
        self._span = CallSpan(order, device_id, rank, slots=slots)
        self._on_device = on_device

    def update(self, rank_to_mask: Any, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask ``rank_to_mask``. The host waits for this Buffer's calls first."""
        import numpy as np
        from cupy.cuda import runtime

        rank_to_mask = check_int(rank_to_mask, "rank_to_mask", minimum=0)
        if rank_to_mask >= self.num_ranks:
            raise ValueError(f"rank_to_mask: expected a rank below {self.num_ranks}, got {rank_to_mask}")
        value = np.array([1 if mask else 0], np.int32)
        with self._on_device:
            self._order.synchronize()
            runtime.memcpy(self.ptr + 4 * rank_to_mask, value.ctypes.data, 4, runtime.memcpyHostToDevice)

    def query(self, mask_status: Any) -> None:
        """Copy the mask into ``mask_status`` (int32 ``[num_ranks]``: 1 masked, 0 not), on the
        caller's current stream, after this Buffer's calls."""
        from cupy.cuda import runtime

        info = describe(mask_status, "mask_status", self.device_id)
        check_array(info, "mask_status", ("int32",), 1, (self.num_ranks,))
        lib = info.lib
        with self._on_device, self._span.begin(lib, None, False) as span:
            runtime.memcpyAsync(lib.pointer(mask_status), self.ptr, 4 * self.num_ranks,
                                runtime.memcpyDeviceToDevice, span.run_on)
            span.finish(lib, False, (mask_status,))

    def clear(self) -> None:
        """Unmask every rank. The host waits for this Buffer's calls first."""
        with self._on_device:
            self._order.synchronize()
            launch.fill_bytes(self.ptr, 0, 4 * self.num_ranks, self._order.ptr)
            self._order.synchronize()
