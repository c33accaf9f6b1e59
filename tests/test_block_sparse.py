"""Block-sparse attention from a FlexAttention BlockMask, without a GPU (attngen/block_sparse.py):
the lowered mask shows exactly what FlexAttention's rule shows (a full block whole, a partial block
where the element mask holds, nothing else), checked against a loop over the lists; the block table's
classification of it is sound and exact where kernel tiles lie inside BlockMask blocks; bad
BlockMasks are named."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

import attngen
from attngen import block_sparse, reference
from attngen.masks import get_mask

ELEMENT_MASKS = [None, "causal", "kv_idx % 3 != 1", "q_idx - kv_idx < 7 and causal"]


def flex_visible(bm, element, Sq, Sk, B, H):
    """FlexAttention's rule, by a loop over the lists: (B, H, Sq, Sk) bool."""
    qb, kb = bm.BLOCK_SIZE
    elem = torch.ones(Sq, Sk, dtype=torch.bool) if element is None else \
        get_mask(element).program.dense(torch.arange(Sq)[:, None], torch.arange(Sk)[None, :], Sq, Sk)
    out = torch.zeros(B, H, Sq, Sk, dtype=torch.bool)
    lists = [(bm.kv_num_blocks, bm.kv_indices, False)]
    if bm.full_kv_num_blocks is not None:
        lists.append((bm.full_kv_num_blocks, bm.full_kv_indices, True))
    for num, idx, full in lists:
        for b in range(B):
            for h in range(H):
                bb, hh = min(b, num.shape[0] - 1), min(h, num.shape[1] - 1)
                for r in range(math.ceil(Sq / qb)):
                    for i in range(min(int(num[bb, hh, r]), idx.shape[-1])):
                        c = int(idx[bb, hh, r, i])
                        if not 0 <= c < math.ceil(Sk / kb):
                            continue
                        rows, cols = slice(r * qb, (r + 1) * qb), slice(c * kb, (c + 1) * kb)
                        out[b, h, rows, cols] |= True if full else elem[rows, cols]
    return out


def lowered_visible(bm, element, Sq, Sk, B, H):
    q, k = torch.zeros(B, Sq, H, 8), torch.zeros(B, Sk, H, 8)
    text, inputs = block_sparse.lowered_call(bm, element or "none", None, q, k)
    program = get_mask(text).program
    return program.dense(torch.arange(Sq)[:, None], torch.arange(Sk)[None, :], Sq, Sk,
                         b=torch.arange(B)[:, None, None, None], h=torch.arange(H)[None, :, None, None],
                         inputs=inputs).expand(B, H, Sq, Sk)


@st.composite
def block_masks(draw):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    qb, kb = draw(st.sampled_from([(16, 16), (32, 16), (16, 48), (64, 32)]))
    Sq, Sk = draw(st.integers(1, 150)), draw(st.integers(1, 150))
    nq, nk = math.ceil(Sq / qb), math.ceil(Sk / kb)
    bm_b, bm_h = draw(st.sampled_from([1, B])), draw(st.sampled_from([1, H]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))

    def lists(cap):
        # indices may repeat or fall outside the key blocks; counts may exceed the list
        idx = torch.randint(-1, nk + 2, (bm_b, bm_h, nq, cap), generator=g, dtype=torch.int32)
        num = torch.randint(0, cap + 2, (bm_b, bm_h, nq), generator=g, dtype=torch.int32)
        return num, idx

    num, idx = lists(draw(st.integers(1, nk + 1)))
    full = lists(draw(st.integers(1, nk + 1))) if draw(st.booleans()) else (None, None)
    # compute_q_blocks=False: FlexAttention itself refuses out-of-range indices there; the lowering drops them
    bm = BlockMask.from_kv_blocks(num, idx, *full, BLOCK_SIZE=(qb, kb), seq_lengths=(Sq, Sk), compute_q_blocks=False)
    return bm, Sq, Sk, B, H


@settings(max_examples=80, deadline=None)
@given(block_masks(), st.sampled_from(ELEMENT_MASKS))
def test_the_lowered_mask_is_flexattentions_rule(case, element):
    bm, Sq, Sk, B, H = case
    assert torch.equal(lowered_visible(bm, element, Sq, Sk, B, H), flex_visible(bm, element, Sq, Sk, B, H))


