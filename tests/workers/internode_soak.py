"""The internode random-case soak: seeded cases (internode_cases.py) run under mpiexec, one process
per rank, by internode_random_worker.py, and checked against deepep_cupy.reference.internode.

Usage::

    python tests/workers/internode_soak.py --cases N --seed S [--timeout T] [--records]
    python tests/workers/internode_soak.py --seed S --cases 1            # one case alone (a failing seed)
    python tests/workers/internode_soak.py --seed S --cases N --list     # print the cases; no GPU needed

Starts ``mpiexec -n R`` (R: the most ranks among the cases) on the worker and passes its output
and exit status through (its ``FAIL`` lines, the ``SUMMARY``; see the worker). With fewer GPUs than
R the ranks share GPU 0 (tests/workers/one_gpu_ranks.py, as ``DEEPEP_TEST_ONE_GPU_MPI=1`` does
for the tests): processes sharing a GPU take turns on it, which is slow but runs every case; ranks
in one process (run_local_group) cannot share a GPU on the internode path (docs/TESTING.md).
Exit status 2 (and one sentence on stderr) when no GPU can be used.
"""

import argparse
import os
import subprocess
import sys

from internode_cases import describe_case, internode_cases

#: The worker and the launcher that puts processes on GPU 0, beside this script.
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "internode_random_worker.py")
ONE_GPU_RANKS = os.path.join(HERE, "one_gpu_ranks.py")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="how many cases (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first case (default 0)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="Buffer timeout_s of the cases (default: the worker's)")
    parser.add_argument("--records", action="store_true", help="print a CASE record for every case")
    parser.add_argument("--list", action="store_true", help="print the cases and run nothing")
    args = parser.parse_args(argv)
    if args.cases < 1:
        parser.error(f"--cases: expected at least 1, got {args.cases}")
    if args.seed < 0:
        parser.error(f"--seed: expected a non-negative seed, got {args.seed}")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout: expected a positive number of seconds, got {args.timeout}")
    return args


def mpiexec_command(mpiexec, num_ranks, num_gpus, worker_args):
    """``mpiexec -n num_ranks python [one_gpu_ranks.py] worker args``: the ranks share GPU 0 when
    there are fewer GPUs than ranks."""
    shared = [ONE_GPU_RANKS] if num_gpus < num_ranks else []
    return [mpiexec, "-n", str(num_ranks), sys.executable, *shared, WORKER, *worker_args]


def main(argv):
    args = parse_args(argv)
    cases = internode_cases(args.seed, args.cases)
    if args.list:
        for case in cases:
            print(describe_case(case))
        return 0
    from deepep_cupy.gpu.check import exit_unless_gpu

    exit_unless_gpu("the internode soak (tests/workers/internode_soak.py)")
    import cupy

    sys.path.insert(0, os.path.dirname(HERE))  # tests/: how the tests find and start mpiexec
    from _harness import find_mpiexec, mpi_env

    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise SystemExit("no mpiexec/mpirun found (set MPIEXEC, or install the 'test' extra: mpich)")
    num_ranks = max(c["num_ranks"] for c in cases)
    num_gpus = cupy.cuda.runtime.getDeviceCount()
    worker_args = ["--seed", str(args.seed), "--cases", str(args.cases)]
    worker_args += ["--timeout", str(args.timeout)] if args.timeout is not None else []
    worker_args += ["--records"] if args.records else []
    command = mpiexec_command(mpiexec, num_ranks, num_gpus, worker_args)
    where = "sharing GPU 0" if num_gpus < num_ranks else f"on GPUs 0..{num_ranks - 1}"
    print(f"internode soak: {args.cases} cases, seeds {args.seed}..{args.seed + args.cases - 1}, "
          f"{num_ranks} processes {where}: {' '.join(command)}", flush=True)
    return subprocess.call(command, env=mpi_env())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
