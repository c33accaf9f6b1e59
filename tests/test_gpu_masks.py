"""Compiled masks and score modifiers on a GPU (marker `gpu`), for every kernel family that runs here:
every kind of mask and modifier against the float64 reference at odd lengths, Sq != Sk and GQA;
and block skipping observed: keys in blocks a mask hides from a whole CTA are never loaded (NaNs
there do not reach the output)."""

from __future__ import annotations

import dataclasses

import pytest

import attngen
from attngen import mask_table, masks, reference, tolerance
from attngen.spec import AttentionSpec

pytestmark = pytest.mark.gpu

MASKS = masks.EXAMPLES + ("sliding_window(0, 0)", "sliding_window(37, 11)", "chunked(100) and causal",
                          "(q_idx + 2 * kv_idx) % 7 != 3 or h == 1 or b == 1", "not causal",
                          # bands written out (closed forms from attngen/maskc/bands.py)
                          "q_idx >= kv_idx", "0 <= q_idx + kv_len - q_len - kv_idx < 150 and kv_idx >= 20")


def _inputs(B, Sq, Sk, Hkv, ratio, D, seed):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(S, H):
        return torch.randn(B, S, H, D, generator=gen, device="cuda").to(torch.bfloat16)

    return rand(Sq, Hkv * ratio), rand(Sk, Hkv), rand(Sk, Hkv)


MODIFIERS = ("softcap(30.0)", "softcap(2.0)", "score - 0.25 * abs(q_idx + (kv_len - q_len) - kv_idx)",
             "where(h == 1, score * 0.5, score) + 0.01 * (kv_idx % 7)")
SHAPES = [(2, 300, 300, 1, 2), (1, 129, 517, 2, 1), (1, 517, 129, 1, 1)]


@pytest.mark.parametrize("text", MASKS)
@pytest.mark.parametrize("B,Sq,Sk,Hkv,ratio", SHAPES)
def test_masks_match_the_reference(gpu_family, text, B, Sq, Sk, Hkv, ratio):
    check(AttentionSpec(head_dim=128, mask=text, gqa_ratio=ratio, family=gpu_family), B, Sq, Sk, Hkv, ratio)


# Bands take the built-ins' tiles (masks.band_shaped), which differ by head dim: each band at each head dim.
@pytest.mark.parametrize("text", ["q_idx >= kv_idx", "sliding_window(37, 11)",
                                  "kv_idx + kv_len - q_len <= q_idx and q_idx - kv_idx < 200"])
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_bands_match_the_reference_at_every_head_dim(gpu_family, text, head_dim):
    for B, Sq, Sk, Hkv, ratio in SHAPES:
        check(AttentionSpec(head_dim=head_dim, mask=text, gqa_ratio=ratio, family=gpu_family), B, Sq, Sk, Hkv, ratio)


# Each modifier once, under a different mask and head dim (every combination would be a compile each).
@pytest.mark.parametrize("modifier, mask, head_dim", list(zip(MODIFIERS, ("none", "causal", "sliding_window(100, 20)",
                                                                          "causal"), (64, 128, 256, 96))))
def test_score_modifiers_match_the_reference(gpu_family, modifier, mask, head_dim):
    spec = AttentionSpec(head_dim=head_dim, mask=mask, score_mod=modifier, gqa_ratio=2, family=gpu_family)
    for B, Sq, Sk, Hkv, ratio in SHAPES:
        check(spec, B, Sq, Sk, Hkv, 2, logit_scale=3.0)


def test_softcap_scores_keep_fp32_accuracy_from_tiny_to_saturated(gpu_family):
    """One key per row: the LSE is the capped score itself, so any error in the kernel's tanh shows
    at fp32 resolution. Scaled scores from 1e-6 to 1e3 (the fuzzer once found 1e-3 off by 1e-4
    relative: 1 - 2 / (e^(2x) + 1) cancels for small x)."""
    import torch

    spec = AttentionSpec(head_dim=64, mask="causal", score_mod="softcap(20)", family=gpu_family)
    B, H = 1, 64
    q, k, v = _inputs(B, 1, 1, H, 1, 64, seed=5)
    magnitudes = torch.logspace(-6, 3, H, device="cuda")
    q = (q.float() * magnitudes[None, None, :, None]).to(q.dtype)  # head h: scaled scores ~ magnitudes[h]
    run_checked(spec, q, k, v)


