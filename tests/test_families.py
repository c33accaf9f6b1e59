"""Every kernel family keeps the protocol (attngen/families/base.py); the Hopper family's binary
holds the instructions it is written for. No GPU needed."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import sass_waits

from attngen import targets
from attngen.build import nvcc
from attngen.errors import SpecError
from attngen.families import FAMILIES, get_family, plan_spec, supporting
from attngen.spec import AttentionSpec
from attngen.tune.model import Shape, gpu_model

H100 = targets.target("sm_90")
FAMILY_NAMES = list(FAMILIES)


def _home(family):
    """A target the family runs on."""
    return next(targets.target(a) for a in ("sm_90", "sm_80")
                if family.supports(AttentionSpec(head_dim=128).problem, targets.target(a)) is None)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_default_config_is_in_the_space_and_plans(name):
    family = get_family(name)
    target = _home(family)
    for d in (64, 96, 128, 256):
        for mask in ("none", "causal"):
            problem = AttentionSpec(head_dim=d, mask=mask).problem
            default = family.default_config(problem, target)
            assert default in family.configs(problem, target)
            plan = family.plan(problem, target, default)
            assert plan.family == name and plan.config == default and plan.target == target
            assert plan.kernels and all(k.smem_bytes <= target.smem_per_block for k in plan.kernels)
            assert type(default).from_label(default.label()) == default


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_pinned_fields_narrow_the_space_and_survive_resolution(name):
    family = get_family(name)
    target = _home(family)
    problem = AttentionSpec(head_dim=128, mask="causal").problem
    default = family.default_config(problem, target)
    field, value = next(iter(dataclasses.asdict(default).items()))
    space = family.configs(problem, target, {field: value})
    assert space and all(getattr(c, field) == value for c in space)
    assert len(space) < len(family.configs(problem, target))
    assert getattr(family.resolve_config(problem, target, {field: value}), field) == value


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_check_config_names_field_value_and_allowed(name):
    family = get_family(name)
    assert family.check_config({}) == []
    (problem,) = family.check_config({"no_such_field": 1})
    assert "no_such_field" in problem and "allowed" in problem
    field, allowed = next(iter(family.config_fields.items()))
    bad = "x" if not isinstance(allowed[0], str) else 12345
    (problem,) = family.check_config({field: bad})
    assert f"config.{field}={bad!r} is invalid; allowed:" in problem


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_names_are_unique_and_renders_deterministic(name):
    family = get_family(name)
    target = _home(family)
    problem = AttentionSpec(head_dim=64).problem
    plans = []
    for config in family.configs(problem, target)[:40]:
        try:
            plans.append(family.plan(problem, target, config))
        except SpecError:
            continue
    assert len({p.name for p in plans}) == len(plans) > 1
    assert family.render(plans[0]) == family.render(plans[0])
    assert plans[0].name in family.render(plans[0])


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_estimate_ranks_a_plan(name):
    family = get_family(name)
    target = _home(family)
    plan = plan_spec(AttentionSpec(head_dim=128, mask="causal", family=name), target)
    report = nvcc.ResourceReport(plan.name, target.name, registers=168, smem_static_bytes=0, stack_frame_bytes=0,
                                 spill_store_bytes=0, spill_load_bytes=0, smem_dynamic_bytes=plan.kernels[0].smem_bytes)
    est = family.estimate(plan, report, gpu_model(target), Shape(batch=2, seqlen_q=4096, seqlen_k=4096, heads_q=16))
    assert 0 < est.ms < 1e3 and est.ctas >= 1


def test_preference_order_puts_the_hopper_family_first_on_h100():
    problem = AttentionSpec(head_dim=128).problem
    assert [f.name for f in supporting(problem, H100)] == ["fwd_sm90", "fwd_sm80"]


def test_sm90_kernel_headers_are_pasted_whole_and_in_order():
    """The kernel is split into headers of one job each (family.py KERNEL_HEADERS); the template pastes
    every one, in that order, one after another: what bench/sm90_versions.py swaps for another version."""
    from attngen.codegen.render import template_files
    from attngen.families.fwd_sm90 import family as sm90

    family = get_family("fwd_sm90")
    named = [name for name in template_files(sm90.FOLDER, "fwd_sm90.cu.j2") if name in sm90.KERNEL_HEADERS]
    assert named == list(sm90.KERNEL_HEADERS)
    assert sorted(p.name for p in sm90.FOLDER.glob("*.cuh")) == sorted(sm90.KERNEL_HEADERS)  # (varlen's: attngen/cuda)
    spec = AttentionSpec(head_dim=128, mask="causal", family="fwd_sm90")
    source = family.render(family.plan(spec.problem, H100, family.default_config(spec.problem, H100)))
    assert "\n".join((sm90.FOLDER / name).read_text() for name in sm90.KERNEL_HEADERS) in source


def test_sm90_config_rules():
    family = get_family("fwd_sm90")
    assert "pingpong=True is invalid with consumers=1" in family.check_config({"pingpong": True, "consumers": 1})[0]
    with pytest.raises(SpecError, match="needs .* shared memory"):
        AttentionSpec(head_dim=256, family="fwd_sm90", config={"block_n": 192, "num_stages": 4}).name
    # Three consumer warpgroups (160 registers) cannot hold d256's O beside S and P: out of the tuner's
    # space there, and refused by name when pinned; d128 keeps them.
    d256, d128 = (AttentionSpec(head_dim=d, mask="none").problem for d in (256, 128))
    assert {c.consumers for c in family.configs(d256, H100)} == {1, 2}
    assert 3 in {c.consumers for c in family.configs(d128, H100)}
    with pytest.raises(SpecError, match="allowed at head_dim > 128: consumers <= 2"):
        family.plan(d256, H100, family.resolve_config(d256, H100, {"consumers": 3, "block_n": 64}))


def test_sm90_schedules_labels_and_defaults():
    from attngen.families.fwd_sm90.family import Sm90Config

    for label, schedule in (("m128n128s2op", "grid"), ("m128n176s2opr", "pairs"), ("m192n128s2opd", "dynamic")):
        config = Sm90Config.from_label(label)
        assert config.schedule == schedule and config.label() == label
    with pytest.raises(ValueError, match="not a fwd_sm90 config label"):
        Sm90Config.from_label("m128n128s2opx")
    family = get_family("fwd_sm90")
    default = lambda **kw: family.default_config(AttentionSpec(**kw).problem, H100).label()  # noqa: E731
    assert default(head_dim=128, mask="causal") == "m128n128s2opr"
    assert default(head_dim=128, mask="causal", gqa_ratio=4) == "m128n128s2opd"  # the table's causal_gqa row
    assert default(head_dim=128, mask="none", gqa_ratio=4) == "m128n160s2oprc"  # no none_gqa row: none's
    # A cluster default falls back where clusters cannot run: dropout, a one-SM target.
    assert default(head_dim=128, mask="none", dropout_p=0.1) == "m128n160s2opr"
    one_sm = dataclasses.replace(H100, sms=1)
    assert family.default_config(AttentionSpec(head_dim=128, mask="none").problem, one_sm).label() == "m128n160s2opr"
    assert default(head_dim=64, mask="causal") == "m192n128s2opd"
    # a window (a closed form) takes causal's config where it is on the counter, as at d64; an expression without
    # one, or with a sink, the expressions' tile
    assert default(head_dim=64, mask="sliding_window(127, 0)") == "m192n128s2opd"
    assert default(head_dim=64, mask="sliding_window(127, 0)", sink="sinks[h]") == "m128n128s2opd"
    assert default(head_dim=64, mask="kv_idx % 3 != 1") == "m128n128s2opd"
    assert default(head_dim=256, mask="sliding_window(127, 0)") == "m128n80s2o"
    # A pinned block size keeps the default's cluster where its accumulators fit the cluster's registers;
    # 192 keys at d128 would spill there, so that pin runs the plain pairs schedule, unless clusters are pinned.
    none128 = AttentionSpec(head_dim=128, mask="none").problem
    resolve = lambda **pins: family.resolve_config(none128, H100, pins).label()  # noqa: E731
    assert resolve(block_n=128) == "m128n128s2oprc" and resolve(block_n=176) == "m128n176s2oprc"
    assert resolve(block_n=192) == "m128n192s2opr" and resolve(block_n=192, cluster=True) == "m128n192s2oprc"


def _tensor(name, shape, dtype="bfloat16"):
    from attngen.runtime.tensors import TensorInfo

    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorInfo(name, "torch", 1 << 20, shape, strides, dtype, 0)


def _sm90_call(head_dim, B, S, H, Hkv, workspace=0, inputs=()):
    from attngen.families.base import ForwardCall

    return ForwardCall(_tensor("q", (B, S, H, head_dim)), _tensor("k", (B, S, Hkv, head_dim)),
                       _tensor("v", (B, S, Hkv, head_dim)), _tensor("out", (B, S, H, head_dim)),
                       _tensor("lse", (B, H, S), "float32"), 0.1, workspace=workspace, inputs=inputs)


def test_sm90_q_buffers_as_many_as_fit():
    # Three Q tiles where they fit beside the K/V ring and the kernel's static shared memory (the
    # next tile's Q loads while an epilogue still holds its own buffer: CARRY needs two or more).
    from attngen.families.fwd_sm90 import family as sm90

    def plan(d, label):
        config = sm90.Sm90Config.from_label(label).to_dict()
        return plan_spec(AttentionSpec(head_dim=d, family="fwd_sm90", config=config), H100)

    for d, label, buffers in ((128, "m128n128s2opr", 3), (128, "m128n160s2opr", 2), (128, "m128n176s2opr", 1),
                              (64, "m192n128s2opd", 3), (256, "m128n80s2o", 1)):
        p = plan(d, label)
        assert p.q_buffers == buffers, (d, label, p.q_buffers)
        assert p.smem_bytes == sm90.smem_bytes(p.config, d, buffers)
        assert p.smem_bytes + sm90.STATIC_SMEM_BYTES <= H100.smem_per_block
        assert f"constexpr int Q_BUFFERS = {buffers};" in get_family("fwd_sm90").render(p)
        if buffers < sm90.Q_BUFFERS_MAX:  # one more would not fit
            assert sm90.smem_bytes(p.config, d, buffers + 1) + sm90.STATIC_SMEM_BYTES > H100.smem_per_block


def test_sm90_short_sequences_take_their_own_defaults(monkeypatch):
    # Calls of at most SHORT_SEQLEN tokens (the front door's length bucket) take tile_defaults.yaml's
    # <kind>_short rows without GQA: 128-row tiles on pairs at d64 causal, 128-key blocks on pairs at d128
    # without a mask (docs/perf-notes.md "Short sequences"); longer calls, GQA and kinds without a row keep theirs.
    from types import SimpleNamespace

    from attngen.families.fwd_sm90 import family as sm90
    from attngen.runtime import dispatch
    from attngen.tune import lookup

    family = get_family("fwd_sm90")

    def label(d, mask, seqlen, gqa=1, **pinned):
        problem = AttentionSpec(head_dim=d, mask=mask, gqa_ratio=gqa).problem
        return family.resolve_config(problem, H100, pinned, seqlen).label()

    assert sm90.SHORT_SEQLEN == 1024
    for seqlen in (1, 512, 1024):
        assert label(64, "causal", seqlen) == "m128n128s2opr"
        assert label(128, "none", seqlen) == "m128n128s2opr"
        # A partly pinned config fills in from the length-free default: whether it plans never depends on the length.
        assert label(128, "none", seqlen, block_n=64) == label(128, "none", None, block_n=64) == "m128n64s2oprc"
    for seqlen in (2048, 16384, None):
        assert label(64, "causal", seqlen) == "m192n128s2opd" and label(128, "none", seqlen) == "m128n160s2oprc"
    assert label(64, "causal", 512, gqa=4) == "m192n128s2opd"  # measured without GQA only
    assert label(128, "causal", 512) == label(128, "causal", None) == "m128n128s2opr"  # no row: the long one wins there
    assert label(64, "none", 512) == "m192n128s2opd"
    # A causal-shaped band takes causal's config for the call's length (pairs when short at d64), another
    # causal-shaped expression causal's schedule on the expressions' tile.
    assert label(64, "q_idx >= kv_idx", 512) == "m128n128s2opr" and label(64, "q_idx >= kv_idx", 4096) == "m192n128s2opd"
    assert label(64, "prefix_lm(16)", 4096) == "m192n128s2opd"  # a band too: prefixes have closed forms
    shaped = "kv_idx <= q_idx or kv_idx < 16 and kv_idx % 2 == 0"  # causal-shaped, no closed form
    assert label(64, shaped, 512) == "m128n128s2opr" and label(64, shaped, 4096) == "m128n128s2opd"

    # The front door asks for the bucket of max(Sq, Sk): 1,000 and 1,024 tokens are short, 1,025 is not.
    monkeypatch.setattr(dispatch.targets, "device_target", lambda device: H100)
    monkeypatch.setattr(dispatch, "kernel_for", lambda plan, device: plan)
    monkeypatch.setattr(lookup, "recent_stamp", lambda: None)  # no tuning database
    dispatch.forget()
    spec = AttentionSpec(head_dim=64, mask="causal")
    for (sq, sk), expected in (((1000, 1000), "m128n128s2opr"), ((1024, 1024), "m128n128s2opr"),
                               ((1025, 1025), "m192n128s2opd"), ((1, 2048), "m192n128s2opd")):
        q = SimpleNamespace(shape=(8, sq, 16, 64), device=0)
        k = SimpleNamespace(shape=(8, sk, 16, 64), device=0)
        assert dispatch.resolve(spec, q, k).config.label() == expected, (sq, sk)
    dispatch.forget()
    # attngen.compile(spec, seqlen=n): the kernel of the front door's defaults for calls of n tokens.
    assert dispatch.compile(spec, 0, seqlen=1000).config.label() == "m128n128s2opr"
    assert dispatch.compile(spec, 0, seqlen=1025).config.label() == dispatch.compile(spec, 0).config.label() \
        == "m192n128s2opd"


def test_sm90_dynamic_schedule_launches(monkeypatch):
    """A dynamic schedule zeroes its counter (in the workspace, after any mask table) in a launch
    before the kernel's, sizes its grid to the SMs and its sections to the K/V that fit in L2."""
    from attngen import mask_table
    from attngen.families.fwd_sm90 import family as sm90

    monkeypatch.setattr(sm90.tma, "encode", lambda *a, **k: bytes(128))  # no driver on the CPU
    family = get_family("fwd_sm90")
    h100 = dataclasses.replace(H100, sms=132)
    for mask, gqa in (("causal", 4), ("doc[b, q_idx] == doc[b, kv_idx] and causal", 1)):
        spec = AttentionSpec(head_dim=128, mask=mask, gqa_ratio=gqa, family="fwd_sm90", config={"schedule": "dynamic"})
        plan = plan_spec(spec, h100)
        inputs = (("doc", _tensor("doc", (2, 8192), "int32")),) if "doc" in mask else ()
        call = _sm90_call(128, 2, 8192, 8 * gqa, 8, workspace=1 << 30, inputs=inputs)
        reset, main = family.launches(plan, call)[-2:]
        assert reset.kernel == f"{plan.name}_reset" and main.kernel == plan.name and reset.params == main.params
        assert main.early and not reset.early  # the kernel starts under the reset (a programmatic dependent launch)
        assert main.grid == (132, 1, 1)  # 64 query blocks x 16 or 64 (batch, head) pairs: more tiles than SMs
        table_bytes = mask_table.workspace_bytes(plan.mask_table, call, plan.block_m)
        assert (plan.mask_table is not None) == ("doc" in mask) and family.workspace_bytes(plan, call) >= table_bytes + 4
        # With a block table the reset also ranks each table row's query blocks (one CTA per row: the ids
        # are per batch entry), into the workspace after the counter, which the kernel's argument points at.
        assert plan.tile_order == ("doc" in mask)
        if plan.tile_order:
            rows = mask_table.table_rows(plan.mask_table, call)
            assert rows == 2 and reset.grid == (rows, -(-64 // sm90.ORDER_THREADS), 1)
            assert reset.block == (sm90.ORDER_THREADS, 1, 1)
            at = sm90.tile_order_offset(plan, call)
            assert at >= table_bytes + 4 and family.workspace_bytes(plan, call) == at + 4 * rows * 64
            args = plan.kernels[0].abi.params
            assert [p.name for p in args][-1] == "tile_order" and "#define ATTNGEN_TILE_ORDER 1" in family.render(plan)
        else:
            assert reset.grid == (1, 1, 1) and "ATTNGEN_TILE_ORDER 1" not in family.render(plan)
        kv_bytes = 2 * 8192 * 128 * 2
        assert sm90.section_heads(call, gqa, 2) == (sm90.L2_SECTION_BYTES // kv_bytes) * gqa
        # The launch's sections: L2's; over a block table (its tiles' lengths follow no pattern) enough (batch,
        # head) pairs for SECTION_WAVES waves of 64-tile heads where L2's are fewer (9 pairs where L2 holds 6).
        at = plan.kernels[0].abi.offsets["section_heads"]
        assert int.from_bytes(main.params[at:at + 4], "little") == (9 if plan.tile_order else 24)
    plan = plan_spec(AttentionSpec(head_dim=128, family="fwd_sm90", config={"schedule": "dynamic"}), h100)
    assert family.launches(plan, _sm90_call(128, 1, 128, 2, 2))[-1].grid == (2, 1, 1)  # fewer tiles than SMs
    # Without a set-up kernel of its own before it, the kernel is launched the ordinary way.
    for label in ("m128n160s2opr", "m128n160s2oprc", "m128n128s2op"):
        plan = plan_spec(AttentionSpec(head_dim=128, family="fwd_sm90",
                                       config=sm90.Sm90Config.from_label(label).to_dict()), h100)
        assert [launch.early for launch in family.launches(plan, _sm90_call(128, 2, 8192, 8, 8))] == [False]


def test_sm90_clusters_of_two_ctas_where_a_pair_shares_its_key_blocks(monkeypatch):
    """Config letter c: a pair's two tiles on a cluster of two CTAs sharing each K/V load. Only the pairs
    schedule without a mask (score modifiers and sinks change no key block) at head dims of whole
    128-column chunks; anything else is refused naming the reason, and the tuner never draws it."""
    from attngen.families.fwd_sm90 import family as sm90

    config = sm90.Sm90Config.from_label("m128n160s2oprc")
    assert config.cluster and config.schedule == "pairs" and config.label() == "m128n160s2oprc"
    assert not sm90.Sm90Config.from_label("m128n160s2opr").cluster
    for kw, match in ((dict(head_dim=128, mask="causal"), "mask 'causal'"),
                      (dict(head_dim=64), "head_dim 64 is one 64-column chunk"),
                      (dict(head_dim=128, mask="causal", varlen=True), "packed sequences")):
        with pytest.raises(SpecError, match=match):
            plan_spec(AttentionSpec(**kw, family="fwd_sm90", config={"schedule": "pairs", "cluster": True}), H100)
    with pytest.raises(SpecError, match="cluster=True is invalid with schedule='dynamic'; allowed: cluster with "
                                        "schedule='pairs'"):
        plan_spec(AttentionSpec(head_dim=128, family="fwd_sm90", config={"schedule": "dynamic", "cluster": True}), H100)
    # Pinned alone, cluster takes the pairs schedule (an expression's default is the dynamic one).
    alone = plan_spec(AttentionSpec(head_dim=128, score_mod="softcap(30)", family="fwd_sm90", config={"cluster": True}),
                      H100)
    assert alone.cluster and alone.schedule == "pairs"
    family = get_family("fwd_sm90")
    for kw, allowed in ((dict(head_dim=128), True), (dict(head_dim=128, score_mod="softcap(30)"), True),
                        (dict(head_dim=128, mask="causal"), False), (dict(head_dim=64), False)):
        clustered = [c for c in family.configs(AttentionSpec(**kw).problem, H100) if c.cluster]
        assert bool(clustered) == allowed and all(c.schedule == "pairs" for c in clustered)
    plan = plan_spec(AttentionSpec(head_dim=128, family="fwd_sm90", config=config.to_dict()), H100)
    source = family.render(plan)
    assert "__cluster_dims__(2, 1, 1)" in source and "constexpr int CLUSTER = 2;" in source
    assert "__cluster_dims__" not in family.render(plan_spec(AttentionSpec(head_dim=128, mask="causal", family="fwd_sm90"),
                                                             H100))
    # Dropout is not offered on clusters (not validated on a GPU), nor a GPU of one SM.
    with pytest.raises(SpecError, match="dropout_p=0.1: clusters are not validated with dropout"):
        plan_spec(AttentionSpec(head_dim=128, dropout_p=0.1, family="fwd_sm90", config={"cluster": True}), H100)
    with pytest.raises(SpecError, match="has 1 SM: a cluster of two CTAs"):
        plan_spec(AttentionSpec(head_dim=128, family="fwd_sm90", config={"cluster": True}),
                  dataclasses.replace(H100, sms=1))
    # Pinned on a problem it cannot take, the tuner's space keeps the cluster configs and says why.
    from attngen.tune.space import search_space

    space = search_space(AttentionSpec(head_dim=128, mask="causal", family="fwd_sm90", config={"cluster": True}), H100)
    assert space and all(c.plan is None and "mask 'causal': the two tiles of a pair" in c.plan_error for c in space)
    # One tile per CTA and round: an even grid, all the SMs' worth (less one of an odd count) or every tile.
    monkeypatch.setattr(sm90.tma, "encode", lambda *a, **k: bytes(128))  # no driver on the CPU
    for sms, B, S, H, grid in ((132, 1, 16384, 16, 132), (131, 1, 16384, 16, 130), (132, 1, 300, 2, 8),
                               (132, 3, 300, 2, 24), (2, 1, 4096, 4, 2)):
        plan = plan_spec(AttentionSpec(head_dim=128, family="fwd_sm90", config=config.to_dict()),
                         dataclasses.replace(H100, sms=sms))
        assert family.launches(plan, _sm90_call(128, B, S, H, H))[-1].grid == (grid, 1, 1)


def test_sm90_model_ranks_a_cluster_just_below_its_twin():
    """fwd_sm90's clusters of two CTAs measured 2-4.5% slower per clock than the same tile alone: the
    model ranks them just behind their twins rather than tied (a tie spends timing slots on both)."""
    from attngen.families.fwd_sm90 import family as sm90

    family = get_family("fwd_sm90")
    times = []
    for label in ("m128n128s2opr", "m128n128s2oprc"):
        config = sm90.Sm90Config.from_label(label).to_dict()
        plan = plan_spec(AttentionSpec(head_dim=128, family="fwd_sm90", config=config), H100)
        report = nvcc.ResourceReport(plan.name, H100.name, registers=168, smem_static_bytes=1024, stack_frame_bytes=0,
                                     spill_store_bytes=0, spill_load_bytes=0, smem_dynamic_bytes=plan.smem_bytes)
        times.append(family.estimate(plan, report, gpu_model(H100), Shape(2, 8192, 8192, 16)).ms)
    assert times[0] < times[1] < 1.05 * times[0]


CUOBJDUMP = nvcc.find_cuobjdump()


# Every default config of tile_defaults.yaml's none and causal rows (and causal under GQA, which has
# its own): 0 spills, no serialised wgmma, and the Hopper instructions.
SM90_DEFAULTS = [(d, mask, 1) for d in (64, 96, 128, 256) for mask in ("none", "causal")] + [(128, "causal", 4)] \
    + [(64, "causal/short", 1), (128, "none/short", 1)]  # the defaults of calls of at most 1k tokens


@pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("d, mask, gqa", SM90_DEFAULTS)
def test_sm90_binary_is_built_of_wgmma_and_tma(tmp_path, d, mask, gqa):
    mask, short = mask.removesuffix("/short"), mask.endswith("/short")
    plan = plan_spec(AttentionSpec(head_dim=d, mask=mask, gqa_ratio=gqa, family="fwd_sm90"), H100,
                     seqlen=512 if short else None)
    cubin = tmp_path / "k.cubin"
    report = nvcc.check_plan(plan, keep_cubin=cubin)
    assert report.spill_bytes == 0 and report.stack_frame_bytes == 0, report.log
    for warning in ("C7508", "C7510", "C7515", "serialized"):  # setmaxnreg ignored, wgmma serialised
        assert warning not in report.log, report.log
    if CUOBJDUMP is None:
        pytest.skip("cuobjdump not on PATH: the SASS is not checked here (CI installs it)")
    sass = nvcc.sass(cubin)
    for instruction in ("HGMMA.64x", "UTMALDG.4D", "UTMASTG.4D", "USETMAXREG", "SYNCS.ARRIVE.TRANS64"):
        assert instruction in sass, f"{plan.name}: no {instruction} in its SASS"
    assert "LDL" not in sass and "STL" not in sass, "local memory traffic in the Hopper kernel"
    assert ("UTMALDG.4D.MULTICAST" in sass) == plan.cluster


@pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("d", [96, 128, 256])
def test_sm90_cluster_binary_multicasts_without_spills(tmp_path, d):
    """The cluster configs (each CTA's half of a K/V block multicast to both): 0 spills with the producer
    one thread in 32 registers (in 24 it spilled the multicast's operands), and the multicast loads."""
    config = {"schedule": "pairs", "cluster": True}
    plan = plan_spec(AttentionSpec(head_dim=d, mask="none", family="fwd_sm90", config=config), H100)
    cubin = tmp_path / "k.cubin"
    report = nvcc.check_plan(plan, keep_cubin=cubin)
    assert report.spill_bytes == 0 and report.stack_frame_bytes == 0, report.log
    if CUOBJDUMP is None:
        pytest.skip("cuobjdump not on PATH: the SASS is not checked here (CI installs it)")
    sass = nvcc.sass(cubin)
    assert "UTMALDG.4D.MULTICAST" in sass and "HGMMA.64x" in sass and "STL" not in sass
    # A GPU-wide fence only in the cluster barrier after the inits: the stages' remote releases at
    # cluster scope put one before every arrival, and the kernel ran 1.8x slower. No cluster barrier at
    # exit (its waiting warps cost 2% per clock): the producer's last waits keep the CTA alive instead.
    assert sass.count("MEMBAR.ALL.GPU") <= 1, f"{plan.name}: GPU-wide fences beyond the cluster barrier"
    assert sass.count("UCGABAR_WAIT") == 1, f"{plan.name}: a cluster barrier other than the one after the inits"


def _steady_loop(sass_text: str) -> list[str]:
    """The instructions of the innermost loop holding both GEMMs' wgmmas (QK^T's and P V's shapes): the
    overlapped loop of fwd_sm90, from a conditional backward branch's target to the branch. (An
    unconditional one is the way back from an out-of-line wait at the code's end, not a loop.)"""
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass_text)]
    index = {address: i for i, (address, _) in enumerate(code)}
    loops = []
    for i, (address, text) in enumerate(code):
        branch = re.search(r"^(?:@!?U?P\w+\s+BRA (?:!?U?P\w+, )?|BRA !?U?P\w+, )0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < address and int(branch.group(1), 16) in index:
            body = [t for _, t in code[index[int(branch.group(1), 16)]:i + 1]]
            shapes = {m.group(1) for t in body for m in [re.search(r"HGMMA\.(64x\d+x16)", t)] if m}
            if len(shapes) >= 2 or (len(shapes) == 1 and sum("HGMMA" in t for t in body) > 8):
                loops.append(body)
    return min(loops, key=len) if loops else []


@pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("d, mask, varlen", [(64, "causal", False), (128, "none", False), (128, "causal", False),
                                             (64, "causal", True), (128, "causal", True), (128, "none", True)])
def test_sm90_steady_loop_keeps_its_wgmma_descriptors_uniform(tmp_path, d, mask, varlen):
    """The overlapped loop's wgmma descriptors stay in uniform registers. When ptxas cannot prove a branch
    around the loop warp-uniform they are built in vector registers and moved over (R2UR) for every
    wgmma: 770 -> 843 instructions a block at d128, 4-8% slower (docs/perf-notes.md "Idle warpgroups");
    the varlen epilogue's choice between the TMA store and the threads' copy did it again at d128 (48 R2UR,
    steady blocks 4.7% slower: "The steady loop's uniform registers, lost again")."""
    if CUOBJDUMP is None:
        pytest.skip("cuobjdump not on PATH: the SASS is not checked here (CI installs it)")
    plan = plan_spec(AttentionSpec(head_dim=d, mask=mask, family="fwd_sm90", varlen=varlen), H100)
    cubin = tmp_path / "k.cubin"
    nvcc.check_plan(plan, keep_cubin=cubin)
    loop = _steady_loop(nvcc.sass(cubin))
    wgmmas = sum("HGMMA" in t for t in loop)
    moves = sum(re.search(r"(^|\s)R2UR\s", t) is not None for t in loop)
    assert wgmmas >= d // 16, f"{plan.name}: no steady loop with both GEMMs found"
    # Kept uniform: 8-16 R2UR for 12-18 wgmmas (d64, d128); moved over: 32-52, about three a wgmma.
    assert moves <= wgmmas * 3 // 2, f"{plan.name}: {moves} R2UR for {wgmmas} wgmmas in the steady loop"
    # Q's descriptors too, from the warpgroup index taken through a shuffle (not under CLUSTER, where that
    # measured slower): one R2UR a wgmma otherwise ("Every wgmma's Q descriptor in uniform registers").
    if not plan.cluster:
        assert moves <= 2, f"{plan.name}: {moves} R2UR in the steady loop: Q's descriptors left uniform registers"


@pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("d, mask, score_mod, label, speculates", [
    (64, "causal", None, None, True), (96, "causal", None, None, True), (128, "none", None, None, True),
    (128, "causal", None, None, True), (256, "none", None, None, True), (256, "causal", None, None, True),
    (256, "none", None, "m128n80s2o", False), (128, "causal", "softcap(30.0)", None, False)])
def test_sm90_steady_loop_takes_exponentials_before_the_block_max(tmp_path, d, mask, score_mod, label, speculates):
    """With pingpong and no score modifier, the overlapped loop's exps start right after the P V wait,
    against the reference the earlier blocks left (speculative_softmax), not after the block's max: a
    chain of maxes and two shuffles that put the first MUFU.EX2 ~50-100 instructions later
    (docs/perf-notes.md "Exponentials against the reference already held"). Without pingpong (a pinned
    config; every default has it) and under a modifier the max comes first, as before."""
    if CUOBJDUMP is None:
        pytest.skip("cuobjdump not on PATH: the SASS is not checked here (CI installs it)")
    from attngen.families.fwd_sm90 import family as sm90

    config = sm90.Sm90Config.from_label(label).to_dict() if label else None
    plan = plan_spec(AttentionSpec(head_dim=d, mask=mask, score_mod=score_mod, family="fwd_sm90", config=config), H100)
    assert plan.pingpong == (label is None), plan.name  # the defaults this test stands on
    cubin = tmp_path / "k.cubin"
    nvcc.check_plan(plan, keep_cubin=cubin)
    loop = _steady_loop(nvcc.sass(cubin))
    assert loop, f"{plan.name}: no steady loop with both GEMMs found"
    wait = next((i for i, t in enumerate(loop) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in t), None)
    assert wait is not None, f"{plan.name}: no wait for P V in the steady loop"
    first = next((i for i in range(wait, len(loop)) if "MUFU.EX2" in loop[i]), None)
    shuffle = next((i for i in range(wait, len(loop)) if "SHFL.BFLY" in loop[i]), None)  # the row max, quad-wide
    assert first is not None and shuffle is not None, f"{plan.name}: no exp or no shuffle after the P V wait"
    if speculates:
        assert first - wait <= 24, f"{plan.name}: the first exp {first - wait} instructions after the P V wait"
        assert first < shuffle, f"{plan.name}: the exps wait for the row max"
    else:
        assert first > shuffle, f"{plan.name}: exps before the row max"


@pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("paged", [True, False])
def test_decode_loads_by_tma_only_where_asked(tmp_path, paged):
    """config.loads='tma' (sm_90a) builds tensor-map loads on mbarriers with no spills; the cp.async
    plan of the same problem, for sm_80 and for sm_90a, has none of them."""
    spec = AttentionSpec(head_dim=128, gqa_ratio=4, mask="causal", family="decode_sm80")
    family = get_family("decode_sm80")
    builds = {}
    for loads, target in (("tma", H100), ("cp_async", H100), ("cp_async", targets.target("sm_80"))):
        plan = family.plan(spec.problem, target, family.resolve_config(spec.problem, target, {"loads": loads}),
                           paged=paged)
        cubin = tmp_path / f"{loads}-{target.name}.cubin"
        report = nvcc.check_plan(plan, keep_cubin=cubin)
        assert report.spill_bytes == 0 and report.stack_frame_bytes == 0, report.log
        builds[(loads, target.name)] = cubin
    if CUOBJDUMP is None:
        pytest.skip("cuobjdump not on PATH: the SASS is not checked here (CI installs it)")
    for (loads, arch), cubin in builds.items():
        sass = nvcc.sass(cubin)
        assert ("UTMALDG.4D" in sass) == (loads == "tma"), f"{loads} {arch}"
        assert ("LDGSTS" in sass) or loads == "tma", f"{loads} {arch}: no cp.async"  # Q always by cp.async


def _nvrtc():
    try:
        from attngen.build.compiler import nvrtc_version

        nvrtc_version()
        return True
    except Exception:  # noqa: BLE001 - CuPy or libnvrtc missing: the test says so
        return False


@pytest.mark.skipif(not _nvrtc(), reason="NVRTC (CuPy + libnvrtc) not available")
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_the_runtime_compiler_builds_every_default(name):
    from attngen.build.compiler import NVRTC_OPTIONS, nvrtc_compile

    family = get_family(name)
    target = _home(family)
    for d in (64, 96, 128, 256):
        plan = plan_spec(AttentionSpec(head_dim=d, mask="causal", family=name), target)
        assert nvrtc_compile(family.render(plan), plan.name, NVRTC_OPTIONS, target.name)


def test_varlen_problems_run_only_on_per_sequence_tiles():
    """Problem.varlen (packed sequences): the forward families support it (fwd_sm90 and fwd_sm80 tile per
    sequence), for masks with closed-form bounds and inputs indexed by h; every other family says why not."""
    from attngen.families import FAMILIES

    def reasons(**kw):
        problem = AttentionSpec(head_dim=128, varlen=True, **kw).problem
        return {name: get_family(name).supports(problem, H100) for name in FAMILIES}

    for kw in ({"mask": "causal"}, {"mask": "sliding_window(100, 0)", "score_mod": "softcap(20.0)", "sink": "sinks[h]"},
               {"mask": "chunked(64) and causal"}, {"score_mod": "alibi"}):
        found = reasons(**kw)
        assert found.pop("fwd_sm90") is None and found.pop("fwd_sm80") is None, kw
        assert all("packed sequences (varlen) run on a family that tiles per sequence" in r for r in found.values())
    for name in ("fwd_sm90", "fwd_sm80"):
        assert "reads runtime inputs" in reasons(mask="kv_idx + kv_offset <= q_idx + q_offset")[name]
        refusals = {"mask": ("kv_idx % 3 != 1", "no closed form"),
                    "score_mod": ("score + bias[q_idx]", "by a position"), "sink": ("sinks[b]", "reads b")}
        for field, (text, why) in refusals.items():
            assert why in reasons(**{field: text})[name]
        assert "dropout" in reasons(dropout_p=0.125)[name]
    with pytest.raises(SpecError, match="varlen='yes' is invalid"):
        AttentionSpec(head_dim=64, varlen="yes")
    spec = AttentionSpec(head_dim=64, varlen=True)
    assert spec.key().endswith(',"varlen":true}') and "varlen" not in AttentionSpec(head_dim=64).key()
    assert spec.problem.label().endswith("_varlen") and AttentionSpec.from_key(spec.key()) == spec


def test_varlen_plans_build_their_tile_list_before_the_kernel(monkeypatch):
    """A varlen plan runs the dynamic schedule (a pinned other one is refused); its first launch is
    the one-CTA tile builder, then the kernel on min(capacity x heads, SMs) CTAs; the workspace holds
    the header, the segment table and the list (varlen_tiles.cuh)."""
    from attngen.families.fwd_sm90 import family as sm90

    monkeypatch.setattr(sm90.tma, "encode", lambda *a, **k: bytes(128))  # no driver on the CPU
    family = get_family("fwd_sm90")
    h100 = dataclasses.replace(H100, sms=132)
    plan = plan_spec(AttentionSpec(head_dim=128, mask="causal", gqa_ratio=2, varlen=True), h100)
    assert plan.family == "fwd_sm90" and plan.schedule == "dynamic"
    assert [(k.symbol, k.threads) for k in plan.kernels] == [(plan.name, 384), (f"{plan.name}_tiles256", 256),
                                                             (f"{plan.name}_tiles1024", 1024)]
    names = [p.name for p in plan.kernels[0].abi.params]
    assert {"in_cu_seqlens_q", "in_cu_seqlens_k", "num_seqs", "o", "o_s1", "o_s2"} <= set(names)
    with pytest.raises(SpecError, match="allowed: schedule=dynamic"):
        plan_spec(AttentionSpec(head_dim=128, varlen=True, family="fwd_sm90", config={"schedule": "pairs"}), h100)
    # The narrowest builder that holds the sequences: 256 threads up to 256 of them, 1,024 beyond (in chunks).
    for sequences, total, grid, threads in ((3, 1000, 52, 256), (16, 16384, 132, 256), (256, 16384, 132, 256),
                                            (257, 16384, 132, 1024), (1500, 16384, 132, 1024)):
        cu = _tensor("cu", (sequences + 1,), "int32")
        call = _sm90_call(128, 1, total, 4, 2, workspace=1 << 30, inputs=(("cu_seqlens_k", cu), ("cu_seqlens_q", cu)))
        capacity = math.ceil(total / 128) + sequences + 2
        assert sm90.varlen_capacity(plan, call) == capacity
        assert family.workspace_bytes(plan, call) == 16 + 16 * (sequences + 2) + 8 * capacity
        build, main = family.launches(plan, call)
        assert build.kernel == f"{plan.name}_tiles{threads}" and build.grid == (1, 1, 1) and build.block == (threads, 1, 1)
        assert main.kernel == plan.name and main.grid == (min(capacity * 4, 132), 1, 1) and build.params == main.params
        assert main.early and not build.early
        assert grid == main.grid[0]


def test_sm80_varlen_plans_build_the_same_list_and_run_a_cta_per_entry():
    """fwd_sm80 tiles packed sequences from the list fwd_sm90 builds (attngen/cuda/varlen_tiles.cuh): the
    one-CTA builder first, then the kernel on (capacity, heads) CTAs in stream order (sm_80 has no early
    launch); the workspace holds the same header, segment table and list."""
    family = get_family("fwd_sm80")
    plan = plan_spec(AttentionSpec(head_dim=128, mask="causal", gqa_ratio=2, varlen=True, family="fwd_sm80"),
                     targets.target("sm_80"))
    assert [(k.symbol, k.threads) for k in plan.kernels[1:]] == [(f"{plan.name}_tiles256", 256),
                                                                  (f"{plan.name}_tiles1024", 1024)]
    names = {p.name for p in plan.kernels[0].abi.params}
    assert {"in_cu_seqlens_q", "in_cu_seqlens_k", "num_seqs", "m_blocks", "tile_counter"} <= names
    source = family.render(plan)
    assert "#define ATTNGEN_VARLEN 1" in source and "varlen::build<256>(p," in source and "varlen::build<1024>(p," in source
    for sequences, total, threads in ((3, 1000, 256), (16, 16384, 256), (600, 16384, 1024), (1025, 16384, 1024)):
        cu = _tensor("cu", (sequences + 1,), "int32")
        call = _sm90_call(128, 1, total, 4, 2, workspace=1 << 30, inputs=(("cu_seqlens_k", cu), ("cu_seqlens_q", cu)))
        capacity = math.ceil(total / plan.block_m) + sequences + 2
        assert family.workspace_bytes(plan, call) == 16 + 16 * (sequences + 2) + 8 * capacity
        build, main = family.launches(plan, call)
        assert build.kernel == f"{plan.name}_tiles{threads}" and build.grid == (1, 1, 1) and build.block == (threads, 1, 1)
        assert main.kernel == plan.name and main.grid == (capacity, 4, 1) and build.params == main.params
        assert not main.early and not build.early


@pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
def test_sm80_varlen_kernels_compile_without_spills(target):
    """Every head dim with a window, softcap and a sink (the heaviest per-score work a varlen call may carry),
    the tile builder beside it; and a plain causal one per head dim."""
    from concurrent.futures import ThreadPoolExecutor

    heavy = {"mask": "sliding_window(255, 0)", "score_mod": "softcap(20.0)", "sink": "sinks[h]"}
    specs = [AttentionSpec(head_dim=d, varlen=True, family="fwd_sm80", **kw)
             for d in (64, 96, 128, 256) for kw in ({"mask": "causal"}, heavy)]

    def spilled(spec):
        report = nvcc.check_plan(plan_spec(spec, targets.target(target)))
        return spec.name, report.spill_bytes + sum(k.spill_bytes for k in report.kernels.values())

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(spilled, specs))
    assert all(spill == 0 for _, spill in results), results


@pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("spec", [AttentionSpec(head_dim=64, mask="causal"),
                                  AttentionSpec(head_dim=128, mask="causal", gqa_ratio=2, varlen=True)],
                         ids=["dynamic", "varlen"])
def test_sm90_kernels_behind_their_setup_kernel_wait_for_it_first(spec, tmp_path):
    """The counter reset (dynamic schedule) and the tile builder (varlen) let the forward kernel start at
    their own start (griddepcontrol.launch_dependents, SASS PREEXIT, before their first write); the forward
    kernel, launched early behind them, waits for them (ACQBULK) on every path before touching global memory."""
    if nvcc.find_cuobjdump() is None:
        pytest.skip("cuobjdump not on PATH: the SASS is not checked here (CI installs it)")
    plan = plan_spec(spec, targets.target("sm_90a"))
    assert plan.schedule == "dynamic" and len(plan.kernels) == (3 if spec.varlen else 2)  # varlen: two builders
    cubin = tmp_path / "k.cubin"
    nvcc.check_plan(plan, keep_cubin=cubin)
    functions = sass_waits.functions(nvcc.sass(cubin))
    sass_waits.before_the_wait(plan.name, functions[plan.name])
    for setup_kernel in plan.kernels[1:]:
        trigger = functions[setup_kernel.symbol].split("PREEXIT", 1)
        assert len(trigger) == 2 and not sass_waits.GLOBAL_ACCESS.search(trigger[0]), setup_kernel.symbol


@pytest.mark.skipif(not nvcc.nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("head_dim, mask", [(64, "causal"), (128, "sliding_window(255, 0)"), (256, "causal"),
                                            (256, "sliding_window(100, 0)")])
def test_varlen_kernels_compile_for_sm90a_without_spills(head_dim, mask):
    extra = {"score_mod": "softcap(20.0)", "sink": "sinks[h]"} if "window" in mask else {}
    plan = plan_spec(AttentionSpec(head_dim=head_dim, mask=mask, varlen=True, **extra), targets.target("sm_90a"))
    report = nvcc.check_plan(plan)
    assert report.spill_bytes == 0, report


def test_varlen_calls_are_checked_naming_what_is_wrong():
    """A varlen call without its boundaries, of batch above 1, or with boundaries of two shapes is
    refused before launch, naming the argument and what is allowed."""
    from attngen.runtime.checks import forward_call

    problem = AttentionSpec(head_dim=128, mask="causal", varlen=True).problem
    cu = _tensor("cu", (4,), "int32")

    def error(batch=1, inputs=None):
        q, k = _tensor("q", (batch, 100, 4, 128)), _tensor("k", (batch, 100, 4, 128))
        out, lse = _tensor("out", (batch, 100, 4, 128)), _tensor("lse", (batch, 4, 100), "float32")
        given = {"cu_seqlens_q": cu, "cu_seqlens_k": cu} if inputs is None else inputs
        with pytest.raises(ValueError) as info:
            forward_call(problem, q, k, k, out, lse, None, given)
        return str(info.value)

    missing = error(inputs={})
    assert "pass inputs={'cu_seqlens_q': an int32 tensor of shape (sequences + 1,)} (cu_seqlens_q and" in missing
    assert "pass inputs={'cu_seqlens_k'" in error(inputs={"cu_seqlens_q": cu})
    assert "allowed: batch 1" in error(batch=2)
    assert "cu_seqlens_q has shape (4,) and cu_seqlens_k (5,); allowed: the same shape" in \
        error(inputs={"cu_seqlens_q": cu, "cu_seqlens_k": _tensor("cu", (5,), "int32")})
    assert "input 'cu_seqlens_k' has dtype int64; allowed: int32" in \
        error(inputs={"cu_seqlens_q": cu, "cu_seqlens_k": _tensor("cu", (4,), "int64")})
