"""Exceptions raised by deepep_cupy."""


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


class RankMismatchError(DeepEPError, ValueError):
    """Ranks called a collective operation with settings that disagree (raised on every rank)."""
