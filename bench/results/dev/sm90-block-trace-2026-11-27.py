# Dev copy (2026-11-27): run from the repo root with the variant header at abv/btrace.cuh (the patch beside this file applied to flash_fwd_sm90.cuh).
"""Dev: block-level timeline of fwd_sm90's overlapped loop (abv/btrace.cuh variant), CTAs 0-7, first tile."""
import sys
from pathlib import Path
import numpy as np
sys.path.insert(0, "bench")
import cupy, torch, attngen
import sm90_ab_probe as ab
from attngen.runtime import dispatch

import os
ab.use_header(Path(os.environ.get("BT", "abv/btrace.cuh")).read_text())
cases = {"d128-none-16k": (128, "none", 1, 16384, 16, None), "d128-none-16k-n128": (128, "none", 1, 16384, 16, "m128n128s2opr"),
         "d64-none-16k": (64, "none", 1, 16384, 32, None)}
for name in sys.argv[1:] or list(cases):
    d, mask, b, s, h, label = cases[name]
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fn = ab.runner(d, mask, h, h, label)
    for _ in range(5):
        fn(q, k, v)
    torch.cuda.synchronize()
    kern = [kk for kk in dispatch._kernels.values() if kk.plan.family == "fwd_sm90"][-1]
    arr = cupy.ndarray((8, 3, 4, 128, 9), cupy.int64, memptr=kern._module._module.get_global("_ZN4fa909blk_traceE"))
    arr.fill(0)
    torch.cuda.synchronize()
    fn(q, k, v)
    torch.cuda.synchronize()
    t = cupy.asnumpy(arr).astype(np.float64)
    np.save(f"{os.environ.get('OUT', '/tmp')}/btrace-{os.path.basename(os.environ.get('BT', 'bt'))}-{name}.npy", t)
    print(name, kern.plan.name)
    # steady blocks 8..100 of CTA 0..7
    lo, hi = 8, 100
    x = t[:, :2, :, lo:hi, :]
    nxt0 = t[:, :2, :, lo + 1:hi + 1, 0]
    waitk = nxt0 - x[..., 4]
    bar = x[..., 1] - x[..., 0]
    issue = x[..., 2] - x[..., 1]
    pvwait = x[..., 5] - x[..., 2]
    tail = x[..., 4] - x[..., 5]
    period = nxt0 - x[..., 0]
    qk_issue = x[..., 6] - x[..., 1]; vwait = x[..., 7] - x[..., 6]; pv_issue = x[..., 2] - x[..., 7]
    pvdone = x[..., 8] - x[..., 5]
    for nm, a in [("qk issue", qk_issue), ("v wait", vwait), ("pv issue", pv_issue), ("S->PV done", pvdone), ("period", period), ("barrier", bar), ("issue", issue), ("to S done", pvwait), ("S done->end", tail), ("wait_k", waitk)]:
        print(f"  {nm:14s} mean {a.mean():7.0f}  p10 {np.percentile(a,10):7.0f}  p90 {np.percentile(a,90):7.0f}  per-wg {a[:, 0].mean():6.0f}/{a[:, 1].mean():6.0f}")
    # intra-warpgroup skew at the barrier: spread of the 4 warps' arrival (event 0)
    skew = x[..., 0].max(axis=2) - x[..., 0].min(axis=2)
    print(f"  warp skew at turn request mean {skew.mean():.0f}, skew of PV-done {(x[...,3].max(axis=2)-x[...,3].min(axis=2)).mean():.0f}")
    # cross-wg: time from wg1 issue end to wg0 next turn etc.
    a_iss = x[:, 0, 0, :, 2]; b_iss = x[:, 1, 0, :, 2]
    print(f"  wg1 issue end - wg0 issue end (same block): {(b_iss - a_iss).mean():.0f}")
    ev = [0, 1, 6, 7, 2, 5, 8, 3, 4]
    print("  order: ready turn qk_issued v_ready issued S_done PV_done mid end")
    print("  CTA0 wg0 warp0 blocks 20-24 events rel:", (t[0, 0, 0, 20:25][:, ev] - t[0, 0, 0, 20, 0]).astype(int).tolist())
    print("  CTA0 wg1 warp0 blocks 20-24 events rel:", (t[0, 1, 0, 20:25][:, ev] - t[0, 0, 0, 20, 0]).astype(int).tolist())
