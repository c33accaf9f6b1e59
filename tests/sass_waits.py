"""SASS checks of kernels launched early (programmatic dependent launches, sm_90): each waits for the
kernel before it (griddepcontrol.wait, SASS ACQBULK) on every path from its entry, before it touches
global memory. Read from `cuobjdump -sass` text (attngen.build.nvcc.sass)."""
from __future__ import annotations

import re

# Instructions that touch global memory (loads, stores, cp.async, TMA, atomics, generic accesses).
GLOBAL_ACCESS = re.compile(r"\b(LDG|STG|LDGSTS|UTMALDG|UTMASTG|UBLKCP|RED|ATOM|ATOMG|LD|ST)(\.|\s)")
# Hints that may come before the wait: reads past L1 (ld.global.cg; a line read before the wait must
# not be found in L1 after it) and L2 prefetches (UTMAPF, never a fault: TMA drops what is out of bounds).
HINT_READ = re.compile(r"\bLDG\.E(\.\d+)?\.STRONG\.GPU\b")
ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/")
# "/*02c0*/  @!P0 BRA 0xe70 ;" or "BRA.U !UP0, 0xe70": a branch's address and its target, the predicate
# before the opcode or as its first operand.
BRANCH = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA(?:\.[\w.]+)?\s+(?:!?U?P\w+,\s*)?(0x[0-9a-f]+)")


def functions(sass: str) -> dict[str, str]:
    """Each kernel's SASS by its symbol."""
    return dict(f.split(maxsplit=1) for f in re.split(r"Function : ", sass)[1:])


def before_the_wait(name: str, body: str, hints: bool = False) -> str:
    """The instructions before the kernel's wait, asserting that every path from the entry reaches the
    wait (no EXIT before it, no branch before it jumping past it) and that nothing before it touches
    global memory (but the hints, where allowed)."""
    parts = body.split("ACQBULK", 1)
    assert len(parts) == 2, f"{name}: no griddepcontrol.wait"
    before = parts[0]
    wait_at = int(ADDRESS.findall(before)[-1], 16)  # the ACQBULK's own address
    assert "EXIT" not in before, f"{name}: a path ends before the wait"
    for at, target in BRANCH.findall(before):
        assert int(target, 16) <= wait_at, f"{name}: the branch at 0x{at} jumps past the wait"
    touched = GLOBAL_ACCESS.search(HINT_READ.sub("", before) if hints else before)
    assert not touched, f"{name}: global memory touched before the wait ({touched.group(0).strip()})"
    return before
