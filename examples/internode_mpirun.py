"""Expert-parallel dispatch and combine across nodes with mpirun: one process per GPU, an internode
Buffer (``num_rdma_bytes > 0``), tokens routed to a few node groups as DeepSeek-V3 routes them.

Across two nodes of 8 GPUs, with a hostfile naming them::

    $ cat hosts
    node0 slots=8
    node1 slots=8
    $ mpirun -np 16 --hostfile hosts -x PYTHONPATH python examples/internode_mpirun.py

On one machine, split into simulated nodes of 2 ranks (every byte between "nodes" still goes
through the rail transport)::

    $ DEEPEP_CUPY_RANKS_PER_NODE=2 mpirun -np 4 python examples/internode_mpirun.py

Choose the transport with ``--transport nccl|mpi`` (or ``DEEPEP_CUPY_TRANSPORT``); by default the
library picks one. It runs, as DeepEP's internode test does: the layout (with the per-node counts),
dispatch in BF16 and FP8, synchronous and asynchronous after ``Buffer.capture()``, a cached
dispatch, combine with two biases, and checks every result from first principles (each rank's
rows hold its rank number, so a received row names its sender and a combined row counts the ranks
it went to). It prints one line per check on rank 0 and ``internode_mpirun: passed`` at the end.
"""

import argparse

import cupy
import numpy as np
from mpi4py import MPI

import deepep_cupy as ep
from deepep_cupy.reference import intranode as reference
from deepep_cupy.gpu.check import exit_unless_gpu


