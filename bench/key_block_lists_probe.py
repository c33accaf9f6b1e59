"""Where the time of masks with key-block lists goes (docs/perf-notes.md, "Key-block lists"), on the
GPU, same process, times against the built-in causal (B=1, 16k, 16 heads, d128, bf16):

  python bench/key_block_lists_probe.py            the block_sparse bench pattern: BlockMask call,
                                                   the same with a prebuilt state grid, the grid
                                                   build alone, the pattern as an expression
  LISTS=1 python bench/key_block_lists_probe.py    the documents mask with lists forced on (the A/B
  LISTS=0 python bench/key_block_lists_probe.py    behind mask_table._lists_pay), and off
"""

from __future__ import annotations

import os


def main() -> None:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    import attngen
    from attngen import block_sparse, mask_table
    from attngen.bench import time_ms
    from attngen.bench_masks import BLOCK, HEAD_DIM, HEADS, LOCAL_BLOCKS, SEQLEN, STRIDE_BLOCKS, _document_ids

    lists = os.environ.get("LISTS")
    if lists is not None:
        mask_table._lists_pay = lambda mask_ir, declared: lists == "1"  # before the first plan is made
    q, k, v = (torch.randn(1, SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def t(fn):
        return time_ms(lambda: fn(), [()], warmup=3, repeats=30)

    with torch.no_grad():
        if lists is not None:
            doc = _document_ids()[0].cuda()
            text = "doc[b, q_idx] == doc[b, kv_idx] and causal"
            for _ in range(3):
                causal = t(lambda: attngen.attention(q, k, v, mask="causal"))
                docs = t(lambda: attngen.attention(q, k, v, mask=text, inputs={"doc": doc}))
                print(f"LISTS={lists} causal {causal:.3f} ms, documents {docs:.3f} ms ({docs / causal:.3f})")
            return

        def pattern(b, h, qi, ki):
            return (qi >= ki) & (((qi // BLOCK - ki // BLOCK) < LOCAL_BLOCKS) | ((ki // BLOCK) % STRIDE_BLOCKS == 0))

        bm = create_block_mask(pattern, None, None, SEQLEN, SEQLEN, device="cuda", BLOCK_SIZE=BLOCK)
        text, inputs = block_sparse.lowered_call(bm, "causal", None, q, k)
        expression = (f"q_idx >= kv_idx and (q_idx // {BLOCK} - kv_idx // {BLOCK} < {LOCAL_BLOCKS} "
                      f"or (kv_idx // {BLOCK}) % {STRIDE_BLOCKS} == 0)")
        for _ in range(2):
            print("block_mask call        ", t(lambda: attngen.attention(q, k, v, block_mask=bm, mask="causal")))
            print("prebuilt state grid    ", t(lambda: attngen.attention(q, k, v, mask=text, inputs=inputs)))
            print("grid build alone       ", t(lambda: block_sparse.state_grid(bm, SEQLEN, SEQLEN, BLOCK, BLOCK)))
            print("pattern as expression  ", t(lambda: attngen.attention(q, k, v, mask=expression)))
            print("built-in causal        ", t(lambda: attngen.attention(q, k, v, mask="causal")))


if __name__ == "__main__":
    main()
