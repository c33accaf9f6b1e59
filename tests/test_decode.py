"""The decode family without a GPU: argument checks name what is wrong, the split heuristic fills the
GPU, plans render and compile for sm_80 and sm_90a with nvcc (no spills at d64/d128), the decode
reference agrees with the dense one on gathered pages, append_kv writes where the kernels read,
and the forward front door refuses a decode family."""

from __future__ import annotations

import math

import pytest
import sass_waits
import torch

from attngen import families, reference, targets
from attngen.build import nvcc
from attngen.decoding import append_kv
from attngen.errors import SpecError
from attngen.families import DECODE_FAMILIES, plan_spec
from attngen.families.base import DecodeCall
from attngen.families.decode_sm80.family import COMBINE_THREADS, FAMILY, MIN_BLOCKS_PER_SPLIT, choose_splits
from attngen.runtime.decode import check_decode_inputs, check_num_splits, decode_plan
from attngen.runtime.tensors import TensorInfo
from attngen.spec import AttentionSpec

SPEC = AttentionSpec(head_dim=128, gqa_ratio=4, mask="causal")
H100 = targets.target("sm_90a")


def info(name, shape, dtype="bfloat16", strides=None, ptr=0):
    if strides is None:
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorInfo(name, "torch", ptr, tuple(shape), tuple(strides), dtype, 0)


def paged_call(**changes):
    args = dict(q=info("q", (2, 1, 8, 128)), k=info("k_cache", (10, 64, 2, 128)), v=info("v_cache", (10, 64, 2, 128)),
                seqlens=info("cache_seqlens", (2,), "int32"), page_table=info("page_table", (2, 5), "int32"))
    args.update(changes)
    return args


def test_a_well_formed_call_passes_the_checks():
    a = paged_call()
    check_decode_inputs(SPEC.problem, a["q"], a["k"], a["v"], a["seqlens"], a["page_table"])


@pytest.mark.parametrize("change, message", [
    (dict(q=info("q", (2, 1, 6, 128))), "q has 6 heads and the cache has 2"),
    (dict(q=info("q", (2, 1, 8, 64))), "q has head_dim 64"),
    (dict(k=info("k_cache", (10, 64, 2, 128), "float16")), "k_cache has dtype float16"),
    (dict(v=info("v_cache", (10, 32, 2, 128))), "k_cache and v_cache must have the same shape"),
    (dict(seqlens=info("cache_seqlens", (2,), "int64")), "cache_seqlens has dtype int64; allowed: int32"),
    (dict(seqlens=info("cache_seqlens", (3,), "int32")), r"cache_seqlens has shape \(3,\)"),
    (dict(page_table=info("page_table", (2, 5), "float32")), "page_table has dtype float32"),
    (dict(page_table=info("page_table", (2, 5), "int32", strides=(1, 2))), "page_table must be contiguous"),
    (dict(page_table=None), "the contiguous cache k_cache has batch 10 but q has batch 2"),
    (dict(k=info("k_cache", (10, 64, 2, 128), strides=(64 * 256, 256, 128, 2))), "contiguous in its last dim"),
    (dict(q=info("q", (2, 1, 8, 128), ptr=8)), "16-byte aligned"),
    (dict(q=info("q", (2, 1 << 27, 8, 128))), r"2147483648 output rows \(batch x seq_q x heads_q\); allowed: fewer"),
])
def test_bad_arguments_are_named(change, message):
    a = paged_call(**change)
    with pytest.raises(ValueError, match=message):
        check_decode_inputs(SPEC.problem, a["q"], a["k"], a["v"], a["seqlens"], a["page_table"])


@pytest.mark.parametrize("value", [0, -1, 257, 2.0, True, "4"])
def test_num_splits_is_checked(value):
    with pytest.raises(ValueError, match="num_splits="):
        check_num_splits(value)


