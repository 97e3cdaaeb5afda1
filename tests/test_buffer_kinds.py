"""One engine per Buffer: every kind of Buffer (intranode, internode, low-latency) answers every
public property, or raises a clear error naming its kind; the Buffer only delegates (CPU, fake
hardware)."""

import ast
import contextlib
import inspect
from pathlib import Path

import pytest
from host_fakes import DEVICE, FakeGroup, FakeMapped, FakeNvlBuffer, FakeOrder, buffer_over, fake_buffer
from internode_fakes import make_paths

import deepep_cupy as ep
from deepep_cupy import buffer as buffer_module
from deepep_cupy.gpu.slots import HostSlots
from deepep_cupy.intranode.engine import IntranodeEngine
from deepep_cupy.low_latency.engine import LowLatencyEngine
from deepep_cupy.low_latency.path import LowLatencyPath, get_low_latency_rdma_size_hint

#: What each kind answers with a value; the other public properties raise BufferKindError.
ANSWERED = {
    "intranode": {"allocate_ahead", "last_dispatch_allocation", "last_dispatch_rows_allocated", "last_count_wait_s",
                  "comm_stream"},
    "low-latency": {"allocate_ahead", "last_dispatch_allocation", "last_dispatch_rows_allocated",
                    "last_count_wait_s", "comm_stream"},
    "internode": {"last_internode_rows", "comm_stream"},
}
#: The settings every kind keeps as they were given.
SETTINGS = ("group", "rank", "num_ranks", "group_size", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode",
            "explicitly_destroy", "device_id", "timeout_s", "topology", "internode_transport")


def public_properties():
    return sorted(name for name, value in vars(ep.Buffer).items()
                  if isinstance(value, property) and not name.startswith("_"))


def intranode_buffer(monkeypatch):
    return fake_buffer(monkeypatch)[0]


def low_latency_buffer(monkeypatch):
    node = fake_buffer(monkeypatch)[0]._engine
    num_bytes = get_low_latency_rdma_size_hint(16, 512, 2, 8)
    nvl = FakeNvlBuffer(num_bytes)
    path = LowLatencyPath(peer_table_ptr=0xB0F, local_ptr=nvl.local_ptr, num_bytes=num_bytes, rank=0, num_ranks=2,
                          device_id=DEVICE, order=node.order, slots=node.slots, timeout_s=5.0, num_sms=4,
                          on_device=contextlib.nullcontext(), owner=nvl)
    node.mapped_beside.append(path)  # as LowLatencyEngine.create does
    return buffer_over(monkeypatch, LowLatencyEngine(node, path, lambda: None), group=node.group,
                       num_rdma_bytes=num_bytes, low_latency_mode=True)


def internode_buffer(monkeypatch):
    path = make_paths(2, 2)[0]
    return buffer_over(monkeypatch, path, group=FakeGroup(0, 4), num_rdma_bytes=1 << 20)


BUILD = {"intranode": intranode_buffer, "low-latency": low_latency_buffer, "internode": internode_buffer}


@pytest.mark.parametrize("kind", sorted(BUILD))
def test_every_public_property_answers_or_names_the_buffers_kind(kind, monkeypatch):
    buf = BUILD[kind](monkeypatch)
    assert buf._engine.kind == kind
    for name in public_properties():
        if name in ANSWERED[kind] or name in SETTINGS:
            getattr(buf, name)
        else:
            with pytest.raises(ep.BufferKindError, match=f"{name}: not available on this {kind} Buffer"):
                getattr(buf, name)


def test_the_list_of_answers_covers_every_public_property():
    listed = set(SETTINGS) | set().union(*ANSWERED.values())
    missing = set(public_properties()) - listed
    # A property no kind answers would be a property of no Buffer at all.
    assert missing == set()


@pytest.mark.parametrize("kind", sorted(BUILD))
def test_the_settings_are_the_ones_given(kind, monkeypatch):
    buf = BUILD[kind](monkeypatch)
    assert buf.num_ranks == buf.group_size == 2 if kind != "internode" else buf.num_ranks == 4
    assert buf.timeout_s == 5.0 and buf.device_id == DEVICE
    assert (buf.topology is not None) == (kind == "internode")
    assert (buf.internode_transport is not None) == (kind == "internode")


@pytest.mark.parametrize("kind", ["intranode", "internode"])
def test_the_decode_calls_name_the_buffers_kind_and_how_to_make_one_that_has_them(kind, monkeypatch):
    buf = BUILD[kind](monkeypatch)
    with pytest.raises(ep.BufferKindError, match=rf"low_latency_dispatch: not available on this {kind} Buffer; "
                                                 r"create it as Buffer\(group, 0, "):
        buf.low_latency_dispatch(None, None, 16, 8)


def test_a_low_latency_buffer_without_nvlink_bytes_refuses_dispatch_naming_the_size_it_needs(monkeypatch):
    engine = IntranodeEngine(ep.ThreadGroup.create(2)[0], 0, 5.0, DEVICE, True)
    engine.attach(HostSlots(0, 5.0, in_process=False, mapped=FakeMapped()), FakeOrder(), 0)
    buf = buffer_over(monkeypatch, engine, num_nvl_bytes=0, num_rdma_bytes=1 << 20, low_latency_mode=True)
    with pytest.raises(ValueError, match="dispatch: this Buffer has no NVLink buffer"):
        buf.dispatch(None)


def test_every_public_operation_of_the_buffer_is_one_delegation_to_its_engine():
    tree = ast.parse(Path(inspect.getsourcefile(buffer_module)).read_text())
    buffer_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Buffer")
    for method in buffer_class.body:
        if not isinstance(method, ast.FunctionDef) or method.name.startswith("_"):
            continue
        body = [s for s in method.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        assert len(body) == 1, method.name  # one statement after the docstring
        assert not any(isinstance(n, ast.If) for n in ast.walk(method)), method.name


def test_the_buffer_chooses_its_engine_once_with_one_return_path_in_init():
    init = inspect.getsource(ep.Buffer.__init__)
    assert "return" not in init and init.count("make_engine(") == 1
    assert "self._internode" not in inspect.getsource(ep.Buffer)


def test_destroying_a_low_latency_buffer_frees_its_low_latency_buffer_and_refuses_later_decode_calls(monkeypatch):
    buf = low_latency_buffer(monkeypatch)
    path = buf._engine.path
    closed = []
    monkeypatch.setattr(path, "close", lambda: closed.append("low-latency buffer"))
    buf.destroy()
    assert closed == ["low-latency buffer"]
    with pytest.raises(ep.DeepEPError, match="destroyed"):
        buf.low_latency_dispatch(None, None, 16, 8)
    buf.destroy()  # again: nothing more to free
    assert closed == ["low-latency buffer"]
