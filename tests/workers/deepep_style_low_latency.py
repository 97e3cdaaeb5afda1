"""DeepEP's low-latency test, as its user would run it after ``import deepep_cupy as deep_ep``.

The calls and checks of DeepEP's tests/test_low_latency.py, written here from its API: BF16 and
FP8 dispatch (plain, ``round_scale``, ``use_ue8m0``), with and without the receive hook, with the
per-expert receive statistics, each received row checked against the sender's token (rank-valued
rows, token index in the last 128 channels), then combine, plain and zero-copy, checked against
the weighted sum of the tokens. PyTorch tensors throughout. Two differences from DeepEP's script,
both about running it here: every rank's top-k comes from the group's ``allgather`` instead of
``torch.distributed.all_gather_into_tensor``, and ``together()`` (a group barrier where ranks
share a GPU in one process, a no-op otherwise) comes before each call.
"""

import random

import numpy as np

import deepep_cupy as deep_ep

RANK_OFFSET = 128  # rows of rank r hold r - 128: exact in BF16 and in FP8 after scaling


def per_token_cast_back(x_fp8, x_scales):
    """FP8 rows and their per-128-channel scales (float32, or UE8M0 int32) back to BF16."""
    import torch

    if x_scales.dtype == torch.int:
        x_scales = (x_scales.view(dtype=torch.uint8).to(torch.int) << 23).view(dtype=torch.float)
    values = x_fp8.to(torch.float32).view(x_fp8.size(0), -1, 128)
    return (values * x_scales.view(x_fp8.size(0), -1, 1)).view(x_fp8.shape).to(torch.bfloat16)


def calc_diff(x, y):
    """DeepEP's similarity measure: 0 for equal tensors."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)


def test_main(buffer, num_tokens, hidden, num_experts, num_topk, rank, num_ranks, all_gather, together, seed=0):
    import cupy
    import torch

    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    device = torch.device("cuda", cupy.cuda.Device().id)
    num_local_experts = num_experts // num_ranks

    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16, device=device) * (rank - RANK_OFFSET)
    x[:, -128:] = torch.arange(num_tokens, device=device).to(torch.bfloat16).view(-1, 1)
    x_pure_rand = torch.randn((num_tokens, hidden), dtype=torch.bfloat16, device=device) * 0.1
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32, device=device).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=True)[1]
    topk_weights = torch.randn((num_tokens, num_topk), dtype=torch.float32, device=device).abs()
    for _ in range(10):
        topk_idx[random.randint(0, num_tokens - 1), random.randint(0, num_topk - 1)] = -1
    all_topk_idx = torch.as_tensor(np.stack(all_gather(topk_idx.cpu().numpy())), device=device)

    calls = 0
    for current_x in (x, x_pure_rand):
        for return_recv_hook in (False, True):
            for use_fp8 in (False, True):
                for round_scale in ((False, True) if use_fp8 else (False,)):
                    for use_ue8m0 in ((False, True) if round_scale else (False,)):
                        calls += 1
                        for _ in range(calls % 2 + 1):  # sometimes twice in a row
                            stats = torch.zeros((num_local_experts,), dtype=torch.int, device=device)
                            together()
                            recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
                                current_x, topk_idx, num_tokens, num_experts, use_fp8=use_fp8,
                                round_scale=round_scale, use_ue8m0=use_ue8m0,
                                cumulative_local_expert_recv_stats=stats, async_finish=not return_recv_hook,
                                return_recv_hook=return_recv_hook)
                            hook() if return_recv_hook else event.current_stream_wait()
                            torch.cuda.current_stream().synchronize()
                        if use_fp8:
                            recv_x = (recv_x[0], recv_x[1].contiguous())
                            expert_x = per_token_cast_back(recv_x[0].view(-1, hidden),
                                                           recv_x[1].view(-1, recv_x[1].shape[-1]))
                            expert_x = expert_x.view(recv_x[0].shape)
                        else:
                            expert_x = recv_x.clone()
                        for i in range(num_local_experts):
                            expert = rank * num_local_experts + i
                            rows = per_token_cast_back(recv_x[0][i], recv_x[1][i]) if use_fp8 else recv_x[i]
                            count = int(recv_count[i].item())
                            src_info, layout_range = handle[0][i], handle[1][i]
                            low = (1 << 32) - 1
                            assert int(stats[i].item()) == count, (int(stats[i].item()), count)
                            assert int((layout_range & low).sum().item()) == count
                            assert int((all_topk_idx == expert).sum().item()) == count
                            if current_x is x:
                                rows = rows[:count]
                                row_min = rows[:, :-128].amin(dim=-1)
                                assert torch.equal(row_min, rows[:, :-128].amax(dim=-1))
                                sources = src_info[:count]
                                if round_scale:
                                    assert calc_diff(rows[:, -1], sources.view(-1)) < 0.007
                                else:
                                    assert int((rows[:, -128:] - (sources.view(-1, 1) % num_tokens)).abs().sum()) == 0
                                for j in range(num_ranks):
                                    begin, from_j = int(layout_range[j].item()) >> 32, int(layout_range[j].item()) & low
                                    if not round_scale:
                                        assert int((row_min == j - RANK_OFFSET).sum()) == \
                                            int((all_topk_idx[j] == expert).sum())
                                    block = rows[begin:begin + from_j, :-128].float()
                                    if not round_scale:
                                        assert bool((block == j - RANK_OFFSET).all())
                                    elif block.numel():
                                        assert calc_diff(block, torch.full_like(block, j - RANK_OFFSET)) < 0.007
                        for zero_copy in (False, True):
                            if zero_copy:
                                buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = expert_x
                            out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=device)
                            torch.cuda.current_stream().synchronize()
                            together()
                            combined_x, event, hook = buffer.low_latency_combine(
                                expert_x, topk_idx, topk_weights, handle, async_finish=not return_recv_hook,
                                zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out)
                            hook() if return_recv_hook else event.current_stream_wait()
                            torch.cuda.current_stream().synchronize()
                            assert combined_x is out
                            weights = topk_weights.masked_fill(topk_idx == -1, 0).sum(dim=1).view(-1, 1)
                            diff = calc_diff(current_x * weights, combined_x)
                            assert torch.isnan(combined_x).sum().item() == 0
                            assert diff < (7e-4 if use_fp8 else 1e-5), (diff, use_fp8, zero_copy)
    return calls


def test_loop(group, together, num_tokens=128, hidden=7168, num_topk=8, experts_per_rank=8):
    """Create the Buffer as DeepEP's test does, run the checks, destroy it."""
    rank, num_ranks = group.rank, group.size
    num_experts = experts_per_rank * num_ranks
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=num_experts // num_ranks, allow_nvlink_for_low_latency_mode=True)
    try:
        return test_main(buffer, num_tokens, hidden, num_experts, min(num_topk, num_experts), rank, num_ranks,
                         group.allgather, together, seed=1)
    finally:
        together()
        buffer.destroy()
