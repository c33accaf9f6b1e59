"""The backward family without a GPU: configs are checked and named, plans fit the register and
shared-memory budgets they claim, the workspace layout is padded and aligned, the launches come in
the order the kernels need, and the rendered source compiles for sm_80 and sm_90a with nvcc with
no spills (the backward's dK/dV accumulators sit at the edge of the 255-register file)."""

from __future__ import annotations

import math

import pytest

from attngen import families, targets
from attngen.build import nvcc
from attngen.errors import SpecError
from attngen.families import BACKWARD_FAMILIES
from attngen.families.base import BackwardCall
from attngen.families.bwd_shared import ALIGN, Workspace
from attngen.families.bwd_sm80.family import (
    ACCUMULATOR_BUDGET,
    REGISTER_BUDGET,
    BwdConfig,
    smem_bytes,
)
from attngen.runtime.tensors import TensorInfo
from attngen.spec import AttentionSpec

FAMILY = BACKWARD_FAMILIES["bwd_sm80"]
H100 = targets.target("sm_90a")
A100 = targets.target("sm_80")


def info(name, shape, dtype="bfloat16"):
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorInfo(name, "torch", 1 << 20, tuple(shape), strides, dtype, 0)


def call(B=2, Sq=100, Sk=300, Hq=8, Hkv=2, D=128, inputs=()):
    """A backward call's layout (no GPU: made-up pointers), for plans and launches."""
    q, k = info("q", (B, Sq, Hq, D)), info("k", (B, Sk, Hkv, D))
    lse = info("lse", (B, Hq, Sq), "float32")
    return BackwardCall(q, k, info("v", k.shape), info("out", q.shape), lse, info("dout", q.shape), None,
                        info("dq", q.shape), info("dk", k.shape), info("dv", k.shape), 0.125, workspace=1 << 30,
                        inputs=inputs)


def test_the_backward_registry_holds_the_family_and_select_finds_it():
    spec = AttentionSpec(head_dim=128, mask="causal")
    assert families.select(spec.problem, A100, None, "backward") is FAMILY  # sm_90a prefers bwd_sm90
    assert families.get_family("bwd_sm80") is FAMILY
    with pytest.raises(SpecError, match="family='bwd_sm80' is a backward family"):
        families.select(spec.problem, H100, "bwd_sm80", "forward")


def test_head_dim_256_is_refused_with_the_reason():
    spec = AttentionSpec(head_dim=256)
    assert "head_dim 256" in FAMILY.supports(spec.problem, H100)
    with pytest.raises(SpecError, match="no backward kernel family can run"):
        families.select(spec.problem, H100, None, "backward")


@pytest.mark.parametrize("config, message", [
    ({"block_n": 128, "num_warps": 2}, "block_n / num_warps in {16, 32}"),
    ({"num_stages": 3}, r"config.num_stages=3 is invalid; allowed: \{1, 2\}"),
    ({"block_q": 64}, "config field 'block_q' is not one of family bwd_sm80's"),
])
def test_bad_configs_are_named(config, message):
    problems = FAMILY.check_config(config)
    assert any(message in p or __import__("re").search(message, p) for p in problems), problems


