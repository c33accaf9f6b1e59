"""FLOP counting as the FlashAttention papers count it (DESIGN.md section 7).

Forward: 4 * B * Hq * Sq * Sk * D (two matrix products of 2 * Sq * Sk * D each), halved under a
causal mask; forward + backward: 3.5x the forward (the backward is 2.5x).
"""

from __future__ import annotations

BACKWARD_FACTOR = 2.5


def forward_flops(batch: int, heads_q: int, seq_q: int, seq_k: int, head_dim: int, causal: bool) -> float:
    flops = 4.0 * batch * heads_q * seq_q * seq_k * head_dim
    return flops / 2 if causal else flops


def forward_backward_flops(batch: int, heads_q: int, seq_q: int, seq_k: int, head_dim: int, causal: bool) -> float:
    return (1.0 + BACKWARD_FACTOR) * forward_flops(batch, heads_q, seq_q, seq_k, head_dim, causal)


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of `flops` done in `ms` milliseconds."""
    return flops / (ms * 1e-3) / 1e12
