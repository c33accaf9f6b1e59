"""Fused dropout without a GPU: the host Philox against Random123's known answers, the keep mapping
(docs/dropout.md) and its statistics, the spec field (validation, names, keys), what the templates
render with and without dropout, families refusing what they cannot do, the kernel argument and the
checks of the rng tensor, the front door's errors, and nvcc builds of every family with dropout for
sm_80 and sm_90a without spills."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attngen
from attngen import dropout, families, philox, reference, targets
from attngen.build import nvcc
from attngen.errors import SpecError
from attngen.families import get_family, plan_spec
from attngen.families.base import ForwardCall
from attngen.runtime import checks
from attngen.runtime.tensors import TensorInfo
from attngen.spec import AttentionSpec

H100 = targets.target("sm_90a")
A100 = targets.target("sm_80")

# Random123's tests/kat_vectors, the three philox4x32 10 lines (github.com/DEShawResearch/random123,
# commit 9545ff6): counter (4 words), key (2 words) -> output (4 words).
KATS = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def info(name, shape, dtype="bfloat16", ptr=1 << 20, device=0):
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorInfo(name, "torch", ptr, tuple(shape), strides, dtype, device)


# -- Philox and the mapping ----------------------------------------------------------------------
@pytest.mark.parametrize("counter, key, expected", KATS)
def test_philox_matches_random123s_known_answers(counter, key, expected):
    assert tuple(int(x) for x in philox.philox4x32(counter, key)) == expected


def test_philox_is_vectorised_over_counters():
    c0 = np.array([0, 0xFFFFFFFF, 0x243F6A88], dtype=np.uint64)
    words = philox.philox4x32((c0, [0, 0xFFFFFFFF, 0x85A308D3], [0, 0xFFFFFFFF, 0x13198A2E],
                               [0, 0xFFFFFFFF, 0x03707344]), ([0, 0xFFFFFFFF, 0xA4093822], [0, 0xFFFFFFFF, 0x299F31D0]))
    assert [tuple(int(w[i]) for w in words) for i in range(3)] == [kat[2] for kat in KATS]


def test_an_elements_draw_is_its_byte_of_its_groups_call():
    """docs/dropout.md's mapping, spelled out for one element: (b, h, i, j) = (3, 5, 77, 45)."""
    seed, offset = 0x0123456789ABCDEF, 0x1_0000_0007  # the offset's low 32 bits count
    b, h, i, j = 3, 5, 77, 45
    counter = ((j >> 5) * 8 + (j & 7), (i >> 5) * 8 + (i & 7), b * 65536 + h, 7)
    words = philox.philox4x32(counter, (seed & 0xFFFFFFFF, seed >> 32))
    want = (int(words[(i >> 3) & 3]) >> (8 * ((j >> 3) & 3))) & 0xFF
    assert int(philox.draws(seed, offset, b, h, i, j)) == want
    # The 16 elements of that group: rows i' = i (mod 8), keys j' = j (mod 8) of the same 32 x 32 span.
    rows, cols = np.arange(64, 96)[:, None], np.arange(32, 64)[None, :]
    same = (rows % 8 == i % 8) & (cols % 8 == j % 8)
    group = philox.draws(seed, offset, b, h, rows, cols)[same]
    assert sorted(group.tolist()) == sorted((int(w) >> s) & 0xFF for w in words for s in (0, 8, 16, 24))


def test_the_gathered_mask_is_the_per_element_mapping():
    mask = philox.keep_mask(99, 3, 2, 3, 70, 101, 100, batch_offset=1)
    b, h = np.arange(1, 3)[:, None, None, None], np.arange(3)[None, :, None, None]
    i, j = np.arange(70)[None, None, :, None], np.arange(101)[None, None, None, :]
    np.testing.assert_array_equal(mask, philox.draws(99, 3, b, h, i, j) < 100)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_keep_rate_is_the_realised_p_within_a_binomial_bound(p):
    """Over 2 x 4 x 512 x 512 elements, overall and for every position of the 32 x 32 span (the
    group's word and byte), the kept fraction is 1 - p' within 5 standard deviations."""
    keep = philox.keep_mask(2024, 0, 2, 4, 512, 512, dropout.threshold(p))
    rate = 1 - dropout.realised(p)
    for part in (keep, *(keep[:, :, a::32, c::32] for a in range(0, 32, 8) for c in range(0, 32, 8))):
        sigma = math.sqrt(rate * (1 - rate) / part.size)
        assert abs(part.mean() - rate) < 5 * sigma, (p, part.shape, part.mean(), rate)


