"""Decoding over a KV cache on a GPU (marker `gpu`): attngen.decode against the float64 reference
(attngen/reference.py decode_attention) for paged caches with shuffled and shared pages and for
contiguous ones, every kind of mask and modifier, lengths 0, 1, odd and full, 1 to 16 new tokens,
forced and chosen split counts; bad lengths and page ids give NaN for their sequence only; a decode
step captured in a CUDA graph replays correctly after the cache grows; the op traces with
torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest

import attngen
from attngen import reference, tolerance
from attngen.spec import AttentionSpec

pytestmark = pytest.mark.gpu


def make_cache(B, capacity, Hkv, D, page_size, seed, *, paged=True, share_prefix=False):
    """(k_cache, v_cache, page_table or None), caches filled with N(0, 1); a paged cache has a spare
    page of NaN (a read of a page no sequence lists would show) and its pages in shuffled order;
    with share_prefix, every sequence's first page is sequence 0's."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    if not paged:
        k, v = (torch.randn(B, capacity, Hkv, D, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
        return k, v, None
    per = -(-capacity // page_size)
    pages = B * per + 1
    k, v = (torch.randn(pages, page_size, Hkv, D, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
    order = torch.randperm(pages, generator=gen)
    table = order[:B * per].reshape(B, per).to(torch.int32)
    k[order[-1]] = float("nan")
    v[order[-1]] = float("nan")
    if share_prefix:
        table[:, 0] = table[0, 0]
    return k, v, table.cuda()


def check_decode(spec, q, k, v, lens, table, *, num_splits=None, inputs=None, logit_scale=1.0):
    import torch

    out, lse = attngen.decode(q, k, v, lens, page_table=table, spec=spec, num_splits=num_splits, inputs=inputs,
                              return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = reference.decode_attention(q, k, v, lens.cpu(), spec, page_table=None if table is None
                                              else table.cpu(), inputs=inputs)
    scale = spec.effective_scale
    for b in range(q.shape[0]):
        kb = reference.gather_cache(k, table, b, int(lens[b]))
        vb = reference.gather_cache(v, table, b, int(lens[b]))
        bad = tolerance.check_output(out[b:b + 1], ref[b:b + 1], q[b:b + 1], kb, vb, "bf16", scale) \
            or tolerance.check_lse(lse[b:b + 1], ref_lse[b:b + 1], q[b:b + 1], kb, scale)
        assert bad is None, f"{spec.name} sequence {b} of lengths {lens.tolist()}, splits {num_splits}: {bad}"
    return out, lse


def _q(B, Sq, Hq, D, seed, scale=1.0):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(B, Sq, Hq, D, generator=gen) * scale).to(torch.bfloat16).cuda()


LENGTHS = [0, 1, 63, 64, 65, 1000, 2049, 4096]


def _loads_spec(loads, **fields):
    """A decode spec pinned to decode_sm80 loading K/V by `loads` (skipped where this GPU has no TMA)."""
    import torch

    if loads == "tma" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA loads need sm_90")
    return AttentionSpec(**fields, family="decode_sm80", config={"loads": loads})


LOADS = ["cp_async", "tma"]


@pytest.mark.parametrize("paged, page_size", [(True, 16), (True, 64), (True, 100), (True, 256), (True, 8), (True, 2),
                                              (False, None)])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 16])
@pytest.mark.parametrize("loads", LOADS)
def test_lengths_pages_and_splits_match_the_reference(paged, page_size, num_splits, loads):
    """Page 100 shares 4 rows with a 64-key block: a TMA plan takes cp.async there; page 8: 8 boxes a block;
    page 2: 33 pages a block, more than cp.async's lanes hold (flash_decode.cuh block_pages), so ids per row."""
    import torch

    spec = _loads_spec(loads, head_dim=128, gqa_ratio=4)
    B, Hkv, capacity = len(LENGTHS), 2, 4096
    k, v, table = make_cache(B, capacity, Hkv, 128, page_size or 0, seed=1, paged=paged, share_prefix=True)
    lens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    check_decode(spec, _q(B, 1, 4 * Hkv, 128, 2), k, v, lens, table, num_splits=num_splits)


@pytest.mark.parametrize("page_size", [64, 128, 16])
@pytest.mark.parametrize("loads", LOADS)
def test_a_strided_paged_cache_matches_the_reference(page_size, loads):
    """Pages that are views into a larger buffer (3 spare rows a page, a spare head, 8 spare columns): the
    page stride is not page_size rows. Pages of 64 and 128 hold whole 64-key blocks (the plan for pages
    of whole blocks, flash_decode.cuh WHOLE_PAGES); pages of 16 take the per-row plan."""
    import torch

    spec = _loads_spec(loads, head_dim=128, gqa_ratio=4)
    B, Hkv, capacity = 3, 2, 1024
    k_full, v_full, table = make_cache(B, capacity, Hkv + 1, 136, page_size, seed=13, paged=True)
    k_pad = torch.full((k_full.shape[0], page_size + 3, Hkv + 1, 136), float("nan"), dtype=k_full.dtype, device="cuda")
    v_pad = torch.full_like(k_pad, float("nan"))
    k_pad[:, :page_size], v_pad[:, :page_size] = k_full, v_full
    k, v = k_pad[:, :page_size, 1:, :128], v_pad[:, :page_size, :Hkv, 8:]
    assert k.stride(0) != page_size * k.stride(1)
    lens = torch.tensor([1000, 65, 1024], dtype=torch.int32, device="cuda")
    for num_splits in (None, 1, 5):
        check_decode(spec, _q(B, 1, 4 * Hkv, 128, 14), k, v, lens, table, num_splits=num_splits)


@pytest.mark.parametrize("page_size", [64, 128, 256])
def test_long_sequences_over_pages_of_whole_blocks_match_the_reference(page_size):
    """Pages of whole 64-key blocks hold their ids 32 pages at a time per lane (flash_decode.cuh
    WHOLE_PAGES): sequences of 80 to 160 pages, so under 1 and 2 splits the windows move (from a split
    starting mid-page, mid-window), and more splits start windows anywhere; pages of 128 and 256 take two
    and four blocks each."""
    import torch

    spec = AttentionSpec(head_dim=128, gqa_ratio=4)
    B, Hkv = 3, 2
    capacity = 160 * page_size
    k, v, table = make_cache(B, capacity, Hkv, 128, page_size, seed=17)
    lens = torch.tensor([capacity, 80 * page_size + 37, 97 * page_size - 1], dtype=torch.int32, device="cuda")
    for num_splits in (None, 1, 2, 7):
        check_decode(spec, _q(B, 1, 4 * Hkv, 128, 18), k, v, lens, table, num_splits=num_splits)


CASES = [
    # (mask, score_mod, sink, head_dim, gqa_ratio, new tokens)
    ("causal", None, None, 64, 8, 1),
    ("causal", None, None, 128, 4, 5),
    ("causal", None, None, 256, 1, 16),
    ("sliding_window(100, 0)", "softcap(30.0)", None, 128, 4, 3),
    ("chunked(128) and causal", None, None, 96, 2, 7),
    ("q_idx + (kv_len - q_len) >= kv_idx and kv_idx % 5 != 1", None, None, 64, 4, 4),
    ("causal", "score - slope[h] * abs(q_idx + (kv_len - q_len) - kv_idx)", None, 128, 4, 2),
    ("causal", None, "sinks[h]", 128, 8, 1),
    ("none", None, None, 128, 16, 16),
    ("kv_idx > q_idx + kv_len - q_len - 200 and kv_idx <= q_idx + (kv_len - q_len)", None, None, 128, 4, 3),  # a band
    ("prefix_lm(plen[b])", None, None, 128, 4, 3),  # a prefix per sequence: bounds read at the batch row
]


@pytest.mark.parametrize("mask, score_mod, sink, head_dim, ratio, new", CASES)
def test_masks_modifiers_and_sinks_match_the_reference(mask, score_mod, sink, head_dim, ratio, new):
    import torch

    spec = AttentionSpec(head_dim=head_dim, gqa_ratio=ratio, mask=mask, score_mod=score_mod, sink=sink)
    B, Hkv = 4, 2
    lens = torch.tensor([new, 777, 0, 1500], dtype=torch.int32, device="cuda")
    inputs = {}
    if score_mod and "slope" in score_mod:
        inputs["slope"] = torch.rand(ratio * Hkv, device="cuda") * 0.1
    if sink:
        inputs["sinks"] = torch.randn(ratio * Hkv, device="cuda")
    if "plen" in mask:
        inputs["plen"] = torch.tensor([1, 700, 5, 1600], dtype=torch.int32, device="cuda")
    for page_size in (32, 128, None):  # pages of 128: whole key blocks (their own plan)
        k, v, table = make_cache(B, 1536, Hkv, head_dim, page_size or 0, seed=3, paged=page_size is not None)
        q = _q(B, new, ratio * Hkv, head_dim, 4, scale=3.0 if score_mod else 1.0)
        for num_splits in (None, 1, 5):
            check_decode(spec, q, k, v, lens, table, num_splits=num_splits, inputs=inputs or None)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("loads", LOADS)
def test_nan_past_each_length_never_reaches_the_output(head_dim, loads):
    """Every cached slot past a sequence's length holds NaN (TMA boxes bring whole pages and blocks,
    so those V rows must be zeroed before P.V; cp.async never reads them), pages and contiguous,
    lengths around block and page edges, chosen and forced splits."""
    import torch

    B, Hkv, capacity, page = 5, 2, 640, 32
    lens = torch.tensor([1, 31, 65, 333, 640], dtype=torch.int32, device="cuda")
    spec = _loads_spec(loads, head_dim=head_dim, gqa_ratio=4, mask="causal")
    for paged in (True, False):
        k, v, table = make_cache(B, capacity, Hkv, head_dim, page, seed=11, paged=paged)
        for b in range(B):
            n = int(lens[b])
            if paged:
                for j in range(n // page, capacity // page):
                    first = n - j * page if j == n // page else 0
                    k[table[b, j], first:] = float("nan")
                    v[table[b, j], first:] = float("nan")
            else:
                k[b, n:] = float("nan")
                v[b, n:] = float("nan")
        q = _q(B, 2, 4 * Hkv, head_dim, 12)
        for num_splits in (None, 1, 4):
            out, _ = check_decode(spec, q, k, v, lens, table, num_splits=num_splits)
            assert not out.isnan().any()


def test_decode_equals_the_forward_on_the_same_cache():
    """One sequence's decode is the forward kernel's answer on the contiguous cache (bottom-right causal)."""
    import torch

    k, v, table = make_cache(2, 1000, 2, 128, 64, seed=5)
    lens = torch.tensor([1000, 321], dtype=torch.int32, device="cuda")
    q = _q(2, 3, 8, 128, 6)
    out = attngen.decode(q, k, v, lens, page_table=table, mask="causal", num_splits=4)
    for b in range(2):
        kb, vb = (reference.gather_cache(t, table, b, int(lens[b])) for t in (k, v))
        fwd = attngen.attention(q[b:b + 1], kb.contiguous(), vb.contiguous(), mask="causal")
        assert (out[b:b + 1].float() - fwd.float()).abs().max().item() <= 2 * 2**-8 * (fwd.float().abs().max().item() + 4)


# Pages of 64 (whole key blocks: their own plan), of 16 (the per-row plan), a contiguous cache (lengths only).
@pytest.mark.parametrize("page", [64, 16, None])
@pytest.mark.parametrize("loads", LOADS)
def test_bad_lengths_and_page_ids_poison_only_their_sequence(loads, page):
    import torch

    spec = _loads_spec(loads, head_dim=64, gqa_ratio=2)
    k, v, table = make_cache(4, 256, 1, 64, page or 0, seed=7, paged=page is not None)
    if page is not None:
        table[2, 1] = k.shape[0] + 5  # a page id past the cache, within sequence 2's length
        table[3, 100 // page + 1] = -1  # past sequence 3's length (100): never read
    lens = torch.tensor([300, -1, 200 if page else -7, 100], dtype=torch.int32, device="cuda")  # capacity 256
    q = _q(4, 1, 2, 64, 8)
    for num_splits in (1, 3):
        out, lse = attngen.decode(q, k, v, lens, page_table=table, spec=spec, num_splits=num_splits, return_lse=True)
        torch.cuda.synchronize()
        assert out[:3].isnan().all() and lse[:3].isnan().all(), num_splits
        assert out[3].isfinite().all() and lse[3].isfinite().all()
        if table is None:
            ref = reference.decode_attention(q[3:], k[3:], v[3:], lens[3:].cpu(), spec)[0]
        else:
            ref = reference.decode_attention(q[3:], k, v, lens[3:].cpu(), spec, page_table=table[3:].cpu())[0]
        kb, vb = (reference.gather_cache(t, table, 3, 100) for t in (k, v))
        assert tolerance.check_output(out[3:], ref, q[3:], kb, vb, "bf16", spec.effective_scale) is None


# One CTA that lets the next kernel in the stream start at once (griddepcontrol.launch_dependents), spins
# `delay` clock cycles, then copies three int32 buffers and last sets a flag in pinned host memory: a kernel
# before an early-launched decode writing the decode's inputs after the split kernel's CTAs may have started
# (and read their hints).
LATE_WRITER = r"""
extern "C" __global__ void late_write(int* d0, const int* s0, int n0, int* d1, const int* s1, int n1,
                                      int* d2, const int* s2, int n2, long long delay, volatile int* done,
                                      volatile const int* go) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    // Wait for the host's word that the decode is enqueued (a busy host can take longer than any fixed
    // delay), with a limit so a lost word cannot hang the GPU; then give the split kernel time to start.
    const long long t0 = clock64();
    while (*go == 0 && clock64() - t0 < 100 * delay) {}
    const long long t1 = clock64();
    while (clock64() - t1 < delay) {}
    for (int i = threadIdx.x; i < n0; i += blockDim.x) d0[i] = s0[i];
    for (int i = threadIdx.x; i < n1; i += blockDim.x) d1[i] = s1[i];
    for (int i = threadIdx.x; i < n2; i += blockDim.x) d2[i] = s2[i];
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        *done = 1;
    }
}
"""


@pytest.mark.parametrize("page", [64, 16, 256, 100])
@pytest.mark.parametrize("lengths", ["move", "grow", "stay"])
@pytest.mark.parametrize("loads", LOADS)
def test_a_split_kernel_started_early_sees_what_the_kernel_before_it_writes_late(loads, lengths, page):
    """On sm_90 the split kernel is a programmatic dependent launch: it may start while the kernel before it
    runs, and a paged TMA plan reads the length and page ids there as hints (L2 prefetches, guessed id
    places). A kernel that lets it start at once and only then writes new lengths, a new page table and one
    page's keys must have all of them seen: lengths whose split spans differ from the hinted ones ("move"),
    longer ones with the same spans ("grow": the ids past the old length come from the guess's reads), the
    same lengths ("stay"); boxes of a whole block (pages of 64, 256) or a quarter (16), and pages of 100,
    whose boxes would be too small, so a TMA plan takes cp.async for the call."""
    cupy = pytest.importorskip("cupy")
    pytest.importorskip("cuda.bindings")  # without it the launch is an ordinary one (attngen/runtime/launch.py)
    import numpy as np
    import torch

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launches need sm_90")
    spec = _loads_spec(loads, head_dim=128, gqa_ratio=4)
    B, Hkv = 2, 8
    k, v, table = make_cache(B, 4096, Hkv, 128, page, seed=21)
    gen = torch.Generator(device="cpu").manual_seed(22)
    old = [1000, 3000]
    new = {"move": [4096, 2049], "grow": [1020, 3007], "stay": old}[lengths]  # grow: 16 and 47 blocks of 64 still
    old_lens, new_lens = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (old, new))
    # The new table: the same pages (no sequence lists the NaN spare) in another order.
    new_table = table.flatten()[torch.randperm(table.numel(), generator=gen).cuda()].reshape(table.shape).contiguous()
    new_page = torch.randn(page, Hkv, 128, generator=gen).to(torch.bfloat16).cuda()
    target = int(new_table[0, 0])  # sequence 0's first page gets new keys
    q = _q(B, 1, 4 * Hkv, 128, 23)
    late = cupy.RawKernel(LATE_WRITER, "late_write")
    done = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # mapped: the device writes it through UVA
    go = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # mapped: the host tells the writer to go on
    stream = torch.cuda.Stream()  # not the legacy default stream
    # 8 splits: sequence 0's last split is its blocks 14-15, both in the ring's first loads, so under "grow"
    # the ids of keys 1000-1019 come from the guess's reads.
    for num_splits in (None, 1, 8):
        lens, tab, kk = old_lens.clone(), table.clone(), k.clone()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            attngen.decode(q, kk, v, lens, page_table=tab, spec=spec, num_splits=num_splits)  # compiled and loaded
            stream.synchronize()
            done.zero_()
            go.zero_()
            dst_page = kk[target].view(torch.int32)
            args = (cupy.asarray(lens), cupy.asarray(new_lens), np.int32(B), cupy.asarray(tab),
                    cupy.asarray(new_table), np.int32(tab.numel()), cupy.asarray(dst_page),
                    cupy.asarray(new_page.view(torch.int32)), np.int32(dst_page.numel()), np.int64(20_000_000),
                    np.uint64(done.data_ptr()), np.uint64(go.data_ptr()))
            with cupy.cuda.ExternalStream(stream.cuda_stream):
                late((1,), (256,), args)
            out, lse = attngen.decode(q, kk, v, lens, page_table=tab, spec=spec, num_splits=num_splits,
                                      return_lse=True)
            enqueued_while_writing = int(done[0]) == 0
            go.fill_(1)
            stream.synchronize()
        assert enqueued_while_writing, "the writer waited ~1 s for the decode's launch and went on: nothing tested"
        assert int(done[0]) == 1
        assert torch.equal(lens, new_lens) and torch.equal(tab, new_table) and torch.equal(kk[target], new_page)
        ref, ref_lse = reference.decode_attention(q, kk, v, new_lens.cpu(), spec, page_table=new_table.cpu())
        for b in range(B):
            kb, vb = (reference.gather_cache(t, new_table, b, int(new_lens[b])) for t in (kk, v))
            bad = tolerance.check_output(out[b:b + 1], ref[b:b + 1], q[b:b + 1], kb, vb, "bf16", spec.effective_scale) \
                or tolerance.check_lse(lse[b:b + 1], ref_lse[b:b + 1], q[b:b + 1], kb, spec.effective_scale)
            assert bad is None, f"{spec.name}, pages of {page}, splits {num_splits}, sequence {b}: {bad}"


@pytest.mark.parametrize("mask", ["causal", "sliding_window(100, 0)"])
def test_drafts_of_different_lengths_padded_at_the_front_give_each_real_token_its_answer(mask):
    """docs/decode.md: sequences with fewer new tokens than seq_q, padded at the front; each one's last
    n rows (its real tokens) match the reference of those n tokens alone (q_len = n)."""
    import torch

    spec = AttentionSpec(head_dim=128, gqa_ratio=4, mask=mask)
    B, Hkv, Sq = 3, 2, 6
    k, v, table = make_cache(B, 700, Hkv, 128, 64, seed=31)
    lens = torch.tensor([650, 7, 300], dtype=torch.int32, device="cuda")
    real = [6, 1, 3]  # new tokens per sequence, all appended to the cache already (they are in lens)
    q = _q(B, Sq, 4 * Hkv, 128, 32)
    out = attngen.decode(q, k, v, lens, page_table=table, spec=spec)
    for b, n in enumerate(real):
        qb = q[b:b + 1, Sq - n:]
        ref = reference.decode_attention(qb, k, v, lens[b:b + 1].cpu(), spec, page_table=table[b:b + 1].cpu())[0]
        kb, vb = (reference.gather_cache(t, table, b, int(lens[b])) for t in (k, v))
        bad = tolerance.check_output(out[b:b + 1, Sq - n:], ref, qb, kb, vb, "bf16", spec.effective_scale)
        assert bad is None, f"{mask}, sequence {b} ({n} real tokens): {bad}"


def test_a_decode_step_replays_from_a_cuda_graph():
    import torch

    spec = AttentionSpec(head_dim=128, gqa_ratio=4, mask="causal")
    B, Hkv = 3, 2
    k, v, table = make_cache(B, 512, Hkv, 128, 64, seed=9)
    lens = torch.tensor([10, 200, 400], dtype=torch.int32, device="cuda")
    q = _q(B, 1, 4 * Hkv, 128, 10)
    k_new, v_new = (_q(B, 1, Hkv, 128, s) for s in (11, 12))

    def step():
        attngen.append_kv(k, v, k_new, v_new, lens, page_table=table, check=False)
        lens.add_(1)
        return attngen.decode(q, k, v, lens, page_table=table, spec=spec, return_lse=True)

    attngen.decode(q, k, v, lens, page_table=table, spec=spec)  # compiled and loaded before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out, lse = step()
    torch.cuda.current_stream().wait_stream(stream)
    lens.copy_(torch.tensor([10, 200, 400], dtype=torch.int32))  # capture ran nothing; start over
    for _ in range(3):
        q.copy_(torch.randn_like(q, dtype=torch.float32).to(q.dtype))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.decode_attention(q, k, v, lens.cpu(), spec, page_table=table.cpu())[0]
        for b in range(B):
            kb, vb = (reference.gather_cache(t, table, b, int(lens[b])) for t in (k, v))
            bad = tolerance.check_output(out[b:b + 1], ref[b:b + 1], q[b:b + 1], kb, vb, "bf16", spec.effective_scale)
            assert bad is None, f"sequence {b}: {bad}"
    assert lens.tolist() == [13, 203, 403]
    # The host check cannot run inside a capture: a clear error naming the way out, nothing captured.
    with pytest.raises(ValueError, match=r"append_kv\(check=True\) .* allowed there: check=False"):
        with torch.cuda.stream(stream), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            attngen.append_kv(k, v, k_new, v_new, lens, page_table=table)
    torch.cuda.current_stream().wait_stream(stream)


def test_decode_traces_with_torch_compile_fullgraph():
    import torch

    k, v, table = make_cache(2, 300, 2, 64, 32, seed=13)
    lens = torch.tensor([300, 17], dtype=torch.int32, device="cuda")
    q = _q(2, 2, 4, 64, 14)

    def fn(q, k, v, lens, table):
        return attngen.decode(q, k, v, lens, page_table=table, mask="causal") * 2

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    assert torch.equal(compiled(q, k, v, lens, table), fn(q, k, v, lens, table))


def test_bad_arguments_raise_clear_errors():
    import torch

    k, v, table = make_cache(2, 128, 2, 64, 32, seed=15)
    lens = torch.tensor([5, 6], dtype=torch.int32, device="cuda")
    q = _q(2, 1, 4, 64, 16)
    with pytest.raises(ValueError, match="cache_seqlens has dtype int64"):
        attngen.decode(q, k, v, lens.long(), page_table=table)
    with pytest.raises(ValueError, match="page_table has dtype"):
        attngen.decode(q, k, v, lens, page_table=table.float())
    with pytest.raises(ValueError, match="num_splits=0 is invalid"):
        attngen.decode(q, k, v, lens, page_table=table, num_splits=0)
    with pytest.raises(ValueError, match="k_cache and v_cache must have the same shape"):
        attngen.decode(q, k, v[:-1], lens, page_table=table)
    with pytest.raises(ValueError, match="contiguous cache k_cache has batch"):
        attngen.decode(q, k, v, lens)
    with pytest.raises(ValueError, match="append_kv: sequence 1"):
        attngen.append_kv(k, v, k[:2, :1], v[:2, :1], torch.tensor([5, 128], dtype=torch.int32, device="cuda"),
                          page_table=table)
