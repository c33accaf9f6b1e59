"""The varlen tile builder (attngen/families/fwd_sm90/varlen_tiles.cuh) under compute-sanitizer:
2100 sequences (three chunks of its scans), one sequence with rows outside it, malformed boundaries.

  compute-sanitizer --tool racecheck --report-api-errors no --kernel-name kns=_tiles \
      python bench/varlen_builder_sanitize.py
"""
import torch

import attngen

g = torch.Generator().manual_seed(3)
for lengths in (torch.randint(0, 7, (2100,), generator=g).tolist(), [600]):
    q = torch.randn(sum(lengths) + 5, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lengths) + 3, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        attngen.attention_varlen(q, k, k, cu, cu, mask="causal")
bad_q = torch.tensor([3, 400, 100, 900], dtype=torch.int32, device="cuda")
bad_k = torch.tensor([-5, 300, 200, 10_000], dtype=torch.int32, device="cuda")
with torch.no_grad():
    attngen.attention_varlen(q, k, k, bad_q, bad_k, mask="causal")
torch.cuda.synchronize()
print("builder runs done")
