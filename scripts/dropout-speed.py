"""What fused dropout costs (docs/dropout.md, "Speed"): forward and forward+backward through the front
door with dropout_p 0 and 0.1, per forward family, in the FlashAttention papers' setup (batch x seqlen
= 16k, hidden 2048, bf16), TFLOP/s as they count them (attngen/bench_backward.py _flops). The backward
is the dispatcher's: on the H100 bwd_sm90 without dropout, bwd_sm80 with it. Prints one line per
case: python scripts/dropout-speed.py [seqlen ...]."""

import sys

import torch

import attngen
from attngen.bench_backward import _flops
from attngen.bench_decode import _time_ms
from attngen.spec import AttentionSpec


def case(S, D, causal, family):
    B, H = 16384 // S, 2048 // D
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    mask = "causal" if causal else "none"
    flops = _flops(B, H, S, D, causal)
    line = [f"d{D} {mask} {S} {family}"]
    for p in (0.0, 0.1):
        spec = AttentionSpec(head_dim=D, mask=mask, family=family, dropout_p=p)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        t_fwd = _time_ms(lambda spec=spec: attngen.attention(q, k, v, spec), 10) * 1e-3
        t_all = _time_ms(lambda spec=spec, leaves=leaves: torch.autograd.grad(attngen.attention(*leaves, spec), leaves, do),
                         10) * 1e-3
        line.append(f"p={p}: fwd {flops / t_fwd / 1e12:.0f} fwd+bwd {3.5 * flops / t_all / 1e12:.0f} TFLOP/s "
                    f"({t_fwd * 1e3:.3f} / {t_all * 1e3:.3f} ms)")
    print(" | ".join(line), flush=True)


if __name__ == "__main__":
    lengths = [int(a) for a in sys.argv[1:]] or [4096]
    families = ["fwd_sm90", "fwd_sm80"] if torch.cuda.get_device_capability() == (9, 0) else ["fwd_sm80"]
    for S in lengths:
        for D in (128, 64):
            for causal in (False, True):
                for family in families:
                    case(S, D, causal, family)
