"""A list-scheduling model of fwd_sm90's dynamic schedule (tiles.cuh tile_of): tiles handed out in order by
a counter to the first CTA that frees up, one CTA per SM, each tile costing its key blocks times a block's
clocks plus a fixed cost. It prints, per way of cutting the heads into sections and per order within a
section, the longest CTA's clocks and how much of the call the CTAs idle at its end (what
bench/tile_timeline.py measures on the GPU). No GPU needed.

    python bench/section_model.py

Cases (d128, 16 heads, 16k tokens, 128 x 128 tiles, 132 SMs): causal (+ ALiBi), a window of 4096 keys and
the bench's 16 documents as ids (attngen/bench_masks.py: every block of a query block that straddles two
documents is partial, and partial blocks cost about twice a full one there); and the same documents packed
(varlen), with the producer's claim of the next tile as a tile starts or late (finish_claimed).
"""
from __future__ import annotations

import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMS, BLOCK, SEQ, HEADS = 132, 128, 16384, 16


def finish(costs: list[int], sections: list[int], order: list[int]) -> tuple[int, float]:
    """(the longest CTA's clocks, the CTAs' mean idle share at the end) for tiles in `order` within each
    section of `sections` heads, the heads of a section side by side."""
    tiles = [costs[m] for size in sections for m in order for _ in range(size)]
    free = [(0, cta) for cta in range(SMS)]
    ends = [0] * SMS
    for cost in tiles:
        t, cta = heapq.heappop(free)
        ends[cta] = t + cost
        heapq.heappush(free, (ends[cta], cta))
    longest = max(ends)
    return longest, 1 - sum(ends) / len(ends) / longest


def finish_claimed(costs: list[int], sections: list[int], order: list[int], lead: int | None, block: int) -> tuple[int, float]:
    """finish() with the producer's claim (producer.cuh): a CTA claims its next tile from the counter as
    its current one starts (lead None: before the late claim, about two blocks before it starts) or `lead`
    blocks' clocks before its current one ends (at its start if shorter), not as it frees up."""
    tiles = [costs[m] for size in sections for m in order for _ in range(size)]
    claims = []  # (claim time, cta, its current tile's end)
    for cta in range(min(SMS, len(tiles))):
        end = tiles[cta]
        heapq.heappush(claims, (-2 * block if lead is None else max(0, end - lead * block), cta, end))
    ends, taken = [0] * SMS, min(SMS, len(tiles))
    while claims:
        claimed, cta, end = heapq.heappop(claims)
        ends[cta] = end
        if taken < len(tiles):
            start, stop = end, end + tiles[taken]
            taken += 1
            at = start - 2 * block if lead is None else max(start, stop - lead * block)
            heapq.heappush(claims, (max(at, claimed), cta, stop))
    longest = max(ends)
    return longest, 1 - sum(ends) / len(ends) / longest


def varlen_entries() -> list[int]:
    """Key blocks of each varlen tile of the bench's 16 documents (tiles aligned to each document's start,
    causal within it), the longest first (varlen_tiles.cuh's list)."""
    from attngen.bench_masks import _document_ids

    lengths = _document_ids()[1].tolist()
    return sorted((m + 1 for n in lengths for m in range(-(-n // BLOCK))), reverse=True)


def document_costs(full: int = 2600, partial: int = 5000, fixed: int = 5500) -> list[int]:
    from attngen.bench_masks import _document_ids

    ids = _document_ids()[0][0].tolist()
    starts = {}
    for i, d in enumerate(ids):
        starts.setdefault(d, i)
    costs = []
    for m in range(SEQ // BLOCK):
        docs = sorted({ids[r] for r in range(m * BLOCK, (m + 1) * BLOCK)})
        first = min(starts[d] for d in docs) // BLOCK
        blocks = m - first + 1
        partials = blocks if len(docs) > 1 else 1 + (first != m and starts[docs[0]] % BLOCK != 0)
        costs.append((blocks - partials) * full + partials * partial + fixed)
    return costs


def main() -> None:
    m_blocks = SEQ // BLOCK
    block, fixed = 2500, 3300
    cases = {
        "causal": [(m + 1) * block + fixed for m in range(m_blocks)],
        "window 4096": [min(m + 1, 4096 // BLOCK + 1) * block + fixed for m in range(m_blocks)],
        "document ids": document_costs(),
    }
    cuts = {"3 x 5 + 1 (before)": [3] * 5 + [1], "3 x 4 + 4 (the one left joins)": [3] * 4 + [4]}
    for name, costs in cases.items():
        by_position = list(range(m_blocks - 1, -1, -1))
        by_work = sorted(range(m_blocks), key=lambda m: (-costs[m], -m))
        for cut, sections in cuts.items():
            for order_name, order in (("by position", by_position), ("by work", by_work)):
                longest, idle = finish(costs, sections, order)
                print(f"{name:13s} sections {cut:31s} {order_name:11s} longest {longest:8d} clk, idle {idle:5.1%}")
    # Varlen documents in sections of 4 heads (the waved sections), the claim as the tile starts against
    # the late claim (docs/perf-notes.md "The next tile claimed late"; measured idle 6.2% -> 2.0%).
    block, fixed = 2840, 3000
    entries = varlen_entries()
    costs = [b * block + fixed for b in entries]
    for lead in (None, 4, 2):
        longest, idle = finish_claimed(costs, [4] * 4, list(range(len(entries))), lead, block)
        claim = "as the tile starts" if lead is None else f"{lead} blocks before its end"
        print(f"varlen docs   sections 4 x 4, claimed {claim:24s} longest {longest:8d} clk, idle {idle:5.1%}")


if __name__ == "__main__":
    main()
