"""The internode GPU worker's scenarios, run on the CPU against the internode path with fake
hardware (tests/internode_fakes.py): the GPU test's expectations hold where the path is right."""

import sys

import pytest
from _harness import WORKERS
from internode_fakes import FakeInternodeBuffer, fake_cupy_module, make_paths, run_ranks, use_host_arrays

sys.path.insert(0, str(WORKERS))  # the worker imports its siblings as a script does
import internode_worker  # noqa: E402


@pytest.mark.parametrize("num_nodes,L", [(2, 2), (4, 1), (3, 2)])
@pytest.mark.parametrize("scenario", [s for s in internode_worker.SCENARIOS if s.get("framework") != "torch"],
                         ids=lambda s: s["name"])
def test_the_worker_scenarios_pass_on_the_internode_path(monkeypatch, num_nodes, L, scenario):
    use_host_arrays(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy_module())
    paths = make_paths(num_nodes, L)
    infos = run_ranks(paths, lambda rank, path: internode_worker.run_scenario(FakeInternodeBuffer(path), scenario,
                                                                             seed=7))
    assert sum(i["received"] for i in infos) > 0
