"""Which ranks of a group form a node: the ranks that can map each other's GPU memory.

A node is a set of consecutive ranks that run on one host and whose GPUs can map each other's
memory (NVLink or PCIe P2P). Between nodes, tokens travel over a rail transport
(:mod:`deepep_cupy.transports`) to the rank with the same local index (rail-aligned peers); inside
a node, over the NVLink kernels. This module only finds the shape; it knows no operation.

Three ways decide the node size ``L`` (ranks per node), in this order:

1. ``ranks_per_node=N`` (keyword) or the environment variable :data:`RANKS_PER_NODE_ENV`: split
   the group into simulated nodes of ``N`` consecutive ranks (a machine tested as several nodes,
   or ``1`` to force every GPU to be its own node).
2. The host names gathered over the group: the ranks of one host, which must be consecutive and
   equally many on every host.
3. ``peers_mappable=False``, or the collective P2P probe finding two GPUs of one host that cannot
   map each other's memory (PCIe-only machines): every GPU is its own node (``L = 1``).
"""

from __future__ import annotations

import os
import re
from typing import Any, List, NamedTuple, Optional, Sequence

from ..errors import RankMismatchError

#: Environment variable: ranks per (simulated) node, when the ``ranks_per_node`` keyword is not given.
RANKS_PER_NODE_ENV = "DEEPEP_CUPY_RANKS_PER_NODE"


class NodeTopology(NamedTuple):
    """The node shape of a group, seen from one rank.

    Ranks of node ``n`` are ``n*L .. n*L+L-1`` (consecutive); every node has ``L`` ranks.

    Attributes:
        rank: this rank's index in the group.
        num_ranks: ranks in the group.
        ranks_per_node: ``L``, the same on every node.
    """

    rank: int
    num_ranks: int
    ranks_per_node: int

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    @property
    def node(self) -> int:
        """This rank's node index."""
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        """This rank's index inside its node."""
        return self.rank % self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_ranks(self) -> List[int]:
        """The global ranks of this rank's node, in order."""
        return self.node_partition()[self.node]

    def rail_ranks(self) -> List[int]:
        """The global ranks with this rank's local index, one per node, in node order."""
        return self.rail_partition()[self.local_rank]

    def node_partition(self) -> List[List[int]]:
        """Every node's ranks (a partition of the group, for :meth:`deepep_cupy.groups.group.Group.split`)."""
        L = self.ranks_per_node
        return [list(range(n * L, n * L + L)) for n in range(self.num_nodes)]

    def rail_partition(self) -> List[List[int]]:
        """Every rail's ranks, rail ``l`` holding local rank ``l`` of each node in node order."""
        return [list(range(local, self.num_ranks, self.ranks_per_node)) for local in range(self.ranks_per_node)]


