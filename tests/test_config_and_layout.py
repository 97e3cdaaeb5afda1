"""Configs, recommended settings, buffer size hints and the NVLink buffer layout (CPU only)."""

import functools
import json

import pytest

import deepep_cupy as ep
from deepep_cupy.config import (
    CONFIG_ENV,
    LINK_SENDER_BLOCKS,
    combine_sender_blocks,
    peer_blocks_in_place,
    sender_blocks,
)
from deepep_cupy.constants import BLOCK_THREADS
from deepep_cupy.gpu import layout


def test_config_rejects_odd_num_sms():
    with pytest.raises(ValueError, match="num_sms.*even"):
        ep.Config(23, 6, 256)


@pytest.mark.parametrize("field", [0, 1, 2])
def test_config_rejects_non_positive_values(field):
    values = [24, 6, 256]
    values[field] = 0
    with pytest.raises(ValueError, match="positive int"):
        ep.Config(*values)


def test_config_has_a_channel_per_sender_warp():
    warps = BLOCK_THREADS["dispatch_kernel"] // 32
    assert ep.Config(24, 6, 256).num_channels == sender_blocks(24) * warps
    assert 1 <= sender_blocks(2) < 2 and sender_blocks(24) < 24


@pytest.mark.parametrize("num_sms,senders", [(2, 1), (4, 2), (8, 4), (12, 5), (16, 7), (20, 8), (24, 8), (32, 8)])
def test_a_combine_pushes_with_more_blocks_than_the_dispatch_until_they_fill_the_links(num_sms, senders):
    # Never fewer than the dispatch's sender blocks: a combine's items are the dispatch's channels.
    assert combine_sender_blocks(num_sms) == senders
    assert sender_blocks(num_sms) <= senders <= LINK_SENDER_BLOCKS and senders < num_sms


@pytest.mark.parametrize("num_sms,num_ranks,peer_blocks", [(24, 2, 16), (16, 2, 8), (32, 2, 24), (24, 8, 22),
                                                         (12, 2, 12), (8, 2, 8), (8, 8, 8), (2, 2, 2)])
def test_an_in_place_dispatch_keeps_its_own_rows_apart_once_the_other_blocks_fill_the_links(num_sms, num_ranks,
                                                                                            peer_blocks):
    # peer_blocks == num_sms: no split, every block writes every destination.
    assert peer_blocks_in_place(num_sms, num_ranks) == peer_blocks
    assert peer_blocks == num_sms or peer_blocks >= LINK_SENDER_BLOCKS


@pytest.mark.parametrize("num_ranks", range(2, 9))
def test_recommended_configs_exist_for_every_rank_count(num_ranks):
    for config in (ep.get_dispatch_config(num_ranks), ep.get_combine_config(num_ranks)):
        assert isinstance(config, ep.Config) and config.num_sms % 2 == 0


@pytest.mark.parametrize("num_ranks", [1, 9])
def test_recommended_configs_refuse_unsupported_rank_counts(num_ranks):
    with pytest.raises(ValueError, match="num_ranks"):
        ep.get_dispatch_config(num_ranks)


def test_tuned_config_file_overrides_the_recommendation(tmp_path, monkeypatch):
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"num_ranks": 2, "device": "test",
                                "dispatch": {"num_sms": 32, "num_max_nvl_chunked_send_tokens": 8,
                                             "num_max_nvl_chunked_recv_tokens": 128},
                                "combine": {"num_sms": 32, "num_max_nvl_chunked_send_tokens": 4,
                                            "num_max_nvl_chunked_recv_tokens": 64}}))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert ep.get_dispatch_config(2) == ep.Config(32, 8, 128)
    assert ep.get_combine_config(2) == ep.Config(32, 4, 64)
    monkeypatch.delenv(CONFIG_ENV)
    assert ep.get_dispatch_config(2) != ep.Config(32, 8, 128)  # back to the built-in recommendation


