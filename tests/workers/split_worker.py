"""MPI worker for tests/test_group_split.py: splits MPI.COMM_WORLD into nodes of two ranks, into
rails (even and odd ranks) and into one part in reverse order, and prints ``RESULT {json}``."""

from comm_worker import report_or_abort  # run as a script: its folder is on sys.path


def main() -> dict:
    from mpi4py import MPI

    from deepep_cupy.groups.group import MPIGroup
    from deepep_cupy.groups.nodes import discover_topology

    group = MPIGroup(MPI.COMM_WORLD)
    rank, size = group.rank, group.size
    nodes = group.split([[n, n + 1] for n in range(0, size, 2)])
    rails = group.split([list(range(local, size, 2)) for local in range(2)])
    backwards = group.split([list(range(size - 1, -1, -1))])
    simulated = discover_topology(group, ranks_per_node=2)
    one_host = discover_topology(group, peers_mappable=True)
    record = {
        "rank": rank,
        "topology": [list(simulated), simulated.rail_ranks(), list(one_host)],
        "node": [nodes.rank, nodes.size, nodes.allgather(rank)],
        "rail": [rails.rank, rails.size, rails.allgather(rank)],
        "reversed": [backwards.rank, backwards.size, backwards.allgather(rank)],
    }
    nodes.barrier()
    for sub in (nodes, rails, backwards):
        sub.free()
    record["freed"] = all(sub.comm is None for sub in (nodes, rails, backwards))
    group.barrier()
    return record


if __name__ == "__main__":
    report_or_abort(main)
