"""The tile list of a packed-sequence (varlen) call, for the forward families that tile per sequence:
what attngen/cuda/varlen_tiles.cuh's builder kernel needs launched and how much workspace it fills.

A call's list holds at most every sequence's query blocks, one of them ragged per sequence, and the
rows before the first sequence and after the last (two more segments); the workspace is a header of
4 ints, the segment table (an int4 per sequence and the two gaps) and the list (an int2 per entry)."""

from __future__ import annotations

import math

from attngen.codegen.abi import Abi
from attngen.families.base import ForwardCall, KernelPlan, Launch

# The builder is one CTA; a plan holds one builder kernel of each width and a call launches the narrowest
# that holds its sequences (more than the widest are taken in chunks of that many).
BUILD_WIDTHS = (256, 1024)


def num_seqs(call: ForwardCall) -> int:
    """The sequences packed in the call's q, k, v (cu_seqlens entries - 1)."""
    return call.input("cu_seqlens_q").shape[0] - 1


def build_threads(call: ForwardCall) -> int:
    """The builder CTA's threads for the call. The build is a chain of block-wide scans and barriers,
    each as long as the CTA is wide, so 16 sequences take 8 warps, not 32; narrower still, the tile
    loop (serial in each thread) costs more than the barriers save; a width fixed at compile time keeps
    the builder's loops unrolled (docs/perf-notes.md "The tile builder as wide as its sequences")."""
    return next((w for w in BUILD_WIDTHS if num_seqs(call) <= w), BUILD_WIDTHS[-1])


def builder_kernels(name: str, abi: Abi) -> tuple[KernelPlan, ...]:
    """The plan's builder kernels, one of each width (the template renders one per entry)."""
    return tuple(KernelPlan(f"{name}_tiles{width}", width, 0, abi) for width in BUILD_WIDTHS)


def builder_launch(name: str, call: ForwardCall, params: bytes) -> Launch:
    """The launch of the builder for the call's sequences (one CTA), before the forward kernel."""
    threads = build_threads(call)
    return Launch(f"{name}_tiles{threads}", (1, 1, 1), (threads, 1, 1), 0, params)


def capacity(block_m: int, call: ForwardCall) -> int:
    """The most entries the call's list can hold (query blocks of block_m rows)."""
    return math.ceil(call.seq_q / block_m) + num_seqs(call) + 2


def workspace_bytes(block_m: int, call: ForwardCall) -> int:
    """The header, the segment table and the list, in bytes."""
    return 16 + 16 * (num_seqs(call) + 2) + 8 * capacity(block_m, call)
