"""Forward kernels against the float64 reference on a GPU (marker `gpu`), for every kernel family that
runs on it: conftest.py parametrizes `gpu_family`, `gpu_spec` and `gpu_default_spec` from the fuzzer's
built-in pool for this GPU (attngen/fuzz/pool.py), so each family is tested through specs pinned to it.

Outputs are NaN-poisoned before every launch so an unwritten element fails; bounds
come from attngen.tolerance (one per dtype, derived from the numerics).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attngen
from attngen import families, reference, targets, tolerance
from attngen.dtypes import DTYPES, torch_dtype
from attngen.errors import SpecError
from attngen.fuzz.case import make_inputs as make_case_inputs
from attngen.fuzz.case import make_runtime_inputs
from attngen.fuzz.pool import builtin_specs
from attngen.fuzz.strategies import ODD_LENGTHS, fuzz_cases
from attngen.spec import HEAD_DIMS, AttentionSpec

pytestmark = pytest.mark.gpu


def this_target():
    import torch

    return targets.device_target(torch.cuda.current_device())


def pinned(gpu_family: str, **problem) -> AttentionSpec:
    """A spec of `problem` pinned to the family under test."""
    spec = AttentionSpec(**problem, family=gpu_family)
    reason = families.get_family(gpu_family).supports(spec.problem, this_target())
    assert reason is None, f"{gpu_family} runs problems of the pool here, but not {spec.problem.label()}: {reason}"
    return spec


def make_inputs(spec, B, Sq, Sk, Hkv, *, transposed=False, logit_scale=1.0, seed=0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = torch_dtype(spec.dtype)
    Hq = Hkv * spec.gqa_ratio

    def rand(S, H, scale=1.0):
        shape = (B, H, S, spec.head_dim) if transposed else (B, S, H, spec.head_dim)
        x = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * scale).to(dtype)
        return x.transpose(1, 2) if transposed else x  # BHSD storage seen as BSHD: non-trivial strides

    return rand(Sq, Hq, logit_scale), rand(Sk, Hkv, logit_scale), rand(Sk, Hkv)


def run_and_check(spec, q, k, v, softmax_scale=None, inputs=None):
    import torch

    kernel = attngen.compile(spec)
    assert spec.family is None or kernel.plan.family == spec.family
    assert kernel.plan.target == this_target()  # planned and built for this GPU, whatever the spec's arch
    B, Sq, Hq, D = q.shape
    Sk = k.shape[1]
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format).contiguous()
    lse = torch.full((B, Hq, Sq), float("nan"), device="cuda", dtype=torch.float32)
    kernel(q, k, v, out=out, lse=lse, softmax_scale=softmax_scale, inputs=inputs)
    torch.cuda.synchronize()
    scale = spec.effective_scale if softmax_scale is None else softmax_scale
    ref, ref_lse = reference.attention_for_spec(q, k, v, spec, softmax_scale=scale, return_lse=True, inputs=inputs)
    bad = tolerance.check_output(out, ref, q, k, v, spec.dtype, scale) or tolerance.check_lse(lse, ref_lse, q, k, scale)
    assert bad is None, f"{kernel.plan.name} B={B} Sq={Sq} Sk={Sk} Hq={Hq}: {bad}"


@pytest.mark.parametrize("Sq,Sk", [(n, n) for n in ODD_LENGTHS] + [(1, 4097), (129, 17), (1000, 127), (17, 1000)])
def test_odd_lengths(gpu_default_spec, Sq, Sk):
    q, k, v = make_inputs(gpu_default_spec, B=1, Sq=Sq, Sk=Sk, Hkv=2, seed=Sq * 7919 + Sk)
    run_and_check(gpu_default_spec, q, k, v)


def test_strided_bhsd_inputs(gpu_spec):
    q, k, v = make_inputs(gpu_spec, B=2, Sq=300, Sk=257, Hkv=2, transposed=True, seed=3)
    assert not q.is_contiguous()
    run_and_check(gpu_spec, q, k, v)


def test_fully_masked_rows_give_zero_and_neg_inf(gpu_family):
    import torch

    spec = pinned(gpu_family, head_dim=64, dtype="bf16", mask="causal")
    q, k, v = make_inputs(spec, B=1, Sq=300, Sk=40, Hkv=3, seed=5)
    out, lse = attngen.attention(q, k, v, spec, return_lse=True)
    hidden = 300 - 40  # bottom-right alignment: rows below Sq - Sk see no key
    assert torch.all(out[:, :hidden] == 0) and torch.all(torch.isneginf(lse[:, :, :hidden]))
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, hidden:]).all()
    run_and_check(spec, q, k, v)


def test_large_logits_and_custom_scale(gpu_family):
    spec = pinned(gpu_family, head_dim=128, dtype="bf16", mask="causal")
    q, k, v = make_inputs(spec, B=1, Sq=513, Sk=513, Hkv=2, logit_scale=30.0, seed=11)
    run_and_check(spec, q, k, v)  # scores up to ~1e4
    run_and_check(spec, q, k, v, softmax_scale=0.5)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_large_logits_where_rows_see_their_first_key_after_the_tiles_first_block(gpu_family, dtype):
    # Bottom-right window: the first tile's rows see keys 288+r..388+r, so its last rows see nothing of
    # its first key block (keys 256-383 at 128-key blocks) and meet their first key with a reference of
    # -inf; fwd_sm90's overlapped loop takes those exps against 0 first, and with scores up to ~1e4 they
    # overflow and must be taken again.
    spec = pinned(gpu_family, head_dim=128, dtype=dtype, mask="sliding_window(100, 0)")
    q, k, v = make_inputs(spec, B=1, Sq=129, Sk=517, Hkv=2, logit_scale=30.0, seed=13)
    run_and_check(spec, q, k, v)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("step", [40.0, 300.0])
def test_running_max_rises_in_small_and_large_steps(gpu_family, dtype, mask, step):
    # A row's max climbs along the keys by less than 2^8 per block (fwd_sm90 keeps its old reference:
    # exps above 1, O not rescaled), then jumps by far more (the reference moves), then falls. fwd_sm90's
    # overlapped loop takes a block's exps against the old reference before it knows the block's max:
    # the step of 40 (log2) makes them large, the step of 300 overflows them, and both must be taken again.
    import torch

    for head_dim in (64, 128):
        spec = pinned(gpu_family, head_dim=head_dim, dtype=dtype, mask=mask)
        q, k, v = make_inputs(spec, B=1, Sq=700, Sk=1500, Hkv=2, seed=head_dim)
        # q ~ 1 and key j's columns ~ logit_j / head_dim: the scores' log2 follows `climb`, up 3 per 128
        # keys, a step at key 900, then down 2 per 128 keys.
        j = torch.arange(1500, device="cuda", dtype=torch.float32)
        climb = torch.where(j < 900, 3.0 * j / 128, step + 3.0 * 900 / 128 - 2.0 * (j - 900) / 128)
        direction = torch.ones(head_dim, device="cuda") / head_dim
        logit = climb / 1.4426950408889634 / spec.effective_scale  # scale * q.k, in nats
        k = (k.float() * 0.05 + logit[None, :, None, None] * direction).to(k.dtype)
        q = (q.float() * 0.05 + 1.0).to(q.dtype)
        run_and_check(spec, q, k, v)


def test_runs_on_current_stream_and_returns_new_tensor(gpu_family):
    import torch

    spec = pinned(gpu_family, head_dim=64, dtype="fp16")
    q, k, v = make_inputs(spec, B=2, Sq=256, Sk=256, Hkv=4, seed=2)
    attngen.attention(q, k, v, spec)  # compiled and resolved now, so the call below launches at once
    q_new = torch.randn_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # The sleep holds back the copy on this stream: a kernel launched on any other stream would
        # read the old q and miss the bound below.
        torch.cuda._sleep(50_000_000)
        q.copy_(q_new)
        out = attngen.attention(q, k, v, spec)
    stream.synchronize()
    assert out.data_ptr() != q.data_ptr() and out.shape == q.shape and out.dtype == q.dtype
    ref = reference.attention_for_spec(q_new, k, v, spec)
    assert tolerance.check_output(out, ref, q_new, k, v, spec.dtype, spec.effective_scale) is None


def test_cupy_arrays(gpu_family):
    import cupy
    import torch

    spec = pinned(gpu_family, head_dim=64, dtype="fp16", mask="causal")
    q, k, v = make_inputs(spec, B=1, Sq=200, Sk=333, Hkv=2, seed=9)
    out = attngen.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), spec)
    assert isinstance(out, cupy.ndarray)
    ref = reference.attention_for_spec(q, k, v, spec)
    assert tolerance.check_output(torch.as_tensor(out, device="cuda"), ref, q, k, v, spec.dtype,
                                  spec.effective_scale) is None


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda q, k, v: (q.float(), k, v), "dtype"),
        (lambda q, k, v: (q[..., :32].contiguous(), k, v), "head_dim"),
        (lambda q, k, v: (q, k[:, :, :1], v[:, :, :1]), "gqa_ratio"),
        (lambda q, k, v: (q, k, v[:, :-1]), "same shape"),
        (lambda q, k, v: (q.cpu(), k, v), "CUDA"),
        (lambda q, k, v: (q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v), "contiguous in its last dim"),
        (lambda q, k, v: (q[0], k, v), "4 dims"),
    ],
)
def test_bad_inputs_raise_clear_errors(gpu_family, change, match):
    spec = pinned(gpu_family, head_dim=64, dtype="bf16", gqa_ratio=2)
    q, k, v = make_inputs(spec, B=1, Sq=64, Sk=64, Hkv=2)
    with pytest.raises(ValueError, match=match):
        attngen.attention(*change(q, k, v), spec)


@functools.lru_cache(maxsize=None)
def _family_cases(gpu_family: str):
    target = this_target()
    return fuzz_cases([spec for spec in builtin_specs(target) if spec.family == gpu_family], target=target)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hypothesis_against_reference(gpu_family, data):
    case = data.draw(_family_cases(gpu_family), label="case")
    q, k, v = (p.view for p in make_case_inputs(case, "cuda"))
    # The pool holds specs whose masks read runtime inputs (prefix_lm_d64's prefix lengths).
    inputs = make_runtime_inputs(case, "cuda") or None
    run_and_check(case.spec, q, k, v, softmax_scale=case.softmax_scale, inputs=inputs)


# -- the front door without a spec, and the dispatcher's choice of family ---------------------------
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("transposed", [False, True])
def test_attention_without_a_spec_takes_dims_from_the_tensors_and_matches_the_reference(head_dim, dtype, transposed):
    # 8 query heads over 2 kv heads: GQA 4 from the shapes; Sq < Sk under bottom-right causal alignment.
    problem = AttentionSpec(head_dim=head_dim, dtype=dtype, gqa_ratio=4, mask="causal")
    q, k, v = make_inputs(problem, B=2, Sq=300, Sk=513, Hkv=2, transposed=transposed, seed=head_dim)
    scale = 1 / math.sqrt(head_dim)
    for softmax_scale in (None, 0.05):
        out, lse = attngen.attention(q, k, v, mask="causal", softmax_scale=softmax_scale, return_lse=True)
        used = scale if softmax_scale is None else softmax_scale
        ref, ref_lse = reference.attention(q, k, v, mask="causal", softmax_scale=used, return_lse=True)
        bad = tolerance.check_output(out, ref, q, k, v, dtype, used) or tolerance.check_lse(lse, ref_lse, q, k, used)
        assert bad is None, f"attention(mask='causal', softmax_scale={softmax_scale}) d{head_dim} {dtype}: {bad}"


@pytest.mark.parametrize("head_dim,mask,Sq,Sk", [(64, "causal", 1000, 1000), (64, "causal", 300, 1024),
                                                 (128, "none", 1000, 1000), (128, "none", 513, 77),
                                                 (64, "causal", 1025, 1025), (128, "none", 2048, 700)])
def test_the_front_door_runs_short_calls_on_their_own_defaults(head_dim, mask, Sq, Sk, tmp_path, monkeypatch):
    # Calls of at most 1,024 tokens resolve to fwd_sm90's short-sequence rows on a Hopper GPU (family.py
    # SHORT_SEQLEN; no tuning database here); every call, short or not, matches the reference.
    from attngen.runtime import dispatch
    from attngen.tune.db import ENV_VAR

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "no-tuning.sqlite3"))
    dispatch.forget()
    spec = AttentionSpec(head_dim=head_dim, dtype="bf16", mask=mask)
    q, k, v = make_inputs(spec, B=2, Sq=Sq, Sk=Sk, Hkv=4, seed=Sq + Sk)
    plan = dispatch.prepare(q, k, v, spec).kernel.plan
    if this_target().cc == 90:
        long = {64: "m192n128s2opd", 128: "m128n160s2oprc"}[head_dim]
        assert plan.family == "fwd_sm90" and plan.config.label() == ("m128n128s2opr" if max(Sq, Sk) <= 1024 else long)
    out, lse = attngen.attention(q, k, v, spec, return_lse=True)
    scale = 1 / math.sqrt(head_dim)
    ref, ref_lse = reference.attention(q, k, v, mask=mask, softmax_scale=scale, return_lse=True)
    bad = tolerance.check_output(out, ref, q, k, v, "bf16", scale) or tolerance.check_lse(lse, ref_lse, q, k, scale)
    assert bad is None, f"{plan.name} Sq={Sq} Sk={Sk}: {bad}"


def test_an_unpinned_spec_runs_the_preferred_family_that_supports_this_gpu():
    spec = AttentionSpec(head_dim=128, dtype="bf16", mask="causal")
    kernel = attngen.compile(spec)
    target = this_target()
    assert kernel.plan.target == target and kernel.plan.name.endswith(f"_{target.label}")
    assert kernel.plan.family == families.supporting(spec.problem, target)[0].name


def test_a_layout_tma_cannot_describe_falls_back_to_another_family_never_to_a_wrong_answer(monkeypatch):
    """Where fwd_sm90's tensor maps cannot describe an input (attngen/families/tma.py describable), an
    unpinned call runs the next family that supports the problem and accepts the call (fwd_sm80),
    and a call pinned to fwd_sm90 raises, naming why. The checks every family shares already refuse
    strides TMA could not take, so the refusal is forced here."""
    import torch

    from attngen.families import tma
    from attngen.runtime import dispatch

    if families.supporting(AttentionSpec(head_dim=128).problem, this_target())[0].name != "fwd_sm90":
        pytest.skip("fwd_sm90 is not this GPU's first family")
    monkeypatch.setattr(tma, "describable", lambda shape, strides, itemsize: f"forced for {shape}")
    dispatch.forget()
    try:
        spec = AttentionSpec(head_dim=128, dtype="bf16", mask="causal", gqa_ratio=2, softmax_scale=0.0456)
        q, k, v = make_inputs(spec, B=2, Sq=333, Sk=333, Hkv=2)
        out, lse = attngen.attention(q, k, v, spec, return_lse=True)
        assert dispatch.prepare(q, k, v, spec).kernel.plan.family == "fwd_sm80"
        ref, ref_lse = reference.attention_for_spec(q, k, v, spec, softmax_scale=spec.effective_scale, return_lse=True)
        torch.cuda.synchronize()
        bad = tolerance.check_output(out, ref, q, k, v, spec.dtype, spec.effective_scale) \
            or tolerance.check_lse(lse, ref_lse, q, k, spec.effective_scale)
        assert bad is None, bad
        pinned_spec = dataclasses.replace(spec, family="fwd_sm90")
        with pytest.raises(ValueError, match=r"family fwd_sm90 cannot run these tensors: TMA cannot describe q: forced"):
            attngen.attention(q, k, v, pinned_spec)
    finally:
        dispatch.forget()


def test_a_family_pinned_on_a_gpu_it_does_not_support_raises_a_spec_error_naming_it(gpu_family, monkeypatch):
    # This GPU as a GPU of another architecture that the family does not run on (sm_75: none does).
    real = this_target()
    family = families.get_family(gpu_family)
    # A scale no other test uses: nothing about this spec is memoized in the front door yet.
    spec = AttentionSpec(head_dim=64, dtype="bf16", family=gpu_family, softmax_scale=0.0123)
    other = next(t for t in (dataclasses.replace(real, cc=cc) for cc in (75, *sorted(targets.KNOWN)))
                 if family.supports(spec.problem, t) is not None)
    q, k, v = make_inputs(spec, B=1, Sq=64, Sk=64, Hkv=1)
    monkeypatch.setattr(targets, "device_target", lambda device: other)
    message = rf"family='{gpu_family}' cannot run .* on {other.name}"
    with pytest.raises(SpecError, match=message) as caught:
        attngen.compile(spec)
    assert caught.value.field == "family"
    with pytest.raises(SpecError, match=message):
        attngen.attention(q, k, v, spec)


@pytest.mark.parametrize("schedule", ["grid", "pairs", "dynamic"])
@pytest.mark.parametrize("head_dim,mask,gqa,B,S,Hkv,pingpong", [
    (128, "causal", 1, 2, 3000, 6, True),   # 288 tiles: more than the SMs, each CTA several
    (64, "none", 4, 1, 4097, 2, True),      # a ragged last block, GQA
    (64, "causal", 2, 3, 300, 2, False),    # fewer tiles than SMs, no pingpong
    (256, "causal", 1, 1, 1000, 3, False),
])
@pytest.mark.parametrize("section_bytes", [None, 1])
def test_tile_schedules(schedule, head_dim, mask, gqa, B, S, Hkv, pingpong, section_bytes, monkeypatch):
    """Every tile schedule of fwd_sm90 covers every tile exactly once, call after call (the dynamic
    schedule's counter is reset before each launch), with sections of one kv head's query heads when
    the section budget is tiny."""
    from attngen.families.fwd_sm90 import family as sm90

    if this_target().cc != 90:
        pytest.skip("fwd_sm90 runs on sm_90a only")
    if section_bytes is not None:
        if schedule != "dynamic":
            pytest.skip("sections are the dynamic schedule's")
        monkeypatch.setattr(sm90, "L2_SECTION_BYTES", section_bytes)
    spec = AttentionSpec(head_dim=head_dim, dtype="bf16", mask=mask, gqa_ratio=gqa, family="fwd_sm90",
                         config={"schedule": schedule, "pingpong": pingpong})
    q, k, v = make_inputs(spec, B=B, Sq=S, Sk=S, Hkv=Hkv, seed=S + head_dim)
    for _ in range(2):
        run_and_check(spec, q, k, v)


@pytest.mark.parametrize("schedule", ["grid", "pairs", "dynamic"])
@pytest.mark.parametrize("head_dim,consumers", [(64, 3), (128, 2)])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_idle_warpgroups(schedule, head_dim, consumers, mask):
    """fwd_sm90's consumer warpgroups whose 64 rows all lie past Sq skip the tile (no GEMMs) but keep
    step with the others: tiles with one and two idle warpgroups, after and before busy tiles and each
    other (one query block per head: every tile of the call), a pending tile's last P V carried into an
    idle one, with Sk above and below Sq; two calls in a row."""
    if this_target().cc != 90:
        pytest.skip("fwd_sm90 runs on sm_90a only")
    block_m = 64 * consumers
    for Sq, Sk in [(1, 300), (64, 64), (65, 1000), (130, 130), (200, 77), (block_m + 64, 2 * block_m + 64),
                   (3 * block_m + 1, 3 * block_m + 1)]:
        spec = AttentionSpec(head_dim=head_dim, dtype="bf16", mask=mask, family="fwd_sm90",
                             config={"consumers": consumers, "block_n": 128, "schedule": schedule})
        q, k, v = make_inputs(spec, B=3, Sq=Sq, Sk=Sk, Hkv=5, seed=Sq + Sk)
        for _ in range(2):
            run_and_check(spec, q, k, v)


@pytest.mark.parametrize("schedule", ["grid", "pairs", "dynamic"])
@pytest.mark.parametrize("head_dim,block_n", [(256, 80), (128, 192)])
def test_idle_warpgroups_with_one_q_buffer(schedule, head_dim, block_n):
    """Without a second Q buffer (no room at these tiles) a busy warpgroup flushes each tile's last P V in
    a turn of its own, and an idle one must take that turn too: with pingpong, a missing turn leaves the
    last hand-over unmatched and the kernel hangs at exit."""
    if this_target().cc != 90:
        pytest.skip("fwd_sm90 runs on sm_90a only")
    for Sq, Sk in [(65, 65), (1, 200), (128 + 40, 300)]:
        spec = AttentionSpec(head_dim=head_dim, dtype="bf16", mask="causal", family="fwd_sm90",
                             config={"block_n": block_n, "pingpong": True, "schedule": schedule})
        q, k, v = make_inputs(spec, B=2, Sq=Sq, Sk=Sk, Hkv=3, seed=Sq)
        for _ in range(2):
            run_and_check(spec, q, k, v)


@pytest.mark.parametrize("head_dim,dtype,block_n,overlap,stages", [
    (128, "bf16", 160, True, 2), (96, "fp16", 128, True, 2), (256, "bf16", 80, True, 2), (128, "fp16", 128, False, 2),
    (128, "bf16", 128, True, 3)])
@pytest.mark.parametrize("extras", [{}, {"score_mod": "softcap(30)", "sink": "sinks[h]"}])
def test_clusters_of_two_ctas(head_dim, dtype, block_n, overlap, stages, extras):
    """fwd_sm90 with each pair's two tiles on a cluster of two CTAs, every K/V block multicast half from
    each: fewer tiles than SMs and several rounds of them, a phantom block (an odd count of query blocks:
    its CTA loads its half and idles), Sq != Sk both ways, GQA; two calls in a row."""
    if this_target().cc != 90:
        pytest.skip("fwd_sm90 runs on sm_90a only")
    spec = AttentionSpec(head_dim=head_dim, dtype=dtype, mask="none", gqa_ratio=2, family="fwd_sm90", **extras,
                         config={"block_n": block_n, "overlap": overlap, "num_stages": stages, "schedule": "pairs",
                                 "cluster": True})
    kernel = attngen.compile(spec)
    assert kernel.plan.cluster
    inputs = None
    if extras:
        import torch

        inputs = {"sinks": torch.linspace(-2.0, 3.0, 6, device="cuda")}
    for B, Sq, Sk in [(1, 1, 300), (2, 130, 1000), (1, 3 * 128 + 5, 77), (3, 2100, 2100), (1, 4097, 5000)]:
        q, k, v = make_inputs(spec, B=B, Sq=Sq, Sk=Sk, Hkv=3, seed=Sq + Sk)
        for _ in range(2):
            run_and_check(spec, q, k, v, inputs=inputs)
