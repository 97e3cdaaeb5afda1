"""A DeepEP intranode script that runs on deepep_cupy: only the import line differs.

It is written against DeepEP's documented intranode API, the way its README example and its
intranode test call it: ranks started with ``torch.multiprocessing.spawn`` (or by ``mpirun`` /
``torchrun``) and ``torch.distributed.init_process_group``, a ``Buffer`` on a ProcessGroup,
``get_dispatch_layout``, dispatch in BF16 and FP8 (scales column-major, as DeepEP's test passes
them), with and without top-k, synchronous and asynchronous, after ``Buffer.capture()``, with
``num_worst_tokens``, cached dispatch, combine with biases, and the README's forward/backward
helpers. Every result is checked against what it must be; the script prints one line per
section and ``deepep_intranode: passed`` at the end (exit status 0).

    python examples/deepep_intranode.py                  # spawns one process per GPU
    mpirun -n 2 python examples/deepep_intranode.py      # or: torchrun --nproc-per-node 2 ...

Options: --num-processes, --num-tokens, --hidden, --num-topk, --num-experts.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist

import deepep_cupy as deep_ep  # the only change: was `import deep_ep`

FP8_BLOCK = 128
FP8_MAX = 448.0


# --- helpers of the kind DeepEP's tests keep in their utils -------------------------------------

def launcher_rank():
    """``(rank, world size, local rank)`` when mpirun or torchrun started this process, else None."""
    for rank, size, local in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                              ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
                              ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        if rank in os.environ and size in os.environ:
            return int(os.environ[rank]), int(os.environ[size]), int(os.environ.get(local, os.environ[rank]))
    return None


def init_dist(local_rank: int, num_local_ranks: int):
    rank = local_rank
    torch.cuda.set_device(local_rank)
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29511"))
    dist.init_process_group("nccl", init_method=f"tcp://{address}:{port}", world_size=num_local_ranks, rank=rank)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    return dist.get_rank(), dist.get_world_size(), dist.new_group(list(range(num_local_ranks)))


def per_token_cast_to_fp8(x: torch.Tensor):
    """BF16 ``[n, h]`` -> (FP8 E4M3 ``[n, h]``, float32 scales ``[n, h / 128]``), one scale per block."""
    blocks = x.float().view(x.size(0), -1, FP8_BLOCK)
    scales = blocks.abs().amax(dim=2).clamp(min=1e-4) / FP8_MAX
    values = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn)
    return values.view(x.shape), scales


def per_token_cast_back(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    blocks = values.float().view(values.size(0), -1, FP8_BLOCK) * scales.unsqueeze(2)
    return blocks.view(values.shape).to(torch.bfloat16)


def similarity_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """1 - cosine similarity of ``a + 1`` and ``b + 1``: about 0 for equal tensors, small for
    tensors that differ by rounding."""
    a, b = a.double() + 1, b.double() + 1
    return (1 - 2 * (a * b).sum() / (a * a + b * b).sum()).item()


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def check_rows_come_from_their_rank(recv: torch.Tensor, rank_prefix_matrix: torch.Tensor, rank: int) -> None:
    """Rows of x = ones * source rank arrive grouped by source rank, in rank order."""
    begin = 0
    for source in range(rank_prefix_matrix.size(0)):
        end = rank_prefix_matrix[source][rank].item()
        block = recv[begin:end].float()
        expect(bool((block == source).all()), f"rows {begin}:{end} should all hold {source}")
        begin = end
    expect(begin == recv.size(0), "rank_prefix_matrix does not cover the received rows")


# --- the README's helpers ------------------------------------------------------------------------

_buffer = None


def get_buffer(group: dist.ProcessGroup, hidden_bytes: int) -> deep_ep.Buffer:
    global _buffer
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (deep_ep.Buffer.get_dispatch_config(group.size()), deep_ep.Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    if _buffer is None or _buffer.group != group or _buffer.num_nvl_bytes < num_nvl_bytes \
            or _buffer.num_rdma_bytes < num_rdma_bytes:
        _buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)
    return _buffer


def dispatch_forward(x, topk_idx, topk_weights, num_experts, previous_event=None):
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, previous_event = \
        _buffer.get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event, async_finish=True,
                                    allocate_on_comm_stream=previous_event is not None)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \
        _buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                         num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                         is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                         previous_event=previous_event, async_finish=True, allocate_on_comm_stream=True)
    return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event


def dispatch_backward(grad_recv_x, grad_recv_topk_weights, handle):
    combined_grad_x, combined_grad_recv_topk_weights, event = \
        _buffer.combine(grad_recv_x, handle, topk_weights=grad_recv_topk_weights, async_finish=True)
    return combined_grad_x, combined_grad_recv_topk_weights, event


def combine_forward(x, handle, previous_event=None):
    combined_x, _, event = _buffer.combine(x, handle, async_finish=True, previous_event=previous_event,
                                           allocate_on_comm_stream=previous_event is not None)
    return combined_x, event


def combine_backward(grad_combined_x, handle, previous_event=None):
    grad_x, _, _, _, _, event = _buffer.dispatch(grad_combined_x, handle=handle, async_finish=True,
                                                 previous_event=previous_event,
                                                 allocate_on_comm_stream=previous_event is not None)
    return grad_x, event


# --- the checks, in the order of DeepEP's intranode test -----------------------------------------

def make_routing(args, num_ranks):
    scores = torch.randn((args.num_tokens, args.num_experts), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, args.num_topk, dim=-1, largest=True, sorted=False)[1].to(deep_ep.topk_idx_t)
    topk_idx[torch.randint(0, args.num_tokens, (8,)), torch.randint(0, args.num_topk, (8,))] = -1
    experts_per_rank = args.num_experts // num_ranks
    rank_idx = torch.where(topk_idx >= 0, topk_idx // experts_per_rank, num_ranks)
    in_rank = torch.zeros((args.num_tokens, num_ranks + 1), dtype=torch.bool)
    in_rank.scatter_(1, rank_idx, True)
    is_token_in_rank = in_rank[:, :num_ranks].contiguous()
    valid = topk_idx[topk_idx >= 0]
    num_tokens_per_expert = torch.bincount(valid, minlength=args.num_experts).to(torch.int32)
    num_tokens_per_rank = is_token_in_rank.sum(dim=0).to(torch.int32)
    return topk_idx, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


def test_main(args, num_sms: int, rank: int, num_ranks: int, buffer: deep_ep.Buffer, group) -> None:
    num_tokens, hidden, num_experts = args.num_tokens, args.hidden, args.num_experts
    experts_per_rank = num_experts // num_ranks
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16) * rank
    x_pure_rand = torch.randn((num_tokens, hidden), dtype=torch.bfloat16)
    x_e4m3 = per_token_cast_to_fp8(x) if deep_ep.Buffer.is_sm90_compiled() else None
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T) if x_e4m3 is not None else None
    topk_idx, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = make_routing(args, num_ranks)
    topk_weights = torch.ones((num_tokens, args.num_topk), dtype=torch.float32) * rank
    topk_weights_pure_rand = torch.randn((num_tokens, args.num_topk), dtype=torch.float32)

    gbl_num_tokens_per_rank = num_tokens_per_rank.clone()
    dist.all_reduce(gbl_num_tokens_per_rank, group=group)
    gbl_num_tokens_per_expert = num_tokens_per_expert.clone()
    dist.all_reduce(gbl_num_tokens_per_expert, group=group)

    ref_num_tokens_per_rank, _, ref_num_tokens_per_expert, ref_is_token_in_rank, _ = \
        buffer.get_dispatch_layout(topk_idx, num_experts)
    expect(torch.equal(ref_num_tokens_per_rank, num_tokens_per_rank), "layout: num_tokens_per_rank")
    expect(torch.equal(ref_num_tokens_per_expert, num_tokens_per_expert), "layout: num_tokens_per_expert")
    expect(torch.equal(ref_is_token_in_rank, is_token_in_rank), "layout: is_token_in_rank")
    report(rank, "get_dispatch_layout")

    config = deep_ep.Config(num_sms, 8, 256)
    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in (x_pure_rand, x, x_e4m3):
                for with_topk in (False, True):
                    dispatch_args = {"x": current_x, "num_tokens_per_rank": num_tokens_per_rank,
                                     "is_token_in_rank": is_token_in_rank,
                                     "num_tokens_per_expert": num_tokens_per_expert, "config": config,
                                     "async_finish": async_mode}
                    if with_topk:
                        dispatch_args.update({"topk_idx": topk_idx, "topk_weights": topk_weights_pure_rand
                                              if current_x is x_pure_rand else topk_weights})
                    if previous_mode:
                        dispatch_args.update({"previous_event": buffer.capture()})
                    recv_x, recv_topk_idx, recv_topk_weights, recv_num_tokens_per_expert_list, handle, event = \
                        buffer.dispatch(**dispatch_args)
                    event.current_stream_wait() if async_mode else ()
                    recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x

                    rank_prefix_matrix = handle[0]
                    expect(gbl_num_tokens_per_rank[rank].item() == recv_x.size(0), "dispatch: received rows")
                    expect(gbl_num_tokens_per_expert.view(num_ranks, -1)[rank].tolist()
                           == recv_num_tokens_per_expert_list, "dispatch: tokens per local expert")
                    if current_x is not x_pure_rand:
                        check_rows_come_from_their_rank(recv_x, rank_prefix_matrix, rank)
                    if with_topk:
                        expect(bool(((recv_topk_idx >= -1) & (recv_topk_idx < experts_per_rank)).all()),
                               "dispatch: local expert ids")
                        for e, count in enumerate(recv_num_tokens_per_expert_list):
                            expect((recv_topk_idx == e).sum().item() == count, f"dispatch: tokens of expert {e}")
                        expect(bool((recv_topk_weights[recv_topk_idx < 0] == 0).all()),
                               "dispatch: weights of non-local experts are 0")
                        if current_x is not x_pure_rand:
                            weights = recv_topk_weights.clone()
                            rows_max = weights.amax(dim=1, keepdim=True).expand_as(weights)
                            weights[recv_topk_idx < 0] = rows_max[recv_topk_idx < 0]
                            check_rows_come_from_their_rank(weights, rank_prefix_matrix, rank)

                        # Fixed-size outputs
                        num_worst_tokens = num_tokens * num_ranks
                        dispatch_args.update({"num_worst_tokens": num_worst_tokens})
                        if previous_mode:
                            dispatch_args.update({"previous_event": buffer.capture()})
                        recv_worst_x, recv_worst_topk_idx, recv_worst_topk_weights, empty_list, _, event = \
                            buffer.dispatch(**dispatch_args)
                        event.current_stream_wait() if async_mode else ()
                        recv_worst_x = per_token_cast_back(*recv_worst_x) if isinstance(recv_worst_x, tuple) \
                            else recv_worst_x
                        expect(len(empty_list) == 0, "num_worst_tokens: no expert counts")
                        expect(num_worst_tokens == recv_worst_x.size(0) == recv_worst_topk_idx.size(0)
                               == recv_worst_topk_weights.size(0), "num_worst_tokens: row count")
                        valid = recv_x.size(0)
                        expect(torch.equal(recv_x, recv_worst_x[:valid]), "num_worst_tokens: recv_x")
                        expect(torch.equal(recv_topk_idx, recv_worst_topk_idx[:valid]), "num_worst_tokens: ids")
                        expect(torch.equal(recv_topk_weights, recv_worst_topk_weights[:valid]),
                               "num_worst_tokens: weights")
                        expect(bool((recv_worst_topk_idx[valid:] == -1).all()), "num_worst_tokens: padding ids")

                    # Cached dispatch (without top-k)
                    if not with_topk:
                        dispatch_args = {"x": current_x, "handle": handle, "config": config,
                                         "async_finish": async_mode}
                        if previous_mode:
                            dispatch_args.update({"previous_event": buffer.capture()})
                        recv_cached_x, _, _, _, _, event = buffer.dispatch(**dispatch_args)
                        event.current_stream_wait() if async_mode else ()
                        recv_cached_x = per_token_cast_back(*recv_cached_x) if isinstance(recv_cached_x, tuple) \
                            else recv_cached_x
                        expect(torch.equal(recv_cached_x, recv_x), "cached dispatch: recv_x")

                    # Combine, with two biases
                    bias_0 = torch.ones((num_tokens, hidden), dtype=torch.bfloat16)
                    bias_1 = torch.randn((num_tokens, hidden), dtype=torch.bfloat16)
                    combine_args = {"x": recv_x, "bias": (bias_0, bias_1), "handle": handle, "config": config,
                                    "async_finish": async_mode}
                    if with_topk:
                        combine_args.update({"topk_weights": recv_topk_weights})
                    if previous_mode:
                        combine_args.update({"previous_event": buffer.capture()})
                    combined_x, combined_topk_weights, event = buffer.combine(**combine_args)
                    event.current_stream_wait() if async_mode else ()
                    sent = is_token_in_rank.sum(dim=1)
                    reached = sent > 0
                    check_x = (combined_x.float() - bias_0.float() - bias_1.float())[reached] \
                        / sent[reached].unsqueeze(1)
                    ref_x = x_pure_rand if current_x is x_pure_rand else x
                    expect(similarity_gap(check_x, ref_x[reached]) < 5e-6, "combine: combined_x")
                    if with_topk:
                        ref_weights = topk_weights_pure_rand if current_x is x_pure_rand else topk_weights
                        expect(torch.equal(combined_topk_weights[topk_idx >= 0], ref_weights[topk_idx >= 0]),
                               "combine: combined_topk_weights")
                        expect(bool((combined_topk_weights[topk_idx < 0] == 0).all()),
                               "combine: weights of dropped experts")
            report(rank, f"dispatch, cached dispatch, combine (previous_event={previous_mode}, async={async_mode})")


def test_readme_helpers(args, rank: int, group) -> None:
    """The README's forward and backward helpers: dispatch, combine and their gradients."""
    buffer = get_buffer(group, args.hidden * 2)
    expect(get_buffer(group, args.hidden * 2) is buffer, "get_buffer: the Buffer is reused")
    x = torch.randn((args.num_tokens, args.hidden), dtype=torch.bfloat16)
    topk_idx, _, _, is_token_in_rank = make_routing(args, group.size())
    topk_weights = torch.rand((args.num_tokens, args.num_topk), dtype=torch.float32)
    recv_x, recv_topk_idx, recv_topk_weights, _, handle, event = dispatch_forward(
        x, topk_idx, topk_weights, args.num_experts, previous_event=deep_ep.Buffer.capture())
    event.current_stream_wait()
    combined_x, event = combine_forward(recv_x, handle, previous_event=deep_ep.Buffer.capture())
    event.current_stream_wait()
    sent = is_token_in_rank.sum(dim=1, keepdim=True).clamp(min=1)
    expect(similarity_gap(combined_x.float() / sent, x.float() * (sent > 0)) < 5e-6, "README: combine_forward")
    grad_x, event = combine_backward(combined_x, handle)
    event.current_stream_wait()
    # The rows this rank received from itself are its own tokens, in order (recv_src_idx).
    rank_prefix_matrix, recv_src_idx = handle[0], handle[3]
    own = slice(rank_prefix_matrix[rank - 1][rank].item() if rank > 0 else 0, rank_prefix_matrix[rank][rank].item())
    expect(grad_x.shape == recv_x.shape and torch.equal(grad_x[own], combined_x[recv_src_idx[own].long()]),
           "README: combine_backward")
    combined_grad_x, combined_grad_weights, event = dispatch_backward(recv_x, recv_topk_weights, handle)
    event.current_stream_wait()
    expect(torch.equal(combined_grad_x, combined_x), "README: dispatch_backward is combine")
    expect(torch.equal(combined_grad_weights[topk_idx >= 0], topk_weights[topk_idx >= 0]),
           "README: dispatch_backward weights")
    report(rank, "README helpers")


