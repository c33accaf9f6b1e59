"""The mask compiler's benchmark (issue: masks and score modifiers), one row per case, peers in the
same process: d128, 16 heads, bf16, one 16384-token sequence.

  causal_expr   mask "q_idx >= kv_idx" (an expression: a band, attngen/maskc/bands.py) against
                the built-in causal: what spelling a mask out costs (causal_expr_fwd_sm80: the same
                on the fwd_sm80 family, pinned)
  cp_shard      a context-parallel shard: the last CP_SHARD query rows against all 16384 keys under
                "kv_idx + kv_offset <= q_idx + q_offset" (offsets as scalar inputs), against the
                built-in causal on the same shard (bottom-right aligned: the same visible pairs)
  window_4096   sliding_window(4095, 0): time against (work fraction x the built-in causal's
                time), and FlexAttention with the same window as a block mask
  documents     16 random-length documents, causal within each, as a runtime input of ids:
                useful TFLOP/s (visible pairs only) against the same family's dense causal and
                FlexAttention with a document block mask
  varlen_documents  the same documents through attention_varlen (cu_seqlens, the packed layout),
                which tiles per sequence (Problem.varlen): useful TFLOP/s against the dense causal
                and FlexAttention's document block mask; and through the document mask over batch 1
                (its arrays built from cu_seqlens per call), the path it takes elsewhere
  mask_build    what a call costs beyond the kernel for a document mask: attngen copies the ids;
                FlexAttention's create_block_mask builds its block mask
  block_sparse  a block-sparse causal pattern with holes (each 128-row block sees its 3 latest key
                blocks and every 8th one): FlexAttention with its BlockMask, attngen with the same
                BlockMask (block_mask=, lowered per call) and as an expression; useful TFLOP/s

FLOPs are counted over visible (query, key) pairs only: 4 * D per pair. Every ratio's times are taken
side by side (attngen/bench.py `time_beside`: the calls alternate in short runs): the GPU's clock
falls ~12% within seconds of sustained load (`bench/window_alloc_probe.py`: the built-in causal
1.61 ms on a rested GPU, 1.80 ms a few seconds on), so a reference timed first and a case timed
later would compare two clocks; and before the first case the built-in causal runs for a few seconds
(`settle_clock`), so that no case is timed while a rested GPU's clock is still falling."""

from __future__ import annotations

import datetime as _dt
import json
import time
from pathlib import Path

SEQLEN = 16384
HEADS = 16
HEAD_DIM = 128
WINDOW = 4096
DOCUMENTS = 16
CP_SHARD = 4096
CP_MASK = "kv_idx + kv_offset <= q_idx + q_offset"


def _time_ms(fn, repeats: int = 20) -> float:
    from attngen.bench import time_ms

    return time_ms(lambda: fn(), [()], warmup=3, repeats=repeats)


def _beside(**fns) -> dict[str, float]:
    """attngen/bench.py time_beside over these calls (no inputs to rotate: one 16k sequence)."""
    from attngen.bench import time_beside

    times, errors = time_beside(fns, [()], warmup=2, repeats=6)
    if errors:
        raise next(iter(errors.values()))
    return times


