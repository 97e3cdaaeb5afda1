"""The host-mapped slots through which kernels hand small results and errors to the host.

Each Buffer owns a few hundred int32 in pinned host memory mapped into the device's address
space (``cudaHostAlloc(..., Mapped)``). Kernels write them with system-scope stores; the host
reads them through a NumPy view, without any CUDA call:

    [ERROR_RECORD, +8)   the first kernel error: code, kernel id, rank, channel, peer, detail
                         (kernels/common.cuh); 0 in [0] means none
    RECV_COUNT           tokens this rank receives in the running fresh dispatch (-1 until known)
    VERDICT              notify_dispatch's verdict on the call (0: go ahead, see below)
    [EXPERT_COUNTS, ...) tokens this rank receives per local expert (rounded up to the alignment)

(A dispatch with ``num_worst_tokens`` publishes its counts and verdict into its handle instead,
on the device; a refusal then reaches the host through the error record.)

Verdicts: 0 all ranks agree; ``p + 1`` rank p's settings differ from rank 0's; ``-(p + 1)``
rank p's expert ids are out of range; :data:`VERDICT_OVER_CAPACITY` a rank receives more than
the rows its host allocated ahead; :data:`VERDICT_BUFFER_TOO_SMALL` a rank sends another more
tokens than a transfer region of the NVLink buffer holds; from :data:`VERDICT_HOST_FAILED` on,
rank p's host failed before the call and took part only to refuse it (:func:`host_failure`).

This module also turns an error record into the exception the host raises.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Optional, Sequence

import numpy as np

from ..constants import (
    ERROR_BAD_EXPERT_ID,
    ERROR_BUFFER_TOO_SMALL,
    ERROR_DISPATCH_REFUSED,
    ERROR_HOST_FAILED,
    ERROR_MISMATCH,
    ERROR_PEER_ABORTED,
    HOST_FAILED_ALLOCATION,
    HOST_FAILED_EXCEPTION,
    HOST_FAILED_INTERRUPT,
    HOST_FAILURE_FLAG,
    HOST_FAILURES,
    KERNEL_STAGES,
    MAX_LOCAL_EXPERTS,
    SIGNATURE_INTS,
    SIGNATURE_ROWS_IN_BUFFER,
    VERDICT_BUFFER_TOO_SMALL,
    VERDICT_HOST_FAILED,
    VERDICT_OVER_CAPACITY,
)
from ..errors import (
    DeepEPError,
    DeepEPTimeoutError,
    PeerAbortedError,
    PeerFailedError,
    RankMismatchError,
)

ERROR_RECORD = 0
ERROR_RECORD_INTS = 8
RECV_COUNT = 8
VERDICT = 9
EXPERT_COUNTS = 16
SLOT_INTS = EXPERT_COUNTS + MAX_LOCAL_EXPERTS
#: Count polls that only yield the GIL; after them (long past any dispatch) each poll also sleeps.
YIELDING_POLLS = 100_000
POLL_SLEEP_S = 1e-4
#: Polls between two looks at the clock.
POLLS_PER_CLOCK_CHECK = 1024
#: How to make room for more tokens per rank.
BUFFER_ADVICE = ("create the Buffer with deepep_cupy.get_nvl_buffer_size_hint(hidden_bytes, num_ranks, "
                 "num_max_tokens_per_rank=...) bytes for the tokens a rank dispatches")
#: What every rank must do once a Buffer is unusable (docs/FAILURES.md, "After a timeout").
RECOVERY = ("The Buffer is unusable: destroy it on every rank (buffer.destroy()) and create a new one on the "
            "same communicator")

SIGNATURE_FIELDS = ("row bytes", f"top-k (x2, +1 with weights, +{SIGNATURE_ROWS_IN_BUFFER} with recv_x_in_buffer)",
                    "scales per token", "num_experts", "num_sms", "num_max_nvl_chunked_send_tokens",
                    "num_max_nvl_chunked_recv_tokens")
assert len(SIGNATURE_FIELDS) == SIGNATURE_INTS - 1


class MappedInts:
    """``count`` int32 in pinned host memory that kernels read and write directly.

    ``values`` is a NumPy view the host reads without any CUDA call; ``device_ptr(i)`` is the
    address of entry ``i`` for kernels (unified addressing makes it the host address).
    """

    def __init__(self, count: int):
        from cupy.cuda import runtime

        self._ptr = runtime.hostAlloc(count * 4, runtime.hostAllocMapped | runtime.hostAllocPortable)
        self._values: Optional[np.ndarray] = np.ctypeslib.as_array(
            (ctypes.c_int32 * count).from_address(self._ptr))
        self._values[:] = 0

    @property
    def values(self) -> np.ndarray:
        """The ints, a view of the pinned memory (gone with it: no read after :meth:`free`)."""
        if self._values is None:
            raise DeepEPError("deepep_cupy: mapped host ints read after they were freed")
        return self._values

    def device_ptr(self, index: int) -> int:
        return self._ptr + 4 * index

    def free(self) -> None:
        if self._ptr:
            from cupy.cuda import runtime

            self._values = None
            runtime.freeHost(self._ptr)
            self._ptr = 0


def host_failure_code(failure: BaseException, before_launch: bool = True) -> int:
    """The ``constants.HOST_FAILURES`` code of an exception a host met in a call: an interrupt;
    else, before the call's launch (where the host only allocates its outputs), a failed
    allocation, and after it any exception."""
    if isinstance(failure, KeyboardInterrupt):
        return HOST_FAILED_INTERRUPT
    if before_launch and isinstance(failure, Exception):
        return HOST_FAILED_ALLOCATION
    return HOST_FAILED_EXCEPTION


def refused_before_launch(failure: BaseException, rank: int,
                          who_raises: str = "every rank raises PeerFailedError at its next call, this one too") -> None:
    """Note on ``failure`` (Python 3.11 on) that this rank took part in its call only to refuse it."""
    if hasattr(failure, "add_note"):
        failure.add_note(f"deepep_cupy: rank {rank} took part in this call only to refuse it: no tokens moved on any "
                         f"rank, {who_raises}, and the Buffer stays usable")


def host_failure(verdict: int):
    """``(rank, what failed)`` of a :data:`VERDICT_HOST_FAILED` verdict, else None."""
    if verdict < VERDICT_HOST_FAILED:
        return None
    failed = verdict - VERDICT_HOST_FAILED
    code = failed % HOST_FAILURE_FLAG
    return failed // HOST_FAILURE_FLAG, HOST_FAILURES.get(code, f"host failure {code}")


#: Stages whose records name the peer by its Buffer rank already: the rail peer lives on another
#: node, outside the node's group that the recording kernel runs in.
PEER_NAMED_BY_BUFFER_RANK = frozenset(k for k, stage in KERNEL_STAGES.items() if stage == "rail block exchange")


def buffer_rank(names: Sequence[int], rank: int) -> int:
    """The Buffer's rank of rank ``rank`` of the slots' group (``names``: see :class:`HostSlots`);
    a rank outside it (a peer already named by its Buffer rank, or -1) is returned as it is."""
    return names[rank] if 0 <= rank < len(names) else rank


def peer_failed_error(rank: int, peer: int, what: str, operation: str, after: str) -> PeerFailedError:
    """What a rank raises for a call that rank ``peer``'s host refused (``what`` failed there)."""
    return PeerFailedError(f"rank {rank}: {operation} was refused on every rank because the host of rank {peer} "
                           f"failed before it could take part ({what}){after}", peer=peer, failure=what)


