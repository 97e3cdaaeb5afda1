"""While a benchmark or test captures a CUDA graph, Python's cyclic collector is held off
(deepep_cupy.gpu.device_pools.collector_held): a collection during a capture can free a CuPy array
onto the capturing stream and break the capture."""

import gc
import threading
import weakref

import pytest

from deepep_cupy.gpu.device_pools import collector_held


@pytest.fixture(autouse=True)
def collector_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_the_collector_is_off_inside_and_back_on_after():
    with collector_held():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    with collector_held():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_the_collector_stays_off_until_the_last_capturing_thread_leaves():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def second():
        first_in.wait()
        with collector_held():
            second_in.set()
            first_out.wait()
            seen["after the first left"] = gc.isenabled()

    thread = threading.Thread(target=second)
    thread.start()
    with collector_held():
        first_in.set()
        second_in.wait()
    first_out.set()
    thread.join()
    assert seen["after the first left"] is False
    assert gc.isenabled()


def test_garbage_from_before_the_first_capture_is_collected_on_entry():
    class Cycle:
        pass

    collected = threading.Event()
    gc.disable()  # the cycle stays until something collects it
    a, b = Cycle(), Cycle()
    a.other, b.other = b, a
    weakref.finalize(a, collected.set)
    del a, b
    assert not collected.is_set()
    with collector_held():
        assert collected.is_set()


def test_an_exception_inside_still_restores_the_collector():
    with pytest.raises(RuntimeError):
        with collector_held():
            raise RuntimeError("capture failed")
    assert gc.isenabled()
