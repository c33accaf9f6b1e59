"""fwd_sm90's tile schedules under compute-sanitizer: every schedule (grid, pairs, dynamic) with one,
two and three consumer warpgroups, pingpong on and off, none and causal, on a problem with more tiles
than SMs (a persistent CTA hands over several tiles) and ragged last blocks. Each output is compared
with the first config's for the same mask.

  compute-sanitizer --tool racecheck --report-api-errors no --kernel-name kns=fwd_sm90 \
      python bench/sm90_schedules_sanitize.py
"""
import itertools

import torch

import attngen
from attngen import families, targets
from attngen.errors import SpecError
from attngen.spec import AttentionSpec

target = targets.device_target(torch.cuda.current_device())
q = torch.randn(1, 640, 48, 64, device="cuda", dtype=torch.float16)  # 48 heads x 4 blocks of 192 > 132 SMs
k = torch.randn(1, 600, 48, 64, device="cuda", dtype=torch.float16)
first = {}
for mask, consumers, pingpong, schedule in itertools.product(("none", "causal"), (1, 2, 3), (False, True),
                                                             ("grid", "pairs", "dynamic")):
    config = {"block_n": 128, "consumers": consumers, "num_stages": 2, "overlap": True, "pingpong": pingpong,
              "schedule": schedule}
    try:
        spec = AttentionSpec(head_dim=64, dtype="fp16", mask=mask, family="fwd_sm90", config=config)
    except SpecError:  # pingpong with one consumer warpgroup
        continue
    with torch.no_grad():
        out = attngen.attention(q, k, k, spec)
    error = (out.float() - first.setdefault(mask, out).float()).abs().max().item()
    print(families.plan_spec(spec, target).name, f"max |out - first| = {error:.2e}")
    assert error < 2e-3, error
torch.cuda.synchronize()
print("schedules done")