def kernel_error(record, timeout_s: float, names: Sequence[int] = ()) -> Optional[Exception]:
    """The exception an error record stands for, or None when it records nothing.

    ``names``: the Buffer's rank of each rank of the group whose kernels wrote the record (a node's
    group under a Buffer across nodes), so that messages name the ranks the user knows.

    A settings disagreement (every rank stopped before moving anything and the queues were reset)
    gives a :class:`RankMismatchError`, a refused dispatch that the host did not wait for what
    :func:`verdict_error` gives for its verdict; after those the Buffer stays usable. Anything else
    is a :class:`DeepEPTimeoutError` after which it is not: a :class:`PeerAbortedError` when this
    rank stopped because another rank had given up on the Buffer before.
    """
    code = int(record[0])
    if code <= 0:
        return None
    stage = KERNEL_STAGES.get(int(record[1]), f"kernel {int(record[1])}")
    where_rank, channel, peer, detail = (int(v) for v in record[2:6])
    if code == ERROR_DISPATCH_REFUSED:
        return refused_dispatch_error(detail, buffer_rank(names, where_rank), names)
    where_rank = buffer_rank(names, where_rank)
    if int(record[1]) not in PEER_NAMED_BY_BUFFER_RANK:
        peer = buffer_rank(names, peer)
    if code == ERROR_HOST_FAILED:
        operation = "the last combine" if "combine" in stage else "the last cached dispatch"
        return peer_failed_error(where_rank, peer, HOST_FAILURES.get(detail, f"host failure {detail}"), operation,
                                 "; no tokens were moved and its outputs are unwritten. Every rank raises this at its "
                                 "next call, the failing one too; the Buffer stays usable")
    if code == ERROR_BAD_EXPERT_ID:
        return ValueError(f"topk_idx: rank {where_rank} passed expert ids outside [-1, num_experts) (such as "
                          f"{detail}) to a low_latency_dispatch (this call, or an earlier one the host did not "
                          "wait for); those entries were sent nowhere. The Buffer stays usable")
    if code == ERROR_BUFFER_TOO_SMALL:
        operation = "combine" if "combine" in stage else "cached dispatch"
        return ValueError(f"num_nvl_bytes: the last {operation} was refused on every rank: its handle has a rank "
                          f"send {detail} tokens to another, more than a transfer region of this Buffer holds for "
                          f"its rows; {BUFFER_ADVICE}. No tokens were moved and its outputs are unwritten")
    if code == ERROR_MISMATCH:
        operation = "combine" if "combine" in stage else "cached dispatch"
        return RankMismatchError(
            f"rank {where_rank}: the last {operation} was called with settings that differ between rank "
            f"{buffer_rank(names, 0)} and rank {peer} (compared: operation, row bytes, scales per token or "
            "element type and top-k, num_sms, chunk sizes, recv_x_in_buffer); no tokens were moved and its outputs "
            "are unwritten")
    where = f"channel {channel}" if channel >= 0 else "whole rank"
    channel_or_none = None if channel < 0 else channel
    if code == ERROR_PEER_ABORTED:
        reason = int(record[6])
        why = (f"its host failed during a call ({HOST_FAILURES.get(reason, reason)})" if reason
               else "a wait of its timed out: a rank came late or not at all")
        return PeerAbortedError(
            f"rank {where_rank}: {stage} stopped ({where}) because rank {peer} had given up on this Buffer "
            f"earlier ({why}); the call's outputs are not valid. {RECOVERY}", rank=where_rank, kernel=stage,
            channel=channel_or_none, peer=peer)
    return DeepEPTimeoutError(
        f"rank {where_rank}: {stage} timed out after {timeout_s:g} s waiting for rank {peer} ({where}, detail "
        f"{detail}); a peer did not join or died. {RECOVERY}", rank=where_rank, kernel=stage,
        channel=channel_or_none, peer=peer)


