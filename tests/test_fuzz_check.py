"""One case through the harness (CPU): correct runners pass, and each way of being wrong is caught and named."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from attngen import reference, tolerance
from attngen.errors import is_sticky_cuda_error
from attngen.families import plan_spec
from attngen.fuzz.case import LAYOUTS, FuzzCase
from attngen.fuzz.check import FAILURE_KINDS, HARNESS, run_case
from attngen.fuzz.runners import ReferenceRunner
from attngen.spec import AttentionSpec

CAUSAL = AttentionSpec(head_dim=64, dtype="bf16", mask="causal", gqa_ratio=2, family="fwd_sm80",
                       config=dict(block_m=16, block_n=16, num_warps=1, num_stages=2))
# Sq > Sk under bottom-right causal alignment: the first Sq - Sk rows see no key.
MASKED_ROWS = FuzzCase(CAUSAL, batch=2, seq_q=21, seq_k=9, heads_kv=2, data_seed=3)


class Broken(ReferenceRunner):
    """The reference, then `damage(spec, q, k, v, out, lse)` applied to its results."""

    def __init__(self, damage):
        self.damage = damage

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
        super().__call__(spec, q, k, v, out=out, lse=lse, softmax_scale=softmax_scale)
        self.damage(spec, q, k, v, out, lse)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("logit_scale", [1.0, 100.0])
def test_the_reference_passes_its_own_harness(layout, logit_scale):
    for case in (MASKED_ROWS, replace(MASKED_ROWS, seq_q=1, seq_k=40), replace(MASKED_ROWS, softmax_scale=0.5)):
        result = run_case(replace(case, layout=layout, logit_scale=logit_scale), ReferenceRunner())
        assert result.ok, result.describe()
        assert result.kernel == CAUSAL.name and result.seconds > 0


def _leave_last_row_unwritten(spec, q, k, v, out, lse):
    out[:, -1] = math.nan


def _write_past_the_output(spec, q, k, v, out, lse):
    # The element just after a contiguous output: inside the poisoned buffer, outside the tensor.
    torch.as_strided(out, (1,), (1,), out.storage_offset() + out.numel()).fill_(1.0)


def _zero_lse_of_masked_rows(spec, q, k, v, out, lse):
    lse[torch.isneginf(lse)] = 0.0


def _nan_in_lse(spec, q, k, v, out, lse):
    lse[0, 0, -1] = math.nan


def _raise(message):
    def damage(*args):
        raise RuntimeError(message)

    return damage


@pytest.mark.parametrize(
    "damage, kind, detail",
    [
        (_leave_last_row_unwritten, "output", "output has NaN/Inf"),
        (_write_past_the_output, "guard", "out's buffer was written outside the tensor"),
        (_zero_lse_of_masked_rows, "lse", "LSE -inf pattern differs"),
        (_nan_in_lse, "lse", "LSE has NaN"),
        (_raise("launch failed: too many resources"), "crash", "RuntimeError: launch failed"),
        (_raise("CUDA error: an illegal memory access was encountered"), "device", "illegal memory access"),
    ],
)
def test_each_kind_of_wrong_is_caught_and_named(damage, kind, detail):
    result = run_case(MASKED_ROWS, Broken(damage))
    assert result.kind == kind and detail in result.detail, result.describe()
    assert kind in FAILURE_KINDS and f"FAILED ({kind})" in result.describe()


def _perturb_output(factor):
    """Move every output element by `factor` times the tolerance bound (attngen.tolerance's formula)."""

    def damage(spec, q, k, v, out, lse):
        ref = reference.attention_for_spec(q, k, v, spec)
        bound = tolerance.output_bound(ref, q, k, v, spec.dtype, spec.effective_scale)
        out.copy_((ref.double() + factor * bound).to(out.dtype))

    return damage


def test_errors_within_the_bound_pass_and_beyond_it_fail():
    # Within: a quarter of the bound, plus the rounding of the result to bf16 (at most u|ref|).
    assert run_case(MASKED_ROWS, Broken(_perturb_output(0.25))).ok
    result = run_case(MASKED_ROWS, Broken(_perturb_output(3.0)))
    assert result.kind == "output" and "exceeds bound" in result.detail


def test_lse_errors_beyond_the_bound_fail():
    def damage(spec, q, k, v, out, lse):
        lse[0, 0, -1] += 1e-2

    result = run_case(MASKED_ROWS, Broken(damage))
    assert result.kind == "lse" and "exceeds bound" in result.detail


def test_sticky_cuda_errors_are_recognised_in_torch_and_cupy_spellings():
    assert is_sticky_cuda_error("CUDA error: an illegal memory access was encountered")
    assert is_sticky_cuda_error("CUDADriverError: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access")
    assert is_sticky_cuda_error("CUDA error: misaligned address")
    assert not is_sticky_cuda_error("CUDA error: out of memory")


class BrokenGrads(ReferenceRunner):
    """The reference's forward and gradients, then `damage(dq, dk, dv)` applied to the gradients."""

    def __init__(self, damage):
        self.damage = damage

    def backward(self, spec, q, k, v, out, lse, dout, *, dq, dk, dv, softmax_scale=None, inputs=None):
        super().backward(spec, q, k, v, out, lse, dout, dq=dq, dk=dk, dv=dv, softmax_scale=softmax_scale, inputs=inputs)
        self.damage(dq, dk, dv)


def test_the_gradients_are_checked_where_a_backward_family_runs():
    result = run_case(MASKED_ROWS, ReferenceRunner())
    assert result.ok and result.backward_kernel.startswith("bwd_sm90_"), result.describe()
    assert f"{result.kernel} + {result.backward_kernel}" in result.describe()
    d256 = replace(MASKED_ROWS, spec=AttentionSpec(head_dim=256, dtype="bf16", mask="causal", gqa_ratio=2))
    result = run_case(d256, ReferenceRunner())  # no backward family runs head_dim 256: the forward alone
    assert result.ok and result.backward_kernel is None


def _unwritten_dq_row(dq, dk, dv):
    dq[:, -1] = math.nan


def _write_past_dv(dq, dk, dv):
    torch.as_strided(dv, (1,), (1,), dv.storage_offset() + dv.numel()).fill_(0.0)


def _dk_off(dq, dk, dv):
    dk[0, 0, 0, 0] += 1.0


def _raise_in_backward(dq, dk, dv):
    raise RuntimeError("launch failed: too many resources")


@pytest.mark.parametrize("damage, kind, detail", [
    (_unwritten_dq_row, "grad", "dq has NaN/Inf"),
    (_write_past_dv, "guard", "dv's buffer was written outside the tensor"),
    (_dk_off, "grad", "dk"),
    (_raise_in_backward, "crash", "backward: RuntimeError: launch failed"),
])
def test_each_kind_of_wrong_gradient_is_caught_and_named(damage, kind, detail):
    result = run_case(MASKED_ROWS, BrokenGrads(damage))
    assert result.kind == kind and detail in result.detail, result.describe()


class OverreadsKeyTiles(ReferenceRunner):
    """Emulates a kernel that loads whole block_n tiles of K and V without clamping to Sk, and gives the
    keys past Sk zero probability: p = 0 times a V value read past the end. Harmless on finite data;
    0 * NaN is NaN."""

    def __call__(self, spec, q, k, v, *, out, lse, softmax_scale=None):
        block_n = plan_spec(spec, self.target).block_n
        B, Sk, H, D = k.shape
        rows = -(-Sk // block_n) * block_n
        k_tiles, v_tiles = (torch.as_strided(t, (B, rows, H, D), t.stride(), t.storage_offset()) for t in (k, v))
        scale = spec.effective_scale if softmax_scale is None else softmax_scale
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k_tiles.float()) * scale
        scores[..., Sk:] = -math.inf
        probs = torch.softmax(scores, dim=-1)
        out.copy_(torch.einsum("bhqk,bkhd->bqhd", probs, v_tiles.float()))
        lse.copy_(torch.logsumexp(scores, dim=-1))


@pytest.mark.parametrize("layout, batch, heads_kv", [("contiguous", 1, 2), ("transposed", 1, 2), ("padded", 2, 2)])
def test_a_key_tile_read_past_the_end_pulls_nan_into_the_output(layout, batch, heads_kv):
    spec = AttentionSpec(head_dim=64, dtype="fp16", family="fwd_sm80",
                         config=dict(block_m=16, block_n=64, num_warps=1, num_stages=2))
    case = FuzzCase(spec, batch=batch, seq_q=3, seq_k=65, heads_kv=heads_kv, layout=layout)  # 63 rows past Sk
    assert run_case(replace(case, seq_k=64), OverreadsKeyTiles()).ok  # a whole tile: nothing read past the end
    result = run_case(case, OverreadsKeyTiles())
    assert result.kind == "output" and "output has NaN/Inf" in result.detail, result.describe()


OUT_OF_MEMORY = "CUDA out of memory. Tried to allocate 12.00 GiB"


def _out_of_memory(*args, **kwargs):
    raise RuntimeError(OUT_OF_MEMORY)


def _float64_reference_out_of_memory(monkeypatch):
    """The harness's float64 reference runs out of memory (the reference runner's float32 one does not)."""
    attention_for_spec = reference.attention_for_spec

    def reference_oom(*args, compute_dtype=torch.float64, **kwargs):
        if compute_dtype == torch.float64:
            raise RuntimeError(OUT_OF_MEMORY)
        return attention_for_spec(*args, compute_dtype=compute_dtype, **kwargs)

    monkeypatch.setattr(reference, "attention_for_spec", reference_oom)


@pytest.mark.parametrize("stage, target", [("checking the result", None),
                                           ("making the inputs and outputs", "attngen.fuzz.check.make_inputs"),
                                           ("checking the result", "attngen.fuzz.case.Poisoned.written_outside")])
def test_an_error_in_the_harness_is_a_harness_error_not_a_kernel_failure(monkeypatch, stage, target):
    if target is None:
        _float64_reference_out_of_memory(monkeypatch)
    else:
        monkeypatch.setattr(target, _out_of_memory)
    result = run_case(MASKED_ROWS, ReferenceRunner())
    assert result.kind == HARNESS and result.harness_error and not result.ok and HARNESS not in FAILURE_KINDS
    assert result.detail == f"{stage}: RuntimeError: {OUT_OF_MEMORY}"
    assert "harness error (not a kernel failure)" in result.describe()


def test_a_sticky_error_surfacing_in_the_harness_is_the_kernels(monkeypatch):
    def sticky(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr("attngen.fuzz.case.Poisoned.written_outside", sticky)
    assert run_case(MASKED_ROWS, ReferenceRunner()).kind == "device"
