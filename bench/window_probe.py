"""Same-process A/B of fwd_sm90 configs on the issue's sliding window (4096 keys at 16k, d128, 16
heads, bf16) against the built-in causal's time scaled by the work fraction (the bar: <= 1.1x).

    PYTHONPATH=. python bench/window_probe.py      (on an H100; docs/perf-notes.md "Window")
"""
import torch

import attngen
from attngen.bench_masks import HEAD_DIM, HEADS, SEQLEN, WINDOW, _time_ms
from attngen.families.fwd_sm90 import family as sm90
from attngen.spec import AttentionSpec

LABELS = ["m128n128s2opd", "m128n128s2op", "m128n128s2opr", "m128n128s2od", "m128n128s3opd", "m128n64s2opd",
          "m128n96s2opd", "m128n160s2opd", "m128n192s2opd"]
MASK = f"sliding_window({WINDOW - 1}, 0)"


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fraction = sum(min(i + 1, WINDOW) for i in range(SEQLEN)) / (SEQLEN * (SEQLEN + 1) // 2)
    with torch.no_grad():
        for round_ in range(2):
            causal_ms = _time_ms(lambda: attngen.attention(q, k, v, mask="causal"))
            line = [f"round {round_}: causal {causal_ms:.3f} ms, bar {1.1 * fraction * causal_ms:.3f} ms"]
            for label in LABELS:
                config = sm90.Sm90Config.from_label(label).to_dict()
                try:
                    spec = AttentionSpec(head_dim=HEAD_DIM, dtype="bf16", mask=MASK, family="fwd_sm90", config=config)
                    ms = _time_ms(lambda: attngen.attention(q, k, v, spec))
                except Exception as exc:  # a config this GPU cannot hold: say so and go on
                    line.append(f"{label} -- {str(exc)[:60]}")
                    continue
                line.append(f"{label} {ms:.3f} ms {ms / (fraction * causal_ms):.3f}x")
            print("\n  ".join(line), flush=True)


if __name__ == "__main__":
    main()
