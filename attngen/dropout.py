"""Fused dropout's contract on the host: which p a kernel realises, its keep threshold and scale, the
kernel argument that carries the call's random state, and the checks of that state's tensor.

A problem's `dropout_p` (attngen/spec.py) is compiled into the kernels: 0 compiles dropout out; a
p > 0 becomes an 8-bit keep threshold T = floor((1 - p) * 256 + 0.5), so the kernels realise
p' = 1 - T/256 (the nearest multiple of 1/256) and scale kept probabilities by 256/T = 1/(1 - p'),
which keeps the output unbiased. Which elements are kept is a pure function of the call's seed and
offset and the element's (batch, head, query, key): attngen/philox.py (and docs/dropout.md) define
it, attngen/cuda/philox.cuh computes it in the kernels. The seed and offset are read at run time
from an int64 tensor [seed, offset] on the GPU (the kernel argument `rng`), so torch.compile and
CUDA graphs replay a call with whatever that tensor holds then.
"""

from __future__ import annotations

import math

from attngen.codegen.abi import Abi, Param
from attngen.errors import type_article

BITS = 8  # bits of each element's draw
LEVELS = 1 << BITS
# p rounds to a threshold in [1, LEVELS - 1]: the bounds of what a kernel can realise.
P_MIN = 0.5 / LEVELS  # p must exceed it (else nothing would be dropped)
P_MAX = 1 - 0.5 / LEVELS  # p may reach it (one level of 256 kept)
ALLOWED = f"0 (no dropout) or a float in ({P_MIN}, {P_MAX}] (realised as the nearest multiple of 1/{LEVELS})"


def threshold(p: float) -> int:
    """The keep threshold of p: an element is kept when its 8-bit draw is below it."""
    return math.floor((1.0 - p) * LEVELS + 0.5)


def realised(p: float) -> float:
    """The dropout probability a kernel built for p realises: 1 - threshold / 256."""
    return 1.0 - threshold(p) / LEVELS if p else 0.0


def keep_scale(p: float) -> float:
    """What kept probabilities are multiplied by: 1 / (1 - realised(p))."""
    return LEVELS / threshold(p) if p else 1.0


def problem(value) -> str | None:
    """What is wrong with a spec's dropout_p (None when nothing is)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"dropout_p={value!r} is invalid ({type_article(value)}, must be a number); allowed: {ALLOWED}"
    if value == 0:
        return None
    if not (math.isfinite(value) and 0 < value < 1) or not 1 <= threshold(value) < LEVELS:
        return f"dropout_p={value!r} is invalid; allowed: {ALLOWED}"
    return None


def slug(p: float) -> str:
    """The name token of a dropout problem: drop0p1 for p = 0.1 (the exact p: two specs never share a name)."""
    return "drop" + repr(float(p)).replace(".", "p").replace("-", "m").replace("+", "")


def with_rng(abi: Abi, call_of) -> Abi:
    """`abi` with the pointer to the call's [seed, offset] appended; `call_of` takes what the family
    packs to its call (ForwardCall or BackwardCall), whose `rng` is that tensor's TensorInfo."""
    return Abi(abi.struct_name, [*abi.params, Param("rng", "const i64*", "ptr", lambda a: call_of(a).rng.ptr,
                                                   "[seed, offset] int64: dropout's random state (attngen/dropout.py)")])


def check_rng(rng, q, p: float) -> None:
    """ValueError naming `rng`, its value and what is allowed, unless it is what a kernel with dropout
    p reads: an int64 tensor of shape (2,) on q's device, [seed, offset]; None when p is 0."""
    if not p:
        if rng is not None:
            raise ValueError("rng is given, but the spec's dropout_p is 0; allowed: None (or a spec with dropout_p > 0)")
        return
    if rng is None:
        raise ValueError(f"the spec's dropout_p={p!r} needs rng: an int64 tensor [seed, offset] of shape (2,) on "
                         f"q's device {q.where}")
    if rng.dtype != "int64" or rng.shape != (2,):
        raise ValueError(f"rng has dtype {rng.dtype} and shape {rng.shape}; allowed: int64 of shape (2,), "
                         "[seed, offset]")
    if rng.device != q.device:
        raise ValueError(f"rng is on {rng.where}; allowed: q's device {q.where}")
    if rng.strides != (1,) or rng.ptr % 8:
        raise ValueError(f"rng has strides {rng.strides} and data pointer {rng.ptr:#x}; allowed: contiguous and "
                         "8-byte aligned: pass .contiguous()")
