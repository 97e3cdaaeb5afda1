"""The recommended SM count from the GPU's NVLinks (deepep_cupy.gpu.hardware; CPU only, NVML faked)."""

import ctypes

import pytest

import deepep_cupy as ep
from deepep_cupy.config import DEFAULT_NUM_SMS, sender_blocks
from deepep_cupy.gpu import hardware


class FakeNvml:
    """NVML with ``links`` link states (1: enabled); asking past them fails as NVML does."""

    def __init__(self, links, found=True):
        self.links, self.found = links, found

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus_id, handle):
        return 0 if self.found else 13  # NVML_ERROR_NOT_FOUND

    def nvmlDeviceGetNvLinkState(self, handle, link, state):
        if link.value >= len(self.links):
            return 2  # NVML_ERROR_INVALID_ARGUMENT
        ctypes.cast(state, ctypes.POINTER(ctypes.c_int))[0] = self.links[link.value]
        return 0


def test_eighteen_links_recommend_24_sms_of_which_8_send():
    assert hardware.num_sms_for_links(18) == DEFAULT_NUM_SMS == 24
    assert sender_blocks(DEFAULT_NUM_SMS) == 8


@pytest.mark.parametrize("links, num_sms", [(0, 4), (4, 6), (12, 18), (18, 24)])
def test_the_sm_count_follows_the_links_three_blocks_per_sender(links, num_sms):
    assert hardware.num_sms_for_links(links) == num_sms
    assert num_sms % 2 == 0


@pytest.mark.parametrize("links", [12, 18])
def test_the_recommended_sm_count_sends_with_the_blocks_that_fill_the_links(links):
    assert sender_blocks(hardware.num_sms_for_links(links)) == hardware.senders_for_links(links)


def test_only_enabled_links_count():
    assert hardware.active_nvlinks("0000:00:00.0", FakeNvml([1] * 12 + [0] * 6)) == 12
    assert hardware.active_nvlinks("0000:00:00.0", FakeNvml([])) == 0


def test_a_gpu_nvml_does_not_know_gives_no_count():
    assert hardware.active_nvlinks("0000:00:00.0", FakeNvml([1] * 18, found=False)) is None


def test_without_a_gpu_the_recommendation_is_that_of_eighteen_links(monkeypatch):
    def no_gpu(_device_id):
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(hardware, "_num_sms_of_device", no_gpu)
    assert hardware.recommended_num_sms() == DEFAULT_NUM_SMS


def test_the_recommended_configs_take_the_gpus_sm_count(monkeypatch):
    monkeypatch.setattr(hardware, "recommended_num_sms", lambda device_id=None: 18)
    assert ep.get_dispatch_config(2).num_sms == ep.get_combine_config(8).num_sms == 18
