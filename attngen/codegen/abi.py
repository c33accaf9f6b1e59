"""The kernel ABI: one declared argument list -> the device struct, the kernel signature, the host packer.

A family declares its kernel's arguments once, as a list of `Param`s: name, C++ type, how the
host packs it, and where its value comes from (a function of the launch's call). From that list:
  - `render()` emits the parameter struct, which the kernel takes as one `__grid_constant__`
    argument (signature()), followed by static_asserts of its size, alignment and every field's
    offset as the host computed them: host and device cannot disagree and still compile;
  - `pack(call)` lays the values out in exactly that layout (C rules: each field at a multiple of
    its alignment, the struct padded to its largest alignment).
Adding a runtime input (cu_seqlens, a page table, a dropout seed, a TMA descriptor) is one Param.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Kind:
    """How the host packs a value: size, alignment and struct-module format."""

    name: str
    size: int
    align: int
    fmt: str


KINDS = {
    kind.name: kind
    for kind in (
        Kind("ptr", 8, 8, "Q"),  # a device address
        Kind("i32", 4, 4, "i"),
        Kind("u32", 4, 4, "I"),
        Kind("i64", 8, 8, "q"),
        Kind("u64", 8, 8, "Q"),
        Kind("f32", 4, 4, "f"),
        # CUtensorMap: 128 opaque bytes, 64-byte aligned (attngen/cuda/tma.cuh declares the device type).
        Kind("tensor_map", 128, 64, "128s"),
    )
}


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str  # its C++ type in the struct: "const cfg::elem_t*", "int", "float", "TensorMap", ...
    kind: str  # a KINDS key: how the host packs it
    value: Callable[[Any], Any]  # the value, from the launch's call
    doc: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Param {self.name!r}: kind={self.kind!r} is invalid; allowed: {sorted(KINDS)}")
        if not self.name.isidentifier():
            raise ValueError(f"Param name {self.name!r} is not a C identifier")


class Abi:
    """The argument struct `struct_name` of a kernel, laid out from `params` in order."""

    def __init__(self, struct_name: str, params: list[Param] | tuple[Param, ...]):
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise ValueError(f"{struct_name}: duplicate parameter names in {names}")
        self.struct_name = struct_name
        self.params = tuple(params)
        self.offsets: dict[str, int] = {}
        fmt, offset = ["<"], 0
        for p in self.params:
            kind = KINDS[p.kind]
            pad = -offset % kind.align
            fmt.append(f"{pad}x" if pad else "")
            offset += pad
            self.offsets[p.name] = offset
            fmt.append(kind.fmt)
            offset += kind.size
        self.align = max((KINDS[p.kind].align for p in self.params), default=1)
        tail = -offset % self.align
        fmt.append(f"{tail}x" if tail else "")
        self.size = offset + tail
        self._struct = struct.Struct("".join(fmt))
        self._getters = tuple(p.value for p in self.params)
        assert self._struct.size == self.size

    def __repr__(self) -> str:
        return f"Abi({self.struct_name}, {self.size} B, {len(self.params)} fields)"

    def pack(self, call: Any) -> bytes:
        """The struct's bytes for one launch: each field's value taken from `call`."""
        return self._struct.pack(*(get(call) for get in self._getters))

    def render(self) -> str:
        """The C++ struct and the asserts that hold it to this layout."""
        lines = [f"struct {self.struct_name} {{"]
        for p in self.params:
            lines.append(f"    {p.ctype} {p.name};" + (f"  // {p.doc}" if p.doc else ""))
        lines.append("};")
        why = f"host and device disagree on {self.struct_name}: see attngen/codegen/abi.py"
        lines.append(f'static_assert(sizeof({self.struct_name}) == {self.size}, "{why}");')
        lines.append(f'static_assert(alignof({self.struct_name}) == {self.align}, "{why}");')
        # NVRTC has no offsetof: the offsets are checked where nvcc compiles the same source (CI, attngen check).
        lines.append("#ifndef __CUDACC_RTC__")
        for p in self.params:
            lines.append(f'static_assert(__builtin_offsetof({self.struct_name}, {p.name}) == {self.offsets[p.name]}, '
                         f'"{why}");')
        lines.append("#endif")
        return "\n".join(lines)

    def signature(self, argument: str = "p") -> str:
        """The kernel's parameter list: the struct by value, as a grid constant (no copy to local memory)."""
        return f"const __grid_constant__ {self.struct_name} {argument}"
