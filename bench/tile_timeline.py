"""Where a fwd_sm90 tile's time goes beyond its key blocks (docs/perf-notes.md, "Per-tile cost"), on
the GPU: every fwd_sm90 kernel of this process is built with ATTNGEN_TRACE, which stamps the SM clock
at each tile's phases (trace.cuh `trace`), and each case's last call is read back.

  PYTHONPATH=.:bench python bench/tile_timeline.py [--config LABEL] [--headers VERSION] [CASE ...]

--config: every case on that fwd_sm90 config (its default swapped, as sm90_ab_probe.py --configs does);
--headers: the kernel built from another version of its headers (bench/sm90_versions.py).

Per case and consumer warpgroup, clocks summed over the traced tiles: waiting for the tile's number
(the schedule), reading its place and bounds, waiting for its Q, the first block (S, softmax: the
overlap's prologue), the other blocks, the epilogue (last P V waited for, normalise, store), and the
gap to the next tile; then per block of the steady loop, and the fixed cost of a tile in blocks. The
producer's side of a tile boundary: from its first K's stage freeing to that K's issue, and from the previous
round's last V to it.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

EVENTS = ["TILE_WAIT", "TILE_READY", "Q_READY", "FIRST_SOFTMAX", "LAST_PV", "STORED", "KEY_BLOCKS", "SM", "K0_READY",
          "TURN0", "S0_READY", "Q_ISSUED", "K0_ISSUED", "V0_ISSUED", "S0_MASKED", "SOFTMAX0_DONE", "PREVIOUS_PV",
          "K0_STAGE_FREE", "LAST_V_ISSUED"]
E = {name: i for i, name in enumerate(EVENTS)}
SHAPE = (1024, 3, 32, 19)  # trace.cuh attngen_trace: [cta][warpgroup 0, 1, producer][tile][event]


def cases(torch, attngen):
    from attngen.bench_masks import _document_ids

    def dense(batch, seqlen, heads, head_dim, mask):
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        return lambda: attngen.attention(q, k, v, mask=mask)

    def documents():
        q, k, v = (torch.randn(16384, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        _, lengths = _document_ids()
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).cuda()
        return lambda: attngen.attention_varlen(q, k, v, cu, cu, mask="causal")

    def document_ids():  # the same documents as ids through attention() (a table mask that reads doc)
        q, k, v = (torch.randn(1, 16384, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        doc = _document_ids()[0].cuda()
        return lambda: attngen.attention(q, k, v, mask="doc[b, q_idx] == doc[b, kv_idx] and causal", inputs={"doc": doc})

    return {
        "documents": documents,
        "document-ids": document_ids,
        "window4096-16k": lambda: dense(1, 16384, 16, 128, "sliding_window(4095, 0)"),
        "d128-causal-16k": lambda: dense(1, 16384, 16, 128, "causal"),
        "d128-causal-2k": lambda: dense(8, 2048, 16, 128, "causal"),
        "d128-none-2k": lambda: dense(8, 2048, 16, 128, "none"),
        "d64-causal-2k": lambda: dense(8, 2048, 32, 64, "causal"),
    }


NO_MASK = os.environ.get("NO_FIRST_MASK") == "1"  # timing only: the first block's mask left out (wrong results)


def traced_render(family):
    render = family.render

    def render_with_trace(plan):
        defines = "#define ATTNGEN_TRACE 1\n" + ("#define ATTNGEN_TRACE_NO_FIRST_MASK 1\n" if NO_MASK else "")
        return defines + render(plan)

    family.render = render_with_trace


def trace_view(cupy, kernel):
    """The kernel's fa90::attngen_trace array [cta, warpgroup, tile, event] on the device (its mangled name)."""
    return cupy.ndarray(SHAPE, cupy.int64, memptr=kernel._module._module.get_global("_ZN4fa9013attngen_traceE"))


