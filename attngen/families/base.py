"""The kernel-family protocol: what every family implements, and the values that pass between stages.

A family is one way of computing attention on some GPUs (the mma.sync forward, the Hopper
wgmma forward, a backward, a split-KV decode with its combine kernel, ...). It lives in its own
folder (Python, templates, headers) and implements `KernelFamily`:

  supports(problem, target)     -> None, or why it cannot run this problem on this target
  config_fields                 the tunable fields and their allowed values
  check_config(config)          problems with a (partial) config: the spec validates with it
  configs(problem, target)      every configuration the tuner may time
  default_config(...)           what runs when nothing is tuned or pinned (seqlen: the call's longest
                                   sequence, rounded up to a power of two, where the caller knows it)
  plan(problem, target, config) -> Plan: kernels, threads, shared memory, ABI; SpecError if it
                                   cannot be built for the target
  render(plan)                  -> the CUDA source of the plan's module
  accepts(plan, call)           -> None, or why these tensors need another family (a layout TMA
                                   cannot describe, say): the dispatcher then falls back
  workspace_bytes(plan, call)   scratch memory one call needs (0 by default)
  operation                     "forward" (attention()), "decode" (decode(): its call is a DecodeCall) or
                                "backward" (attention()'s gradients: its call is a BackwardCall)
  num_splits(plan, call, target) a decode family's split count when the caller gives none
  launches(plan, call)          -> the ordered kernels of one call: grids, blocks, packed parameters
  estimate(plan, report, gpu, shape) -> the tuner's predicted time

The generic stages (spec validation, build, dispatch, tune, fuzz, CLI) reach kernels only
through this protocol; attngen/families/__init__.py registers the families.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from attngen.codegen.abi import Abi
from attngen.spec import Problem
from attngen.targets import Target

if TYPE_CHECKING:
    from attngen.build.nvcc import ResourceReport
    from attngen.mask_table import MaskTable
    from attngen.masks import MaskLowering
    from attngen.score_mods import ScoreModLowering
    from attngen.runtime.tensors import TensorInfo
    from attngen.tune.model import Estimate, GpuModel, Shape


class Config:
    """Base of a family's configuration: a frozen dataclass of its tunable fields."""

    def label(self) -> str:
        """The configuration in identifiers, e.g. m128n64w4s2."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class KernelPlan:
    """One __global__ function of a plan's module."""

    symbol: str
    threads: int
    smem_bytes: int  # dynamic shared memory per block
    abi: Abi


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything rendering and launching need. Families subclass it to add their own choices."""

    family: str
    name: str  # canonical: module name, generated/ file name, cache entry name
    problem: Problem
    target: Target
    config: Config
    kernels: tuple[KernelPlan, ...]
    block_m: int  # query rows per tile
    block_n: int  # keys per tile
    fault: str | None = None  # attngen/faults.py; None for every kernel users run

    def choices(self) -> dict[str, Any]:
        """What the family derived beyond the problem and the config (manifests, tuner tables)."""
        return {}


@dataclass(frozen=True, kw_only=True)
class ForwardPlan(Plan):
    """A plan of a forward family: what its templates read about the problem, the mask and the fault."""

    mask: "MaskLowering"
    # Whether the kernels walk each tile's list of non-empty key blocks (attngen/mask_table.py) where
    # the mask has a table; families that read only the bounds leave it False.
    LISTS_KEY_BLOCKS = False

    @property
    def inputs(self) -> tuple:
        """The runtime inputs the mask and score modifier read (attngen/runtime_inputs.py Declared)."""
        return problem_inputs(self.problem)

    @property
    def mask_table(self) -> "MaskTable | None":
        """The block table built per call for a mask that reads int inputs (attngen/mask_table.py)."""
        from attngen.mask_table import for_problem

        return for_problem(self.problem, self.block_n if self.LISTS_KEY_BLOCKS else None)

    @property
    def partial_visible(self) -> str:
        """The C++ element predicate for blocks the key-block lists flag partial (mask.cuh.j2 shown):
        the mask's own, or for a BlockMask whose blocks this plan's tiles lie inside, its element mask
        alone (a partial tile then has state 1: attngen/block_sparse.py partial_element)."""
        from attngen.block_sparse import partial_element
        from attngen.masks import get_mask

        table = self.mask_table
        element = None if table is None or table.list_block_n is None else \
            partial_element(self.mask.text, self.block_m, self.block_n)
        return self.mask.visible if element is None else get_mask(element).visible

    @property
    def score_mod(self) -> "ScoreModLowering | None":
        """The problem's score modifier, lowered (None: scores as they are)."""
        from attngen.score_mods import get_score_mod

        return None if self.problem.score_mod is None else get_score_mod(self.problem.score_mod)

    @property
    def sink(self) -> "ScoreModLowering | None":
        """The problem's attention-sink logit, lowered (None: no sink)."""
        from attngen.score_mods import get_score_mod

        return None if self.problem.sink is None else get_score_mod(self.problem.sink)

    @property
    def dtype(self) -> str:
        return self.problem.dtype

    @property
    def head_dim(self) -> int:
        return self.problem.head_dim

    @property
    def gqa_ratio(self) -> int:
        return self.problem.gqa_ratio

    @property
    def fault_macro(self) -> str | None:
        from attngen.faults import fault_macro

        return fault_macro(self.fault)

    @property
    def problem_summary(self) -> str:
        """The problem's fields that are set, for the generated source's header comment."""
        from attngen.spec import is_set

        return ", ".join(f"{f.name}={getattr(self.problem, f.name)}" for f in dataclasses.fields(self.problem)
                         if is_set(f.name, getattr(self.problem, f.name)))

    @property
    def dropout(self) -> dict | None:
        """What the templates compile in for dropout (attngen/dropout.py): the keep threshold of the
        8-bit draws and the scale of kept probabilities; None without dropout."""
        from attngen import dropout

        p = self.problem.dropout_p
        return {"threshold": dropout.threshold(p), "scale": dropout.keep_scale(p), "realised": dropout.realised(p)} \
            if p else None


