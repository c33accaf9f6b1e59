"""The search on the CPU, with the reference as the thing under test and deliberately broken runners:
correct code passes; a kernel that drops the last partial key tile is found, shrunk to the minimal
case, written as a reproducer and replayed; budgets, determinism and sticky GPU errors behave."""

from __future__ import annotations

import math
import time

import pytest
import torch

from attngen import targets
from attngen.errors import SpecError
from attngen.families import plan_spec
from attngen.fuzz.case import FuzzCase
from attngen.fuzz.reproducer import load_reproducer, replay, reproducer_dir, write_reproducer
from attngen.fuzz.runners import ReferenceRunner
from attngen.fuzz.search import search
from attngen.fuzz.strategies import DEFAULT_LIMITS, first_cases
from attngen.masks import get_mask
from attngen.spec import AttentionSpec

SPECS = (
    AttentionSpec(head_dim=64, dtype="fp16", family="fwd_sm80",
                  config=dict(block_m=32, block_n=16, num_warps=2, num_stages=2)),
    AttentionSpec(head_dim=64, dtype="bf16", mask="causal", gqa_ratio=2, family="fwd_sm80",
                  config=dict(block_m=16, block_n=32, num_warps=1, num_stages=2)),
)
LIMITS = DEFAULT_LIMITS.up_to(72)


def _attention_over_first_keys(spec, q, k, v, scale, kept):
    """The reference's semantics (mask alignment from the full Sk), with keys >= kept never visited."""
    Sq, Sk = q.shape[1], k.shape[1]
    kk, vv = (t.double().repeat_interleave(spec.gqa_ratio, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    q_idx, k_idx = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
    visible = torch.as_tensor(get_mask(spec.mask).dense_visible(q_idx, k_idx, Sq, Sk)) & (k_idx < kept)
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])
    return torch.einsum("bhqk,bkhd->bqhd", probs, vv), lse


class DropsLastPartialKeyTile(ReferenceRunner):
    """A kernel whose key loop stops at the last full block_n tile, once there is one (the GPU fault
    `drop_last_partial_kv_tile`, emulated): the smallest failing case has Sk = block_n + 1."""

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
        block_n = plan_spec(spec, self.target).block_n
        kept = k.shape[1] - k.shape[1] % block_n
        if not 0 < kept < k.shape[1]:
            return super().__call__(spec, q, k, v, out=out, lse=lse, softmax_scale=softmax_scale)
        scale = spec.effective_scale if softmax_scale is None else softmax_scale
        o, l = _attention_over_first_keys(spec, q, k, v, scale, kept)
        out.copy_(o)
        lse.copy_(l)


class Counting(ReferenceRunner):
    def __init__(self, fail_when=lambda case_args: False, message="wrong", sleep=0.0):
        self.calls, self.fail_when, self.message, self.sleep = 0, fail_when, message, sleep

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
        self.calls += 1
        time.sleep(self.sleep)
        if self.fail_when((self.calls, q.shape[1], k.shape[1])):
            raise RuntimeError(self.message)
        super().__call__(spec, q, k, v, out=out, lse=lse, softmax_scale=softmax_scale)


def test_correct_runner_passes_every_case_and_stats_add_up():
    runner = ReferenceRunner()
    outcome = search(SPECS, runner, examples=60, seed=1, limits=LIMITS)
    assert outcome.failure is None and outcome.stopped == "examples" and outcome.cases == 60
    assert sum(s.cases for s in outcome.kernels.values()) == 60
    assert set(outcome.kernels) == {runner.kernel_name(spec) for spec in SPECS}
    assert all(s.sample is not None and s.failures == 0 for s in outcome.kernels.values())
    assert outcome.throughput > 0


