"""A combine that sends its rows against one that reads them where they lie (mpirun -n 2).

    mpirun -n 2 python3 scripts/combine_in_place.py [--sms 8,16,24,32] [--rounds 2]

Per SM count: a fresh BF16 dispatch of the reference workload (CuPy inputs) with rows in place
makes the handle and leaves recv_x and recv_topk_weights in the NVLink buffer. "sent": the combine
of copies of them (its senders push the rows to their owners); "in place": the combine of the
views themselves (every block reduces, reading the other ranks' rows over NVLink). Alternated
``--rounds`` times; loop time per call over 20 calls (no L2 flush), max over ranks; ``exact``: the
in-place outputs equal the sent ones bit for bit.
"""

import cupy
from _mpi_timing import loop_us, rank_buffer, reference_workload, sweep_arguments
from mpi4py import MPI

import deepep_cupy as ep

args, sms_list = sweep_arguments(__doc__, "8,16,24,32")
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
buf = rank_buffer(comm, max(sms_list), args.tokens, recv_x_in_buffer=True)
workload = reference_workload(buf, rank, args.tokens)


def copy(a):
    out = cupy.empty_like(a)
    out.data.copy_from_device_async(a.data, a.nbytes)
    return out


for sms in sms_list:
    config = ep.Config(sms, 4, 256)
    for round_ in range(args.rounds):
        # The sent combine's regions overlap the rows in place: dispatch again before each variant.
        view_x, _, view_w, _, handle, _ = buf.dispatch(workload["x"], **workload["layout"], config=config,
                                                       recv_x_in_buffer=True)
        x_copy, w_copy = copy(view_x), copy(view_w)
        sent = lambda: buf.combine(x_copy, handle, topk_weights=w_copy, config=config)  # noqa: E731
        expected = [a.copy() for a in sent()[:2]]
        sent_us = loop_us(comm, sent)
        view_x, _, view_w, _, handle, _ = buf.dispatch(workload["x"], **workload["layout"], config=config,
                                                       recv_x_in_buffer=True)
        in_place = lambda: buf.combine(view_x, handle, topk_weights=view_w, config=config)  # noqa: E731
        got = in_place()
        exact = all(bool(cupy.array_equal(a, b)) for a, b in zip(got[:2], expected))
        in_place_us = loop_us(comm, in_place)
        figures = comm.gather((sent_us, in_place_us, exact), root=0)
        if rank == 0:
            print(f"sms {sms:2d} round {round_}: sent {max(f[0] for f in figures):7.1f} us, in place "
                  f"{max(f[1] for f in figures):7.1f} us, exact {all(f[2] for f in figures)}", flush=True)
buf.destroy()
