"""The search space and the static pruning/ranking stage, with fake resource reports (no GPU, no nvcc)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from attngen import families, targets
from attngen.build.nvcc import ResourceReport
from attngen.errors import SpecError
from attngen.families.fwd_sm80.family import BLOCK_MS, BLOCK_NS, NUM_STAGES, NUM_WARPS, ROWS_PER_WARP, Sm80Config
from attngen.masks import get_mask
from attngen.spec import AttentionSpec
from attngen.tune.model import Occupancy, Shape, gpu_model, occupancy
from attngen.tune.ranking import Ranked, no_survivor_error, rank, survivors
from attngen.tune.report import plan_choices, spearman
from attngen.tune.resources import Pruned, prune
from attngen.tune.space import families_of, search_space, unconfigured

SM90 = targets.target("sm_90")
SM80 = targets.target("sm_80")
H100 = gpu_model(SM90)
SM80_FAMILY = families.get_family("fwd_sm80")
REGISTERED = dict(families.FAMILIES)


pytestmark = pytest.mark.usefixtures("sm80_only")


def fake_report(candidate, registers=128, spills=0, static_smem=0) -> ResourceReport:
    plan = candidate.plan
    return ResourceReport(plan.name, plan.target.name, registers, static_smem, 0, spills, spills, plan.smem_bytes)


def test_space_is_every_config_the_family_accepts():
    space = search_space(AttentionSpec(head_dim=64), SM90)
    expected = {(m, n, w, s) for m in BLOCK_MS for n in BLOCK_NS for w in NUM_WARPS for s in NUM_STAGES
                if m / w in ROWS_PER_WARP}
    assert {(c.config.block_m, c.config.block_n, c.config.num_warps, c.config.num_stages) for c in space} == expected
    assert len({c.label for c in space}) == len(space)
    assert all(c.launchable and c.target == SM90 and c.family == "fwd_sm80" for c in space)  # d64 always fits
    assert space[0].label == f"fwd_sm80/{space[0].config.label()}"
    assert families_of(space) == ("fwd_sm80",)


def test_plan_rejections_stay_in_the_space_with_their_reason():
    space = search_space(AttentionSpec(head_dim=256), SM80)
    rejected = [c for c in space if not c.launchable]
    assert rejected and all("shared memory" in c.plan_error for c in rejected)
    for c in space:
        assert c.launchable == (c.plan is not None)
        if c.launchable:
            assert c.plan.smem_bytes <= SM80.smem_per_block


def test_pinned_config_fields_narrow_the_space_and_the_target_argument_wins():
    spec = AttentionSpec(head_dim=128, family="fwd_sm80", config={"block_n": 64, "num_stages": 2}, arch="sm_80")
    space = search_space(spec, SM90)
    assert {c.label for c in space} == {f"fwd_sm80/{label}" for label in (
        "m16n64w1s2", "m32n64w1s2", "m32n64w2s2", "m64n64w2s2", "m64n64w4s2", "m128n64w4s2", "m128n64w8s2",
        "m256n64w8s2")}
    assert {c.target.name for c in space} == {"sm_90a"}  # the spec's arch is for offline generation only
    assert unconfigured(spec) == AttentionSpec(head_dim=128, family="fwd_sm80")
    assert space[0].spec == AttentionSpec(head_dim=128, family="fwd_sm80", config=space[0].config.to_dict())
    assert space[0].spec.fully_configured


def test_every_family_that_supports_the_problem_is_searched_unless_one_is_pinned(monkeypatch, other_family):
    monkeypatch.setattr(families, "FAMILIES", {"fwd_other": other_family, "fwd_sm80": SM80_FAMILY})
    spec = AttentionSpec(head_dim=64, mask="causal")
    space = search_space(spec, SM90)
    names = [c.family for c in space]
    assert families_of(space) == ("fwd_other", "fwd_sm80") and names == sorted(names)  # preference order
    assert names.count("fwd_other") == names.count("fwd_sm80") == len(space) // 2
    assert families_of(search_space(spec, SM80)) == ("fwd_sm80",)  # the other family cannot run on sm_80
    assert families_of(search_space(spec.replace(family="fwd_sm80"), SM90)) == ("fwd_sm80",)
    with pytest.raises(SpecError, match="family='fwd_other' cannot run .* on sm_80: needs sm_90 or newer"):
        search_space(spec.replace(family="fwd_other"), SM80)
    monkeypatch.setattr(families, "FAMILIES", {"fwd_other": other_family})
    with pytest.raises(SpecError, match="no kernel family can run causal_d64_gqa1_bf16 on sm_80 .*fwd_other: needs"):
        search_space(spec, SM80)


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90a"])
def test_the_space_covers_every_registered_family_that_supports_the_problem(monkeypatch, arch):
    monkeypatch.setattr(families, "FAMILIES", REGISTERED)  # the real registry, whatever it holds today
    spec, target = AttentionSpec(head_dim=128, mask="causal"), targets.target(arch)
    space = search_space(spec, target)
    assert families_of(space) == tuple(sorted(f.name for f in families.supporting(spec.problem, target)))
    for name in families_of(space):
        assert len([c for c in space if c.family == name]) == len(families.get_family(name).configs(spec.problem,
                                                                                                    target))


def test_space_needs_a_spec_and_a_target():
    with pytest.raises(ValueError, match="spec must be"):
        search_space({"head_dim": 64}, SM90)
    with pytest.raises(ValueError, match="target must be an attngen.targets.Target"):
        search_space(AttentionSpec(head_dim=64), "sm_90")


def test_plan_choices_show_what_the_plan_derives():
    plan = SM80_FAMILY.plan(AttentionSpec(head_dim=128).problem, SM90, Sm80Config(128, 128, 4, 1))
    text = plan_choices(plan)
    assert "sub_n=64" in text and "row_sums_in_smem" in text and "block_m" not in text and "threads" not in text
    assert plan_choices(None) == "-"


# -- pruning --------------------------------------------------------------------------------
def candidate(head_dim=64, target=SM90, **config):
    spec = AttentionSpec(head_dim=head_dim, family="fwd_sm80", config=config)
    return next(c for c in search_space(spec, target))


def test_prune_verdicts():
    c = candidate(block_m=128, block_n=64, num_warps=4, num_stages=2)
    ok = prune(c, fake_report(c, registers=168), H100)
    assert ok.survives and ok.occupancy == Occupancy(3, 12, "registers")
    assert "spills 8/8 B" in prune(c, fake_report(c, spills=8), H100).reason
    assert prune(c, fake_report(c, static_smem=200 * 1024), H100).reason == \
        f"smem {c.plan.smem_bytes + 200 * 1024} B > {SM90.smem_per_block} B"
    assert prune(c, "CompileError: nvcc failed", H100).reason == "compile: CompileError: nvcc failed"
    one_warp = candidate(block_m=16, block_n=128, num_warps=1, num_stages=4)
    low = prune(one_warp, fake_report(one_warp, registers=200), H100)
    assert low.reason == "occupancy: 1 warps/SM < 4 schedulers (smem)"
    big = next(c for c in search_space(AttentionSpec(head_dim=256), SM80) if not c.launchable)
    assert prune(big, None, H100).reason.startswith("plan: config ")


def test_prune_checks_the_shared_memory_of_every_kernel_of_a_plan():
    # A plan of two kernels (a main kernel and a combine kernel, say): the second one's report decides too.
    c = candidate(block_m=128, block_n=64, num_warps=4, num_stages=2)
    main = c.plan.kernels[0]
    combine = dataclasses.replace(main, symbol="combine", smem_bytes=230 * 1024)
    two = dataclasses.replace(c, plan=dataclasses.replace(c.plan, kernels=(main, combine)))
    report = fake_report(c)
    combined = dataclasses.replace(report, kernels={main.symbol: report, "combine": dataclasses.replace(
        report, name="combine", smem_dynamic_bytes=combine.smem_bytes)})
    assert prune(two, combined, H100).reason == f"smem {230 * 1024} B > {SM90.smem_per_block} B (combine)"
    assert prune(c, report, H100).survives


def test_occupancy_limits():
    # 255 registers x 4 warps: 8 warps per SM fit the register file (FA2's d128 tile).
    assert occupancy(H100, 128, 255, 100_000) == Occupancy(2, 8, "registers")
    assert occupancy(H100, 128, 64, 100 * 1024) == Occupancy(2, 8, "smem")
    assert occupancy(H100, 512, 16, 1024) == Occupancy(4, 64, "threads")
    assert occupancy(H100, 32, 16, 1024).ctas == 32
    assert occupancy(H100, 128, 64, 300 * 1024).ctas == 0


def test_no_survivors_is_an_error_that_says_why():
    c = candidate(block_m=128, block_n=64, num_warps=4, num_stages=2)
    ranked = rank([prune(c, fake_report(c, spills=4), H100), prune(c, "CompileError: x", H100)], H100,
                  Shape(1, 1024, 1024, 16))
    assert survivors(ranked) == []
    message = no_survivor_error(AttentionSpec(head_dim=64), ranked)
    assert "every one of the 2 configurations" in message
    assert "1 by spills" in message and "1 by compile" in message and "fwd_sm80/m128n64w4s2" in message


# -- the model, through the ranking: each family's estimate() ----------------------------------
def ranked_for(config: dict, head_dim=128, mask="none", registers=128, shape=Shape(4, 4096, 4096, 16)) -> Ranked:
    c = candidate(head_dim=head_dim, **config)
    if mask != "none":
        c = next(iter(search_space(AttentionSpec(head_dim=head_dim, mask=mask, family="fwd_sm80", config=config),
                                   SM90)))
    return rank([prune(c, fake_report(c, registers=registers), H100)], H100, shape)[0]


TILE = {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2}


def test_model_grows_with_work_and_causal_halves_it():
    times = [ranked_for(TILE, shape=Shape(16384 // s, s, s, 16)).predicted_ms for s in (1024, 4096, 16384)]
    assert times[0] < times[1] < times[2]  # same tokens, work ~ seqlen
    full = ranked_for(TILE).predicted_ms
    causal = ranked_for(TILE, mask="causal").predicted_ms
    assert 0.4 * full < causal < 0.75 * full
    flops = Shape(4, 4096, 4096, 16).flops(128, False)
    assert 100 < flops / full / 1e9 < 744  # TFLOP/s below the wgmma peak, above nonsense


def test_model_rewards_occupancy_rows_per_warp_and_pipelining():
    assert ranked_for(TILE, registers=255).predicted_ms < ranked_for({**TILE, "num_stages": 3},
                                                                     registers=255).predicted_ms
    assert ranked_for(TILE, registers=128).predicted_ms <= ranked_for(TILE, registers=255).predicted_ms
    two_tiles = ranked_for(TILE, registers=128).predicted_ms  # 32 rows per warp: half the smem reads per MMA
    one_tile = ranked_for({**TILE, "num_warps": 8}, registers=128).predicted_ms
    assert two_tiles < one_tile
    assert ranked_for({**TILE, "num_stages": 1}, registers=128).predicted_ms > two_tiles


def test_model_sees_wave_tails():
    r = ranked_for(TILE, head_dim=64, registers=128)
    slots = r.estimate.slots
    full = ranked_for(TILE, head_dim=64, registers=128, shape=Shape(1, 128, 128, slots)).predicted_ms
    one_more = ranked_for(TILE, head_dim=64, registers=128, shape=Shape(1, 128, 128, slots + 1)).predicted_ms
    assert one_more > 1.8 * full - 0.01  # one CTA past a full wave costs a whole wave


@pytest.mark.parametrize("text", ["causal", "sliding_window(100, 3)"])
def test_key_blocks_match_the_dense_mask(text):
    import torch

    from attngen.tune.model import key_blocks

    mask = get_mask(text)
    for sq, sk in ((1000, 1000), (300, 40), (129, 1000)):
        got = key_blocks(mask, 64, 32, Shape(1, sq, sk, 1))
        dense = torch.broadcast_to(mask.dense_visible(torch.arange(sq)[:, None], torch.arange(sk)[None, :], sq, sk),
                                   (sq, sk))
        for idx, m_block in enumerate(reversed(range(math.ceil(sq / 64)))):
            rows = dense[m_block * 64:m_block * 64 + 64]
            blocks = [n for n in range(math.ceil(sk / 32)) if rows[:, n * 32:n * 32 + 32].any()]
            full = {n for n in blocks if rows[:, n * 32:n * 32 + 32].all() and n * 32 + 32 <= sk}
            n_loaded, n_partial = got[idx]
            span = max(blocks) - min(blocks) + 1 if blocks else 0  # loaded: first to last non-empty block
            assert n_loaded == span, (text, sq, sk, m_block)
            assert n_partial == n_loaded - len(full), (text, sq, sk, m_block)


def test_ranking_puts_survivors_first_in_predicted_order():
    spec = AttentionSpec(head_dim=64, family="fwd_sm80", config={"block_m": 128, "block_n": 64, "num_stages": 2})
    pruned = [prune(c, fake_report(c, registers=128, spills=s), H100)
              for c, s in zip(search_space(spec, SM90), (0, 8))]
    pruned.append(Pruned(pruned[0].candidate, None, None, "compile: x"))
    ranked = rank(pruned, H100, Shape(4, 4096, 4096, 32))
    assert [r.pruned.survives for r in ranked] == [True, False, False]
    assert math.isinf(ranked[-1].predicted_ms) and math.isfinite(ranked[1].predicted_ms)


def test_ranking_orders_the_candidates_of_every_family_together(monkeypatch, other_family):
    monkeypatch.setattr(families, "FAMILIES", {"fwd_other": other_family, "fwd_sm80": SM80_FAMILY})
    space = search_space(AttentionSpec(head_dim=64, family=None, mask="causal"), SM90)
    registers = {"fwd_other": 200, "fwd_sm80": 96}  # the other family's kernels are fatter: fewer CTAs per SM
    ranked = rank([prune(c, fake_report(c, registers=registers[c.family]), H100) for c in space], H100,
                  Shape(4, 4096, 4096, 32))
    alive = survivors(ranked)
    assert [r.predicted_ms for r in alive] == sorted(r.predicted_ms for r in alive)
    assert {r.candidate.family for r in alive[:10]} == {"fwd_sm80"}  # each estimated by its own family's model
    assert {r.candidate.family for r in alive} == {"fwd_other", "fwd_sm80"}


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)
    assert math.isnan(spearman([1, 2], [1, 2]))
    with pytest.raises(ValueError):
        spearman([1], [1, 2])


def test_unknown_arch_and_bad_configs_are_refused():
    with pytest.raises(ValueError, match="arch='sm_70'"):
        targets.target("sm_70")
    with pytest.raises(SpecError, match="config.block_m=48"):
        AttentionSpec(head_dim=64, family="fwd_sm80", config={"block_m": 48})


def test_the_nvcc_worker_plans_again_and_returns_a_plan_error_as_its_verdict():
    from attngen.tune import resources

    problem = AttentionSpec(head_dim=256).problem
    verdict = resources._nvcc_report("fwd_sm80", problem, SM80, Sm80Config(256, 128, 8, 4))
    assert verdict.startswith("SpecError: config m256n128w8s4 needs ") and "shared memory" in verdict


def test_resource_reports_are_cached_per_nvcc_version_and_failures_are_retried(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    import attngen.build.nvcc
    from attngen.tune import resources

    space = search_space(AttentionSpec(head_dim=64, family="fwd_sm80",
                                       config={"block_m": 64, "block_n": 64, "num_warps": 4}), SM90)
    compiled, failing, version = [], {space[0].config}, ["13.0.88"]

    def fake_nvcc(family, problem, target, config):
        compiled.append(config)
        if config in failing:
            return "CompileError: nvcc was killed"
        return ResourceReport(config.label(), target.name, 128, 0, 0, 0, 0, 0)

    monkeypatch.setattr(resources, "_reports", {})
    monkeypatch.setattr(resources, "_nvcc_report", fake_nvcc)
    monkeypatch.setattr(resources, "process_pool", lambda jobs: ThreadPoolExecutor(2))
    monkeypatch.setattr(attngen.build.nvcc, "nvcc_version", lambda: version[0])
    first = resources.compile_reports(space)
    assert first[0] == "CompileError: nvcc was killed" and len(compiled) == len(space)
    failing.clear()
    again = resources.compile_reports(space)
    assert compiled[len(space):] == [space[0].config]  # only the failure is compiled again
    assert isinstance(again[0], ResourceReport) and again[1:] == first[1:]
    version[0] = "13.1.0"
    resources.compile_reports(space)
    assert len(compiled) == 2 * len(space) + 1  # another nvcc: every report again

