"""What a Buffer compiles before its first call, and how (CPU only: NVRTC and the GPU stubbed).

``kernels.warm_up`` builds the instances a group may use (``kernels.warm_up_instances``), the
missing ones in several threads at once, each on the caller's device, each once per process and
device, and a warm start builds nothing and starts no thread. The stub below stands in for the
one-instance build (``kernels._build``: NVRTC, CuPy's cache, the module load) and for the
per-thread current device.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from deepep_cupy.gpu import kernels


class StubBuilds:
    """Records each build: (device current in the building thread, instance, thread), how many
    builds ran at once, and which instance was built while a build of it was running.

    The first builds wait (up to ``meet_timeout_s``) until ``meet`` of them run together, so a
    serial warm-up never reaches ``meet``; with ``twin_wait_s`` every build waits that long for a
    second build of its instance, so two builds of one instance that may overlap do."""

    def __init__(self, monkeypatch, threads: int, meet: int = 1, fail: str = "", meet_timeout_s: float = 2.0,
                 twin_wait_s: float = 0.0):
        self.built = []
        self.running = []  # (thread, instance) of the builds in progress
        self.most_at_once = 0
        self.overlapping = []
        self.fail = fail
        self.meet = meet
        self.meet_timeout_s = meet_timeout_s
        self.twin_wait_s = twin_wait_s
        self._met = False
        self._cond = threading.Condition()
        self._device = threading.local()
        monkeypatch.setattr(kernels, "_functions", {})
        monkeypatch.setattr(kernels, "_build_locks", {})
        monkeypatch.setattr(kernels, "_current_device", lambda: getattr(self._device, "id", 0))
        monkeypatch.setattr(kernels, "_use_device", self.use_device)
        monkeypatch.setattr(kernels, "_build", self.build)
        monkeypatch.setattr(kernels, "compile_threads", lambda: threads)

    def use_device(self, device: int) -> None:
        self._device.id = device

    def _builds_of(self, expression: str) -> int:
        return sum(e == expression for _, e in self.running)

    def build(self, expression: str):
        entry = (threading.get_ident(), expression)
        with self._cond:
            if self._builds_of(expression):
                self.overlapping.append(expression)
            self.running.append(entry)
            self.most_at_once = max(self.most_at_once, len(self.running))
            self._met = self._met or len(self.running) >= self.meet
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._met, self.meet_timeout_s)
            self._cond.wait_for(lambda: self._builds_of(expression) > 1, self.twin_wait_s)
        try:
            if expression == self.fail:
                raise RuntimeError(f"NVRTC failed on {expression}")
            self.built.append((kernels._current_device(), expression, threading.current_thread().name))
            return object()
        finally:
            with self._cond:
                self.running.remove(entry)
                self._cond.notify_all()

    def instances(self, device: int = 0):
        return Counter(e for d, e, _ in self.built if d == device)


def test_warm_up_builds_each_listed_instance_once(monkeypatch):
    builds = StubBuilds(monkeypatch, threads=4)
    kernels.warm_up(2, every_instance=True)
    assert builds.instances() == Counter(kernels.warm_up_instances(2, every_instance=True))


def test_warm_up_builds_several_instances_at_once(monkeypatch):
    builds = StubBuilds(monkeypatch, threads=4, meet=4)
    kernels.warm_up(2, every_instance=True)
    assert builds.most_at_once == 4
    assert all(thread.startswith("deepep_cupy-compile") for _, _, thread in builds.built)


def test_warm_up_never_runs_more_builds_at_once_than_compile_threads(monkeypatch):
    builds = StubBuilds(monkeypatch, threads=3, meet=4, meet_timeout_s=0.05)
    kernels.warm_up(8, every_instance=True)
    assert builds.most_at_once == 3


def test_warm_up_builds_on_the_callers_device(monkeypatch):
    builds = StubBuilds(monkeypatch, threads=4)

    def rank_on_gpu_3():
        kernels._use_device(3)
        kernels.warm_up(4)

    rank = threading.Thread(target=rank_on_gpu_3)
    rank.start()
    rank.join()
    assert builds.instances(device=3) == Counter(kernels.warm_up_instances(4))
    assert len(builds.built) == len(kernels.warm_up_instances(4))


def test_with_one_compile_thread_warm_up_builds_in_the_callers_thread(monkeypatch):
    builds = StubBuilds(monkeypatch, threads=1)
    monkeypatch.setattr(kernels, "ThreadPoolExecutor", None)  # using it would raise
    kernels.warm_up(2, every_instance=True)
    assert builds.instances() == Counter(kernels.warm_up_instances(2, every_instance=True))
    assert {thread for _, _, thread in builds.built} == {threading.current_thread().name}


def test_a_warm_up_of_loaded_instances_builds_nothing_and_starts_no_thread(monkeypatch):
    builds = StubBuilds(monkeypatch, threads=4)
    kernels.warm_up(2, every_instance=True)
    built = list(builds.built)
    monkeypatch.setattr(kernels, "ThreadPoolExecutor", None)  # using it would raise
    kernels.warm_up(2, every_instance=True)
    kernels.warm_up(2)
    assert builds.built == built


def test_a_warm_up_builds_only_what_is_missing(monkeypatch):
    builds = StubBuilds(monkeypatch, threads=4)
    kernels.warm_up(2)
    kernels.warm_up(2, every_instance=True)
    assert builds.instances() == Counter(kernels.warm_up_instances(2, every_instance=True))


def test_ranks_sharing_a_gpu_warming_up_at_once_build_each_instance_once(monkeypatch):
    builds = StubBuilds(monkeypatch, threads=4, twin_wait_s=0.2)
    ranks = [threading.Thread(target=kernels.warm_up, args=(2, True)) for _ in range(2)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    assert builds.instances() == Counter(kernels.warm_up_instances(2, every_instance=True))


def test_ranks_on_two_gpus_build_each_instance_on_each_and_never_twice_at_once(monkeypatch):
    # The second build of an instance waits for the first: it then reads CuPy's disk cache.
    builds = StubBuilds(monkeypatch, threads=4, twin_wait_s=0.2)

    def rank(device):
        kernels._use_device(device)
        kernels.warm_up(2)

    ranks = [threading.Thread(target=rank, args=(device,)) for device in (0, 1)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    for device in (0, 1):
        assert builds.instances(device) == Counter(kernels.warm_up_instances(2))
    assert builds.overlapping == []


def test_a_failed_build_is_raised_once_every_other_build_has_ended(monkeypatch):
    failing = kernels.name_expression("combine_kernel", ("bf16_t", 2))
    builds = StubBuilds(monkeypatch, threads=4, fail=failing)
    with pytest.raises(RuntimeError, match="NVRTC failed on combine_kernel<bf16_t, 2>"):
        kernels.warm_up(2, every_instance=True)
    assert builds.running == []
    assert builds.instances() == Counter(e for e in kernels.warm_up_instances(2, every_instance=True) if e != failing)
    assert (0, failing) not in kernels._functions


def test_ranks_sharing_a_gpu_compile_every_instance_up_front():
    # Loading a module mid-run waits for co-located peers' kernels: nothing may be left for first use.
    hot_path = kernels.warm_up_instances(4)
    assert "dispatch_kernel<4>" in hot_path and "dispatch_kernel<4, true>" not in hot_path
    assert "expand_kernel" not in hot_path
    every = {e for file_name, expressions in kernels.SOURCES.items() if file_name not in kernels.OWN_WARM_UP
             for e in expressions if "<" not in e or "4" in e[e.index("<") + 1:-1].split(", ")}
    assert {"dispatch_kernel<4, false, true>", "combine_kernel<float, 4, true>", "expand_kernel"} <= every
    assert set(kernels.warm_up_instances(4, every_instance=True)) == every


def test_the_decode_kernels_are_loaded_by_the_low_latency_path_not_by_every_buffer():
    # They need sm_89 (FP8 conversions); a Buffer without low_latency_mode never compiles them.
    decode = set(kernels.SOURCES["low_latency.cu"])
    assert "low_latency.cu" in kernels.OWN_WARM_UP
    assert not decode & set(kernels.warm_up_instances(8, every_instance=True))


@pytest.mark.parametrize("every_instance", [False, True])
def test_warm_up_starts_the_longest_compiles_first(every_instance):
    instances = kernels.warm_up_instances(2, every_instance)
    assert len(set(instances)) == len(instances)
    assert instances[0] == "dispatch_kernel<2>"
    first_other = next(i for i, e in enumerate(instances) if not e.startswith("dispatch_kernel"))
    assert all(not e.startswith("dispatch_kernel") for e in instances[first_other:])
    assert instances[-1] == "dispatch_layout_kernel"


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 2), (16, 16), (128, kernels.MAX_COMPILE_THREADS)])
def test_compile_threads_follow_the_cpus_this_process_may_use(monkeypatch, cpus, threads):
    monkeypatch.setattr(kernels.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert kernels.compile_threads() == threads
