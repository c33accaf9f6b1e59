"""Run one paged decode case through a decode runner and classify the result, as check.py does for
the forward: a kernel failure ("device", "crash", "output", "lse": check.FAILURE_KINDS) or an error
of the harness itself (check.HARNESS: out of memory making the inputs or in the float64 reference),
which stops a search instead of being shrunk. The comparison itself is paged.decode_failure's."""

from __future__ import annotations

import time

from attngen.errors import is_sticky_cuda_error
from attngen.fuzz.check import HARNESS, CaseResult
from attngen.fuzz.paged import DecodeCase, decode_failure, make_decode_inputs


def run_decode_case(case: DecodeCase, runner) -> CaseResult:
    start = time.perf_counter()
    kernel = runner.kernel_name(case.spec, case.page_size)

    def result(kind=None, detail=""):
        return CaseResult(case, kernel, time.perf_counter() - start, kind, detail)

    def harness_failure(stage: str, exc: Exception) -> CaseResult:
        message = f"{type(exc).__name__}: {exc}"
        # A sticky error surfacing here was raised by the kernel that ran before it.
        return result("device" if is_sticky_cuda_error(message) else HARNESS, f"{stage}: {message}")

    try:
        host = make_decode_inputs(case)
        x = host.to(runner.device)
    except Exception as exc:  # noqa: BLE001 - out of memory, typically
        return harness_failure("making the inputs", exc)
    try:
        out, lse = runner(x.q, x.k_cache, x.v_cache, x.cache_seqlens, page_table=x.page_table, spec=case.spec,
                          num_splits=case.num_splits, inputs=x.inputs or None, return_lse=True)
    except Exception as exc:  # noqa: BLE001 - whatever the decode raises is this case's failure
        message = f"{type(exc).__name__}: {exc}"
        return result("device" if is_sticky_cuda_error(message) else "crash", message)
    try:
        bad = decode_failure(case, host, out.cpu(), lse.cpu())
    except Exception as exc:  # noqa: BLE001 - the reference running out of memory, typically
        return harness_failure("checking the result", exc)
    return result() if bad is None else result(*bad)


def case_kernel_name(runner, case: DecodeCase) -> str:
    """The runner's name for the case's kernel, or the spec's key when naming it is what failed."""
    try:
        return runner.kernel_name(case.spec, case.page_size)
    except Exception:  # noqa: BLE001 - reporting a harness error must not raise another
        return f"spec {case.spec.key()}"