def _grid_draws(seed, offset, B=2, H=4, S=256):
    b, h = np.arange(B)[:, None, None, None], np.arange(H)[None, :, None, None]
    i, j = np.arange(S)[None, None, :, None], np.arange(S)[None, None, None, :]
    return philox.draws(seed, offset, b, h, i, j).astype(float)


def test_neighbouring_elements_and_other_seeds_offsets_and_heads_are_uncorrelated():
    draws = _grid_draws(7, 0)
    pairs = {
        "next key": (draws[..., :-1], draws[..., 1:]), "next row": (draws[:, :, :-1], draws[:, :, 1:]),
        "next group row": (draws[:, :, :-8], draws[:, :, 8:]), "next head": (draws[:, :-1], draws[:, 1:]),
        "next batch": (draws[:-1], draws[1:]), "seed + 1": (draws, _grid_draws(8, 0)),
        "offset + 1": (draws, _grid_draws(7, 1)), "offset + 2**32": (draws, _grid_draws(7, 2**32 + 5)),
    }
    for name, (x, y) in pairs.items():
        r = np.corrcoef(x.ravel(), y.ravel())[0, 1]
        assert abs(r) < 5 / math.sqrt(x.size), (name, r)


# -- the spec field ----------------------------------------------------------------------------------
def test_threshold_realised_p_and_scale():
    assert dropout.threshold(0.1) == 230 and dropout.realised(0.1) == 1 - 230 / 256
    assert dropout.keep_scale(0.1) == 256 / 230 and dropout.keep_scale(0.0) == 1.0
    assert dropout.threshold(0.5) == 128 and dropout.threshold(dropout.P_MAX) == 1
    assert dropout.threshold(0.0021) == 255


@pytest.mark.parametrize("value, match", [
    (-0.1, r"dropout_p=-0.1 is invalid; allowed: 0 \(no dropout\) or a float in \(0.001953125, 0.998046875\]"),
    (1.0, "dropout_p=1.0 is invalid"),
    (0.999, "dropout_p=0.999 is invalid"),
    (0.001, "dropout_p=0.001 is invalid"),  # rounds to keeping every element
    (float("nan"), "dropout_p=nan is invalid"),
    (True, r"dropout_p=True is invalid \(a bool, must be a number\)"),
    ("0.1", r"dropout_p='0.1' is invalid \(a str, must be a number\)"),
])
def test_bad_dropout_p_is_named_with_what_is_allowed(value, match):
    with pytest.raises(SpecError, match=match) as exc:
        AttentionSpec(head_dim=64, dropout_p=value)
    assert exc.value.field == "dropout_p"


def test_a_spec_file_with_a_bad_dropout_p_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "drop.yaml"
    path.write_text("head_dim: 64\ndropout_p: 1.5\nmask: causal\n")
    with pytest.raises(SpecError, match=r"drop.yaml: dropout_p=1.5 is invalid; allowed: 0"):
        attngen.load_spec(path)
    path.write_text("head_dim: 64\ndropout_p: 0.1\nmask: causal\n")
    assert attngen.load_spec(path).dropout_p == 0.1