def test_splits_fill_the_gpu_and_keep_blocks_per_split():
    # 8 CTAs without splitting on 264 slots: split until the slots are nearly full.
    s = choose_splits(1, 8, 1, 32768, 64, 132, 2)
    assert 0.9 * 264 <= 8 * s <= 264
    # Already more CTAs than slots: no split.
    assert choose_splits(64, 8, 1, 16384, 64, 132, 2) == 1
    # A short cache: every split keeps MIN_BLOCKS_PER_SPLIT blocks of a full cache.
    s = choose_splits(1, 8, 1, 256, 64, 132, 2)
    assert s <= 256 // 64 // MIN_BLOCKS_PER_SPLIT
    # 64 blocks of 8 kv heads: 32 splits of 2 blocks fill one wave; 29 (most slots busy) would leave
    # splits of 3 blocks, and the longest split sets a CTA's time.
    assert choose_splits(1, 8, 1, 4096, 64, 132, 2) == 32
    # 8 x 8 row tiles on 264 slots: 4 splits of 32 blocks in one wave beat 8 splits over two.
    assert choose_splits(8, 8, 1, 8192, 64, 132, 2) == 4


def decode_call_of(num_splits: int) -> DecodeCall:
    """A paged call: 3 sequences of 2 new tokens, 8 query heads over 2 kv heads, d128."""
    return DecodeCall(*(info(name, shape, dtype) for name, shape, dtype in (
        ("q", (3, 2, 8, 128), "bfloat16"), ("k_cache", (40, 64, 2, 128), "bfloat16"),
        ("v_cache", (40, 64, 2, 128), "bfloat16"), ("cache_seqlens", (3,), "int32"),
        ("page_table", (3, 10), "int32"), ("out", (3, 2, 8, 128), "bfloat16"), ("lse", (3, 8, 2), "float32"))),
        0.1, num_splits)


def test_the_combine_takes_one_cta_per_output_row():
    plan = decode_plan(AttentionSpec(head_dim=128, gqa_ratio=4), H100, True)
    call = decode_call_of(5)
    main, combine = FAMILY.launches(plan, call)
    assert main.grid == (2, 5, 3)  # (kv heads x row tiles, splits, batch)
    assert combine.grid == (3 * 2 * 8, 1, 1) and combine.block == (COMBINE_THREADS, 1, 1)
    # On sm_90 both are programmatic dependent launches (each waits in-kernel); not before.
    assert combine.early and main.early
    sm80 = decode_plan(AttentionSpec(head_dim=128, gqa_ratio=4), targets.target("sm_80"), True)
    assert not any(launch.early for launch in FAMILY.launches(sm80, call))


@pytest.mark.parametrize("page_size, rows", [(64, 64), (16, 16), (256, 64), (8, 8), (96, 32), (100, 0), (4, 0)])
def test_tma_boxes_stay_inside_a_page_or_fall_back_to_cp_async(page_size, rows):
    """A box is gcd(block_n, page_size) rows (inside one page), 0 (the cp.async path) below
    MIN_BOX_ROWS or where TMA cannot describe the cache; a contiguous cache takes whole blocks."""
    from attngen.families.decode_sm80.family import box_rows

    spec = AttentionSpec(head_dim=128, gqa_ratio=4, family="decode_sm80", config={"loads": "tma"})
    plan = decode_plan(spec, H100, True)
    assert plan.tma and plan.block_n == 64 and plan.config.label() == "m16n64w4s3t"
    pages = paged_call(k=info("k_cache", (10, page_size, 2, 128), ptr=1 << 20),
                       v=info("v_cache", (10, page_size, 2, 128), ptr=1 << 21))
    call = DecodeCall(**pages, out=info("out", (2, 1, 8, 128)), lse=info("lse", (2, 8, 1), "float32"),
                      softmax_scale=0.1)
    assert box_rows(plan, call) == rows
    misaligned = DecodeCall(**{**pages, "k": info("k_cache", (10, page_size, 2, 128), ptr=(1 << 20) + 8)},
                            out=call.out, lse=call.lse, softmax_scale=0.1)
    assert box_rows(plan, misaligned) == 0
    strided = DecodeCall(**{**pages, "v": info("v_cache", (10, page_size, 2, 128), ptr=1 << 21,
                                                strides=(page_size * 2 * 136, 2 * 136, 136, 1))},
                         out=call.out, lse=call.lse, softmax_scale=0.1)
    assert box_rows(plan, strided) == rows  # a 272-byte head stride: a multiple of 16 bytes
    odd = DecodeCall(**{**pages, "v": info("v_cache", (10, page_size, 2, 128), ptr=1 << 21,
                                           strides=(page_size * 2 * 132, 2 * 132, 132, 1))},
                     out=call.out, lse=call.lse, softmax_scale=0.1)
    assert box_rows(plan, odd) == 0  # 264-byte head stride: not a multiple of 16 bytes
    contiguous = decode_plan(spec, H100, False)
    flat = DecodeCall(**{**pages, "k": info("k_cache", (2, 320, 2, 128), ptr=1 << 20),
                         "v": info("v_cache", (2, 320, 2, 128), ptr=1 << 21), "page_table": None},
                      out=call.out, lse=call.lse, softmax_scale=0.1)
    assert box_rows(contiguous, flat) == 64


