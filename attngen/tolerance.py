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
Dropout (attngen/dropout.py) weights each p_j by z_j s, z_j in {0, 1} and s = 1 / (1 - p): a
dropped p_j is exactly 0 and the kernels multiply the row's result by s once (fp32), so both
terms in max|v| hold with s * max|v| (sum_j p_j z_j s |v_j| / l <= s max|v|).
LSE is fp32 throughout: its error is the score error (bounded here by the cruder
eps32 * scale * D * max|q| * max|k| >= 2 ds, which also covers the fp32 row sum over long
rows) plus the rounding of the log and of the result, eps32 * (|lse| + 1); we allow 4x.

Gradients (check_grads; the backward of attngen/families/bwd_sm80/family.py). Per batch and kv
head, i runs over the ratio * Sq query rows of the GQA group, j over the Sk keys, d over the head
dim. Exact (float64, from the dtype-valued q, k, v, dO: reference.attention_grads): S = scale q.k,
Z = score_mod(S) (-inf where masked), L the row's LSE (sink included), P = exp(Z - L), O = P v,
dP = dO.v, D = dO.O - dLSE, g1, g2 the modifier's first and second derivatives in S (1 and 0
without one), dS = P (dP - D) g1 scale, dV_j = sum_i P_ij dO_i, dK_j = sum_i dS_ij q_i,
dQ_i = sum_j dS_ij k_j. The kernels read the forward's output O' (the dtype) and LSE L' (fp32).
Besides u and u32: eps32 bounds one fp32 operation, rounded or truncated (tensor cores may
truncate while accumulating); tau is the absolute error of rounding a value below the normal
range: half the dtype's subnormal spacing or fp32's flush-to-zero threshold 2^-126, whichever is
larger (fp16 2^-25, bf16 2^-126); N_q = ratio * Sq and N_k = Sk count the terms of the fp32 sums
of dK, dV and of dQ; an fp32 sum of N terms errs by at most N eps32 times their magnitudes.
1. P. The kernel's P' = exp(Z' - L') is P e^eps with |eps_ij| <= e_ij = |g1| ds_ij + e_L,i +
   2 eps32 (|Z_ij| + |L_i|) + 2^-21: ds_ij = u32 scale sum_d |q_id k_jd| is the forward's estimate
   of a score's fp32 error (the modifier scales it by |g1|); e_L,i is the forward LSE's error,
   |L' - L| where the check is given L', else the forward's estimate max_j |g1| ds_ij +
   eps32 (|L| + 1); 2 eps32 (|Z| + |L|) covers four fp32 roundings of magnitude |Z| or |L| (the
   modifier, the log2(e) conversions of score and LSE, the exponent's FMA) and 2^-21 the
   approximate exp2. ex2.approx.ftz flushes a result below fp32's normal range to 0, so
   |P' - P| <= eta P + phi with eta = e^e - 1 and phi = 2^-126 where visible (0 elsewhere).
2. dV. P' rounded to the dtype (u relative, or tau), times dO exactly, summed in fp32 over N_q
   rows, rounded: pre = sum_i (eta P + phi) |dO| + (u + N_q eps32) sum_i ((1 + eta) P + phi) |dO| +
   tau sum_{i sees j} |dO_i|, and |dV' - dV| <= pre + u (|dV| + pre) + tau.
3. D. D' = fl32(sum_d dO O') - dLSE (exact products, d roundings of the sum, one of the
   difference): |D' - D| <= dD_i = |sum_d dO_id (O'_id - O_id)| + (d + 1) eps32
   (sum_d |dO_id O'_id| + |dLSE_i|). The first term is the error of the O the kernel read, exactly
   (check_grads holds O' to check_output's bound first). Bounding it by that bound instead, as
   sum_d |dO| * 2u (|O| + max|v|), would exceed |D| itself: a kernel dropping D would pass.
4. dP. dP' = fl32(dO_i . v_j): |dP' - dP| <= ddP_ij = d eps32 sum_d |dO_id v_jd|.
5. g1, at the kernel's fp32 score: |g1' - g1| <= dg = |g2| (ds + eps32 |S|) + 4 eps32 |g1| + eg
   (0 without a modifier; the modifier's value error is in e above), eg the fp32 evaluation error of
   g1's expression at the exact score, bounded op by op (attngen/maskc/dense.py evaluation_error): it
   is absolute where the expression cancels, e.g. softcap's 1 - tanh^2 near saturation, ~1e-7 while
   g1 itself may be 1e-17 (`attngen fuzz` found that on the H100).
6. dS. dS' = dtype(fl32(P' (dP' - D') g1' scale)): pre = eta |dS| + phi scale |dP - D| (|g1| + dg)
   + ((1 + eta) P + phi) scale ((ddP + dD)(|g1| + dg) + |dP - D| dg), plus 4 eps32 (|dS| + pre) for
   the fp32 products;
   E_dS = pre + u (|dS| + pre) + tau where visible. Where P is peaked dP and D nearly cancel, and
   dD (O's rounding) rather than dS sets the error: the backward's weakest step.
7. dK, dQ. dS' times q or k exactly, summed in fp32 (dQ through fp32 atomics), rounded:
   pre = sum_i E_dS |q_i| + N_q eps32 sum_i (|dS| + E_dS) |q_i|, |dK' - dK| <= pre +
   u (|dK| + pre) + tau; dQ alike over j with |k_j| and N_k.
8. A sink input x. d loss / d sink_i = -ps_i D_i, ps = exp(sink - L), computed in fp32 from L'
   and D' (attngen/api.py sink_grads): E_i = eta_L ps |D| + (1 + eta_L) ps dD plus
   4 eps32 (ps |D| + E_i), eta_L = e^(e_L + 2 eps32 (|sink| + |L|) + 2^-21) - 1; summed into x
   through the sink's Jacobian J (fp32, N rows): |dx' - dx| <= |J|^T E + N eps32 |J|^T (ps |D| + E)
   + eps32 |dx|.
9. Dropout (W = Z s from reference.attention_grads, Z in {0, 1}, s = 1 / (1 - p)): the kernels round
   P' Z (a dropped element is exactly 0) for dV and multiply dV by fl32(s) at the end, so 2. holds
   with P W for P (and tau W for tau) plus 2 eps32 (|dV| + pre) for s's rounding and the product;
   dP' = fl32(fl32(dO.v) fl32(s)) Z, so 4. becomes W ddP + 2 eps32 |dP| with dP = W dO.v, the dP of
   6. D is of the dropped O the kernels read, unchanged.
As for the forward we allow SAFETY = 2 times u, eps32, tau and every exponent error e. Nothing
is fitted to a kernel: a bound is a sum of magnitudes (worst case, signs ignored), so it is loose
by the ratio of sum |terms| to |sum| where gradients cancel, and tight (ratio ~1) nowhere else.
Rows that see no key have dQ exactly 0 and keys no row sees dK = dV = 0 (bound 0); NaN/Inf in
a gradient is always a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from attngen.dtypes import DTYPES

EPS32 = 2.0**-23
U32 = 2.0**-24
UNIT_ROUNDOFF = {name: dtype.unit_roundoff for name, dtype in DTYPES.items()}
SAFETY = 2.0
LSE_SAFETY = 4.0
# The absolute error of rounding a value below the normal range (module docstring: tau).
TINY = {"fp16": 2.0**-25, "bf16": 2.0**-126}
EXP2_ERROR = 2.0**-21  # ex2.approx: 2 ulp of fp32
FTZ32 = 2.0**-126  # ex2.approx.ftz returns 0 below fp32's normal range (module docstring: phi)


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


def check_output(out, ref, q, k, v, dtype: str, scale: float, keep_scale: float = 1.0):
    """Return None when out matches ref within the bound, else the worst Mismatch (torch tensors);
    keep_scale: dropout's 1 / (1 - p) (reference of the same mask)."""
    import torch

    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        idx = tuple(int(i) for i in (~torch.isfinite(out64)).nonzero()[0])
        return Mismatch("output has NaN/Inf", float("nan"), 0.0, idx)
    return _worst("output", (out64 - ref64).abs(), output_bound(ref64, q, k, v, dtype, scale, keep_scale))


def output_bound(ref, q, k, v, dtype: str, scale: float, keep_scale: float = 1.0):
    """The allowed |out - ref| per element (module docstring); keep_scale: dropout's 1 / (1 - p)."""
    import torch

    u = UNIT_ROUNDOFF[dtype]
    vmax = v.double().abs().max().item() * keep_scale if v.numel() else 0.0
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


# -- gradients (module docstring, "Gradients") ---------------------------------------------------
def _rows(t, ratio: int):
    """(B, S, Hq, D) -> (B, Hkv, ratio, S, D), float64: query rows grouped by the kv head they read."""
    B, S, Hq, D = t.shape
    return t.double().permute(0, 2, 1, 3).reshape(B, Hq // ratio, ratio, S, D)


def _unrows(t):
    B, Hkv, ratio, S, D = t.shape
    return t.reshape(B, Hkv * ratio, S, D).permute(0, 2, 1, 3)


def _keys(t):
    """(B, S, Hkv, D) <-> (B, Hkv, S, D), float64."""
    return t.double().permute(0, 2, 1, 3)


def _lse_rows(t, ratio: int):
    B, Hq, S = t.shape
    return t.double().reshape(B, Hq // ratio, ratio, S)


def grad_bounds(ref_grads, q, k, v, out, dout, dtype: str, scale: float, *, lse=None, dlse=None) -> dict:
    """The allowed |error| of each gradient element (module docstring, "Gradients"): {"dq": like q,
    "dk", "dv": like k, "inputs": {name: like the input}}, float64. `ref_grads` is
    reference.attention_grads' (dq, dk, dv, parts) for the same q, k, v, dout, dlse; `out` is the
    forward output the backward read; `lse` its LSE, when known (else the forward's estimate)."""
    import torch

    dq_ref, dk_ref, dv_ref, parts = ref_grads
    if abs(parts["scale"] - scale) > 1e-12 * abs(scale):
        raise ValueError(f"scale={scale} differs from the reference's {parts['scale']}")
    u, e32, tiny = SAFETY * UNIT_ROUNDOFF[dtype], SAFETY * EPS32, SAFETY * TINY[dtype]
    ratio = parts["ratio"]
    P, dS, visible, delta = parts["P"], parts["dS"], parts["visible"], parts["D"]
    vis = visible.double()
    d = q.shape[-1]
    n_q, n_k = ratio * q.shape[1], k.shape[1]
    qa, ka, va, doa = _rows(q, ratio).abs(), _keys(k).abs(), _keys(v).abs(), _rows(dout, ratio).abs()
    out_k = _rows(out, ratio)
    L = parts["lse"]
    L_abs = torch.where(torch.isfinite(L), L.abs(), torch.zeros_like(L))
    Z_abs = torch.where(visible, parts["Z"].abs(), torch.zeros_like(P))
    g1 = parts["g1"]
    g1a = torch.ones_like(P) if g1 is None else g1.abs()

    # 1. P: the exponent's error, per element (eta = 0 where hidden: P and P' are 0 there).
    ds = U32 * scale * torch.einsum("bgrqd,bgkd->bgrqk", qa, ka)
    if lse is not None:
        L_k = _lse_rows(lse, ratio)
        both = torch.isfinite(L_k) & torch.isfinite(L)
        e_lse = torch.where(both, (L_k - L).abs(), torch.zeros_like(L))
    else:
        e_lse = (g1a * ds * vis).amax(-1) + EPS32 * (L_abs + 1.0) if P.shape[-1] else torch.zeros_like(L)
    e = g1a * ds + e_lse[..., None] + 2 * EPS32 * (Z_abs + L_abs[..., None]) + EXP2_ERROR
    eta = torch.expm1(SAFETY * e) * vis
    phi = SAFETY * FTZ32 * vis

    # 2. dV (9.: the dropout weights W on P).
    W = parts.get("W")
    PW, vis_w = (P, vis) if W is None else (P * W, vis * W)
    P_eta = eta * PW + (phi if W is None else phi * W)
    mag = torch.einsum("bgrqk,bgrqd->bgkd", PW + P_eta, doa)
    pre = torch.einsum("bgrqk,bgrqd->bgkd", P_eta, doa) + (u + n_q * e32) * mag \
        + tiny * torch.einsum("bgrqk,bgrqd->bgkd", vis_w, doa)
    key_seen = visible.flatten(2, 3).any(2).double()[..., None]  # (B, Hkv, Sk, 1)
    dv_bound = pre + u * (_keys(dv_ref).abs() + pre) + tiny * key_seen
    if W is not None:
        dv_bound = dv_bound + 2 * e32 * (_keys(dv_ref).abs() + pre)

    # 3. D, from the O the kernel read; 4. dP; 5. g1.
    o_err = (_rows(dout, ratio) * (out_k - parts["out"])).sum(-1).abs()
    dlse_abs = 0.0 if dlse is None else _lse_rows(dlse, ratio).abs()
    dD = o_err + (d + 1) * e32 * ((doa * out_k.abs()).sum(-1) + dlse_abs)
    ddP = d * e32 * torch.einsum("bgrqd,bgkd->bgrqk", doa, va)
    if W is not None:
        ddP = W * ddP + 2 * e32 * parts["dP"].abs()
    if g1 is None:
        dg = torch.zeros_like(P)
    else:
        dg = parts["g2"].abs() * SAFETY * (ds + EPS32 * parts["S"].abs()) + 4 * e32 * g1a
        if parts.get("g1_err") is not None:
            dg = dg + SAFETY * parts["g1_err"]

    # 6. dS (scale included).
    dS_abs = dS.abs()
    G_free = (parts["dP"] - delta[..., None]).abs()  # |dP - D|
    pre = eta * dS_abs + phi * scale * G_free * (g1a + dg) \
        + ((1 + eta) * P + phi) * scale * ((ddP + dD[..., None]) * (g1a + dg) + G_free * dg)
    pre = pre + 4 * e32 * (dS_abs + pre)
    E_dS = pre + u * (dS_abs + pre) + tiny * vis
    dS_mag = dS_abs + E_dS

    # 7. dK, dQ.
    pre = torch.einsum("bgrqk,bgrqd->bgkd", E_dS, qa) + n_q * e32 * torch.einsum("bgrqk,bgrqd->bgkd", dS_mag, qa)
    dk_bound = pre + u * (_keys(dk_ref).abs() + pre) + tiny * key_seen
    row_seen = visible.any(-1).double()[..., None]  # (B, Hkv, ratio, Sq, 1)
    pre = torch.einsum("bgrqk,bgkd->bgrqd", E_dS, ka) + n_k * e32 * torch.einsum("bgrqk,bgkd->bgrqd", dS_mag, ka)
    dq_bound = pre + u * (_rows(dq_ref, 1).reshape(pre.shape).abs() + pre) + tiny * row_seen

    # 8. The sink's inputs.
    inputs = {}
    if parts["jacobian"]:
        ps, sinks = parts["psink"], parts["sinks"]
        sink_abs = torch.where(torch.isfinite(sinks), sinks.abs(), torch.zeros_like(sinks))
        eta_l = torch.expm1(SAFETY * (e_lse + 2 * EPS32 * (sink_abs + L_abs) + EXP2_ERROR))
        grad_abs = ps * delta.abs()
        E = eta_l * grad_abs + (1 + eta_l) * ps * dD
        E = E + 4 * e32 * (grad_abs + E)
        rows = ps.numel()
        for name, jacobian in parts["jacobian"].items():
            J = jacobian.abs().reshape(rows, -1)
            pre = (E.reshape(-1) @ J + rows * e32 * ((grad_abs + E).reshape(-1) @ J)).reshape(jacobian.shape[4:])
            inputs[name] = pre + e32 * (parts["dinputs"][name].abs() + pre)
    # 8b. The score modifier's inputs read at [h] (bwd_shared.learnable_inputs): per head, the sum over
    # batches, rows and keys of G m, G = P (dP - D) the gradient of the modified score (the dS of 6.
    # without g' and the scale), m = d modified / d input in fp32; summed in fp32 in any order.
    if parts.get("dmod"):
        G_abs = (P * (parts["dP"] - delta[..., None])).abs()
        E_G = eta * G_abs + phi * G_free + ((1 + eta) * P + phi) * (ddP + dD[..., None])
        E_G = E_G + 4 * e32 * (G_abs + E_G)
        terms = G_abs.shape[0] * G_abs.shape[3] * G_abs.shape[4]  # batches x rows x keys per head
        for name, m in parts["dmod"].items():
            m_abs = m.abs()
            pre = (E_G * m_abs + 4 * e32 * G_abs * m_abs).sum(dim=(0, 3, 4)).reshape(-1)  # (Hkv * ratio,) = heads
            pre = pre + terms * e32 * ((G_abs + E_G) * m_abs).sum(dim=(0, 3, 4)).reshape(-1)
            ref = parts["dinputs"][name]
            bound = torch.zeros_like(ref)
            bound[:pre.numel()] = pre
            inputs[name] = bound + e32 * (ref.abs() + bound)
    return {"dq": _unrows(dq_bound), "dk": _keys(dk_bound), "dv": _keys(dv_bound), "inputs": inputs,
            "row_seen": _unrows(row_seen.expand(dq_bound.shape))[..., 0] > 0,
            "key_seen": key_seen[..., 0].permute(0, 2, 1) > 0}


def check_grads(grads, ref_grads, q, k, v, out, dout, dtype: str, scale: float, *, lse=None, dlse=None):
    """None when a backward's gradients match the float64 reference within grad_bounds, else the
    worst Mismatch. `grads`: (dq, dk, dv) or (dq, dk, dv, {input name: gradient}); `ref_grads`:
    reference.attention_grads(q, k, v, dout, ..., dlse=dlse, grad_inputs=...) for the same call;
    `out` (and `lse`, when the caller has it) the forward outputs the backward read, held to the
    forward's bounds first (the derivation stands on them). NaN/Inf is always a mismatch; rows that
    see no key must give dq exactly 0 and keys no row sees dk = dv = 0."""
    import torch

    dq_ref, dk_ref, dv_ref, parts = ref_grads
    given = dict(zip(("dq", "dk", "dv"), grads[:3]))
    given_inputs = dict(grads[3]) if len(grads) > 3 else {}
    if sorted(given_inputs) != sorted(parts["dinputs"]):
        raise ValueError(f"gradients of inputs {sorted(given_inputs)} given, the reference has "
                         f"{sorted(parts['dinputs'])}: pass grad_inputs= to reference.attention_grads")
    ratio = parts["ratio"]
    B, Hkv, _, Sq, _ = parts["out"].shape
    out_ref = _unrows(parts["out"])
    bad = check_output(out, out_ref, q, k, v, dtype, scale, parts.get("keep_scale", 1.0))
    if bad is not None:
        return Mismatch(f"the forward output the backward read ({bad.what})", bad.worst, bad.allowed, bad.index)
    if lse is not None:
        bad = check_lse(lse, parts["lse"].reshape(B, Hkv * ratio, Sq), q, k, scale)
        if bad is not None:
            return Mismatch(f"the forward LSE the backward read ({bad.what})", bad.worst, bad.allowed, bad.index)
    refs = {"dq": dq_ref, "dk": dk_ref, "dv": dv_ref}
    for name, got in given.items():
        if got is None or tuple(got.shape) != tuple(refs[name].shape):
            raise ValueError(f"{name} has shape {None if got is None else tuple(got.shape)}; allowed: "
                             f"{tuple(refs[name].shape)}")
    for name, got in (*given.items(), *((f"d inputs[{n!r}]", g) for n, g in given_inputs.items())):
        finite = torch.isfinite(got.double())
        if not finite.all():
            idx = tuple(int(i) for i in (~finite).nonzero()[0])
            return Mismatch(f"{name} has NaN/Inf", float("nan"), 0.0, idx)
    bounds = grad_bounds(ref_grads, q, k, v, out, dout, dtype, scale, lse=lse, dlse=dlse)
    zeros = (("dq", bounds["row_seen"], "a row that sees no key"), ("dk", bounds["key_seen"], "a key no row sees"),
             ("dv", bounds["key_seen"], "a key no row sees"))
    for name, seen, what in zeros:
        stray = (given[name].double() != 0) & ~seen[..., None].to(given[name].device)
        if stray.any():
            idx = tuple(int(i) for i in stray.nonzero()[0])
            return Mismatch(f"{name} of {what} is not 0", given[name].double()[idx].abs().item(), 0.0, idx)
    for name in ("dv", "dk", "dq"):
        err = (given[name].double() - refs[name].double().to(given[name].device)).abs()
        bad = _worst(name, err, bounds[name].to(err.device))
        if bad is not None:
            return bad
    for name, got in given_inputs.items():
        ref = parts["dinputs"][name].to(got.device)
        bad = _worst(f"d inputs[{name!r}]", (got.double() - ref).abs(), bounds["inputs"][name].to(got.device))
        if bad is not None:
            return bad
    return None
