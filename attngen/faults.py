"""Deliberate kernel faults, for testing the tests: a fuzzer that cannot catch these is broken.

A fault is a template flag every kernel family honours: `family.plan(..., fault=...)` gives the
kernel its own symbol (`<name>_fault_<fault>`) and source, so it can never be served from the
cache in place of the correct kernel (tests/test_faults.py checks each registered family).
"""

from __future__ import annotations

FAULTS = {
    # The kernel never visits the last key block when it is partial (Sk % block_n != 0).
    "drop_last_partial_kv_tile": "ATTNGEN_FAULT_DROP_LAST_PARTIAL_KV_TILE",
}


def check_fault(fault: str | None) -> str | None:
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"fault={fault!r} is not a known fault; allowed: None or one of {sorted(FAULTS)}")
    return fault


def fault_macro(fault: str | None) -> str | None:
    """The preprocessor macro the template tests for, or None for a correct kernel."""
    return FAULTS[check_fault(fault)] if fault is not None else None
