"""Exceptions raised by attngen. All input errors are ValueErrors that name the argument."""

from __future__ import annotations


class SpecError(ValueError):
    """An invalid spec field or spec file. `field` names the offending field (None: the whole spec)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class CompileError(RuntimeError):
    """The CUDA compiler rejected a rendered kernel; carries the compiler log and the source path."""

    def __init__(self, message: str, log: str = "", source_path: str | None = None):
        detail = f"\n--- compiler log ---\n{log}" if log else ""
        where = f"\nsource: {source_path}" if source_path else ""
        super().__init__(f"{message}{where}{detail}")
        self.log = log
        self.source_path = source_path


# Errors after which the CUDA context is unusable: every later launch in the process fails too.
STICKY_CUDA_ERRORS = (
    "illegal memory access", "misaligned address", "unspecified launch failure", "illegal instruction",
    "device-side assert", "hardware stack error", "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_ILLEGAL_INSTRUCTION",
)


def is_sticky_cuda_error(message: str) -> bool:
    """Whether an error message (torch or CuPy spelling) reports a context-breaking CUDA error."""
    return any(pattern.lower() in message.lower() for pattern in STICKY_CUDA_ERRORS)
