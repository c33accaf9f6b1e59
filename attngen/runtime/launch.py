"""Load a plan's binary on a device and launch a family's Launch list on a stream.

Launches go straight to the driver (cuLaunchKernel through CuPy's binding) with each kernel's
one packed parameter struct (attngen/codegen/abi.py): no per-argument conversion, no stream
or device objects built per call. A Launch marked `early` (a programmatic dependent launch) goes
through cuda-python's cuLaunchKernelEx with the programmatic-serialization attribute, its launch
configuration built once; without cuda-python it is an ordinary launch (the kernel's
griddepcontrol.wait is then a no-op), so only the overlap is lost.
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
            early = _early_config(launch) if launch.early else None
            bound.append((self._handles[launch.kernel], *launch.grid, *launch.block, launch.smem_bytes,
                          ctypes.addressof(argv), (params, argv, early)))
        return tuple(bound)

    def launch_bound(self, bound: tuple, stream: int) -> None:
        """Launch bound launches in order on `stream` (a raw cudaStream_t); the driver copies the
        parameters at once, so a bound launch can be launched again."""
        launch_kernel = self._launch_kernel
        for handle, gx, gy, gz, bx, by, bz, smem, argv, (_, _, early) in bound:
            if early is None:
                launch_kernel(handle, gx, gy, gz, bx, by, bz, smem, stream, argv, 0)
            else:
                _launch_early(early, handle, stream, argv)

    def launch(self, launches: list[Launch], stream: int) -> None:
        """Launch in order on `stream` (a raw cudaStream_t)."""
        self.launch_bound(self.bind(launches), stream)


def _early_config(launch: Launch):
    """A CUlaunchConfig allowing programmatic serialization for `launch`, or None (an ordinary
    launch) where cuda-python is missing."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = launch.grid
    config.blockDimX, config.blockDimY, config.blockDimZ = launch.block
    config.sharedMemBytes = launch.smem_bytes
    config.attrs = [attr]
    config.numAttrs = 1
    return driver, config


def _launch_early(early, handle: int, stream: int, argv: int) -> None:
    driver, config = early
    config.hStream = driver.CUstream(stream)
    (err,) = driver.cuLaunchKernelEx(config, driver.CUfunction(handle), argv, 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx (programmatic dependent launch) failed: {err}")
