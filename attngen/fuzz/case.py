"""One fuzz case, and its inputs and outputs made deterministically and poisoned.

A case is a spec, a shape, a memory layout and how its data is drawn. The data is drawn on
the CPU from a torch.Generator seeded with `data_seed`, then copied to the device, so a
reproducer regenerates exactly the same inputs on any machine (`input_digest` confirms it).

Every tensor the kernel sees is a view into a larger flat buffer filled with NaN. A "row" is
one sequence position: H*D elements of q, k, v or out, one element of the LSE. GUARD_ROWS rows
of NaN lie before and after each tensor's storage, and each layout places the tensor as:
  contiguous  (B, S, H, D)
  transposed  (B, H, S, D) storage seen through .transpose(1, 2) (how SDPA-layout tensors arrive)
  padded      (B, S + GUARD_ROWS, H, D + PAD) storage seen as [:, :S, :, :D]: strides that do not
              follow from the shape, GUARD_ROWS NaN rows after every sequence and PAD NaN
              columns after every row
The LSE is always contiguous (the kernel contract). GUARD_ROWS is at least the largest tile edge
(a plan's block_m or block_n) any kernel family may have (tests/test_fuzz_pool.py checks every
registered family's configs on every known target). What that catches:
  - an output element the kernel never writes stays NaN, so the case fails;
  - a write that lands in the buffer but outside the tensor's elements changes the NaN there
    (`Poisoned.written_outside`); a write into another (batch, head)'s elements is caught only
    if it leaves a wrong value there;
  - a read outside an input pulls NaN into the result if it lands in NaN: up to GUARD_ROWS rows
    before the first or after the last row of the storage, in every layout, and in the padded
    layout also up to GUARD_ROWS rows past the end of every sequence, before the start of every
    sequence but the first (the previous one's padding), and up to PAD columns past a row's D.
    In the contiguous and transposed layouts a read past the end of a sequence other than the
    last in storage order lands in the next (batch, head)'s finite data, and is caught only if
    that moves the result beyond the bound.
The inputs themselves are drawn on the CPU from the seed, so the guards do not change them.

A packed case (`documents`) holds sequences packed end to end in one batch row, as
attention_varlen lays them out (attngen/varlen.py): for a spec with `varlen` set (kernels that
tile per sequence), or one whose expressions read attention_varlen's per-token arrays (the
document mask it lowers a call to). The documents are part of the case, not drawn from the seed,
so hypothesis shrinks them (fewer, shorter sequences) and a reproducer records them.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass

import torch

from attngen.dtypes import torch_dtype
from attngen.spec import AttentionSpec

LAYOUTS = ("contiguous", "transposed", "padded")
# NaN rows before and after every tensor, and after every sequence in the padded layout: a whole
# tile of the largest any family may have (a kernel that loads a tile without clamping reads up to
# a tile past the end). A row of q/k/v/out is H*D elements, a multiple of 8, so views stay 16-byte aligned.
GUARD_ROWS = 256
PAD = 8  # extra NaN columns per row in the padded layout: 16 bytes, so rows stay 16-byte aligned
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class FuzzCase:
    spec: AttentionSpec
    batch: int
    seq_q: int
    seq_k: int
    heads_kv: int
    layout: str = "contiguous"
    # q and k are drawn from N(0, logit_scale^2), so scores have a spread of ~logit_scale^2.
    logit_scale: float = 1.0
    # None: the spec's scale. Otherwise passed to the kernel call (only when the spec sets none).
    softmax_scale: float | None = None
    data_seed: int = 0
    # Packed cases only (module docstring): each sequence's (query rows, keys), in order; the
    # cu_seqlens are their running sums. Rows past the last sequence (seq_q above the sum) belong
    # to none and must come back 0 / -inf; keys past it (seq_k above the sum) are never visible.
    documents: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        # Cases also come from hand-editable reproducer files: every field is checked here.
        if not isinstance(self.spec, AttentionSpec):
            raise ValueError(f"spec={self.spec!r} is invalid; allowed: an attngen.AttentionSpec")
        for name in ("batch", "seq_q", "seq_k", "heads_kv"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid; allowed: an integer >= 1")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is invalid; allowed: {', '.join(LAYOUTS)}")
        if not _positive_finite(self.logit_scale):
            raise ValueError(f"logit_scale={self.logit_scale!r} is invalid; allowed: a finite float > 0")
        if self.softmax_scale is not None and (self.spec.softmax_scale is not None
                                               or not _positive_finite(self.softmax_scale)):
            raise ValueError(f"softmax_scale={self.softmax_scale!r} is invalid; allowed: None, or a finite "
                             "float > 0 when the spec sets no softmax_scale")
        if isinstance(self.data_seed, bool) or not isinstance(self.data_seed, int) or not 0 <= self.data_seed <= MAX_SEED:
            raise ValueError(f"data_seed={self.data_seed!r} is invalid; allowed: an integer in [0, 2**63 - 1]")
        self._check_documents()

    def _check_documents(self) -> None:
        documents = self.documents
        if not is_packed(self.spec):
            if documents != ():
                raise ValueError(f"documents={documents!r} is invalid for a spec whose kernels read no sequence "
                                 "boundaries; allowed: () (a spec with varlen set, or reading attention_varlen's "
                                 "per-token arrays, takes documents)")
            return
        pairs = isinstance(documents, tuple) and all(
            isinstance(d, tuple) and len(d) == 2 and all(type(n) is int and n >= 0 for n in d) for d in documents)
        if not pairs or not documents:
            raise ValueError(f"documents={documents!r} is invalid; allowed: a non-empty tuple of (query rows, keys) "
                             "pairs of integers >= 0")
        if self.batch != 1:
            raise ValueError(f"batch={self.batch} is invalid for packed documents; allowed: 1 (every sequence is "
                             "packed into one batch row)")
        for name, total, index in (("seq_q", self.seq_q, 0), ("seq_k", self.seq_k, 1)):
            packed = sum(d[index] for d in documents)
            if total < packed:
                raise ValueError(f"{name}={total} is invalid: the documents pack {packed}; allowed: at least that")

    @property
    def cu_seqlens(self) -> tuple[list[int], list[int]]:
        """cu_seqlens_q and cu_seqlens_k of a packed case: the running sums of its documents."""
        return tuple([0, *itertools.accumulate(d[i] for d in self.documents)] for i in (0, 1))

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.spec.gqa_ratio

    @property
    def scale(self) -> float:
        return self.spec.effective_scale if self.softmax_scale is None else self.softmax_scale

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seq_q, self.heads_q, self.spec.head_dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seq_k, self.heads_kv, self.spec.head_dim)

    @property
    def lse_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.heads_q, self.seq_q)

    @property
    def score_elements(self) -> int:
        """B * Hq * Sq * Sk: the size of the reference's score matrix, a measure of a case's cost."""
        return self.batch * self.heads_q * self.seq_q * self.seq_k

    def label(self) -> str:
        scale = "" if self.softmax_scale is None else f" softmax_scale={self.softmax_scale:g}"
        documents = f" documents={_documents_label(self.documents)}" if self.documents else ""
        return (f"B={self.batch} Sq={self.seq_q} Sk={self.seq_k} Hq={self.heads_q} Hkv={self.heads_kv}{documents} "
                f"{self.layout} logits~{self.logit_scale:g}^2{scale} seed={self.data_seed}")


def _documents_label(documents, shown: int = 6) -> str:
    """'[(3, 3), (0, 2)]', or the first `shown` of many and how many more."""
    pairs = ", ".join(f"({q}, {k})" for q, k in documents[:shown])
    more = f", ... {len(documents) - shown} more" if len(documents) > shown else ""
    return f"[{pairs}{more}]"


def is_packed(spec: AttentionSpec) -> bool:
    """Whether the spec's kernels read sequence boundaries: cu_seqlens (varlen set) or attention_varlen's
    per-token arrays (its document mask)."""
    from attngen.families.base import problem_inputs
    from attngen.varlen import RESERVED

    return bool(spec.varlen) or any(d.name in RESERVED for d in problem_inputs(spec.problem))


def _positive_finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


# -- poisoned buffers -------------------------------------------------------------
@dataclass(frozen=True)
class Poisoned:
    """A view (what the kernel gets) into a flat NaN-filled buffer larger than the view."""

    buffer: torch.Tensor
    view: torch.Tensor
    layout: str

    def written_outside(self) -> str | None:
        """Where the first element outside the view that is no longer NaN lies, or None."""
        inside = torch.zeros(self.buffer.shape, dtype=torch.bool, device=self.buffer.device)
        _view(inside, self.layout, tuple(self.view.shape)).fill_(True)
        changed = ~torch.isnan(self.buffer) & ~inside
        if not changed.any():
            return None
        index = int(changed.nonzero()[0, 0])
        first, last = self.view.storage_offset(), int(inside.nonzero()[-1, 0])
        where = ("before the tensor's first element" if index < first else
                 "after the tensor's last element" if index > last else "between the tensor's elements")
        return f"buffer element {index}, {where} (the tensor spans buffer elements {first} to {last})"


def _row(shape: tuple[int, ...]) -> int:
    """Elements of one sequence position: H*D of a (B, S, H, D) tensor, one of a (B, H, S) LSE."""
    return shape[2] * shape[3] if len(shape) == 4 else 1


def _storage_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the storage between the guards."""
    if layout == "contiguous":
        return shape
    B, S, H, D = shape
    if layout == "transposed":
        return (B, H, S, D)
    return (B, S + GUARD_ROWS, H, D + PAD)


