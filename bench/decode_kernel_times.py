"""Per-kernel GPU time (torch.profiler / CUPTI) of attngen.decode at the small shapes: the split kernel
against the combine, 30 eager calls each.  PYTHONPATH=. python bench/decode_kernel_times.py"""
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import attngen
from attngen.bench_decode import HEAD_DIM, HEADS_KV, HEADS_Q, _paged

for batch, seqlen in ((1, 32768), (8, 8192), (1, 4096)):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    kp, vp, table = _paged(k, v, gen)
    for layout, args, pt in (("contiguous", (q, k, v, lens), None), ("paged", (q, kp, vp, lens), table)):
        for _ in range(5):
            attngen.decode(*args, page_table=pt)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(30):
                attngen.decode(*args, page_table=pt)
            torch.cuda.synchronize()
        times = collections.defaultdict(list)
        for e in prof.events():
            if e.device_type.name == "CUDA":
                name = "combine" if e.name.endswith("_combine") else ("split" if "decode_sm80" in e.name else e.name[:30])
                times[name].append(e.device_time)
        print(batch, seqlen, layout, {n: (len(t), round(sum(t) / len(t), 2)) for n, t in times.items()}, flush=True)