def refused_dispatch_error(verdict: int, rank: int, names: Sequence[int] = ()) -> Exception:
    """What a dispatch with ``num_worst_tokens`` raises, at the host's next check, when every rank
    refused it (``verdict``: notify_dispatch's; ``names``: as :func:`kernel_error` takes them)."""
    after = ("; no tokens were moved, and the cached dispatches and combines that used its handle moved "
             "nothing (their outputs are not valid). The Buffer stays usable")
    if verdict == VERDICT_OVER_CAPACITY:
        return ValueError(f"num_worst_tokens: in an earlier dispatch that the host did not wait for, a rank "
                          f"received more tokens than num_worst_tokens{after}")
    failed = host_failure(verdict)
    if failed is not None:
        return peer_failed_error(rank, buffer_rank(names, failed[0]), failed[1],
                                 "an earlier dispatch that the host did not wait for", after)
    if verdict == VERDICT_BUFFER_TOO_SMALL:
        return ValueError(f"num_nvl_bytes: in an earlier dispatch that the host did not wait for, a rank sent "
                          f"another more tokens than a transfer region of this Buffer holds ({BUFFER_ADVICE}){after}")
    if verdict < 0:
        return ValueError(f"topk_idx: in an earlier dispatch with num_worst_tokens (the host did not wait for "
                          f"it), rank {buffer_rank(names, -verdict - 1)} passed expert ids outside "
                          f"[-1, num_experts){after}")
    return RankMismatchError(
        f"rank {rank}: in an earlier dispatch with num_worst_tokens (the host did not wait for it), the "
        f"settings differ between rank {buffer_rank(names, 0)} and rank {buffer_rank(names, verdict - 1)} "
        f"(compared: {', '.join(SIGNATURE_FIELDS)}){after}")


