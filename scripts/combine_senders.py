"""How many blocks of a combine should push rows back to their owners (mpirun -n 2).

    mpirun -n 2 python3 scripts/combine_senders.py [--sms 12,16,24] [--senders 5,6,7,8] [--rounds 2]

Per SM count: a fresh BF16 dispatch of the reference workload (CuPy inputs) makes the handle, then
its combine runs with each number of sender blocks (``num_senders`` of the combine plan's kernel;
``*`` marks ``config.combine_sender_blocks``'s choice), alternated ``--rounds`` times. Loop time per
call over 20 calls (no L2 flush), max over ranks; ``exact``: the outputs equal those of the
recommended split.
"""

import cupy
from _mpi_timing import loop_us, rank_buffer, reference_workload, sweep_arguments
from mpi4py import MPI

import deepep_cupy as ep
from deepep_cupy.config import combine_sender_blocks

args, sms_list = sweep_arguments(__doc__, "12,16,24", **{"--senders": dict(
    default="5,6,7,8,9,10", help="besides the recommended count (fewer than the SMs)")})
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
buf = rank_buffer(comm, max(sms_list), args.tokens)
workload = reference_workload(buf, rank, args.tokens)


for sms in sms_list:
    config = ep.Config(sms, 4, 256)
    buf._engine.ctx.plans.clear()
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(workload["x"], **workload["layout"], config=config)
    combine = lambda: buf.combine(recv_x, handle, topk_weights=recv_w, config=config)  # noqa: E731
    expected = [a.copy() for a in combine()[:2]]
    plan = next(p for key, p in buf._engine.ctx.plans.items() if key[0] == "combine")
    chosen = combine_sender_blocks(sms)
    choices = sorted({chosen} | {int(v) for v in args.senders.split(",") if 0 < int(v) < sms})
    for round_ in range(args.rounds):
        for senders in choices:
            plan.main.params.values.num_senders = senders
            got = combine()
            exact = all(bool(cupy.array_equal(a, b)) for a, b in zip(got[:2], expected))
            figures = comm.gather((loop_us(comm, combine), exact), root=0)
            if rank == 0:
                print(f"sms {sms:2d} round {round_} senders {senders:2d}{'*' if senders == chosen else ' '} "
                      f"{max(f[0] for f in figures):7.1f} us  exact {all(f[1] for f in figures)}", flush=True)
    plan.main.params.values.num_senders = chosen
buf.destroy()
