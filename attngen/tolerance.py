"""Accuracy bounds for kernel outputs against the float64 reference, stated once per dtype.

Derivation (u = unit roundoff of the dtype: bf16 2^-8, fp16 2^-11):
- the output is rounded to the dtype once: error <= u * |ref|;
- P is rounded to the dtype before the P.V product; those errors sum to at most
  u * sum_j p_j |v_j| / l <= u * max|v|;
- scores, row sums and O accumulate in fp32 and exp2/log2 are approximate to ~2^-22:
  orders of magnitude below the two terms above.
So |out - ref| <= u * (|ref| + max|v|); we allow twice that bound.
LSE is fp32 throughout: its error is dominated by the fp32 score accumulation,
<= eps32 * scale * D * max|q| * max|k|, plus rounding of the log itself; we allow 4x.
"""

from __future__ import annotations

from dataclasses import dataclass

EPS32 = 2.0**-23
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
SAFETY = 2.0


@dataclass(frozen=True)
class Mismatch:
    what: str
    worst: float
    allowed: float
    index: tuple

    def __str__(self) -> str:
        return f"{self.what}: |error| {self.worst:.3g} exceeds bound {self.allowed:.3g} at index {self.index}"


def check_output(out, ref, v, dtype: str):
    """Return None when out matches ref within the bound, else the worst Mismatch (torch tensors)."""
    import torch

    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        idx = tuple(int(i) for i in (~torch.isfinite(out64)).nonzero()[0])
        return Mismatch("output has NaN/Inf", float("nan"), 0.0, idx)
    u = UNIT_ROUNDOFF[dtype]
    vmax = v.double().abs().max().item() if v.numel() else 0.0
    bound = SAFETY * u * (ref64.abs() + vmax)
    return _worst("output", (out64 - ref64).abs(), bound)


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
    d = q.shape[-1]
    qmax = q.double().abs().max().item() if q.numel() else 0.0
    kmax = k.double().abs().max().item() if k.numel() else 0.0
    bound = 4 * EPS32 * (scale * d * qmax * kmax + ref64.abs().where(~masked, torch.zeros_like(ref64)) + 1.0)
    err = (lse64 - ref64).abs().where(~masked, torch.zeros_like(ref64))
    return _worst("LSE", err, bound)


def _worst(what, err, bound):
    excess = err - bound
    if excess.numel() == 0 or excess.max().item() <= 0:
        return None
    flat = int(excess.argmax())
    idx = tuple(int(i) for i in __import__("numpy").unravel_index(flat, tuple(err.shape)))
    return Mismatch(what, err.flatten()[flat].item(), bound.flatten()[flat].item(), idx)
