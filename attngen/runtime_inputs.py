"""Runtime inputs: tensors a mask or score modifier reads (docs/masks.md), from declaration to kernel.

An expression reads `name[i, j]` (or `name`, a scalar): a tensor passed with the call as
`inputs={"name": tensor}`. A mask's inputs are int32 tensors (document ids, prefix lengths), a
score modifier's float32 ones (ALiBi slopes, a bias) unless it reads one as `int(name)`, an int32
tensor (a context-parallel shard's `q_offset`, shared with the mask). For each, the kernel's argument struct gets a
pointer `in_<name>` and one element stride `in_<name>_s<d>` per index (attngen/codegen/abi.py),
and the emitted expressions read `p.in_<name>[i * s0 + j * s1]`.

The kernel reads an input wherever the expression indexes it, so every call is checked first: each
index expression's range over the call (b < batch, h < heads, q_idx < Sq, kv_idx < Sk), computed
by interval arithmetic, must lie inside the tensor's shape. An index that depends on another
input cannot be bounded without reading it and is refused. Never an out-of-bounds read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from attngen.codegen.abi import Abi, Param

KINDS = {"mask": ("int", "int32", "const int*"), "score_mod": ("float", "float32", "const float*")}


@dataclass(frozen=True)
class Declared:
    """One runtime input: its name, number of indices, and which expression kind reads it."""

    name: str
    arity: int
    kind: str  # "mask" (int32) or "score_mod" (float32)

    @property
    def dtype(self) -> str:
        return KINDS[self.kind][1]

    @property
    def ctype(self) -> str:
        return KINDS[self.kind][2]


def declared(programs) -> tuple[Declared, ...]:
    """The inputs a list of (kind, program) reads, sorted by name; ValueError when one name is read
    as both kinds (an int32 and a float32 tensor cannot be one input). A score modifier's int(name)
    read is of the mask's kind, an int32 tensor."""
    from attngen.maskc.ir import Input, Type, walk

    found: dict[str, tuple[Declared, str]] = {}
    for kind, program in programs:
        as_int = {n.name for n in walk(program.ir) if isinstance(n, Input) and n.type is Type.INT}
        reader = "mask" if kind == "mask" else "score modifier or sink"
        for name, arity in program.inputs:
            mine = Declared(name, arity, "mask" if name in as_int else "score_mod")
            other = found.get(name)
            if other is not None and other[0] != mine:
                hint = ""
                if other[0].kind != mine.kind:  # int32 against float32: which reads can change says who read it
                    hint = f", or read the mask's int32 {name} in the score modifier or sink as int({name})" \
                        if "mask" in (reader, other[1]) else \
                        f", or read {name} as int({name}) in both the score modifier and the sink"
                raise ValueError(f"input {name!r} is read as {_what(*other)} and as {_what(mine, reader)}; "
                                 f"allowed: one name per input, e.g. rename one of them{hint}")
            found[name] = mine, reader
    return tuple(found[n][0] for n in sorted(found))


def _what(d: Declared, reader: str) -> str:
    return f"{'an int32' if d.kind == 'mask' else 'a float32'} tensor with {d.arity} indices (by the {reader})"


def as_mapping(inputs) -> dict:
    """A call's `inputs` as a dict of names to tensors (empty for None); ValueError otherwise."""
    from collections.abc import Mapping

    if inputs is None:
        return {}
    if not isinstance(inputs, Mapping) or not all(isinstance(name, str) for name in inputs):
        raise ValueError(f"inputs={inputs!r} is invalid; allowed: None or a dict of input names to CUDA tensors")
    return dict(inputs)


def input_ref(name: str, index_code: list) -> str:
    """The C++ that reads input `name` at `index_code` inside the kernel (p: its argument struct)."""
    offset = " + ".join(f"({code}) * p.in_{name}_s{d}" for d, code in enumerate(index_code)) or "0"
    return f"p.in_{name}[{offset}]"


@functools.lru_cache(maxsize=256)
def with_inputs(abi: Abi, inputs: tuple[Declared, ...], call_of: Callable) -> Abi:
    """`abi` with each input's pointer and strides appended; `call_of` takes what the family packs
    to its ForwardCall."""
    if not inputs:
        return abi
    params = list(abi.params)
    for d in inputs:
        params.append(Param(f"in_{d.name}", d.ctype, "ptr", lambda a, n=d.name: call_of(a).input(n).ptr,
                            f"runtime input {d.name} ({d.dtype}, {d.arity} indices)"))
        params += [Param(f"in_{d.name}_s{i}", "i64", "i64", lambda a, n=d.name, i=i: call_of(a).input(n).strides[i])
                   for i in range(d.arity)]
    return Abi(abi.struct_name, params)


def index_nodes(program) -> list[tuple[str, int, object]]:
    """(input name, index position, index expression node) for every read of an input."""
    from attngen.maskc.ir import Input, walk

    return [(node.name, d, index) for node in walk(program.ir) if isinstance(node, Input)
            for d, index in enumerate(node.index)]


def check(programs, inputs: dict, given: dict, batch: int, heads_q: int, seq_q: int, seq_k: int, device: int) -> None:
    """ValueError naming the input and what is allowed, unless `given` (name -> TensorInfo) holds
    exactly the `inputs` (Declared) with the right dtype, rank and device, and every index the
    programs can compute over this call lies inside its tensor."""
    from attngen.maskc.cuda import static_range
    from attngen.runtime.tensors import device_name

    wanted = {d.name: d for d in inputs}
    extra = sorted(set(given) - set(wanted))
    if extra:
        raise ValueError(f"inputs {extra} are not read by the mask or score modifier; allowed: "
                         f"{sorted(wanted) or 'no inputs'}")
    for d in inputs:
        t = given.get(d.name)
        if t is None:
            raise ValueError(f"the {'mask or score modifier' if d.kind == 'mask' else 'score modifier'} reads input {d.name!r}: pass "
                             f"inputs={{{d.name!r}: a {d.dtype} tensor with {d.arity} dims}}")
        if t.dtype != d.dtype:
            raise ValueError(f"input {d.name!r} has dtype {t.dtype}; allowed: {d.dtype}")
        if len(t.shape) != d.arity:
            raise ValueError(f"input {d.name!r} has shape {t.shape}, but the expression indexes it with {d.arity} "
                             f"indices; allowed: a tensor with {d.arity} dims")
        if t.device != device:
            raise ValueError(f"input {d.name!r} is on {t.where} but q is on {device_name(device)}")
    ranges = {"b": (0, batch - 1), "h": (0, heads_q - 1), "q_idx": (0, seq_q - 1), "kv_idx": (0, seq_k - 1),
              "q_len": (seq_q, seq_q), "kv_len": (seq_k, seq_k)}
    for program in programs:
        memo: dict = {}
        for name, d, node in index_nodes(program):
            bound = static_range(node, memo, ranges)
            size = given[name].shape[d]
            if bound is None:
                raise ValueError(f"index {d} of input {name!r} depends on another runtime input: it cannot be "
                                 "bounded before the kernel reads it; allowed: indices computed from b, h, q_idx, "
                                 "kv_idx, q_len, kv_len and constants")
            if bound[0] < 0 or bound[1] >= size:
                raise ValueError(f"index {d} of input {name!r} takes values in [{bound[0]}, {bound[1]}] over this call "
                                 f"(batch {batch}, heads {heads_q}, Sq {seq_q}, Sk {seq_k}), but dim {d} of its "
                                 f"shape {given[name].shape} allows [0, {size - 1}]")
