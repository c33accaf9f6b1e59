"""attngen.attention_varlen without a GPU (attngen/varlen.py): the packed problem it hands to
attention() (the document mask and the caller's expressions rewritten into per-sequence positions,
read from arrays built from cu_seqlens) computes, in the float64 reference, exactly what attention
of each sequence on its own computes; bad arguments are named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attngen import api, reference, varlen

MASKS = ["none", "causal", "sliding_window(3, 1)", "chunked(4)", "kv_idx % 2 == 0 or causal", "prefix_lm(2)",
         "q_idx - kv_idx < 5 and causal"]
MODIFIERS = [None, "softcap(5.0)", "alibi", "score * where(q_len > 3, 1.0, 0.5)"]


def packed(lengths_q, lengths_k, Hq=4, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tq, Hq, D, generator=g).to(torch.bfloat16)
    k = torch.randn(tk, Hkv, D, generator=g).to(torch.bfloat16)
    v = torch.randn(tk, Hkv, D, generator=g).to(torch.bfloat16)
    cu = [torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
          for lengths in (lengths_q, lengths_k)]
    inputs = {"slope": torch.linspace(0.1, 0.9, Hq), "sinks": torch.linspace(-1.0, 2.0, Hq)}
    return q, k, v, cu[0], cu[1], inputs


def lowered_reference(q, k, v, cu_q, cu_k, mask, score_mod, sink, inputs):
    """What attention_varlen asks attention() for, computed by the float64 reference."""
    texts = varlen.lowered(mask, score_mod, sink)
    ours = varlen.varlen_inputs(*texts, q, k, cu_q, cu_k)
    wanted = {**{n: t for n, t in inputs.items() if (n == "slope" and score_mod == "alibi") or (n == "sinks" and sink)},
              **ours}
    out, lse = reference.attention(q[None], k[None], v[None], mask=texts[0], score_mod=texts[1], sink=texts[2],
                                   inputs=wanted, return_lse=True)
    return out[0], lse[0]


def per_sequence(q, k, v, cu_q, cu_k, mask, score_mod, sink, inputs):
    return reference.attention_varlen(q, k, v, cu_q, cu_k, mask=mask, score_mod=score_mod, sink=sink, inputs=inputs)


def assert_same(a, b):
    (out_a, lse_a), (out_b, lse_b) = a, b
    assert torch.equal(torch.isinf(lse_a), torch.isinf(lse_b))
    finite = torch.isfinite(lse_b)
    assert torch.allclose(lse_a[finite], lse_b[finite], atol=1e-5, rtol=0)
    assert torch.allclose(out_a.float(), out_b.float(), atol=1e-2, rtol=0)  # both rounded to bf16 once


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("score_mod", MODIFIERS)
def test_the_packed_problem_is_each_sequence_on_its_own(mask, score_mod):
    lengths_q, lengths_k = [5, 0, 1, 9, 3, 12], [7, 4, 1, 9, 0, 10]  # empty sequences on either side
    q, k, v, cu_q, cu_k, inputs = packed(lengths_q, lengths_k, seed=len(mask))
    args = (q, k, v, cu_q, cu_k, mask, score_mod, None, inputs)
    assert_same(lowered_reference(*args), per_sequence(*args))


@pytest.mark.parametrize("mask", ["causal", "sliding_window(2, 0)"])
def test_a_sink_applies_per_row_and_sets_the_lse_of_rows_without_keys(mask):
    q, k, v, cu_q, cu_k, inputs = packed([4, 3, 6], [4, 0, 8], seed=3)
    args = (q, k, v, cu_q, cu_k, mask, "softcap(5.0)", "sinks[h]", inputs)
    got, want = lowered_reference(*args), per_sequence(*args)
    assert_same(got, want)
    assert torch.isfinite(got[1]).all()  # the sequence without keys: LSE = its sink


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=5),
       st.sampled_from(MASKS), st.integers(0, 2**16))
def test_random_packings(lengths, mask, seed):
    lengths_q, lengths_k = [a for a, _ in lengths], [b for _, b in lengths]
    if sum(lengths_q) == 0 or sum(lengths_k) == 0:
        lengths_q[0] += 1
        lengths_k[0] += 1
    q, k, v, cu_q, cu_k, inputs = packed(lengths_q, lengths_k, seed=seed)
    args = (q, k, v, cu_q, cu_k, mask, None, None, inputs)
    assert_same(lowered_reference(*args), per_sequence(*args))


def test_tokens_past_the_last_sequence_see_nothing():
    q, k, v, cu_q, cu_k, inputs = packed([6, 4], [6, 4])
    short_q, short_k = torch.tensor([0, 6, 8], dtype=torch.int32), torch.tensor([0, 6, 8], dtype=torch.int32)
    out, lse = lowered_reference(q, k, v, short_q, short_k, "causal", None, None, inputs)
    assert torch.isinf(lse[:, 8:]).all() and not out[8:].any()
    want = per_sequence(q[:8], k[:8], v[:8], short_q, short_k, "causal", None, None, inputs)
    assert_same((out[:8], lse[:, :8]), want)


@pytest.mark.parametrize("sink", [None, "sinks[h]", "sinks[h] + 0.1 * q_idx - 0.05 * q_len"])
def test_rows_outside_every_sequence_are_a_sequence_without_keys(sink):
    """Rows before cu_seqlens_q[0] and from cu_seqlens_q[-1] on see no key: 0 and -inf, or the sink's
    logit at their position in their run of rows (as the kernels tiling per sequence give them),
    the same through the document mask and one sequence at a time."""
    q, k, v, _, _, inputs = packed([12], [12], seed=5)
    cu_q, cu_k = torch.tensor([3, 6, 9], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    args = (q, k, v, cu_q, cu_k, "causal", None, sink, inputs)
    got, want = lowered_reference(*args), per_sequence(*args)
    assert_same(got, want)
    outside = torch.tensor([0, 1, 2, 9, 10, 11])
    assert not got[0][outside].any()
    assert torch.isinf(got[1][:, outside]).all() == (sink is None)
    if sink is not None:  # rows 0..2 and 9..11 are positions 0..2 of a run of 3 rows
        assert torch.allclose(got[1][:, outside[:3]], got[1][:, outside[3:]])
    arrays = varlen.varlen_inputs(*varlen.lowered("causal", None, "sinks[h] + q_idx"), q, k, cu_q, cu_k)
    assert arrays["varlen_qposf"].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]


def test_the_call_hands_attention_the_packed_problem_and_unpacks_its_result(monkeypatch):
    q, k, v, cu_q, cu_k, inputs = packed([5, 7], [5, 7])
    seen = {}

    def fake_attention(q4, k4, v4, **kw):
        seen.update(kw, shapes=(q4.shape, k4.shape))
        out, lse = reference.attention(q4, k4, v4, mask=kw["mask"], score_mod=kw["score_mod"], sink=kw["sink"],
                                       inputs=kw["inputs"], return_lse=True)
        return (out, lse) if kw["return_lse"] else out

    monkeypatch.setattr(api, "attention", fake_attention)
    out, lse = varlen.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, mask="causal", return_lse=True,
                                       deterministic=True)
    assert out.shape == q.shape and lse.shape == (4, 12) and seen["shapes"] == ((1, 12, 4, 16), (1, 12, 2, 16))
    assert seen["deterministic"] is True and set(seen["inputs"]) == {"varlen_qdoc", "varlen_kdoc", "varlen_qstart",
                                                                     "varlen_kstart", "varlen_qlen", "varlen_klen"}
    assert_same((out, lse), per_sequence(q, k, v, cu_q, cu_k, "causal", None, None, inputs))
    assert varlen.attention_varlen(q, k, v, cu_q, cu_k).shape == q.shape


def call_error(**change):
    q, k, v, cu_q, cu_k, _ = packed([5, 7], [5, 7])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    args.update(change)
    with pytest.raises(ValueError) as info:
        varlen.attention_varlen(**args)
    return str(info.value)


def test_bad_arguments_are_named():
    q = packed([5, 7], [5, 7])[0]
    assert "q must have 3 dims" in call_error(q=q[None])
    assert "cu_seqlens_q has dtype int64" in call_error(cu_seqlens_q=torch.tensor([0, 5, 12]))
    assert "cu_seqlens_q has shape (3,) but cu_seqlens_k has (2,)" in \
        call_error(cu_seqlens_k=torch.tensor([0, 12], dtype=torch.int32))
    assert "must be a torch tensor" in call_error(cu_seqlens_q=[0, 5, 12])
    assert "max_seqlen_q=-1 is invalid" in call_error(max_seqlen_q=-1)
    assert "reads b" in call_error(mask="doc[b, q_idx] == doc[b, kv_idx]")
    assert "reserves the names" in call_error(inputs={"varlen_qdoc": torch.zeros(12, dtype=torch.int32)})
    assert "reads positions as floats" in call_error(score_mod="score + q_idx % 3")


def test_a_modifier_reading_positions_is_refused_past_2_to_the_24_tokens():
    """Modifiers read positions as float32, exact below 2^24: a longer packing is refused before any
    array is built (expanded views: no memory), unless the modifier ignores positions."""
    texts = varlen.lowered("causal", "alibi", None)
    assert "varlen_qposf[q_idx]" in texts[1] and "varlen_kposf[kv_idx]" in texts[1]
    total = varlen.FLOAT_EXACT
    q = torch.zeros(1, 2, 16, dtype=torch.bfloat16).expand(total, 2, 16)
    cu = torch.tensor([0, total], dtype=torch.int32)
    with pytest.raises(ValueError, match=f"allowed: fewer than {total} tokens"):
        varlen.attention_varlen(q, q, q, cu, cu, mask="causal", score_mod="alibi",
                                inputs={"slope": torch.ones(2)})


def test_torch_compile_takes_the_per_sequence_tiles_when_the_gpu_runs_them(monkeypatch):
    """Under torch.compile(fullgraph=True) the choice between per-sequence tiles and the document mask
    is made once at trace time (assume_constant_result): on an sm_90a device (faked here) the graph
    holds one attention op over the varlen spec with cu_seqlens as its inputs, with no graph break.
    (The document mask's path traces to its op too; CPU torch cannot fake the CUDA tensors it slices
    on the way, so tests/test_gpu_varlen_tiles.py runs it compiled, with gradients.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from attngen import targets

    api.register()
    monkeypatch.setattr(targets, "device_target", lambda device: targets.target("sm_90a"))
    varlen._per_sequence_spec.cache_clear()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(q, k, v, cu_q, cu_k):
        return varlen.attention_varlen(q, k, v, cu_q, cu_k, mask="causal") * 2

    def op_keys(gm):
        return [str(n.args[3]) for n in gm.graph.nodes if n.op == "call_function" and "attngen" in str(n.target)]

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            q = torch.empty(40, 8, 128, dtype=torch.bfloat16, device="cuda")
            k = torch.empty(40, 2, 128, dtype=torch.bfloat16, device="cuda")
            cu = torch.empty(4, dtype=torch.int32, device="cuda")
            assert torch.compile(layer, backend=backend, fullgraph=True)(q, k, k, cu, cu).shape == q.shape
            (key,) = op_keys(graphs[-1])
            assert '"varlen":true' in key and '"mask":"causal"' in key
    finally:
        varlen._per_sequence_spec.cache_clear()
        torch._dynamo.reset()


@pytest.mark.parametrize("sink, match", [("sinks[", r"sink='sinks\[' is invalid: .*allowed: an expression over b, h"),
                                         ("kv_idx * 1.0", r"sink='kv_idx \* 1.0' reads \['kv_idx'\]: a sink is one logit")])
def test_a_bad_sink_is_named_as_a_sink(sink, match):
    """attention_varlen checked a sink as a score modifier: its errors said score_mod= and a modifier's rules."""
    import torch

    import attngen

    q = torch.randn(10, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        attngen.attention_varlen(q, q, q, cu, cu, sink=sink)


def test_a_pinned_tiling_family_must_be_one_that_tiles_per_sequence(monkeypatch):
    """attngen.varlen.PER_SEQUENCE_FAMILY names a family with per-sequence tiles, or the call says so (it would
    otherwise fall back to the document mask without a word)."""
    from attngen.spec import AttentionSpec

    monkeypatch.setattr(varlen, "PER_SEQUENCE_FAMILY", "fwd_sm70")
    with pytest.raises(ValueError, match=r"PER_SEQUENCE_FAMILY='fwd_sm70' is invalid; allowed: None or one of "
                                         r"\['fwd_sm90', 'fwd_sm80'\]"):
        varlen._per_sequence_key(AttentionSpec(head_dim=64, mask="causal").key(), 0)


def test_a_modifier_reading_int_inputs_reads_positions_as_ints():
    """A score modifier with int(name) reads (ALiBi over a shard's global positions) takes the mask's int32
    position arrays on the document-mask path, not float32 ones: its integer arithmetic stays exact past 2**24
    (a float32 position there rounds, and the answer moved by up to 1.1 at offsets of 5e7)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(64, 2, 64, generator=gen, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 20, 64], dtype=torch.int32)
    score_mod = "score - slope[h] * abs(q_idx + int(q_offset) - kv_idx - int(kv_offset))"
    mask_text, lowered, _ = varlen.lowered("causal", score_mod, None)
    assert "varlen_qposf" not in lowered and "int(varlen_qstart[q_idx])" in lowered
    assert "varlen_qposf" in varlen.lowered("causal", "alibi", None)[1]  # without int reads: floats, as before
    off = torch.tensor(50_000_001, dtype=torch.int32)
    inputs = {"slope": torch.tensor([0.5, 0.25]), "q_offset": off, "kv_offset": off}
    want, _ = reference.attention_varlen(q, k, v, cu, cu, mask="causal", score_mod=score_mod, inputs=inputs)
    arrays = varlen.varlen_inputs(mask_text, lowered, None, q, k, cu, cu)
    got = reference.attention(q[None].float(), k[None].float(), v[None].float(), mask=mask_text, score_mod=lowered,
                              inputs={**inputs, **arrays}, compute_dtype=torch.float32)[0]
    assert (got.double() - want).abs().max() < 1e-5
