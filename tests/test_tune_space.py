"""The search space and the static pruning/ranking stage, with fake resource reports (no GPU, no nvcc)."""

from __future__ import annotations

import math

import pytest

from attngen.errors import SpecError
from attngen.masks import get_mask
from attngen.nvcc import ResourceReport
from attngen.plan import SMEM_LIMIT, make_plan
from attngen.spec import BLOCK_MS, BLOCK_NS, NUM_STAGES, NUM_WARPS, ROWS_PER_WARP, AttentionSpec
from attngen.tune.model import Occupancy, Shape, gpu_model, occupancy
from attngen.tune.ranking import Ranked, no_survivor_error, rank, survivors
from attngen.tune.report import plan_choices, spearman
from attngen.tune.resources import Pruned, prune
from attngen.tune.space import search_space, untiled

H100 = gpu_model("sm_90")


def fake_report(spec, registers=128, spills=0, static_smem=0) -> ResourceReport:
    plan = make_plan(spec)
    return ResourceReport(plan.name, plan.arch, registers, static_smem, 0, spills, spills, plan.smem_bytes)


def test_space_is_every_tile_the_spec_accepts():
    space = search_space(AttentionSpec(head_dim=64), "sm_90")
    expected = {(m, n, w, s) for m in BLOCK_MS for n in BLOCK_NS for w in NUM_WARPS for s in NUM_STAGES
                if m / w in ROWS_PER_WARP}
    assert {(c.spec.block_m, c.spec.block_n, c.spec.num_warps, c.spec.num_stages) for c in space} == expected
    assert len({c.label for c in space}) == len(space)
    assert all(c.launchable and c.spec.arch == "sm_90" for c in space)  # d64 always fits


def test_plan_rejections_stay_in_the_space_with_their_reason():
    space = search_space(AttentionSpec(head_dim=256), "sm_80")
    rejected = [c for c in space if not c.launchable]
    assert rejected and all("shared memory" in c.plan_error for c in rejected)
    for c in space:
        assert c.launchable == (c.plan is not None)
        if c.launchable:
            assert c.plan.smem_bytes <= SMEM_LIMIT["sm_80"]


def test_pinned_tile_fields_narrow_the_space_and_spec_arch_wins():
    spec = AttentionSpec(head_dim=128, block_n=64, num_stages=2, arch="sm_80")
    space = search_space(spec, "sm_90")
    assert {c.label for c in space} == {"m16n64w1s2", "m32n64w1s2", "m32n64w2s2", "m64n64w2s2", "m64n64w4s2",
                                        "m128n64w4s2", "m128n64w8s2", "m256n64w8s2"}
    assert {c.spec.arch for c in space} == {"sm_80"}
    assert untiled(space[0].spec).to_dict() == {k: v for k, v in spec.to_dict().items()
                                                if k not in ("block_n", "num_stages")}


def test_space_needs_a_spec():
    with pytest.raises(ValueError, match="spec must be"):
        search_space({"head_dim": 64}, "sm_90")


def test_plan_choices_show_what_the_plan_derives():
    spec = AttentionSpec(head_dim=128, block_m=128, block_n=128, num_warps=4, num_stages=1)
    text = plan_choices(make_plan(spec))
    assert "sub_n=64" in text and "block_m" not in text and "threads" not in text


# -- pruning --------------------------------------------------------------------------------
def candidate(**tile):
    spec = AttentionSpec(head_dim=64, **tile)
    return next(c for c in search_space(spec, "sm_90"))