def test_tma_config_labels_round_trip_and_need_sm90():
    from attngen.families.decode_sm80.family import DecodeConfig

    assert DecodeConfig.from_label("m16n64w4s3t") == DecodeConfig(16, 64, 4, 3, "tma")
    assert DecodeConfig.from_label("m16n64w4s3") == DecodeConfig(16, 64, 4, 3)
    assert DecodeConfig(16, 128, 4, 2, "tma").label() == "m16n128w4s2t"
    problem = AttentionSpec(head_dim=128).problem
    assert not any(c.loads == "tma" for c in FAMILY.configs(problem, targets.target("sm_80")))
    assert any(c.loads == "tma" for c in FAMILY.configs(problem, H100))
    with pytest.raises(SpecError, match="config.loads='tma' needs sm_90 or newer"):
        FAMILY.plan(problem, targets.target("sm_80"), DecodeConfig(16, 64, 4, 2, "tma"))


def test_the_forward_front_door_refuses_a_decode_family():
    spec = AttentionSpec(head_dim=128, family="decode_sm80")
    with pytest.raises(SpecError, match="is a decode family, but this call runs a forward family"):
        plan_spec(spec, H100, operation="forward")
    with pytest.raises(SpecError, match="is a forward family, but this call runs a decode family"):
        families.select(spec.problem, H100, "fwd_sm80", "decode")
    # A spec pinning a forward family still decodes, with the decode family's defaults.
    assert decode_plan(AttentionSpec(head_dim=128, family="fwd_sm80"), H100, True).family == "decode_sm80"
    assert plan_spec(spec, H100).family == "decode_sm80"  # what `attngen generate` plans


@pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("spec", [
    AttentionSpec(head_dim=64, gqa_ratio=8, mask="causal"),
    AttentionSpec(head_dim=128, gqa_ratio=4, mask="sliding_window(4096, 0)", score_mod="softcap(50.0)"),
    AttentionSpec(head_dim=128, gqa_ratio=8, mask="q_idx + (kv_len - q_len) >= kv_idx", sink="sinks[h]"),
], ids=lambda s: s.name)
@pytest.mark.parametrize("page_size", [16, 64, None], ids=["paged", "whole-pages", "contiguous"])
def test_plans_compile_without_spills(arch, spec, page_size):
    plan = decode_plan(spec, targets.target(arch), page_size is not None, page_size)
    assert plan.whole_pages == (page_size == 64)
    report = nvcc.check_plan(plan)
    assert report.spill_bytes == 0 and report.stack_frame_bytes == 0, report.log
    assert [k.symbol for k in plan.kernels] == [plan.name, f"{plan.name}_combine"]


@pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("mask", ["none", "causal", "sliding_window(4096, 0)"])
@pytest.mark.parametrize("head_dim, ratio", [(64, 8), (96, 4), (128, 4), (256, 2)])
def test_every_default_plan_compiles_without_spills(head_dim, ratio, mask):
    """The default config at every head dim, over each kind of cache (pages of 16, pages of whole key
    blocks, contiguous) on the default target: no spills (d96 causal contiguous once spilled 4 bytes)."""
    spec = AttentionSpec(head_dim=head_dim, gqa_ratio=ratio, mask=mask)
    for page_size in (16, 64, None):
        plan = decode_plan(spec, H100, page_size is not None, page_size)
        report = nvcc.check_plan(plan)
        assert report.spill_bytes == 0 and report.stack_frame_bytes == 0, (plan.name, report.log)


@pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("page_size", [16, 64, None], ids=["paged", "whole-pages", "contiguous"])
@pytest.mark.parametrize("loads", ["cp_async", "tma"])
def test_sm90_kernels_wait_for_the_kernel_before_them_before_touching_memory(tmp_path, loads, page_size):
    """On sm_90 both kernels are launched early (family.py launches): each must wait for the kernel before
    it (griddepcontrol.wait, SASS ACQBULK) on every path, before any global load or store but the split
    kernel's L2 hints, or a step could read a cache row, a length or a partial before the kernel that
    wrote it is done."""
    if nvcc.find_cuobjdump() is None:
        pytest.skip("cuobjdump not on PATH: the SASS is not checked here (CI installs it)")
    spec = AttentionSpec(head_dim=128, gqa_ratio=4, mask="causal", family="decode_sm80", config={"loads": loads})
    paged = page_size is not None
    plan = decode_plan(spec, H100, paged, page_size)
    if loads == "cp_async":  # (a TMA plan's launches encode tensor maps, with cuda-python)
        assert all(launch.early for launch in FAMILY.launches(plan, decode_call_of(3)))
    cubin = tmp_path / "k.cubin"
    nvcc.check_plan(plan, keep_cubin=cubin)
    functions = sass_waits.functions(nvcc.sass(cubin))
    assert sorted(functions) == sorted(k.symbol for k in plan.kernels)
    for name, body in functions.items():
        before = sass_waits.before_the_wait(name, body, hints=True)
        hints = "UTMAPF" in before  # the paged split kernel's L2 prefetches (flash_decode.cuh prefetch_first_blocks)
        assert hints == (loads == "tma" and paged and not name.endswith("_combine")), f"{name}: L2 hints {hints}"


@pytest.mark.parametrize("config, page_size, whole", [
    ({}, 64, True), ({}, 128, True), ({}, 256, True), ({}, 16, False), ({}, 32, False), ({}, 100, False),
    ({}, 1, False), ({}, 192, True), ({}, None, False), ({"block_n": 32, "num_warps": 2}, 32, True),
    ({"block_n": 128}, 64, False), ({"block_n": 128}, 256, True), ({"loads": "tma"}, 64, False)])
def test_pages_of_whole_key_blocks_get_a_plan_of_their_own(config, page_size, whole):
    """A paged cp.async call whose page size is a multiple of block_n runs the plan for pages of whole
    blocks (flash_decode.cuh WHOLE_PAGES); every other page size, TMA plans and contiguous caches not."""
    spec = AttentionSpec(head_dim=128, gqa_ratio=4, family="decode_sm80", config=config or None)
    plan = decode_plan(spec, H100, page_size is not None, page_size)
    assert plan.whole_pages == whole and plan.name.endswith("_paged_whole") == whole
    assert plan.paged == (page_size is not None) and plan.choices()["whole_pages"] == whole
    rows = decode_plan(spec, H100, True)  # no page size given: the plan for any page size
    assert not rows.whole_pages and rows.name.endswith("_paged")
    assert 'constexpr bool WHOLE_PAGES = ' + ("true" if whole else "false") in FAMILY.render(plan)


