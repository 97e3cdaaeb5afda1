"""The paper model of dispatch and combine across nodes (``deepep_cupy.bench.scale_model``).

CPU only: the model is Python + NumPy. These checks are its invariants, not its figures.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from deepep_cupy.bench import scale_model as sm
from deepep_cupy.reference import intranode as reference

WORKLOAD = sm.Workload()
CLUSTERS = [sm.Cluster(ep, g) for g in (8, 4) for ep in (16, 32, 64, 128, 256)]
ROUTINGS = ["uniform", "node-limited"]


def _flow(cluster, routing="node-limited", samples=4096):
    return sm.traffic(WORKLOAD, cluster, sm.routing_pairs(WORKLOAD, cluster, routing, samples=samples))


def test_hit_probability_matches_enumeration_of_every_expert_set():
    experts, groups, k = 12, 4, 3
    per_group = experts // groups
    sets = list(itertools.combinations(range(experts), k))
    hits = sum(any(e // per_group == 1 for e in s) for s in sets)
    assert sm.hit_probability(experts, groups, k) == pytest.approx(hits / len(sets), abs=1e-12)


def test_hit_probability_refuses_groups_that_do_not_split_the_experts():
    with pytest.raises(ValueError, match="split evenly"):
        sm.hit_probability(256, 3, 8)


@pytest.mark.parametrize("cluster", CLUSTERS[:5], ids=lambda c: f"EP{c.num_ranks}")
def test_uniform_expectation_matches_monte_carlo_of_the_reference_routing(cluster):
    topk = reference.random_routing(np.random.default_rng(7), 20000, WORKLOAD.num_experts, WORKLOAD.num_topk)
    sampled = sm.monte_carlo_pairs(topk, WORKLOAD.num_experts, cluster)
    exact = sm.uniform_pairs(WORKLOAD, cluster)
    # Pairs per token lie in [1, 8]: their standard deviation is below 2, so the mean of 20000
    # tokens is within 0.06 of the expectation far beyond 4 standard errors.
    assert sampled.node == pytest.approx(exact.node, abs=0.06)
    assert sampled.rank == pytest.approx(exact.rank, abs=0.06)


@pytest.mark.parametrize("cluster", CLUSTERS, ids=lambda c: f"EP{c.num_ranks}x{c.gpus_per_node}")
@pytest.mark.parametrize("routing", ROUTINGS)
def test_deduplicated_pairs_never_exceed_flat_pairs(cluster, routing):
    pairs = sm.routing_pairs(WORKLOAD, cluster, routing, samples=4096)
    flow = sm.traffic(WORKLOAD, cluster, pairs)
    assert 1.0 <= pairs.node <= pairs.rank <= WORKLOAD.num_topk
    assert flow.network_rows <= flow.flat_network_rows
    assert flow.network_rows < flow.logical_rows


def test_node_limited_routing_keeps_each_token_on_four_nodes_with_distinct_experts():
    topk = sm.node_limited_routing(np.random.default_rng(1), 2000, 256, 16, 4, 8)
    assert topk.shape == (2000, 8) and topk.min() >= 0 and topk.max() < 256
    assert all(len(set(row)) == 8 for row in topk.tolist())
    assert sm.distinct_groups_per_token(topk, 256, 16).max() <= 4


def test_node_limited_routing_is_uniform_when_there_are_four_nodes_or_fewer():
    for cluster in (sm.Cluster(16, 8), sm.Cluster(32, 8), sm.Cluster(16, 4)):
        assert sm.routing_pairs(WORKLOAD, cluster, "node-limited") == sm.uniform_pairs(WORKLOAD, cluster)


def test_node_limited_routing_sends_fewer_rows_across_than_uniform_from_eight_nodes_on():
    for cluster in (sm.Cluster(64, 8), sm.Cluster(256, 8)):
        assert _flow(cluster, "node-limited").network_rows < _flow(cluster, "uniform").network_rows


def test_one_node_sends_nothing_across_and_needs_no_count_round_trip():
    cluster = sm.Cluster(8, 8)
    flow = _flow(cluster, "uniform")
    assert flow.network_rows == 0 and flow.flat_network_rows == 0
    rates = sm.Rates()
    for op in (sm.dispatch_time(WORKLOAD, cluster, flow, rates, "fp8", cached=False),
               sm.combine_time(WORKLOAD, cluster, flow, rates)):
        assert op.fixed_us == 0
        assert op.stages_us["network"] == 0
        assert op.sequential_us == op.stages_us["nvlink"] > 0


@pytest.mark.parametrize("cluster", [sm.Cluster(16, 8), sm.Cluster(64, 8), sm.Cluster(256, 4)],
                         ids=lambda c: f"EP{c.num_ranks}x{c.gpus_per_node}")
def test_times_fall_as_the_nic_gets_faster(cluster):
    flow = _flow(cluster)
    times = []
    for nic in (12.5, 25.0, 50.0, 100.0, 200.0, 400.0):
        rates = sm.Rates(nic_gbps=nic)
        ops = (sm.dispatch_time(WORKLOAD, cluster, flow, rates, "fp8", cached=True),
               sm.dispatch_time(WORKLOAD, cluster, flow, rates, "bf16", cached=False),
               sm.combine_time(WORKLOAD, cluster, flow, rates))
        times.append([t for op in ops for t in (op.sequential_us, op.overlapped_us)]
                     + [sm.flat_all_to_all_us(WORKLOAD, cluster, flow, rates, "fp8")])
    times = np.array(times)
    assert (np.diff(times[:, 0::2], axis=0) < 0).all()  # sequential: the network stage always counts
    assert (np.diff(times, axis=0) <= 0).all()  # overlapped: flat once NVLink binds


def test_overlap_never_takes_longer_than_the_stages_one_after_the_other():
    flow = _flow(sm.Cluster(64, 8))
    op = sm.combine_time(WORKLOAD, sm.Cluster(64, 8), flow, sm.Rates())
    assert op.overlapped_us <= op.chunked_us(4, 0.0) <= op.chunked_us(2, 0.0) <= op.sequential_us
    assert op.chunked_us(1, 0.0) == pytest.approx(op.sequential_us)


def test_network_bytes_are_the_same_as_deepep_v1s_and_fewer_than_a_flat_all_to_alls():
    flow = _flow(sm.Cluster(64, 8))
    # DeepEP's test counts (token, node) pairs with the own node; the own node's never cross.
    assert flow.network_rows == pytest.approx(flow.logical_rows * 7 / 8)
    assert flow.flat_network_rows / flow.network_rows > 1.5


@pytest.mark.parametrize("key", sorted(sm.MEASURED_LOOP_US))
def test_fitted_kernel_costs_reproduce_the_measured_loop_times(key):
    cost = sm.fit_measured_kernel(key)
    dtype = "bf16" if key.startswith("combine") else key.rsplit("_", 1)[1]
    cross = sm.hit_probability(256, 2, 8) * WORKLOAD.row_bytes(dtype)
    for tokens, measured in zip(sm.MEASURED_TOKENS, sm.MEASURED_LOOP_US[key]):
        assert cost.time_us(tokens * cross) == pytest.approx(measured)
    assert 250 < cost.gbps < sm.NVLINK_LINK_GBPS and cost.fixed_us > 0


def test_the_bandwidth_bound_is_above_every_published_deepep_v1_figure():
    for ep, published in sm.DEEPEP_V1_PUBLISHED.items():
        flow = _flow(sm.Cluster(ep, 8), samples=16384)
        for which, (op, dtype) in enumerate((("dispatch", "fp8"), ("combine", "bf16"))):
            nvl = sm.DEEPEP_V1_H800_INTRANODE[which] * 7 / 8
            bound = sm.deepep_gbps(WORKLOAD, flow, dtype,
                                   sm.deepep_v1_time(WORKLOAD, flow, op=op, nic_gbps=50.0, nvlink_gbps=nvl))
            assert 0.8 * bound < published[which] <= bound


def test_cluster_refuses_ranks_that_do_not_fill_whole_nodes():
    with pytest.raises(ValueError, match="multiple of gpus_per_node"):
        sm.Cluster(12, 8)


def test_unknown_routing_and_dtype_are_refused_by_name():
    with pytest.raises(ValueError, match="routing"):
        sm.routing_pairs(WORKLOAD, sm.Cluster(16, 8), "skewed")
    with pytest.raises(ValueError, match="dtype"):
        WORKLOAD.row_bytes("fp16")


def test_command_line_prints_markdown_tables_for_each_nic_rate(capsys):
    assert sm.main(["--ep", "16", "64", "--gpus-per-node", "8", "--nic-gbps", "25", "100", "--samples", "2048"]) == 0
    out = capsys.readouterr().out
    assert out.count("Times in us, NIC") == 2 and "NIC 25 GB/s" in out and "NIC 100 GB/s" in out
    assert "| 64 | 8 | dispatch FP8 |" in out and "| 16 | 8 | combine BF16 |" in out
    assert all(line.count("|") >= 2 for line in out.splitlines() if line.startswith("|"))
    assert math.isfinite(float(out.split("| 64 | 8 | dispatch FP8 | ")[1].split(" |")[0]))


def test_the_tables_of_docs_scale_model_are_what_the_command_prints():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "SCALE_MODEL.md").read_text()
    printed = sm.render(sm.build_parser().parse_args([]))
    table_rows = [line for line in printed.splitlines() if line.startswith("| ")]
    assert len(table_rows) > 60
    missing = [line for line in table_rows if line not in doc]
    assert not missing, f"docs/SCALE_MODEL.md is out of date (rerun the command): {missing[:3]}"


def test_a_reader_that_stops_early_ends_the_output_not_the_program():
    # `python -m deepep_cupy.bench.scale_model | head -1`: the reader closes the pipe after a line.
    import subprocess
    import sys

    from _harness import REPO_ROOT, mpi_env

    command = [sys.executable, "-m", "deepep_cupy.bench.scale_model", "--ep", "16", "--samples", "256"]
    model = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT, env=mpi_env())
    assert model.stdout.readline().startswith(b"Workload: ")
    model.stdout.close()
    _, stderr = model.communicate(timeout=120)
    assert model.returncode == 0 and stderr == b"", stderr.decode()