def test_prune_verdicts():
    c = candidate(block_m=128, block_n=64, num_warps=4, num_stages=2)
    ok = prune(c, fake_report(c.spec, registers=168), H100)
    assert ok.survives and ok.occupancy == Occupancy(3, 12, "registers")
    assert "spills 8/8 B" in prune(c, fake_report(c.spec, spills=8), H100).reason
    assert prune(c, fake_report(c.spec, static_smem=200 * 1024), H100).reason.startswith("smem ")
    assert prune(c, "CompileError: nvcc failed", H100).reason == "compile: CompileError: nvcc failed"
    one_warp = candidate(block_m=16, block_n=128, num_warps=1, num_stages=4)
    low = prune(one_warp, fake_report(one_warp.spec, registers=200), H100)
    assert low.reason == "occupancy: 1 warps/SM < 4 schedulers (smem)"
    big = next(c for c in search_space(AttentionSpec(head_dim=256), "sm_80") if not c.launchable)
    assert prune(big, None, H100).reason.startswith("plan: ")


def test_occupancy_limits():
    # 255 registers x 4 warps: 8 warps per SM fit the register file (FA2's d128 tile).
    assert occupancy(H100, 128, 255, 100_000) == Occupancy(2, 8, "registers")
    assert occupancy(H100, 128, 64, 100 * 1024) == Occupancy(2, 8, "smem")
    assert occupancy(H100, 512, 16, 1024) == Occupancy(4, 64, "threads")
    assert occupancy(H100, 32, 16, 1024).ctas == 32
    assert occupancy(H100, 128, 64, 300 * 1024).ctas == 0


def test_no_survivors_is_an_error_that_says_why():
    c = candidate(block_m=128, block_n=64, num_warps=4, num_stages=2)
    ranked = rank([prune(c, fake_report(c.spec, spills=4), H100), prune(c, "CompileError: x", H100)], H100,
                  Shape(1, 1024, 1024, 16))
    assert survivors(ranked) == []
    message = no_survivor_error(c.spec, ranked)
    assert "1 by spills" in message and "1 by compile" in message and "m128n64w4s2" in message


# -- the model ------------------------------------------------------------------------------
def ranked_for(spec, registers=128, shape=Shape(4, 4096, 4096, 16)) -> Ranked:
    c = next(iter(search_space(spec, "sm_90")))
    return rank([prune(c, fake_report(c.spec, registers=registers), H100)], H100, shape)[0]