def problem_programs(problem: Problem) -> list[tuple[str, Any]]:
    """(kind, compiled program) of the problem's mask, score modifier and sink: kind "mask" reads
    int inputs, "score_mod" float ones (attngen/runtime_inputs.py)."""
    from attngen.masks import get_mask
    from attngen.score_mods import get_score_mod

    programs = [("mask", get_mask(problem.mask).program)]
    for text in (problem.score_mod, problem.sink):
        if text is not None:
            programs.append(("score_mod", get_score_mod(text).program))
    return programs


def problem_inputs(problem: Problem) -> tuple:
    """The runtime inputs a problem's expressions read (attngen/runtime_inputs.py Declared)."""
    from attngen.runtime_inputs import declared

    found = declared(problem_programs(problem))
    if getattr(problem, "varlen", False):  # the sequences' boundaries (attngen/varlen.py)
        from attngen.varlen import declared_cu_seqlens

        found = tuple(sorted((*found, *declared_cu_seqlens()), key=lambda d: d.name))
    return found


@dataclass(frozen=True)
class ForwardCall:
    """The validated arguments of one forward call (attngen/runtime/checks.py made them)."""

    q: "TensorInfo"
    k: "TensorInfo"
    v: "TensorInfo"
    out: "TensorInfo"
    lse: "TensorInfo"
    softmax_scale: float
    workspace: int = 0  # device address of workspace_bytes() of scratch, when asked for
    inputs: tuple = ()  # ((name, TensorInfo), ...) sorted: the runtime inputs the expressions read
    rng: "TensorInfo | None" = None  # [seed, offset] int64 when the problem has dropout (attngen/dropout.py)

    def input(self, name: str) -> "TensorInfo":
        for key, info in self.inputs:
            if key == name:
                return info
        raise KeyError(name)

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def seq_q(self) -> int:
        return self.q.shape[1]

    @property
    def seq_k(self) -> int:
        return self.k.shape[1]

    @property
    def heads_q(self) -> int:
        return self.q.shape[2]

    @property
    def heads_kv(self) -> int:
        return self.k.shape[2]


