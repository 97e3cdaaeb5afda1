"""Performance settings of dispatch and combine, the NVLink buffer size they need, and the file
of tuned configs (written by ``python -m deepep_cupy.bench --tune --save-config``)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from .constants import BLOCK_THREADS, FP8_SCALE_BLOCK, MAX_RANKS, MAX_TOPK
from .gpu import hardware, layout

#: Tokens per rank :func:`get_nvl_buffer_size_hint` makes room for unless told otherwise.
DEFAULT_MAX_TOKENS_PER_RANK = 8192
#: Environment variable naming a JSON file of tuned configs (written by ``bench --save-config``).
CONFIG_ENV = "DEEPEP_CUPY_CONFIG"


@dataclass(frozen=True)
class Config:
    """How many SMs dispatch and combine use, and how often their senders publish progress.

    Args:
        num_sms: thread blocks of the transfer kernels, even: :func:`sender_blocks` of a dispatch's
            send and the others receive (a combine's: :func:`combine_sender_blocks` send, the
            others reduce). Every sender warp of a dispatch is one channel (a contiguous range of
            the rank's tokens), so a combine must use a config with the channels of the dispatch
            whose handle it uses (the same ``num_sms``, or one with as many dispatch senders).
        num_max_nvl_chunked_send_tokens: tokens a sender warp writes before it publishes how far
            it got (the receivers copy what is published).
        num_max_nvl_chunked_recv_tokens: DeepEP's queue depth. Accepted (and compared across
            ranks) so that DeepEP's configs work; the transfer regions here are sized by the
            Buffer (deepep_cupy/gpu/layout.py), not by it.
        num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens: DeepEP's internode
            settings, accepted so that its five-argument configs work; intranode calls ignore them.
    """

    num_sms: int = 24
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self):
        for name in ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Config.{name}: expected a positive int, got {value!r}")
        if self.num_sms % 2:
            raise ValueError(f"Config.num_sms: expected an even number, got {self.num_sms}")

    def __hash__(self) -> int:
        # Hashed on every call (plans are cached by it): computed once (_hash).
        return self._hash

    @functools.cached_property  # frozen: stored in the instance's dict, read from there after the first call
    def _hash(self) -> int:
        return hash((self.num_sms, self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens))

    @functools.cached_property  # read on every call (frozen: stored in the instance's dict)
    def num_channels(self) -> int:
        """Channels of a dispatch with this config: one per sender warp."""
        return sender_blocks(self.num_sms) * BLOCK_THREADS["dispatch_kernel"] // 32

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, *, num_topk: int = MAX_TOPK,
                                 num_max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK,
                                 recv_x_in_buffer: bool = False) -> int:
        """Bytes of NVLink buffer that dispatch and combine need with this config
        (:func:`get_nvl_buffer_size_hint`)."""
        return get_nvl_buffer_size_hint(hidden_bytes, num_ranks, self, num_topk=num_topk,
                                        num_max_tokens_per_rank=num_max_tokens_per_rank,
                                        recv_x_in_buffer=recv_x_in_buffer)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, *, num_topk: int = MAX_TOPK,
                                  num_max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK) -> int:
        """Bytes of internode staging (DeepEP's RDMA buffer size): :func:`get_rdma_buffer_size_hint`."""
        return get_rdma_buffer_size_hint(hidden_bytes, num_ranks, num_topk=num_topk,
                                         num_max_tokens_per_rank=num_max_tokens_per_rank)


#: Blocks that push over NVLink at the link's rate: 8 on 18 NVLinks (2 x H200, where the rates were
#: measured: deepep_cupy.gpu.hardware). A constant, not the local GPU's count: every rank must split
#: a config's SMs alike.
LINK_SENDER_BLOCKS = hardware.senders_for_links(hardware.ASSUMED_LINKS)


def sender_blocks(num_sms: int) -> int:
    """Blocks of a dispatch of ``num_sms`` blocks that send (each warp a channel); the rest receive.
    A combine's blocks are split by :func:`combine_sender_blocks`.

    A dispatch's receivers copy twice what its senders push (the arrived rows, and this rank's own
    tokens): they get about two thirds of the blocks, the senders at most enough to fill the links
    (half of 8 or fewer).
    """
    if num_sms <= 8:
        return max(1, num_sms // 2)
    return min(LINK_SENDER_BLOCKS, round(num_sms / 3))


def combine_sender_blocks(num_sms: int) -> int:
    """Blocks of a combine of ``num_sms`` blocks that push rows back to their owners; the rest reduce.

    A combine's work items are the dispatch's channels (one per dispatch sender warp, times the
    other ranks), dealt to its sender blocks in turn, so it needs at least the dispatch's sender
    blocks (with fewer, some warps take two items one after the other) and may use more: each
    block adds an SM's stores. Below the 8 blocks that fill the links the push gains from 3/7 of
    the SMs; the reducers, which read two rows for every row pushed, keep the rest (measured on
    2 x H200, docs/PERFORMANCE.md).
    """
    return max(sender_blocks(num_sms), min(LINK_SENDER_BLOCKS, round(3 * num_sms / 7)))


def peer_blocks_in_place(num_sms: int, num_ranks: int) -> int:
    """Blocks of a dispatch that writes its rows in place (``recv_x_in_buffer``) that write the rows
    other ranks take; the rest write this rank's own rows. ``num_sms``: every block writes every
    destination.

    An SM stores about 45 GB/s in all, to a peer or to its own memory, but its stores to its own
    memory slow its pushes over NVLink: blocks that only push fill the links. A rank's own rows
    are about 1/(R - 1) of what it pushes to the R - 1 others, so they keep pace with the links on
    ``LINK_SENDER_BLOCKS / (R - 1)`` blocks (at most ``num_sms // R``), when the others are still
    enough to fill the links; with fewer SMs all of them are needed on every destination
    (docs/PERFORMANCE.md). The split assumes routing that spreads tokens over the ranks: where most
    of a rank's tokens stay on it, its own-row blocks do most of the work (at 24 SMs on 2 ranks,
    8 blocks write what 24 would share).
    """
    own = min(num_sms // num_ranks, -(-LINK_SENDER_BLOCKS // (num_ranks - 1)))
    return num_sms - own if own and num_sms - own >= LINK_SENDER_BLOCKS else num_sms


def get_nvl_buffer_size_hint(hidden_bytes: int, num_ranks: int, config: Optional[Config] = None, *,
                             num_topk: int = MAX_TOPK,
                             num_max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK,
                             recv_x_in_buffer: bool = False) -> int:
    """Bytes of NVLink buffer needed by dispatch (BF16 or FP8 with scales) and combine.

    A receiver's buffer holds one region per other rank, with a slot for every token that rank
    may send it: about ``(num_ranks - 1) * num_max_tokens_per_rank * (hidden_bytes + 8 * num_topk
    + 4 * scales + 4)`` bytes (8 ranks x 8192 tokens x hidden 7168 BF16 with top-8: 0.84 GB).
    A call in which a rank sends another more tokens than its Buffer has room for raises a
    ``ValueError`` on every rank before anything moves. A dispatch with ``recv_x_in_buffer``
    keeps its outputs in the buffer: a row of each for every token a rank may receive, its own
    included, ``num_ranks`` regions' worth instead of ``num_ranks - 1`` (8 ranks x 8192 tokens x
    hidden 7168 BF16 with top-8: 0.96 GB).

    Args:
        hidden_bytes: bytes of one token row at its widest (``hidden * 2`` for BF16).
        num_ranks: ranks in the group (2..8).
        config: the config to size for (default: the larger of the recommended dispatch and
            combine configs for ``num_ranks``).
        num_topk: top-k entries per token.
        num_max_tokens_per_rank: the most tokens a rank dispatches in one call.
        recv_x_in_buffer: size for dispatches that return their outputs in the buffer.

    Returns:
        A byte count; pass it (or more) as ``num_nvl_bytes`` to :class:`deepep_cupy.Buffer`.
    """
    if config is None:
        return max(get_nvl_buffer_size_hint(hidden_bytes, num_ranks, c, num_topk=num_topk,
                                            num_max_tokens_per_rank=num_max_tokens_per_rank,
                                            recv_x_in_buffer=recv_x_in_buffer)
                   for c in (get_dispatch_config(num_ranks), get_combine_config(num_ranks)))
    # FP8 rows carry hidden / FP8_SCALE_BLOCK float scales; count them on top of the widest row.
    num_scales = max(1, hidden_bytes // 2 // FP8_SCALE_BLOCK)
    tokens = int(num_max_tokens_per_rank)
    d = layout.dispatch_layout(num_ranks, config.num_channels, tokens, hidden_bytes, num_topk, num_scales,
                               bool(recv_x_in_buffer))
    c = layout.combine_layout(num_ranks, config.num_channels, tokens, hidden_bytes, num_topk)
    return max(d.total_bytes, c.total_bytes)


def get_rdma_buffer_size_hint(hidden_bytes: int, num_ranks: int, *, num_topk: int = MAX_TOPK,
                              num_max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK) -> int:
    """Bytes of internode staging one dispatch or combine of an internode Buffer may take.

    An internode call (deepep_cupy/internode/path.py) packs each token once per destination node into a
    record (row, FP8 scales, int64 top-k ids, float32 weights, padded to 16 bytes) and receives
    as many from the other nodes: at most ``num_max_tokens_per_rank`` tokens times the node count
    (at most ``num_ranks``: one rank per node) each way. The staging comes from CuPy's memory pool
    per call, not from a buffer of this size: pass any ``num_rdma_bytes > 0`` to make an internode
    Buffer; this hint says how much memory the calls may hold at their peak.

    Args:
        hidden_bytes: bytes of one token row at its widest (``hidden * 2`` for BF16).
        num_ranks: ranks in the group (across all nodes).
        num_topk: top-k entries per token.
        num_max_tokens_per_rank: the most tokens a rank dispatches in one call.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks: expected a positive int, got {num_ranks!r}")
    if isinstance(hidden_bytes, bool) or not isinstance(hidden_bytes, int) or hidden_bytes <= 0:
        raise ValueError(f"hidden_bytes: expected a positive int, got {hidden_bytes!r}")
    num_scales = max(1, hidden_bytes // 2 // FP8_SCALE_BLOCK)
    record = -(-(hidden_bytes + 4 * num_scales + 12 * int(num_topk)) // 16) * 16
    return 2 * int(num_max_tokens_per_rank) * num_ranks * record


# The recommended configs, measured on 2 x H200 (docs/PERFORMANCE.md): publishing every 4 tokens
# beats 8 and 16; the SM count follows the GPU's NVLinks (deepep_cupy.gpu.hardware).
RECOMMENDED_SEND_CHUNK = 4
#: DeepEP's queue depth, unused here (see Config).
RECOMMENDED_RECV_CHUNK = 256
#: SMs of the recommended configs on a GPU with 18 NVLinks (2 x H200, 8 x H100/H200): 24.
DEFAULT_NUM_SMS = hardware.num_sms_for_links(hardware.ASSUMED_LINKS)


def recommended_config(device_id: Optional[int] = None) -> Config:
    """The recommended config on GPU ``device_id`` (default: CuPy's current device)."""
    return Config(hardware.recommended_num_sms(device_id), RECOMMENDED_SEND_CHUNK, RECOMMENDED_RECV_CHUNK)


def _check_num_ranks(num_ranks: int) -> None:
    if not 2 <= num_ranks <= MAX_RANKS:
        raise ValueError(f"num_ranks: expected 2..{MAX_RANKS}, got {num_ranks}")


# ---------------------------------------------------------------------------------------------
# The tuned-config file (format in the deepep_cupy.bench docstring): the bench writes it, the
# library reads it through DEEPEP_CUPY_CONFIG.

CONFIG_KEYS = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens")


def _jsonable(obj: Any) -> Any:
    """Convert NumPy scalars/arrays, tuples and non-finite floats into plain JSON values."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(path: str, doc: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")


def config_to_dict(config: Any) -> Dict[str, int]:
    """A ``deepep_cupy.Config`` (or a dict with its keys) as ``{num_sms, ..send_tokens, ..recv_tokens}``."""
    if isinstance(config, dict):
        return {k: int(config[k]) for k in CONFIG_KEYS}
    return {k: int(getattr(config, k)) for k in CONFIG_KEYS}


def config_document(num_ranks: int, dispatch: Any, combine: Any, device: Optional[str] = None,
                    measured: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The ``--save-config`` document (format in the :mod:`deepep_cupy.bench` docstring)."""
    doc = {"num_ranks": int(num_ranks), "device": device,
           "dispatch": config_to_dict(dispatch), "combine": config_to_dict(combine)}
    if measured:
        doc["measured"] = _jsonable(measured)
    return doc


def save_config(path: str, num_ranks: int, dispatch: Any, combine: Any, device: Optional[str] = None,
                measured: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Write :func:`config_document` to ``path``; returns the document."""
    doc = config_document(num_ranks, dispatch, combine, device, measured)
    write_json(path, doc)
    return doc


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_config_document(path: str, doc: Any) -> None:
    """Raise a ``ValueError`` naming ``path`` and the problem unless ``doc`` is a valid config document."""
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object with 'num_ranks', 'dispatch' and 'combine' "
                         f"(or a list of them), got {type(doc).__name__}")
    missing = [k for k in ("num_ranks", "dispatch", "combine") if k not in doc]
    if missing:
        raise ValueError(f"{path}: missing {missing}")
    if not _is_positive_int(doc["num_ranks"]):
        raise ValueError(f"{path}: 'num_ranks' must be a positive integer, got {doc['num_ranks']!r}")
    for op in ("dispatch", "combine"):
        config = doc[op]
        if not isinstance(config, dict):
            raise ValueError(f"{path}: '{op}' must be an object with the keys {list(CONFIG_KEYS)}, got {config!r}")
        problems = []
        missing = [k for k in CONFIG_KEYS if k not in config]
        if missing:
            problems.append(f"lacks {missing}")
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown:
            problems.append(f"has unknown keys {unknown}")
        bad = {k: config[k] for k in CONFIG_KEYS if k in config and not _is_positive_int(config[k])}
        if bad:
            problems.append(f"needs positive integers, got {bad}")
        if problems:
            raise ValueError(f"{path}: '{op}' " + "; ".join(problems))


@functools.lru_cache(maxsize=16)
def _parse_config_file(path: str, stamp: Tuple[int, int]) -> Any:
    """The validated contents of ``path``; ``stamp`` (mtime in ns, size) makes an edited file be read again."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except ValueError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
    for entry in doc if isinstance(doc, list) else [doc]:
        _check_config_document(path, entry)
    return doc


def _read_config_file(path: str) -> Any:
    """A tuned-config file's contents (one document or a list of them), read and validated once per
    version of the file. Shared: do not modify it.

    Raises:
        OSError: the file cannot be read.
        ValueError: naming the file: it is not JSON, or not a valid config document.
    """
    path = os.path.abspath(os.fspath(path))
    status = os.stat(path)
    return _parse_config_file(path, (status.st_mtime_ns, status.st_size))


def load_config(path: str) -> Union[Dict[str, Any], List[Dict[str, Any]]]:
    """Read and validate a ``--save-config`` file: ``{"num_ranks", "dispatch", "combine", ...}``
    (a list of such documents if the file holds a list). Returns the caller's own copy."""
    return copy.deepcopy(_read_config_file(path))


def _tuned(kind: str, num_ranks: int) -> Optional[Config]:
    """The config saved by ``python -m deepep_cupy.bench --tune --save-config PATH``, if any."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        return None
    try:
        saved = _read_config_file(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{CONFIG_ENV}={path}: cannot read a tuned config file ({exc})") from None
    entries = saved if isinstance(saved, list) else [saved]
    for entry in entries:
        if entry.get("num_ranks") == num_ranks and kind in entry:
            try:
                return Config(**entry[kind])
            except ValueError as exc:
                raise ValueError(f"{CONFIG_ENV}={path}: '{kind}' for {num_ranks} ranks: {exc}") from None
    return None


def get_dispatch_config(num_ranks: int) -> Config:
    """The recommended dispatch config for ``num_ranks`` ranks on the current GPU (its SM count from
    the GPU's NVLinks, :mod:`deepep_cupy.gpu.hardware`), or a tuned one if ``DEEPEP_CUPY_CONFIG`` names one."""
    _check_num_ranks(num_ranks)
    return _tuned("dispatch", num_ranks) or recommended_config()


def get_combine_config(num_ranks: int) -> Config:
    """The recommended combine config for ``num_ranks`` ranks (a tuned one if ``DEEPEP_CUPY_CONFIG`` names one)."""
    _check_num_ranks(num_ranks)
    return _tuned("combine", num_ranks) or recommended_config()


# ---------------------------------------------------------------------------------------------
# The SM count of the default configs (DeepEP's ``Buffer.set_num_sms``)

#: The count :func:`set_default_num_sms` chose (one entry), empty until it is called (process-wide, as
#: DeepEP's class attribute): until then the default configs are the recommended (or tuned) ones as
#: they are. Read it; set it only through :func:`set_default_num_sms`.
CHOSEN_NUM_SMS: List[int] = []


def set_default_num_sms(num_sms: int) -> None:
    """Make ``num_sms`` the SM count of every default config from now on (a positive even int)."""
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms <= 0 or num_sms % 2:
        raise ValueError(f"num_sms: expected a positive even int, got {num_sms!r}")
    CHOSEN_NUM_SMS[:] = [num_sms]


def chosen_num_sms() -> Optional[int]:
    """The SM count :func:`set_default_num_sms` chose, or None."""
    return CHOSEN_NUM_SMS[0] if CHOSEN_NUM_SMS else None


def default_num_sms() -> int:
    """The SM count of the default configs as DeepEP's ``Buffer.num_sms`` reads it."""
    return CHOSEN_NUM_SMS[0] if CHOSEN_NUM_SMS else DEFAULT_NUM_SMS


def default_config(kind: str, num_ranks: int) -> Config:
    """The default ``"dispatch"`` or ``"combine"`` config for ``num_ranks`` ranks: the recommended (or
    tuned) one, with the chosen SM count once :func:`set_default_num_sms` was called."""
    config = get_dispatch_config(num_ranks) if kind == "dispatch" else get_combine_config(num_ranks)
    chosen = chosen_num_sms()
    if chosen is None or config.num_sms == chosen:
        return config
    return dataclasses.replace(config, num_sms=chosen)