def test_p_zero_keeps_every_identity_and_p_names_the_kernel():
    plain, zero = AttentionSpec(head_dim=128, mask="causal"), AttentionSpec(head_dim=128, mask="causal", dropout_p=0)
    assert zero == plain and zero.key() == plain.key() and zero.name == plain.name
    assert zero.problem.key() == plain.problem.key() and "dropout_p" not in zero.to_dict()
    with_p = AttentionSpec(head_dim=128, mask="causal", dropout_p=0.1)
    assert "_drop0p1_" in with_p.name and with_p.to_dict()["dropout_p"] == 0.1
    assert AttentionSpec.from_key(with_p.key()) == with_p and with_p.name != plain.name
    assert AttentionSpec(head_dim=128, mask="causal", dropout_p=0.25).name.count("drop0p25") == 1


# -- families and rendering -----------------------------------------------------------------------------
def _render(spec, target=H100):
    plan = plan_spec(spec, target)
    return plan, get_family(plan.family).render(plan)


@pytest.mark.parametrize("family", ["fwd_sm80", "fwd_sm90", "bwd_sm80"])
def test_p_zero_renders_no_dropout_and_p_renders_the_philox(family):
    plan, source = _render(AttentionSpec(head_dim=128, mask="causal", family=family))
    assert "ATTNGEN_DROPOUT 1" not in source and "namespace dropout {" not in source \
        and "rng" not in plan.kernels[0].abi.offsets
    plan, source = _render(AttentionSpec(head_dim=128, mask="causal", family=family, dropout_p=0.1))
    assert "#define ATTNGEN_DROPOUT 1" in source and "namespace dropout {" in source
    assert "constexpr u32 DROPOUT_THRESHOLD = 230;" in source and "0x9E3779B9u" in source
    assert "const i64* rng;" in source and plan.kernels[0].abi.params[-1].name == "rng"


def test_the_decode_family_refuses_dropout():
    spec = AttentionSpec(head_dim=128, mask="causal", dropout_p=0.1)
    reason = families.DECODE_FAMILIES["decode_sm80"].supports(spec.problem, H100)
    assert "dropout_p=0.1 is for training" in reason
    with pytest.raises(SpecError, match="no decode kernel family can run"):
        families.select(spec.problem, H100, None, "decode")


def test_fwd_sm90_with_dropout_keeps_to_two_consumer_warpgroups():
    fam = get_family("fwd_sm90")
    spec = AttentionSpec(head_dim=64, mask="causal", dropout_p=0.1)
    assert fam.default_config(spec.problem, H100).consumers == 2
    assert fam.default_config(AttentionSpec(head_dim=64, mask="causal").problem, H100).consumers == 3
    assert {c.consumers for c in fam.configs(spec.problem, H100)} == {1, 2}
    config = fam.resolve_config(spec.problem, H100, {"consumers": 3})
    with pytest.raises(SpecError, match="allowed with dropout_p > 0: consumers <= 2"):
        fam.plan(spec.problem, H100, config)


def test_the_rng_pointer_is_packed_last_from_the_call():
    spec = AttentionSpec(head_dim=64, mask="causal", dropout_p=0.1, family="fwd_sm80")
    plan = plan_spec(spec, H100)
    q = info("q", (2, 100, 4, 64))
    call = ForwardCall(q, info("k", q.shape), info("v", q.shape), info("out", q.shape),
                       info("lse", (2, 4, 100), "float32"), 0.125, rng=info("rng", (2,), "int64", ptr=0xABCDEF00))
    abi = plan.kernels[0].abi
    packed = abi.pack(call)
    assert int.from_bytes(packed[abi.offsets["rng"]:abi.offsets["rng"] + 8], "little") == 0xABCDEF00