def report(rank: int, what: str) -> None:
    if rank == 0:
        print(f"deepep_intranode: {what}: passed", flush=True)


def test_loop(local_rank: int, num_local_ranks: int, args) -> None:
    rank, num_ranks, group = init_dist(local_rank, num_local_ranks)
    deep_ep.Buffer.set_num_sms(24)
    num_nvl_bytes = max(config.get_nvl_buffer_size_hint(args.hidden * 2, num_ranks)
                        for config in (deep_ep.Buffer.get_dispatch_config(num_ranks),
                                       deep_ep.Buffer.get_combine_config(num_ranks)))
    buffer = deep_ep.Buffer(group, num_nvl_bytes, 0, low_latency_mode=False, num_qps_per_rank=1,
                            explicitly_destroy=True, allow_mnnvl=False, use_fabric=False)
    torch.manual_seed(rank)
    for num_sms in (24,):
        test_main(args, num_sms, rank, num_ranks, buffer, group)
    test_readme_helpers(args, rank, group)
    buffer.destroy()
    if _buffer is not None:
        _buffer.destroy()
    dist.barrier()
    report(rank, "all")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-processes", type=int, default=None, help="ranks to spawn (default: all GPUs)")
    parser.add_argument("--num-tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=256)
    args = parser.parse_args()
    # Not DeepEP's: without a GPU or driver, one sentence on stderr and exit status 2, no traceback.
    from deepep_cupy.gpu.check import exit_unless_gpu
    exit_unless_gpu("examples/deepep_intranode.py")
    launched = launcher_rank()
    if launched is not None:
        rank, size, local_rank = launched
        test_loop(local_rank, size, args)
        return
    num_processes = args.num_processes or torch.cuda.device_count()
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    torch.multiprocessing.spawn(test_loop, args=(num_processes, args), nprocs=num_processes)


if __name__ == "__main__":
    main()
