"""Accuracy bounds for kernel outputs against the float64 reference, stated once per dtype.

Derivation (u = unit roundoff of the dtype: bf16 2^-8, fp16 2^-11; u32 = 2^-24, eps32 = 2^-23):
- the output is rounded to the dtype once: error <= u * |ref|;
- P is rounded to the dtype before the P.V product; those errors sum to at most
  u * sum_j p_j |v_j| / l <= u * max|v|;
- a score is an fp32 sum of exact products (fp16/bf16 products fit in fp32); its rounding
  error is estimated as u32 times the accumulated magnitude: ds = u32 * scale * sum_i |q_i k_i|
  (one rounding's worth: the random-walk estimate, not a bound; the worst case is D times
  that). Scores off by ds scale each p_j, and the row sum, by up to e^ds, which moves the
  output by up to (e^(2 ds) - 1) * max|v|, with ds the row's largest. Negligible at unit
  logits, it is the dominant term when scores approach 1e4;
- row sums and O accumulate in fp32 and exp2/log2 are approximate to ~2^-22: negligible.
So |out - ref| <= u * (|ref| + max|v|) + (e^(2 ds) - 1) * max|v|; we allow SAFETY = 2 times
u and 2 times ds: 2u * (|ref| + max|v|) + (e^(4 ds) - 1) * max|v|.
LSE is fp32 throughout: its error is the score error (bounded here by the cruder
eps32 * scale * D * max|q| * max|k| >= 2 ds, which also covers the fp32 row sum over long
rows) plus the rounding of the log and of the result, eps32 * (|lse| + 1); we allow 4x.
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen.dtypes import DTYPES

EPS32 = 2.0**-23
U32 = 2.0**-24
UNIT_ROUNDOFF = {name: dtype.unit_roundoff for name, dtype in DTYPES.items()}
SAFETY = 2.0
LSE_SAFETY = 4.0


@dataclass(frozen=True)
class Mismatch:
    what: str
    worst: float
    allowed: float
    index: tuple

    def __str__(self) -> str:
        return f"{self.what}: |error| {self.worst:.3g} exceeds bound {self.allowed:.3g} at index {self.index}"


def score_error(q, k, scale: float):
    """ds per query row, shape (B, Sq, Hq): u32 * scale * max over keys of sum_i |q_i k_i|."""
    import torch

    ratio = q.shape[2] // max(k.shape[2], 1)  # query head h reads kv head h // ratio
    k_abs = k.double().abs().repeat_interleave(ratio, dim=2)
    magnitude = torch.einsum("bqhd,bkhd->bqhk", q.double().abs(), k_abs)
    if magnitude.shape[-1] == 0:
        return magnitude.sum(-1)
    return U32 * scale * magnitude.amax(-1)


def check_output(out, ref, q, k, v, dtype: str, scale: float):
    """Return None when out matches ref within the bound, else the worst Mismatch (torch tensors)."""
    import torch

    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        idx = tuple(int(i) for i in (~torch.isfinite(out64)).nonzero()[0])
        return Mismatch("output has NaN/Inf", float("nan"), 0.0, idx)
    return _worst("output", (out64 - ref64).abs(), output_bound(ref64, q, k, v, dtype, scale))


def output_bound(ref, q, k, v, dtype: str, scale: float):
    """The allowed |out - ref| per element (module docstring)."""
    import torch

    u = UNIT_ROUNDOFF[dtype]
    vmax = v.double().abs().max().item() if v.numel() else 0.0
    score_term = torch.expm1(2 * SAFETY * score_error(q, k, scale)) * vmax
    return SAFETY * u * (ref.double().abs() + vmax) + score_term[..., None]


def check_lse(lse, ref_lse, q, k, scale: float):
    """LSE within the fp32 bound; -inf exactly where the reference has -inf (fully masked rows)."""
    import torch

    lse64, ref64 = lse.double(), ref_lse.double()
    masked = torch.isneginf(ref64)
    if not torch.equal(torch.isneginf(lse64), masked):
        idx = tuple(int(i) for i in (torch.isneginf(lse64) != masked).nonzero()[0])
        return Mismatch("LSE -inf pattern differs from reference", float("inf"), 0.0, idx)
    if torch.isnan(lse64).any():
        return Mismatch("LSE has NaN", float("nan"), 0.0, tuple(int(i) for i in torch.isnan(lse64).nonzero()[0]))
    ref_abs = ref64.abs().where(~masked, torch.zeros_like(ref64))
    d = q.shape[-1]
    qmax = q.double().abs().max().item() if q.numel() else 0.0
    kmax = k.double().abs().max().item() if k.numel() else 0.0
    bound = LSE_SAFETY * EPS32 * (scale * d * qmax * kmax + ref_abs + 1.0)
    err = (lse64 - ref64).abs().where(~masked, torch.zeros_like(ref64))
    return _worst("LSE", err, bound)


def _worst(what, err, bound):
    import numpy as np

    excess = err - bound
    if excess.numel() == 0 or excess.max().item() <= 0:
        return None
    flat = int(excess.argmax())
    idx = tuple(int(i) for i in np.unravel_index(flat, tuple(err.shape)))
    return Mismatch(what, err.flatten()[flat].item(), bound.flatten()[flat].item(), idx)