def test_the_rng_tensor_is_checked_before_any_launch():
    problem = AttentionSpec(head_dim=64, dropout_p=0.1).problem
    q, k = info("q", (2, 10, 4, 64)), info("k", (2, 10, 4, 64))
    out, lse = info("out", q.shape), info("lse", (2, 4, 10), "float32")
    for rng, match in [
        (None, r"the spec's dropout_p=0.1 needs rng: an int64 tensor \[seed, offset\] of shape \(2,\)"),
        (info("rng", (2,), "int32"), r"rng has dtype int32 and shape \(2,\); allowed: int64 of shape \(2,\)"),
        (info("rng", (3,), "int64"), r"rng has dtype int64 and shape \(3,\)"),
        (info("rng", (2,), "int64", device=1), "rng is on cuda:1; allowed: q's device cuda:0"),
        (info("rng", (2,), "int64", ptr=(1 << 20) + 4), "allowed: contiguous and 8-byte aligned"),
    ]:
        with pytest.raises(ValueError, match=match):
            checks.forward_call(problem, q, k, k, out, lse, None, {}, rng)
    with pytest.raises(ValueError, match="rng is given, but the spec's dropout_p is 0"):
        checks.forward_call(AttentionSpec(head_dim=64).problem, q, k, k, out, lse, None, {}, info("rng", (2,), "int64"))
    assert checks.forward_call(problem, q, k, k, out, lse, None, {}, info("rng", (2,), "int64")).rng.ptr == 1 << 20


# -- the front door ------------------------------------------------------------------------------------
def test_front_door_dropout_errors_name_the_argument():
    q = torch.randn(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"dropout_p=1.5 is invalid; allowed: 0 \(no dropout\)"):
        attngen.attention(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match=r"dropout_seed=-1 is invalid; allowed: None .*an int in \[0, 2\*\*64\)"):
        attngen.attention(q, q, q, dropout_p=0.1, dropout_seed=-1)
    with pytest.raises(ValueError, match=r"dropout_seed='7' is invalid"):
        attngen.attention(q, q, q, dropout_p=0.1, dropout_seed="7")
    spec = AttentionSpec(head_dim=64, dropout_p=0.25)
    with pytest.raises(ValueError, match=r"dropout_p=0.1 conflicts with the spec's dropout_p=0.25; allowed: 0"):
        attngen.attention(q, q, q, spec, dropout_p=0.1)


def test_the_front_doors_spec_key_spells_dropout_as_the_spec_does():
    from attngen.api import _spec_key

    q = torch.empty(1, 4, 8, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 4, 2, 128, dtype=torch.bfloat16, device="meta")
    for p in (0.0, 0.1, 0.5):
        expected = AttentionSpec(head_dim=128, gqa_ratio=4, mask="causal", score_mod="softcap(30.0)", dropout_p=p)
        assert _spec_key(q, k, None, "causal", "softcap(30.0)", None, p) == expected.key()


# -- the reference --------------------------------------------------------------------------------------
def test_the_reference_drops_the_mapped_elements_and_keeps_the_lse():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 37, 4, 64, generator=g, dtype=torch.float64) for _ in range(3))
    _, lse0 = reference.attention(q, k, v, mask="causal", return_lse=True)
    out, lse = reference.attention(q, k, v, mask="causal", return_lse=True, dropout_p=0.3, dropout_seed=5,
                                   dropout_offset=9)
    assert torch.equal(lse, lse0)
    keep = reference.dropout_mask(0.3, 5, 9, 2, 4, 37, 37)
    probs = torch.softmax((torch.einsum("bqhd,bkhd->bhqk", q, k) / 8).masked_fill(
        torch.ones(37, 37, dtype=torch.bool).triu(1), -math.inf), -1)
    want = torch.einsum("bhqk,bkhd->bqhd", probs * keep * dropout.keep_scale(0.3), v)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reference.attention(q, k, v, dropout_p=0.0, dropout_seed=5), reference.attention(q, k, v))
    with pytest.raises(ValueError, match="dropout_p=2 is invalid"):
        reference.attention(q, k, v, dropout_p=2)
    with pytest.raises(ValueError, match=r"dropout_seed=-1e\+20 is invalid|dropout_seed=1e\+20 is invalid"):
        reference.dropout_mask(0.1, 1e20, 0, 1, 1, 1, 1)