def _guard(layout: str, shape: tuple[int, ...]) -> int:
    """NaN elements before and after the storage: GUARD_ROWS rows of it."""
    return GUARD_ROWS * _row(_storage_shape(layout, shape) if layout == "padded" else shape)


def buffer_elements(shape: tuple[int, ...], layout: str) -> int:
    """How many elements a poisoned buffer for a tensor of `shape` in `layout` holds."""
    return math.prod(_storage_shape(layout, shape)) + 2 * _guard(layout, shape)


def _view(buffer: torch.Tensor, layout: str, shape: tuple[int, ...]) -> torch.Tensor:
    storage_shape = _storage_shape(layout, shape)
    guard = _guard(layout, shape)
    storage = buffer[guard: guard + math.prod(storage_shape)].view(storage_shape)
    if layout == "contiguous":
        return storage
    if layout == "transposed":
        return storage.transpose(1, 2)
    B, S, H, D = shape
    return storage[:, :S, :, :D]


def poisoned(shape: tuple[int, ...], layout: str, dtype: torch.dtype, device) -> Poisoned:
    buffer = torch.full((buffer_elements(shape, layout),), math.nan, dtype=dtype, device=device)
    return Poisoned(buffer, _view(buffer, layout, shape), layout)


def strides(case: FuzzCase) -> dict[str, list[int]]:
    """Element strides of q, k/v and out in the case's layout (recorded in reproducers)."""
    meta = torch.device("meta")
    return {name: list(poisoned(shape, case.layout, torch.float16, meta).view.stride())
            for name, shape in (("q", case.q_shape), ("k", case.kv_shape), ("v", case.kv_shape),
                                ("out", case.q_shape))}


