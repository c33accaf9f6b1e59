"""The fuzzer on a GPU (marker `gpu`), for every kernel family that runs on it (conftest.py parametrizes
`gpu_family`): each family's kernels pass a short fuzz; a deliberately broken kernel (attngen/faults.py)
of each family is caught, shrunk to the minimal case and written as a reproducer that replays;
compute-sanitizer finds nothing in two kernels of each family, and a --replay --sanitize really
instruments the kernel this GPU launches."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from attngen import targets
from attngen.cli import main
from attngen.families import plan_spec
from attngen.fuzz.case import FuzzCase, is_packed
from attngen.fuzz.check import run_case
from attngen.fuzz.pool import builtin_specs
from attngen.fuzz.reproducer import load_reproducer, replay, reproducer_dir, write_reproducer
from attngen.fuzz.runners import KernelRunner, Machine
from attngen.fuzz.sanitizer import find_compute_sanitizer, sanitize
from attngen.fuzz.search import search
from attngen.fuzz.strategies import Limits
from attngen.runtime import dispatch
from attngen.spec import AttentionSpec

pytestmark = pytest.mark.gpu

FAULT = "drop_last_partial_kv_tile"
# Shorter than the tool's defaults, so the test takes seconds; the regimes are the same.
LIMITS = Limits(max_seq=1100, max_long_seq_k=4500, max_score_elements=2**24, max_input_elements=2**23)


def family_specs(gpu_family: str, runner) -> list[AttentionSpec]:
    """The built-in pool's specs pinned to the family, for the runner's target; the first has no mask."""
    specs = [spec for spec in builtin_specs(runner.target) if spec.family == gpu_family]
    assert specs and specs[0].mask == "none", specs[:1]
    return specs


def test_real_kernels_pass_a_short_fuzz(gpu_family):
    runner = KernelRunner()
    specs = family_specs(gpu_family, runner)
    # The pool's kernels built at once, as `attngen fuzz` does: built one by one inside the search, a cold
    # cache kept this test silent for minutes (docs/perf-notes.md "The GPU tests' silent minutes").
    runner.compile_ahead(specs)
    outcome = search(specs, runner, examples=600, seed=0, limits=LIMITS)
    assert outcome.failure is None, outcome.failure.describe()
    assert outcome.cases == 600 and set(outcome.kernels) == {runner.kernel_name(s) for s in specs}
    assert all(name.startswith(f"{gpu_family}_") for name in outcome.kernels)


def test_the_regimes_beyond_two_lengths_pass_a_short_fuzz(gpu_family):
    """The pool's specs of packed documents (both ways), position offsets and block states, alone:
    more cases each than the whole pool's short fuzz gives them."""
    runner = KernelRunner()
    specs = [spec for spec in family_specs(gpu_family, runner)
             if is_packed(spec) or "kv_offset" in spec.mask or spec.mask.startswith("block_mask_state[")]
    assert len(specs) >= 6 + 4 * (gpu_family == "fwd_sm90"), [spec.mask for spec in specs]
    runner.compile_ahead(specs)
    outcome = search(specs, runner, examples=400, seed=1, limits=LIMITS)
    assert outcome.failure is None, outcome.failure.describe()
    assert set(outcome.kernels) == {runner.kernel_name(s) for s in specs}


def test_fault_changes_exactly_the_cases_with_a_partial_last_key_tile(gpu_family):
    runner = KernelRunner(fault=FAULT)
    spec = family_specs(gpu_family, runner)[0]  # no mask: every query block's keys end at Sk
    block_n = plan_spec(spec, runner.target).block_n
    assert run_case(FuzzCase(spec, batch=1, seq_q=300, seq_k=2 * block_n, heads_kv=2), runner).ok
    result = run_case(FuzzCase(spec, batch=1, seq_q=300, seq_k=2 * block_n + 1, heads_kv=2), runner)
    assert result.kind in ("output", "lse"), result.describe()


def test_broken_kernel_is_caught_shrunk_and_replayable(gpu_family, tmp_path):
    runner = KernelRunner(fault=FAULT)
    specs = family_specs(gpu_family, runner)
    outcome = search(specs, runner, examples=200, seed=0, limits=LIMITS)
    assert outcome.failure is not None and outcome.shrunk, "the fuzzer missed a kernel that drops key tiles"
    failure = outcome.failure
    assert failure.kind in ("output", "lse") and failure.kernel.endswith(f"_fault_{FAULT}")
    assert failure.kernel.startswith(f"{gpu_family}_")
    # The smallest case there is: one query against one key, in the first spec's only (partial) key tile.
    minimal = FuzzCase(specs[0], batch=1, seq_q=1, seq_k=1, heads_kv=1)
    assert failure.case == minimal, failure.describe()

    path = write_reproducer(reproducer_dir(tmp_path, failure.case, failure.kernel), failure.case,
                            kernel=failure.kernel, machine=runner.machine, fault=FAULT, failure=failure)
    repro = load_reproducer(path)
    assert repro.case.spec.family == gpu_family  # spec.yaml keeps the pinned family
    again, warnings = replay(repro, runner)
    assert again.kind == failure.kind and warnings == []
    assert replay(repro, KernelRunner())[0].ok  # the correct kernel passes the same case