# -- nvcc: every family with dropout, no spills --------------------------------------------------------
NVCC_CASES = [
    ("fwd_sm80", "sm_80", AttentionSpec(head_dim=128, mask="causal", dropout_p=0.1), {}),
    ("fwd_sm80", "sm_90a", AttentionSpec(head_dim=64, dtype="fp16", dropout_p=0.1), {}),
    ("fwd_sm80", "sm_90a", AttentionSpec(head_dim=96, gqa_ratio=4, mask="causal", dropout_p=0.2), {}),
    ("fwd_sm80", "sm_90a", AttentionSpec(head_dim=256, mask="causal", dropout_p=0.1), {}),
    ("fwd_sm80", "sm_90a", AttentionSpec(head_dim=128, mask="causal", dropout_p=0.1), {"block_m": 64, "block_n": 16}),
    ("fwd_sm80", "sm_80", AttentionSpec(head_dim=128, mask="doc[b, q_idx] == doc[b, kv_idx] and causal",
                                        score_mod="softcap(30.0)", dropout_p=0.1), {}),
    ("fwd_sm90", "sm_90a", AttentionSpec(head_dim=128, mask="causal", dropout_p=0.1), {}),
    ("fwd_sm90", "sm_90a", AttentionSpec(head_dim=64, dropout_p=0.1), {}),
    ("fwd_sm90", "sm_90a", AttentionSpec(head_dim=256, mask="causal", dropout_p=0.1), {}),
    ("fwd_sm90", "sm_90a", AttentionSpec(head_dim=128, dropout_p=0.1), {"block_n": 80}),
    ("fwd_sm90", "sm_90a", AttentionSpec(head_dim=64, mask="sliding_window(127, 0)", sink="sinks[h]",
                                         dropout_p=0.1), {}),
    ("bwd_sm80", "sm_80", AttentionSpec(head_dim=64, mask="causal", dropout_p=0.1), {}),
    ("bwd_sm80", "sm_90a", AttentionSpec(head_dim=128, mask="causal", dropout_p=0.1), {}),
    ("bwd_sm80", "sm_90a", AttentionSpec(head_dim=96, gqa_ratio=4, dropout_p=0.5), {}),
    ("bwd_sm80", "sm_90a", AttentionSpec(head_dim=64, dropout_p=0.1), {"block_m": 16, "block_n": 32, "num_warps": 2}),
    ("bwd_sm80", "sm_80", AttentionSpec(head_dim=128, mask="doc[b, q_idx] == doc[b, kv_idx] and causal",
                                        score_mod="softcap(30.0)", dropout_p=0.1), {}),
]


@pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("family, arch, spec, config", NVCC_CASES,
                         ids=[f"{f}-{a}-{s.problem.label()}-{i}" for i, (f, a, s, _) in enumerate(NVCC_CASES)])
def test_dropout_kernels_compile_without_spills(family, arch, spec, config):
    target = targets.target(arch)
    fam = get_family(family)
    plan = fam.plan(spec.problem, target, fam.resolve_config(spec.problem, target, config))
    report = nvcc.check_plan(plan)
    for name, kernel in (report.kernels or {plan.name: report}).items():
        assert kernel.spill_bytes == 0 and kernel.stack_frame_bytes == 0, (name, report.log)


def test_tune_and_fuzz_refuse_specs_with_dropout(tmp_path):
    """Both verify against the reference without dropout: a spec with dropout is named, not mis-tested."""
    from attngen.fuzz.command import _spec_pool
    from attngen.tune.search import TuneError, check_no_dropout

    spec = AttentionSpec(head_dim=64, mask="causal", dropout_p=0.1)
    with pytest.raises(TuneError, match="dropout_p=0.1: the tuner verifies its winner against the reference"):
        check_no_dropout(spec)
    check_no_dropout(spec.replace(dropout_p=0.0))
    path = tmp_path / "drop.yaml"
    path.write_text("head_dim: 64\nmask: causal\ndropout_p: 0.1\n")
    with pytest.raises(SpecError, match=r"drop.yaml: dropout_p=0.1: the fuzzer compares kernels with the reference"):
        _spec_pool([path], False, 0, 0, H100)
