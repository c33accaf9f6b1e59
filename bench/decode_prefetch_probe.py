"""The split kernel's L2 prefetch before its wait (flash_decode.cuh prefetch_first_blocks) against another
version of flash_decode.cuh, same process, builds alternating: per call from CUDA graphs of back-to-back
calls (each call's split kernel then starts under the previous call's combine, as it would under any
kernel that lets its dependents start early), the same with an ordinary kernel between the calls
(nothing to start under: what a model whose attention follows a plain kernel sees), and eager calls on an
idle GPU (synchronised before each, kernel times from the profiler: the hints then only add to the
kernel's start).

Cases: the decode bench's shapes (GQA 32/8, d128, bf16, one new token), contiguous and paged (pages of 64,
shuffled), and the bench's graph step at 1 x 4096 (paged, caches rotated past L2).

    git show HEAD:attngen/families/decode_sm80/flash_decode.cuh > .ab/decode-base.cuh
    PYTHONPATH=. python bench/decode_prefetch_probe.py --header base=.ab/decode-base.cuh [--rounds 2]
        [--shapes 1x32768,8x8192] [--config m16n64w4s3t] [--control] [--out FILE.jsonl]

One JSON line per measurement: us per call, TB/s = K and V bytes / time."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import attngen
from attngen.bench_decode import GRAPH_SHAPE, HEAD_DIM, HEADS_KV, HEADS_Q, SHAPES, _copy_bandwidth, _graph_ms, _paged
from decode_paged_probe import HEADER, json_lines, use_header
from decode_step_timeline import rotated_steps


def cases(shapes: list[tuple[int, int]], spec=None):
    """(name, bytes read per call, step function) for each shape and layout, then the rotated graph step
    (`spec`: a decode spec pinning a config, or None for the default)."""
    gen = torch.Generator().manual_seed(0)
    for batch, seqlen in shapes:
        q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
        kp, vp, table = _paged(k, v, gen)
        yield f"{batch}x{seqlen}", 2 * k.numel() * 2, lambda: attngen.decode(q, k, v, lens, spec=spec)
        yield f"{batch}x{seqlen}-paged", 2 * k.numel() * 2, lambda: attngen.decode(q, kp, vp, lens, page_table=table,
                                                                                 spec=spec)
        del q, k, v, kp, vp, table
    batch, seqlen = GRAPH_SHAPE
    nbytes = 2 * batch * seqlen * HEADS_KV * HEAD_DIM * 2
    steps = rotated_steps(batch, seqlen, True, gen)  # one cache per step, none found in L2 (as bench_graph)
    count = len(steps)
    turn = iter(range(10**9))

    def step():
        q, kp, vp, lens, table = steps[next(turn) % count]
        return attngen.decode(q, kp, vp, lens, page_table=table, spec=spec)
    yield f"graph-step-{batch}x{seqlen}-paged", nbytes, step


def _idle_us(fn, calls: int = 30) -> float:
    """Median GPU us of the kernels of fn() launched onto an idle GPU (synchronised before each call), from
    the profiler's kernel records (host launch latency excluded): nothing runs before the split kernel to
    start under, as in eager decoding whose host is slower than the GPU."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.cuda.synchronize()
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and "decode_sm80" in e.name),
                     key=lambda e: e.time_range.start)
    # One call: its split kernel's start to the end of its combine (or of the split kernel, with one split).
    per_call = []
    for i, e in enumerate(kernels):
        if e.name.endswith("_combine"):
            continue
        last = kernels[i + 1] if i + 1 < len(kernels) and kernels[i + 1].name.endswith("_combine") else e
        per_call.append(last.time_range.end - e.time_range.start)
    return sorted(per_call)[len(per_call) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--header", action="append", default=[], metavar="NAME=FILE")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per build, alternating (ABBA...)")
    parser.add_argument("--shapes", default=",".join(f"{b}x{s}" for b, s in SHAPES))
    parser.add_argument("--config", help="a decode_sm80 config label to pin (default: the family's choice)")
    parser.add_argument("--control", action="store_true",
                        help="also an A/A build: the tree's header with a comment appended (compiled apart, same "
                             "kernels), for the spread between builds and places in the order")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    emit = json_lines(args.out.open("w") if args.out else None)
    builds = [("tree", None), *((name, Path(path).read_text()) for name, path in (h.split("=", 1) for h in args.header))]
    if args.control:
        builds.append(("control", HEADER.read_text() + "\n// A/A control: the tree's header, compiled apart\n"))
    order = [b for r in range(args.rounds) for b in (builds if r % 2 == 0 else builds[::-1])]
    emit(gpu=torch.cuda.get_device_name(0), copy_tbps=_copy_bandwidth())
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    small = torch.zeros(1024, device="cuda")
    spec = None
    if args.config:
        from attngen.families.decode_sm80.family import DecodeConfig
        spec = attngen.AttentionSpec(head_dim=HEAD_DIM, gqa_ratio=HEADS_Q // HEADS_KV, family="decode_sm80",
                                     config=DecodeConfig.from_label(args.config).to_dict())
    for name, nbytes, fn in cases(shapes, spec):
        for build, text in order:
            use_header(text)
            for between in (False, True):
                def call(fn=fn, between=between):
                    if between:
                        small.add_(1.0)  # an ordinary kernel: the split kernel cannot start under it
                    return fn()
                call()
                us = _graph_ms(call, calls=40 if name.startswith("graph") else 20) * 1e3
                emit(case=name, build=build, mode="between" if between else "back-to-back", us=us,
                     tbps=nbytes / us / 1e6)
            us = _idle_us(fn)
            emit(case=name, build=build, mode="idle", us=us, tbps=nbytes / us / 1e6)
        use_header(None)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
