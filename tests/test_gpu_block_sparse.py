"""Block-sparse attention on a GPU (marker `gpu`), attngen/block_sparse.py: BlockMasks with holes,
full lists, broadcast batch or head axes and ragged lengths against the float64 reference on every
forward family; key blocks a BlockMask hides are never loaded, holes inside a tile's span included
(NaNs there do not reach the output); the per-call key-block lists equal the Python model's; a
BlockMask from FlexAttention's create_block_mask gives FlexAttention's answer; gradients flow."""

from __future__ import annotations

import math

import pytest

import attngen
from attngen import block_sparse, reference, tolerance
from attngen.spec import AttentionSpec

pytestmark = pytest.mark.gpu


def _qkv(B, Sq, Sk, Hq, Hkv, D, seed):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(S, H):
        return torch.randn(B, S, H, D, generator=gen, device="cuda").to(torch.bfloat16)

    return rand(Sq, Hq), rand(Sk, Hkv), rand(Sk, Hkv)


def random_block_mask(B, H, Sq, Sk, q_block, kv_block, seed, full=True):
    """Each query block lists a random half of the key blocks as partial and, with full, one more as
    full; batch and head axes as given (1: broadcast)."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    gen = torch.Generator().manual_seed(seed)
    nq, nk = math.ceil(Sq / q_block), math.ceil(Sk / kv_block)
    order = torch.stack([torch.randperm(nk, generator=gen) for _ in range(B * H * nq)]).reshape(B, H, nq, nk)
    num = torch.full((B, H, nq), max(1, nk // 2), dtype=torch.int32)
    idx = order.int()
    fnum = fidx = None
    if full:
        fnum = torch.randint(0, 2, (B, H, nq), generator=gen, dtype=torch.int32)
        fidx = order[..., -1:].int().contiguous()  # not among the partial ones
    to = {"device": "cuda"}
    return BlockMask.from_kv_blocks(num.to(**to), idx.to(**to), None if fnum is None else fnum.to(**to),
                                    None if fidx is None else fidx.to(**to), BLOCK_SIZE=(q_block, kv_block),
                                    seq_lengths=(Sq, Sk), compute_q_blocks=False)


def run_checked(spec, q, k, v, inputs, clean_v=None):
    import torch

    B, Sq, Hq, _ = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, Hq, Sq), float("nan"), device="cuda")
    attngen.compile(spec)(q, k, v, out=out, lse=lse, inputs=inputs)
    torch.cuda.synchronize()
    v_ref = v if clean_v is None else clean_v
    ref, ref_lse = reference.attention_for_spec(q, k, v_ref, spec, return_lse=True, inputs=inputs)
    scale = spec.effective_scale
    bad = tolerance.check_output(out, ref, q, k, v_ref, "bf16", scale) or tolerance.check_lse(lse, ref_lse, q, k, scale)
    assert bad is None, f"{spec.name} q {tuple(q.shape)} k {tuple(k.shape)}: {bad}"
    return out


CASES = [  # B, Sq, Sk, Hkv, ratio, (Q_BLOCK, KV_BLOCK), (batch axis, head axis) of the BlockMask, element mask
    (2, 300, 517, 2, 2, (128, 128), (2, 4), "causal"),
    (1, 517, 300, 1, 4, (128, 128), (1, 1), None),
    (2, 640, 640, 2, 1, (256, 128), (1, 2), "kv_idx % 5 != 2"),
    (1, 200, 1000, 1, 2, (64, 256), (1, 2), "causal"),
]


@pytest.mark.parametrize("B,Sq,Sk,Hkv,ratio,blocks,axes,element", CASES)
def test_blockmasks_match_the_reference(gpu_family, B, Sq, Sk, Hkv, ratio, blocks, axes, element):
    q, k, v = _qkv(B, Sq, Sk, Hkv * ratio, Hkv, 64, seed=Sq + Sk)
    bm = random_block_mask(*axes, Sq, Sk, *blocks, seed=Sq)
    text, inputs = block_sparse.lowered_call(bm, element or "none", None, q, k)
    run_checked(AttentionSpec(head_dim=64, mask=text, gqa_ratio=ratio, family=gpu_family), q, k, v, inputs)


def test_hidden_blocks_inside_the_span_are_never_loaded(gpu_family):
    """Every query block lists key blocks 0, 2, 4, ... (partial) and 6 (full): blocks 1, 3 and 5 lie
    inside every tile's span, hidden; NaNs there must not reach the output."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    B, S, H, D = 1, 1024, 2, 64
    q, k, v = _qkv(B, S, S, H, H, D, seed=7)
    nq = nk = S // 128
    idx = torch.tensor([0, 2, 4] + [7] * (nk - 3), dtype=torch.int32, device="cuda").expand(1, 1, nq, nk).contiguous()
    num = torch.full((1, 1, nq), 3, dtype=torch.int32, device="cuda")
    fidx = torch.full((1, 1, nq, 1), 6, dtype=torch.int32, device="cuda")
    fnum = torch.ones(1, 1, nq, dtype=torch.int32, device="cuda")
    bm = BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=128, seq_lengths=(S, S), compute_q_blocks=False)
    text, inputs = block_sparse.lowered_call(bm, "kv_idx % 3 != 0", None, q, k)
    clean = v.clone()
    for hidden in (1, 3, 5, 7):
        v[:, hidden * 128:(hidden + 1) * 128] = float("nan")
    out = run_checked(AttentionSpec(head_dim=D, mask=text, family=gpu_family), q, k, v, inputs, clean_v=clean)
    assert torch.isfinite(out).all()