def test_every_spec_runs_in_a_search_with_as_many_cases_as_specs():
    specs = [AttentionSpec(head_dim=d, dtype=dtype, mask=mask, family="fwd_sm80")
             for d in (64, 128) for dtype in ("fp16", "bf16") for mask in ("none", "causal")]
    runner = ReferenceRunner()
    outcome = search(specs, runner, examples=len(specs), seed=0, limits=LIMITS)
    assert outcome.failure is None and outcome.cases == len(specs)
    assert set(outcome.kernels) == {runner.kernel_name(spec) for spec in specs}


def test_a_run_is_a_function_of_its_seed():
    def cases(seed):
        seen = []
        search(SPECS, ReferenceRunner(), examples=25, seed=seed, limits=LIMITS,
               on_case=lambda result, outcome, shrinking: seen.append(result.case))
        return seen

    assert cases(5) == cases(5)
    assert cases(5) != cases(6)


def test_dropped_partial_key_tile_is_found_and_shrunk_to_the_minimal_case(tmp_path):
    runner = DropsLastPartialKeyTile()
    outcome = search(SPECS, runner, examples=300, seed=0, limits=LIMITS)
    assert outcome.stopped == "failure" and outcome.shrunk and outcome.failure.kind in ("output", "lse")
    block_n = plan_spec(SPECS[0], runner.target).block_n
    assert outcome.failure.case == FuzzCase(SPECS[0], batch=1, seq_q=1, seq_k=block_n + 1, heads_kv=1)
    assert outcome.cases < 300 and outcome.shrink_steps > 0
    # Found by the explicit first case of the spec (Sk = block_n + 1), which hypothesis does not
    # shrink: the search of that spec alone found and shrank it.
    assert outcome.first_failure.case == first_cases(SPECS, LIMITS, runner.target)[0]

    # The reproducer replays the same failure with the broken runner and passes with a correct one.
    failure = outcome.failure
    path = write_reproducer(reproducer_dir(tmp_path, failure.case, failure.kernel), failure.case,
                            kernel=failure.kernel, machine=runner.machine, failure=failure)
    repro = load_reproducer(path)
    assert repro.case == failure.case and repro.failure["kind"] == failure.kind
    again, warnings = replay(repro, runner)
    assert not again.ok and again.kind == failure.kind and again.detail == failure.detail and warnings == []
    assert replay(repro, ReferenceRunner())[0].ok


def test_time_budget_stops_the_search():
    start = time.monotonic()
    outcome = search(SPECS, Counting(sleep=0.05), examples=10_000, seed=2, time_budget=0.5, limits=LIMITS)
    assert outcome.stopped == "time budget" and outcome.failure is None
    assert 1 <= outcome.cases < 15 and time.monotonic() - start < 2  # within about one case of the budget


def test_sticky_gpu_error_is_reported_unshrunk_and_nothing_runs_after_it():
    runner = Counting(fail_when=lambda args: args[2] > 20, message="CUDA error: an illegal memory access was encountered")
    outcome = search(SPECS, runner, examples=300, seed=3, limits=LIMITS)
    assert outcome.failure.kind == "device" and not outcome.shrunk
    assert outcome.failure is outcome.first_failure and outcome.failure.case.seq_k > 20
    assert runner.calls == outcome.cases  # no case ran after the error, shrink steps included


def test_a_failure_that_does_not_repeat_is_reported_as_flaky():
    runner = Counting(fail_when=lambda args: args[0] == 5, message="transient")
    outcome = search(SPECS, runner, examples=100, seed=4, limits=LIMITS)
    assert outcome.flaky and outcome.failure.kind == "crash" and "transient" in outcome.failure.detail


def test_sticky_gpu_error_while_shrinking_another_failure_wins():
    failed_once = []

    def fail_when(args):
        calls, _, seq_k = args
        if failed_once and seq_k < 30:
            raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered")
        if seq_k >= 30:
            failed_once.append(calls)
            return True
        return False

    runner = Counting(fail_when=fail_when, message="wrong")
    outcome = search(SPECS, runner, examples=300, seed=5, limits=LIMITS)
    assert outcome.first_failure.kind == "crash" and outcome.failure.kind == "device"
    assert not outcome.shrunk and not outcome.flaky and outcome.failure is outcome.device_error
    assert runner.calls == outcome.cases + outcome.shrink_steps  # nothing ran after the device error