def test_every_config_the_family_lists_plans_or_says_why():
    family = DECODE_FAMILIES["decode_sm80"]
    for d in (64, 128, 256):
        problem = AttentionSpec(head_dim=d).problem
        for config in family.configs(problem, H100):
            try:
                plan = family.plan(problem, H100, config)
            except SpecError as exc:
                assert "shared memory" in str(exc)
                continue
            assert plan.smem_bytes <= H100.smem_per_block


def _paged(B, per, page_size, Hkv, D, seed):
    gen = torch.Generator().manual_seed(seed)
    pages = B * per
    k, v = (torch.randn(pages, page_size, Hkv, D, generator=gen) for _ in range(2))
    table = torch.randperm(pages, generator=gen).reshape(B, per).to(torch.int32)
    return k, v, table


def test_the_decode_reference_is_the_dense_one_on_gathered_pages():
    k, v, table = _paged(3, 4, 16, 2, 64, seed=0)
    q = torch.randn(3, 2, 8, 64)
    lens = torch.tensor([0, 17, 64], dtype=torch.int32)
    spec = AttentionSpec(head_dim=64, gqa_ratio=4, mask="causal")
    out, lse = reference.decode_attention(q, k, v, lens, spec, page_table=table)
    assert out[0].eq(0).all() and lse[0].isneginf().all()
    for b in (1, 2):
        pages = table[b].long()
        kb = k[pages].reshape(1, -1, 2, 64)[:, :lens[b]]
        vb = v[pages].reshape(1, -1, 2, 64)[:, :lens[b]]
        ref, ref_lse = reference.attention(q[b:b + 1], kb, vb, mask="causal", return_lse=True)
        assert torch.allclose(out[b:b + 1], ref) and torch.allclose(lse[b:b + 1], ref_lse)


@pytest.mark.parametrize("paged", [True, False])
def test_append_kv_writes_where_the_cache_is_read(paged):
    B, Hkv, D, page_size = 2, 2, 64, 16
    if paged:
        k, v, table = _paged(B, 4, page_size, Hkv, D, seed=1)
    else:
        k, v, table = torch.zeros(B, 64, Hkv, D), torch.zeros(B, 64, Hkv, D), None
    lens = torch.tensor([15, 40], dtype=torch.int32)
    k_new, v_new = torch.randn(B, 3, Hkv, D), torch.randn(B, 3, Hkv, D)
    append_kv(k, v, k_new, v_new, lens, page_table=table)
    for b in range(B):
        got = reference.gather_cache(k, table, b, int(lens[b]) + 3)[0, int(lens[b]):]
        assert torch.equal(got, k_new[b])
        assert torch.equal(reference.gather_cache(v, table, b, int(lens[b]) + 3)[0, int(lens[b]):], v_new[b])
    with pytest.raises(ValueError, match="append_kv: sequence 1 has cache_seqlens 63"):
        append_kv(k, v, k_new, v_new, torch.tensor([0, 63], dtype=torch.int32), page_table=table)
    if paged:
        with pytest.raises(ValueError, match="page_table is torch.float32"):
            append_kv(k, v, k_new, v_new, lens, page_table=table.float())
        with pytest.raises(ValueError, match=r"page_table is torch.int32 of shape \(2, 0\); allowed: .*pages per sequence >= 1"):
            append_kv(k, v, k_new, v_new, lens, page_table=table[:, :0])
    with pytest.raises(ValueError, match="cache_seqlens is torch.int64"):
        append_kv(k, v, k_new, v_new, lens.long(), page_table=table)
    with pytest.raises(ValueError, match="k_new has shape"):
        append_kv(k, v, k_new[:, :, :1], v_new, lens, page_table=table)
    with pytest.raises(ValueError, match="v_cache is a list"):
        append_kv(k, [], k_new, v_new, lens, page_table=table)