def summarise(name: str, trace: np.ndarray, ms: float) -> None:
    lines = [f"{name}: call {ms:.3f} ms"]
    for wg in range(2):
        t = trace[:, wg]  # [cta, tile, event]
        done = (t[..., E["STORED"]] > 0) & (t[..., E["KEY_BLOCKS"]] > 0)
        if not done.any():
            continue
        n = t[..., E["KEY_BLOCKS"]][done]
        phases = {
            "schedule": t[..., E["TILE_READY"]] - t[..., E["TILE_WAIT"]],
            "q": t[..., E["Q_READY"]] - t[..., E["TILE_READY"]],
            "k0": t[..., E["K0_READY"]] - t[..., E["Q_READY"]],
            "turn0": t[..., E["TURN0"]] - t[..., E["K0_READY"]],
            "s0": t[..., E["S0_READY"]] - t[..., E["TURN0"]],
            "mask0": t[..., E["S0_MASKED"]] - t[..., E["S0_READY"]],
            "softmax0": t[..., E["FIRST_SOFTMAX"]] - t[..., E["S0_MASKED"]],
            "other blocks": t[..., E["LAST_PV"]] - t[..., E["FIRST_SOFTMAX"]],
            "epilogue": t[..., E["STORED"]] - t[..., E["LAST_PV"]],
        }
        producer = trace[:, 2]
        k0_load = (t[..., E["K0_READY"]] - producer[..., E["K0_ISSUED"]])[done & (producer[..., E["K0_ISSUED"]] > 0)]
        k0_early = (t[..., E["Q_READY"]] - producer[..., E["K0_ISSUED"]])[done & (producer[..., E["K0_ISSUED"]] > 0)]
        sums = {k: float(v[done].sum()) for k, v in phases.items()}
        # The gap from a tile's end to the next one's start on the same CTA (persistent schedules).
        nxt = np.zeros_like(done)
        nxt[:, :-1] = done[:, :-1] & done[:, 1:]
        gap = (t[:, 1:, E["TILE_WAIT"]] - t[:, :-1, E["STORED"]])[nxt[:, :-1]]
        steady = sums["other blocks"] / max(float((n - 1).sum()), 1.0)
        # Each CTA's span, first tile's start to last store: a carried epilogue (CARRY) runs inside
        # the next tile, so the phases overlap and their sum would count it twice.
        first = np.where(done[:, 0], t[:, 0, E["TILE_WAIT"]], 0)
        last = np.where(done, t[..., E["STORED"]], 0).max(axis=1)
        total = float((last - first)[done[:, 0]].sum())
        fixed = (total - steady * float(n.sum())) / len(n)
        if wg == 0 and not done[:, 1:].any():  # one tile per CTA: the gap between CTAs on an SM
            starts, ends, sms = t[:, 0, E["TILE_WAIT"]], t[:, 0, E["STORED"]], t[:, 0, E["SM"]]
            cta_gaps = []
            for sm in np.unique(sms[done[:, 0]]):
                order = np.argsort(starts[(sms == sm) & done[:, 0]])
                s_, e_ = starts[(sms == sm) & done[:, 0]][order], ends[(sms == sm) & done[:, 0]][order]
                cta_gaps.extend((s_[1:] - e_[:-1]).tolist())
            gap = np.array(cta_gaps, dtype=np.int64)
            total = sum(sums.values()) + float(gap.sum())
            fixed = (total - steady * float(n.sum())) / len(n)
        if wg == 0 and done[:, 1:].any():  # persistent: how evenly the CTAs' work ends (one clock for all SMs)
            spans = (last - first)[done[:, 0]].astype(np.float64)
            lines.append(f"  CTA spans (first tile's start to last store, clk): max {spans.max():.0f}, median "
                         f"{np.median(spans):.0f}, min {spans.min():.0f}; idle at the end "
                         f"{1 - spans.mean() / spans.max():.1%} of the longest; the longest at the call's time: "
                         f"{spans.max() / (ms * 1e3):.0f} MHz")
        lines.append(f"  wg{wg}: {len(n)} tiles, {n.mean():.1f} blocks each, {steady:.0f} clk per steady block; "
                     f"per tile (clk): " + ", ".join(f"{k} {v / len(n):.0f}" for k, v in sums.items())
                     + f", gap {gap.mean() if len(gap) else 0:.0f}; fixed {fixed:.0f} clk = {fixed / steady:.2f} blocks"
                     + f"; K0 issued {k0_early.mean():.0f} clk before Q ready, ready {k0_load.mean():.0f} after issue")
        lines.extend(first_softmax_split(wg, t, done))
    lines.extend(producer_boundary(trace))
    lines.extend(lone_tiles(trace))
    lines.extend(late_ctas(trace))
    print("\n".join(lines), flush=True)


