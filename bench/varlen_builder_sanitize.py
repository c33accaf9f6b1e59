"""The varlen tile builder (attngen/cuda/varlen_tiles.cuh) and the kernels reading its list under
compute-sanitizer: 2100 sequences (three chunks of the wide builder's scans), 40 (the narrow builder), one sequence with
rows outside it, malformed
boundaries; with a family name, through that family's per-sequence tiles (attngen.varlen.PER_SEQUENCE_FAMILY).

  compute-sanitizer --tool racecheck --report-api-errors no --kernel-name kns=_tiles \\
      python bench/varlen_builder_sanitize.py
  compute-sanitizer --tool memcheck python bench/varlen_builder_sanitize.py fwd_sm80
"""
import sys

import torch

import attngen
from attngen import varlen

varlen.PER_SEQUENCE_FAMILY = sys.argv[1] if len(sys.argv) > 1 else None
g = torch.Generator().manual_seed(3)
# Both builders (attngen/families/varlen_tiles.py build_threads): 1,024 threads over three chunks, 256 threads
# for 40 sequences and for one.
for lengths in (torch.randint(0, 7, (2100,), generator=g).tolist(), torch.randint(0, 300, (40,), generator=g).tolist(),
                [600]):
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
print("builder runs done", varlen.PER_SEQUENCE_FAMILY or "default family")
