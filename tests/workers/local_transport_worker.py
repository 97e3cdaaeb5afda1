"""The local rail transport on GPUs: N rank threads of one process (rank r on GPU r % G), each
made by make_transport on an in-process group, random byte counts (zeros included), the received
bytes compared exactly. Prints one ``RESULT {json}`` per rank.

Usage: ``python local_transport_worker.py N``
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def rank_main(group):
    import cupy
    from transport_fakes import expected_recv, packed_send, random_counts

    from deepep_cupy.transports import make_transport

    t = make_transport(None, group, list(range(group.size)), cupy.cuda.Device().id, timeout_s=60)
    rng = np.random.default_rng(99)   # the same matrices on every rank
    cases = [[[0] * group.size] * group.size] + [random_counts(rng, group.size, 70000) for _ in range(8)]
    stream = cupy.cuda.get_current_stream()
    mismatches = []
    for i, counts in enumerate(cases):
        rank = t.rank
        send = cupy.asarray(packed_send(rank, counts, i)) if sum(counts[rank]) else cupy.empty(1, cupy.uint8)
        recv_bytes = [counts[p][rank] for p in range(t.size)]
        recv = cupy.full(sum(recv_bytes) + 1, 0xEE, cupy.uint8)
        t.alltoallv(send.data.ptr, counts[rank], recv.data.ptr, recv_bytes, stream.ptr)
        # Work queued on the stream afterwards sees the bytes: copy them out on the same stream.
        got = cupy.asnumpy(recv, stream=stream)
        stream.synchronize()
        if not (np.array_equal(got[:-1], expected_recv(rank, counts, i)) and got[-1] == 0xEE):
            mismatches.append(i)
    ints = t.alltoall_ints([10 * t.rank + p for p in range(t.size)])
    t.close()
    return {"rank": group.rank, "name": t.name, "device": cupy.cuda.Device().id, "mismatches": mismatches,
            "cases": len(cases), "ints": ints}


if __name__ == "__main__":
    from deepep_cupy.groups.local import run_local_group

    for record in run_local_group(rank_main, num_ranks=int(sys.argv[1]), timeout_s=120):
        sys.stdout.write("RESULT " + json.dumps(record) + "\n")
    sys.stdout.flush()
