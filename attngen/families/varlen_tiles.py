"""The tile list of a packed-sequence (varlen) call, for the forward families that tile per sequence:
what attngen/cuda/varlen_tiles.cuh's builder kernel needs launched and how much workspace it fills.

A call's list holds at most every sequence's query blocks, one of them ragged per sequence, and the
rows before the first sequence and after the last (two more segments); the workspace is a header of
4 ints, the segment table (an int4 per sequence and the two gaps) and the list (an int2 per entry)."""

from __future__ import annotations

import math

from attngen.families.base import ForwardCall

BUILD_THREADS = 1024  # varlen_tiles.cuh BUILD_THREADS: the builder is one CTA of these


def num_seqs(call: ForwardCall) -> int:
    """The sequences packed in the call's q, k, v (cu_seqlens entries - 1)."""
    return call.input("cu_seqlens_q").shape[0] - 1


def capacity(block_m: int, call: ForwardCall) -> int:
    """The most entries the call's list can hold (query blocks of block_m rows)."""
    return math.ceil(call.seq_q / block_m) + num_seqs(call) + 2


def workspace_bytes(block_m: int, call: ForwardCall) -> int:
    """The header, the segment table and the list, in bytes."""
    return 16 + 16 * (num_seqs(call) + 2) + 8 * capacity(block_m, call)
