"""Compile every kernel instance a group of R ranks may use into CuPy's disk cache, in parallel.

Usage: ``python tests/workers/warm_kernels.py R [R ...]``. Each instance is its own module
(deepep_cupy.gpu.kernels.get_kernel), compiled by NVRTC in a process of its own here, so a GPU run
whose ranks would otherwise compile them one after the other (and all at once) finds them cached.
"""

import multiprocessing
import sys
import time


def instances(num_ranks):
    from deepep_cupy.gpu import kernels

    names = [e for expressions in kernels.SOURCES.values() for e in expressions if "<" not in e]
    for args in ((num_ranks,), (num_ranks, "true"), (num_ranks, "false", "true"), (num_ranks, "true", "true")):
        names.append(kernels.name_expression("dispatch_kernel", args))
    for element in kernels.COMBINE_ELEMENTS.values():
        names.append(kernels.name_expression("combine_kernel", (element, num_ranks)))
        names.append(kernels.name_expression("combine_kernel", (element, num_ranks, "true")))
    return names


def compile_one(name):
    import cupy

    from deepep_cupy.gpu import kernels

    cupy.cuda.Device(0).use()
    start = time.time()
    kernels.get_kernel(name)
    return name, round(time.time() - start, 1)


if __name__ == "__main__":
    names = sorted({n for r in (sys.argv[1:] or ["2"]) for n in instances(int(r))})
    with multiprocessing.get_context("spawn").Pool(min(len(names), 12)) as pool:
        for name, seconds in pool.imap_unordered(compile_one, names):
            print(f"{seconds:6.1f} s  {name}", flush=True)
