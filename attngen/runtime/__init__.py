"""Running kernels: tensor adapters (tensors.py), the kernel contract's input checks (checks.py),
loading and launching binaries (launch.py), and resolving a call to a loaded kernel (dispatch.py).

`compile(spec)` returns a Kernel for the current GPU; `attention(...)` is the front door's
implementation (attngen/api.py wraps it as a torch op)."""

from attngen.runtime.dispatch import Kernel, compile, forward

__all__ = ["Kernel", "compile", "forward"]
