"""Compile targets: which GPU a kernel is built for, and the limits it must fit.

A Target is one GPU architecture (compute capability) and its limits. Its `name` is the exact
compile target NVRTC/nvcc get: the arch-specific variant ("sm_90a") where the architecture has
one, so a family may use instructions such as wgmma and setmaxnreg. A binary built for an
arch-specific target runs only on GPUs of exactly that compute capability, and the runtime
always plans and compiles for the GPU it runs on, so sm_90a code never runs on another GPU.

Offline (`attngen generate`, `attngen check`), targets come from the table below; at run time
from the device, whose reported limits win over the table.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

KB = 1024
# Compute capability -> (opt-in shared memory per block, shared memory per SM), from the CUDA C
# Programming Guide's technical specifications per compute capability.
KNOWN = {
    80: (163 * KB, 164 * KB),  # A100
    86: (99 * KB, 100 * KB),  # RTX 30, A10, A40
    87: (163 * KB, 164 * KB),  # Jetson Orin
    89: (99 * KB, 100 * KB),  # RTX 40, L4, L40
    90: (227 * KB, 228 * KB),  # H100, H200
    100: (227 * KB, 228 * KB),  # B200
    103: (227 * KB, 228 * KB),  # B300
    110: (227 * KB, 228 * KB),  # Thor
    120: (99 * KB, 100 * KB),  # RTX 50
    121: (99 * KB, 100 * KB),  # DGX Spark
}
# Architectures with an arch-specific compile target ("a" suffix: wgmma, setmaxnreg, tcgen05, ...).
ARCH_SPECIFIC = frozenset({90, 100, 103, 110, 120, 121})
MIN_CC = 80
# An architecture newer than the table: the smallest limits any supported GPU has.
UNKNOWN_LIMITS = (99 * KB, 100 * KB)
DEFAULT_ARCH = "sm_90"  # what `attngen generate` builds for when a spec names no arch

_NAME = re.compile(r"sm_(\d{2,3})(a?)")


@dataclass(frozen=True)
class Target:
    cc: int  # compute capability as 10 * major + minor: 90
    smem_per_block: int  # opt-in dynamic shared memory one block may use, bytes
    smem_per_sm: int
    sms: int | None = None  # multiprocessors; None for a target read from the table
    device_name: str | None = None

    @property
    def name(self) -> str:
        """The exact compile target: sm_90a, sm_86, ..."""
        return f"sm_{self.cc}" + ("a" if self.cc in ARCH_SPECIFIC else "")

    @property
    def arch(self) -> str:
        """The GPU architecture, as a spec names it: sm_90."""
        return f"sm_{self.cc}"

    @property
    def label(self) -> str:
        """The name in identifiers: sm90a."""
        return self.name.replace("_", "")

    def __str__(self) -> str:
        return self.name


def allowed_archs() -> list[str]:
    """What a spec's `arch` may say: each known architecture, plain and (where it has one) arch-specific."""
    return [name for cc in sorted(KNOWN) for name in (f"sm_{cc}", f"sm_{cc}a") if cc in ARCH_SPECIFIC or name[-1] != "a"]


def target(arch: str) -> Target:
    """The target of an architecture name (sm_90 and sm_90a both name the H100's): ValueError if unknown."""
    match = _NAME.fullmatch(arch) if isinstance(arch, str) else None
    cc = int(match.group(1)) if match else None
    if cc not in KNOWN or (match.group(2) and cc not in ARCH_SPECIFIC):
        raise ValueError(f"arch={arch!r} is invalid; allowed: {', '.join(allowed_archs())}")
    return Target(cc, *KNOWN[cc])


def for_compute_capability(major: int, minor: int, *, smem_per_block: int | None = None,
                           smem_per_sm: int | None = None, sms: int | None = None,
                           device_name: str | None = None) -> Target:
    """The target of a GPU; its own reported limits, where given, override the table's."""
    cc = 10 * major + minor
    if cc < MIN_CC:
        what = f" ({device_name})" if device_name else ""
        raise ValueError(f"the GPU{what} has compute capability {major}.{minor}; attngen kernels need 8.0 or newer "
                         "(Ampere, Ada, Hopper, Blackwell)")
    table_block, table_sm = KNOWN.get(cc, UNKNOWN_LIMITS)
    return Target(cc, smem_per_block or table_block, smem_per_sm or table_sm, sms, device_name)


@functools.lru_cache(maxsize=None)
def device_target(device: int) -> Target:
    """The target of CUDA device `device` (needs CuPy), with its own limits and SM count."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"]
    return for_compute_capability(
        props["major"], props["minor"], smem_per_block=props.get("sharedMemPerBlockOptin"),
        smem_per_sm=props.get("sharedMemPerMultiprocessor"), sms=props["multiProcessorCount"],
        device_name=name.decode() if isinstance(name, bytes) else str(name))