def test_unreadable_tuned_config_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=CONFIG_ENV):
        ep.get_dispatch_config(2)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_size_hint_covers_bf16_and_fp8_dispatch_and_combine(num_ranks):
    config = ep.Config(24, 16, 256)
    hidden, C = 7168, config.num_channels
    hint = ep.get_nvl_buffer_size_hint(hidden * 2, num_ranks, config, num_topk=8, num_max_tokens_per_rank=4096)
    bf16 = layout.dispatch_layout(num_ranks, C, 4096, hidden * 2, 8, 0)
    fp8 = layout.dispatch_layout(num_ranks, C, 4096, hidden, 8, hidden // 128)
    combine = layout.combine_layout(num_ranks, C, 4096, hidden * 2, 8)
    assert hint >= max(bf16.total_bytes, fp8.total_bytes, combine.total_bytes)


def test_size_hint_grows_with_the_tokens_per_rank():
    small = ep.get_nvl_buffer_size_hint(7168 * 2, 2, ep.Config(24, 16, 256), num_max_tokens_per_rank=1024)
    large = ep.get_nvl_buffer_size_hint(7168 * 2, 2, ep.Config(24, 16, 256), num_max_tokens_per_rank=2048)
    assert large - small >= 1024 * 7168 * 2


def test_eight_ranks_of_8192_bf16_tokens_of_hidden_7168_fit_in_2_gib():
    assert ep.get_nvl_buffer_size_hint(7168 * 2, 8, num_topk=8, num_max_tokens_per_rank=8192) <= 2 << 30


def test_eight_ranks_of_8192_bf16_tokens_with_recv_x_in_the_buffer_fit_in_2_gib():
    assert ep.get_nvl_buffer_size_hint(7168 * 2, 8, num_topk=8, num_max_tokens_per_rank=8192,
                                       recv_x_in_buffer=True) <= 2 << 30


@pytest.mark.parametrize("num_ranks", [2, 8])
def test_an_in_place_dispatch_has_a_row_of_every_output_for_every_token_a_rank_may_receive(num_ranks):
    T, row_bytes, K, S = 1000, 7168, 8, 56
    lay = layout.dispatch_layout(num_ranks, 96, T, row_bytes, K, S, rows_in_buffer=True)
    assert lay.rows == num_ranks * T
    # recv_x, source indices, int64 top-k ids, weights and scales follow each other without overlap.
    ends = [(lay.x_off, row_bytes), (lay.src_idx_off, 4), (lay.topk_idx_off, 8 * K), (lay.topk_weights_off, 4 * K),
            (lay.scales_off, 4 * S)]
    for (offset, per_row), (next_offset, _) in zip(ends, ends[1:] + [(lay.total_bytes, 0)]):
        assert offset + lay.rows * per_row <= next_offset
    hint = ep.get_nvl_buffer_size_hint(row_bytes * 2, num_ranks, ep.Config(24, 4, 256), num_topk=K,
                                       num_max_tokens_per_rank=T, recv_x_in_buffer=True)
    assert hint >= layout.dispatch_layout(num_ranks, ep.Config(24, 4, 256).num_channels, T, row_bytes * 2, K, S,
                                          rows_in_buffer=True).total_bytes


def test_the_largest_fitting_regions_fit_and_one_more_slot_would_not():
    make = functools.partial(layout.dispatch_layout, 4, 96, row_bytes=7168, num_topk=8, num_scales=56)
    for num_bytes in (10 << 20, 123456789, 1 << 30):
        plan = layout.largest_fitting(make, num_bytes)
        assert plan.total_bytes <= num_bytes < make(plan.region_tokens + 1).total_bytes


def test_no_regions_fit_a_buffer_smaller_than_one_slot():
    make = functools.partial(layout.combine_layout, 2, 96, row_bytes=14336, num_topk=8)
    assert layout.largest_fitting(make, layout.DATA_OFFSET + 1024) is None


def _regions(plan, names):
    return [getattr(plan, name) for name in names]


def test_dispatch_regions_are_aligned_ordered_and_after_the_header():
    plan = layout.dispatch_layout(8, 24, 256, 7168, 8, 56)
    offsets = _regions(plan, ["meta_off", "x_off", "src_idx_off", "topk_idx_off", "topk_weights_off", "scales_off"])
    assert offsets[0] >= layout.DATA_OFFSET
    assert all(o % layout.ALIGNMENT == 0 for o in offsets)
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    queues, slots = 24 * 8, 7 * 256                               # one region per other rank
    assert offsets[1] - offsets[0] >= 3 * 4 * queues          # start/end/tail per channel and source
    assert offsets[2] - offsets[1] >= slots * 7168             # the rows
    assert plan.total_bytes >= offsets[5] + slots * 56 * 4     # the scales fit
    assert plan.zero_count == 3 * queues and plan.region_tokens == 256


def test_combine_regions_are_aligned_ordered_and_after_the_header():
    plan = layout.combine_layout(4, 12, 128, 14336, 8)
    offsets = _regions(plan, ["meta_off", "x_off", "topk_weights_off"])
    assert offsets[0] >= layout.DATA_OFFSET
    assert all(o % layout.ALIGNMENT == 0 for o in offsets)
    assert offsets[1] - offsets[0] >= 4 * 12 * 4
    assert offsets[2] - offsets[1] >= 3 * 128 * 14336
    assert plan.zero_count == 12 * 4 and plan.region_tokens == 128


def test_notify_areas_hold_the_largest_tables_and_do_not_overlap():
    # signature, rank counts, expert counts and receive capacity rows of every rank
    largest = 4 * layout.MAX_RANKS * (layout.SIGNATURE_INTS + layout.MAX_RANKS + layout.MAX_LOCAL_EXPERTS + 1)
    first, second = layout.NOTIFY_OFFSETS
    assert first >= layout.SIGNAL_BYTES
    assert second - first >= largest
    assert layout.DATA_OFFSET - second >= largest
