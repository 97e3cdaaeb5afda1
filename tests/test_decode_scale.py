"""The scale model's decode step across nodes (``deepep_cupy.bench.decode_scale``), issue 48.

CPU only: the model is Python + NumPy. These checks are its invariants, not its figures.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from deepep_cupy.bench import decode_scale as ds
from deepep_cupy.bench import scale_model as sm
from deepep_cupy.reference import intranode as reference

WORKLOAD = sm.Workload(num_tokens=ds.DECODE_TOKENS)
CLUSTERS = [sm.Cluster(ep, g) for g in (8, 4) for ep in (16, 32, 64, 128, 256)]
ROUTINGS = ["uniform", "node-limited"]
OPS = ["dispatch", "combine"]


def _bytes(cluster, routing="node-limited", op="dispatch", **kwargs):
    rows = ds.decode_rows(WORKLOAD, cluster, routing, samples=4096)
    return ds.decode_bytes(WORKLOAD, cluster, rows, op, **kwargs)


def _cluster_id(cluster):
    return f"EP{cluster.num_ranks}x{cluster.gpus_per_node}"


@pytest.mark.parametrize("cluster", CLUSTERS, ids=_cluster_id)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("op", OPS)
def test_the_dedup_design_never_needs_more_bytes_than_deepeps_per_rank_messages(cluster, routing, op):
    nbytes = _bytes(cluster, routing, op)
    assert 0 < nbytes.needed <= nbytes.per_rank <= nbytes.deepep


def test_one_node_sends_nothing_across():
    cluster = sm.Cluster(8, 8)
    rates = sm.Rates(nic_efficiency=ds.DECODE_NIC_EFFICIENCY)
    rows = ds.decode_rows(WORKLOAD, cluster, "uniform")
    assert rows.network == rows.remote_rank == rows.remote_expert == 0
    for op in OPS:
        nbytes = ds.decode_bytes(WORKLOAD, cluster, rows, op)
        assert nbytes.needed == nbytes.sent == nbytes.deepep == nbytes.per_rank == 0 and nbytes.padding == 1
        ours = ds.design_time(WORKLOAD, cluster, rows, nbytes, rates, op)
        assert ours.stages_us["network"] == 0 and ours.sequential_us == ours.stages_us["nvlink"] > 0
        nvl = rates.nvlink(*(("dispatch_cached", "fp8") if op == "dispatch" else ("combine", "bf16"))).gbps
        assert ds.deepep_time(nbytes, rates, op) == pytest.approx(
            ds.DEEPEP_LL_FIXED_US + nbytes.deepep_nvlink / (nvl * 1e3))


@pytest.mark.parametrize("cluster", CLUSTERS, ids=_cluster_id)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("op", OPS)
def test_fixed_size_blocks_send_at_least_the_needed_bytes(cluster, routing, op):
    nbytes = _bytes(cluster, routing, op)
    slot, header, _ = ds.slot_bytes(WORKLOAD, op)
    assert nbytes.sent == (cluster.num_nodes - 1) * (header + WORKLOAD.num_tokens * slot)
    assert nbytes.sent >= nbytes.needed and nbytes.padding >= 1


def test_the_padding_ratio_is_the_nodes_over_the_nodes_a_token_reaches():
    # Blocks of T slots to each of N - 1 nodes, T P_node (N - 1) / N of them filled: N / P_node.
    for cluster in CLUSTERS:
        pairs = sm.routing_pairs(WORKLOAD, cluster, "uniform")
        nbytes = ds.decode_bytes(WORKLOAD, cluster, ds.expected_rows(WORKLOAD, cluster, pairs), "combine")
        assert nbytes.padding == pytest.approx(cluster.num_nodes / pairs.node)


def test_the_bytes_table_reports_the_padding_of_every_ep_size():
    table = ds.bytes_table(WORKLOAD, [sm.Cluster(16, 8), sm.Cluster(256, 8)], ROUTINGS, bound=128, samples=2048,
                           seed=0)
    header, _, *rows = table.splitlines()
    column = header.split(" | ").index("padding: sent / needed")
    padding = [float(row.split(" | ")[column]) for row in rows]
    assert len(padding) == 4 and padding[0] == pytest.approx(1.0, abs=0.01) and padding[-1] == pytest.approx(8.0)


def test_a_bound_above_the_tokens_pads_the_blocks_in_proportion():
    cluster = sm.Cluster(64, 8)
    small, large = _bytes(cluster, op="combine"), _bytes(cluster, op="combine", bound=4 * WORKLOAD.num_tokens)
    assert large.needed == small.needed and large.sent == pytest.approx(4 * small.sent)


def test_a_bound_below_the_tokens_is_refused():
    with pytest.raises(ValueError, match="must hold"):
        _bytes(sm.Cluster(16, 8), bound=WORKLOAD.num_tokens - 1)


@pytest.mark.parametrize("cluster", [sm.Cluster(16, 8), sm.Cluster(64, 8), sm.Cluster(256, 8), sm.Cluster(32, 4)],
                         ids=_cluster_id)
def test_times_fall_as_the_nic_gets_faster(cluster):
    rows = ds.decode_rows(WORKLOAD, cluster, "node-limited", samples=4096)
    times = []
    for nic in (12.5, 25.0, 50.0, 100.0, 200.0, 400.0):
        rates = sm.Rates(nic_gbps=nic, nic_efficiency=ds.DECODE_NIC_EFFICIENCY)
        row = []
        for op in OPS:
            nbytes = ds.decode_bytes(WORKLOAD, cluster, rows, op)
            row += [ds.design_time(WORKLOAD, cluster, rows, nbytes, rates, op).sequential_us,
                    ds.design_time(WORKLOAD, cluster, rows, nbytes, rates, op, padded=False).sequential_us,
                    ds.deepep_time(nbytes, rates, op)]
        times.append(row)
    times = np.array(times)
    assert (np.diff(times[:, [0, 1, 3, 4]], axis=0) < 0).all()  # this design: the network stage always counts
    assert (np.diff(times, axis=0) <= 0).all()  # DeepEP: flat once its NVLink messages bind


@pytest.mark.parametrize("cluster", [sm.Cluster(ep, 8) for ep in (16, 32, 64, 128, 256)] + [sm.Cluster(64, 4)],
                         ids=_cluster_id)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_the_bytes_match_a_monte_carlo_of_the_routing(cluster, routing):
    samples, rng = 32768, np.random.default_rng(99)
    if routing == "uniform":
        topk = reference.random_routing(rng, samples, WORKLOAD.num_experts, WORKLOAD.num_topk)
    else:
        topk = sm.node_limited_routing(rng, samples, WORKLOAD.num_experts, cluster.num_nodes,
                                       min(cluster.num_nodes, sm.DEEPEP_NODE_GROUPS), WORKLOAD.num_topk)
    sampled = ds.monte_carlo_rows(topk, WORKLOAD, cluster)
    model = ds.decode_rows(WORKLOAD, cluster, routing)
    # Per token every count lies in [0, 8]: its standard deviation is below 2, so the mean of 32768
    # tokens is within 0.05 rows of its expectation by more than 4 standard errors.
    for op in OPS:
        got, want = (ds.decode_bytes(WORKLOAD, cluster, rows, op) for rows in (sampled, model))
        tolerance = 0.05 * WORKLOAD.num_tokens * max(ds.slot_bytes(WORKLOAD, op))
        for field in ("needed", "sent", "deepep", "per_rank", "nvlink", "deepep_nvlink"):
            assert getattr(got, field) == pytest.approx(getattr(want, field), abs=tolerance), field


def test_deepeps_published_figures_imply_the_default_nic_efficiency_and_fixed_cost():
    fixed, gbps = ds.fit_deepep_low_latency()
    assert gbps / 50.0 == pytest.approx(ds.DECODE_NIC_EFFICIENCY, abs=0.005)
    assert fixed == pytest.approx(ds.DEEPEP_LL_FIXED_US, abs=1.0)


def test_the_deepep_model_lands_within_twelve_percent_of_every_published_figure():
    table = ds.check_table()
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    ratios = [float(row.split(" | ")[7]) for row in rows]
    assert len(ratios) == 2 * len(ds.DEEPEP_LL_PUBLISHED) and all(0.88 < r < 1.12 for r in ratios)


def test_unknown_op_is_refused_by_name():
    with pytest.raises(ValueError, match="op"):
        ds.slot_bytes(WORKLOAD, "reduce")


def test_the_command_line_prints_the_decode_tables(capsys):
    assert sm.main(["--decode", "--ep", "16", "64", "--gpus-per-node", "8", "--nic-gbps", "25", "100",
                    "--samples", "2048"]) == 0
    out = capsys.readouterr().out
    assert out.count("Decode times in us, NIC") == 2 and "NIC 25 GB/s x 0.84" in out and "NIC 100 GB/s" in out
    assert "| 64 | 8 | dispatch FP8 |" in out and "| 16 | 8 | combine BF16 |" in out
    assert "padding: sent / needed" in out and "pplx-garden (published)" in out
    assert "Times in us, NIC" not in out  # the normal tables are not printed
    assert all(line.count("|") >= 2 for line in out.splitlines() if line.startswith("|"))


def test_the_decode_tables_of_docs_scale_model_are_what_the_command_prints():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "SCALE_MODEL.md").read_text()
    printed = ds.render_decode(sm.build_parser().parse_args(["--decode"]))
    table_rows = [line for line in printed.splitlines() if line.startswith("| ")]
    assert len(table_rows) > 60
    missing = [line for line in table_rows if line not in doc]
    assert not missing, f"docs/SCALE_MODEL.md is out of date (rerun the command): {missing[:3]}"