def test_a_config_beyond_the_accumulator_budget_is_refused():
    spec = AttentionSpec(head_dim=128)
    with pytest.raises(SpecError, match="registers of dK/dV per thread"):
        FAMILY.plan(spec.problem, H100, BwdConfig(64, 128, 4, 2))  # 32 keys per warp at d128: 256 registers
    assert all(2 * c.keys_per_warp * 128 // 32 <= ACCUMULATOR_BUDGET for c in FAMILY.configs(spec.problem, H100))


def test_a_config_beyond_shared_memory_is_refused_with_the_numbers():
    spec = AttentionSpec(head_dim=128)
    config = BwdConfig(128, 128, 8, 2)
    assert smem_bytes(config, 128) > H100.smem_per_block
    with pytest.raises(SpecError, match=f"needs {smem_bytes(config, 128)} B of shared memory"):
        FAMILY.plan(spec.problem, H100, config)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("target", [A100, H100], ids=lambda t: t.name)
def test_defaults_fit_and_their_register_steps_fit_the_budget(head_dim, target):
    spec = AttentionSpec(head_dim=head_dim)
    plan = FAMILY.plan(spec.problem, target, FAMILY.default_config(spec.problem, target))
    assert plan.smem_bytes <= target.smem_per_block
    keys = plan.block_n // plan.num_warps
    assert 2 * keys * head_dim // 32 + 3 * keys * plan.sub_m // 32 <= REGISTER_BUDGET
    assert plan.block_m % plan.sub_m == 0


def test_the_workspace_is_padded_to_whole_query_blocks_and_aligned():
    spec = AttentionSpec(head_dim=128, gqa_ratio=4)
    plan = FAMILY.plan(spec.problem, H100, BwdConfig(64, 128, 8, 2))
    c = call()
    ws = Workspace.of(plan, c)
    assert ws.sq_pad == 128  # 100 queries, blocks of 64
    rows = 2 * 8 * 128
    assert ws.dq_acc % ALIGN == 0 and ws.lse2 - ws.dq_acc >= rows * 128 * 4
    assert ws.delta - ws.lse2 >= rows * 4 and ws.total - ws.delta >= rows * 4
    assert FAMILY.workspace_bytes(plan, c) == ws.total


def test_deterministic_adds_a_counter_per_query_block_and_its_own_kernel_name():
    """deterministic (bwd_shared.py): one int32 counter per (batch, head, query block) after the
    other arrays, zeroed by prep; the kernel waits for its turn before adding dQ; the name says _det."""
    base = AttentionSpec(head_dim=128, gqa_ratio=4, mask="causal")
    det = base.replace(deterministic=True)
    plain, ordered = (FAMILY.plan(s.problem, H100, BwdConfig(64, 128, 8, 2)) for s in (base, det))
    assert ordered.name == plain.name.replace("_bf16_", "_bf16_det_") and ordered.name != plain.name
    c = call()
    ws, ws_det = Workspace.of(plain, c), Workspace.of(ordered, c)
    assert ws_det.dq_turns % ALIGN == 0 and ws_det.total - ws_det.dq_turns >= 2 * 8 * (128 // 64) * 4
    assert ws.total == ws.dq_turns  # none without it
    source, plain_source = FAMILY.render(ordered), FAMILY.render(plain)
    assert "constexpr bool DETERMINISTIC = true;" in source
    assert "constexpr bool DETERMINISTIC = false;" in plain_source


def test_the_hopper_backward_refuses_deterministic_and_the_mma_sync_one_runs_it():
    from attngen.runtime.backward import backward_plan

    spec = AttentionSpec(head_dim=128, gqa_ratio=4, mask="causal", deterministic=True)
    assert "unordered" in BACKWARD_FAMILIES["bwd_sm90"].supports(spec.problem, H100)
    plan = backward_plan(spec, H100)
    assert plan.family == "bwd_sm80" and "_det_" in plan.name
    with pytest.raises(SpecError, match="family='bwd_sm90' cannot run .*unordered"):
        backward_plan(spec.replace(family="bwd_sm90"), H100)


def test_a_mask_table_comes_first_in_the_workspace_and_the_launches():
    spec = AttentionSpec(head_dim=128, gqa_ratio=4, mask="doc[b, q_idx] == doc[b, kv_idx] and causal")
    plan = FAMILY.plan(spec.problem, H100, FAMILY.default_config(spec.problem, H100))
    doc = info("inputs['doc']", (2, 300), "int32")
    c = call()
    c = BackwardCall(**{**c.__dict__, "inputs": (("doc", doc),)})
    ws = Workspace.of(plan, c)
    assert ws.dq_acc > 0  # after the table and the summaries
    symbols = [launch.kernel for launch in FAMILY.launches(plan, c)]
    assert symbols == [f"{plan.name}_mask_summaries", f"{plan.name}_mask_table", f"{plan.name}_prep", plan.name,
                       f"{plan.name}_dq"]


def test_launch_grids_cover_every_row_and_key_block():
    spec = AttentionSpec(head_dim=96, gqa_ratio=4)
    plan = FAMILY.plan(spec.problem, H100, FAMILY.default_config(spec.problem, H100))
    c = call(D=96)
    prep, main, dq = FAMILY.launches(plan, c)
    assert prep.grid[0] * prep.block[0] // 32 >= Workspace.of(plan, c).sq_pad and prep.grid[1:] == (8, 2)
    assert main.grid == (2, math.ceil(300 / plan.block_n), 2) and main.smem_bytes == plan.smem_bytes
    rows_per_block = dq.block[0] // (96 // 8)
    assert dq.grid[0] * rows_per_block >= 100 and dq.grid[1:] == (8, 2)


def test_a_score_modifier_renders_its_derivative():
    spec = AttentionSpec(head_dim=64, mask="causal", score_mod="softcap(30.0)")
    plan = FAMILY.plan(spec.problem, H100, FAMILY.default_config(spec.problem, H100))
    source = FAMILY.render(plan)
    assert "modify_grad" in source and "tanh" in source.split("modify_grad", 1)[1].split("}", 1)[0]


CASES = [
    AttentionSpec(head_dim=64, dtype="fp16"),
    AttentionSpec(head_dim=96, gqa_ratio=4),
    AttentionSpec(head_dim=128, mask="causal", score_mod="softcap(30.0)"),
    AttentionSpec(head_dim=128, mask="doc[b, q_idx] == doc[b, kv_idx] and causal"),
    AttentionSpec(head_dim=64, mask="sliding_window(64, 0)", sink="sinks[h]"),
    AttentionSpec(head_dim=128, gqa_ratio=4, mask="causal", deterministic=True),
    AttentionSpec(head_dim=64, mask="doc[b, q_idx] == doc[b, kv_idx] and causal", deterministic=True, dropout_p=0.1),
]


@pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("spec", CASES, ids=lambda s: s.problem.label())
def test_plans_compile_without_spills(arch, spec):
    target = targets.target(arch)
    plan = FAMILY.plan(spec.problem, target, FAMILY.default_config(spec.problem, target))
    report = nvcc.check_plan(plan)
    for name, kernel in (report.kernels or {plan.name: report}).items():
        assert kernel.spill_bytes == 0 and kernel.stack_frame_bytes == 0, (name, report.log)
