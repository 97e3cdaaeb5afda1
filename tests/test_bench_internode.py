"""The internode benchmark's options, accounting and report (no GPU)."""

import numpy as np
import pytest

from deepep_cupy.bench import cli
from deepep_cupy.bench.internode import OPS, format_internode_report, traffic_rows
from deepep_cupy.reference import internode as iref
from deepep_cupy.reference import intranode as ref


def test_ranks_per_node_and_transport_parse():
    args = cli.parse_args(["--ranks-per-node", "2", "--transport", "mpi"])
    assert args.ranks_per_node == 2 and args.transport == "mpi"
    assert cli.parse_args([]).ranks_per_node is None


def test_ranks_per_node_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--ranks-per-node", "0"])
    assert "--ranks-per-node must be positive" in capsys.readouterr().err


def test_internode_needs_mpirun(monkeypatch):
    monkeypatch.setattr(cli, "detect_launcher", lambda args: "local")
    with pytest.raises(SystemExit, match="--ranks-per-node runs under mpirun"):
        cli.main(["--ranks-per-node", "2"])


def test_traffic_rows_are_the_references_per_rank_counts_and_the_flat_all_to_all_rows():
    rng = np.random.default_rng(0)
    topks = [ref.random_routing(rng, 50, 32, 4) for _ in range(8)]
    rows = traffic_rows(topks, 32, 2)
    t = iref.traffic(topks, 32, 8, 2)
    assert rows["hierarchical"] == t["per_rank_hierarchical"] and rows["flat"] == t["per_rank_flat"]
    assert sum(rows["flat_all_ranks"]) == t["flat_all_ranks"]
    assert all(h <= f <= a for h, f, a in zip(rows["hierarchical"], rows["flat"], rows["flat_all_ranks"]))


def test_the_report_shows_bytes_ratio_times_and_the_check():
    args = cli.parse_args(["--ranks-per-node", "1", "--hidden", "128", "--num-tokens", "10"])
    rows = [dict(rank=r, transport="mpi", internode_rows=10, flat_rows=20, nccl_rows=30, ok=r == 0, why="bad count",
                 times_us={op: 1.0 for op in OPS}, nccl_us=None, nccl_skipped="one GPU") for r in range(2)]
    text = format_internode_report(rows, args)
    assert "total rows to other nodes: 20 hierarchical, 40 flat all-to-all (ratio 0.500)" in text
    assert "PASS" in text and "FAIL: bad count" in text and "NCCL baseline skipped: one GPU" in text