def check(spec, B, Sq, Sk, Hkv, ratio, logit_scale=1.0):
    q, k, v = _inputs(B, Sq, Sk, Hkv, ratio, spec.head_dim, seed=Sq + Sk)
    q = (q.float() * logit_scale).to(q.dtype)  # larger logits: softcap bends them
    run_checked(spec, q, k, v)


def run_checked(spec, q, k, v, inputs=None):
    """The compiled kernel into NaN-poisoned outputs, held to the float64 reference; (out, lse)."""
    import torch

    B, Sq, Hq, _ = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, Hq, Sq), float("nan"), device="cuda")
    attngen.compile(spec)(q, k, v, out=out, lse=lse, inputs=inputs)
    torch.cuda.synchronize()
    ref, ref_lse = reference.attention_for_spec(q, k, v, spec, return_lse=True, inputs=inputs)
    scale = spec.effective_scale
    bad = tolerance.check_output(out, ref, q, k, v, "bf16", scale) or tolerance.check_lse(lse, ref_lse, q, k, scale)
    assert bad is None, f"{spec.name} B={B} Sq={Sq} Sk={k.shape[1]}: {bad}"
    return out, lse


def test_blocks_a_mask_hides_are_never_loaded(gpu_family):
    import torch

    spec = AttentionSpec(head_dim=64, mask="sliding_window(64, 0)", family=gpu_family)
    q, k, v = _inputs(1, 2048, 2048, 2, 1, 64, seed=3)
    clean = v.clone()
    v[:, :256] = float("nan")  # hidden from every row >= 512 by at least two whole blocks of any size
    out = attngen.compile(spec)(q, k, v)[0]
    torch.cuda.synchronize()
    assert torch.isfinite(out[:, 1024:]).all(), "a key block outside every row's window was loaded"
    ref = reference.attention_for_spec(q, k, clean, spec)
    bad = tolerance.check_output(out[:, 1024:], ref[:, 1024:], q[:, 1024:], k, clean, "bf16", spec.effective_scale)
    assert bad is None, bad


DOC_MASK = "doc[b, q_idx] == doc[b, kv_idx] and causal"


def test_runtime_inputs_match_the_reference(gpu_family):
    """Packed documents (one of length 1, one empty gap of ids) under causal, with ALiBi slopes per head."""
    import torch

    B, S, Hkv, ratio = 2, 300, 2, 2
    spec = AttentionSpec(head_dim=64, mask=DOC_MASK, score_mod="alibi", gqa_ratio=ratio, family=gpu_family)
    q, k, v = _inputs(B, S, S, Hkv, ratio, 64, seed=11)
    lengths = [[1, 120, 179], [200, 1, 99]]
    doc = torch.tensor([sum(([i * 2] * n for i, n in enumerate(row)), []) for row in lengths], dtype=torch.int32,
                       device="cuda")
    slope = torch.tensor([0.5, 0.25, 0.125, 0.0625], device="cuda")
    inputs = {"doc": doc, "slope": slope}
    run_checked(spec, q, k, v, inputs)
    scale = spec.effective_scale
    # The front door, eagerly and again with other ids at the same layout (the Prepared path): bit
    # for bit the kernel of the unpinned spec (the dispatcher's family, not necessarily gpu_family).
    front = attngen.attention(q, k, v, mask=DOC_MASK, score_mod="alibi", inputs=inputs)
    unpinned, _ = run_checked(dataclasses.replace(spec, family=None), q, k, v, inputs)
    assert torch.equal(front, unpinned)
    other = {"doc": torch.zeros_like(doc), "slope": slope}
    again = attngen.attention(q, k, v, mask=DOC_MASK, score_mod="alibi", inputs=other)
    ref = reference.attention_for_spec(q, k, v, spec, inputs=other)
    assert tolerance.check_output(again, ref, q, k, v, "bf16", scale) is None
    with pytest.raises(ValueError, match="index 1 of input 'doc'"):
        attngen.attention(q, k, v, mask=DOC_MASK, score_mod="alibi", inputs={"doc": doc[:, :200], "slope": slope})


