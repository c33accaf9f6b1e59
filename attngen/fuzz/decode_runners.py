"""The thing under test in the paged decode regime: a callable with attngen.decode's signature.

A decode runner has a `device`, a `target`, a `machine` (as attngen/fuzz/runners.py's), and
`kernel_name(spec, page_size)`: the decode plan it runs for a spec over a paged cache of that page
size or (None) a contiguous one (pages of whole key blocks have a plan of their own). It is called as
attngen.decode is, `runner(q, k_cache, v_cache, cache_seqlens, page_table=..., spec=...,
num_splits=..., inputs=..., return_lse=True)`, and returns (out, lse); `compile_ahead(pool)` builds the
decode plans of the pool's cases before the first one (None where nothing is compiled).
`DecodeKernelRunner` runs attngen.decode on the GPU; `ReferenceDecodeRunner` runs the reference on
the CPU (correct by construction), so the CPU tests can run `attngen fuzz --decode` end to end and
wrap it to build deliberately broken decodes.
"""

from __future__ import annotations

import torch

from attngen import reference, targets
from attngen.fuzz.runners import Machine
from attngen.spec import AttentionSpec


def decode_kernel_name(spec: AttentionSpec, target, page_size: int | None) -> str:
    from attngen.runtime.decode import decode_plan

    return decode_plan(spec, target, page_size is not None, page_size).name


class DecodeKernelRunner:
    """attngen.decode on the current CUDA device. `launched` lists the plans launched so far, by name:
    a replay under compute-sanitizer prints them (attngen/fuzz/sanitizer.py)."""

    def __init__(self):
        from attngen.fuzz.runners import cuda_device

        self.device_index, self.target, self.machine = cuda_device()
        self.device = f"cuda:{self.device_index}"
        self.launched: list[str] = []

    def kernel_name(self, spec: AttentionSpec, page_size: int | None) -> str:
        return decode_kernel_name(spec, self.target, page_size)

    def compile_ahead(self, pool):
        """Every decode plan the pool's cases may run, built into the on-disk cache at once."""
        from attngen.fuzz.compile_ahead import compile_ahead

        return compile_ahead(pool, self.target, regime="decode")

    def __call__(self, q, k_cache, v_cache, cache_seqlens, *, page_table, spec, num_splits, inputs, return_lse=True):
        import attngen

        result = attngen.decode(q, k_cache, v_cache, cache_seqlens, page_table=page_table, spec=spec,
                                num_splits=num_splits, inputs=inputs, return_lse=return_lse)
        self.launched.append(self.kernel_name(spec, None if page_table is None else k_cache.shape[1]))
        torch.cuda.synchronize(self.device_index)  # an asynchronous launch error surfaces here, in this case
        return result


class ReferenceDecodeRunner:
    """The float32 reference as the decode under test, on the CPU. It names kernels by the plans the
    default target (sm_90a) gets."""

    device = "cpu"
    target = targets.target(targets.DEFAULT_ARCH)
    machine = Machine(target.name)

    def kernel_name(self, spec: AttentionSpec, page_size: int | None) -> str:
        return decode_kernel_name(spec, self.target, page_size)

    def compile_ahead(self, pool) -> None:
        return None  # no kernels

    def __call__(self, q, k_cache, v_cache, cache_seqlens, *, page_table, spec, num_splits, inputs, return_lse=True):
        out, lse = reference.decode_attention(q, k_cache, v_cache, cache_seqlens, spec, page_table=page_table,
                                              inputs=inputs, compute_dtype=torch.float32)
        out = out.to(q.dtype)
        return (out, lse.float()) if return_lse else out
