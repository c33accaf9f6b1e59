"""Run one case through a runner and hold the result to the float64 reference.

Checks, in order: the runner returned (no exception); nothing was written outside `out` or
`lse`; the output is finite, fully written (outputs start as NaN) and within the dtype's bound;
the LSE has -inf exactly on fully masked rows, no NaN, and is within its bound. The bounds are
attngen.tolerance's, stated once and derived from the numerics; nothing here loosens them.

An error in the harness's own work (making the poisoned buffers, the float64 reference, the
checks), out of memory say, is not a kernel failure: its result has kind HARNESS, and the search
stops on it instead of shrinking it.

Then, where a backward family runs the spec on the runner's target (runner.backward_name), the
gradients: from the runner's own out and LSE and a dout drawn from the case's seed, dq, dk and dv
(NaN-poisoned buffers in the case's layout) are checked like the output: nothing written outside,
every element written and finite, within tolerance.check_grads' bounds against float64 autograd of
the reference. Specs with dropout are not fuzzed (attngen/fuzz/command.py), and the gradients of
runtime inputs are checked by the GPU tests, not here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from attngen import reference, tolerance
from attngen.errors import is_sticky_cuda_error
from attngen.fuzz.case import (
    FuzzCase,
    make_backward_tensors,
    make_inputs,
    make_outputs,
    make_runtime_inputs,
)
from attngen.fuzz.runners import Runner

# What each kernel failure kind means; also the order in which the checks run.
FAILURE_KINDS = {
    "device": "the GPU raised a sticky error: the CUDA context is unusable for later cases in this process",
    "crash": "the runner raised an exception",
    "guard": "the kernel wrote outside its output tensors",
    "output": "the output is NaN/Inf, not fully written, or differs from the reference beyond the bound",
    "lse": "the LSE differs from the reference (value, -inf pattern or NaN)",
    "grad": "a gradient (dq, dk, dv) is NaN/Inf, not fully written, or differs from the reference beyond the bound",
}
# Not a kernel failure: the harness itself could not run or check the case.
HARNESS = "harness"
HARNESS_MEANING = "the harness itself failed (making inputs, the reference or the checks), not the kernel"


@dataclass(frozen=True)
class CaseResult:
    case: FuzzCase  # or a paged DecodeCase (attngen/fuzz/decode_check.py)
    kernel: str
    seconds: float
    kind: str | None = None  # a FAILURE_KINDS key or HARNESS; None when the case passed
    detail: str = ""
    backward_kernel: str | None = None  # the backward plan whose gradients were checked; None: not checked

    @property
    def ok(self) -> bool:
        return self.kind is None

    @property
    def harness_error(self) -> bool:
        """The case was not checked: the harness failed, so nothing is known about the kernel."""
        return self.kind == HARNESS

    def describe(self) -> str:
        status = ("ok" if self.ok else f"harness error (not a kernel failure): {self.detail}" if self.harness_error
                  else f"FAILED ({self.kind}): {self.detail}")
        kernels = self.kernel if self.backward_kernel is None else f"{self.kernel} + {self.backward_kernel}"
        return f"{kernels} {self.case.label()}: {status}"


def run_case(case: FuzzCase, runner: Runner) -> CaseResult:
    start = time.perf_counter()
    kernel = runner.kernel_name(case.spec)
    backward_kernel = None  # set once the gradients are being checked

    def result(kind=None, detail=""):
        return CaseResult(case, kernel, time.perf_counter() - start, kind, detail, backward_kernel)

    def harness_failure(stage: str, exc: Exception) -> CaseResult:
        message = f"{type(exc).__name__}: {exc}"
        # A sticky error surfacing here was raised by the kernel that ran before it.
        return result("device" if is_sticky_cuda_error(message) else HARNESS, f"{stage}: {message}")

    try:
        q, k, v = (p.view for p in make_inputs(case, runner.device))
        inputs = make_runtime_inputs(case, runner.device) or None
        out, lse = make_outputs(case, runner.device)
    except Exception as exc:  # noqa: BLE001 - out of memory, typically
        return harness_failure("making the inputs and outputs", exc)
    try:
        extra = {"inputs": inputs} if inputs else {}  # runners of specs without runtime inputs need not take them
        runner(case.spec, q, k, v, out=out.view, lse=lse.view, softmax_scale=case.softmax_scale, **extra)
    except Exception as exc:  # noqa: BLE001 - whatever the runner raises is this case's failure
        message = f"{type(exc).__name__}: {exc}"
        return result("device" if is_sticky_cuda_error(message) else "crash", message)
    try:
        for name, buffer in (("out", out), ("lse", lse)):
            where = buffer.written_outside()
            if where is not None:
                return result("guard", f"{name}'s buffer was written outside the tensor, at {where}")
        ref, ref_lse = reference.attention_for_spec(q, k, v, case.spec, softmax_scale=case.softmax_scale,
                                                    return_lse=True, inputs=inputs)
        bad = tolerance.check_output(out.view, ref, q, k, v, case.spec.dtype, case.scale)
        if bad is not None:
            return result("output", str(bad))
        bad = tolerance.check_lse(lse.view, ref_lse, q, k, case.scale)
        if bad is not None:
            return result("lse", str(bad))
    except Exception as exc:  # noqa: BLE001 - the reference running out of memory, typically
        return harness_failure("checking the result", exc)

    backward_name = getattr(runner, "backward_name", None)
    backward_kernel = None if backward_name is None else backward_name(case.spec)
    if backward_kernel is None:  # no backward family runs this spec here (head_dim 256, say)
        return result()
    try:
        dout, dq, dk, dv = make_backward_tensors(case, runner.device)
    except Exception as exc:  # noqa: BLE001
        return harness_failure("making the backward's tensors", exc)
    try:
        runner.backward(case.spec, q, k, v, out.view, lse.view, dout.view, dq=dq.view, dk=dk.view, dv=dv.view,
                        softmax_scale=case.softmax_scale, **extra)
    except Exception as exc:  # noqa: BLE001
        message = f"{type(exc).__name__}: {exc}"
        return result("device" if is_sticky_cuda_error(message) else "crash", f"backward: {message}")
    try:
        for name, buffer in (("dq", dq), ("dk", dk), ("dv", dv)):
            where = buffer.written_outside()
            if where is not None:
                return result("guard", f"{name}'s buffer was written outside the tensor, at {where}")
            if not bool(buffer.view.isfinite().all()):
                return result("grad", f"{name} has NaN/Inf (an element unwritten, or overflow)")
        spec = case.spec
        ref = reference.attention_grads(q, k, v, dout.view, mask=spec.mask, score_mod=spec.score_mod, sink=spec.sink,
                                        inputs=inputs, gqa_ratio=spec.gqa_ratio, softmax_scale=case.scale)
        bad = tolerance.check_grads((dq.view, dk.view, dv.view), ref, q, k, v, out.view, dout.view, spec.dtype,
                                    case.scale, lse=lse.view)
        if bad is not None:
            return result("grad", str(bad))
    except Exception as exc:  # noqa: BLE001
        return harness_failure("checking the gradients", exc)
    return result()