def _reference_runs_out_of_memory_when(monkeypatch, too_big):
    """The harness's float64 reference raises out-of-memory for cases with `too_big(seq_k)`."""
    from attngen import reference

    attention_for_spec = reference.attention_for_spec

    def reference_oom(q, k, v, spec, *args, compute_dtype=torch.float64, **kwargs):
        if compute_dtype == torch.float64 and too_big(k.shape[1]):
            raise RuntimeError("CUDA out of memory. Tried to allocate 40.00 GiB")
        return attention_for_spec(q, k, v, spec, *args, compute_dtype=compute_dtype, **kwargs)

    monkeypatch.setattr(reference, "attention_for_spec", reference_oom)


def test_a_harness_error_stops_the_search_unshrunk_and_is_no_kernel_failure(monkeypatch):
    _reference_runs_out_of_memory_when(monkeypatch, lambda seq_k: seq_k > 40)
    runner = Counting()
    outcome = search(SPECS, runner, examples=300, seed=6, limits=LIMITS)
    assert outcome.stopped == "harness error" and outcome.harness_error.kind == "harness"
    assert outcome.harness_error.case.seq_k > 40 and "out of memory" in outcome.harness_error.detail
    assert outcome.failure is None and outcome.shrink_steps == 0 and runner.calls == outcome.cases
    assert sum(s.failures for s in outcome.kernels.values()) == 0


def test_a_harness_error_while_shrinking_keeps_the_kernel_failure_found(monkeypatch):
    failed = []
    _reference_runs_out_of_memory_when(monkeypatch, lambda seq_k: bool(failed) and seq_k < 30)
    runner = Counting(fail_when=lambda args: args[2] >= 30 and not failed.append(args), message="wrong")
    outcome = search(SPECS, runner, examples=300, seed=5, limits=LIMITS)
    assert outcome.stopped == "harness error" and outcome.harness_error.case.seq_k < 30
    assert outcome.failure.kind == "crash" and outcome.failure.case.seq_k >= 30 and not outcome.shrunk


def test_an_unexpected_exception_in_a_case_is_a_harness_error(monkeypatch):
    def broken_harness(case, runner):
        raise AssertionError("a bug in the harness")

    monkeypatch.setattr("attngen.fuzz.search.run_case", broken_harness)
    outcome = search(SPECS, ReferenceRunner(), examples=10, seed=0, limits=LIMITS)
    assert outcome.stopped == "harness error" and outcome.cases == 1
    assert outcome.harness_error.detail == "AssertionError: a bug in the harness"


def test_a_spec_the_runners_target_cannot_plan_is_refused_before_any_case_runs(sm90a_only_family):
    runner = Counting()
    runner.target = targets.target("sm_80")  # an A100 (the reference stands in for its kernels)
    spec = SPECS[0].replace(family=sm90a_only_family.name)
    with pytest.raises(SpecError, match=rf"family='{sm90a_only_family.name}' cannot run .* on sm_80: needs sm_90a"):
        search([SPECS[1], spec], runner, examples=5, seed=0, limits=LIMITS)
    assert runner.calls == 0


def test_a_runner_that_cannot_name_a_kernel_is_a_harness_error():
    class Unnamed(ReferenceRunner):
        def kernel_name(self, spec):
            raise RuntimeError("no name")

    outcome = search(SPECS, Unnamed(), examples=5, seed=0, limits=LIMITS)
    assert outcome.stopped == "harness error" and outcome.cases == 1
    assert outcome.harness_error.kernel.startswith("spec {") and outcome.harness_error.detail == "RuntimeError: no name"
