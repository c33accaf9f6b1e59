"""Where the decode bench's graph step goes (1 x 4096, paged, caches rotated past L2): the step captured
back to back in a CUDA graph, as `attngen bench --decode` times it, replayed under the profiler; per step,
the split kernel's and the combine's start and end relative to the split kernel's start, and the next
step's split start. Also the step per split count, and the cuDNN peer's kernels the same way.

    PYTHONPATH=. python bench/decode_step_timeline.py [--splits 8,16,32] [--shape 1x32768] [--contiguous] [--no-peer]

Prints one line per split count: medians in us."""
from __future__ import annotations

import argparse
import statistics

import torch

import attngen
from attngen.bench_decode import GRAPH_SHAPE, HEAD_DIM, HEADS_KV, HEADS_Q, _graph_ms, _paged


def rotated_steps(batch: int, seqlen: int, paged: bool, gen: torch.Generator) -> list:
    """(q, k cache, v cache, lengths, page table or None) for as many decode steps as it takes for their
    caches to fill three times L2 (at least two), as the bench's graph step: no step finds its cache in L2."""
    nbytes = 2 * batch * seqlen * HEADS_KV * HEAD_DIM * 2
    out = []
    for _ in range(max(2, -(-3 * torch.cuda.get_device_properties(0).L2_cache_size // nbytes))):
        k = torch.randn(batch, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kp, vp, table = _paged(k, v, gen) if paged else (k, v, None)
        q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        out.append((q, kp, vp, torch.full((batch,), seqlen, dtype=torch.int32, device="cuda"), table))
    return out


def timeline(fn, calls: int) -> list:
    """Kernel records (name, start us, end us) of `calls` back-to-back fn() captured in a graph, replayed."""
    from torch.profiler import ProfilerActivity, profile

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    ks = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]
    return sorted(ks, key=lambda k: k[1])


def summarise(ks: list) -> dict:
    """Medians over the steps (a split kernel and, with more than one split, its combine), us: each
    kernel's duration (from its early start), the combine's end after its split kernel's end, the next
    split kernel's end after this combine's end (its work once its wait can release), and the step
    (split end to split end)."""
    splits = [k for k in ks if not k[0].split("(")[0].endswith("_combine")]
    combines = [k for k in ks if k[0].split("(")[0].endswith("_combine")]
    rows = {"split kernel": [e - s for _, s, e in splits], "step": [b[2] - a[2] for a, b in zip(splits, splits[1:])]}
    if combines:
        pairs = list(zip(splits, combines))
        rows["combine kernel"] = [e - s for _, s, e in combines]
        rows["combine start after split start"] = [c[1] - a[1] for a, c in pairs]
        rows["combine end after split end"] = [c[2] - a[2] for a, c in pairs]
        rows["split end after previous combine end"] = [b[2] - c[2] for (_, c), b in zip(pairs, splits[1:])]
        rows["split start after previous combine start"] = [b[1] - c[1] for (_, c), b in zip(pairs, splits[1:])]
    return {k: round(statistics.median(v), 2) for k, v in rows.items() if v}


def shape(text: str) -> tuple[int, int]:
    try:
        batch, seqlen = (int(x) for x in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: allowed: BATCHxTOKENS, e.g. 1x32768") from None
    if batch < 1 or seqlen < 1:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: allowed: a batch and a token count of at least 1")
    return batch, seqlen


def split_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x]
    except ValueError:
        counts = [0]
    if any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"--splits {text!r}: allowed: positive integers separated by commas")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--splits", type=split_counts, default=[], help="split counts to force, after the default")
    parser.add_argument("--shape", type=shape, default=GRAPH_SHAPE, help="BATCHxTOKENS, e.g. 1x32768")
    parser.add_argument("--contiguous", action="store_true", help="the contiguous cache instead of pages of 64")
    parser.add_argument("--no-peer", action="store_true")
    args = parser.parse_args()
    batch, seqlen = args.shape
    nbytes = 2 * batch * seqlen * HEADS_KV * HEAD_DIM * 2
    steps = rotated_steps(batch, seqlen, not args.contiguous, torch.Generator().manual_seed(1))
    count = len(steps)
    print(torch.cuda.get_device_name(0), f"{batch}x{seqlen}", "contiguous" if args.contiguous else "paged",
          f"{count} caches of {nbytes / 1e6:.1f} MB", flush=True)
    for splits in [None, *args.splits]:
        turn = iter(range(10**9))

        def step(splits=splits):
            q, kp, vp, lens, table = steps[next(turn) % count]
            return attngen.decode(q, kp, vp, lens, page_table=table, num_splits=splits)
        ms = _graph_ms(step, calls=4 * count)
        print(f"splits={splits}: graph step {ms * 1e3:.2f} us;", summarise(timeline(step, 4 * count)),
              flush=True)
    if args.no_peer:
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    kt = [torch.randn(batch, HEADS_KV, seqlen, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2 * count)]
    qt = torch.randn(batch, HEADS_Q, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    turn = iter(range(10**9))

    def peer():
        i = next(turn) % count
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt[2 * i], kt[2 * i + 1], enable_gqa=True)
    ms = _graph_ms(peer, calls=4 * count)
    ks = timeline(peer, 4 * count)
    print(f"cudnn: graph step {ms * 1e3:.2f} us; kernels {sorted({k[0][:60] for k in ks})}")
    first = [k for k in ks if k[0] == ks[0][0]]  # each step's first kernel
    print("cudnn:", {n[:50]: round(statistics.median([e - s for m, s, e in ks if m == n]), 2) for n in {k[0] for k in ks}},
          "step", round(statistics.median([b[1] - a[1] for a, b in zip(first, first[1:])]), 2))


if __name__ == "__main__":
    main()
