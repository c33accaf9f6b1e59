"""Load a plan's binary on a device and launch a family's Launch list on a stream.

Launches go straight to the driver (cuLaunchKernel through CuPy's binding) with each kernel's
one packed parameter struct (attngen/codegen/abi.py): no per-argument conversion, no stream
or device objects built per call.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from attngen.errors import require_cupy
from attngen.families.base import Launch, Plan


class LoadedModule:
    """A compiled plan loaded on one CUDA device."""

    def __init__(self, plan: Plan, binary_path: Path, device: int):
        cupy = require_cupy()
        from cupy_backends.cuda.api import driver

        self.device = device
        self._launch_kernel = driver.launchKernel
        with cupy.cuda.Device(device):
            self._module = cupy.RawModule(path=str(binary_path))
            self._kernels = {}
            for kernel in plan.kernels:
                raw = self._module.get_function(kernel.symbol)
                # Opt in to more than 48 KB of dynamic shared memory (a no-op below that).
                raw.max_dynamic_shared_size_bytes = kernel.smem_bytes
                self._kernels[kernel.symbol] = raw
            # The CUfunction handles, loaded on this device (RawKernel.kernel is a cupy.cuda.Function).
            self._handles = {symbol: raw.kernel.ptr for symbol, raw in self._kernels.items()}

    def bind(self, launches: list[Launch]) -> tuple:
        """The launches as driver arguments, their parameter buffers built once (kept alive here)."""
        bound = []
        for launch in launches:
            params = ctypes.create_string_buffer(launch.params, len(launch.params))
            argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
            bound.append((self._handles[launch.kernel], *launch.grid, *launch.block, launch.smem_bytes,
                          ctypes.addressof(argv), (params, argv)))
        return tuple(bound)

    def launch_bound(self, bound: tuple, stream: int) -> None:
        """Launch bound launches in order on `stream` (a raw cudaStream_t); the driver copies the
        parameters at once, so a bound launch can be launched again."""
        launch_kernel = self._launch_kernel
        for handle, gx, gy, gz, bx, by, bz, smem, argv, _ in bound:
            launch_kernel(handle, gx, gy, gz, bx, by, bz, smem, stream, argv, 0)

    def launch(self, launches: list[Launch], stream: int) -> None:
        """Launch in order on `stream` (a raw cudaStream_t)."""
        self.launch_bound(self.bind(launches), stream)
