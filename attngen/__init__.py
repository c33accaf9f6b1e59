"""attngen: FlashAttention kernels compiled from declarative specs.

    attngen.attention(q, k, v, mask="causal")          # the front door (a torch custom op)
    attngen.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, mask="causal")  # packed sequences
    attngen.decode(q, k_cache, v_cache, cache_seqlens, page_table=pages)  # decoding over a (paged) KV cache
    attngen.AttentionSpec(head_dim=128, mask="causal")  # pin everything: problem, family, config, arch
    attngen.compile(spec)                               # a loaded kernel for the current GPU
    attngen.families.FAMILIES                           # the kernel families, in order of preference
"""

import importlib

from attngen.api import attention, register
from attngen.decoding import append_kv, decode
from attngen.errors import CompileError, MissingDependency, SpecError
from attngen.spec import AttentionSpec, Problem, load_spec
from attngen.varlen import attention_varlen

__all__ = ["AttentionSpec", "CompileError", "MissingDependency", "Problem", "SpecError", "append_kv", "attention",
           "attention_varlen",
           "compile", "decode", "families", "load_spec", "reference", "register"]
__version__ = "0.2.0"


def compile(spec, device=None, *, fault=None, seqlen=None):  # noqa: A001 - the public name mirrors torch.compile
    """Plan, build (disk-cached) and load a spec's kernel for a GPU (for calls of at most `seqlen` tokens,
    where given); see attngen.runtime.dispatch.compile."""
    from attngen.runtime.dispatch import compile as _compile

    return _compile(spec, device, fault=fault, seqlen=seqlen)


def __getattr__(name):
    # Import on use: the reference needs torch, and `attngen generate` needs neither it nor CuPy.
    if name in ("reference", "families", "tolerance"):
        return importlib.import_module(f"attngen.{name}")
    raise AttributeError(f"module 'attngen' has no attribute {name!r}")
