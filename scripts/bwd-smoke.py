"""Direct launches of a backward family against float64 autograd of the reference (a development check).

Runs the family's kernels through dispatch.Kernel on a hand-made BackwardCall, so it needs no
front door; prints the worst relative error of dq, dk, dv per case.

    python scripts/bwd-smoke.py [--family bwd_sm90|bwd_sm80] [--quick]
"""

import argparse
import sys

import torch

from attngen import reference, targets
from attngen.families import BACKWARD_FAMILIES
from attngen.families.base import BackwardCall
from attngen.runtime.dispatch import Kernel
from attngen.runtime.tensors import describe
from attngen.spec import AttentionSpec
import attngen

_PARSER = argparse.ArgumentParser(description="Direct launches of a backward family against the reference.")
_PARSER.add_argument("--family", default="bwd_sm80", choices=list(BACKWARD_FAMILIES))
_PARSER.add_argument("--quick", action="store_true", help="three small cases, for compute-sanitizer")
ARGS = _PARSER.parse_args()
FAMILY = BACKWARD_FAMILIES[ARGS.family]


def run_case(B, Sq, Sk, Hq, Hkv, D, dtype, mask="none", score_mod=None, sink=None, inputs=None, config=None, seed=0):
    torch.manual_seed(seed)
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float16
    q = torch.randn(B, Sq, Hq, D, device="cuda", dtype=tdt)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=tdt)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=tdt)
    dout = torch.randn(B, Sq, Hq, D, device="cuda", dtype=tdt)
    out, lse = attngen.attention(q, k, v, mask=mask, score_mod=score_mod, sink=sink, inputs=inputs, return_lse=True)
    spec = AttentionSpec(head_dim=D, dtype=dtype, gqa_ratio=Hq // Hkv, mask=mask, score_mod=score_mod, sink=sink)
    target = targets.device_target(0)
    cfg = FAMILY.default_config(spec.problem, target) if config is None else FAMILY.resolve_config(spec.problem, target, config)
    plan = FAMILY.plan(spec.problem, target, cfg)
    kernel = Kernel(plan, 0)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scale = D ** -0.5
    info = {n: describe(t, n) for n, t in dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, dq=dq, dk=dk, dv=dv).items()}
    ins = tuple(sorted((n, describe(t, n)) for n, t in (inputs or {}).items()))
    call = BackwardCall(info["q"], info["k"], info["v"], info["out"], info["lse"], info["dout"], None, info["dq"],
                        info["dk"], info["dv"], scale, inputs=ins)
    kernel.run(call, torch.cuda.current_stream().cuda_stream, q)
    torch.cuda.synchronize()
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    ref = reference.attention(q64, k64, v64, mask=mask, score_mod=score_mod, sink=sink, inputs=inputs,
                              gqa_ratio=Hq // Hkv)
    gq, gk, gv = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    errs = []
    for name, got, want in (("dq", dq, gq), ("dk", dk, gk), ("dv", dv, gv)):
        err = (got.double() - want).abs().max().item()
        errs.append(f"{name} {err / max(want.abs().max().item(), 1e-30):.2e}")
        if not torch.isfinite(got).all():
            errs.append(f"{name} NONFINITE")
    print(f"{plan.config.label()} B{B} Sq{Sq} Sk{Sk} H{Hq}/{Hkv} d{D} {dtype} {mask} {score_mod} {sink}:", ", ".join(errs),
          flush=True)


def quick():
    """Three small cases for compute-sanitizer: odd lengths, GQA with a mask table, a modifier and a sink."""
    run_case(1, 77, 130, 2, 1, 64, "fp16", "causal")
    doc = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor([40, 50, 40]))[None].cuda()
    run_case(1, 130, 130, 4, 2, 128, "bf16", "doc[b, q_idx] == doc[b, kv_idx] and causal", inputs={"doc": doc})
    sinks = torch.randn(2, device="cuda", dtype=torch.float32)
    d = 96 if FAMILY.supports(AttentionSpec(head_dim=96).problem, targets.device_target(0)) is None else 64
    run_case(1, 100, 100, 2, 2, d, "bf16", "causal", score_mod="softcap(30.0)", sink="sinks[h]", inputs={"sinks": sinks})


if __name__ == "__main__" and ARGS.quick:
    quick()
    sys.exit(0)

if __name__ == "__main__":
    run_case(1, 128, 128, 1, 1, 64, "bf16")
    run_case(2, 200, 200, 4, 2, 128, "bf16", "causal")
    run_case(1, 130, 77, 2, 1, 64, "fp16", "causal")
    run_case(1, 77, 300, 4, 1, 96, "bf16", "causal")
    run_case(2, 257, 257, 2, 2, 128, "fp16", "none", config={"num_stages": 1})
    run_case(1, 300, 300, 2, 2, 128, "bf16", "sliding_window(64, 0)", score_mod="softcap(30.0)")
    run_case(1, 256, 256, 2, 2, 64, "bf16", "causal", score_mod="score - 0.05 * abs(q_idx - kv_idx)")
    sinks = torch.randn(4, device="cuda", dtype=torch.float32)
    run_case(1, 200, 200, 4, 4, 64, "bf16", "causal", sink="sinks[h]", inputs={"sinks": sinks})
    doc = torch.repeat_interleave(torch.arange(4, dtype=torch.int32), torch.tensor([50, 100, 30, 120]))[None].cuda()
    run_case(1, 300, 300, 2, 2, 128, "bf16", "doc[b, q_idx] == doc[b, kv_idx] and causal", inputs={"doc": doc})
    run_case(1, 1024, 1024, 8, 2, 128, "bf16", "causal", config={"block_m": 32, "block_n": 64, "num_warps": 4})
    run_case(1, 100, 90, 2, 2, 64, "fp16", "causal", config={"block_m": 16, "block_n": 32, "num_warps": 2})
    sys.exit(0)
