"""In-process groups: one Python process drives every rank, one thread per rank.

:class:`ThreadGroup` is the :class:`deepep_cupy.groups.group.Group` of such ranks (collectives through
a shared hub instead of a transport), and :func:`run_local_group` runs a function on every rank's
thread, each with its GPU and stream (ranks sharing a GPU allocate from that GPU's pool:
:mod:`deepep_cupy.gpu.device_pools`), aborting the group as soon as one rank raises and raising
:class:`deepep_cupy.RankFailed`.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, NoReturn, Optional, Sequence, Tuple, Type

import numpy as np

from ..errors import (
    DeepEPError,
    DeepEPTimeoutError,
    GpuUnavailableError,
    GroupAbortedError,
    RankFailed,
    RankMismatchError,
)
from ..gpu import check as gpu_check
from ..gpu.device_pools import allocator_for
from ..gpu.sm_budget import check_sm_budget
from .group import Group

#: How long a rank of a :class:`ThreadGroup` waits in a collective for the others by default.
DEFAULT_THREAD_TIMEOUT_S = 300.0


class _Hub:
    """State shared by the ranks of one thread group: a reusable barrier and the allgather slots.

    The barrier is generation-counted (a rank can re-enter it at once without mixing rounds),
    records which ranks have arrived (to name the missing ones on a timeout), checks that all
    ranks are in the same collective, and can be broken: every rank waiting in it, or arriving
    later, then raises the reason (:class:`GroupAbortedError` after an abort,
    :class:`DeepEPTimeoutError` after a timeout, :class:`RankMismatchError` for mismatched
    collectives). Waits block on a condition variable (no GIL-holding spin).
    """

    def __init__(self, size: int, devices: Sequence[Optional[int]], timeout_s: float):
        if size < 1:
            raise ValueError(f"num_ranks: expected at least 1 rank, got {size}")
        if len(devices) != size:
            raise ValueError(f"devices: expected one entry per rank ({size}), got {len(devices)}")
        _check_timeout(timeout_s)
        self.size = size
        self.devices = list(devices)
        self.timeout_s = float(timeout_s)
        self._cond = threading.Condition()
        self._generation = 0
        self._arrived: Dict[int, str] = {}     # rank -> name of the collective it is waiting in
        self._slots: List[Any] = [None] * size
        self._broken: Optional[Tuple[Type[Exception], str]] = None     # (what to raise, why)
        self._children: List["_Hub"] = []    # hubs of sub-groups (ThreadGroup.split): aborted with this one
        self._parent: Optional["_Hub"] = None

    def make_children(self, parts: Sequence[Sequence[int]]) -> List["_Hub"]:
        """One hub per part (ranks of this hub), with the devices and timeout of its ranks here."""
        children = [_Hub(len(part), [self.devices[r] for r in part], self.timeout_s) for part in parts]
        for child in children:
            child._parent = self
        with self._cond:
            self._children.extend(children)
            broken = self._broken
        if broken is not None:
            for child in children:
                child.abort(broken[1], broken[0])
        return children

    def forget_child(self, child: "_Hub") -> None:
        with self._cond:
            if child in self._children:
                self._children.remove(child)

    @property
    def broken(self) -> Optional[str]:
        """Why the group was aborted, or None."""
        return None if self._broken is None else self._broken[1]

    def abort(self, reason: str, error_type: Type[Exception] = GroupAbortedError) -> None:
        """Break the group: every rank in (or later entering) a collective raises ``reason``."""
        with self._cond:
            if self._broken is None:
                self._broken = (error_type, reason)
            self._cond.notify_all()
            children = list(self._children)
        for child in children:
            child.abort(reason, error_type)

    def _raise_broken(self, rank: int, what: str, broken: Tuple[Type[Exception], str]) -> NoReturn:
        error_type, reason = broken
        verb = "timed out" if error_type is DeepEPTimeoutError else "aborted"
        raise error_type(f"rank {rank}: {what} of the in-process group {verb}: {reason}")

    def wait(self, rank: int, what: str, timeout_s: Optional[float]) -> None:
        timeout_s = self.timeout_s if timeout_s is None else _check_timeout(timeout_s)
        with self._cond:
            if self._broken is not None:
                self._raise_broken(rank, what, self._broken)
            if rank in self._arrived:  # pragma: no cover - two threads share one rank's group
                self._broken = broken = (DeepEPError, f"rank {rank} entered {what} twice (one ThreadGroup per thread)")
                self._cond.notify_all()
                self._raise_broken(rank, what, broken)
            others = set(self._arrived.values())
            if others and others != {what}:
                first = min(self._arrived)
                self._broken = broken = (RankMismatchError, f"rank {rank} called {what} while rank {first} is in "
                                                            f"{self._arrived[first]} (every rank must call the same "
                                                            "collectives in the same order)")
                self._cond.notify_all()
                self._raise_broken(rank, what, broken)
            generation = self._generation
            self._arrived[rank] = what
            if len(self._arrived) == self.size:
                self._arrived = {}
                self._generation += 1
                self._cond.notify_all()
                return
            deadline = time.monotonic() + timeout_s
            while self._generation == generation and self._broken is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(self.size)) - set(self._arrived))
                    self._broken = (DeepEPTimeoutError,
                                    f"rank {rank} waited {timeout_s:g} s in {what} for ranks {missing}, "
                                    "which never arrived")
                    self._cond.notify_all()
                    break
                self._cond.wait(remaining)
            # The wait ends with the next generation or a break; a break after every rank arrived
            # does not undo the collective.
            if self._generation == generation and self._broken is not None:
                self._raise_broken(rank, what, self._broken)

    def allgather(self, rank: int, obj: Any, timeout_s: Optional[float]) -> List[Any]:
        self._slots[rank] = obj
        self.wait(rank, "allgather", timeout_s)
        gathered = list(self._slots)
        # Nobody may overwrite a slot of this round before every rank has copied the list.
        self.wait(rank, "allgather (second phase)", timeout_s)
        return gathered


def _check_timeout(timeout_s: float) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


class ThreadGroup(Group):
    """One rank of an in-process group: every rank is a thread of this process.

    Ranks share one address space, so a :class:`deepep_cupy.Buffer` built on a ThreadGroup
    exchanges raw device pointers (no CUDA IPC) and enables peer access between the GPUs. Several
    ranks may share a GPU, each with its own Buffer and stream, as long as their transfer kernels
    fit on it together (see :func:`check_sm_budget`).

    Usually made by :func:`run_local_group`; to run the threads yourself, make one group per rank
    with :meth:`create` and hand group ``r`` to the thread of rank ``r`` (which must make
    ``group.device_id`` its current CuPy device before creating a Buffer).

    Collectives (``allgather``, ``barrier``) must be called by every rank in the same order. They
    wait at most ``timeout_s`` seconds (the group's, unless given) and raise
    :class:`deepep_cupy.DeepEPTimeoutError` naming the ranks that never arrived; once any rank
    failed (:meth:`abort`), every rank's current and later collectives raise
    :class:`GroupAbortedError` (a :class:`deepep_cupy.DeepEPError`) naming it.

    Attributes:
        devices: the CUDA device id of every rank (``None`` entries: no device assigned).
        timeout_s: the default collective timeout in seconds (settable; shared by all ranks).
    """

    in_process = True

    def __init__(self, hub: _Hub, rank: int):
        if not 0 <= rank < hub.size:
            raise ValueError(f"rank: expected 0..{hub.size - 1}, got {rank}")
        self._hub = hub
        self._rank = rank

    @classmethod
    def create(cls, num_ranks: int, devices: Optional[Sequence[Optional[int]]] = None, *,
               timeout_s: float = DEFAULT_THREAD_TIMEOUT_S) -> List["ThreadGroup"]:
        """One ThreadGroup per rank, all sharing one hub.

        Args:
            num_ranks: ranks (threads) in the group.
            devices: CUDA device id per rank (recorded, not selected: the caller's threads select
                them); default ``None`` for every rank.
            timeout_s: default collective timeout in seconds.

        Returns:
            ``[group_0, ..., group_{num_ranks-1}]``.
        """
        hub = _Hub(num_ranks, list(devices) if devices is not None else [None] * num_ranks, timeout_s)
        return [cls(hub, r) for r in range(num_ranks)]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._hub.size

    @property
    def devices(self) -> List[Optional[int]]:
        return list(self._hub.devices)

    @property
    def device_id(self) -> Optional[int]:
        """This rank's CUDA device id (``None`` when the group was made without devices)."""
        return self._hub.devices[self._rank]

    def ranks_on_device(self, device_id: int) -> int:
        """How many ranks of this group run on CUDA device ``device_id`` (this one included)."""
        return sum(1 for d in self._hub.devices if d is not None and d == device_id)

    @property
    def timeout_s(self) -> float:
        return self._hub.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._hub.timeout_s = _check_timeout(value)

    @property
    def aborted(self) -> Optional[str]:
        """Why the group was aborted, or ``None`` while it is healthy."""
        return self._hub.broken

    def allgather(self, obj: Any, timeout_s: Optional[float] = None) -> List[Any]:
        """Gather one object from every rank (the objects themselves: nothing is copied or pickled).

        Args:
            obj: this rank's contribution.
            timeout_s: override of the group's timeout for this call.

        Returns:
            A list of ``size`` objects, index ``i`` holding rank ``i``'s contribution.
        """
        return self._hub.allgather(self._rank, obj, timeout_s)

    def allgather_within(self, obj: Any, timeout_s: float) -> List[Any]:
        return self.allgather(obj, timeout_s)

    def barrier(self, timeout_s: Optional[float] = None) -> None:
        """Block until every rank has called ``barrier`` (or raise on abort / timeout)."""
        self._hub.wait(self._rank, "barrier", timeout_s)

    def abort(self, reason: str) -> None:
        """Break the group so that no rank stays blocked in a collective (e.g. after an error).
        Sub-groups made by :meth:`split` break with it."""
        self._hub.abort(f"rank {self._rank}: {reason}")

    def _split(self, parts: List[List[int]], index: int) -> "ThreadGroup":
        # Rank 0 makes every part's hub; the others take theirs from it.
        hubs = self.allgather(self._hub.make_children(parts) if self._rank == 0 else None)[0]
        return ThreadGroup(hubs[index], parts[index].index(self._rank))

    def free(self) -> None:
        """A sub-group stops following its parent's aborts (its hub is released with its last user)."""
        if self._hub._parent is not None:
            self._hub._parent.forget_child(self._hub)

    def __repr__(self) -> str:
        return f"ThreadGroup(rank={self._rank}, size={self.size}, device={self.device_id})"


def _ranks_per_device(devices: Sequence[Optional[int]]) -> Dict[int, int]:
    counts: Dict[int, int] = {}
    for d in devices:
        if d is not None:
            counts[d] = counts.get(d, 0) + 1
    return counts


def _resolve_devices(num_ranks: Optional[int], devices: Optional[Sequence[int]],
                     use_devices: bool, device_count: Optional[int]) -> List[Optional[int]]:
    if devices is not None:
        devices = list(devices)
        for d in devices:
            if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
                raise TypeError(f"devices: expected CUDA device ids (ints), got {d!r}")
        devices = [int(d) for d in devices]
        if num_ranks is not None and len(devices) != num_ranks:
            raise ValueError(f"devices: expected one device per rank ({num_ranks}), got {len(devices)}: {devices}")
        if not devices:
            raise ValueError("devices: expected at least one device id")
    if not use_devices:
        if devices is not None:
            return list(devices)
        if num_ranks is None:
            raise ValueError("num_ranks: required when use_devices=False and no devices are given")
        return [None] * num_ranks
    if device_count is None or device_count <= 0:
        found = gpu_check.probe() if device_count is None else gpu_check.GpuProbe(device_count)
        reason = gpu_check.missing_gpu_reason(found)
        if reason is not None:
            # Says what use_devices=False gives, so that nobody takes it for a way to run a Buffer.
            raise GpuUnavailableError(gpu_check.no_gpu_sentence(
                "run_local_group", f"{reason}; use_devices=False runs pure-Python ranks, whose groups have "
                                   "collectives but no GPU for a Buffer"))
        device_count = found.count
    if devices is None:
        if num_ranks is None:
            num_ranks = device_count
        devices = [r % device_count for r in range(num_ranks)]
    bad = [d for d in devices if not 0 <= d < device_count]
    if bad:
        raise ValueError(f"devices: {bad} out of range: {device_count} CUDA devices are visible "
                         f"(ids 0..{device_count - 1})")
    return list(devices)


#: How often (seconds) the thread of :func:`run_local_group` looks at its ranks while they are healthy
#: (it is also woken as each rank ends): an interrupt (Ctrl-C in a notebook) is seen this soon.
LAUNCHER_POLL_S = 1.0

#: The GIL switch interval (seconds) while :func:`run_local_group` runs rank threads.
RANK_SWITCH_INTERVAL_S = 2e-5


def _wait_for_ranks(done: threading.Condition, seconds: float) -> None:
    """The launching thread's wait for its ranks (``done`` held), where it spends its time while they
    run: a Ctrl-C (a notebook's stop button) meets it here, as a KeyboardInterrupt. A function of its
    own so that a test can raise that interrupt here, whatever the process does with SIGINT."""
    done.wait(seconds)


def run_local_group(fn: Callable[[ThreadGroup], Any], num_ranks: Optional[int] = None,
                    devices: Optional[Sequence[int]] = None, *, timeout_s: float = DEFAULT_THREAD_TIMEOUT_S,
                    num_sms: Optional[int] = None, use_devices: bool = True,
                    _device_count: Optional[int] = None) -> List[Any]:
    """Run ``fn(group)`` for every rank of an in-process group, one thread per rank.

    Rank ``r`` runs in its own thread with CUDA device ``devices[r]`` current
    (``cupy.cuda.Device(devices[r]).use()``) and its own non-blocking CuPy stream current, so a
    ``deepep_cupy.Buffer(group, ...)`` created there lives on that GPU. Several ranks may share a
    GPU (their work must then stay off the legacy default stream, which would serialize them).

    While the ranks run, the interpreter's GIL switch interval is at most
    :data:`RANK_SWITCH_INTERVAL_S`: a rank thread whose CUDA wait has ended gets the GIL back
    from a busy peer thread within that time instead of CPython's default 5 ms, which stalled
    every rank's next launch (docs/PERFORMANCE.md has the measurements behind the value).

    The rank threads are daemon threads, always waited for while they are healthy; only a rank
    still stuck ``timeout_s`` after another failed is left behind (and named), so that it cannot
    keep the interpreter from exiting.

    Args:
        fn: called once per rank with that rank's :class:`ThreadGroup`.
        num_ranks: ranks to run (default: ``len(devices)``, else the number of visible GPUs).
        devices: CUDA device id per rank (default: rank ``r`` on GPU ``r % device_count``).
        timeout_s: how long a collective (``allgather``/``barrier``) waits for the other ranks, and
            how long this function waits for the remaining ranks once one has failed.
        num_sms: if given, first check that ``num_sms``-SM transfer kernels of all ranks sharing a
            GPU fit on it together (:func:`check_sm_budget`; ``ValueError`` if not).
        use_devices: ``False`` runs pure-Python ranks: no CUDA call at all, ``devices`` (if given)
            only recorded in the groups. For tests without a GPU.
        _device_count: for tests: the number of visible GPUs to assume instead of asking CUDA.

    Returns:
        ``[result_0, ..., result_{R-1}]``: what ``fn`` returned on each rank.

    Raises:
        RankFailed: a rank raised. It names the rank whose exception came first in time (preferring
            exceptions that are not deepep_cupy communication errors: see :class:`RankFailed`) and
            is raised ``from`` that exception (``.rank``, ``.exception``, ``.failures`` of all ranks).
            The group is aborted as soon as a rank raises, so the others' collectives raise
            instead of waiting; ranks still running ``timeout_s`` later are named in ``.stuck``.
        ValueError: bad ``devices``/``num_ranks``, or the SM budget does not fit.
    """
    if num_ranks is not None and (isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1):
        raise ValueError(f"num_ranks: expected a positive int, got {num_ranks!r}")
    _check_timeout(timeout_s)
    resolved = _resolve_devices(num_ranks, devices, use_devices, _device_count)
    if num_sms is not None:
        check_sm_budget(_ranks_per_device(resolved), num_sms)
    groups = ThreadGroup.create(len(resolved), resolved, timeout_s=timeout_s)
    hub = groups[0]._hub
    size = len(groups)

    results: List[Any] = [None] * size
    failures: Dict[int, BaseException] = {}
    order: List[int] = []           # failing ranks, first in time first
    done = threading.Condition()
    finished = [0]

    def body(rank: int) -> None:
        try:
            if use_devices:
                import cupy

                cupy.cuda.Device(resolved[rank]).use()
                # Each rank gets its own stream: on the shared legacy default stream, one rank's
                # wait for its transfer would also hold back the launch of a co-located peer's,
                # which that transfer waits for (deadlock).
                with cupy.cuda.Stream(non_blocking=True), allocator_for(resolved, rank):
                    results[rank] = fn(groups[rank])
            else:
                results[rank] = fn(groups[rank])
        except BaseException as exc:  # noqa: B902 - every failure must reach the caller
            with done:
                failures[rank] = exc
                order.append(rank)
            # After recording: the first failure stays first, the others see why they are aborted.
            hub.abort(f"rank {rank} failed: {type(exc).__name__}: {exc}")
        finally:
            with done:
                finished[0] += 1
                done.notify_all()

    threads = [threading.Thread(target=body, args=(r,), name=f"deepep-rank-{r}", daemon=True)
               for r in range(size)]
    previous_switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(min(previous_switch_interval, RANK_SWITCH_INTERVAL_S))
    try:
        for t in threads:
            t.start()
        with done:
            # No deadline while all ranks are healthy (their own collectives time out); once one
            # failed, the others get ``timeout_s`` to notice the abort and return.
            deadline = None
            while finished[0] < size:
                if order and deadline is None:
                    deadline = time.monotonic() + timeout_s
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                _wait_for_ranks(done, LAUNCHER_POLL_S if remaining is None else min(remaining, LAUNCHER_POLL_S))
    except BaseException:
        # KeyboardInterrupt in a notebook: release every rank blocked in a collective.
        hub.abort("interrupted in the launching thread")
        raise
    finally:
        sys.setswitchinterval(previous_switch_interval)
    all_returned = finished[0] == size
    for t in threads:
        t.join(None if all_returned else 0)  # returned threads are only leaving ``body``
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if order:
        first = _primary_failure(order, failures)
        raise RankFailed(first, failures[first], failures, stuck) from failures[first]
    return results


def _primary_failure(order: Sequence[int], failures: Mapping[int, BaseException]) -> int:
    """The rank to blame (see :class:`RankFailed`): ``order`` lists the failed ranks, first in time first."""
    for wanted in (lambda e: not isinstance(e, DeepEPError),
                   lambda e: not isinstance(e, GroupAbortedError),
                   lambda e: True):
        for rank in order:
            if wanted(failures[rank]):
                return rank
    raise AssertionError("no failure")  # pragma: no cover
