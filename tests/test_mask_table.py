"""The block table of masks that read runtime inputs (attngen/mask_table.py), on the CPU: which
plans build one, its workspace layout and launches, and the bounds it must hold (the Python model
the GPU test compares the kernel's table with)."""

from __future__ import annotations

import math

import pytest
import torch

from attngen import families, mask_table, targets
from attngen.families.base import ForwardCall
from attngen.masks import get_mask
from attngen.runtime.tensors import TensorInfo
from attngen.spec import AttentionSpec

DOCS = "doc[b, q_idx] == doc[b, kv_idx] and causal"


def _call(B, S, H, D, inputs) -> ForwardCall:
    def info(name, shape, dtype="bfloat16"):
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return TensorInfo(name, "torch", 0, shape, strides, dtype, 0)

    return ForwardCall(info("q", (B, S, H, D)), info("k", (B, S, H, D)), info("v", (B, S, H, D)),
                       info("out", (B, S, H, D)), info("lse", (B, H, S), "float32"), 0.125, workspace=1 << 20,
                       inputs=tuple((name, info(f"inputs[{name!r}]", shape, "int32"))
                                    for name, shape in sorted(inputs.items())))


@pytest.mark.parametrize("mask, expected", [
    ("causal", None), ("sliding_window(64, 0)", None), ("causal and chunked(64)", None),  # closed forms
    ("kv_idx % 3 != 1", ()), ("kv_idx < lim or q_idx == kv_idx", ()),  # a table, nothing to summarize (a scalar is read exactly)
    (DOCS, (("doc", 2),)), ("doc[b, q_idx] == doc[b, kv_idx] and h < 4", (("doc", 2),)),
])
def test_plans_build_a_table_for_masks_without_a_closed_form(mask, expected):
    table = mask_table.for_problem(AttentionSpec(head_dim=64, mask=mask).problem)
    assert (None if table is None else tuple((d.name, d.arity) for d in table.inputs)) == expected
    if table is not None:
        assert table.by_batch == ("b," in mask) and table.by_head == ("h <" in mask)


@pytest.fixture(autouse=True)
def _no_tensor_maps(monkeypatch):
    # fwd_sm90 packs TMA descriptors (cuda-python, absent in CI): opaque bytes here.
    from attngen.families import tma

    monkeypatch.setattr(tma, "encode", lambda *args: bytes(128))


