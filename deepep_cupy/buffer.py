"""Buffer: the user API of expert-parallel dispatch and combine.

A facade over one engine, chosen once in ``__init__`` (:func:`deepep_cupy.engines.make_engine`): an
intranode engine (:class:`deepep_cupy.intranode.engine.IntranodeEngine`: the NVLink buffer, slots,
stream order and the dispatch and combine paths) on one node, the internode path
(:class:`deepep_cupy.internode.path.InternodePath`, given an intranode engine for its node) on a
group of several nodes with ``num_rdma_bytes > 0``, or a low-latency engine
(:class:`deepep_cupy.low_latency.engine.LowLatencyEngine`) with ``low_latency_mode``. Every public
operation and property is a one-line delegation to it; one that the engine's kind lacks raises
:class:`deepep_cupy.errors.BufferKindError` naming the kind. No engine imports the Buffer.
"""

from __future__ import annotations

from typing import Any, Optional

from . import compat, config
from .config import Config
from .engine import Engine
from .engines import Settings, check_settings, make_engine
from .events import EventOverlap
from .groups.group import as_group
from .intranode.handle import DispatchHandle
from .low_latency.path import get_low_latency_rdma_size_hint

__all__ = ["Buffer", "DispatchHandle"]


class _DefaultNumSms:
    """``Buffer.num_sms`` (DeepEP's class attribute): the SM count of the default configs, kept by
    :mod:`deepep_cupy.config` (:meth:`Buffer.set_num_sms`)."""

    def __get__(self, obj: Any, owner: Any = None) -> int:
        return config.default_num_sms()