def _requested_ranks_per_node(ranks_per_node: Optional[int]) -> Optional[int]:
    if ranks_per_node is not None:
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node: expected a positive int, got {ranks_per_node!r}")
        return ranks_per_node
    text = os.environ.get(RANKS_PER_NODE_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{RANKS_PER_NODE_ENV}: expected a positive int, got {text!r}")
    return value


def _host_ranks_per_node(hosts: Sequence[str]) -> int:
    """L from the host names in rank order; ValueError unless hosts hold equal runs of consecutive ranks."""
    runs: List[List[Any]] = []           # [host, count] per run of equal names
    for host in hosts:
        if runs and runs[-1][0] == host:
            runs[-1][1] += 1
        else:
            runs.append([host, 1])
    names = [h for h, _ in runs]
    if len(set(names)) < len(names):
        raise ValueError(f"group: the ranks of a host must be consecutive, got hosts {list(hosts)} (rank order)")
    counts = {h: n for h, n in runs}
    if len(set(counts.values())) > 1:
        raise ValueError(f"group: every node must run the same number of ranks, got {counts} (ranks per host)")
    return runs[0][1]


#: A PCI address (domain:bus:device.function) at the start of a bus id; test launchers may decorate
#: the rest (tests/workers/one_gpu_ranks.py gives ranks sharing a GPU bus ids of their own).
_PCI_ADDRESS = re.compile(r"^[0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f]+")


def _pci_address(bus_id: str) -> str:
    match = _PCI_ADDRESS.match(bus_id)
    return (match.group(0) if match else bus_id).lower()


def gpu_address(device_id: int) -> Optional[str]:
    """The PCI address of CUDA device ``device_id`` (None where CUDA cannot say: CPU machines)."""
    try:
        from cupy.cuda import runtime

        return _pci_address(runtime.deviceGetPCIBusId(device_id))
    except Exception:
        return None


def gpu_bus_id() -> str:
    """The PCI bus id of the current CUDA device (``cudaDeviceGetPCIBusId``)."""
    from cupy.cuda import runtime

    return runtime.deviceGetPCIBusId(runtime.getDevice())


def can_map_peers(my_bus_id: str, peer_bus_ids: Sequence[str]) -> bool:
    """Whether this rank's GPU can map the memory of the GPUs at ``peer_bus_ids`` (P2P probe).

    A peer on the same GPU counts as mappable (ranks sharing a GPU in tests); a GPU this process
    cannot see (``deviceGetByPCIBusId`` fails) does not.
    """
    from cupy.cuda import runtime

    mine = _pci_address(my_bus_id)
    my_device = runtime.getDevice()
    for bus_id in peer_bus_ids:
        address = _pci_address(bus_id)
        if address == mine:
            continue
        try:
            device = runtime.deviceGetByPCIBusId(address)
        except runtime.CUDARuntimeError:
            return False
        if device != my_device and not runtime.deviceCanAccessPeer(my_device, device):
            return False
    return True


def discover_topology(group: Any, ranks_per_node: Optional[int] = None,
                      peers_mappable: Optional[bool] = None) -> NodeTopology:
    """Find the nodes of ``group`` (collective: every rank calls it with the same settings).

    Args:
        group: a :class:`deepep_cupy.groups.group.Group`.
        ranks_per_node: split the group into simulated nodes of this many consecutive ranks
            (default: :data:`RANKS_PER_NODE_ENV`, else the hosts). It must divide the group's
            size, and a simulated node never spans two hosts. ``1``: every GPU its own node.
        peers_mappable: ``True``: trust that the GPUs of a host map each other's memory (no
            probe); ``False``: they do not (every GPU its own node); ``None``: probe with CUDA's
            ``deviceCanAccessPeer`` (needs a current CUDA device).

    Returns:
        This rank's :class:`NodeTopology`.

    Raises:
        ValueError: the hosts hold unequal or non-consecutive runs of ranks, or ``ranks_per_node``
            does not fit them.
        RankMismatchError: ranks asked for different settings.
    """
    requested = _requested_ranks_per_node(ranks_per_node)
    if peers_mappable is not None and not isinstance(peers_mappable, bool):
        raise TypeError(f"peers_mappable: expected True, False or None, got {peers_mappable!r}")
    probe = requested is None and peers_mappable is None
    mine = (group.host_name(), requested, peers_mappable, gpu_bus_id() if probe else None)
    everyone = group.allgather(mine)
    settings = [(e[1], e[2]) for e in everyone]
    if len(set(settings)) > 1:
        raise RankMismatchError(f"ranks_per_node/peers_mappable: ranks disagree, got {settings} (rank order)")
    size, rank = len(everyone), group.rank
    host_L = _host_ranks_per_node([e[0] for e in everyone])
    if requested is not None:
        if size % requested or host_L % requested:
            raise ValueError(f"ranks_per_node: {requested} must divide the ranks of every host ({host_L}) "
                             f"and of the group ({size})")
        return NodeTopology(rank, size, requested)
    if peers_mappable is False or host_L == 1:
        return NodeTopology(rank, size, 1)
    if peers_mappable is True:
        return NodeTopology(rank, size, host_L)
    peers = [everyone[r][3] for r in NodeTopology(rank, size, host_L).node_ranks() if r != rank]
    verdicts = group.allgather(bool(can_map_peers(everyone[rank][3], peers)))
    return NodeTopology(rank, size, host_L if all(verdicts) else 1)
