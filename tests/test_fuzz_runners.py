"""KernelRunner's device wiring (CPU, with the CUDA queries stood in for): one device index decides the
tensors' device, the exact compile target the plans are made for, the machine it records and the compile."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from attngen import targets
from attngen.build import compiler
from attngen.errors import SpecError
from attngen.families import plan_spec
from attngen.fuzz.runners import KernelRunner, Machine, ReferenceRunner
from attngen.runtime import dispatch
from attngen.spec import AttentionSpec

SPEC = AttentionSpec(head_dim=128, dtype="bf16")
A10 = targets.for_compute_capability(8, 6, sms=72, device_name="NVIDIA A10")


@pytest.fixture
def fake_gpu(monkeypatch):
    """An sm_86 GPU at index 1, torch's current device; records the device index each query is asked about."""
    asked = {"target": [], "compile": [], "synchronize": []}
    gpu = {"target": A10}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"NVIDIA A10 (cuda:{index})")
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda *a: pytest.fail("the runner must ask attngen.targets, not torch, for the target"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: asked["synchronize"].append(index))
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setattr(compiler, "nvrtc_version", lambda: "nvrtc-12.4")

    def device_target(index):
        asked["target"].append(index)
        if isinstance(gpu["target"], Exception):
            raise gpu["target"]
        return gpu["target"]

    def kernel_for(plan, device):  # the real dispatch.compile plans; building and loading are stood in for
        asked["compile"].append(device)
        return _FakeKernel(plan)

    monkeypatch.setattr(targets, "device_target", device_target)
    monkeypatch.setattr(dispatch, "kernel_for", kernel_for)
    asked["gpu"] = gpu
    return asked


class _FakeKernel:
    def __init__(self, plan):
        self.plan = plan

    def __call__(self, q, k, v, *, out, lse, softmax_scale=None, inputs=None):
        pass


def test_one_device_index_for_tensors_target_machine_and_compile(fake_gpu):
    runner = KernelRunner(fault="drop_last_partial_kv_tile")
    assert runner.device == "cuda:1" and runner.target is A10 and runner.target.name == "sm_86"
    assert runner.machine == Machine("sm_86", "NVIDIA A10 (cuda:1)", "nvrtc-12.4")
    assert fake_gpu["target"] == [1]
    name = runner.kernel_name(SPEC)
    assert name == plan_spec(SPEC, A10, fault="drop_last_partial_kv_tile").name
    assert name.endswith("_sm86_fault_drop_last_partial_kv_tile")
    runner(SPEC, None, None, None, out=None, lse=None)
    assert fake_gpu["compile"] == [1] and fake_gpu["synchronize"] == [1] and set(fake_gpu["target"]) == {1}
    assert runner.launched == [name]  # the plan it launched, for the sanitizer's check


def test_a_pinned_family_this_gpu_cannot_run_is_a_spec_error_naming_it(fake_gpu, sm90a_only_family):
    runner = KernelRunner()
    pinned = SPEC.replace(family=sm90a_only_family.name)
    for run in (lambda: runner.kernel_name(pinned), lambda: runner(pinned, None, None, None, out=None, lse=None)):
        with pytest.raises(SpecError, match=rf"family='{sm90a_only_family.name}' cannot run .* on sm_86: needs sm_90a"):
            run()
    assert runner.launched == []
    # Unpinned, the same problem runs as a family this GPU supports.
    assert plan_spec(SPEC, A10).family != sm90a_only_family.name


def test_a_gpu_no_family_supports_fails_to_start_with_the_reason(fake_gpu):
    fake_gpu["gpu"]["target"] = ValueError("the GPU (Tesla T4) has compute capability 7.5; attngen kernels need 8.0")
    with pytest.raises(RuntimeError, match=r"compute capability 7.5; attngen kernels need 8.0"):
        KernelRunner()


def test_without_cupy_the_runner_says_which_extra_to_install(fake_gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(RuntimeError, match=r'pip install "attngen\[cuda13\]"'):
        KernelRunner()


def test_the_reference_runner_names_the_default_targets_plans():
    runner = ReferenceRunner()
    assert runner.target == targets.target(targets.DEFAULT_ARCH) and runner.machine == Machine(runner.target.name)
    assert runner.kernel_name(SPEC) == plan_spec(SPEC, runner.target).name
