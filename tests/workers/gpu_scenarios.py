"""The dispatch/combine scenarios the GPU tests run (plain data: importable without a GPU).

Each scenario names a workload; ``gpu_worker.py`` runs it on every rank and compares every output
with ``deepep_cupy.reference.intranode`` bit-exactly.
"""

BASE = dict(num_tokens=512, hidden=2048, num_topk=4, num_experts=32, num_sms=24, dtype="bfloat16",
            with_topk=True, with_weights=True, expert_alignment=1, routing="uniform", cached=True,
            combine=True, mode="sync", framework="cupy", send_chunk=None, recv_chunk=None, seed=1,
            allocation="any", scales_layout="row", bias=0, worst=False, expand=False, recv_in_buffer=False,
            combine_in_place=False)
# allocation: how the scenario's first fresh dispatch must size its outputs ("any": whatever the
# previous scenario left; "exact": Buffer.allocate_ahead off; "ahead": allocated ahead with room for
# every rank's tokens; "retried": allocated ahead too small).
# DeepEP's inputs and calls: scales_layout "column" passes FP8 scales column-major
# (scales.T.contiguous().T); bias: how many bias arrays combine adds (0..2); worst: one more fresh
# dispatch with num_worst_tokens (fixed-size outputs), combined from its full-size rows; expand: one
# more fresh dispatch with expand=True (rows grouped per local expert); recv_in_buffer: every dispatch
# with recv_x_in_buffer=True (its outputs views of the NVLink buffer, checked to be there, then
# copied: the next call overwrites them); combine_in_place: one more fresh dispatch with rows in place
# whose recv_x is overwritten where it lies (every value's sign flipped, as an expert writing its
# output there) and combined from there.


def _scenario(name, **changes):
    unknown = set(changes) - set(BASE)
    assert not unknown, unknown
    return dict(BASE, name=name, **changes)


SCENARIOS = [
    _scenario("bf16_basic"),
    _scenario("bf16_hidden_7168", hidden=7168, num_tokens=1024, num_topk=8, num_experts=64, seed=2),
    _scenario("fp8_with_scales", dtype="float8_e4m3fn", hidden=7168, num_topk=8, num_experts=64, seed=3),
    _scenario("fp8_per_token_scale", dtype="float8_e4m3fn_1d", hidden=2048, seed=4),
    _scenario("fp16_dispatch_and_combine", dtype="float16", seed=5),
    _scenario("fp32_dispatch_and_combine", dtype="float32", hidden=1024, seed=6),
    _scenario("without_topk", with_topk=False, with_weights=False, seed=7),
    _scenario("topk_without_weights", with_weights=False, seed=8),
    _scenario("expert_alignment_128", expert_alignment=128, seed=9),
    _scenario("rows_with_minus_one", routing="drop", seed=10),
    _scenario("a_rank_with_zero_tokens", num_tokens=(512, 0), seed=11),
    _scenario("a_rank_receiving_nothing", routing="avoid_last_rank", seed=12),
    _scenario("skewed_routing", routing="skewed", num_tokens=2048, seed=13),
    _scenario("async_with_previous_event", mode="async", seed=14),
    _scenario("num_sms_2", num_sms=2, seed=15),
    _scenario("num_sms_8_small_queues", num_sms=8, send_chunk=4, recv_chunk=32, num_tokens=3000, seed=16),
    _scenario("num_sms_48", num_sms=48, num_tokens=2000, seed=17),
    _scenario("fewer_tokens_than_channels", num_tokens=(5, 3), seed=18),
    _scenario("torch_tensors", framework="torch", seed=19),
    _scenario("deepep_inputs_torch", framework="torch", dtype="float8_e4m3fn", scales_layout="column",
              num_topk=8, num_experts=64, hidden=2048, mode="async", worst=True, combine=False, seed=25),
    _scenario("deepep_combine_with_bias_torch", framework="torch", bias=2, worst=True, seed=26),
    _scenario("combine_with_one_bias", bias=1, dtype="float32", hidden=1024, seed=27),
    _scenario("column_major_scales", dtype="float8_e4m3fn", scales_layout="column", seed=28),
    _scenario("outputs_allocated_exactly", allocation="exact", seed=22),
    _scenario("outputs_allocated_ahead_too_small", allocation="retried", num_tokens=(512, 300), seed=23),
    _scenario("outputs_allocated_ahead_too_small_fp8", allocation="retried", dtype="float8_e4m3fn",
              hidden=7168, num_topk=8, num_experts=64, seed=24),
    _scenario("expand_rows_per_expert", expand=True, expert_alignment=16, seed=29),
    _scenario("expand_fp8_torch", expand=True, framework="torch", dtype="float8_e4m3fn", num_topk=8,
              num_experts=64, seed=30),
    _scenario("rows_in_buffer_bf16", recv_in_buffer=True, hidden=7168, num_tokens=1024, num_topk=8,
              num_experts=64, worst=True, seed=31),
    _scenario("rows_in_buffer_fp8_torch_async", recv_in_buffer=True, framework="torch", dtype="float8_e4m3fn",
              scales_layout="column", num_topk=8, num_experts=64, mode="async", worst=True, seed=32),
    _scenario("rows_in_buffer_num_sms_8_skewed", recv_in_buffer=True, num_sms=8, routing="skewed",
              num_tokens=3000, allocation="retried", seed=33),
    _scenario("rows_in_buffer_fewer_tokens_than_channels", recv_in_buffer=True, num_tokens=(5, 3), seed=34),
    _scenario("rows_in_buffer_expand_without_topk_weights", recv_in_buffer=True, expand=True, with_weights=False,
              num_sms=2, seed=35),
    _scenario("combine_in_place_bf16", recv_in_buffer=True, combine_in_place=True, hidden=7168, num_tokens=1024,
              num_topk=8, num_experts=64, seed=36),
    _scenario("combine_in_place_torch_fp32_with_biases", recv_in_buffer=True, combine_in_place=True,
              framework="torch", dtype="float32", hidden=1024, bias=2, seed=37),
    _scenario("combine_in_place_without_weights_num_sms_8_skewed", recv_in_buffer=True, combine_in_place=True,
              with_weights=False, num_sms=8, routing="skewed", num_tokens=3000, seed=38),
    _scenario("combine_in_place_torch_a_rank_receiving_nothing", recv_in_buffer=True, combine_in_place=True,
              framework="torch", routing="avoid_last_rank", seed=39),
    _scenario("reference_workload_bf16", num_tokens=4096, hidden=7168, num_topk=8, num_experts=256, seed=20),
    _scenario("reference_workload_fp8", num_tokens=4096, hidden=7168, num_topk=8, num_experts=256,
              dtype="float8_e4m3fn", seed=21),
]

NAMES = [s["name"] for s in SCENARIOS]

#: Scenarios tests/workers/torch_dist_worker.py runs as PyTorch code on a torch.distributed group.
TORCH_DIST_NAMES = ["bf16_basic", "fp8_with_scales", "without_topk", "async_with_previous_event", "torch_tensors",
                    "deepep_inputs_torch", "deepep_combine_with_bias_torch", "column_major_scales"]
