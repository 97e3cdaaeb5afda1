# %% [markdown]
# # Dispatch and combine on every GPU of this node, from one Python process
#
# `deepep_cupy.run_local_group(fn)` runs `fn(group)` once per rank, each rank in its own thread
# with its own GPU current (rank `r` on GPU `r % num_gpus`). Inside `fn`, a `deepep_cupy.Buffer`
# built on `group` works exactly as under `mpirun`: the ranks exchange raw device pointers
# instead of CUDA IPC handles. The results of all ranks come back as a list, in rank order; if a
# rank raises, `run_local_group` raises `deepep_cupy.RankFailed` naming it.
#
# This is the code of `examples/in_process_dispatch_combine.ipynb`; without Jupyter run it as
# `python examples/in_process_dispatch_combine.py`.

# %%
import os

import numpy as np
import cupy

import deepep_cupy as ep
from deepep_cupy.reference import intranode as ref
from deepep_cupy.gpu.check import exit_unless_gpu

exit_unless_gpu("this example")  # without a GPU: one sentence saying what is missing, exit status 2
num_gpus = cupy.cuda.runtime.getDeviceCount()
# One rank per GPU (a single GPU hosts two); DEEPEP_EXAMPLE_RANKS=8 puts 8 ranks on fewer GPUs.
num_ranks = int(os.environ.get("DEEPEP_EXAMPLE_RANKS", max(2, num_gpus)))
devices = [r % num_gpus for r in range(num_ranks)]
num_tokens, hidden, num_topk = 4096, 7168, 4  # per rank; BF16 rows
experts_per_rank = 8
num_experts = experts_per_rank * num_ranks

# Ranks sharing a GPU run their transfer kernels at the same time: all their blocks must fit.
ranks_per_gpu = max(devices.count(d) for d in set(devices))
sm_count = min(cupy.cuda.Device(d).attributes["MultiProcessorCount"] for d in set(devices))
dispatch_config = ep.get_dispatch_config(num_ranks)
combine_config = ep.get_combine_config(num_ranks)
num_sms = min(dispatch_config.num_sms, combine_config.num_sms, sm_count // ranks_per_gpu // 2 * 2)
dispatch_config = ep.Config(num_sms, dispatch_config.num_max_nvl_chunked_send_tokens,
                            dispatch_config.num_max_nvl_chunked_recv_tokens)
combine_config = ep.Config(num_sms, combine_config.num_max_nvl_chunked_send_tokens,
                           combine_config.num_max_nvl_chunked_recv_tokens)
num_nvl_bytes = max(ep.get_nvl_buffer_size_hint(hidden * 2, num_ranks, c) for c in (dispatch_config, combine_config))
print(f"{num_ranks} ranks on GPUs {devices}, {num_experts} experts ({experts_per_rank} per rank), "
      f"num_sms={num_sms}, {num_nvl_bytes / 2**20:.0f} MiB of NVLink buffer per rank")


# %%
def rank_fn(group):
    """One rank: make its tokens, lay them out, dispatch them, send them back (combine)."""
    rng = np.random.default_rng(group.rank)
    topk_idx_host = ref.random_routing(rng, num_tokens, num_experts, num_topk)
    x_host = ref.float32_to_bfloat16_bits(rng.standard_normal((num_tokens, hidden), dtype=np.float32))
    weights_host = rng.random((num_tokens, num_topk), dtype=np.float32)

    with ep.Buffer(group, num_nvl_bytes) as buf:
        x = cupy.asarray(x_host)                      # uint16 storage = BF16 bits
        topk_idx = cupy.asarray(topk_idx_host)
        topk_weights = cupy.asarray(weights_host)

        num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = \
            buf.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
            config=dispatch_config)

        # The experts would run here; send the received rows back unchanged.
        combined_x, combined_weights, _ = buf.combine(recv_x, handle, topk_weights=recv_topk_weights,
                                                      config=combine_config)
        cupy.cuda.get_current_stream().synchronize()
        return {
            "rank": group.rank,
            "gpu": group.device_id,
            "received": int(recv_x.shape[0]),
            "per_expert": num_recv_tokens_per_expert_list,
            "rank_prefix_matrix": cupy.asnumpy(handle[0]),
            "x": x_host,
            "copies": cupy.asnumpy(is_token_in_rank).sum(axis=1),
            "combined_x": cupy.asnumpy(combined_x),
        }


results = ep.run_local_group(rank_fn, num_ranks, devices, num_sms=num_sms)

# %% [markdown]
# Tokens received per rank and per local expert (each rank owns experts
# `[rank * experts_per_rank, (rank + 1) * experts_per_rank)`), and how many tokens each rank sent
# to each other rank (from the handle's `rank_prefix_matrix`, identical on all ranks).

# %%
header = " ".join(f"e{e:<5d}" for e in range(experts_per_rank))
print(f"{'rank':>4} {'GPU':>3} {'received':>8}   local expert: {header}")
for res in results:
    counts = " ".join(f"{c:<6d}" for c in res["per_expert"])
    print(f"{res['rank']:>4} {res['gpu']:>3} {res['received']:>8}                 {counts}")

prefix = results[0]["rank_prefix_matrix"]
sent = np.diff(np.vstack([np.zeros((1, num_ranks), prefix.dtype), prefix]), axis=0)  # [from, to]
print("\ntokens sent, from rank (rows) to rank (columns):")
print("      " + " ".join(f"{j:>6d}" for j in range(num_ranks)))
for i in range(num_ranks):
    print(f"{i:>5d} " + " ".join(f"{n:>6d}" for n in sent[i]))
assert all(res["received"] == sent[:, res["rank"]].sum() for res in results)

# %% [markdown]
# Combine sums the copies of every token: a token sent to `k` ranks comes back as `k * x`
# (exact here: float32 sums of equal BF16 values, starting from 0.0, rounded back to BF16).

# %%
for res in results:
    copies = res["copies"][:, None].astype(np.float32)
    expected = ref.round_to_dtype(np.float32(0.0) + ref.bfloat16_bits_to_float32(res["x"]) * copies, "bfloat16")
    assert np.array_equal(res["combined_x"], expected), f"rank {res['rank']}: combine differs"
print(f"combine checked on all {num_ranks} ranks")
