"""Where a decode split kernel's CTAs spend their time, contiguous cache against pages (docs/perf-notes.md,
"The paged cache's gap, CTA by CTA"): every decode_sm80 kernel of this process is built with ATTNGEN_TRACE,
which stamps the SM clock at points of each split-kernel CTA (flash_decode.cuh `DecodeEvent`) and the
global timer at its entry and end; each case runs `--calls` calls back to back in a CUDA graph (as the
decode bench times them), and the last call's stamps are read back.

    PYTHONPATH=. python bench/decode_cta_timeline.py [--shapes 1x32768,8x8192] [--layouts contiguous,p64-shuffled]
        [--configs m16n64w4s3,m16n64w4s3t]

Layouts as bench/decode_paged_probe.py, and p64-identity-as-contiguous: the identity pages' memory read
through the contiguous kernel (the same bytes as p64-identity, the other code path).

Per case: the call's GPU time, the grid's span by the global timer (first CTA's entry to the last one's
end) and how spread the CTAs' entries and ends are, then per CTA (median and 90th percentile, in
microseconds at the CTA's own clock rate): entry to the griddepcontrol wait's return, to the length, to
the ring's first page ids (cp.async; TMA: its first loads issued), to the first block landed, the steady
blocks (per block), the last block to the warps' merge, and the partials' stores.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np

EVENTS = ["ENTRY", "WAITED", "LENGTH", "IDS", "FIRST_BLOCK", "LAST_BLOCK", "MERGED", "STORED", "GT_ENTRY", "GT_END",
          "SM", "BLOCKS", "ISSUED0", "ISSUED"]  # flash_decode.cuh DecodeEvent, in order
E = {name: i for i, name in enumerate(EVENTS)}
TRACE_CTAS, TRACE_BLOCKS = 4096, 64  # flash_decode.cuh: the first TRACE_BLOCKS blocks' landings follow the events
SYMBOL = "_ZN2fd20attngen_decode_traceE"  # fd::attngen_decode_trace


def traced_render(family) -> None:
    render = family.render
    family.render = lambda plan: "#define ATTNGEN_TRACE 1\n" + render(plan)


def summarise(name: str, t: np.ndarray, ms: float) -> str:
    t = t[t[:, E["GT_END"]] > 0]
    if not len(t):
        return f"{name}: no CTA stamped"
    # Each CTA's clock rate from its own span on both timers (clocks per ns).
    ghz = (t[:, E["STORED"]] - t[:, E["ENTRY"]]) / np.maximum(t[:, E["GT_END"]] - t[:, E["GT_ENTRY"]], 1)
    us = lambda clk: clk / ghz / 1e3  # noqa: E731
    blocks = t[:, E["BLOCKS"]]
    phases = {
        "wait": t[:, E["WAITED"]] - t[:, E["ENTRY"]],
        "length": t[:, E["LENGTH"]] - t[:, E["WAITED"]],
        "ids": t[:, E["IDS"]] - t[:, E["LENGTH"]],
        "block 0 issued": t[:, E["ISSUED0"]] - t[:, E["IDS"]],
        "ring issued": t[:, E["ISSUED"]] - t[:, E["IDS"]],
        "first block": t[:, E["FIRST_BLOCK"]] - t[:, E["IDS"]],
        "per block": (t[:, E["LAST_BLOCK"]] - t[:, E["FIRST_BLOCK"]]) / np.maximum(blocks - 1, 1),
        "last to merged": t[:, E["MERGED"]] - t[:, E["LAST_BLOCK"]],
        "stores": t[:, E["STORED"]] - t[:, E["MERGED"]],
        "whole CTA": t[:, E["STORED"]] - t[:, E["ENTRY"]],
    }
    entry, end = t[:, E["GT_ENTRY"]], t[:, E["GT_END"]]
    lines = [f"{name}: call {ms * 1e3:.2f} us; {len(t)} CTAs on {len(np.unique(t[:, E['SM']]))} SMs, "
             f"{blocks.mean():.1f} blocks each, clock {np.median(ghz):.2f} GHz; grid span {(end.max() - entry.min()) / 1e3:.2f} us, "
             f"entries spread {(entry.max() - entry.min()) / 1e3:.2f} us, ends spread {(end.max() - end.min()) / 1e3:.2f} us"]
    # When the blocks landed, on the global timer (each CTA's clock mapped through its entry), as the share
    # of the grid's blocks landed by each tenth of its span: a straight line is an even rate.
    landed = t[:, len(EVENTS):len(EVENTS) + TRACE_BLOCKS]
    at = entry[:, None] + (landed - t[:, E["ENTRY"]][:, None]) / ghz[:, None]
    at = at[(landed > 0) & (np.arange(TRACE_BLOCKS)[None, :] < blocks[:, None])]
    if len(at):
        tenths = np.linspace(entry.min(), end.max(), 11)[1:]
        lines.append("  blocks landed by each tenth of the span: "
                     + " ".join(f"{(at <= x).mean():.2f}" for x in tenths))
    lines.append("  per CTA, us (median / p90): " + ", ".join(
        f"{k} {np.median(us(v)):.2f} / {np.percentile(us(v), 90):.2f}" for k, v in phases.items()))
    return "\n".join(lines)


LAYOUT = re.compile(r"contiguous|p(\d+)-(identity|shuffled|grouped)(-as-contiguous)?")


def shape_list(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)x(\d+)", item)
        if not match or min(int(match[1]), int(match[2])) < 1:
            raise argparse.ArgumentTypeError(f"--shapes {text!r}: {item!r} is not allowed; allowed: BATCHxTOKENS, "
                                              f"both at least 1, separated by commas (e.g. 1x32768,8x8192)")
        shapes.append((int(match[1]), int(match[2])))
    return shapes


def layout_list(text: str) -> list[str]:
    for item in text.split(","):
        match = LAYOUT.fullmatch(item)
        if not match or (match[1] is not None and int(match[1]) < 1):
            raise argparse.ArgumentTypeError(f"--layouts {text!r}: {item!r} is not allowed; allowed: contiguous or "
                                              f"pN-identity, pN-shuffled, pN-grouped (N >= 1 tokens a page), any of "
                                              f"them with -as-contiguous, separated by commas")
    return text.split(",")


def config_list(text: str) -> list[str]:
    from attngen.families.decode_sm80.family import DecodeConfig

    for item in text.split(","):
        try:
            DecodeConfig.from_label(item)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"--configs {text!r}: {e}") from None
    return text.split(",")


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--calls {text!r}: allowed: an integer of at least 1")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=shape_list, default="1x32768,8x8192", help="BATCHxTOKENS,...")
    parser.add_argument("--layouts", type=layout_list, default="contiguous,p64-shuffled")
    parser.add_argument("--configs", type=config_list, default="m16n64w4s3", help="decode_sm80 config labels")
    parser.add_argument("--calls", type=positive, default=20)
    parser.add_argument("--save", type=Path, help="a folder for each case's raw stamps (.npy, [cta, event])")
    args = parser.parse_args()
    for batch, seqlen in args.shapes:  # the pages cut each sequence evenly (decode_paged_probe.arrange)
        for layout in args.layouts:
            page = LAYOUT.fullmatch(layout)[1]
            if page is not None and seqlen % int(page):
                parser.error(f"--layouts {layout!r} with --shapes {batch}x{seqlen}: pages of {page} tokens do not "
                             f"divide {seqlen}; allowed: a page size that divides every shape's token count")

    import cupy
    import torch

    import attngen
    from attngen import families
    from attngen.bench_decode import HEAD_DIM, HEADS_KV, HEADS_Q, _graph_ms
    from attngen.families.decode_sm80.family import DecodeConfig
    from attngen.runtime import dispatch
    from bench.decode_paged_probe import arrange

    traced_render(families.get_family("decode_sm80"))
    print(torch.cuda.get_device_name(0), flush=True)
    for batch, seqlen in args.shapes:
        shape = f"{batch}x{seqlen}"
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
        for layout in args.layouts:
            if layout == "contiguous":
                kc, vc, table = k, v, None
            elif layout.endswith("-as-contiguous"):  # the pages' memory read through the contiguous kernel
                kc, vc, _ = arrange(k, v, layout.removesuffix("-as-contiguous"), gen)
                kc, vc, table = kc.view(k.shape), vc.view(v.shape), None
            else:
                kc, vc, table = arrange(k, v, layout, gen)
            for label in args.configs:
                spec = attngen.AttentionSpec(head_dim=HEAD_DIM, gqa_ratio=HEADS_Q // HEADS_KV, family="decode_sm80",
                                             config=DecodeConfig.from_label(label).to_dict())
                fn = lambda: attngen.decode(q, kc, vc, lens, page_table=table, spec=spec)  # noqa: E731
                ms = _graph_ms(fn, calls=args.calls)  # the last replay's last call left its stamps
                torch.cuda.synchronize()
                suffix = "_contiguous" if table is None else "_paged"
                kernels = [kern for kern in dispatch._kernels.values()
                           if kern.plan.family == "decode_sm80" and kern.plan.name.endswith(suffix)
                           and kern.plan.config.label() == label]
                for kern in kernels:
                    view = cupy.ndarray((TRACE_CTAS, len(EVENTS) + TRACE_BLOCKS), cupy.int64,
                                        memptr=kern._module._module.get_global(SYMBOL))
                    stamps = view.get()
                    print(summarise(f"{shape} {layout} {label}", stamps, ms), flush=True)
                    if args.save:
                        args.save.mkdir(parents=True, exist_ok=True)
                        np.save(args.save / f"{shape}-{layout}-{label}.npy", stamps[stamps[:, E["GT_END"]] > 0])
                    view.fill(0)
            del kc, vc, table
        del k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
