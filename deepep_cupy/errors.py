"""Every exception type deepep_cupy raises besides the built-in TypeError / ValueError."""

from typing import Dict, Optional, Sequence


class DeepEPError(RuntimeError):
    """A communication operation failed (the Buffer may be unusable: see the message)."""


class DeepEPTimeoutError(DeepEPError, TimeoutError):
    """A rank waited longer than the Buffer's timeout for its peers.

    Attributes:
        rank: the rank that gave up.
        kernel: the stage it was in (``"dispatch receiver"``, ``"notify_dispatch"``, ...).
        channel: the channel it was serving, or ``None`` for whole-rank stages.
        peer: the peer rank it was waiting for, or ``None``.
    """

    def __init__(self, message, *, rank=None, kernel=None, channel=None, peer=None):
        super().__init__(message)
        self.rank, self.kernel, self.channel, self.peer = rank, kernel, channel, peer


class PeerAbortedError(DeepEPTimeoutError):
    """This rank's call stopped because another rank had already given up on the Buffer (a wait of
    that rank timed out): its kernels stop at once instead of waiting out their own timeout.

    Attributes are :class:`DeepEPTimeoutError`'s; ``peer`` is the rank that gave up. The Buffer is
    unusable on every rank: each must ``destroy()`` it and create a new one.
    """


class PeerFailedError(DeepEPError):
    """A call was refused on every rank because one rank's host failed before it could take part
    (its outputs could not be allocated, it raised or it was interrupted): that rank took part only
    to refuse it, nothing moved, and the Buffer stays usable. The failing rank itself raises its
    own exception (an out-of-memory error, say), with a note saying so.

    Attributes:
        peer: the rank whose host failed (the lowest, when several did).
        failure: what failed (``deepep_cupy.constants.HOST_FAILURES``).
    """

    def __init__(self, message, *, peer=None, failure=None):
        super().__init__(message)
        self.peer, self.failure = peer, failure


class RankMismatchError(DeepEPError, ValueError):
    """Ranks called a collective operation with settings that disagree (raised on every rank)."""


class KernelBuildError(DeepEPError):
    """A kernel could not be compiled or loaded, or its sources were not found."""


class RankFailed(DeepEPError):
    """A rank of :func:`run_local_group` raised; raised ``from`` that rank's exception.

    Which rank is named: the first (in time) to raise an exception that is not a
    :class:`DeepEPError`; failing that, the first to raise one that is not a
    :class:`GroupAbortedError`; failing that, the first. Timeouts and aborts are usually the other
    ranks' reaction to a failure, and a rank's clean-up (``with Buffer(...)``: destroy) can run
    before its own exception reaches :func:`run_local_group`.

    Attributes:
        rank: the rank named (see above).
        exception: that exception (also the ``__cause__``).
        failures: ``{rank: exception}`` of every rank that raised, the first one included.
        stuck: ranks whose thread was still running when :func:`run_local_group` gave up on them
            (empty when every thread finished).
    """

    def __init__(self, rank: int, exception: BaseException, failures: Optional[Dict[int, BaseException]] = None,
                 stuck: Sequence[int] = ()):
        self.rank = rank
        self.exception = exception
        self.failures = dict(failures) if failures else {rank: exception}
        self.stuck = list(stuck)
        message = f"rank {rank} failed: {type(exception).__name__}: {exception}"
        others = sorted(set(self.failures) - {rank})
        if others:
            message += f" (ranks {others} raised too, most because of it)"
        if self.stuck:
            message += (f"; ranks {self.stuck} did not finish in time after that and were left running "
                        "(daemon threads: they end with the process)")
        super().__init__(message)


class GroupAbortedError(DeepEPError):
    """A collective of a :class:`ThreadGroup` gave up because the group was aborted (another rank
    failed, or the launcher was interrupted): a consequence, not a cause."""


class NcclUnavailable(DeepEPError):
    """NCCL cannot be used here (no libnccl loads, or the benchmark's NCCL baseline cannot run); the
    message says why."""


class GpuUnavailableError(DeepEPError):
    """This process has no usable CUDA GPU (CuPy does not import, no driver, or no device): raised
    by ``Buffer()`` and :func:`run_local_group` before any CUDA call, with one sentence saying what
    is missing (``deepep_cupy.gpu.check``)."""


class BufferKindError(ValueError):
    """An operation or property that this kind of Buffer (intranode, internode or low-latency) does
    not have; the message names the Buffer's kind and how to make one that has it."""