def test_append_kv_names_lengths_or_a_page_table_on_another_device():
    k = torch.empty(2, 16, 2, 64, device="meta")
    new = torch.empty(2, 1, 2, 64, device="meta")
    lens = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens is on cpu; allowed: the cache's device, meta"):
        append_kv(k, k, new, new, lens)
    with pytest.raises(ValueError, match="page_table is on cpu; allowed: the cache's device, meta"):
        append_kv(k, k, new, new, lens.to("meta"), page_table=torch.zeros(2, 1, dtype=torch.int32))


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("lens, bad_page", [([0, 63], False), ([-2, 10], False), ([5, 10], True)])
def test_append_kv_unchecked_refuses_a_write_that_does_not_fit(paged, lens, bad_page):
    """check=False (inside a CUDA graph capture) still never lands a write elsewhere: a position past
    the capacity, a negative one or a bad page id becomes an index past the cache, which the indexing
    kernel refuses (an IndexError here; a device-side assert on the GPU), and no token is overwritten.
    The first version clamped the page and wrapped negative indices, so position 64 of a 64-token
    capacity overwrote slot 0 of the sequence's last page."""
    if bad_page and not paged:
        pytest.skip("page ids exist only in a paged cache")
    B, Hkv, D, page_size = 2, 2, 64, 16
    if paged:
        k, v, table = _paged(B, 4, page_size, Hkv, D, seed=2)
        if bad_page:
            table[0, 0] = -1  # a negative id: Python indexing would wrap it to the last page
    else:
        k, v, table = torch.randn(B, 64, Hkv, D), torch.randn(B, 64, Hkv, D), None
    before = k.clone(), v.clone()
    k_new, v_new = torch.randn(B, 3, Hkv, D), torch.randn(B, 3, Hkv, D)
    with pytest.raises(IndexError):
        append_kv(k, v, k_new, v_new, torch.tensor(lens, dtype=torch.int32), page_table=table, check=False)
    # The writes that fit may have landed; nothing else changed.
    targets = torch.zeros(k.shape[:2], dtype=torch.bool)
    for b in range(B):
        for pos in range(lens[b], lens[b] + 3):
            if paged and 0 <= pos < table.shape[1] * page_size and table[b, pos // page_size] >= 0:
                targets[table[b, pos // page_size], pos % page_size] = True
            elif not paged and 0 <= pos < k.shape[1]:
                targets[b, pos] = True
    assert torch.equal(k[~targets], before[0][~targets]) and torch.equal(v[~targets], before[1][~targets])
    with pytest.raises(ValueError, match="append_kv: sequence"):
        append_kv(k, v, k_new, v_new, torch.tensor(lens, dtype=torch.int32), page_table=table)


def test_decode_errors_name_the_cache_as_k_cache():
    """decode's shape errors came from attention's checks and said "k" and the forward's layout."""
    import attngen

    q = torch.randn(1, 1, 3, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 16, 2, 64, dtype=torch.bfloat16)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="q has 3 heads and k_cache has 2; allowed"):
        attngen.decode(q, k, k, lens)
    with pytest.raises(ValueError, match=r"k_cache must have 4 dims \(num_pages, page_size, heads_kv, head_dim\) or"):
        attngen.decode(q, k[0], k, lens)


def test_the_traced_op_refuses_what_the_decode_family_refuses():
    """At trace time (fake tensors) the op gives the decode family's own refusal, as an eager call would,
    not a later, misleading one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import attngen

    attngen.register()
    with FakeTensorMode():
        q = torch.empty(2, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 256, 2, 128, dtype=torch.bfloat16, device="cuda")
        lens = torch.empty(2, dtype=torch.int32, device="cuda")
        with pytest.raises(SpecError, match="decode_sm80: dropout_p=0.1 is for training"):
            torch.ops.attngen.decode(q, k, k, lens, None, AttentionSpec(head_dim=128, gqa_ratio=4, dropout_p=0.1).key(),
                                     None, None)
        out, lse = torch.ops.attngen.decode(q, k, k, lens, None, AttentionSpec(head_dim=128, gqa_ratio=4).key(), None,
                                            None)
        assert out.shape == q.shape and lse.shape == (2, 8, 1)
