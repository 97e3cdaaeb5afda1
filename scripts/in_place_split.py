"""How an in-place dispatch (``recv_x_in_buffer=True``) should split its blocks (mpirun -n 2).

    mpirun -n 2 python3 scripts/in_place_split.py [--sms 16,24,32] [--peer-blocks 8,12,16] [--rounds 2]

Per SM count: the copying dispatch, then the in-place one with each number of blocks that push to
the peers (``num_senders`` of its kernel; the others write the rank's own rows; ``num_sms``: no
split; ``*`` marks ``config.peer_blocks_in_place``'s choice), alternated ``--rounds`` times. Loop
time per call over 20 calls (no L2 flush) of cached BF16, cached FP8 and fresh BF16 dispatches
of the reference workload, CuPy inputs, max over ranks; ``exact``: every in-place output equals
the copying dispatch's.
"""

import cupy
from _mpi_timing import loop_us as timed
from _mpi_timing import rank_buffer, reference_workload, sweep_arguments
from mpi4py import MPI

import deepep_cupy as ep
from deepep_cupy.config import peer_blocks_in_place

args, sms_list = sweep_arguments(__doc__, "16,24,32", **{"--peer-blocks": dict(
    default="8,10,12,16", help="besides num_sms and the recommended split")})
comm = MPI.COMM_WORLD
rank, R = comm.Get_rank(), comm.Get_size()
buf = rank_buffer(comm, max(sms_list), args.tokens, recv_x_in_buffer=True)
workload = reference_workload(buf, rank, args.tokens, fp8=True)
x, x8 = workload["x"], workload["x8"]


def loop_us(fn):
    return timed(comm, fn)


def set_peer_blocks(value):
    """Every in-place plan's transfer launches with ``value`` pushing blocks from now on."""
    for key, plan in buf._engine.ctx.plans.items():
        if key[0] in ("dispatch", "cached dispatch") and key[-1] is True:
            plan.main.params.values.num_senders = value


def equal(a, b):
    if isinstance(a, tuple):
        return all(equal(u, v) for u, v in zip(a, b))
    return bool(cupy.array_equal(a, b))


def show(label, figures):
    gathered = comm.gather(figures, root=0)
    if rank == 0:
        print(label, "  ".join(f"{k} {max(g[k] for g in gathered):6.1f}" if isinstance(v, float)
                               else f"{k} {all(g[k] for g in gathered)}" for k, v in figures.items()), flush=True)


for sms in sms_list:
    config = ep.Config(sms, 4, 256)
    fresh = dict(workload["layout"], config=config)
    buf._engine.ctx.plans.clear()
    copied = buf.dispatch(x, **fresh)
    handle = copied[4]
    expected = [a.copy() for a in copied[:3]] + [handle[3].copy()]
    expected_fp8 = tuple(a.copy() for a in buf.dispatch(x8, handle=handle, config=config)[0])
    chosen = peer_blocks_in_place(sms, R)
    choices = {sms, chosen} | {int(v) for v in args.peer_blocks.split(",") if 0 < int(v) <= sms}
    for round_ in range(args.rounds):
        show(f"sms {sms:2d} round {round_} copying       ", dict(
            cached_bf16=loop_us(lambda: buf.dispatch(x, handle=handle, config=config)),
            cached_fp8=loop_us(lambda: buf.dispatch(x8, handle=handle, config=config)),
            fresh_bf16=loop_us(lambda: buf.dispatch(x, **fresh))))
        for peer_blocks in sorted(choices, reverse=True):
            first = buf.dispatch(x, **fresh, recv_x_in_buffer=True)[4]  # the plans, then their split
            buf.dispatch(x, handle=first, config=config, recv_x_in_buffer=True)
            buf.dispatch(x8, handle=first, config=config, recv_x_in_buffer=True)
            set_peer_blocks(peer_blocks)
            out = buf.dispatch(x, **fresh, recv_x_in_buffer=True)
            in_place = out[4]
            exact = all(equal(a, b) for a, b in zip([*out[:3], in_place[3]], expected))
            exact = exact and equal(buf.dispatch(x, handle=in_place, config=config, recv_x_in_buffer=True)[0],
                                    expected[0])
            exact = exact and equal(buf.dispatch(x8, handle=in_place, config=config, recv_x_in_buffer=True)[0],
                                    expected_fp8)
            mark = "*" if peer_blocks == chosen else " "
            show(f"sms {sms:2d} round {round_} peer blocks {peer_blocks:2d}{mark}", dict(
                cached_bf16=loop_us(lambda: buf.dispatch(x, handle=in_place, config=config, recv_x_in_buffer=True)),
                cached_fp8=loop_us(lambda: buf.dispatch(x8, handle=in_place, config=config, recv_x_in_buffer=True)),
                fresh_bf16=loop_us(lambda: buf.dispatch(x, **fresh, recv_x_in_buffer=True)),
                exact=exact))
buf.destroy()
