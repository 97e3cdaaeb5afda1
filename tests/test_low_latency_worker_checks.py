"""The low-latency GPU worker's cases and checks, run on the CPU against a stand-in Buffer.

The stand-in answers every call with the NumPy model (ranks as threads exchanging their inputs), so
the cases must pass with it, and a single wrong byte in what it returns must fail them: the GPU
run then checks the kernels, not the worker.
"""

import sys
from types import SimpleNamespace

import numpy as np
import pytest
from _harness import WORKERS

import deepep_cupy as ep
from deepep_cupy.reference import low_latency as ll

sys.path.insert(0, str(WORKERS))
import low_latency_worker as worker  # noqa: E402  (a script's folder)

#: The cases that need a GPU library (graphs, PyTorch) or the kernels' own reports.
GPU_ONLY = {"graph_cupy", "graph_torch", "graph_torch_hook_fp8", "graph_torch_async", "graph_cupy_async",
            "masked_rank_shrink",
            "deepep_style_torch", "bad_expert_id_is_reported",
            "lone_call_times_out"}
CPU_CASES = [c for c in worker.CASES if c not in GPU_ONLY]


class ReferenceBuffer:
    """One rank's low-latency calls answered by the NumPy model; ``corrupt`` flips a received byte."""

    def __init__(self, group, corrupt=None):
        self.group, self.corrupt, self.area = group, corrupt, None

    def low_latency_dispatch(self, x, topk_idx, M, E, cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True, round_scale=False, use_ue8m0=False,
                             async_finish=False, return_recv_hook=False):
        everyone = self.group.allgather((np.asarray(x), np.asarray(topk_idx)))
        results = ll.dispatch([e[0] for e in everyone], [e[1] for e in everyone], M, E, use_fp8=use_fp8,
                              round_scale=round_scale, use_ue8m0=use_ue8m0)
        mine = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in results[self.group.rank].items()}
        if self.corrupt == "recv_x" and mine["recv_count"][0] > 0:
            mine["recv_x"][0, 0, 0] ^= 1
        if self.corrupt == "scales" and use_fp8 and mine["recv_count"][0] > 0:
            mine["scales"][0, 0, 0] += 1
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += mine["recv_count"]
        recv = (mine["recv_x"], mine["scales"]) if use_fp8 else mine["recv_x"]
        handle = ep.low_latency.LowLatencyHandle(mine["src_info"], mine["layout_range"], M, x.shape[1], E)
        self.results = getattr(self, "results", {})
        self.results[id(handle.src_info)] = results
        event = SimpleNamespace(current_stream_wait=lambda: None)
        return recv, mine["recv_count"], handle, event, (lambda: None) if return_recv_hook else None

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        self.group.barrier()

    def get_next_low_latency_combine_buffer(self, handle):
        L, rows = handle.src_info.shape
        self.area = np.zeros((L, rows, handle.hidden), np.uint16)
        return self.area

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False,
                            async_finish=False, return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
        rows = self.area if zero_copy else np.asarray(x)
        everyone = self.group.allgather((rows, np.asarray(topk_idx), np.asarray(topk_weights)))
        results = self.results[id(handle.src_info)]
        combined = ll.combine([e[0] for e in everyone], [e[1] for e in everyone], [e[2] for e in everyone], results,
                              ranks=[self.group.rank], use_logfmt=use_logfmt)[self.group.rank]
        if self.corrupt == "combined" and combined.size:
            combined[-1, -1] ^= 1
        event = SimpleNamespace(current_stream_wait=lambda: None)
        return combined, event, (lambda: None) if return_recv_hook else None


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(worker, "to_device", lambda a, lib="cupy": a.full() if isinstance(a, worker.ExpertRows)
                        else np.array(a))
    monkeypatch.setattr(worker, "to_numpy", np.asarray)
    monkeypatch.setattr(worker.Ctx, "synchronize", lambda self: None)


def run_cases(names, num_ranks=2, corrupt=None):
    def rank(group):
        ctx = worker.Ctx.__new__(worker.Ctx)
        ctx.group, ctx.buf, ctx.sharing = group, ReferenceBuffer(group, corrupt), False
        ctx.rank, ctx.R, ctx.E, ctx.L, ctx.device = group.rank, group.size, 4 * group.size, 4, 0
        outcome = {}
        for name in names:
            try:
                worker.run_case(ctx, name)
                outcome[name] = None
            except worker.Mismatch as exc:
                outcome[name] = str(exc)
        return outcome

    return ep.run_local_group(rank, num_ranks, use_devices=False)


@pytest.mark.parametrize("case", CPU_CASES)
def test_every_case_passes_with_the_model_answering(on_cpu, case):
    assert run_cases([case]) == [{case: None}] * 2


@pytest.mark.parametrize("corrupt, case, what", [
    ("recv_x", "bf16_eager", "recv_x[0]"), ("recv_x", "fp8_hook", "recv_x[0]"), ("scales", "fp8_eager", "scales[0]"),
    ("combined", "fp8_ue8m0_eager", "combined_x"), ("combined", "zero_copy", "combined_x"),
])
def test_a_single_wrong_byte_fails_the_case(on_cpu, corrupt, case, what):
    outcomes = run_cases([case], corrupt=corrupt)
    assert any(o[case] and what in o[case] for o in outcomes), outcomes


def test_the_cpu_run_leaves_out_only_the_cases_that_need_a_gpu():
    assert set(worker.CASES) - set(CPU_CASES) == GPU_ONLY and GPU_ONLY <= set(worker.CASES)
