"""Where the time of packed documents with per-sequence tiles goes (docs/perf-notes.md, "Per-sequence
tiles"), on the GPU, same process: the bench's 16 documents in 16k tokens (attngen/bench_masks.py),
d128, 16 heads, bf16, causal within each document.

  python bench/varlen_probe.py [LABEL ...]

For each fwd_sm90 config label (default: a sweep), the call's time (CUDA events) and its kernels'
times from torch.profiler (the tile builder, the forward kernel), against the dense causal 16k
kernel of the same process; useful TFLOP/s count visible pairs only.
"""

from __future__ import annotations

import sys

SWEEP = ["m128n128s2opd", "m128n128s2od", "m128n176s2opd", "m128n96s2opd", "m128n64s4opd", "m192n128s2opd",
         "m192n96s2opd", "m64n128s4od"]


def kernel_us(torch, fn, repeats: int = 20) -> dict[str, float]:
    """Mean device microseconds per call of each kernel fn launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.count >= repeats:
            times[event.key[-40:]] = event.device_time_total / repeats
    return times


def main(labels: list[str]) -> None:
    import torch

    import attngen
    from attngen.bench import time_ms
    from attngen.bench_masks import HEAD_DIM, HEADS, SEQLEN, _document_ids
    from attngen.families.fwd_sm90.family import Sm90Config

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    _, lengths = _document_ids()
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).cuda()
    pairs = int(sum(n * (n + 1) // 2 for n in lengths.tolist()))
    pair_flops = 4 * HEAD_DIM * HEADS
    causal_pairs = SEQLEN * (SEQLEN + 1) // 2

    def t(fn):
        return time_ms(lambda: fn(), [()], warmup=3, repeats=30)

    with torch.no_grad():
        causal = lambda: attngen.attention(q, k, v, mask="causal")  # noqa: E731
        causal_ms = t(causal)
        causal_kernel = max(kernel_us(torch, causal).values())
        dense = causal_pairs * pair_flops / causal_kernel / 1e6
        print(f"dense causal: {causal_ms:.3f} ms, kernel {causal_kernel:.0f} us, {dense:.0f} TFLOP/s")
        call = lambda: attngen.attention_varlen(q[0], k[0], v[0], cu, cu, mask="causal")  # noqa: E731
        print(f"attention_varlen: {t(call):.3f} ms; kernels {kernel_us(torch, call)}")
        for label in labels or SWEEP:
            config = Sm90Config.from_label(label).to_dict()
            spec = attngen.AttentionSpec(head_dim=HEAD_DIM, mask="causal", varlen=True, family="fwd_sm90",
                                         config=config)
            fn = lambda: attngen.attention(q, k, v, spec, inputs={"cu_seqlens_q": cu, "cu_seqlens_k": cu})  # noqa: E731
            try:
                ms = t(fn)
            except Exception as exc:  # a config this GPU cannot hold
                print(f"{label}: {exc}")
                continue
            kernels = kernel_us(torch, fn)
            main_us = max(kernels.values())
            build_us = min(kernels.values()) if len(kernels) > 1 else 0.0
            useful = pairs * pair_flops / main_us / 1e6
            print(f"{label}: call {ms:.3f} ms, kernel {main_us:.0f} us, builder {build_us:.1f} us, "
                  f"{useful:.0f} useful TFLOP/s = {useful / dense:.3f} x dense causal")


if __name__ == "__main__":
    main(sys.argv[1:])