def test_the_key_block_lists_are_the_models(gpu_family):
    """The table kernel's per-call lists (attngen/mask_table.py) for a BlockMask: every query block's
    list equals MaskLowering.key_blocks, entry for entry."""
    import dataclasses

    import torch

    from attngen import mask_table
    from attngen.runtime.dispatch import _outputs_and_call
    from attngen.runtime.tensors import describe

    B, S, Hkv, ratio = 1, 1100, 2, 2
    q, k, v = _qkv(B, S, S, Hkv * ratio, Hkv, 64, seed=3)
    bm = random_block_mask(1, Hkv * ratio, S, S, 128, 128, seed=5)
    text, inputs = block_sparse.lowered_call(bm, "causal", None, q, k)
    kernel = attngen.compile(AttentionSpec(head_dim=64, mask=text, gqa_ratio=ratio, family=gpu_family))
    out, lse, call = _outputs_and_call(kernel.plan, q, describe(q, "q"), describe(k, "k"), describe(v, "v"), None,
                                       None, None, inputs)
    workspace = torch.zeros(kernel.workspace_bytes(call), dtype=torch.uint8, device="cuda")
    call = dataclasses.replace(call, workspace=workspace.data_ptr())
    kernel._module.launch(kernel.family.launches(kernel.plan, call), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    plan = kernel.plan
    table = plan.mask_table
    assert table.by_head and table.list_block_n == plan.block_n
    m_blocks, per = math.ceil(S / plan.block_m), mask_table.list_ints(table, call)
    at = mask_table.list_offset(table, call, plan.block_m)
    rows = mask_table.table_rows(table, call)
    lists = workspace[at:at + rows * m_blocks * per * 4].view(torch.int32).view(rows, m_blocks, per).cpu()
    _, table_at, _ = mask_table.layout(table, call, plan.block_m)
    entries = workspace[table_at:table_at + rows * m_blocks * 16].view(torch.int32).view(rows, m_blocks, 4).cpu()
    host = {name: t.cpu() for name, t in inputs.items()}
    walked = {"list": 0, "span": 0}
    bn, g = plan.block_n, mask_table.GRANULE
    for h in range(rows):
        for m in range(m_blocks):
            m0, m1 = m * plan.block_m, min((m + 1) * plan.block_m, S)
            want = plan.mask.key_blocks(m0, m1, S, S, bn, h=h, inputs=host, granule=g)
            entry = tuple(entries[h, m].tolist())
            if entry[0] >= 0:  # no hole: the kernel walks the bounds, which must then say the same
                assert entry == plan.mask.bounds(m0, m1, S, S, bn, h=h, inputs=host, granule=g), (h, m)
                kv_begin, kv_end, full_begin, full_end = entry
                span = [(n, full_begin <= n * bn < full_end) for n in reversed(range(kv_begin // bn, -(-kv_end // bn)))]
                assert span == want, (h, m)
                walked["span"] += 1
            else:  # {-1, count, 0, 0}: the list
                assert entry[2:] == (0, 0) and entry[0] == -1
                got = [(int(e) >> 1, bool(int(e) & 1)) for e in lists[h, m, :entry[1]]]
                assert got == want, (h, m)
                walked["list"] += 1
    assert walked["list"] > 0 and walked["span"] > 0, walked
    ref, ref_lse = reference.attention(q, k, v, mask=text, inputs=inputs, return_lse=True)
    scale = 64 ** -0.5
    bad = tolerance.check_output(out, ref, q, k, v, "bf16", scale) or tolerance.check_lse(lse, ref_lse, q, k, scale)
    assert bad is None, bad


def test_a_flexattention_blockmask_gives_flexattentions_answer():
    """create_block_mask from a mask_mod (a causal window), the same mask as an expression: attngen's
    output and FlexAttention's are both within the bf16 tolerance of the float64 reference."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, S, Hq, Hkv, D = 2, 1000, 4, 2, 128

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 300)

    bm = create_block_mask(window, B, 1, S, S, device="cuda")
    q, k, v = _qkv(B, S, S, Hq, Hkv, D, seed=13)
    expression = "q_idx >= kv_idx and q_idx - kv_idx < 300"
    with pytest.raises(ValueError, match="mask_mod 'window'"):
        attngen.attention(q, k, v, block_mask=bm)
    out = attngen.attention(q, k, v, block_mask=bm, mask=expression)
    flex = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm,
                          enable_gqa=True).transpose(1, 2)
    ref = reference.attention(q, k, v, mask=expression)
    for name, got in (("attngen", out), ("FlexAttention", flex)):
        bad = tolerance.check_output(got, ref, q, k, v, "bf16", D ** -0.5)
        assert bad is None, f"{name}: {bad}"


def test_gradients_flow_through_a_blockmask():
    import torch

    from attngen import tolerance as tol

    B, S, Hq, Hkv, D = 1, 600, 4, 2, 64
    q, k, v = _qkv(B, S, S, Hq, Hkv, D, seed=17)
    dout = torch.randn_like(q)
    bm = random_block_mask(1, Hq, S, S, 128, 128, seed=9)
    text, inputs = block_sparse.lowered_call(bm, "causal", None, q, k)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = attngen.attention(*leaves, block_mask=bm, mask="causal", return_lse=True)
    grads = torch.autograd.grad([out], leaves, [dout])
    ref = reference.attention_grads(q, k, v, dout, mask=text, inputs=inputs)
    bad = tol.check_grads(grads, ref, q, k, v, out.detach(), dout, "bf16", D ** -0.5, lse=lse.detach())
    assert bad is None, bad


def test_a_blockmask_call_compiles_fullgraph_and_matches_eager_exactly():
    """torch.compile(fullgraph=True) of a call with a BlockMask: the lowering runs once at trace time
    (no graph break), the state grid is built in the graph, the answer is the eager one bit for bit."""
    import torch

    B, S, Hq, Hkv, D = 2, 600, 4, 2, 64
    q, k, v = _qkv(B, S, S, Hq, Hkv, D, seed=19)
    bm = random_block_mask(B, 1, S, S, 128, 128, seed=21)

    def layer(q, k, v, bm):
        return attngen.attention(q, k, v, block_mask=bm, mask="causal").float() * 2

    eager = layer(q, k, v, bm)
    explanation = torch._dynamo.explain(layer)(q, k, v, bm)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, \
        [(r.reason, [str(frame) for frame in r.user_stack[-3:]]) for r in explanation.break_reasons]
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, fullgraph=True)(q, k, v, bm), eager)


def test_a_blockmask_call_replayed_from_a_cuda_graph_reads_the_lists_of_each_replay():
    """A graph captured with one BlockMask's lists, replayed after other lists are copied into the same
    tensors: the state grid is rebuilt from them in the replay (never the eager cache's), so the
    answer is the new lists', bit for bit the eager call's."""
    import torch

    B, S, Hq, Hkv, D = 1, 517, 4, 2, 64
    q, k, v = _qkv(B, S, S, Hq, Hkv, D, seed=23)
    bm = random_block_mask(1, Hq, S, S, 128, 128, seed=1)
    lists = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    attngen.attention(q, k, v, block_mask=bm, mask="causal")  # compile and resolve before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attngen.attention(q, k, v, block_mask=bm, mask="causal")
    for seed in (2, 3):
        fresh = random_block_mask(1, Hq, S, S, 128, 128, seed=seed)
        for name in lists:
            getattr(bm, name).copy_(getattr(fresh, name))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, attngen.attention(q, k, v, block_mask=fresh, mask="causal")), seed
        text, inputs = block_sparse.lowered_call(fresh, "causal", None, q, k)
        ref = reference.attention(q, k, v, mask=text, inputs=inputs)
        assert tolerance.check_output(out, ref, q, k, v, "bf16", D ** -0.5) is None, seed