def verdict_error(verdict: int, rank: int, num_experts: int, signature, bad_ids=None,
                  names: Sequence[int] = ()) -> Optional[Exception]:
    """The exception a fresh dispatch raises for notify_dispatch's ``verdict`` (None for 0).

    ``rank``: this rank of the dispatching group; ``bad_ids``: a few of this rank's out-of-range
    expert ids, when it is the rank at fault; ``names``: as :func:`kernel_error` takes them.
    """
    rank = buffer_rank(names, rank)
    if verdict == 0 or verdict == VERDICT_OVER_CAPACITY:
        return None
    failed = host_failure(verdict)
    if failed is not None:
        return peer_failed_error(rank, buffer_rank(names, failed[0]), failed[1], "this dispatch",
                                 "; no tokens were moved, and the Buffer stays usable")
    if verdict == VERDICT_BUFFER_TOO_SMALL:
        return ValueError(f"num_nvl_bytes: a rank sends another more tokens than a transfer region of this Buffer "
                          f"holds for these rows; {BUFFER_ADVICE}. No tokens were moved")
    if verdict < 0:
        bad_rank = buffer_rank(names, -verdict - 1)
        detail = f": values such as {bad_ids}" if bad_ids else ""
        return ValueError(f"topk_idx: rank {bad_rank} passed expert ids outside [-1, {num_experts}){detail}; "
                          "no tokens were moved")
    return RankMismatchError(
        f"rank {rank}: dispatch settings differ between rank {buffer_rank(names, 0)} and rank "
        f"{buffer_rank(names, verdict - 1)} (compared: "
        f"{', '.join(SIGNATURE_FIELDS)}); mine are {list(signature)}; no tokens were moved")


