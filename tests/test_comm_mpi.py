"""The rank-group plumbing: MPIGroup under a real mpiexec, and as_group on fake communicators."""

from __future__ import annotations

import pytest
from _harness import WORKERS, describe, run_mpi, worker_records

from deepep_cupy.groups.group import Group, MPIGroup, as_group

# ---------------------------------------------------------------------------------------------
# MPIGroup over MPI.COMM_WORLD, 2..4 processes (more than the CI machine's 2 cores on purpose)


def _results(proc, n):
    """The ``RESULT {json}`` records of all ranks, by rank (robust to interleaved output)."""
    assert proc.returncode == 0, describe(proc)
    records = worker_records(proc.stdout)
    assert len(records) == n, f"expected {n} RESULT records\n{describe(proc)}"
    results = sorted(records, key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(n)), describe(proc)
    return results


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_mpi_group(n):
    proc = run_mpi(n, [str(WORKERS / "comm_worker.py")], timeout=180)
    results = _results(proc, n)
    for r in results:
        where = f"rank {r['rank']}: {r}"
        assert r["size"] == n and r["comm_size"] == n, where
        assert r["comm_rank"] == r["rank"], where
        assert r["is_group"] and r["in_process"] is False and r["comm_is_same"], where
        assert r["as_group_type"] == "MPIGroup" and r["as_group_idempotent"], where
        assert r["allgather_ok"], where
        assert r["gathered_ranks"] == list(range(n)), where
    # One node: every rank reports the same host name, and allgather shows the same to everyone.
    hosts = {r["host"] for r in results}
    assert len(hosts) == 1 and hosts != {""}, hosts
    assert all(r["hosts"] == [r["host"]] * n for r in results)
    # Barrier: in each round, nobody left before everyone (including the late rank) had entered.
    rounds = len(results[0]["barrier_rounds"])
    assert rounds == len({0, n - 1})
    for i in range(rounds):
        late = results[0]["barrier_rounds"][i]["late"]
        entered = max(r["barrier_rounds"][i]["entered"] for r in results)
        left = min(r["barrier_rounds"][i]["left"] for r in results)
        assert left >= entered, f"round with late rank {late}: a rank left at {left} before {entered}"


@pytest.mark.mpi
def test_run_mpi_reports_a_hang(tmp_path):
    """A worker that never finishes is killed (whole process group) and reported with its output."""
    script = tmp_path / "hang.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(AssertionError, match="timed out") as info:
        run_mpi(2, [str(script)], timeout=10)
    assert "started" in str(info.value)


# ---------------------------------------------------------------------------------------------
# as_group / MPIGroup on fake communicators (no MPI needed)


class FakeComm:
    """Just the four methods MPIGroup uses, recording the calls."""

    def __init__(self, rank=1, size=3):
        self._rank, self._size = rank, size
        self.calls = []

    def Get_rank(self):
        return self._rank

    def Get_size(self):
        return self._size

    def allgather(self, obj):
        self.calls.append(("allgather", obj))
        return [obj] * self._size

    def Barrier(self):
        self.calls.append(("Barrier",))


class ThreadGroupStub(Group):
    in_process = True

    @property
    def rank(self):
        return 0

    @property
    def size(self):
        return 1

    def allgather(self, obj):
        return [obj]

    def barrier(self):
        pass


def test_as_group_wraps_a_communicator():
    comm = FakeComm(rank=1, size=3)
    group = as_group(comm)
    assert isinstance(group, MPIGroup) and isinstance(group, Group)
    assert group.comm is comm
    assert (group.rank, group.size) == (1, 3)
    assert group.in_process is False
    assert group.allgather("x") == ["x", "x", "x"]
    group.barrier()
    assert comm.calls == [("allgather", "x"), ("Barrier",)]


def test_as_group_passes_groups_through():
    group = ThreadGroupStub()
    assert as_group(group) is group
    wrapped = as_group(FakeComm())
    assert as_group(wrapped) is wrapped


class MissingBarrier:
    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def allgather(self, obj):
        return [obj]


@pytest.mark.parametrize("bad", [None, 3, "COMM_WORLD", object(), [FakeComm()], MissingBarrier()],
                         ids=["None", "int", "str", "object", "list", "no-Barrier"])
def test_as_group_rejects_non_communicators(bad):
    with pytest.raises(TypeError, match=r"\bgroup: expected a torch.distributed ProcessGroup, an mpi4py communicator"):
        as_group(bad)
    with pytest.raises(TypeError, match=r"\bgroup: expected a torch.distributed ProcessGroup, an mpi4py communicator"):
        MPIGroup(bad)


@pytest.mark.mpi
def test_an_allgather_within_a_deadline_gathers_objects_of_any_size_and_names_a_rank_that_never_comes(tmp_path):
    script = tmp_path / "within.py"
    script.write_text(
        "import json\n"
        "from mpi4py import MPI\n"
        "from deepep_cupy.groups.group import MPIGroup\n"
        "from deepep_cupy.errors import DeepEPTimeoutError\n"
        "g = MPIGroup(MPI.COMM_WORLD)\n"
        "got = g.allgather_within(('x' * (1000 * g.rank), g.rank), 30)\n"
        "ok = [len(s) for s, _ in got] == [1000 * r for r in range(g.size)] and [r for _, r in got] == [0, 1]\n"
        "late = None\n"
        "comm = MPI.COMM_WORLD\n"
        "if g.rank == 0:\n"
        "    try:\n"
        "        g.allgather_within('alone', 0.5)\n"
        "    except DeepEPTimeoutError as exc:\n"
        "        late = str(exc)\n"
        "    comm.send('timed out', dest=1)\n"
        "    comm.recv(source=1)\n"
        "else:\n"
        "    comm.recv(source=0)\n"
        "print('RESULT ' + json.dumps({'rank': g.rank, 'ok': ok, 'late': late}), flush=True)\n"
        "if g.rank == 1:\n"
        "    comm.send('printed', dest=0)\n"
        "else:\n"
        "    comm.Abort(0)  # its allgather is still posted: MPI cannot cancel it, so no orderly finalize\n")
    proc = run_mpi(2, [str(script)], timeout=120)
    records = {r["rank"]: r for r in worker_records(proc.stdout)}
    assert records[0]["ok"] and records[1]["ok"], describe(proc)
    assert "timed out after 0.5 s" in records[0]["late"], describe(proc)