def _document_ids(seed: int = 0, documents: int = DOCUMENTS, tokens: int = SEQLEN):
    """`documents` documents of random lengths (at least 1) filling `tokens` tokens (the bench's: 16 in
    SEQLEN), as (1, tokens) int32 ids, and their lengths."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(tokens - 1, generator=gen)[:documents - 1].add(1).sort().values
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([tokens])]))
    ids = torch.repeat_interleave(torch.arange(documents, dtype=torch.int32), lengths)
    return ids[None], lengths


def run_mask_bench(out_dir: Path) -> dict:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import attngen
    from attngen.bench import settle_clock
    from attngen.spec import AttentionSpec

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    flex = torch.compile(flex_attention, dynamic=False)
    pair_flops = 4 * HEAD_DIM * HEADS
    causal_pairs = SEQLEN * (SEQLEN + 1) // 2
    results: dict = {}

    def attn(**kwargs):
        return lambda: attngen.attention(q, k, v, **kwargs)

    with torch.no_grad():
        causal = attn(mask="causal")
        settle_clock(causal)  # the first ratio compares two kernels of one source: 1.00 on a settled clock
        t = _beside(causal=causal, expression=attn(mask="q_idx >= kv_idx"))
        causal_ms = t["causal"]
        results["causal_expr"] = {"causal_ms": causal_ms, "expression_ms": t["expression"],
                                  "ratio": t["expression"] / causal_ms}
        # The same on the other forward family (the bar holds per family): pinned to fwd_sm80.
        sm80 = {text: AttentionSpec(head_dim=HEAD_DIM, dtype="bf16", mask=text, family="fwd_sm80")
                for text in ("causal", "q_idx >= kv_idx")}
        t = _beside(causal=lambda: attngen.attention(q, k, v, sm80["causal"]),
                    expression=lambda: attngen.attention(q, k, v, sm80["q_idx >= kv_idx"]))
        results["causal_expr_fwd_sm80"] = {"causal_ms": t["causal"], "expression_ms": t["expression"],
                                           "ratio": t["expression"] / t["causal"]}

        shard = q[:, SEQLEN - CP_SHARD:]
        offsets = {"q_offset": torch.tensor(SEQLEN - CP_SHARD, dtype=torch.int32, device="cuda"),
                   "kv_offset": torch.tensor(0, dtype=torch.int32, device="cuda")}
        t = _beside(offsets=lambda: attngen.attention(shard, k, v, mask=CP_MASK, inputs=offsets),
                    causal=lambda: attngen.attention(shard, k, v, mask="causal"))
        results["cp_shard"] = {"rows": CP_SHARD, "offsets_ms": t["offsets"], "causal_ms": t["causal"],
                               "ratio": t["offsets"] / t["causal"]}

        window_pairs = sum(min(i + 1, WINDOW) for i in range(SEQLEN))
        window_mask = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < WINDOW), None, None, SEQLEN,
                                        SEQLEN, device="cuda")
        t = _beside(window=attn(mask=f"sliding_window({WINDOW - 1}, 0)"), causal=causal,
                    flex=lambda: flex(qt, kt, vt, block_mask=window_mask))
        window_ms, flex_window_ms = t["window"], t["flex"]
        fraction = window_pairs / causal_pairs
        results["window_4096"] = {"ms": window_ms, "flex_ms": flex_window_ms, "work_fraction": fraction,
                                  "causal_ms": t["causal"],
                                  "vs_fraction_of_causal": window_ms / (fraction * t["causal"]),
                                  "tflops": window_pairs * pair_flops / window_ms / 1e9,
                                  "flex_tflops": window_pairs * pair_flops / flex_window_ms / 1e9}

        ids, lengths = _document_ids()
        doc = ids.cuda()
        doc_pairs = int(sum(n * (n + 1) // 2 for n in lengths.tolist()))
        doc_text = "doc[b, q_idx] == doc[b, kv_idx] and causal"
        flat = doc[0]
        doc_mask = create_block_mask(lambda b, h, qi, ki: (flat[qi] == flat[ki]) & (qi >= ki), None, None, SEQLEN,
                                     SEQLEN, device="cuda")

        def flex_doc():
            return flex(qt, kt, vt, block_mask=doc_mask)

        t = _beside(documents=attn(mask=doc_text, inputs={"doc": doc}), causal=causal, flex=flex_doc)
        doc_ms, flex_doc_ms = t["documents"], t["flex"]
        causal_tflops = causal_pairs * pair_flops / t["causal"] / 1e9
        doc_tflops = doc_pairs * pair_flops / doc_ms / 1e9
        results["documents"] = {"ms": doc_ms, "flex_ms": flex_doc_ms, "lengths": lengths.tolist(),
                                "causal_ms": t["causal"],
                                "tflops": doc_tflops, "flex_tflops": doc_pairs * pair_flops / flex_doc_ms / 1e9,
                                "vs_dense_causal": doc_tflops / causal_tflops,
                                "vs_flex": flex_doc_ms / doc_ms}

        # The same documents as FlashAttention's varlen layout (attngen.attention_varlen, cu_seqlens).
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).cuda()
        packed = [x[0] for x in (q, k, v)]
        t = _beside(varlen=lambda: attngen.varlen.attention_varlen(*packed, cu, cu, mask="causal"), causal=causal,
                    flex=flex_doc)
        varlen_ms = t["varlen"]
        attngen.varlen.PER_SEQUENCE_TILES = False
        try:
            varlen_mask_ms = _time_ms(lambda: attngen.varlen.attention_varlen(*packed, cu, cu, mask="causal"))
        finally:
            attngen.varlen.PER_SEQUENCE_TILES = True
        varlen_tflops = doc_pairs * pair_flops / varlen_ms / 1e9
        results["varlen_documents"] = {"ms": varlen_ms, "tflops": varlen_tflops, "flex_ms": t["flex"],
                                       "causal_ms": t["causal"],
                                       "vs_dense_causal": varlen_tflops / (causal_pairs * pair_flops / t["causal"] / 1e9),
                                       "vs_flex": t["flex"] / varlen_ms, "document_mask_ms": varlen_mask_ms,
                                       "vs_document_ids": varlen_ms / doc_ms}

        start = time.perf_counter()
        for _ in range(10):
            create_block_mask(lambda b, h, qi, ki: (flat[qi] == flat[ki]) & (qi >= ki), None, None, SEQLEN, SEQLEN,
                              device="cuda")
        torch.cuda.synchronize()
        build_ms = (time.perf_counter() - start) / 10 * 1e3
        copy_ms = _time_ms(lambda: ids.to("cuda", non_blocking=True))
        results["mask_build"] = {"flex_create_block_mask_ms": build_ms, "attngen_copy_ids_ms": copy_ms}

        results["block_sparse"] = _block_sparse(torch, attngen, create_block_mask, flex, q, k, v, qt, kt, vt,
                                                pair_flops, causal_pairs, causal)

    props = torch.cuda.get_device_properties(0)
    meta = {"gpu": props.name, "date": _dt.date.today().isoformat(), "torch": torch.__version__,
            "setup": f"bf16, 1 x {SEQLEN} tokens, {HEADS} heads, d{HEAD_DIM}; FLOPs over visible pairs only"}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in props.name.lower()).strip("-")
    (out_dir / f"masks-{slug}-{meta['date']}.json").write_text(json.dumps({"meta": meta, **results}, indent=1))
    plot(out_dir / f"masks-{slug}-{meta['date']}.json")
    for name, row in results.items():
        print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "lengths"})
    return results


BLOCK = 128
LOCAL_BLOCKS = 3
STRIDE_BLOCKS = 8


def _block_sparse(torch, attngen, create_block_mask, flex, q, k, v, qt, kt, vt, pair_flops, causal_pairs, causal):
    """The block_sparse case: times and useful TFLOP/s of the three ways to run one pattern."""
    expression = (f"q_idx >= kv_idx and (q_idx // {BLOCK} - kv_idx // {BLOCK} < {LOCAL_BLOCKS} "
                  f"or (kv_idx // {BLOCK}) % {STRIDE_BLOCKS} == 0)")

    def pattern(b, h, qi, ki):
        return (qi >= ki) & (((qi // BLOCK - ki // BLOCK) < LOCAL_BLOCKS) | ((ki // BLOCK) % STRIDE_BLOCKS == 0))

    bm = create_block_mask(pattern, None, None, SEQLEN, SEQLEN, device="cuda", BLOCK_SIZE=BLOCK)
    rows = torch.arange(SEQLEN, device="cuda")[:, None]
    pairs = sum(int(pattern(0, 0, rows[i:i + 1024], torch.arange(SEQLEN, device="cuda")[None, :]).sum())
                for i in range(0, SEQLEN, 1024))
    t = _beside(flex=lambda: flex(qt, kt, vt, block_mask=bm),
                block_mask=lambda: attngen.attention(q, k, v, block_mask=bm, mask="causal"),
                expression=lambda: attngen.attention(q, k, v, mask=expression), causal=causal)
    flex_ms, block_mask_ms, expression_ms = t["flex"], t["block_mask"], t["expression"]
    tflops = {name: pairs * pair_flops / ms / 1e9 for name, ms in
              (("flex", flex_ms), ("block_mask", block_mask_ms), ("expression", expression_ms))}
    causal_tflops = causal_pairs / t["causal"] * pair_flops / 1e9
    return {"pairs_fraction_of_causal": pairs / (SEQLEN * (SEQLEN + 1) // 2), "flex_ms": flex_ms, "causal_ms": t["causal"],
            "block_mask_ms": block_mask_ms, "expression_ms": expression_ms,
            **{f"{name}_tflops": value for name, value in tflops.items()},
            "block_mask_vs_flex": flex_ms / block_mask_ms, "expression_vs_flex": flex_ms / expression_ms,
            "block_mask_vs_dense_causal_tflops": tflops["block_mask"] / causal_tflops}


def plot(json_path: Path) -> Path | None:
    """A PNG beside a mask benchmark's JSON: each case's time, attngen against FlexAttention (None
    without matplotlib, the `bench` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib missing; no plot written")
        return None

    data = json.loads(Path(json_path).read_text())
    rows = [("window 4096", data["window_4096"]["ms"], data["window_4096"]["flex_ms"]),
            ("documents", data["documents"]["ms"], data["documents"]["flex_ms"])]
    if "flex_ms" in data.get("varlen_documents", {}):
        rows.append(("varlen documents", data["varlen_documents"]["ms"], data["varlen_documents"]["flex_ms"]))
    if "block_sparse" in data:
        rows.append(("BlockMask", data["block_sparse"]["block_mask_ms"], data["block_sparse"]["flex_ms"]))
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label="attngen")
    ax.bar([i + 0.2 for i in x], [r[2] for r in rows], 0.4, label="FlexAttention")
    ax.set_xticks(list(x), [r[0] for r in rows])
    ax.set_ylabel("ms (lower is better)")
    ax.set_title(f"{data['meta']['gpu']}, {data['meta']['date']}: {data['meta']['setup']}", fontsize=7)
    ax.legend()
    fig.tight_layout()
    out = Path(json_path).with_suffix(".png")
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
