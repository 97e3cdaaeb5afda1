"""Making a Buffer's GPU current for the span of a call."""

from __future__ import annotations

from typing import List


class DeviceScope:
    """Makes a GPU current for the duration of a call (nothing to do when it is)."""

    def __init__(self, device_id: int):
        from cupy.cuda import runtime

        self.device_id = device_id
        self._runtime = runtime
        self._previous: List[int] = []

    def __enter__(self):
        current = self._runtime.getDevice()
        if current != self.device_id:
            self._runtime.setDevice(self.device_id)
        self._previous.append(current)

    def __exit__(self, *exc):
        previous = self._previous.pop()
        if previous != self.device_id:
            self._runtime.setDevice(previous)