class Buffer:
    """NVLink buffers of one rank plus the streams and counters of its dispatch/combine calls.

    Created collectively by every rank of the group, one rank per GPU (or, in one process, one
    thread per rank). Streams follow DeepEP: an operation starts after the work queued on the
    caller's current stream (or after ``previous_event``); without ``async_finish`` its results
    are ready for the caller's stream when it returns, with it the caller gets an
    :class:`EventOverlap`. Asynchronous calls (and those given ``previous_event`` or
    ``allocate_on_comm_stream``) run on the Buffer's communication stream (:attr:`comm_stream`);
    plain synchronous calls run straight on the caller's stream, which orders them the same way
    at less host cost. A Buffer's calls never overlap each other on the GPU, whatever streams
    they come from (deepep_cupy/gpu/streams.py).

    Arrays: CuPy arrays or PyTorch CUDA tensors, read natively; results come back in the caller's
    library, allocated by its allocator (deepep_cupy/tensors.py for the element types).

    Args:
        group: the ranks: a ``torch.distributed`` ProcessGroup (as DeepEP takes), an mpi4py
            communicator, or a :class:`deepep_cupy.Group` (e.g. an in-process
            :class:`deepep_cupy.ThreadGroup`). ``comm=`` may name it instead (DeepEP's keyword
            for an mpi4py communicator).
        num_nvl_bytes: bytes of this rank's NVLink buffer (same on every rank); see
            :func:`deepep_cupy.get_nvl_buffer_size_hint`. May be 0 with ``low_latency_mode``
            (a decode-only Buffer, as DeepEP's ``Buffer(group, 0, num_rdma_bytes, True)``).
        num_rdma_bytes: with ``low_latency_mode=True``, the bytes of the low-latency buffer (decode
            calls over NVLink, and across nodes over the rail, docs/DECODE.md; size it with
            :meth:`get_low_latency_rdma_size_hint`;
            same on every rank).
            Otherwise 0, or > 0 for an internode Buffer (DeepEP's switch): when the group spans
            several nodes (``ranks_per_node``), every operation takes the hierarchical path of
            :mod:`deepep_cupy.internode.path` (a token crosses the network once per destination node,
            over the rail transport, to the rank of its own local index there, and this library's
            intranode kernels forward it inside the node); on one node the Buffer is intranode,
            as DeepEP's is. Its staging comes from CuPy's pool per call
            (:func:`deepep_cupy.config.get_rdma_buffer_size_hint` says how much).
        low_latency_mode: DeepEP's decode API (:meth:`low_latency_dispatch`,
            :meth:`low_latency_combine`), on one node or across nodes (there the decode calls only;
            the normal ones raise ``BufferKindError``).
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric,
        explicitly_destroy, enable_shrink: DeepEP's arguments, accepted so that its scripts run
            unchanged (the first two are not used: NVLink carries everything). ``allow_mnnvl``,
            ``use_fabric`` must be False (``ValueError``), ``enable_shrink`` too without low_latency_mode (with it:
            DeepEP's rank masking, docs/DECODE.md). ``explicitly_destroy``
            is recorded; :meth:`destroy` may be called either way.
        timeout_s: how long a rank waits for its peers (in kernels and on the host) before it
            raises :class:`deepep_cupy.DeepEPTimeoutError`.
        device: the CUDA device id (default: PyTorch's current device for a ProcessGroup,
            otherwise CuPy's current device).
        allocate_ahead: size a fresh dispatch's outputs from the previous dispatch's receive count
            (scaled by the token count, plus 1/8 and 64 rows) so that the transfer starts before
            the host has this call's counts; the arrays returned are exact-size views of those
            allocations. A call that receives more than that is redone with exact sizes (one more
            count exchange), as are the first and one whose guess is above the largest receive
            count seen (the bound on memory allocated ahead: deepep_cupy/intranode/capacity.py). While it
            waits for its counts, a dispatch like the previous one (same arguments' kinds and
            token count) allocates the next one's outputs (up to 512 MiB, held until then), so that
            the next launches its transfer at once. False: every call learns its counts first, in
            a round that moves nothing, then allocates exactly (no spare rows, one count exchange
            more per call).
        ranks_per_node: (internode) split the group into nodes of this many consecutive ranks
            (simulated nodes on one machine; 1: every GPU its own node); default: the environment
            variable ``DEEPEP_CUPY_RANKS_PER_NODE``, else the hosts, with every GPU its own node
            where a host's GPUs cannot map each other's memory (:mod:`deepep_cupy.groups.nodes`).
        internode_transport: (internode) ``"nccl"``, ``"mpi"`` or ``"local"`` (in-process ranks);
            default: ``DEEPEP_CUPY_TRANSPORT``, else chosen from the group
            (:func:`deepep_cupy.transports.make_transport`).

    Attributes:
        group: the group as it was given (the ProcessGroup, communicator or Group).
        topology: the :class:`deepep_cupy.groups.nodes.NodeTopology` of an internode Buffer (else None).
        internode_transport: the name of an internode Buffer's rail transport (else None).
        rank, num_ranks (alias ``group_size``), num_nvl_bytes, num_rdma_bytes, low_latency_mode,
        explicitly_destroy, device_id, timeout_s: the settings.
        last_dispatch_allocation: how the last fresh dispatch sized its outputs: ``"exact"``
            (its counts learned first), ``"ahead"`` (allocated ahead, it fitted), ``"retried"``
            (allocated ahead, too small, redone exactly) or ``"fixed"`` (``num_worst_tokens``).
        last_dispatch_rows_allocated: the received rows the last fresh dispatch (without
            ``num_worst_tokens``) allocated, the most of its rounds.
        last_count_wait_s: seconds the last fresh dispatch's host waited for the receive counts
            (the rest of its host time is Python and driver work).
    """

    #: The SM count of the default configs (DeepEP's ``Buffer.num_sms``), set by :meth:`set_num_sms`.
    num_sms = _DefaultNumSms()

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Any = None, *, timeout_s: float = 100.0, device: Optional[int] = None,
                 allocate_ahead: bool = True, ranks_per_node: Optional[int] = None,
                 internode_transport: Optional[str] = None):
        compat.check_supported(num_rdma_bytes, low_latency_mode=low_latency_mode, allow_mnnvl=allow_mnnvl,
                               use_fabric=use_fabric, enable_shrink=enable_shrink and not low_latency_mode)
        check_settings(num_nvl_bytes, timeout_s, low_latency_mode)
        self.group = compat.resolve_group(group, comm)
        self._group = as_group(self.group)
        self.rank, self.num_ranks = self._group.rank, self._group.size
        self.group_size = self.num_ranks
        self.num_nvl_bytes, self.num_rdma_bytes = int(num_nvl_bytes), int(num_rdma_bytes)
        self.low_latency_mode, self.explicitly_destroy = bool(low_latency_mode), bool(explicitly_destroy)
        self.timeout_s = float(timeout_s)
        self.device_id = compat.resolve_device(device, self._group)
        self._engine: Engine = make_engine(self._group, Settings(
            self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode, bool(enable_shrink), self.timeout_s,
            self.device_id, bool(allocate_ahead), ranks_per_node, internode_transport))

    # -----------------------------------------------------------------------------------------
    # Properties (the engine's)

    @property
    def topology(self):
        """The :class:`deepep_cupy.groups.nodes.NodeTopology` of an internode Buffer (else None)."""
        return self._engine.topology

    @property
    def internode_transport(self) -> Optional[str]:
        """The name of an internode Buffer's rail transport (else None)."""
        return self._engine.internode_transport

    @property
    def allocate_ahead(self) -> bool:
        return self._engine.allocate_ahead

    @allocate_ahead.setter
    def allocate_ahead(self, value: bool) -> None:
        self._engine.allocate_ahead = value

    @property
    def last_dispatch_allocation(self) -> Optional[str]:
        return self._engine.last_dispatch_allocation

    @property
    def last_dispatch_rows_allocated(self) -> Optional[int]:
        return self._engine.last_dispatch_rows_allocated

    @property
    def last_count_wait_s(self) -> float:
        return self._engine.last_count_wait_s

    @property
    def last_internode_rows(self) -> int:
        """Rows that left this rank for other nodes in the last dispatch (internode Buffers)."""
        return self._engine.last_internode_rows

    @property
    def comm_stream(self):
        """The ``cupy.cuda.Stream`` the Buffer's kernels run on."""
        return self._engine.comm_stream

    def get_comm_stream(self):
        """The communication stream as DeepEP returns it: a ``torch.cuda.Stream`` naming
        :attr:`comm_stream` (that stream itself, CuPy's, where PyTorch is not installed)."""
        return compat.torch_stream_of(self._engine.comm_stream, self.device_id)

    # -----------------------------------------------------------------------------------------
    # DeepEP's static names

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set :attr:`num_sms`, the SM count of the default configs of every Buffer (DeepEP's name).

        After this call, :meth:`get_dispatch_config` and :meth:`get_combine_config` (and every
        call made without ``config``) use ``new_num_sms`` with the recommended chunk sizes.

        Raises:
            ValueError: not a positive even int.
        """
        config.set_default_num_sms(new_num_sms)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The default dispatch config for ``num_ranks`` ranks: :func:`deepep_cupy.get_dispatch_config`,
        with :attr:`num_sms` once :meth:`set_num_sms` was called."""
        return config.default_config("dispatch", num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The default combine config for ``num_ranks`` ranks (see :meth:`get_dispatch_config`)."""
        return config.default_config("combine", num_ranks)

    @staticmethod
    def capture(stream: Any = None) -> EventOverlap:
        """An event recorded now on the current stream, to pass as ``previous_event`` (see
        :func:`deepep_cupy.compat.capture` for which stream)."""
        return compat.capture(stream)

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: the kernels are compiled at run time for the GPU in use (DeepEP's name; FP8 works)."""
        return True

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` for a low-latency Buffer (DeepEP's name):
        :func:`deepep_cupy.low_latency.path.get_low_latency_rdma_size_hint`."""
        return get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    # -----------------------------------------------------------------------------------------
    # Operations

    def check_kernel_errors(self) -> None:
        """Raise what the Buffer's kernels reported (a timeout, ranks that disagree), if anything.

        Every operation does this first; call it after waiting for an asynchronous call to learn
        of its failure without starting another one.
        """
        self._engine.check_kernel_errors()

    def get_dispatch_layout(self, topk_idx, num_experts: int, previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Count, per rank and per expert, the tokens routed by ``topk_idx``.

        Args:
            topk_idx: int64 ``[num_tokens, num_topk]``, expert ids in ``[0, num_experts)`` or -1.
                Ids out of that range are not counted here (no host synchronisation is spent on
                checking them); the dispatch that uses them raises ``ValueError`` on every rank.
            num_experts: experts in total, a multiple of the rank count.
            previous_event, async_finish, allocate_on_comm_stream: as for :meth:`dispatch`.

        Returns:
            ``(num_tokens_per_rank int32 [R], None, num_tokens_per_expert int32 [E],
            is_token_in_rank bool [num_tokens, R], event)``. The ``None`` stands where DeepEP returns
            its RDMA counts (internode only).
        """
        return self._engine.get_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                                allocate_on_comm_stream)

    def dispatch(self, x, handle: Optional[DispatchHandle] = None, num_tokens_per_rank=None,
                 num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, *, expand: bool = False,
                 recv_x_in_buffer: bool = False):
        """Send each token once to every rank that owns one of its experts.

        Args:
            x: ``[num_tokens, hidden]`` BF16 (CuPy uint16 bits / torch.bfloat16), FP16 or FP32; or
                ``(x_fp8 [num_tokens, hidden] uint8 / torch.float8_e4m3fn, x_scales float32
                [num_tokens, hidden // 128] or [num_tokens])``. Row bytes must be a multiple of 16.
            handle: a handle from an earlier dispatch with the same routing (cached mode: the
                layout arguments and top-k are not needed and not returned).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from
                :meth:`get_dispatch_layout` (int32 [R], bool [num_tokens, R], int32 [E]).
            num_tokens_per_rdma_rank: DeepEP's internode counts: accepted (not read) on an internode
                Buffer; on one node None (what :meth:`get_dispatch_layout` returns in its place).
            topk_idx: int64 ``[num_tokens, num_topk]`` or None; topk_weights: float32, same shape.
            expert_alignment: round each local expert's receive count up to a multiple of this.
            num_worst_tokens: 0, or the most tokens this rank can receive (fresh dispatch only):
                a dispatch that never waits for the host, as DeepEP's, and that a CUDA graph can
                capture. The outputs have exactly that many rows; rows past the received ones have
                ``recv_topk_idx`` -1 (other outputs unwritten there); the expert counts come back
                as an empty list (DeepEP's) and, with the received row count, as device arrays
                ``handle.recv_expert_counts`` and ``handle.recv_count``; ``combine`` takes x with
                that many rows. Nothing is checked on the host after the launch: when a rank
                receives more (or the ranks disagree, or an expert id is out of range) every rank
                moves nothing, the handle's counts are 0, the cached dispatches and combines using
                it move nothing, and the next call of the Buffer, or
                :meth:`check_kernel_errors` once the GPU got there, raises ``ValueError``
                (``RankMismatchError`` for settings) on every rank; the Buffer stays usable.
                (Across nodes with one rank per node, the rank that received more keeps the first
                ``num_worst_tokens`` rows; the next call raises all the same.)
            config: :class:`Config` (default: :func:`get_dispatch_config`).
            previous_event: make the communication wait for this event instead of the caller's stream.
            async_finish: return an event instead of making the caller's stream wait.
            allocate_on_comm_stream: allocate outputs on the communication stream.
            expand: (fresh dispatch with ``topk_idx``, without ``num_worst_tokens``) return the
                rows grouped per local expert, the layout a grouped GEMM reads: group ``e`` holds a
                copy of received row ``i`` for every top-k entry of ``i`` naming ``e`` (in the
                order of ``i``, then of the entry), then zero rows up to a multiple of
                ``expert_alignment``; the groups follow each other in expert order, their sizes
                are the returned expert counts. ``handle.expert_offsets`` (a list of local experts
                + 1 ints) says where each group starts and ``handle.expanded_rows`` (int32, one
                per expanded row) which received row it copies (-1 for padding); ``combine`` still
                takes one row per received token (``handle.num_recv_tokens``).
            recv_x_in_buffer: return ``recv_x``, its scales and the top-k outputs as views of this
                rank's NVLink buffer, into which every rank writes each token straight into its
                row: no SM copies rows out and every one of ``config.num_sms`` writes rows (with
                enough SMs some only this rank's own: ``config.peer_blocks_in_place``), so that
                few SMs reach the links' rate (docs/PERFORMANCE.md). The views are valid until the
                next dispatch or combine of this Buffer (copy them to keep them longer, e.g. for a
                backward pass) and must not be written, but for ``recv_x`` overwritten with the
                rows to combine (:meth:`combine` then reads them where they lie); passing one to
                any other call of this Buffer raises ``ValueError``. Every rank must pass the same
                value (``RankMismatchError``). The Buffer needs
                ``get_nvl_buffer_size_hint(..., recv_x_in_buffer=True)`` bytes for as many tokens;
                ``num_worst_tokens`` (or a handle's rows) beyond what it holds raise ``ValueError``.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
            event)``: ``recv_x`` like ``x`` (a tuple for FP8), rows grouped by source rank and in
            source order; ``recv_topk_idx`` int64 with local expert ids (-1 elsewhere) and
            ``recv_topk_weights`` float32 (0 where the id is -1), both None without top-k;
            the expert counts as a Python list (None in cached mode).
        """
        return self._engine.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                     num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                     config, previous_event, async_finish, allocate_on_comm_stream, expand=expand,
                                     recv_x_in_buffer=recv_x_in_buffer)

    def combine(self, x, handle: DispatchHandle, topk_weights=None, bias=None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Send every received token back to its owner, which sums the copies.

        Args:
            x: ``[num_recv_tokens, hidden]`` BF16/FP16/FP32, rows in the receive order of the
                dispatch that made ``handle``. When that dispatch wrote its rows in place
                (``recv_x_in_buffer``), x may be its ``recv_x`` overwritten with rows of x's type
                (for instance the experts' outputs written there): then nothing is sent, every
                SM reduces, and each rank reads the others' rows where they lie (every rank must
                do so: ``RankMismatchError`` otherwise). A cached dispatch in place with the
                handle leaves its rows there too; once another dispatch, or a combine that sends,
                has overwritten them, x there raises ``ValueError``.
            handle: the handle returned by that dispatch.
            topk_weights: float32 ``[num_recv_tokens, num_topk]`` or None; summed like ``x``. With
                x in place: None or that dispatch's ``recv_topk_weights`` (read where it lies).
            bias: None, an array, or a pair of arrays (entries may be None), each ``[num_tokens,
                hidden]`` of x's dtype (num_tokens: the tokens of the handle's dispatch on this
                rank), added to the combined rows before the received copies.
            config: :class:`Config` with the dispatch's ``num_sms`` (default: :func:`get_combine_config`).
            previous_event, async_finish, allocate_on_comm_stream: as for :meth:`dispatch`.

        Returns:
            ``(combined_x [num_tokens, hidden] like x, combined_topk_weights float32 or None, event)``:
            ``combined_x[t]`` is the float32 sum of the biases, then over the ranks the token went
            to in ascending order of their rows, rounded to x's dtype (0 for tokens sent nowhere
            without bias).
        """
        return self._engine.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                    allocate_on_comm_stream)

    def barrier(self) -> None:
        """A device-side barrier of all ranks on the communication stream; the host waits for it."""
        self._engine.barrier()

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Send each token to the owner of each of its experts, packed per expert (decode).

        Args:
            x: BF16 ``[num_tokens, hidden]``, ``num_tokens <= num_max_dispatch_tokens_per_rank``
                (the same on every rank); hidden a multiple of 8 (of 128 for FP8, 512 for UE8M0).
            topk_idx: int64 ``[num_tokens, num_topk]``, expert ids or -1; a token names an expert at
                most once. Ids outside ``[-1, num_experts)`` are sent nowhere and make the next
                call raise ``ValueError``.
            cumulative_local_expert_recv_stats: None or int32 ``[num_local_experts]``: each
                expert's received rows are added to it.
            dispatch_wait_recv_cost_stats: None or int64 ``[num_ranks]``: per source rank, the
                clock64 cycles this rank's receive waited for its counts are added, summed over the
                local experts (DeepEP's wait_recv_cost).
            use_fp8: cast to FP8 e4m3 in the kernel, with a float32 scale per 128 channels
                (``amax * (1 / 448)`` as DeepEP computes it, amax of the group floored at 1e-4).
            round_scale: round each scale up to a power of two; use_ue8m0: and return them as
                packed exponent bytes (implies round_scale).
            async_finish: return an event instead of making the current stream wait.
            return_recv_hook: issue only the send; ``hook()`` issues the receive (on the stream
                current then). Two calls may be in flight (send, send, hook, hook); hooks must run
                in the order of their calls, and a call without a hook is refused while a hook of
                its op is not called yet (``ValueError``).

        Returns:
            ``(recv_x, recv_count, handle, event, hook)``: recv_x BF16 ``[L, R * M, hidden]`` or
            ``(fp8 [L, R * M, hidden], scales)`` with scales float32 ``[L, R * M, hidden // 128]``
            (column-major: a transposed view) or int32 ``[L, R * M, hidden // 512]`` (UE8M0, 4
            exponent bytes per int); recv_count int32 ``[L]``; rows of expert ``l``: source rank 0's
            tokens first, then rank 1's ..., each by source token index; ``handle`` (DeepEP's
            tuple: src_info int32 ``[L, R * M]``, layout_range int64 ``[L, R]`` = begin << 32 |
            count, M, hidden, num_experts); ``hook`` is None without return_recv_hook.
        """
        return self._engine.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                                 cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                                 use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False,
                            out=None, combine_wait_recv_cost_stats=None):
        """Send each expert's rows back and sum them per token with their weights (decode).

        Args:
            x: BF16 ``[L, R * M, hidden]`` in the layout of the dispatch that gave ``handle``.
            topk_idx, topk_weights: that dispatch's routing (int64) and float32 weights
                ``[num_tokens, num_topk]``.
            use_logfmt: send the rows LogFMT-compressed (DeepEP's LogFMT-10; hidden a multiple of 512).
            zero_copy: send the rows written into :meth:`get_next_low_latency_combine_buffer`
                instead of ``x`` (then only checked for shape).
            async_finish, return_recv_hook: as for :meth:`low_latency_dispatch`.
            out: None or BF16 ``[num_tokens, hidden]`` to write into.
            combine_wait_recv_cost_stats: None or int64 ``[num_ranks]``, as dispatch's.

        Returns:
            ``(combined_x, event, hook)``: combined_x[t] = sum over k (in order, ids != -1) of
            ``topk_weights[t, k] * row of (t, topk_idx[t, k])``, in float32, rounded to BF16.
        """
        return self._engine.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                                return_recv_hook, out, combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle):
        """BF16 ``[L, R * M, hidden]``, a view of this rank's low-latency buffer: write the expert
        outputs there and call :meth:`low_latency_combine` with ``zero_copy=True``."""
        return self._engine.get_next_low_latency_combine_buffer(handle)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (or unmask) a rank for this rank's decode calls (``enable_shrink=True``; DeepEP's)."""
        self._engine.low_latency_update_mask_buffer(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status) -> None:
        """Write this rank's mask into int32 ``mask_status[num_ranks]`` (1: masked; DeepEP's)."""
        self._engine.low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (``enable_shrink=True``; DeepEP's)."""
        self._engine.low_latency_clean_mask_buffer()

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        """This rank's NVLink buffer (or with ``use_rdma_buffer`` its low-latency one) as ``dtype`` (DeepEP's)."""
        return self._engine.get_local_buffer_tensor(dtype, size, offset, use_rdma_buffer)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency signal words and call counters on every rank (collective; the host
        waits for this rank's calls first). Not needed between calls: the signals carry epochs."""
        self._engine.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def destroy(self) -> None:
        """Free the NVLink buffer, unmap the peers' and free the host counters (idempotent).

        Every rank must call it (it ends with a group barrier only when the Buffer was complete).
        It first waits for this Buffer's kernels, whatever streams its calls ran on, and it is the
        way out after a timeout: it does not raise because a call or a kernel failed, and a new
        Buffer on the same communicator works afterwards (docs/FAILURES.md, "After a timeout").
        """
        self._engine.destroy()

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __del__(self):  # pragma: no cover - a safety net; destroy() is the contract
        engine = self.__dict__.get("_engine")
        if engine is not None:
            try:
                engine.release()
            except Exception:
                pass
