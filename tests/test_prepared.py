"""Prepared calls (attngen/runtime/prepared.py) on the CPU, with a stand-in kernel: launches are
packed once per pointer set and only for that set, the memo is bounded, and a Prepared resolved
under one tuning database is stale once the database changes."""

from __future__ import annotations

import dataclasses
import math

from attngen.families.base import ForwardCall
from attngen.runtime.prepared import MAX_BOUND, Prepared
from attngen.runtime.tensors import TensorInfo


class RecordingKernel:
    def __init__(self, workspace_bytes=0):
        self.bound = []
        self.workspace = workspace_bytes

    def workspace_bytes(self, call: ForwardCall) -> int:
        return self.workspace

    def bind(self, call: ForwardCall):
        self.bound.append(call)
        return (("launch", call.q.ptr, call.k.ptr, call.v.ptr, call.out.ptr, call.lse.ptr),)


def _call(B=2, S=100, H=4, D=64) -> ForwardCall:
    def info(name, shape, dtype="bfloat16"):
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))  # contiguous
        return TensorInfo(name, "torch", 0, shape, strides, dtype, 0)

    return ForwardCall(info("q", (B, S, H, D)), info("k", (B, S, H, D)), info("v", (B, S, H, D)),
                       info("out", (B, S, H, D)), info("lse", (B, H, S), "float32"), 0.125)


def test_launches_are_packed_once_per_pointer_set_with_those_pointers():
    kernel = RecordingKernel()
    prepared = Prepared(kernel, _call(), stamp=None)
    first = prepared.launches((16, 32, 48, 64, 80, 0))
    assert prepared.launches((16, 32, 48, 64, 80, 0)) is first and len(kernel.bound) == 1
    other = prepared.launches((96, 32, 48, 64, 80, 0))
    assert other[0][1:] == (96, 32, 48, 64, 80) and len(kernel.bound) == 2
    call = kernel.bound[-1]
    assert call.q.shape == (2, 100, 4, 64) and call.lse.shape == (2, 4, 100) and call.softmax_scale == 0.125
    assert (prepared.out_shape, prepared.lse_shape, prepared.empty) == ((2, 100, 4, 64), (2, 4, 100), False)


def test_the_pointer_memo_is_bounded():
    prepared = Prepared(RecordingKernel(), _call(), stamp=None)
    for i in range(3 * MAX_BOUND):
        prepared.launches((16 * i, 0, 0, 0, 0, 0))
    assert len(prepared._bound) <= MAX_BOUND


def test_empty_calls_launch_nothing():
    assert Prepared(RecordingKernel(), _call(B=0), stamp=None).empty
    assert Prepared(RecordingKernel(), _call(S=0), stamp=None).empty


def test_a_prepared_call_is_stale_once_the_tuning_database_changes(monkeypatch):
    from attngen.tune import lookup

    stamps = iter([("db", 1), ("db", 1), ("db", 2)])
    monkeypatch.setattr(lookup, "recent_stamp", lambda: next(stamps))
    prepared = Prepared(RecordingKernel(), _call(), stamp=("db", 1))
    assert prepared.current() and prepared.current() and not prepared.current()
    assert Prepared(RecordingKernel(), _call(), stamp=None).current()  # fully configured: never stale


def test_runtime_inputs_and_the_workspace_join_the_pointer_set():
    """A layout's workspace and runtime inputs are addressed like q, k, v: after out and lse."""
    call = _call()
    doc = TensorInfo("inputs['doc']", "torch", 0, (2, 100), (100, 1), "int32", 0)
    kernel = RecordingKernel(workspace_bytes=512)
    prepared = Prepared(kernel, dataclasses.replace(call, inputs=(("doc", doc),)), stamp=None)
    assert prepared.workspace_bytes == 512
    prepared.launches((16, 32, 48, 64, 80, 1024, 4096))
    prepared.launches((16, 32, 48, 64, 80, 2048, 8192))
    assert [(c.workspace, c.input("doc").ptr) for c in kernel.bound] == [(1024, 4096), (2048, 8192)]
    assert kernel.bound[0].input("doc").shape == (2, 100) and kernel.bound[0].q.ptr == 16
