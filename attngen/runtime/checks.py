"""The kernel contract's checks on a forward call (DESIGN.md section 3), shared by every forward family.

Every bad input raises a ValueError naming the argument, the value and what is allowed, before
anything is launched: a silent wrong answer or an illegal memory access is the worst bug this
project can have.
"""

from __future__ import annotations

from attngen.dtypes import get_dtype
from attngen.families.base import ForwardCall
from attngen.runtime.tensors import TensorInfo
from attngen.spec import FLOAT32_MAX, FLOAT32_MIN_NORMAL, Problem

MAX_GRID_YZ = 65535
MAX_SEQ = 2**31 - 1


def check_scale(scale, problem: Problem) -> float:
    """The scale a call runs with: the problem's, or an explicit one that does not contradict it."""
    if scale is None:
        return problem.scale
    # The kernel takes the scale as float32: the same range the spec accepts, so it never rounds to 0 or inf.
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not FLOAT32_MIN_NORMAL <= scale <= FLOAT32_MAX:
        raise ValueError(f"softmax_scale={scale!r} is invalid; allowed: a float in "
                         f"[{FLOAT32_MIN_NORMAL:.4g}, {FLOAT32_MAX:.4g}] or None")
    if problem.softmax_scale is not None and scale != problem.softmax_scale:
        raise ValueError(f"softmax_scale={scale!r} conflicts with the spec's softmax_scale={problem.softmax_scale!r}; "
                         "allowed: None or the spec's value")
    return float(scale)


def check_inputs(problem: Problem, q: TensorInfo, k: TensorInfo, v: TensorInfo) -> None:
    want = get_dtype(problem.dtype).torch_name
    for t in (q, k, v):
        if len(t.shape) != 4:
            raise ValueError(f"{t.name} must have 4 dims (batch, seq, heads, head_dim), got shape {t.shape}")
        if t.dtype != want:
            raise ValueError(f"{t.name} has dtype {t.dtype}, but the spec's dtype is {problem.dtype} ({want})")
        if t.shape[3] != problem.head_dim:
            raise ValueError(f"{t.name} has head_dim {t.shape[3]} (shape {t.shape}), but the spec's head_dim "
                             f"is {problem.head_dim}")
        if t.strides[3] != 1:
            raise ValueError(f"{t.name} must be contiguous in its last dim, got strides {t.strides}")
        # Kernels move 16-byte chunks: every row must start 16-byte aligned.
        if t.ptr % 16 or any(s % 8 for s in t.strides[:3]):
            raise ValueError(f"{t.name} rows must be 16-byte aligned (data pointer and batch/seq/head strides "
                             f"multiples of 8 elements), got strides {t.strides}; pass .contiguous()")
        if t.device != q.device:
            raise ValueError(f"{t.name} is on {t.where} but q is on {q.where}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    Hq, Hkv, Sk = q.shape[2], k.shape[2], k.shape[1]
    if Hkv == 0 or Hq != problem.gqa_ratio * Hkv:
        raise ValueError(f"q has {Hq} heads and k/v have {Hkv}; the spec's gqa_ratio={problem.gqa_ratio} needs "
                         f"Hq == gqa_ratio * Hkv")
    if Sk < 1:
        raise ValueError(f"k/v have sequence length {Sk}; allowed: >= 1")
    for what, n, limit in (("q seq len", q.shape[1], MAX_SEQ), ("k seq len", Sk, MAX_SEQ),
                           ("q heads", Hq, MAX_GRID_YZ), ("batch", q.shape[0], MAX_GRID_YZ)):
        if n > limit:
            raise ValueError(f"{what} {n} exceeds the supported maximum {limit}")


def check_output(t: TensorInfo, q: TensorInfo, shape, dtype: str) -> None:
    if t.shape != tuple(shape):
        raise ValueError(f"{t.name} must have shape {tuple(shape)}, got {t.shape}")
    if t.dtype != dtype:
        raise ValueError(f"{t.name} must have dtype {dtype}, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{t.name} is on {t.where} but q is on {q.where}")
    if t.name == "out" and (t.strides[-1] != 1 or t.ptr % 16 or any(s % 8 for s in t.strides[:-1])):
        raise ValueError(f"out must be 16-byte aligned and contiguous in its last dim, got strides {t.strides}")
    if t.name == "lse":
        B, H, S = shape
        if t.strides != (H * S, S, 1):
            raise ValueError(f"lse must be contiguous with shape {tuple(shape)}, got strides {t.strides}")


def forward_call(problem: Problem, q: TensorInfo, k: TensorInfo, v: TensorInfo, out: TensorInfo, lse: TensorInfo,
                 softmax_scale, inputs: dict | None = None, rng: TensorInfo | None = None) -> ForwardCall:
    """A checked ForwardCall (q, k, v checked first with check_inputs); `inputs`: name -> TensorInfo
    of the runtime inputs the mask and score modifier read (attngen/runtime_inputs.py); `rng`: the
    [seed, offset] int64 tensor a problem with dropout reads (attngen/dropout.py), else None."""
    from attngen.dropout import check_rng
    from attngen.families.base import problem_inputs, problem_programs
    from attngen.runtime_inputs import check

    check_output(out, q, q.shape, q.dtype)
    B, Sq, Hq, _ = q.shape
    check_output(lse, q, (B, Hq, Sq), "float32")
    inputs = dict(inputs or {})
    declared = problem_inputs(problem)
    if problem.varlen:
        _check_varlen(q, inputs)
    if declared or inputs:
        programs = [program for _, program in problem_programs(problem)]
        check(programs, declared, inputs, B, Hq, Sq, k.shape[1], q.device)
    check_rng(rng, q, problem.dropout_p)
    return ForwardCall(q, k, v, out, lse, check_scale(softmax_scale, problem),
                       inputs=tuple(sorted(inputs.items())), rng=rng)


def _check_varlen(q: TensorInfo, inputs: dict) -> None:
    """A varlen call (Problem.varlen): one batch row of packed sequences, as many key as query boundaries
    (their dtype, rank and device are checked with the other runtime inputs)."""
    missing = [name for name in ("cu_seqlens_q", "cu_seqlens_k") if name not in inputs]
    if missing:
        raise ValueError(f"a varlen call reads the sequences' boundaries: pass inputs={{{missing[0]!r}: an int32 "
                         "tensor of shape (sequences + 1,)} (cu_seqlens_q and cu_seqlens_k)")
    if q.shape[0] != 1:
        raise ValueError(f"q has shape {q.shape}; a varlen call packs its sequences end to end: allowed: batch 1, "
                         "(1, total_q, heads_q, head_dim)")
    cu_q, cu_k = inputs["cu_seqlens_q"], inputs["cu_seqlens_k"]
    if cu_q.shape != cu_k.shape or len(cu_q.shape) != 1 or cu_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q has shape {cu_q.shape} and cu_seqlens_k {cu_k.shape}; allowed: the same "
                         "shape (sequences + 1,)")