class HostSlots:
    """A Buffer's mapped slots and the protocol around them.

    Args:
        rank: this rank of the group whose kernels write the slots.
        timeout_s: how long a host wait lasts before it gives up (the kernels' own deadline
            comes first; see :meth:`wait_for_count`).
        in_process: ranks are threads of this process (waits then go through an event).
        names: the Buffer's rank of each rank of that group, by which messages name them (a
            node's group under a Buffer across nodes); empty: the group is the Buffer's.
    """

    def __init__(self, rank: int, timeout_s: float, in_process: bool, mapped=None, names: Sequence[int] = ()):
        self.names = tuple(names)
        #: This rank as messages name it: its Buffer rank.
        self.rank = buffer_rank(self.names, rank)
        self.timeout_s = timeout_s
        self.in_process = in_process
        self.mapped = mapped if mapped is not None else MappedInts(SLOT_INTS)
        self.values = self.mapped.values
        self.failed: Optional[str] = None
        #: Seconds the last :meth:`wait_for_count` waited.
        self.last_wait_s = 0.0

    def device_ptr(self, index: int) -> int:
        return self.mapped.device_ptr(index)

    def free(self) -> None:
        self.mapped.free()
        self.values = None

    def raise_if_failed(self) -> None:
        """Raise what the kernels recorded since the last check, or the reason the Buffer died."""
        if self.failed is not None:
            raise DeepEPError(f"rank {self.rank}: Buffer unusable: {self.failed}")
        if self.values[ERROR_RECORD] > 0:
            self._raise_record()

    def _raise_record(self) -> None:
        record = self.values[ERROR_RECORD:ERROR_RECORD + ERROR_RECORD_INTS]
        error = kernel_error(record, self.timeout_s, self.names)
        if error is None:   # the record holds no error (callers look at its code first)
            return
        if not isinstance(error, DeepEPTimeoutError):
            record[:] = 0  # reported once: nothing was moved, so the next call may go ahead
        else:
            self.failed = str(error)
        raise error

    def start_dispatch(self) -> None:
        """Clear the count and verdict slots before a dispatch whose host waits for them."""
        values = self.values
        values[RECV_COUNT] = -1
        values[VERDICT] = 0

    def wait_for_count(self, kernel_done=None) -> int:
        """Wait until notify_dispatch publishes the receive count; raise a kernel error or a timeout.

        Separate processes poll the slot, giving up the GIL between reads (``os.sched_yield``
        releases it), so other Python threads of the process keep running; ``time.sleep(0)`` would
        cost a timer slack (~50 us) per read. In-process ranks first wait on
        ``kernel_done`` (an event recorded after notify_dispatch) in the driver: a thread polling
        with the GIL gets it back before a peer thread wakes up, so a peer that still has to
        launch its half of the exchange could be kept waiting a whole switch interval.
        """
        start = time.perf_counter()
        if kernel_done is not None and self.in_process:
            kernel_done.synchronize()
        values = self.values
        value = self._published_count()
        if value >= 0:
            self.last_wait_s = time.perf_counter() - start
            return value
        # The device reports its own timeout first (it names the stage and the peer).
        deadline = time.monotonic() + self.timeout_s + 1.0
        yield_gil = os.sched_yield
        polls = 0
        while True:
            value = self._published_count()
            if value >= 0:
                self.last_wait_s = time.perf_counter() - start
                return value
            if values[ERROR_RECORD] > 0:
                self._raise_record()
            if polls < YIELDING_POLLS:
                yield_gil()
            else:  # long past any dispatch: stop burning a core
                time.sleep(POLL_SLEEP_S)
            polls += 1
            if polls % POLLS_PER_CLOCK_CHECK == 0 and time.monotonic() > deadline:
                self.failed = "a host wait timed out"
                raise DeepEPTimeoutError(
                    f"rank {self.rank}: waited {self.timeout_s:g} s on the host for notify_dispatch to publish "
                    "the receive counts", rank=self.rank, kernel="host wait")

    def _published_count(self) -> int:
        """The receive count notify_dispatch published (-1 until then). A count is no result when a
        kernel has already recorded a failure (a rank gave up on the Buffer, or the transfer
        launched behind the count exchange failed): that failure is raised instead."""
        value = int(self.values[RECV_COUNT])
        if value >= 0 and self.values[ERROR_RECORD] > 0:
            self._raise_record()
        return value

    def verdict(self) -> int:
        return int(self.values[VERDICT])

    def expert_counts(self, num_local_experts: int) -> list:
        return self.values[EXPERT_COUNTS:EXPERT_COUNTS + num_local_experts].tolist()