@pytest.mark.parametrize("shape", [(300, 300), (200, 333), (129, 1)])
def test_a_blockmask_from_create_block_mask_with_its_mask_is_that_mask(shape):
    Sq, Sk = shape
    offset = Sk - Sq  # attngen's causal is bottom-right aligned; say the same to FlexAttention

    def causal(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx

    bm = create_block_mask(causal, 1, 1, Sq, Sk, device="cpu", BLOCK_SIZE=128)
    assert bm.full_kv_num_blocks is not None
    dense = get_mask("causal").program.dense(torch.arange(Sq)[:, None], torch.arange(Sk)[None, :], Sq, Sk)
    assert torch.equal(lowered_visible(bm, "causal", Sq, Sk, 1, 1)[0, 0], dense)


@pytest.mark.parametrize("tile", [(64, 64), (128, 128), (128, 64), (192, 128), (64, 176)])
def test_the_block_table_classification_is_sound_and_exact_inside_blockmask_blocks(tile):
    block_m, block_n = tile
    Sq = Sk = 640
    g = torch.Generator().manual_seed(block_m + block_n)
    nq, nk = 5, 5
    num = torch.randint(0, nk + 1, (1, 2, nq), generator=g, dtype=torch.int32)
    idx = torch.stack([torch.randperm(nk, generator=g) for _ in range(2 * nq)]).reshape(1, 2, nq, nk).int()
    fnum = torch.randint(0, 2, (1, 2, nq), generator=g, dtype=torch.int32)
    fidx = torch.randint(0, nk, (1, 2, nq, 1), generator=g, dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=128, seq_lengths=(Sq, Sk),
                                  compute_q_blocks=False)
    q, k = torch.zeros(1, Sq, 2, 8), torch.zeros(1, Sk, 2, 8)
    text, inputs = block_sparse.lowered_call(bm, "causal", None, q, k)
    program = get_mask(text).program
    grid = inputs[block_sparse.STATE]
    causal = get_mask("causal").program.dense(torch.arange(Sq)[:, None], torch.arange(Sk)[None, :], Sq, Sk)
    for h in range(2):
        dense = lowered_visible(bm, "causal", Sq, Sk, 1, 2)[0, h]
        for m0 in range(0, Sq, block_m):
            for n0 in range(0, Sk, block_n):
                m1, n1 = min(m0 + block_m, Sq), min(n0 + block_n, Sk)
                got = program.classify(m0, m1 - 1, n0, n1 - 1, Sq, Sk, 0, h, inputs, granule=16)
                seen = dense[m0:m1, n0:n1]
                if got == "empty":
                    assert not seen.any()
                if got == "full":
                    assert seen.all()
                inside = m0 // 128 == (m1 - 1) // 128 and n0 // 128 == (n1 - 1) // 128
                if inside:  # one BlockMask block: its state decides exactly
                    state = int(grid[0, h, m0 // 128, n0 // 128])
                    if state == 0:
                        assert got == "empty"
                    if state == 2:
                        assert got == "full"
                    if got == "partial":  # what the forward kernels apply there: the element mask alone
                        assert state == 1 and torch.equal(seen, causal[m0:m1, n0:n1])
    element = block_sparse.partial_element(program.canonical, block_m, block_n)
    aligned = 128 % block_m == 0 and 128 % block_n == 0
    assert element == ("kv_idx <= q_idx + (kv_len - q_len)" if aligned else None)


def test_partial_element_takes_only_the_lowering_itself():
    text = get_mask(block_sparse.lowered("q_idx % 2 == 0 or causal", 256, 128, True, False)).text
    assert block_sparse.partial_element(text, 128, 64) == "(q_idx % 2 == 0 or kv_idx <= q_idx + (kv_len - q_len))"
    assert block_sparse.partial_element(text, 128, 256) is None  # key tiles wider than the BlockMask's blocks
    assert block_sparse.partial_element(get_mask(block_sparse.lowered("none", 128, 128, False, False)).text,
                                        64, 64) == "True"
    look_alike = ("block_mask_state[0, 0, q_idx // 128, kv_idx // 128] == 2 or "
                  "block_mask_state[0, 0, q_idx // 128, kv_idx // 64] == 1 and causal")
    assert block_sparse.partial_element(get_mask(look_alike).text, 64, 64) is None
    assert block_sparse.partial_element("causal", 64, 64) is None


def test_eager_calls_reuse_the_grid_until_a_list_changes():
    q = torch.zeros(1, 256, 1, 64)
    bm = _bm()
    first = block_sparse.lowered_call(bm, "none", None, q, q)[1][block_sparse.STATE]
    assert block_sparse.lowered_call(bm, "none", None, q, q)[1][block_sparse.STATE] is first
    bm.kv_indices[0, 0, 1, 0] = 1  # in place: the version counter moves
    again = block_sparse.lowered_call(bm, "none", None, q, q)[1][block_sparse.STATE]
    assert again is not first and again[0, 0, 1].tolist() == [0, 1] and first[0, 0, 1].tolist() == [1, 0]


def test_the_reference_runs_a_blockmask_like_the_dense_mask():
    g = torch.Generator().manual_seed(1)
    B, Sq, Sk, Hq, Hkv, D = 2, 70, 90, 4, 2, 16
    q = torch.randn(B, Sq, Hq, D, generator=g)
    k, v = torch.randn(B, Sk, Hkv, D, generator=g), torch.randn(B, Sk, Hkv, D, generator=g)
    num = torch.randint(0, 4, (B, 1, 3), generator=g, dtype=torch.int32)
    idx = torch.randint(0, 3, (B, 1, 3, 3), generator=g, dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(32, 32), seq_lengths=(Sq, Sk))
    text, inputs = block_sparse.lowered_call(bm, "kv_idx % 2 == 0", None, q, k)
    out, lse = reference.attention(q, k, v, mask=text, inputs=inputs, return_lse=True)
    dense = flex_visible(bm, "kv_idx % 2 == 0", Sq, Sk, B, Hq)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, dim=2)) / D**0.5
    scores = scores.masked_fill(~dense, float("-inf"))
    want_lse = torch.logsumexp(scores, -1)
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    want = torch.einsum("bhqk,bkhd->bqhd", p, v.double().repeat_interleave(2, dim=2))
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert torch.allclose(lse[torch.isfinite(lse)].double(), want_lse[torch.isfinite(want_lse)], atol=1e-5)
    assert torch.allclose(out.double(), want, atol=1e-5)


def _bm(**overrides):
    num = torch.ones(1, 1, 2, dtype=torch.int32)
    idx = torch.zeros(1, 1, 2, 2, dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128, seq_lengths=(256, 256))
    for name, value in overrides.items():
        object.__setattr__(bm, name, value)
    return bm


@pytest.mark.parametrize("bm, mask, needle", [
    (object(), None, "without kv_num_blocks"),
    (_bm(mask_mod=lambda b, h, q, k: q >= k), None, "mask_mod '<lambda>'"),
    (_bm(kv_num_blocks=torch.ones(1, 1, 2)), "none", "block_mask.kv_num_blocks has dtype float32"),
    (_bm(kv_indices=torch.zeros(1, 2, 2, dtype=torch.int32)), "none", "kv_indices has dtype int32 and shape (1, 2, 2)"),
    (_bm(kv_num_blocks=torch.ones(3, 1, 2, dtype=torch.int32),
         kv_indices=torch.zeros(3, 1, 2, 2, dtype=torch.int32)), "none", "(1 or 2, 1 or 4, query blocks)"),
    (_bm(kv_num_blocks=torch.ones(1, 1, 1, dtype=torch.int32),
         kv_indices=torch.zeros(1, 1, 1, 2, dtype=torch.int32)), "none", "at least ceil(seq_q / 128) = 2"),
    (_bm(seq_lengths=(128, 256)), "none", "seq_lengths=(128, 256) is shorter"),
    (_bm(BLOCK_SIZE=(0, 128)), "none", "BLOCK_SIZE=(0, 128) is invalid"),
    (_bm(BLOCK_SIZE=1.5), "none", "BLOCK_SIZE=1.5 is invalid"),
    (_bm(full_kv_num_blocks=torch.ones(1, 1, 2, dtype=torch.int32)), "none", "one of full_kv_num_blocks"),
    (_bm(full_kv_num_blocks=torch.ones(1, 1, 3, dtype=torch.int32),
         full_kv_indices=torch.zeros(1, 1, 3, 1, dtype=torch.int32)), "none", "the shape of kv_num_blocks"),
    (_bm(), 5, "mask=5 is invalid"),
    (_bm(), "block_mask_state[0] > 0", "reserves the name 'block_mask_state'"),
])
def test_bad_blockmasks_are_named(bm, mask, needle):
    q = torch.zeros(2, 256, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 256, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as info:
        attngen.attention(q, k, k, block_mask=bm, mask=mask)
    assert needle in str(info.value)


def test_tensors_of_another_rank_are_named():
    with pytest.raises(ValueError, match=r"q has shape \(256, 4, 64\); allowed with block_mask: 4 dims"):
        block_sparse.lowered_call(_bm(), "none", None, torch.zeros(256, 4, 64), torch.zeros(1, 256, 2, 64))
    with pytest.raises(ValueError, match="block_mask needs torch tensors; k is a NoneType"):
        block_sparse.lowered_call(_bm(), "none", None, torch.zeros(1, 256, 4, 64), None)


def test_empty_sequences_give_empty_grids():
    for seq_q, seq_k, shape in ((0, 256, (1, 1, 0, 2)), (256, 0, (1, 1, 2, 0))):
        _, inputs = block_sparse.lowered_call(_bm(), "none", None, torch.zeros(1, seq_q, 1, 64),
                                              torch.zeros(1, seq_k, 1, 64))
        assert tuple(inputs[block_sparse.STATE].shape) == shape


def test_the_state_input_name_is_reserved_in_inputs():
    q = torch.zeros(1, 256, 1, 64)
    with pytest.raises(ValueError, match="inputs has 'block_mask_state'"):
        block_sparse.lowered_call(_bm(), "none", {"block_mask_state": torch.zeros(1)}, q, q)
    # ...and in the score modifier and sink, which could read the int32 grid as int(block_mask_state[...]).
    for score_mod, sink in (("score + int(block_mask_state[0, 0, 0, 0])", None), (None, "int(block_mask_state) * 1.0")):
        with pytest.raises(ValueError, match="reads the input 'block_mask_state'; block_mask reserves"):
            block_sparse.lowered_call(_bm(), "none", None, q, q, score_mod, sink)


def test_blockmask_lists_on_another_device_are_named():
    q = torch.zeros(1, 256, 1, 64, device="meta")
    with pytest.raises(ValueError, match="block_mask.kv_num_blocks is on cpu, q on meta"):
        block_sparse.lowered_call(_bm(), "none", None, q, q)


@pytest.mark.parametrize("family, arch", [("fwd_sm80", "sm_80"), ("fwd_sm90", "sm_90a")])
def test_forward_kernels_apply_the_element_mask_alone_on_partial_blocks_and_compile(family, arch):
    from attngen import families, targets
    from attngen.build import nvcc
    from attngen.spec import AttentionSpec

    text = block_sparse.lowered("causal", 128, 128, False, True)
    plan = families.plan_spec(AttentionSpec(head_dim=128, mask=text, family=family), targets.target(arch))
    assert plan.mask_table.list_block_n == plan.block_n and 128 % plan.block_m == 0 and 128 % plan.block_n == 0
    assert plan.partial_visible == get_mask("causal").visible
    source = families.get_family(family).render(plan)
    shown = source[source.index("bool shown("):source.index("bool shown(") + 900]
    assert "block_mask_state" not in shown.split("return visible(")[0]
    if nvcc.find_nvcc() is None:
        pytest.skip("nvcc not found")
    report = nvcc.check_plan(plan)
    assert report.spill_bytes == 0, report


def test_the_lowering_is_a_constant_under_a_fullgraph_trace():
    """torch.compile cannot trace the expression parser (it changes warnings filters): attention()
    with a BlockMask lowers it through a function that runs once at trace time."""
    attngen.api.register()
    text = get_mask(block_sparse.lowered("causal", 128, 64, True, False)).text

    def traced(x):  # and what attention() does with it: its key's JSON (dynamo failed on `type(text)`)
        return x + len(attngen.api._known_texts("mask", block_sparse.lowered("causal", 128, 64, True, False))[0])

    torch._dynamo.reset()
    assert torch.compile(traced, backend="eager", fullgraph=True)(torch.zeros(1)).item() == len(text)


def test_a_blockmask_with_a_pinned_spec_is_refused_by_name():
    q = torch.zeros(1, 256, 1, 64)
    with pytest.raises(ValueError, match="block_mask with a spec is not supported; allowed: spec=None"):
        attngen.attention(q, q, q, attngen.AttentionSpec(head_dim=64, mask="causal"), block_mask=_bm())
