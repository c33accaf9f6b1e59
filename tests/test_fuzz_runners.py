"""KernelRunner's device wiring (CPU, with the CUDA queries stood in for): one device index decides the
tensors' device, the arch family the plans resolve for, the exact compile target and the compile."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from attngen import compiler, runtime
from attngen.fuzz.runners import KernelRunner, Machine
from attngen.plan import make_plan
from attngen.spec import AttentionSpec

SPEC = AttentionSpec(head_dim=128, dtype="bf16")


@pytest.fixture
def fake_gpu(monkeypatch):
    """An sm_86 GPU at index 1, torch's current device; records the device index each query is asked about."""
    asked = {"arch": [], "compile": [], "synchronize": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"NVIDIA A10 (cuda:{index})")
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda *a: pytest.fail("the runner must ask attngen.runtime, not torch, for the arch"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: asked["synchronize"].append(index))
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: "nvrtc-12.4")

    def device_arch(index):
        asked["arch"].append(index)
        return runtime.arch_family("sm_86"), "sm_86"

    def compile_kernel(spec, device=None, *, fault=None):
        asked["compile"].append(device)
        plan = make_plan(spec, runtime.arch_family("sm_86"), fault=fault)
        return _FakeKernel(plan)

    monkeypatch.setattr(runtime, "_device_arch", device_arch)
    monkeypatch.setattr(runtime, "compile", compile_kernel)
    return asked


class _FakeKernel:
    def __init__(self, plan):
        self.plan = plan

    def __call__(self, q, k, v, *, out, lse, softmax_scale=None):
        pass


def test_one_device_index_for_tensors_arch_target_and_compile(fake_gpu):
    runner = KernelRunner(fault="drop_last_partial_kv_tile")
    assert runner.device == "cuda:1" and runner.arch == "sm_80"
    assert runner.machine == Machine("sm_80", "sm_86", "NVIDIA A10 (cuda:1)", "nvrtc-12.4")
    assert fake_gpu["arch"] == [1]
    name = runner.kernel_name(SPEC)
    assert name == make_plan(SPEC, "sm_80", fault="drop_last_partial_kv_tile").name
    assert name.endswith("_fault_drop_last_partial_kv_tile")
    runner(SPEC, None, None, None, out=None, lse=None)
    assert fake_gpu["compile"] == [1] and fake_gpu["synchronize"] == [1]
    assert runner.launched == [name]  # the symbol it launched, for the sanitizer's check