def first_softmax_split(wg: int, t: np.ndarray, done: np.ndarray) -> list[str]:
    """The softmax0 phase of tiles that carried the previous tile's last P V (CARRY) split: the first block's
    softmax, the wait for that P V, and the rest (the previous tile's output staged and stored, O zeroed, P made)."""
    carried = done & (t[..., E["PREVIOUS_PV"]] > 0)
    if not carried.any():
        return []
    parts = {
        "softmax": t[..., E["SOFTMAX0_DONE"]] - t[..., E["S0_MASKED"]],
        "previous P V wait": t[..., E["PREVIOUS_PV"]] - t[..., E["SOFTMAX0_DONE"]],
        "previous output, O zeroed, P": t[..., E["FIRST_SOFTMAX"]] - t[..., E["PREVIOUS_PV"]],
    }
    return [f"  wg{wg} softmax0 of {int(carried.sum())} carrying tiles (clk): "
            + ", ".join(f"{k} {float(v[carried].mean()):.0f}" for k, v in parts.items())]


def producer_boundary(trace: np.ndarray) -> list[str]:
    """The producer between a tile's loads and the next's, per round after the first (means, clk): its first K's
    stage free to that K's issue, and the previous round's last V issued to both. A stage free long before its
    K goes out says the producer's own work holds the load, not the ring."""
    pr = trace[:, 2]
    seen = (pr[:, 1:, E["K0_ISSUED"]] > 0) & (pr[:, 1:, E["K0_STAGE_FREE"]] > 0) & (pr[:, :-1, E["LAST_V_ISSUED"]] > 0)
    if not seen.any():
        return []
    k0, free = (pr[:, 1:, E[name]][seen] for name in ("K0_ISSUED", "K0_STAGE_FREE"))
    last_v = pr[:, :-1, E["LAST_V_ISSUED"]][seen]
    return [f"  producer, {int(seen.sum())} rounds: K0's stage free -> K0 issued {float((k0 - free).mean()):.0f}; "
            f"previous last V issued -> K0's stage free {float((free - last_v).mean()):.0f}, -> K0 issued "
            f"{float((k0 - last_v).mean()):.0f}"]


def late_ctas(trace: np.ndarray, count: int = 3) -> list[str]:
    """Persistent schedules: the CTAs with the longest spans, each with its last three tiles (key blocks, start
    and end in clocks from the CTA's first tile's start). Spans only: each SM's clock64 has an offset of its
    own (measured: SMs' clocks apart by ~2M clk), so CTAs' times are compared as spans, all of which begin
    at the launch."""
    t = trace[:, 0]
    done = (t[..., E["STORED"]] > 0) & (t[..., E["KEY_BLOCKS"]] > 0)
    if not done[:, 1:].any():
        return []
    first = t[:, 0, E["TILE_WAIT"]]
    spans = np.where(done[:, 0], np.where(done, t[..., E["STORED"]], 0).max(axis=1) - first, 0)
    median = int(np.median(spans[done[:, 0]]))
    out = []
    for cta in np.argsort(spans)[::-1][:count]:
        tiles = np.nonzero(done[cta])[0][-3:]
        desc = "; ".join(f"{int(t[cta, j, E['KEY_BLOCKS']])} blocks {int(t[cta, j, E['TILE_WAIT']] - first[cta])} to "
                         f"{int(t[cta, j, E['STORED']] - first[cta])}" for j in tiles)
        out.append(f"  late CTA {cta} (span {int(spans[cta])} clk, the median's {median}; {int(done[cta].sum())} "
                   f"tiles): last tiles {desc}")
    return out


