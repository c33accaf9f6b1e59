"""Per-kernel GPU time (torch.profiler / CUPTI) of packed documents, causal within each (d128, 16 heads,
bf16): the tile builder against the forward kernel, and the gap from one kernel's start to the next one's,
30 calls back to back: N documents of random lengths (at least 1) filling T tokens, by default
`attngen bench --masks`'s 16 in 16384.

    PYTHONPATH=. python bench/varlen_kernel_times.py [--documents N --tokens T]"""
import argparse
import collections
import re
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import attngen
from attngen.bench_masks import DOCUMENTS, SEQLEN, _document_ids

parser = argparse.ArgumentParser()
parser.add_argument("--documents", type=int, default=DOCUMENTS, help="documents of random lengths (at least 1)")
parser.add_argument("--tokens", type=int, default=SEQLEN, help="tokens they fill")
args = parser.parse_args()
if not 1 <= args.documents <= args.tokens:
    parser.error(f"--documents {args.documents} with --tokens {args.tokens}: allowed 1 <= documents <= tokens")
_, lengths = _document_ids(documents=args.documents, tokens=args.tokens)
tokens = args.tokens
q, k, v = (torch.randn(tokens, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).cuda()
with torch.no_grad():
    for _ in range(5):
        attngen.attention_varlen(q, k, v, cu, cu, mask="causal")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(30):
            attngen.attention_varlen(q, k, v, cu, cu, mask="causal")
        torch.cuda.synchronize()
kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)


def is_builder(name: str) -> bool:  # {plan}_tiles{threads} (varlen_tiles.py builder_kernels; before, {plan}_tiles)
    return re.search(r"_tiles\d*$", name) is not None


times = collections.defaultdict(list)
for e in kernels:
    times["tiles" if is_builder(e.name) else ("forward" if "fwd_sm90" in e.name else e.name[:30])].append(e.device_time)
print(f"{len(lengths)} documents in {tokens} tokens:", {n: (len(t), round(statistics.median(t), 2)) for n, t in times.items()})
starts = [(is_builder(e.name), e.time_range.start, e.time_range.end) for e in kernels]
# builder start -> forward start, forward end -> next builder start (us)
after_tiles = [b[1] - a[1] for a, b in zip(starts, starts[1:]) if a[0] and not b[0]]
between_calls = [b[1] - a[2] for a, b in zip(starts, starts[1:]) if not a[0] and b[0]]
print("tiles start -> forward start us", round(statistics.median(after_tiles), 2),
      " forward end -> next tiles start us", round(statistics.median(between_calls), 2))