@pytest.mark.parametrize("family, arch", [("fwd_sm80", "sm_80"), ("fwd_sm90", "sm_90a")])
def test_the_table_kernels_run_first_in_one_workspace(family, arch):
    # A BlockMask's state conjoined: the forward families then also keep key-block lists.
    spec = AttentionSpec(head_dim=128, mask=f"{DOCS} and block_mask_state[b, 0, q_idx // 128, kv_idx // 128] != 0",
                         score_mod="alibi", gqa_ratio=2, family=family)
    plan = families.plan_spec(spec, targets.target(arch))
    fam = families.get_family(family)
    call = _call(2, 1000, 8, 128, {"block_mask_state": (2, 1, 8, 8), "doc": (2, 1000), "slope": (8,)})
    offsets, table_at, total = mask_table.layout(plan.mask_table, call, plan.block_m)
    m_blocks = math.ceil(1000 / plan.block_m)
    assert offsets == {"block_mask_state": 0, "doc": 256} and table_at == 256 + 2 * math.ceil(1000 / 16) * 8 // 256 * 256 + 256
    lists_at = table_at + -(-(2 * m_blocks * 16) // 256) * 256  # a table per batch entry, not per head
    list_ints = math.ceil(1000 / plan.block_n)  # forward families: each entry's key-block list
    assert total == lists_at + -(-(2 * m_blocks * list_ints * 4) // 256) * 256
    dynamic = getattr(plan, "schedule", None) == "dynamic"  # fwd_sm90's tile counter follows the table,
    order = 2 * m_blocks * 4 if dynamic else 0  # then its query blocks' order (an int each, per table row)
    assert fam.workspace_bytes(plan, call) == total + (mask_table.ALIGN if dynamic else 0) + order
    launches = fam.launches(plan, call)
    assert [launch.kernel for launch in launches] == [f"{plan.name}_mask_summaries", f"{plan.name}_mask_table",
                                                      *([f"{plan.name}_reset"] if dynamic else []), plan.name]
    assert launches[1].grid[0] * mask_table.THREADS >= 2 * m_blocks * 32  # a warp per table entry
    abi = plan.kernels[0].abi
    params = launches[-1].params
    assert all(launch.params == params for launch in launches)  # one argument struct for the three
    read = {name: int.from_bytes(params[abi.offsets[name]:abi.offsets[name] + 8], "little")
            for name in ("sum_doc", "mask_table", "mask_list")}
    assert read == {"sum_doc": (1 << 20) + offsets["doc"], "mask_table": (1 << 20) + table_at,
                    "mask_list": (1 << 20) + lists_at}


@pytest.mark.parametrize("family, arch", [("fwd_sm80", "sm_80"), ("fwd_sm90", "sm_90a")])
def test_only_blockmask_and_periodic_tables_keep_key_block_lists(family, arch):
    plan = families.plan_spec(AttentionSpec(head_dim=128, mask=DOCS, family=family), targets.target(arch))
    assert plan.mask_table.list_block_n is None and "mask_list" not in plan.kernels[0].abi.offsets
    for holey in ("block_mask_state[0, h, q_idx // 128, kv_idx // 128] != 0", "causal and (kv_idx // 64) % 4 == 0",
                  "kv_idx % 3 != 1"):  # a BlockMask, and masks dividing kv_idx: periodic holes
        plan = families.plan_spec(AttentionSpec(head_dim=128, mask=holey, family=family), targets.target(arch))
        assert plan.mask_table.list_block_n == plan.block_n, holey
    plan = families.plan_spec(AttentionSpec(head_dim=128, mask="q_idx // 64 >= kv_idx // 64", family=family),
                              targets.target(arch))
    assert plan.mask_table.list_block_n is not None  # kv_idx // 64 divides kv_idx


@pytest.mark.parametrize("family", ["bwd_sm80", "bwd_sm90"])
def test_backward_tables_hold_bounds_only(family):
    spec = AttentionSpec(head_dim=128, mask="block_mask_state[0, h, q_idx // 128, kv_idx // 128] != 0 and causal",
                         family=family)
    plan = families.plan_spec(spec, targets.target("sm_90a"))
    call = _call(2, 1000, 8, 128, {"block_mask_state": (1, 8, 8, 8)})
    assert plan.mask_table.list_block_n is None and "mask_list" not in plan.kernels[0].abi.offsets
    _, table_at, total = mask_table.layout(plan.mask_table, call, plan.block_m)
    assert total == table_at + -(-(8 * math.ceil(1000 / plan.block_m) * 16) // 256) * 256  # per head: h is read


def test_a_mask_without_inputs_builds_its_table_alone():
    spec = AttentionSpec(head_dim=64, mask="q_idx + kv_idx < 1500", family="fwd_sm80")
    plan = families.plan_spec(spec, targets.target("sm_80"))
    call = _call(1, 1000, 2, 64, {})
    launches = families.get_family("fwd_sm80").launches(plan, call)
    assert [launch.kernel for launch in launches] == [f"{plan.name}_mask_table", plan.name]
    assert mask_table.layout(plan.mask_table, call, plan.block_m)[2] == 256  # one table for every batch and head


def test_without_a_table_there_is_no_workspace():
    # One CTA per tile: no tile counter either (the dynamic schedule keeps one in the workspace).
    spec = AttentionSpec(head_dim=64, mask="causal", family="fwd_sm90", config={"schedule": "grid"})
    plan = families.plan_spec(spec, targets.target("sm_90a"))
    call = _call(1, 100, 2, 64, {})
    assert plan.mask_table is None and families.get_family("fwd_sm90").workspace_bytes(plan, call) == 0
    assert len(families.get_family("fwd_sm90").launches(plan, call)) == 1


def test_the_bounds_skip_other_documents():
    """Documents of 256, 1 and 300 tokens, causal within each: a query block sees only its own
    documents' keys, and the keys every row sees are full blocks (no per-element mask)."""
    lowering = get_mask(DOCS)
    lengths = [256, 1, 300, 211]
    doc = torch.tensor([sum(([i] * n for i, n in enumerate(lengths)), [])])
    S, inputs = doc.shape[1], {"doc": doc}
    g = mask_table.GRANULE
    assert lowering.bounds(256, 384, S, S, 64, inputs=inputs, granule=g) == (256, 384, 0, 0)
    # rows 384..511 of the third document (257..556): keys from its start, rounded down to a granule
    kv_begin, kv_end, full_begin, full_end = lowering.bounds(384, 512, S, S, 64, inputs=inputs, granule=g)
    assert (kv_begin, kv_end) == (256, 512) and (full_begin, full_end) == (320, 384)
    assert lowering.bounds(640, 768, S, S, 64, inputs=inputs, granule=g)[0] == 512  # the fourth starts at 557
    assert lowering.bounds(384, 512, S, S, 64, inputs=inputs) == (0, 512, 0, 0)  # exact reads only: no skipping


def test_the_key_block_lists_skip_holes_inside_the_span():
    """A mask visible on every third key block: the bounds span them all (holes loaded and masked),
    the list holds only the visible blocks, last first, flagged full."""
    lowering = get_mask("(kv_idx // 64) % 3 == 0")
    assert lowering.bounds(0, 128, 128, 640, 64) == (0, 640, 0, 64)
    assert lowering.key_blocks(0, 128, 128, 640, 64) == [(9, True), (6, True), (3, True), (0, True)]
    lengths = [256, 1, 300, 211]
    doc = torch.tensor([sum(([i] * n for i, n in enumerate(lengths)), [])])
    S = doc.shape[1]
    listed = get_mask(DOCS).key_blocks(384, 512, S, S, 64, inputs={"doc": doc}, granule=mask_table.GRANULE)
    assert listed == [(7, False), (6, False), (5, True), (4, False)]  # the third document's blocks only