# -- inputs and outputs -----------------------------------------------------------
def _host_draws(case: FuzzCase, count: int) -> tuple[torch.Tensor, ...]:
    """The first `count` of q, k, v, dout, drawn in that order from the case's seed."""
    gen = torch.Generator().manual_seed(case.data_seed)
    dtype = torch_dtype(case.spec.dtype)

    def draw(shape, scale):
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype)

    shapes = ((case.q_shape, case.logit_scale), (case.kv_shape, case.logit_scale), (case.kv_shape, 1.0),
              (case.q_shape, 1.0))
    return tuple(draw(shape, scale) for shape, scale in shapes[:count])


def host_inputs(case: FuzzCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v on the CPU, contiguous, in the spec's dtype: a pure function of the case."""
    return _host_draws(case, 3)


def host_dout(case: FuzzCase) -> torch.Tensor:
    """The output's gradient for the backward check: drawn after q, k, v from the same seed (so the
    input digest, of q, k, v and the runtime inputs, pins it too)."""
    return _host_draws(case, 4)[3]


def make_backward_tensors(case: FuzzCase, device) -> tuple[Poisoned, Poisoned, Poisoned, Poisoned]:
    """dout (filled) and dq, dk, dv (all NaN), in the case's layout, inside NaN-poisoned buffers."""
    values = host_dout(case)
    dout = poisoned(case.q_shape, case.layout, values.dtype, device)
    dout.view.copy_(values)
    grads = [poisoned(shape, case.layout, values.dtype, device) for shape in (case.q_shape, case.kv_shape, case.kv_shape)]
    return dout, *grads


def make_inputs(case: FuzzCase, device) -> list[Poisoned]:
    """q, k, v on `device`, in the case's layout, inside NaN-poisoned buffers."""
    placed = []
    for values in host_inputs(case):
        p = poisoned(tuple(values.shape), case.layout, values.dtype, device)
        p.view.copy_(values)
        placed.append(p)
    return placed


# Runtime inputs (attngen/runtime_inputs.py) of a spec whose mask or score modifier reads tensors.
# Drawn from the case's seed like q, k, v; each dim just large enough for every index the
# expressions compute over the case. By what they are:
#   - an int input indexed by a position (document ids): packed documents, nondecreasing runs of
#     equal ids along the last dim whose mean length is drawn per tensor, log-uniform from 1 to the
#     dim's length (one document to all of length 1), an id skipped at one boundary in five (an
#     empty document);
#   - FlexAttention block states (attngen/block_sparse.py STATE): hidden, partial and full blocks
#     (0, 1, 2) in proportions drawn per tensor;
#   - any other int input, a scalar or indexed by b or h (position offsets, prefix lengths):
#     a third of the time 0, else uniform in [0, L] or in [-L, 2L], L the longer length, so offsets
#     shift whole rows out of sight and back;
#   - a float input (a modifier's: slopes, a bias, sinks): uniform in [0, 0.5), which keeps scores
#     no larger than the tolerances assume;
#   - a packed case's boundaries: cu_seqlens_q / cu_seqlens_k from its documents, and the per-token
#     arrays of attention_varlen's document mask built from them by attngen/varlen.py itself.
DOCUMENT_SKIP = 0.2  # how often a document boundary skips an id


def _positional(problem) -> set[str]:
    """The inputs some read of which is indexed by an expression of q_idx or kv_idx."""
    from attngen.families.base import problem_programs
    from attngen.maskc.ir import depends_on
    from attngen.runtime_inputs import index_nodes

    return {name for _, program in problem_programs(problem) for name, _, node in index_nodes(program)
            if depends_on(node, "q_idx") or depends_on(node, "kv_idx")}


def input_shapes(case: FuzzCase) -> dict[str, tuple[int, ...]]:
    """name -> the smallest shape holding every index the spec's expressions compute over the case."""
    from attngen.families.base import problem_inputs, problem_programs
    from attngen.maskc.cuda import static_range
    from attngen.runtime_inputs import index_nodes

    problem = case.spec.problem
    declared = problem_inputs(problem)
    if not declared:
        return {}
    programs = [program for _, program in problem_programs(problem)]
    ranges = {"b": (0, case.batch - 1), "h": (0, case.heads_q - 1), "q_idx": (0, case.seq_q - 1),
              "kv_idx": (0, case.seq_k - 1), "q_len": (case.seq_q, case.seq_q), "kv_len": (case.seq_k, case.seq_k)}
    shapes = {d.name: [1] * d.arity for d in declared}
    for program in programs:
        memo: dict = {}
        for name, dim, node in index_nodes(program):
            bound = static_range(node, memo, ranges)
            if bound is None or bound[0] < 0:
                raise ValueError(f"the fuzzer cannot size input {name!r}: index {dim} takes values {bound} over the case")
            shapes[name][dim] = max(shapes[name][dim], bound[1] + 1)
    if case.documents:
        shapes.update({name: tuple(t.shape) for name, t in _packed_inputs(case).items()})
    return {name: tuple(shape) for name, shape in shapes.items()}


def _packed_inputs(case: FuzzCase) -> dict[str, torch.Tensor]:
    """A packed case's cu_seqlens and the per-token arrays its expressions read, on the CPU."""
    from attngen.varlen import CU_SEQLENS, varlen_inputs

    cu_q, cu_k = (torch.tensor(cu, dtype=torch.int32) for cu in case.cu_seqlens)
    spec = case.spec
    arrays = varlen_inputs(spec.mask, spec.score_mod, spec.sink, torch.empty(case.seq_q), torch.empty(case.seq_k),
                           cu_q, cu_k)
    if spec.varlen:
        arrays.update(zip(sorted(CU_SEQLENS), (cu_k, cu_q)))
    return arrays


def _document_ids(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    length = shape[-1]
    mean = math.exp(float(torch.rand((), generator=gen)) * math.log(length)) if length > 1 else 1.0
    boundary = (torch.rand(shape, generator=gen) < 1.0 / mean).to(torch.int32)
    skip = (torch.rand(shape, generator=gen) < DOCUMENT_SKIP).to(torch.int32)
    return torch.cumsum(boundary * (1 + skip), dim=-1, dtype=torch.int32)


def _block_states(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    weights = torch.rand(3, generator=gen) + 0.05  # hidden, partial, full: every kind possible
    states = torch.multinomial(weights, math.prod(shape), replacement=True, generator=gen)
    return states.view(shape).to(torch.int32)


def _thresholds(shape: tuple[int, ...], gen: torch.Generator, longest: int) -> torch.Tensor:
    which = int(torch.randint(0, 3, (), generator=gen))
    if which == 0:
        return torch.zeros(shape, dtype=torch.int32)
    low, high = (0, longest) if which == 1 else (-longest, 2 * longest)
    return torch.randint(low, high + 1, shape, generator=gen, dtype=torch.int32)


def host_runtime_inputs(case: FuzzCase) -> dict[str, torch.Tensor]:
    """The case's runtime inputs on the CPU, by name: a pure function of the case."""
    from attngen.block_sparse import STATE
    from attngen.families.base import problem_inputs

    shapes = input_shapes(case)
    packed = _packed_inputs(case) if case.documents else {}
    positional = _positional(case.spec.problem)
    gen = torch.Generator().manual_seed(case.data_seed ^ 0x5EED)  # q, k, v keep their own stream
    inputs = {}
    for d in problem_inputs(case.spec.problem):
        shape = shapes[d.name]
        if d.name in packed:
            inputs[d.name] = packed[d.name]
        elif d.kind != "mask":
            inputs[d.name] = torch.rand(shape, generator=gen) * 0.5
        elif d.name == STATE:
            inputs[d.name] = _block_states(shape, gen)
        elif d.name in positional:
            inputs[d.name] = _document_ids(shape, gen)
        else:
            inputs[d.name] = _thresholds(shape, gen, max(case.seq_q, case.seq_k))
    return inputs


def make_runtime_inputs(case: FuzzCase, device) -> dict[str, torch.Tensor]:
    return {name: t.to(device) for name, t in host_runtime_inputs(case).items()}


def make_outputs(case: FuzzCase, device) -> tuple[Poisoned, Poisoned]:
    """out (in the case's layout) and LSE (contiguous: the kernel contract), both all NaN."""
    out = poisoned(case.q_shape, case.layout, torch_dtype(case.spec.dtype), device)
    lse = poisoned(case.lse_shape, "contiguous", torch.float32, device)
    return out, lse


def input_digest(case: FuzzCase) -> str:
    """sha256 of the case's input bytes: a replay checks it regenerated the same data."""
    digest = hashlib.sha256()
    for t in (*host_inputs(case), *host_runtime_inputs(case).values()):
        digest.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # a 0-d offset too
    return digest.hexdigest()