def grouped_routing(rng, num_tokens, num_experts, num_topk, num_nodes, num_groups):
    """Top-k experts from ``num_groups`` of the nodes per token (DeepSeek-V3's node-limited routing)."""
    scores = rng.random((num_tokens, num_experts)) + 1.0
    per_node = scores.reshape(num_tokens, num_nodes, -1)
    groups = np.argsort(-per_node.max(axis=2), axis=1)[:, :num_groups]
    allowed = np.zeros((num_tokens, num_nodes), dtype=bool)
    np.put_along_axis(allowed, groups, True, axis=1)
    masked = np.where(np.repeat(allowed, num_experts // num_nodes, axis=1), scores, -np.inf)
    return np.argsort(-masked, axis=1)[:, :num_topk].astype(np.int64)


def bf16_bits(value: float) -> int:
    return int(reference.float32_to_bfloat16_bits(np.float32(value)))


def check(comm, condition, what):
    ok = comm.allreduce(bool(condition), op=MPI.LAND)
    if comm.Get_rank() == 0:
        print(f"  {what}: {'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        raise SystemExit(f"internode_mpirun: {what} failed")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--num-topk-groups", type=int, default=2, help="nodes a token's experts may come from")
    parser.add_argument("--transport", choices=("nccl", "mpi"), default=None)
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    rank, num_ranks = comm.Get_rank(), comm.Get_size()
    # Without a GPU or driver: one sentence (from rank 0 alone) and exit status 2, no traceback.
    exit_unless_gpu("examples/internode_mpirun.py", say=rank == 0)
    local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    cupy.cuda.Device(local_rank % cupy.cuda.runtime.getDeviceCount()).use()
    T, H, K, E = args.num_tokens, args.hidden, args.num_topk, args.num_experts

    # A rank forwards at most T tokens from each node into its node's NVLink stage.
    buffer = ep.Buffer(comm, ep.get_nvl_buffer_size_hint(H * 2, 8, num_max_tokens_per_rank=T * num_ranks),
                       ep.Config().get_rdma_buffer_size_hint(H * 2, num_ranks, num_max_tokens_per_rank=T),
                       internode_transport=args.transport)
    if buffer.topology is None:
        raise SystemExit("internode_mpirun: all ranks are on one node; set DEEPEP_CUPY_RANKS_PER_NODE to "
                         "split it into simulated nodes")
    num_nodes = buffer.topology.num_nodes
    if rank == 0:
        print(f"internode_mpirun: {num_ranks} ranks on {num_nodes} nodes of {buffer.topology.ranks_per_node}, "
              f"transport {buffer.internode_transport}", flush=True)

    rng = np.random.default_rng(rank)
    topk_idx = cupy.asarray(grouped_routing(rng, T, E, K, num_nodes, min(args.num_topk_groups, num_nodes)))
    x = cupy.full((T, H), bf16_bits(rank), dtype=cupy.uint16)  # BF16 as its bits
    weights = cupy.full((T, K), float(rank), dtype=cupy.float32)

    per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    owners = topk_idx // (E // num_ranks)
    want_in_rank = cupy.zeros((T, num_ranks), dtype=bool)
    want_in_rank[cupy.repeat(cupy.arange(T), K), owners.ravel()] = True
    check(comm, bool((in_rank == want_in_rank).all()), "is_token_in_rank")
    nodes_of = want_in_rank.reshape(T, num_nodes, -1).any(axis=2)
    check(comm, bool((per_node == nodes_of.sum(axis=0)).all()), "num_tokens_per_rdma_rank (tokens per node)")

    received_per_rank = comm.allreduce(cupy.asnumpy(per_rank).astype(np.int64), op=MPI.SUM)
    received_per_expert = comm.allreduce(cupy.asnumpy(per_expert).astype(np.int64), op=MPI.SUM)
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert)
    fp8 = (cupy.full((T, H), 0x38, dtype=cupy.uint8), cupy.ones((T, H // 128), dtype=cupy.float32))  # e4m3 1.0
    for name, rows, asynchronous in (("BF16", x, False), ("BF16 async", x, True), ("FP8", fp8, False)):
        previous = buffer.capture() if asynchronous else None
        recv_x, recv_topk, recv_weights, counts, handle, event = buffer.dispatch(
            rows, topk_idx=topk_idx, topk_weights=weights, previous_event=previous, async_finish=asynchronous,
            **layout)
        if asynchronous:
            event.current_stream_wait()
        recv_rows = recv_x[0] if isinstance(recv_x, tuple) else recv_x
        check(comm, recv_rows.shape[0] == received_per_rank[rank], f"dispatch {name}: received rows")
        local = E // num_ranks
        check(comm, counts == received_per_expert[rank * local:(rank + 1) * local].tolist(),
              f"dispatch {name}: tokens per local expert")
        if rows is x:
            senders = reference.bfloat16_bits_to_float32(cupy.asnumpy(recv_rows))
            sender_of_row = np.broadcast_to(senders[:, :1], (len(senders), K))
            local_entries = cupy.asnumpy(recv_topk) >= 0
            check(comm, bool((senders == senders[:, :1]).all()), f"dispatch {name}: every row is one sender's")
            check(comm, bool((cupy.asnumpy(recv_weights)[local_entries] == sender_of_row[local_entries]).all()),
                  f"dispatch {name}: the weights of local experts come with their row")

    recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **layout)
    cached, *_ = buffer.dispatch(x, handle=handle)
    check(comm, bool((cached == recv_x).all()), "cached dispatch: the same rows")

    bias_0 = cupy.full((T, H), bf16_bits(1.0), dtype=cupy.uint16)
    bias_1 = cupy.full((T, H), bf16_bits(0.5), dtype=cupy.uint16)
    combined, combined_weights, _ = buffer.combine(recv_x, handle, topk_weights=recv_weights, bias=(bias_0, bias_1))
    copies = cupy.asnumpy(want_in_rank.sum(axis=1)).astype(np.float32)
    sums = reference.bfloat16_bits_to_float32(cupy.asnumpy(combined))
    # Small whole numbers: every partial sum is exact, only the final BF16 rounding remains.
    want = reference.bfloat16_bits_to_float32(reference.float32_to_bfloat16_bits(1.5 + rank * copies))
    check(comm, bool(np.all(sums == want[:, None])), "combine: biases plus one copy per rank")
    # Each top-k entry's weight comes back from the one rank owning its expert (0 from the others).
    check(comm, bool(np.all(cupy.asnumpy(combined_weights) == rank)), "combine: each top-k weight back once")

    buffer.destroy()
    if rank == 0:
        print("internode_mpirun: passed", flush=True)


if __name__ == "__main__":
    main()
