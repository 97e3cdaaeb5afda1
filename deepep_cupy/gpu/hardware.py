"""The SM count a dispatch needs, from the GPU's NVLinks.

Senders must fill the links, receivers copy about twice what the senders push
(deepep_cupy.config.sender_blocks), so the recommended SM count is three times the senders that
fill the links:

    senders = ceil(active NVLinks x LINK_GBPS / SM_PUSH_GBPS),   num_sms = 3 x senders (even)

with the rates measured on 2 x H200 (docs/PERFORMANCE.md): 18 links take 326 GB/s per direction,
one SM pushes about 41 GB/s, so 8 senders and 24 SMs. The links are counted with NVML; where NVML
or the GPU cannot be asked (no driver, no GPU: CPU-only CI), the recommendation is that of 18
links.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Optional

#: GB/s one active NVLink carries per direction under a dispatch's load (326 / 18, measured).
LINK_GBPS = 18.1
#: GB/s of 16-byte stores one SM pushes to a peer (326 / 8, measured).
SM_PUSH_GBPS = 40.75
#: The links of the machine the figures were measured on, assumed where none can be counted.
ASSUMED_LINKS = 18
#: NVML's link index bound (NVML_NVLINK_MAX_LINKS) and enable state "enabled".
NVML_MAX_LINKS = 18
NVML_FEATURE_ENABLED = 1


def senders_for_links(links: int) -> int:
    """Sender blocks that fill ``links`` active NVLinks (module docstring)."""
    return max(1, math.ceil(links * LINK_GBPS / SM_PUSH_GBPS))


def num_sms_for_links(links: int) -> int:
    """The recommended SM count of a GPU with ``links`` active NVLinks (module docstring)."""
    return 2 * math.ceil(3 * senders_for_links(links) / 2)


def _load_nvml():
    """libnvidia-ml, initialised, or None."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        return nvml if nvml.nvmlInit_v2() == 0 else None
    except (OSError, AttributeError):
        return None


def active_nvlinks(pci_bus_id: str, nvml=None) -> Optional[int]:
    """Active NVLinks of the GPU at ``pci_bus_id`` (CUDA's ``deviceGetPCIBusId``), or None when NVML
    cannot say."""
    nvml = nvml if nvml is not None else _load_nvml()
    if nvml is None:
        return None
    device = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(device)) != 0:
        return None
    active = 0
    for link in range(NVML_MAX_LINKS):
        state = ctypes.c_int(0)
        if nvml.nvmlDeviceGetNvLinkState(device, ctypes.c_uint(link), ctypes.byref(state)) != 0:
            break  # past the device's links, or a device without NVLink
        active += state.value == NVML_FEATURE_ENABLED
    return active


def recommended_num_sms(device_id: Optional[int] = None) -> int:
    """The recommended SM count for GPU ``device_id`` (default: CuPy's current device)."""
    try:
        from cupy.cuda import runtime

        return _num_sms_of_device(runtime.getDevice() if device_id is None else device_id)
    except Exception:  # no GPU or no driver here
        return num_sms_for_links(ASSUMED_LINKS)


@functools.lru_cache(maxsize=None)
def _num_sms_of_device(device_id: int) -> int:
    from cupy.cuda import runtime

    links = active_nvlinks(runtime.deviceGetPCIBusId(device_id))
    return num_sms_for_links(ASSUMED_LINKS if links is None else links)