def test_a_document_mask_replayed_from_a_cuda_graph_reads_the_ids_of_each_replay():
    """The ids are read on the device in every launch (no per-call table on the host): a graph captured
    with one set of ids, replayed after new ids are copied into the same tensor, gives the new ids'
    answer, bit for bit the eager call's."""
    import torch

    B, S, Hkv, ratio = 2, 300, 2, 2
    q, k, v = _inputs(B, S, S, Hkv, ratio, 64, seed=12)
    doc = torch.zeros(B, S, dtype=torch.int32, device="cuda")
    attngen.attention(q, k, v, mask=DOC_MASK, inputs={"doc": doc})  # compile and resolve before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attngen.attention(q, k, v, mask=DOC_MASK, inputs={"doc": doc})
    for lengths in ([[1, 120, 179], [200, 1, 99]], [[300], [150, 150]]):
        fresh = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths], dtype=torch.int32,
                             device="cuda")
        doc.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attngen.attention(q, k, v, mask=DOC_MASK, inputs={"doc": fresh.clone()}))
        ref = reference.attention(q, k, v, mask=DOC_MASK, inputs={"doc": fresh})
        assert tolerance.check_output(out, ref, q, k, v, "bf16", 64 ** -0.5) is None, lengths


def test_the_block_table_holds_the_bounds_of_the_model(gpu_family):
    """The two kernels that build a document mask's table per call (attngen/mask_table.py): the
    summaries are the min and max of doc per granule, and every query block's bounds are those of
    the Python model (MaskLowering.bounds with the granule); the attention matches the reference."""
    import torch

    from attngen import mask_table
    from attngen.runtime.dispatch import _outputs_and_call
    from attngen.runtime.tensors import describe

    B, S, Hkv, ratio = 2, 1500, 2, 2
    spec = AttentionSpec(head_dim=64, mask=DOC_MASK, gqa_ratio=ratio, family=gpu_family)
    kernel = attngen.compile(spec)
    q, k, v = _inputs(B, S, S, Hkv, ratio, 64, seed=21)
    gen = torch.Generator().manual_seed(4)
    lengths = [torch.randint(1, 400, (12,), generator=gen).tolist() for _ in range(B)]
    lengths[1][3] = 1  # a document of one token
    doc = torch.tensor([(sum(([i] * n for i, n in enumerate(row)), []) + [len(row)] * S)[:S] for row in lengths],
                       dtype=torch.int32, device="cuda")
    out, lse, call = _outputs_and_call(kernel.plan, q, describe(q, "q"), describe(k, "k"), describe(v, "v"), None,
                                       None, None, {"doc": doc})
    workspace = torch.zeros(kernel.workspace_bytes(call), dtype=torch.uint8, device="cuda")
    call = dataclasses.replace(call, workspace=workspace.data_ptr())
    kernel._module.launch(kernel.family.launches(kernel.plan, call), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()

    plan, g = kernel.plan, mask_table.GRANULE
    offsets, table_at, _ = mask_table.layout(plan.mask_table, call, plan.block_m)
    granules = -(-S // g)
    summaries = workspace[offsets["doc"]:offsets["doc"] + B * granules * 8].view(torch.int32).view(B, granules, 2)
    padded = torch.cat([doc, doc[:, -1:].expand(B, granules * g - S)], dim=1).view(B, granules, g)
    assert torch.equal(summaries[..., 0], padded.amin(-1)) and torch.equal(summaries[..., 1], padded.amax(-1))
    m_blocks = -(-S // plan.block_m)
    table = workspace[table_at:table_at + B * m_blocks * 16].view(torch.int32).view(B, m_blocks, 4).cpu()
    lowering, host_doc = plan.mask, {"doc": doc.cpu()}
    for b in range(B):
        for m in range(m_blocks):
            m0, m1 = m * plan.block_m, min((m + 1) * plan.block_m, S)
            expected = lowering.bounds(m0, m1, S, S, plan.block_n, b=b, inputs=host_doc, granule=g)
            assert tuple(table[b, m].tolist()) == expected, (b, m, table[b, m].tolist(), expected)
    assert int((table[..., 1] - table[..., 0]).sum()) < B * m_blocks * S // 3  # causal alone: S / 2
    ref, ref_lse = reference.attention_for_spec(q, k, v, spec, return_lse=True, inputs={"doc": doc})
    scale = spec.effective_scale
    assert (tolerance.check_output(out, ref, q, k, v, "bf16", scale) or tolerance.check_lse(lse, ref_lse, q, k, scale)) \
        is None


def test_the_dynamic_schedule_ranks_a_tables_query_blocks_by_their_key_blocks(monkeypatch):
    """fwd_sm90's dynamic schedule over a block table (document ids: no query block's work follows its
    position) takes each table row's query blocks the most key blocks first, ties the later block first:
    the order its reset kernel builds per call is that ranking of the table's own counts. Every tile is
    covered once, call after call, with other documents at the same layout, in sections of three (batch,
    head) pairs out of eight (the two left over a section of their own) and of six (the two left over
    joining it: tiles.cuh section_of)."""
    import torch

    from attngen import targets
    from attngen.families.fwd_sm90 import family as sm90
    from attngen.runtime.dispatch import _outputs_and_call
    from attngen.runtime.tensors import describe

    if targets.device_target(torch.cuda.current_device()).cc != 90:
        pytest.skip("fwd_sm90 runs on sm_90a only")
    Hkv, ratio = 2, 2
    Hq = Hkv * ratio
    monkeypatch.setattr(sm90, "launch_section_heads", lambda plan, call, m_blocks, sms: 3 * plan.gqa_ratio)
    per_head = "doc[b, h, q_idx] == doc[b, h, kv_idx] and causal"  # a table row per (batch, head)
    # (mask, GQA, batch, tokens, longest document, held to the reference): the last has more query blocks
    # than one CTA of the reset kernel ranks (ORDER_THREADS); its outputs are checked for NaN only.
    for mask, gqa, B, S, longest, referenced in ((DOC_MASK, 1, 2, 1500, 600, True), (DOC_MASK, ratio, 2, 1500, 600, True),
                                                 (per_head, 1, 2, 700, 300, True), (DOC_MASK, 1, 1, 33_000, 3_000, False)):
        spec = AttentionSpec(head_dim=64, mask=mask, gqa_ratio=gqa, family="fwd_sm90", config={"schedule": "dynamic"})
        kernel = attngen.compile(spec)
        assert kernel.plan.tile_order
        q, k, v = _inputs(B, S, S, Hq // gqa, gqa, 64, seed=31 + gqa)
        rows = B * (Hq if mask == per_head else 1)
        gen = torch.Generator().manual_seed(gqa)
        for _ in range(2):
            lengths = [torch.randint(1, longest, (S // (longest // 2) + 1,), generator=gen).tolist() for _ in range(rows)]
            doc = torch.tensor([(sum(([i] * n for i, n in enumerate(row)), []) + [len(row)] * S)[:S]
                                for row in lengths], dtype=torch.int32, device="cuda")
            doc = doc.view(B, Hq, S) if mask == per_head else doc
            if referenced:
                run_checked(spec, q, k, v, {"doc": doc})
            out, lse, call = _outputs_and_call(kernel.plan, q, describe(q, "q"), describe(k, "k"), describe(v, "v"),
                                               None, None, None, {"doc": doc})
            out.fill_(float("nan"))
            workspace = torch.zeros(kernel.workspace_bytes(call), dtype=torch.uint8, device="cuda")
            call = dataclasses.replace(call, workspace=workspace.data_ptr())
            kernel._module.launch(kernel.family.launches(kernel.plan, call), torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            assert bool(torch.isfinite(out).all()), "a tile was never run"
            plan = kernel.plan
            m_blocks = -(-S // plan.block_m)
            assert mask_table.table_rows(plan.mask_table, call) == rows
            table_at = mask_table.layout(plan.mask_table, call, plan.block_m)[1]
            table = workspace[table_at:table_at + rows * m_blocks * 16].view(torch.int32).view(rows, m_blocks, 4).tolist()
            at = sm90.tile_order_offset(plan, call)
            order = workspace[at:at + rows * m_blocks * 4].view(torch.int32).view(rows, m_blocks).tolist()
            for r in range(rows):
                counts = [(-(-hi // plan.block_n) - lo // plan.block_n if hi > lo else 0) if lo >= 0 else hi
                          for lo, hi, _, _ in table[r]]
                assert order[r] == sorted(range(m_blocks), key=lambda m: (-counts[m], -m)), (r, counts, order[r])
            assert order[0] != list(range(m_blocks - 1, -1, -1))  # documents: not the order by position


def test_sinks_match_the_reference_with_rows_that_see_no_key(gpu_family):
    """Per-head sinks under causal with Sk < Sq: the first rows see no key (output 0, LSE = sink)."""
    import torch

    B, Sq, Sk, Hkv, ratio = 2, 300, 200, 2, 2
    spec = AttentionSpec(head_dim=128, mask="causal", sink="sinks[h]", gqa_ratio=ratio, family=gpu_family)
    q, k, v = _inputs(B, Sq, Sk, Hkv, ratio, 128, seed=12)
    inputs = {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0], device="cuda")}
    out, lse = run_checked(spec, q, k, v, inputs)
    assert torch.equal(out[:, :100], torch.zeros_like(out[:, :100]))
    assert torch.allclose(lse[:, :, :100], inputs["sinks"][None, :, None].expand(B, 4, 100))


@pytest.mark.parametrize("mask", ["kv_idx + kv_offset <= q_idx + q_offset",
                                  "kv_idx + kv_offset <= q_idx + q_offset and q_idx + q_offset - kv_idx - kv_offset < 200"])
def test_context_parallel_offsets_match_the_reference(gpu_family, mask):
    """A shard of queries against global key positions: the offsets are scalar inputs the closed-form bounds read
    (a band, attngen/maskc/bands.py). Shards before, across and after the keys, the same kernel for each (new
    offsets recompile nothing); a shard that sees no key gives 0 and -inf."""
    import torch

    spec = AttentionSpec(head_dim=64, mask=mask, gqa_ratio=2, family=gpu_family)
    q, k, v = _inputs(2, 200, 700, 2, 2, 64, seed=29)
    for q_offset, kv_offset in ((500, 0), (0, 0), (1000, 100), (-300, 0), (350, -50)):
        inputs = {"q_offset": torch.tensor(q_offset, dtype=torch.int32, device="cuda"),
                  "kv_offset": torch.tensor(kv_offset, dtype=torch.int32, device="cuda")}
        out, lse = run_checked(spec, q, k, v, inputs)
        if q_offset + 200 <= kv_offset:  # every row before the first key
            assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


def test_alibi_over_a_shards_global_positions_shares_the_masks_offsets(gpu_family):
    """Context parallelism with ALiBi: the score modifier reads the mask's int32 offsets as int(q_offset), one
    tensor for both; shards before, across and after the keys against the reference, one kernel for all."""
    import torch

    spec = AttentionSpec(head_dim=128, mask="kv_idx + kv_offset <= q_idx + q_offset", gqa_ratio=2, family=gpu_family,
                         score_mod="score - slope[h] * abs(q_idx + int(q_offset) - kv_idx - int(kv_offset))")
    q, k, v = _inputs(2, 200, 700, 2, 2, 128, seed=31)
    slope = torch.tensor([0.5, 0.125, 0.03125, 0.0078125], device="cuda")
    for q_offset, kv_offset in ((500, 0), (0, 0), (1000, 100), (-300, 0), (350, -50)):
        inputs = {"q_offset": torch.tensor(q_offset, dtype=torch.int32, device="cuda"),
                  "kv_offset": torch.tensor(kv_offset, dtype=torch.int32, device="cuda"), "slope": slope}
        run_checked(spec, q, k, v, inputs)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefix_lengths_per_batch_row_match_the_reference(gpu_family, head_dim):
    """prefix_lm(plen[b]): each batch row's prefix length read by the closed-form bounds at its row (a band with an
    `or`: attngen/maskc/bands.py Widest), so no block table. Prefixes of 0, inside a block, across blocks, past the
    keys and negative; Sq == Sk and Sq != Sk (bottom-right causal past the prefix)."""
    import torch

    spec = AttentionSpec(head_dim=head_dim, mask="prefix_lm(plen[b])", gqa_ratio=2, family=gpu_family)
    for (Sq, Sk), lengths in (((300, 300), [0, 77, 1000, 129, -5]), ((129, 517), [400, 0, 3, 517, 200])):
        q, k, v = _inputs(len(lengths), Sq, Sk, 2, 2, head_dim, seed=Sq + 7)
        plen = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        run_checked(spec, q, k, v, {"plen": plen})
    assert mask_table.for_problem(spec.problem) is None