def lone_tiles(trace: np.ndarray) -> list[str]:
    """Warpgroup 0's tiles with warpgroup 1 idle (its 64 rows past the sequence's end: no store of its own)
    against those both run: clocks per steady block and per block of the whole round (tile start to next)."""
    t0, t1 = trace[:, 0], trace[:, 1]
    done0 = (t0[..., E["STORED"]] > 0) & (t0[..., E["KEY_BLOCKS"]] > 1)
    alone = done0 & (t1[..., E["TILE_READY"]] > 0) & (t1[..., E["STORED"]] == 0)
    paired = done0 & (t1[..., E["STORED"]] > 0)
    nxt = np.zeros_like(done0)
    nxt[:, :-1] = t0[:, 1:, E["TILE_WAIT"]] > 0
    out = []
    for label, sel in (("alone", alone), ("paired", paired)):
        if not sel.any():
            continue
        n = t0[..., E["KEY_BLOCKS"]][sel].astype(np.float64)
        steady = (t0[..., E["LAST_PV"]] - t0[..., E["FIRST_SOFTMAX"]])[sel].sum() / (n - 1).sum()
        whole = sel & nxt
        rounds = np.zeros_like(t0[..., 0])
        rounds[:, :-1] = t0[:, 1:, E["TILE_WAIT"]] - t0[:, :-1, E["TILE_WAIT"]]
        per_block = rounds[whole].sum() / t0[..., E["KEY_BLOCKS"]][whole].sum() if whole.any() else float("nan")
        out.append(f"  wg0 {label}: {int(sel.sum())} tiles, {n.mean():.1f} blocks each, {steady:.0f} clk per steady "
                   f"block, {per_block:.0f} clk per block of the round (tile start to the next's)")
    return out


def config_label(label: str):
    """--config's value as an Sm90Config; argparse reports a label that is none."""
    from attngen.families.fwd_sm90 import family as sm90

    try:
        return sm90.Sm90Config.from_label(label)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


CASE_NAMES = ("documents", "document-ids", "window4096-16k", "d128-causal-16k", "d128-causal-2k", "d128-none-2k",
              "d64-causal-2k")  # cases()'s keys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", metavar="LABEL", type=config_label,
                        help="a fwd_sm90 config label for every case, e.g. m128n128s2opd")
    parser.add_argument("--headers", metavar="VERSION", help="the kernel's headers from a version (sm90_versions.py)")
    parser.add_argument("cases", nargs="*", metavar="CASE", help=f"any of {', '.join(CASE_NAMES)} (default: all)")
    args = parser.parse_args()
    if unknown := [name for name in args.cases if name not in CASE_NAMES]:
        parser.error(f"cases {unknown} are not cases of this timeline; allowed: {', '.join(CASE_NAMES)}")
    import cupy
    import torch

    import attngen
    from attngen import families
    from attngen.bench import time_ms
    from attngen.runtime import dispatch

    family = families.get_family("fwd_sm90")
    if args.headers:
        import sm90_versions as versions

        versions.use(versions.load(args.headers))
    if args.config:
        family.default_config = lambda problem, target, seqlen=None: args.config
    traced_render(family)
    names = args.cases
    torch.manual_seed(0)
    table = cases(torch, attngen)
    assert tuple(table) == CASE_NAMES, "CASE_NAMES lists cases()'s keys"
    with torch.no_grad():
        for name in names or list(table):
            fn = table[name]()
            ms = time_ms(lambda: fn(), [()], warmup=3, repeats=20)
            used = [k for k in dispatch._kernels.values() if k.plan.family == "fwd_sm90"]
            for kernel in used:
                trace_view(cupy, kernel).fill(0)
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
            for kernel in used:
                trace = trace_view(cupy, kernel).get()
                if (trace[..., E["STORED"]] > 0).any():
                    summarise(f"{name} ({kernel.plan.name})", trace, ms)


if __name__ == "__main__":
    main()
