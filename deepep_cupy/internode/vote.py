"""The vote that makes an internode call fail on every rank together: each rank says whether its
part of the call so far went well, and every rank raises when one did not."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, TypeVar

from ..errors import PeerFailedError

_T = TypeVar("_T")


class CallVote:
    """The group's votes for one internode path.

    Args:
        allgather: the whole group's allgather of one Python object per rank, with a deadline.
        rank: this rank (for messages).
    """

    def __init__(self, allgather: Callable[[Any], list], rank: int):
        self._allgather = allgather
        self.rank = rank

    def vote(self, what: str, failure: Optional[BaseException], payload: Any = None) -> List[Any]:
        """Every rank's ``payload``, once every rank has said whether its part of the call so far
        went well: when one failed, every rank raises from this call (the failing rank its own
        exception, the others :class:`deepep_cupy.PeerFailedError` naming it and what it raised)."""
        mine = None if failure is None else f"{type(failure).__name__}: {failure}"
        table = self._allgather((mine, None if failure is not None else payload))
        failed = [r for r, (error, _) in enumerate(table) if error is not None]
        if failure is not None:
            raise failure
        if failed:
            r = failed[0]
            raise PeerFailedError(f"rank {self.rank}: the internode {what} failed on rank {r} "
                                  f"({table[r][0]}); every rank raises from this call", peer=r)
        return [p for _, p in table]

    def voting(self, what: str, step: Callable[[], _T]) -> _T:
        """``step()``'s result once every rank's step went well (:meth:`vote`)."""
        try:
            result = step()
        except Exception as exc:  # told to every rank; re-raised by vote
            self.vote(what, exc)
            raise  # pragma: no cover - vote re-raises exc
        self.vote(what, None)
        return result
