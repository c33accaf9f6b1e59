"""Runtime inputs (attngen/runtime_inputs.py) without a GPU: the reference reads them, every call is
checked so the kernel can never read outside an input (ranges by interval arithmetic over the
call), the kernel ABI grows a pointer and strides per input, and the kernels compile with them."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attngen
from attngen import families, masks, reference, score_mods, targets
from attngen.errors import SpecError
from attngen.runtime_inputs import check, declared
from attngen.runtime.tensors import TensorInfo
from attngen.spec import AttentionSpec

attngen.register()
DOC_MASK = "doc[b, q_idx] == doc[b, kv_idx] and causal"


def info(name, shape, dtype="int32", device=0):
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorInfo(name, "torch", 0, tuple(shape), strides, dtype, device)


def programs(mask, score_mod=None):
    out = [masks.get_mask(mask).program]
    return out + ([score_mods.get_score_mod(score_mod).program] if score_mod else [])


def test_the_reference_reads_document_ids_and_slopes():
    gen = torch.Generator().manual_seed(1)
    B, S, H, D = 2, 24, 4, 64
    q, k, v = (torch.randn(B, S, H, D, generator=gen, dtype=torch.float64) for _ in range(3))
    doc = torch.tensor([[0] * 10 + [1] * 14, [0] * 3 + [1] * 3 + [2] * 18], dtype=torch.int32)
    slope = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    spec = AttentionSpec(head_dim=64, mask=DOC_MASK, score_mod="alibi")
    out = reference.attention_for_spec(q, k, v, spec, inputs={"doc": doc, "slope": slope})
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 8
    pos = torch.arange(S)
    scores = scores - slope.double()[None, :, None, None] * (pos[:, None] - pos[None, :]).abs()
    visible = (doc[:, :, None] == doc[:, None, :])[:, None] & (pos[None, :] <= pos[:, None])
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~visible, -math.inf).softmax(-1), v)
    assert torch.allclose(out, expected, atol=1e-12)


def test_every_index_must_stay_inside_its_input():
    mask = programs(DOC_MASK)
    wanted = declared([("mask", program) for program in mask])
    ok = {"doc": info("doc", (2, 300))}
    check(mask, wanted, ok, batch=2, heads_q=8, seq_q=300, seq_k=300, device=0)
    cases = [
        ({}, "reads input 'doc'"),
        ({**ok, "bias": info("bias", (8,), "float32")}, r"\['bias'\] are not read"),
        ({"doc": info("doc", (2, 300), "int64")}, "dtype int64; allowed: int32"),
        ({"doc": info("doc", (600,))}, "indexes it with 2 indices"),
        ({"doc": info("doc", (2, 299))}, r"index 1 of input 'doc' takes values in \[0, 299\]"),
        ({"doc": info("doc", (1, 300))}, r"index 0 of input 'doc' takes values in \[0, 1\]"),
        ({"doc": info("doc", (2, 300), device=1)}, "on cuda:1 but q is on cuda:0"),
    ]
    for given, message in cases:
        with pytest.raises(ValueError, match=message):
            check(mask, wanted, given, batch=2, heads_q=8, seq_q=300, seq_k=300, device=0)


def test_an_index_read_from_another_input_is_refused():
    mask = programs("doc[b, pos[q_idx]] == 0")
    wanted = declared([("mask", program) for program in mask])
    with pytest.raises(ValueError, match="depends on another runtime input"):
        check(mask, wanted, {"doc": info("doc", (1, 10)), "pos": info("pos", (10,))}, 1, 1, 10, 10, 0)


def test_bottom_right_positions_are_bounded_by_the_call():
    # q_idx + (kv_len - q_len) reaches kv_len - 1: a per-key table of length Sk is enough, Sk - 1 is not.
    mask = programs("limit[q_idx + (kv_len - q_len)] >= kv_idx")
    wanted = declared([("mask", program) for program in mask])
    check(mask, wanted, {"limit": info("limit", (500,))}, 1, 1, 100, 500, 0)
    with pytest.raises(ValueError, match=r"takes values in \[400, 499\]"):
        check(mask, wanted, {"limit": info("limit", (499,))}, 1, 1, 100, 500, 0)


def test_one_name_cannot_be_read_as_an_int_and_a_float():
    with pytest.raises(SpecError, match=r"read as an int32 tensor .*\(by the mask\) and as a float32 tensor"):
        AttentionSpec(head_dim=64, mask="w[h] > 0", score_mod="score * w[h]")


@pytest.mark.parametrize("family", ["fwd_sm80", "fwd_sm90"])
def test_the_abi_carries_each_input_and_the_kernels_compile(family):
    from attngen.build import nvcc

    spec = AttentionSpec(head_dim=128, mask=DOC_MASK, score_mod="alibi", family=family)
    plan = families.plan_spec(spec, targets.target("sm_90a" if family == "fwd_sm90" else "sm_80"))
    names = [p.name for p in plan.kernels[0].abi.params]
    # fwd_sm90's dynamic schedule: its reset kernel zeroes the tile counter and orders the query blocks.
    dynamic = getattr(plan, "schedule", None) == "dynamic"
    if dynamic:
        assert names.pop() == "tile_order"
    # The inputs, then what the mask's block table reads (attngen/mask_table.py): doc's sizes and summaries.
    assert names[-10:] == ["in_doc", "in_doc_s0", "in_doc_s1", "in_slope", "in_slope_s0", "in_doc_n0", "in_doc_n1",
                           "sum_doc", "mask_table", "mask_rows"]
    reset = [f"{plan.name}_reset"] if dynamic else []
    assert [k.symbol for k in plan.kernels] == [plan.name, f"{plan.name}_mask_summaries", f"{plan.name}_mask_table",
                                                *reset]
    source = families.get_family(family).render(plan)
    assert "p.in_doc[" in source and "p.in_slope[" in source
    if nvcc.find_nvcc() is None:
        pytest.skip("nvcc not found")
    report = nvcc.check_plan(plan)
    if family == "fwd_sm90":  # the Hopper family keeps 0 spills; fwd_sm80 at d128 spills a little (docs/masks.md)
        assert report.spill_bytes == 0, report


def test_the_fake_op_checks_inputs_and_torch_compile_traces_them():
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 100, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 100, 2, 64, dtype=torch.bfloat16, device="cuda")
        doc = torch.empty(2, 100, dtype=torch.int32, device="cuda")
        slope = torch.empty(8, dtype=torch.float32, device="cuda")

        def layer(q, k, v, doc, slope):
            return attngen.attention(q, k, v, mask=DOC_MASK, score_mod="alibi", inputs={"doc": doc, "slope": slope})

        out = torch.compile(layer, backend="eager", fullgraph=True)(q, k, k, doc, slope)
        assert out.shape == q.shape
        with pytest.raises(Exception, match="index 1 of input 'doc'"):
            torch.ops.attngen.forward(q, k, k, AttentionSpec(head_dim=64, gqa_ratio=4, mask=DOC_MASK).key(), None,
                                      ["doc"], [torch.empty(2, 50, dtype=torch.int32, device="cuda")])


def test_fuzz_cases_draw_runtime_inputs_sized_to_the_case_and_check_them():
    from attngen.fuzz.case import FuzzCase, host_runtime_inputs, input_digest, input_shapes
    from attngen.fuzz.check import run_case
    from attngen.fuzz.runners import ReferenceRunner

    spec = AttentionSpec(head_dim=64, gqa_ratio=2, mask=DOC_MASK, score_mod="alibi")
    case = FuzzCase(spec, batch=2, seq_q=17, seq_k=40, heads_kv=2, data_seed=3)
    assert input_shapes(case) == {"doc": (2, 40), "slope": (4,)}
    drawn = host_runtime_inputs(case)
    assert drawn["doc"].dtype == torch.int32 and (drawn["doc"].diff(dim=-1) >= 0).all()  # runs of documents
    assert drawn["slope"].dtype == torch.float32 and 0 <= drawn["slope"].min() and drawn["slope"].max() < 0.5
    assert all(torch.equal(a, b) for a, b in zip(drawn.values(), host_runtime_inputs(case).values()))
    assert input_digest(case) != input_digest(FuzzCase(spec, batch=2, seq_q=17, seq_k=40, heads_kv=2, data_seed=4))
    result = run_case(case, ReferenceRunner())
    assert result.ok, result.describe()


def test_a_score_modifier_shares_the_masks_int_offsets():
    """ALiBi over a context-parallel shard's global positions: the score modifier reads the mask's int32 offsets
    as int(q_offset), one input each (without int() the names clash, and the error says to write it); the shard's
    answer is the whole sequence's last rows; both families render and compile it without spills."""
    from attngen.build import nvcc
    from attngen.families.bwd_shared import modifier_learnable_inputs

    mask = "kv_idx + kv_offset <= q_idx + q_offset"
    alibi = "score - slope[h] * abs(q_idx + int(q_offset) - kv_idx - int(kv_offset))"
    wanted = declared([("mask", p) for p in programs(mask)] + [("score_mod", score_mods.get_score_mod(alibi).program)])
    assert [(d.name, d.arity, d.dtype) for d in wanted] == [("kv_offset", 0, "int32"), ("q_offset", 0, "int32"),
                                                            ("slope", 1, "float32")]
    with pytest.raises(ValueError, match=r"read the mask's int32 kv_offset in the score modifier or sink as int\(kv_offset\)"):
        declared([("mask", p) for p in programs(mask)]
                 + [("score_mod", score_mods.get_score_mod(alibi.replace("int(kv_offset)", "kv_offset")).program)])
    with pytest.raises(ValueError, match=r"read w as int\(w\) in both the score modifier and the sink"):
        AttentionSpec(head_dim=64, score_mod="score + int(w[h])", sink="w[h]")
    assert modifier_learnable_inputs(alibi, None) == ("slope",)  # an int32 read has no gradient
    assert modifier_learnable_inputs("score + int(w[h]) * 0.5", None) == ()
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 64, 2, 64, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 256, 2, 64, generator=gen, dtype=torch.float64) for _ in range(2))
    slope = torch.tensor([0.25, 0.0625], dtype=torch.float64)
    shard = {"q_offset": torch.tensor(192, dtype=torch.int32), "kv_offset": torch.tensor(0, dtype=torch.int32),
             "slope": slope.float()}
    spec = AttentionSpec(head_dim=64, mask=mask, score_mod=alibi)
    got = reference.attention_for_spec(q, k, v, spec, inputs=shard)
    whole = AttentionSpec(head_dim=64, mask="causal", score_mod="alibi")
    q_whole = torch.cat([torch.zeros(1, 192, 2, 64, dtype=torch.float64), q], dim=1)
    expected = reference.attention_for_spec(q_whole, k, v, whole, inputs={"slope": slope.float()})[:, 192:]
    assert torch.allclose(got, expected, atol=1e-6)
    for family, arch in (("fwd_sm80", "sm_80"), ("fwd_sm90", "sm_90a")):
        plan = families.plan_spec(spec.replace(family=family), targets.target(arch))
        assert "const int* in_q_offset" in families.get_family(family).render(plan)
        if nvcc.find_nvcc() is not None:
            assert nvcc.check_plan(plan).spill_bytes == 0


