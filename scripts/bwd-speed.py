"""Backward speed, development check: a backward family (direct launches) against SDPA's flash and
cuDNN backends, forward+backward TFLOP/s in the FlashAttention papers' setup (batch x seqlen = 16k,
hidden 2048). Prints one line per case.

    python scripts/bwd-speed.py [--family bwd_sm90|bwd_sm80] [--causal | --short]
"""

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngen
from attngen import targets
from attngen.bench_backward import _flops
from attngen.bench_decode import _time_ms
from attngen.families import BACKWARD_FAMILIES
from attngen.families.base import BackwardCall
from attngen.runtime.dispatch import Kernel
from attngen.runtime.tensors import describe
from attngen.spec import AttentionSpec

FAMILY = None  # set from --family


def _time_s(fn):
    return _time_ms(fn, 10) * 1e-3  # the benchmark's timing: median of CUDA-event intervals after warm-up


def case(S, D, causal, config=None):
    B, H = 16384 // S, 2048 // D
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    mask = "causal" if causal else "none"
    out, lse = attngen.attention(q, k, v, mask=mask, return_lse=True)
    spec = AttentionSpec(head_dim=D, dtype="bf16", mask=mask)
    target = targets.device_target(0)
    cfg = FAMILY.default_config(spec.problem, target) if config is None else \
        FAMILY.resolve_config(spec.problem, target, config)
    kernel = Kernel(FAMILY.plan(spec.problem, target, cfg), 0)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    info = {n: describe(t, n) for n, t in dict(q=q, k=k, v=v, out=out, lse=lse, dout=do, dq=dq, dk=dk, dv=dv).items()}
    call = BackwardCall(info["q"], info["k"], info["v"], info["out"], info["lse"], info["dout"], None, info["dq"],
                        info["dk"], info["dv"], D ** -0.5)
    stream = torch.cuda.current_stream().cuda_stream
    t_fwd = _time_s(lambda: attngen.attention(q, k, v, mask=mask))
    t_bwd = _time_s(lambda: kernel.run(call, stream, q))
    flops = _flops(B, H, S, D, causal)
    line = [f"d{D} {'causal' if causal else 'full'} {S} {FAMILY.name} {cfg.label()}: attngen fwd {flops / t_fwd / 1e12:.0f} "
            f"bwd {2.5 * flops / t_bwd / 1e12:.0f} fwd+bwd {3.5 * flops / (t_fwd + t_bwd) / 1e12:.0f}"]
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                g = do.transpose(1, 2)
                t_f = _time_s(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
                t_fb = _time_s(lambda: torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                                                         (qt, kt, vt), g))
            line.append(f"{name} fwd {flops / t_f / 1e12:.0f} bwd {2.5 * flops / (t_fb - t_f) / 1e12:.0f} "
                        f"fwd+bwd {3.5 * flops / t_fb / 1e12:.0f}")
        except Exception as exc:  # noqa: BLE001
            line.append(f"{name} failed: {exc}")
    print(" | ".join(line), flush=True)


def main():
    global FAMILY
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default=next(iter(BACKWARD_FAMILIES)), choices=list(BACKWARD_FAMILIES))
    parser.add_argument("--causal", action="store_true", help="causal cases and one full one")
    parser.add_argument("--short", action="store_true", help="d64/d128 x full/causal at 2k and 8k, no config sweep")
    args = parser.parse_args()
    FAMILY = BACKWARD_FAMILIES[args.family]
    if args.causal:
        for D in (128, 64):
            for S in (2048, 8192):
                case(S, D, True)
        case(8192, 128, False)
        return
    for D in (128, 64):
        for causal in (False, True):
            for S in (2048, 8192):
                case(S, D, causal)
    if args.short or FAMILY.name != "bwd_sm80":
        return
    for config in ({"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 1},
                   {"block_m": 32, "block_n": 128, "num_warps": 8}, {"block_m": 64, "block_n": 128, "num_warps": 8, "num_stages": 1}):
        case(8192, 128, True, config)
    for config in ({"block_m": 64, "block_n": 64, "num_warps": 4}, {"block_m": 128, "block_n": 128, "num_warps": 4},
                   {"block_m": 64, "block_n": 128, "num_warps": 8}, {"block_m": 128, "block_n": 64, "num_warps": 4}):
        case(8192, 64, True, config)


if __name__ == "__main__":
    main()
    sys.exit(0)
