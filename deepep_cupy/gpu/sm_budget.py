"""Whether the ranks sharing a GPU can run their transfer kernels at once.

Ranks on one GPU (in-process groups) spin-wait on each other inside their kernels, so every block of
every co-located rank must be resident at the same time: ``ranks x num_sms <= SMs`` per GPU.
"""

from __future__ import annotations

import collections.abc
import functools
from typing import Callable, Mapping, Union


@functools.lru_cache(maxsize=None)
def sm_count_of(device_id: int) -> int:
    """Multiprocessors of CUDA device ``device_id``."""
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def largest_num_sms(ranks_on_gpu: int, sm_count: int) -> int:
    """The largest (even) ``num_sms`` with which ``ranks_on_gpu`` ranks fit on a GPU of ``sm_count`` SMs."""
    return (sm_count // ranks_on_gpu) // 2 * 2


def check_sm_budget(ranks_per_device: Mapping[int, int], num_sms: int,
                    sm_count: Union[None, int, Mapping[int, int], Callable[[int], int]] = None) -> None:
    """Check that the ranks sharing each GPU can run their transfer kernels at the same time.

    Ranks on one GPU run their dispatch/combine kernels concurrently and those kernels spin-wait
    on each other, so every block of every co-located rank must be resident at once: each kernel
    has ``num_sms`` blocks of one SM each, hence ``ranks_on_gpu * num_sms <= SMs`` per GPU.

    Args:
        ranks_per_device: ``{device_id: number of ranks on it}`` (zero counts are fine).
        num_sms: the ``Config.num_sms`` the ranks will use.
        sm_count: the multiprocessor count: one int for every GPU, a ``{device_id: count}``
            mapping, a function of the device id, or ``None`` to ask CUDA.

    Raises:
        ValueError: on the first GPU that cannot hold its ranks' kernels, naming the GPU, its rank
            count, ``num_sms`` and its SM count, and the largest ``num_sms`` that would fit.
    """
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms <= 0:
        raise ValueError(f"num_sms: expected a positive int, got {num_sms!r}")
    for device_id in sorted(ranks_per_device):
        ranks = int(ranks_per_device[device_id])
        if ranks <= 0:
            continue
        if sm_count is None:
            sms = sm_count_of(device_id)
        elif callable(sm_count):
            sms = int(sm_count(device_id))
        elif isinstance(sm_count, collections.abc.Mapping):
            sms = int(sm_count[device_id])
        else:
            sms = int(sm_count)
        if ranks * num_sms > sms:
            fit = largest_num_sms(ranks, sms)
            hint = (f"use num_sms <= {fit} (even) or put fewer ranks on GPU {device_id}" if fit >= 2
                    else f"put fewer ranks on GPU {device_id}")
            raise ValueError(
                f"GPU {device_id}: {ranks} ranks x num_sms={num_sms} = {ranks * num_sms} blocks of transfer "
                f"kernels, but the GPU has {sms} SMs; ranks sharing a GPU run their dispatch/combine "
                f"kernels at the same time and every block must be resident at once (one block per SM): "
                f"{hint}")
