"""The checked plans of an operation's calls, by kind of arguments.

An operation checks the arguments of a new kind once, binds its kernels for them (a *plan*) and
keeps the plan under the key :func:`deepep_cupy.tensors.read` gives those arguments; later calls
with arguments of the same kinds find it here and skip the checks. What a plan holds is the
operation's business: this cache knows none.
"""

from __future__ import annotations

from typing import Any

#: Plans a cache keeps before it forgets them all (a model uses a handful).
MAX_PLANS = 256


class PlanCache(dict):
    """Plans by kind of arguments (``get`` as a dict's); :meth:`make` checks arguments of a new kind
    and keeps their plan, forgetting all of them past :data:`MAX_PLANS`.

    Args:
        scope: a context in which plans are built (the GPU made current).
    """

    def __init__(self, scope: Any):
        super().__init__()
        self.scope = scope

    def make(self, key: tuple, build, *args):
        """``build(*args)`` (it raises on bad arguments), kept under ``key``."""
        with self.scope:
            made = build(*args)
        if len(self) >= MAX_PLANS:
            self.clear()
        self[key] = made
        return made