MAX_SPLITS = 256  # parts a decode call may cut each sequence's cache into (DecodeCall.num_splits)


@dataclass(frozen=True)
class DecodeCall:
    """The validated arguments of one decode call (attngen/runtime/decode.py made them): new tokens'
    queries against each sequence's cached keys and values."""

    q: "TensorInfo"  # (batch, seq_q, heads_q, head_dim)
    k: "TensorInfo"  # paged (num_pages, page_size, heads_kv, head_dim) or contiguous (batch, capacity, ...)
    v: "TensorInfo"
    seqlens: "TensorInfo"  # (batch,) int32: each sequence's cache length
    page_table: "TensorInfo | None"  # (batch, pages per sequence) int32, or None for a contiguous cache
    out: "TensorInfo"
    lse: "TensorInfo"
    softmax_scale: float
    num_splits: int = 1
    workspace: int = 0  # device address of workspace_bytes() of scratch, when asked for
    inputs: tuple = ()  # ((name, TensorInfo), ...) sorted: the runtime inputs the expressions read

    input = ForwardCall.input
    batch = ForwardCall.batch
    seq_q = ForwardCall.seq_q
    heads_q = ForwardCall.heads_q
    heads_kv = ForwardCall.heads_kv

    @property
    def head_dim(self) -> int:
        return self.q.shape[3]

    @property
    def page_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_pages(self) -> int:
        return self.k.shape[0] if self.page_table is not None else 0

    @property
    def capacity(self) -> int:
        """Tokens one sequence's cache can hold: its pages times the page size, or the contiguous length."""
        return self.page_table.shape[1] * self.page_size if self.page_table is not None else self.k.shape[1]

    @property
    def partial_rows(self) -> int:
        """Rows of split partials in the workspace: one per (split, sequence, token, query head)."""
        return self.num_splits * self.batch * self.seq_q * self.heads_q