def test_cli_reports_the_broken_kernel_and_its_replay_fails(tmp_path):
    result = CliRunner().invoke(main, ["fuzz", "--examples", "50", "--seed", "0", "--max-seq-len", "600", "--out",
                                       str(tmp_path), "--fault", FAULT])
    assert result.exit_code == 1, result.output
    path = re.search(r"replay it with:\n  attngen fuzz --replay (\S+)", result.output).group(1)
    replayed = CliRunner().invoke(main, ["fuzz", "--replay", path])
    assert replayed.exit_code == 1 and replayed.output.startswith("FAIL"), replayed.output
    clean = CliRunner().invoke(main, ["fuzz", "--examples", "50", "--seed", "0", "--max-seq-len", "600", "--out",
                                      str(tmp_path / "clean")])
    assert clean.exit_code == 0, clean.output


@pytest.mark.skipif(find_compute_sanitizer() is None, reason="compute-sanitizer not found")
def test_sanitizer_is_clean_on_two_kernels(gpu_family, tmp_path):
    runner = KernelRunner()
    samples = []
    # One without a mask, one causal with GQA (the pool's first of each); partial tiles, padded strides.
    specs = family_specs(gpu_family, runner)
    causal = next((spec for spec in specs if spec.mask == "causal" and spec.gqa_ratio > 1), None)
    assert causal is not None, "the built-in pool has no causal spec with GQA"
    for spec in (specs[0], causal):
        case = FuzzCase(spec, batch=2, seq_q=77, seq_k=45, heads_kv=2, layout="padded", data_seed=1)
        kernel = runner.kernel_name(spec)
        samples.append((kernel, write_reproducer(reproducer_dir(tmp_path, case, kernel), case, kernel=kernel,
                                                 machine=runner.machine)))
    assert samples[1][0].startswith(f"{gpu_family}_causal_")
    results = sanitize(samples, timeout=600)
    assert len(results) == 6  # two kernels x memcheck, racecheck, synccheck
    for r in results:
        assert r.clean, f"{r.tool} {r.kernel}: {r.finding}\n{r.report.excerpt or r.output_tail}"


def test_runner_machine_is_the_compile_target_of_the_device_it_compiles_for():
    import torch

    runner = KernelRunner()
    spec = AttentionSpec(head_dim=64, dtype="fp16")  # unpinned: the dispatcher's choice for this GPU
    assert runner.device == f"cuda:{torch.cuda.current_device()}"
    kernel = dispatch.compile(spec, runner.device_index)
    assert runner.target == targets.device_target(runner.device_index) == kernel.plan.target
    assert runner.machine.target == runner.target.name and runner.kernel_name(spec) == kernel.plan.name
    assert runner.machine.gpu == torch.cuda.get_device_name(runner.device_index)
    assert runner.machine.nvrtc.startswith("nvrtc-")
    runner(spec, *(torch.randn(1, 5, 1, 64, device=runner.device, dtype=torch.float16) for _ in "qkv"),
           out=torch.empty(1, 5, 1, 64, device=runner.device, dtype=torch.float16),
           lse=torch.empty(1, 1, 5, device=runner.device))
    assert runner.launched == [kernel.plan.name]


@pytest.mark.skipif(find_compute_sanitizer() is None, reason="compute-sanitizer not found")
def test_replay_sanitize_instruments_the_kernel_this_gpu_launches(gpu_family, tmp_path):
    # A reproducer recorded elsewhere, under another kernel name: the sanitizer must still instrument
    # (and see launched) the kernel this GPU compiles, here with the fault the command line gives.
    runner = KernelRunner(fault=FAULT)
    spec = family_specs(gpu_family, runner)[0]
    case = FuzzCase(spec, batch=1, seq_q=33, seq_k=plan_spec(spec, runner.target).block_n + 7, heads_kv=1,
                    data_seed=2)
    path = write_reproducer(reproducer_dir(tmp_path, case, "x"), case, kernel="fwd_recorded_elsewhere",
                            machine=Machine("sm_86", "another GPU", "nvrtc-0.0"))
    result = CliRunner().invoke(main, ["fuzz", "--replay", str(path), "--sanitize", "--fault", FAULT])
    kernel = runner.kernel_name(spec)
    # The fault makes the replay fail (exit 1: a kernel finding), and the sanitizer instrumented the faulty kernel.
    assert result.exit_code == 1 and f"launched kernel {kernel}" in result.output, result.output
    assert "never launched" not in result.output and f"kns={kernel}" in result.output
    assert "recorded with GPU another GPU" in result.output and "recorded with compile target sm_86" in result.output
