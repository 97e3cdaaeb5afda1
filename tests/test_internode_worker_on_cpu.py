"""The internode GPU worker's scenarios, run on the CPU against the internode path with fake
hardware (tests/internode_fakes.py): the GPU test's expectations hold where the path is right."""

import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
from _harness import WORKERS
from host_fakes import on_device
from internode_fakes import make_paths, run_ranks, use_host_arrays

sys.path.insert(0, str(WORKERS))  # the worker imports its siblings as a script does
import internode_worker  # noqa: E402


def fake_cupy_module():
    stream = SimpleNamespace(ptr=0, synchronize=lambda: None)
    cuda = SimpleNamespace(get_current_stream=lambda: stream, Device=lambda *a: SimpleNamespace(id=0),
                           runtime=SimpleNamespace(streamWaitEvent=lambda *a: None))
    module = types.ModuleType("cupy")
    module.cuda = cuda
    module.asarray = lambda a: on_device(np.asarray(a))
    module.asnumpy = np.asarray
    module.asfortranarray = lambda a: np.asfortranarray(a).view(type(a))
    return module


class FakeBuffer:
    def __init__(self, path):
        self.path, self.rank, self.num_ranks, self.topology = path, path.topology.rank, path.topology.num_ranks, \
            path.topology
        self.get_dispatch_layout, self.dispatch, self.combine = path.get_dispatch_layout, path.dispatch, path.combine

    @staticmethod
    def capture(stream=None):
        return None


@pytest.mark.parametrize("num_nodes,L", [(2, 2), (4, 1), (3, 2)])
@pytest.mark.parametrize("scenario", [s for s in internode_worker.SCENARIOS if s.get("framework") != "torch"],
                         ids=lambda s: s["name"])
def test_the_worker_scenarios_pass_on_the_internode_path(monkeypatch, num_nodes, L, scenario):
    use_host_arrays(monkeypatch)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy_module())
    paths = make_paths(num_nodes, L)
    infos = run_ranks(paths, lambda rank, path: internode_worker.run_scenario(FakeBuffer(path), scenario, seed=7))
    assert sum(i["received"] for i in infos) > 0