@dataclass(frozen=True)
class BackwardCall:
    """The validated arguments of one backward call (attngen/runtime/backward.py made them): the
    gradients of a forward call's q, k, v from its outputs' gradients."""

    q: "TensorInfo"  # (batch, seq_q, heads_q, head_dim): the forward's inputs
    k: "TensorInfo"  # (batch, seq_k, heads_kv, head_dim)
    v: "TensorInfo"
    out: "TensorInfo"  # the forward's output, like q
    lse: "TensorInfo"  # the forward's LSE, (batch, heads_q, seq_q) float32 contiguous
    dout: "TensorInfo"  # d loss / d out, q's shape and dtype
    dlse: "TensorInfo | None"  # d loss / d lse, like lse, or None when the loss does not read the LSE
    dq: "TensorInfo"  # the gradients (outputs): q's shape and dtype
    dk: "TensorInfo"  # k's shape and dtype
    dv: "TensorInfo"
    softmax_scale: float
    workspace: int = 0  # device address of workspace_bytes() of scratch, when asked for
    inputs: tuple = ()  # ((name, TensorInfo), ...) sorted: the runtime inputs the expressions read
    rng: "TensorInfo | None" = None  # the forward call's [seed, offset] when the problem has dropout

    input = ForwardCall.input
    batch = ForwardCall.batch
    seq_q = ForwardCall.seq_q
    seq_k = ForwardCall.seq_k
    heads_q = ForwardCall.heads_q
    heads_kv = ForwardCall.heads_kv


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a call, in order."""

    kernel: str  # symbol
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    params: bytes  # the kernel's ABI struct, packed
    # Programmatic dependent launch (sm_90+): the kernel may start while the one before it in the
    # stream finishes, and waits for that one's results itself (griddepcontrol.wait).
    early: bool = False


class KernelFamily(ABC):
    name: ClassVar[str]
    operation: ClassVar[str] = "forward"  # or "decode", "backward": the front door each family serves
    description: ClassVar[str]
    folder: ClassVar[Path]  # templates and headers
    config_fields: ClassVar[dict[str, tuple]]  # field -> allowed values (in the tuner's order)
    # Fields added after tuning databases were written, with the value that builds the kernel an entry
    # without them timed: such an entry stays valid (attngen/tune) rather than being ignored.
    config_field_defaults: ClassVar[dict[str, Any]] = {}

    def __repr__(self) -> str:
        return f"<kernel family {self.name}>"

    @abstractmethod
    def supports(self, problem: Problem, target: Target) -> str | None: ...

    def with_added_fields(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """A stored config with the fields added since it was written (config_field_defaults) filled in."""
        return {**self.config_field_defaults, **config}

    def check_config(self, config: Mapping[str, Any]) -> list[str]:
        """What is wrong with a (partial) config, as messages naming field, value and what is allowed."""
        problems = []
        for name, value in config.items():
            allowed = self.config_fields.get(name)
            if allowed is None:
                problems.append(f"config field {name!r} is not one of family {self.name}'s; allowed: "
                                f"{', '.join(self.config_fields)}")
            elif isinstance(value, bool) != isinstance(allowed[0], bool) or value not in allowed \
                    or type(value) is not type(allowed[0]):
                problems.append(f"config.{name}={value!r} is invalid; allowed: "
                                f"{{{', '.join(str(v) for v in allowed)}}}")
        return problems

    @abstractmethod
    def configs(self, problem: Problem, target: Target, pinned: Mapping[str, Any] | None = None) -> list[Config]:
        """Every configuration with the pinned fields (those the spec sets), whether or not it fits the
        target: plan() says which do."""

    @abstractmethod
    def default_config(self, problem: Problem, target: Target, seqlen: int | None = None) -> Config:
        """What runs when nothing is tuned or pinned; `seqlen`, where known (the front door's shape
        bucket: max(Sq, Sk) rounded up to a power of two), may choose a config for short sequences."""

    @abstractmethod
    def resolve_config(self, problem: Problem, target: Target, pinned: Mapping[str, Any],
                       seqlen: int | None = None) -> Config:
        """The config with the pinned fields, the rest filled in from the default (for `seqlen`)."""

    @abstractmethod
    def plan(self, problem: Problem, target: Target, config: Config, *, fault: str | None = None) -> Plan: ...

    @abstractmethod
    def render(self, plan: Plan) -> str: ...

    def accepts(self, plan: Plan, call: ForwardCall) -> str | None:
        return None

    def workspace_bytes(self, plan: Plan, call: ForwardCall) -> int:
        return 0

    @abstractmethod
    def launches(self, plan: Plan, call: ForwardCall) -> list[Launch]: ...

    @abstractmethod
    def estimate(self, plan: Plan, report: "ResourceReport", gpu: "GpuModel", shape: "Shape") -> "Estimate": ...

    # -- shared helpers -------------------------------------------------------------------
    def plan_name(self, problem: Problem, target: Target, config: Config, fault: str | None = None) -> str:
        """The canonical name: family, problem, config and target, e.g.
        fwd_sm80_causal_d128_gqa4_bf16_m128n64w4s2_sm90a."""
        # Deterministic changes only what a backward family emits (forward kernels are deterministic
        # anyway, so a deterministic spec's forward shares the usual kernel).
        det = "_det" if problem.deterministic and self.operation == "backward" else ""
        name = f"{self.name}_{problem.label()}{det}_{config.label()}_{target.label}"
        return name if fault is None else f"{name}_fault_{fault}"
