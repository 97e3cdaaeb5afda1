"""The intranode engine: dispatch and combine between the GPUs of one node, over NVLink.

It owns the NVLink buffer, the host slots, the stream order, the operations' context and the
dispatch and combine paths. A Buffer on one node has one; an internode Buffer gives one to its
path for the node's ranks; a low-latency Buffer has one for its normal operations, slots and stream.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..config import CHOSEN_NUM_SMS, Config, default_config
from ..constants import MAX_RANKS
from ..engine import Engine
from ..errors import RankMismatchError
from ..events import EventOverlap
from ..gpu import kernels
from ..gpu.ipc import NvlBuffer
from ..gpu.local_buffer import local_buffer_tensor
from ..gpu.slots import HostSlots
from ..gpu.sm_budget import check_sm_budget
from ..gpu.streams import StreamOrder
from ..groups.group import Group
from .combine import CombinePath
from .context import OperationContext
from .dispatch import DispatchPath
from .handle import DispatchHandle
from .layout_call import LayoutPath
from .rows_in_buffer import RowsInBuffer


class IntranodeEngine(Engine):
    """Layout, dispatch, combine and barrier of the ranks of one node (``Buffer``'s docstrings are
    the contract).

    Args:
        group: the ranks (a :class:`deepep_cupy.groups.group.Group`), all on one node.
        num_nvl_bytes: bytes of each rank's NVLink buffer (0: none, for a decode-only Buffer, whose
            normal operations are then refused).
        timeout_s: the peers' deadline; device_id: the GPU; allocate_ahead: as the Buffer's.

    The GPU resources come with :meth:`attach` (:meth:`create` makes them, collectively).
    """

    kind = "intranode"

    def __init__(self, group: Group, num_nvl_bytes: int, timeout_s: float, device_id: int, allocate_ahead: bool):
        self.group = group
        self.rank, self.num_ranks = group.rank, group.size
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.timeout_s = float(timeout_s)
        self.device_id = device_id
        self.nvl: Optional[Any] = None
        # Set by attach (create attaches before the engine is used; destroy keeps them, failed).
        self.slots: HostSlots
        self.order: StreamOrder
        self.ctx = OperationContext(group, device_id, self.timeout_s, self.num_nvl_bytes)
        self.on_device: Any = self.ctx.on_device
        self.layout_path = LayoutPath(self.ctx)
        rows_in_buffer = RowsInBuffer()
        self.dispatch_path = DispatchPath(self.ctx, rows_in_buffer, allocate_ahead)
        self.combine_path = CombinePath(self.ctx, rows_in_buffer)
        self._default_configs: Dict[tuple, Config] = {}
        self._checked_sms: set = set()
        #: Buffers of other paths mapped beside this engine's, on the same ranks (a low-latency
        #: buffer): destroy meets the ranks before freeing them too, and release closes them first.
        self.mapped_beside: List[Any] = []

    @classmethod
    def create(cls, group: Group, num_nvl_bytes: int, *, timeout_s: float, device_id: int, allocate_ahead: bool,
               num_rdma_bytes: int = 0, min_ranks: int = 2) -> "IntranodeEngine":
        """An engine with its GPU resources, made by every rank of ``group`` together (the ranks'
        settings compared, the NVLink buffers mapped, the kernels loaded); ``num_rdma_bytes``: the
        low-latency buffer's size, which every rank must share too; ``min_ranks``: 1 for a node of
        one rank under the decode calls across nodes (the user's own groups need 2)."""
        import cupy

        engine = cls(group, num_nvl_bytes, timeout_s, device_id, allocate_ahead)
        with engine.on_device:
            engine.check_group(cupy, num_rdma_bytes, min_ranks)
            shares_gpu = engine.ranks_on_gpu() > 1
            try:
                engine.nvl = NvlBuffer(group, engine.num_nvl_bytes) if engine.num_nvl_bytes else None
                engine.attach(HostSlots(engine.rank, engine.timeout_s, group.in_process, names=group.buffer_ranks),
                              StreamOrder.create(device_id, shares_gpu),
                              engine.nvl.peer_ptrs.data.ptr if engine.nvl is not None else 0)
                if engine.nvl is not None:
                    kernels.warm_up(engine.num_ranks, every_instance=shares_gpu)
            except BaseException:
                engine.destroy()
                raise
        group.barrier()
        return engine

    def attach(self, host_slots: HostSlots, order: StreamOrder, peer_table_ptr: int) -> None:
        """Take the slots and the stream order, and give them, with the NVLink buffer
        (:attr:`nvl`), to the operations' context (which binds the arguments every kernel shares)."""
        self.slots = host_slots
        self.order = order
        self.ctx.attach(self.nvl, host_slots, order, peer_table_ptr)

    def ranks_on_gpu(self) -> int:
        """The group's ranks on this GPU in this process (their kernels must fit on it together)."""
        return max(1, self.group.ranks_on_device(self.device_id))

    def check_group(self, cupy, num_rdma_bytes: int = 0, min_ranks: int = 2) -> None:
        """Every rank on one host, one GPU each (unless in one process), with the same buffer sizes."""
        if not min_ranks <= self.num_ranks <= MAX_RANKS:
            raise ValueError(f"comm: expected {min_ranks}..{MAX_RANKS} ranks, got {self.num_ranks}")
        me = {"host": self.group.host_name(), "bus": cupy.cuda.runtime.deviceGetPCIBusId(self.device_id),
              "nvl_bytes": self.num_nvl_bytes, "rdma_bytes": int(num_rdma_bytes)}
        everyone = self.group.allgather(me)
        hosts = sorted({e["host"] for e in everyone})
        if len(hosts) > 1:
            raise ValueError(f"comm: all ranks must run on one node (intranode NVLink), got nodes {hosts}")
        # Both sizes place what the ranks write into each other's buffers (the low-latency layout
        # comes from num_rdma_bytes alone), so every rank must have the same.
        for name in ("nvl_bytes", "rdma_bytes"):
            sizes = [e[name] for e in everyone]
            if len(set(sizes)) > 1:
                raise RankMismatchError(f"num_{name}: ranks disagree, got {sizes} (rank order)")
        buses = [e["bus"] for e in everyone]
        if not self.group.in_process and len(set(buses)) < len(buses):
            raise ValueError(
                f"comm: expected one GPU per rank, got GPUs {buses} (rank order); select the device "
                "from the local rank before creating the Buffer, e.g. cupy.cuda.Device(local_rank).use()")

    # -----------------------------------------------------------------------------------------
    # Operations

    def config(self, config: Optional[Config], kind: str) -> Config:
        """``config``, or the default one of ``kind`` (``"dispatch"``/``"combine"``), checked to fit the GPU."""
        if not self.num_nvl_bytes:
            raise ValueError(f"{kind}: this Buffer has no NVLink buffer (num_nvl_bytes=0, a low-latency Buffer); "
                             "create it with num_nvl_bytes > 0 for dispatch and combine")
        if config is None:
            key = (kind, CHOSEN_NUM_SMS[0] if CHOSEN_NUM_SMS else None)
            config = self._default_configs.get(key)
            if config is None:
                with self.on_device:  # the recommended SM count is that of the Buffer's GPU
                    config = self._default_configs[key] = default_config(kind, self.num_ranks)
        elif not isinstance(config, Config):
            raise TypeError(f"config: expected deepep_cupy.Config, got {type(config).__name__}")
        if config.num_sms not in self._checked_sms:
            # Ranks sharing a GPU spin-wait on each other, so all their blocks must be resident at once.
            check_sm_budget({self.device_id: self.ranks_on_gpu()}, config.num_sms)
            self._checked_sms.add(config.num_sms)
        return config

    def check_kernel_errors(self) -> None:
        self.slots.raise_if_failed()

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self.slots.raise_if_failed()
        per_rank, per_expert, in_rank, event = self.layout_path.layout(topk_idx, num_experts, previous_event,
                                                                         async_finish, allocate_on_comm_stream)
        return per_rank, None, per_expert, in_rank, event

    def dispatch(self, x, handle: Optional[DispatchHandle] = None, num_tokens_per_rank=None,
                 num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, *, expand: bool = False,
                 recv_x_in_buffer: bool = False):
        self.slots.raise_if_failed()
        if type(config) is not Config or config.num_sms not in self._checked_sms:  # else checked already
            config = self.config(config, "dispatch")
        if num_tokens_per_rdma_rank is not None:
            raise ValueError("num_tokens_per_rdma_rank: expected None (intranode dispatch has no RDMA ranks)")
        if handle is not None:
            if num_worst_tokens:
                raise ValueError("num_worst_tokens: a cached dispatch receives the handle's row count; pass 0")
            if expand:
                raise ValueError("expand: a cached dispatch returns the rows in receive order; expand them with "
                                 "handle.expanded_rows of the fresh dispatch that expanded")
            return self.dispatch_path.cached(x, handle, config, previous_event, async_finish, allocate_on_comm_stream,
                                             recv_x_in_buffer)
        return self.dispatch_path.fresh(x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                                        topk_weights, expert_alignment, num_worst_tokens, config, previous_event,
                                        async_finish, allocate_on_comm_stream, expand, recv_x_in_buffer)

    def combine(self, x, handle: DispatchHandle, topk_weights=None, bias=None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        self.slots.raise_if_failed()
        if type(config) is not Config or config.num_sms not in self._checked_sms:  # else checked already
            config = self.config(config, "combine")
        return self.combine_path.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                         allocate_on_comm_stream)

    def barrier(self) -> None:
        slots, order = self.slots, self.order
        slots.raise_if_failed()
        with self.on_device:
            stream = order.begin_on_comm_stream()
            self.ctx.bind("barrier_kernel", grid=1).run(stream)
            order.synchronize()
            slots.raise_if_failed()

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        if use_rdma_buffer:
            self.unsupported("get_local_buffer_tensor(use_rdma_buffer=True)", "low-latency")
        return local_buffer_tensor(self.nvl, dtype, size, offset)

    # -----------------------------------------------------------------------------------------
    # Properties

    @property
    def comm_stream(self):
        return self.order.stream

    @property
    def allocate_ahead(self) -> bool:
        return self.dispatch_path.allocate_ahead

    @allocate_ahead.setter
    def allocate_ahead(self, value: bool) -> None:
        self.dispatch_path.allocate_ahead = bool(value)

    @property
    def last_dispatch_allocation(self) -> Optional[str]:
        return self.dispatch_path.last_dispatch_allocation

    @property
    def last_dispatch_rows_allocated(self) -> Optional[int]:
        return self.dispatch_path.last_dispatch_rows_allocated

    @property
    def last_count_wait_s(self) -> float:
        return self.slots.last_wait_s

    # -----------------------------------------------------------------------------------------
    # Lifetime

    def destroy(self) -> None:
        """Wait for this engine's kernels, then free the NVLink buffer, unmap the peers' and free the
        host slots (idempotent; never raises because a call or a kernel failed)."""
        slots, order = self.__dict__.get("slots"), self.__dict__.get("order")
        if self.nvl is None and slots is None:
            return
        with self.on_device:
            try:
                # Only this engine's kernels (StreamOrder.synchronize): ranks sharing the GPU may
                # have kernels in flight that wait for this rank, and a device-wide synchronize
                # would wait for them. Ours end by themselves: every wait has a deadline, and after
                # a timeout they stop at once (the abort mark, kernels/common.cuh).
                if order is not None:
                    order.synchronize()
            except Exception:
                pass
            if (self.nvl is not None or self.mapped_beside) and slots is not None:
                # No peer may still write into our buffers when they are freed.
                try:
                    self.group.barrier()
                except Exception:
                    pass
            self.release()

    def release(self) -> None:
        """Free what the engine holds, without waiting (``destroy`` waits first)."""
        try:
            while self.mapped_beside:
                self.mapped_beside.pop().close()
            if self.nvl is not None:
                nvl, self.nvl = self.nvl, None
                nvl.close()
        finally:
            slots = self.__dict__.get("slots")
            if slots is not None:
                slots.free()
                slots.failed = "the Buffer was destroyed"
            self.ctx.plans.clear()
            self.dispatch_path.forget()