def test_model_grows_with_work_and_causal_halves_it():
    spec = AttentionSpec(head_dim=128, block_m=128, block_n=64, num_warps=4, num_stages=2)
    times = [ranked_for(spec, shape=Shape(16384 // s, s, s, 16)).predicted_ms for s in (1024, 4096, 16384)]
    assert times[0] < times[1] < times[2]  # same tokens, work ~ seqlen
    full = ranked_for(spec).predicted_ms
    causal = ranked_for(spec.replace(mask="causal")).predicted_ms
    assert 0.4 * full < causal < 0.75 * full
    flops = Shape(4, 4096, 4096, 16).flops(128, False)
    assert 100 < flops / full / 1e9 < 744  # TFLOP/s below the wgmma peak, above nonsense


def test_model_rewards_occupancy_rows_per_warp_and_pipelining():
    spec = AttentionSpec(head_dim=128, block_m=128, block_n=64, num_warps=4, num_stages=2)
    assert ranked_for(spec, registers=255).predicted_ms < ranked_for(spec.replace(num_stages=3), registers=255).predicted_ms
    assert ranked_for(spec, registers=128).predicted_ms <= ranked_for(spec, registers=255).predicted_ms
    two_tiles = ranked_for(spec, registers=128).predicted_ms  # 32 rows per warp: half the smem reads per MMA
    one_tile = ranked_for(spec.replace(num_warps=8), registers=128).predicted_ms
    assert two_tiles < one_tile
    assert ranked_for(spec.replace(num_stages=1), registers=128).predicted_ms > two_tiles


def test_model_sees_wave_tails():
    spec = AttentionSpec(head_dim=64, block_m=128, block_n=64, num_warps=4, num_stages=2)
    r = ranked_for(spec, registers=128)
    slots = r.estimate.slots
    full = ranked_for(spec, registers=128, shape=Shape(1, 128, 128, slots)).predicted_ms
    one_more = ranked_for(spec, registers=128, shape=Shape(1, 128, 128, slots + 1)).predicted_ms
    assert one_more > 1.8 * full - 0.01  # one CTA past a full wave costs a whole wave


def test_key_blocks_match_the_dense_mask():
    from attngen.tune.model import key_blocks

    spec = AttentionSpec(head_dim=64, mask="causal", block_m=64, block_n=32, num_warps=4, num_stages=2)
    plan = make_plan(spec)
    for sq, sk in ((1000, 1000), (300, 40), (129, 1000)):
        mask = get_mask("causal")
        got = key_blocks(plan, Shape(1, sq, sk, 1))
        for idx, m_block in enumerate(reversed(range(math.ceil(sq / 64)))):
            rows = range(m_block * 64, min(m_block * 64 + 64, sq))
            blocks = {k // 32 for q in rows for k in range(sk) if mask.dense_visible(q, k, sq, sk)}
            full = {n for n in blocks if all(mask.dense_visible(q, k, sq, sk) for q in rows
                                             for k in range(n * 32, n * 32 + 32)) and n * 32 + 32 <= sk}
            n_loaded, n_partial = got[idx]
            assert n_loaded == (max(blocks) + 1 if blocks else 0), (sq, sk, m_block)
            assert n_partial == n_loaded - len(full), (sq, sk, m_block)


def test_ranking_puts_survivors_first_in_predicted_order():
    spec = AttentionSpec(head_dim=64, block_m=128, block_n=64, num_stages=2)
    pruned = [prune(c, fake_report(c.spec, registers=r, spills=s), H100)
              for c, r, s in zip(search_space(spec, "sm_90"), (128, 128), (0, 8))]
    pruned.append(Pruned(pruned[0].candidate, None, None, "compile: x"))
    ranked = rank(pruned, H100, Shape(4, 4096, 4096, 32))
    assert [r.pruned.survives for r in ranked] == [True, False, False]
    assert math.isinf(ranked[-1].predicted_ms) and math.isfinite(ranked[1].predicted_ms)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833)
    assert math.isnan(spearman([1, 2], [1, 2]))
    with pytest.raises(ValueError):
        spearman([1], [1, 2])


def test_model_rejects_unknown_arch():
    with pytest.raises(ValueError, match="arch='sm_70'"):
        gpu_model("sm_70")
    with pytest.raises(SpecError):
        AttentionSpec(head_dim=64, block_m=48)


def test_resource_reports_are_cached_per_nvcc_version_and_failures_are_retried(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    import attngen.nvcc
    from attngen.tune import resources

    space = search_space(AttentionSpec(head_dim=64, block_m=64, block_n=64, num_warps=4), "sm_90")
    compiled, failing, version = [], set(c.spec for c in space[:1]), ["13.0.88"]

    def fake_report(spec, arch):
        compiled.append(spec)
        if spec in failing:
            return "CompileError: nvcc was killed"
        return ResourceReport(spec.tile.label(), arch, 128, 0, 0, 0, 0, 0)

    monkeypatch.setattr(resources, "_reports", {})
    monkeypatch.setattr(resources, "_nvcc_report", fake_report)
    monkeypatch.setattr(resources, "process_pool", lambda jobs: ThreadPoolExecutor(2))
    monkeypatch.setattr(attngen.nvcc, "nvcc_version", lambda: version[0])
    first = resources.compile_reports(space, "sm_90")
    assert first[0] == "CompileError: nvcc was killed" and len(compiled) == len(space)
    failing.clear()
    again = resources.compile_reports(space, "sm_90")
    assert compiled[len(space):] == [space[0].spec]  # only the failure is compiled again
    assert isinstance(again[0], ResourceReport) and again[1:] == first[1:]
    version[0] = "13.1.0"
    resources.compile_reports(space, "sm_90")
    assert len(compiled) == 2 * len(space) + 1  # another nvcc: every report again
