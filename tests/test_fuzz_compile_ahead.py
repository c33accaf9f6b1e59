"""The fuzz pool's kernels built before its first case (attngen/fuzz/compile_ahead.py)."""

from __future__ import annotations

import pytest

from attngen import targets
from attngen.fuzz import command
from attngen.fuzz.compile_ahead import compile_ahead, decode_plans, forward_plans
from attngen.fuzz.runners import ReferenceRunner
from attngen.spec import AttentionSpec

SM90 = targets.target("sm_90a")
SMALL = dict(block_m=32, block_n=16, num_warps=2, num_stages=2)
POOL = [AttentionSpec(head_dim=64, dtype="fp16", family="fwd_sm80", config=SMALL),
        AttentionSpec(head_dim=64, dtype="fp16", mask="causal", family="fwd_sm80", config=SMALL),
        AttentionSpec(head_dim=64, dtype="fp16", mask="causal", family="fwd_sm80", config=SMALL)]  # a repeat


def _nvrtc() -> bool:
    try:
        from attngen.build.compiler import nvrtc_version

        nvrtc_version()
        return True
    except Exception:  # noqa: BLE001 - CuPy or libnvrtc missing: the test says so
        return False


def test_a_case_runs_its_forward_plan_and_its_backward_plan_where_one_runs_it():
    hopper = AttentionSpec(head_dim=64, dtype="fp16", mask="causal", family="fwd_sm90")
    found = forward_plans(POOL[0], SM90, None)
    assert set(found) == {"forward", "backward"} and found["forward"].name == ReferenceRunner().kernel_name(POOL[0])
    assert found["backward"].name == ReferenceRunner().backward_name(POOL[0])
    faulty, sound = (forward_plans(hopper, SM90, fault)["forward"].name
                     for fault in ("drop_last_partial_kv_tile", None))
    assert faulty != sound  # a deliberately broken kernel is a kernel of its own


@pytest.mark.skipif(not _nvrtc(), reason="NVRTC (CuPy + libnvrtc) not available")
def test_every_plan_of_the_pool_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    names = {plan.name for spec in POOL for plan in forward_plans(spec, SM90, None).values()}
    first = compile_ahead(POOL, SM90, None, jobs=2)
    assert (first.kernels, first.failed, first.jobs) == (len(names), 0, 2)
    assert {p.name.split("-sm_90a-")[0] for p in tmp_path.glob("*.cubin")} == names
    again = compile_ahead(POOL, SM90, None, jobs=2)  # found in the cache
    assert (again.kernels, again.failed) == (len(names), 0)
    assert "compiled 4 kernels ahead in" in again.line() and "failed" not in again.line()


def test_a_decode_case_runs_one_plan_per_kind_of_cache():
    from attngen.fuzz.decode_runners import ReferenceDecodeRunner

    spec = AttentionSpec(head_dim=64, dtype="fp16", gqa_ratio=2, mask="causal")
    found = decode_plans(spec, SM90)
    assert {size: plan.name for size, plan in found.items()} == {
        size: ReferenceDecodeRunner().kernel_name(spec, size) for size in (16, 256, None)}
    assert len({plan.name for plan in found.values()}) == 3  # pages of rows, of whole blocks, contiguous


@pytest.mark.skipif(not _nvrtc(), reason="NVRTC (CuPy + libnvrtc) not available")
def test_the_decode_plans_are_built_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    spec = AttentionSpec(head_dim=64, dtype="fp16", gqa_ratio=2, mask="causal")
    built = compile_ahead([spec, spec], SM90, regime="decode", jobs=2)
    assert (built.kernels, built.failed) == (3, 0)
    assert {p.name.split("-sm_90a-")[0] for p in tmp_path.glob("*.cubin")} == {
        plan.name for plan in decode_plans(spec, SM90).values()}


def test_only_runs_with_a_case_per_spec_and_real_kernels_build_ahead():
    class Builds(ReferenceRunner):
        def compile_ahead(self, pool):
            from attngen.fuzz.compile_ahead import CompiledAhead

            return CompiledAhead(len(pool), 1, 2.5, 4)

    assert command.compile_ahead_line(POOL, ReferenceRunner(), 100) is None  # the CPU reference has no kernels
    assert command.compile_ahead_line(POOL, Builds(), 2) is None  # fewer cases than specs: built as drawn
    assert command.compile_ahead_line(POOL, Builds(), 3) == ("  compiled 3 kernels ahead in 2.5 s (4 processes), 1 "
                                                         "failed (their cases report it)")


def test_the_run_says_what_it_built_after_its_header(monkeypatch):
    from click.testing import CliRunner

    from attngen.cli import main
    from attngen.fuzz.compile_ahead import CompiledAhead

    class Builds(ReferenceRunner):
        def compile_ahead(self, pool):
            return CompiledAhead(len(pool), 0, 1.0, 2)

    monkeypatch.setattr(command, "make_runner", lambda fault: Builds())
    result = CliRunner().invoke(main, ["fuzz", "--family", "fwd_sm80", "--examples", 40, "--seed", 0,
                                       "--max-seq-len", 8, "--time-budget", 30])
    assert result.exit_code == 0, result.output
    header, families, built = result.output.splitlines()[:3]
    assert header.startswith("attngen fuzz: ") and families.startswith("  target sm_90a, families fwd_sm80: ")
    assert built.startswith("  compiled ") and built.endswith(" kernels ahead in 1.0 s (2 processes)")
