"""The generated kernel ABI: host packing and the device struct agree, and a disagreement cannot compile."""

from __future__ import annotations

import struct

import pytest

from attngen.build.nvcc import compile_with_nvcc, nvcc_available
from attngen.codegen.abi import KINDS, Abi, Param
from attngen.errors import CompileError
from attngen.families import FAMILIES

# One field of every kind, in an order that needs padding (an i32 before a pointer, a tensor map late).
MIXED = [
    Param("count", "int", "i32", lambda c: c["count"]),
    Param("ptr", "const float*", "ptr", lambda c: c["ptr"]),
    Param("scale", "float", "f32", lambda c: c["scale"]),
    Param("stride", "long long", "i64", lambda c: c["stride"]),
    Param("flags", "unsigned int", "u32", lambda c: c["flags"]),
    Param("tmap", "TensorMap", "tensor_map", lambda c: c["tmap"]),
    Param("seed", "unsigned long long", "u64", lambda c: c["seed"]),
]
DEVICE_TYPES = "struct alignas(64) TensorMap { unsigned long long opaque[16]; };\n"


def test_layout_follows_c_rules():
    abi = Abi("Mixed", MIXED)
    assert abi.offsets == {"count": 0, "ptr": 8, "scale": 16, "stride": 24, "flags": 32, "tmap": 64, "seed": 192}
    assert abi.align == 64 and abi.size == 256


def test_pack_places_every_value_at_its_offset():
    abi = Abi("Mixed", MIXED)
    values = {"count": -7, "ptr": 0x7F00_0000_1000, "scale": 0.5, "stride": -(2**40), "flags": 3,
              "tmap": bytes(range(128)), "seed": 2**64 - 1}
    raw = abi.pack(values)
    assert len(raw) == abi.size
    assert struct.unpack_from("<i", raw, 0)[0] == -7
    assert struct.unpack_from("<Q", raw, 8)[0] == values["ptr"]
    assert struct.unpack_from("<f", raw, 16)[0] == 0.5
    assert struct.unpack_from("<q", raw, 24)[0] == -(2**40)
    assert struct.unpack_from("<I", raw, 32)[0] == 3
    assert raw[64:192] == values["tmap"]
    assert struct.unpack_from("<Q", raw, 192)[0] == 2**64 - 1


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="kind='f64'"):
        Param("x", "double", "f64", lambda c: 0)
    with pytest.raises(ValueError, match="not a C identifier"):
        Param("a-b", "int", "i32", lambda c: 0)
    with pytest.raises(ValueError, match="duplicate"):
        Abi("Twice", [MIXED[0], MIXED[0]])


def test_every_family_declares_its_kernels_abi():
    for family in FAMILIES.values():
        module = __import__(type(family).__module__, fromlist=["ARGUMENTS"])
        abi = module.ARGUMENTS
        assert abi.params and abi.size % abi.align == 0
        assert all(p.kind in KINDS for p in abi.params)


def _compile(source: str):
    return compile_with_nvcc(source + "\nextern \"C\" __global__ void probe(const __grid_constant__ Mixed p) {}\n",
                             "sm_90a", "probe")


@pytest.mark.skipif(not nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
def test_device_struct_matches_the_host_layout():
    abi = Abi("Mixed", MIXED)
    _compile(DEVICE_TYPES + abi.render())  # every offset, the size and the alignment are static_asserts


@pytest.mark.skipif(not nvcc_available(), reason="nvcc not found (PATH or $CUDA_HOME/bin)")
def test_a_host_device_disagreement_does_not_compile(monkeypatch):
    # The host believes i64 takes 4 bytes: the stride and the fields after it move, and the asserts fire.
    monkeypatch.setitem(KINDS, "i64", type(KINDS["i64"])("i64", 4, 4, "i"))
    wrong = Abi("Mixed", MIXED)
    assert wrong.offsets["stride"] == 20
    with pytest.raises(CompileError, match="host and device disagree on Mixed"):
        _compile(DEVICE_TYPES + wrong.render())
