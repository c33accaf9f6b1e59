"""Philox4x32-10 in numpy, and the dropout keep mask it defines (docs/dropout.md, "The mapping").

The kernels draw dropout's random bits with attngen/cuda/philox.cuh; this module computes the same
bits on the host, vectorised over uint32 arrays, so attngen.reference can materialise a call's exact
keep mask for small shapes. Philox4x32-10 is Random123's (Salmon et al., SC11): a 4 x 32-bit counter
and a 2 x 32-bit key through 10 rounds; tests/test_dropout.py holds it to Random123's published
known-answer vectors (tests/kat_vectors of github.com/DEShawResearch/random123).

The mapping, a pure function of (seed, offset, b, h, i, j) with i the query row and j the key:
  key     = (seed mod 2^32, seed >> 32 mod 2^32)       seed as an unsigned 64-bit integer
  counter = ((j >> 5) * 8 + (j & 7),                   the key columns j' = j (mod 8) of j's 32-key span
             (i >> 5) * 8 + (i & 7),                   the query rows i' = i (mod 8) of i's 32-row span
             b * 65536 + h,
             offset mod 2^32)
  draw    = byte (j >> 3) & 3 of word (i >> 3) & 3 of the output (bytes little-endian)
  kept    = draw < threshold
So one Philox call gives the 16 draws of a group {i' = i (mod 8)} x {j' = j (mod 8)} within a
32 x 32 span: 4 rows by 4 columns, which both the forward's (rows g, g+8 per m16 tile) and the
backward's (keys g, g+8 per m16 tile of S^T) register layouts share.
"""

from __future__ import annotations

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57  # the round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # the key schedule's increments (Weyl sequence)
ROUNDS = 10
SPAN = 32  # rows and keys of a group's span
MASK32 = 0xFFFFFFFF


def philox4x32(counter, key, rounds: int = ROUNDS) -> tuple[np.ndarray, ...]:
    """The 4 output words of Philox4x32-`rounds` for counters (c0, c1, c2, c3) and keys (k0, k1):
    each an integer or an array (broadcast together), returned as uint32 arrays."""
    c = [np.asarray(x, dtype=np.uint64) & MASK32 for x in counter]
    k0, k1 = (np.asarray(x, dtype=np.uint64) & MASK32 for x in key)
    for r in range(rounds):
        if r:
            k0 = (k0 + W0) & MASK32
            k1 = (k1 + W1) & MASK32
        p0 = c[0] * np.uint64(M0)  # < 2^64: exact in uint64
        p1 = c[2] * np.uint64(M1)
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & MASK32, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & MASK32]
    return tuple(x.astype(np.uint32) for x in c)


def draws(seed: int, offset: int, batch, head, i, j) -> np.ndarray:
    """The 8-bit draw of each element (batch, head, i, j) (arrays broadcast together), as uint8."""
    seed, offset = int(seed) % 2**64, int(offset) % 2**32
    i, j = np.asarray(i, dtype=np.int64), np.asarray(j, dtype=np.int64)
    batch, head = np.asarray(batch, dtype=np.int64), np.asarray(head, dtype=np.int64)
    counter = ((j >> 5) * 8 + (j & 7), (i >> 5) * 8 + (i & 7), batch * 65536 + head, offset)
    words = philox4x32(counter, (seed & MASK32, seed >> 32))
    word = np.choose((i >> 3) & 3, words)
    return ((word >> (8 * ((j >> 3) & 3)).astype(np.uint32)) & 0xFF).astype(np.uint8)


def keep_mask(seed: int, offset: int, batch: int, heads: int, seq_q: int, seq_k: int, threshold: int,
              batch_offset: int = 0) -> np.ndarray:
    """(batch, heads, seq_q, seq_k) bool: which elements of a call the kernels keep, for batches
    batch_offset.. and query heads 0..heads-1. One Philox call per group (16 elements), then
    gathered: dense, for small shapes."""
    seed, offset = int(seed) % 2**64, int(offset) % 2**32
    b = np.arange(batch_offset, batch_offset + batch, dtype=np.int64)[:, None, None, None]
    h = np.arange(heads, dtype=np.int64)[None, :, None, None]
    rows = np.arange(-(-seq_q // SPAN) * 8, dtype=np.int64)[None, None, :, None]  # counter word 1: (i >> 5) * 8 + (i & 7)
    cols = np.arange(-(-seq_k // SPAN) * 8, dtype=np.int64)[None, None, None, :]  # counter word 0
    words = np.stack(philox4x32((cols, rows, b * 65536 + h, offset), (seed & MASK32, seed >> 32)))
    i = np.arange(seq_q, dtype=np.int64)[:, None]
    j = np.arange(seq_k, dtype=np.int64)[None, :]
    word = words[(i >> 3) & 3, :, :, (i >> 5) * 8 + (i & 7), (j >> 5) * 8 + (j & 7)]  # (seq_q, seq_k, batch, heads)
    draw = (word >> (8 * ((j >> 3) & 3)).astype(np.uint32)[..., None, None]) & 0xFF
    return np.ascontiguousarray(np.moveaxis(draw < threshold, (0, 1), (2, 3)))