def test_position_offsets_are_scalar_inputs():
    """Context parallelism's shard of queries against global key positions: offsets as 0-d inputs,
    read by the mask's closed-form bounds (a band: attngen/maskc/bands.py), checked for rank, compiled
    into both families."""
    from attngen.build import nvcc

    text = "kv_idx + kv_offset <= q_idx + q_offset"
    mask = programs(text)
    wanted = declared([("mask", program) for program in mask])
    assert [(d.name, d.arity) for d in wanted] == [("kv_offset", 0), ("q_offset", 0)]
    check(mask, wanted, {"kv_offset": info("kv_offset", ()), "q_offset": info("q_offset", ())}, 1, 1, 64, 256, 0)
    with pytest.raises(ValueError, match="indexes it with 0 indices"):
        check(mask, wanted, {"kv_offset": info("kv_offset", (1,)), "q_offset": info("q_offset", ())}, 1, 1, 64, 256, 0)
    # Queries 192..255 of a 256-token sequence against all 256 keys: causal in global positions.
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 64, 2, 64, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 256, 2, 64, generator=gen, dtype=torch.float64) for _ in range(2))
    offsets = {"q_offset": torch.tensor(192, dtype=torch.int32), "kv_offset": torch.tensor(0, dtype=torch.int32)}
    spec = AttentionSpec(head_dim=64, mask=text)
    got = reference.attention_for_spec(q, k, v, spec, inputs=offsets)
    assert torch.allclose(got, reference.attention(q, k, v, mask="causal"), atol=1e-12)  # bottom-right is the same here
    for family, arch in (("fwd_sm80", "sm_80"), ("fwd_sm90", "sm_90a")):
        plan = families.plan_spec(spec.replace(family=family), targets.target(arch))
        assert "p.in_q_offset[0]" in families.get_family(family).render(plan)
        if nvcc.find_nvcc() is not None:
            assert nvcc.check_plan(plan).spill_bytes == 0


@pytest.mark.parametrize("value", [[1, 2], "doc", {1: "x"}])
def test_inputs_must_be_a_dict_of_names(value):
    from attngen.runtime_inputs import as_mapping

    with pytest.raises(ValueError, match=r"inputs=.* is invalid; allowed: None or a dict of input names"):
        as_mapping(value)
    assert as_mapping(None) == {}
