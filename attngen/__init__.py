"""attngen: FlashAttention kernels compiled from declarative specs."""

import importlib

from attngen.errors import CompileError, SpecError
from attngen.spec import AttentionSpec, load_spec

__all__ = ["AttentionSpec", "CompileError", "SpecError", "attention", "compile", "load_spec", "reference"]
__version__ = "0.1.0"


def attention(q, k, v, spec, *, softmax_scale=None, return_lse=False):
    """FlashAttention forward on torch CUDA tensors or CuPy arrays; see attngen.runtime.attention."""
    from attngen.runtime import attention as _attention

    return _attention(q, k, v, spec, softmax_scale=softmax_scale, return_lse=return_lse)


def compile(spec, device=None, *, fault=None):  # noqa: A001 - the public name mirrors torch.compile
    """Render, compile (disk-cached) and load a spec's kernel; see attngen.runtime.compile."""
    from attngen.runtime import compile as _compile

    return _compile(spec, device, fault=fault)


def __getattr__(name):
    # The reference needs torch; import it only when used so `attngen generate` needs neither.
    if name == "reference":
        return importlib.import_module("attngen.reference")
    raise AttributeError(f"module 'attngen' has no attribute {name!r}")
