"""Performance settings of dispatch and combine, and the NVLink buffer size they need."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

from . import layout
from .layout import MAX_LOCAL_EXPERTS  # noqa: F401  (re-exported)
from .kernels import MAX_RANKS

#: The most top-k entries per token the kernels handle (one warp lane each).
MAX_TOPK = 32
#: Environment variable naming a JSON file of tuned configs (written by ``bench --save-config``).
CONFIG_ENV = "DEEPEP_CUPY_CONFIG"


@dataclass(frozen=True)
class Config:
    """How many SMs and how large the NVLink queues are for one dispatch or combine.

    Args:
        num_sms: thread blocks of the transfer kernels; even (half send, half receive), one
            channel per pair, so ``num_sms // 2`` channels. A combine must use the same number
            of SMs as the dispatch whose handle it uses.
        num_max_nvl_chunked_send_tokens: tokens a sender writes before publishing its queue tail.
        num_max_nvl_chunked_recv_tokens: slots of each (channel, rank) queue in the receiver's buffer.
    """

    num_sms: int = 24
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256

    def __post_init__(self):
        for name in ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Config.{name}: expected a positive int, got {value!r}")
        if self.num_sms % 2:
            raise ValueError(f"Config.num_sms: expected an even number (send/receive block pairs), got {self.num_sms}")
        if self.num_max_nvl_chunked_send_tokens > self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                "Config: num_max_nvl_chunked_send_tokens "
                f"({self.num_max_nvl_chunked_send_tokens}) must not exceed num_max_nvl_chunked_recv_tokens "
                f"({self.num_max_nvl_chunked_recv_tokens}): a sender waits for a whole chunk of free slots")

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, *, num_topk: int = MAX_TOPK) -> int:
        """Bytes of NVLink buffer that dispatch and combine need with this config.

        Args:
            hidden_bytes: bytes of one token row at its widest (``hidden * 2`` for BF16).
            num_ranks: ranks in the group.
            num_topk: top-k entries per token (default: the largest supported).
        """
        return get_nvl_buffer_size_hint(hidden_bytes, num_ranks, self, num_topk=num_topk)

    def to_dict(self) -> dict:
        return asdict(self)


def get_nvl_buffer_size_hint(hidden_bytes: int, num_ranks: int, config: Optional[Config] = None, *,
                             num_topk: int = MAX_TOPK) -> int:
    """Bytes of NVLink buffer needed by dispatch (BF16 or FP8 with scales) and combine.

    Args:
        hidden_bytes: bytes of one token row at its widest (``hidden * 2`` for BF16).
        num_ranks: ranks in the group (2..8).
        config: the config to size for (default: the larger of the recommended dispatch and
            combine configs for ``num_ranks``).
        num_topk: top-k entries per token.

    Returns:
        A byte count; pass it (or more) as ``num_nvl_bytes`` to :class:`deepep_cupy.Buffer`.
    """
    if config is None:
        return max(get_nvl_buffer_size_hint(hidden_bytes, num_ranks, c, num_topk=num_topk)
                   for c in (get_dispatch_config(num_ranks), get_combine_config(num_ranks)))
    # FP8 rows carry hidden / 128 float scales; count them on top of the widest row.
    num_scales = max(1, hidden_bytes // 2 // 128)
    d = layout.dispatch_layout(num_ranks, config.num_channels, config.num_max_nvl_chunked_recv_tokens,
                               hidden_bytes, num_topk, num_scales)
    c = layout.combine_layout(num_ranks, config.num_channels, config.num_max_nvl_chunked_recv_tokens,
                              hidden_bytes, num_topk)
    return max(d.total_bytes, c.total_bytes)


# Recommended settings per rank count. 2 ranks: measured on 2 x H200 (scripts/quick_perf.py,
# reference workload): 32-token chunks and 512-slot queues beat 16/256 and 6/256 for combine and
# tie for dispatch. More ranks were not measured: smaller queues keep the buffer near 1 GB at 8.
_DISPATCH_CONFIGS = {r: Config(24, 32, 512) if r <= 4 else Config(24, 16, 256) for r in range(2, MAX_RANKS + 1)}
_COMBINE_CONFIGS = {r: Config(24, 32, 512) if r <= 4 else Config(24, 16, 256) for r in range(2, MAX_RANKS + 1)}


def _check_num_ranks(num_ranks: int) -> None:
    if not 2 <= num_ranks <= MAX_RANKS:
        raise ValueError(f"num_ranks: expected 2..{MAX_RANKS}, got {num_ranks}")


def _tuned(kind: str, num_ranks: int) -> Optional[Config]:
    """The config saved by ``python -m deepep_cupy.bench --tune --save-config PATH``, if any."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{CONFIG_ENV}={path}: cannot read a tuned config file ({exc})") from None
    entries = saved if isinstance(saved, list) else [saved]
    for entry in entries:
        if entry.get("num_ranks") == num_ranks and kind in entry:
            return Config(**entry[kind])
    return None


def get_dispatch_config(num_ranks: int) -> Config:
    """The recommended dispatch config for ``num_ranks`` ranks (a tuned one if ``DEEPEP_CUPY_CONFIG`` names one)."""
    _check_num_ranks(num_ranks)
    return _tuned("dispatch", num_ranks) or _DISPATCH_CONFIGS[num_ranks]


def get_combine_config(num_ranks: int) -> Config:
    """The recommended combine config for ``num_ranks`` ranks (a tuned one if ``DEEPEP_CUPY_CONFIG`` names one)."""
    _check_num_ranks(num_ranks)
    return _tuned("combine", num_ranks) or _COMBINE_CONFIGS[num_ranks]
