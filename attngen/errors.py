"""Exceptions raised by attngen. All input errors are ValueErrors that name the argument."""

from __future__ import annotations

import reprlib

# Values in messages: repr(), cut short for a huge or deeply nested value a spec file (or a generated
# expression) may hold.
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong, _SHOW.maxlist, _SHOW.maxdict = 3, 200, 200, 200, 8, 8


def show(value) -> str:
    """repr(value) for error messages; long values are elided with '...'."""
    return _SHOW.repr(value)


def type_article(value) -> str:
    """'a str', 'an int', 'None': what a value of the wrong type is, for messages."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


class SpecError(ValueError):
    """An invalid spec field or spec file. `field` names the (first) offending field (None: the whole
    spec); `problems` lists every (field, message) found, when a spec had several."""

    def __init__(self, message: str, field: str | None = None, problems: list | None = None):
        super().__init__(message)
        self.field = field
        self.problems = list(problems) if problems else [(field, message)]


class CompileError(RuntimeError):
    """The CUDA compiler rejected a rendered kernel; carries the compiler log and the source path."""

    def __init__(self, message: str, log: str = "", source_path: str | None = None):
        detail = f"\n--- compiler log ---\n{log}" if log else ""
        where = f"\nsource: {source_path}" if source_path else ""
        super().__init__(f"{message}{where}{detail}")
        self.log = log
        self.source_path = source_path


class MissingDependency(ImportError):
    """A GPU-side package is missing; the message says which extra installs it."""


# Errors after which the CUDA context is unusable: every later launch in the process fails too.
STICKY_CUDA_ERRORS = (
    "illegal memory access", "misaligned address", "unspecified launch failure", "illegal instruction",
    "device-side assert", "hardware stack error", "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_ILLEGAL_INSTRUCTION",
)


def is_sticky_cuda_error(message: str) -> bool:
    """Whether an error message (torch or CuPy spelling) reports a context-breaking CUDA error."""
    return any(pattern.lower() in message.lower() for pattern in STICKY_CUDA_ERRORS)


CUPY_EXTRA = ('attngen runs kernels through CuPy, which is not installed: pip install "attngen[cuda13]" '
              '(CUDA 13) or "attngen[cuda12]" (CUDA 12)')


def require_cupy():
    """The cupy module, or MissingDependency saying which extra to install."""
    try:
        import cupy
    except ImportError as exc:
        raise MissingDependency(f"{CUPY_EXTRA} ({exc})") from None
    return cupy
