"""The memory pool that in-process ranks sharing a GPU allocate from (deepep_cupy.gpu.device_pools),
with CUDA's pool calls played by a fake runtime."""

import threading

import pytest
from _harness import import_or_skip

from deepep_cupy.gpu.device_pools import DevicePools, allocator_for

DEFAULT_POOL = 1000


class FakeRuntime:
    """The device/pool calls of ``cupy.cuda.runtime`` that the pools make, on plain integers."""

    cudaMemAllocationTypePinned, cudaMemHandleTypeNone, cudaMemLocationTypeDevice = 1, 0, 1
    cudaMemPoolReuseAllowInternalDependencies = 3

    def __init__(self, device_count=2):
        self.device_count = device_count
        self.current = {d: DEFAULT_POOL + d for d in range(device_count)}
        self.created, self.destroyed, self.attributes = [], [], {}

    def getDeviceCount(self):
        return self.device_count

    def MemPoolProps(self, alloc_type, handle_type, location_type, device):
        return ("props", device)

    def memPoolCreate(self, props):
        pool = 1 + len(self.created)
        self.created.append((pool, props[1]))
        return pool

    def memPoolSetAttribute(self, pool, attribute, value):
        self.attributes[pool, attribute] = value

    def memPoolDestroy(self, pool):
        self.destroyed.append(pool)

    def deviceGetMemPool(self, device):
        return self.current[device]

    def deviceSetMemPool(self, device, pool):
        self.current[device] = pool


def fake_async_pool_type(runtime):
    """``cupy.cuda.MemoryAsyncPool`` as far as the pools use it: made on a list of handles, it
    makes the integer ones their devices' current pools; ``malloc`` names its pool."""

    class FakeAsyncPool:
        def __init__(self, handles):
            assert len(handles) == runtime.device_count
            for device, handle in enumerate(handles):
                if handle != "current":
                    runtime.deviceSetMemPool(device, handle)
            self.handles = handles

        def malloc(self, size):
            return ("from", self.handles)

    return FakeAsyncPool


@pytest.fixture
def runtime():
    return FakeRuntime()


@pytest.fixture
def pools(runtime):
    return DevicePools(runtime, fake_async_pool_type(runtime))


def test_the_ranks_of_one_gpu_allocate_from_one_pool(runtime, pools):
    first, second = pools.acquire(0), pools.acquire(0)
    assert first == second
    assert runtime.created == [(1, 0)]
    assert runtime.current[0] == 1


def test_the_shared_pool_forbids_reuse_that_makes_one_stream_wait_for_another(runtime, pools):
    pools.acquire(0)
    assert runtime.attributes[1, runtime.cudaMemPoolReuseAllowInternalDependencies] == 0


def test_the_pool_stays_current_until_the_last_rank_on_its_gpu_ends(runtime, pools):
    pools.acquire(0)
    pools.acquire(0)
    pools.release(0)
    assert runtime.current[0] == 1 and runtime.destroyed == []
    pools.release(0)
    assert runtime.destroyed == [1]


def test_the_pool_current_before_is_current_again_after_the_last_rank(runtime, pools):
    runtime.current[0] = 77  # a pool the user made current
    pools.acquire(0)
    pools.release(0)
    assert runtime.current[0] == 77


def test_each_gpu_gets_a_pool_of_its_own_and_leaves_the_others_alone(runtime, pools):
    pools.acquire(0)
    pools.acquire(1)
    assert runtime.created == [(1, 0), (2, 1)]
    assert runtime.current == {0: 1, 1: 2}
    pools.release(1)
    assert runtime.current == {0: 1, 1: DEFAULT_POOL + 1}


def test_a_gpu_used_again_after_its_last_rank_ended_gets_a_new_pool(runtime, pools):
    pools.acquire(0)
    pools.release(0)
    pools.acquire(0)
    assert runtime.created == [(1, 0), (2, 0)] and runtime.current[0] == 2


def test_ranks_starting_and_ending_at_once_leave_the_device_as_it_was(runtime, pools):
    start = threading.Barrier(8)

    def rank():
        start.wait()
        for _ in range(200):
            pools.acquire(0)
            pools.release(0)

    threads = [threading.Thread(target=rank) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert runtime.current[0] == DEFAULT_POOL
    assert sorted(runtime.destroyed) == [pool for pool, _ in runtime.created]


def test_a_rank_alone_on_its_gpu_keeps_the_allocator_it_had(runtime, pools):
    with allocator_for([0, 1], 1, pools):
        pass
    assert runtime.created == []


def test_a_rank_sharing_its_gpu_allocates_from_the_shared_pool_until_it_ends(runtime, pools):
    cupy_memory = import_or_skip("cupy.cuda.memory")
    with allocator_for([0, 0], 1, pools):
        assert runtime.current[0] == 1
        assert cupy_memory.get_allocator()(8) == ("from", [1, "current"])
    assert runtime.current[0] == DEFAULT_POOL
