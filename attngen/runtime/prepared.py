"""A call layout checked once: what every later call with the same layout can skip.

Everything the checks, the tuning lookup and the family's launch list depend on is a function of
the inputs' layout (shapes, strides, dtypes, devices), the spec and the scale, except the data
pointers: those only enter the packed parameters (and the TMA descriptors), and the checks only
need them 16-byte aligned. So a checked call becomes a `Prepared` per layout; its launches are
packed once per set of pointers (a loop that reuses its buffers, as torch's caching allocator
makes it, packs nothing after the first step), and a call costs two output allocations, one
dictionary lookup and the driver launches. Kept current with the tuning database by its stamp.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attngen.families.base import ForwardCall
from attngen.runtime.tensors import current_stream, describe, new_like

# Distinct pointer sets remembered per layout before the memo starts over (a bounded cache).
MAX_BOUND = 64


class Prepared:
    """The kernel, output shapes and scale of one checked call layout."""

    def __init__(self, kernel, call: ForwardCall, stamp: Any):
        self.kernel = kernel
        self.stamp = stamp  # the tuning database's stamp it was resolved under; None: never stale
        self.template = call
        B, Sq, Hq, D = call.q.shape
        self.out_shape = (B, Sq, Hq, D)
        self.lse_shape = (B, Hq, Sq)
        self.device = call.q.device
        self.empty = call.batch == 0 or call.seq_q == 0 or call.heads_q == 0
        self.workspace_bytes = kernel.workspace_bytes(call)  # scratch per call (a mask's block table)
        self._bound: dict[tuple[int, ...], tuple] = {}

    def current(self) -> bool:
        """Whether the tuning database still says what it said when this was resolved."""
        if self.stamp is None:
            return True
        from attngen.tune import lookup

        return self.stamp == lookup.recent_stamp()

    def launches(self, ptrs: tuple[int, ...]) -> tuple:
        """The packed launches for (q, k, v, out, lse, workspace or 0, then the runtime inputs by name,
        then with dropout the rng tensor) at these addresses."""
        bound = self._bound.get(ptrs)
        if bound is None:
            if len(self._bound) >= MAX_BOUND:
                self._bound.clear()
            t = self.template
            inputs = tuple((name, dataclasses.replace(info, ptr=ptr)) for (name, info), ptr in zip(t.inputs, ptrs[6:]))
            rng = None if t.rng is None else dataclasses.replace(t.rng, ptr=ptrs[6 + len(t.inputs)])
            call = dataclasses.replace(
                t, q=dataclasses.replace(t.q, ptr=ptrs[0]), k=dataclasses.replace(t.k, ptr=ptrs[1]),
                v=dataclasses.replace(t.v, ptr=ptrs[2]), out=dataclasses.replace(t.out, ptr=ptrs[3]),
                lse=dataclasses.replace(t.lse, ptr=ptrs[4]), workspace=ptrs[5], inputs=inputs, rng=rng)
            bound = self._bound[ptrs] = self.kernel.bind(call)
        return bound

    def run_torch(self, torch, q, k, v, stream: int, inputs: tuple = (), rng=None):
        """(out, lse) for plain torch tensors of this layout, whose pointers are 16-byte aligned;
        `inputs`: the runtime input tensors in name order; `rng`: dropout's [seed, offset] tensor."""
        out = torch.empty(self.out_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        if not self.empty:
            # Freed once queued: the caching allocator hands it out again in stream order.
            workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=q.device) \
                if self.workspace_bytes else None
            ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                    0 if workspace is None else workspace.data_ptr(), *(t.data_ptr() for t in inputs),
                    *(() if rng is None else (rng.data_ptr(),)))
            self.kernel.launch_bound(self.launches(ptrs), stream)
        return out, lse

    def run(self, q, k, v, inputs=None, rng=None):
        """(out, lse) for torch tensors or CuPy arrays of this layout, 16-byte aligned; `inputs`:
        name -> tensor, the runtime inputs; `rng`: dropout's [seed, offset] tensor."""
        out, lse = new_like(q, self.out_shape), new_like(q, self.lse_shape, "float32")
        if not self.empty:
            inputs = inputs or {}
            workspace = new_like(q, (self.workspace_bytes,), "uint8") if self.workspace_bytes else None
            ptrs = (describe(q, "q").ptr, describe(k, "k").ptr, describe(v, "v").ptr, describe(out, "out").ptr,
                    describe(lse, "lse").ptr, 0 if workspace is None else describe(workspace, "workspace").ptr,
                    *(describe(inputs[name], name).ptr for name, _ in self.template.inputs),
                    *(() if rng is None else (describe(rng, "rng").ptr,)))
            self.kernel.launch_bound(self.launches(ptrs), current_stream(q, self.device))
        return out, lse
