"""AttentionSpec: the declarative description of one attention kernel.

A spec says what to compute (the problem: head dim, dtype, GQA ratio, mask, scale), optionally
how (a kernel `family` and some or all of its `config` fields) and where (`arch`, the GPU
architecture `attngen generate` and `attngen check` build for; at run time kernels are always
built for the GPU they run on). It is validated once, at construction, reporting every problem
at once; it is immutable and hashable. Unset family and config fields are filled in when a
plan is made: the tuned entry for the call's shape if `attngen tune` stored one, else the
family's defaults; the tuner only ever changes them.

The canonical name (`name`) spells every parameter of the kernel that runs, the target
included: fwd_sm80_causal_d128_gqa4_bf16_m128n64w4s2_sm90a. It is the kernel symbol, the
generated/ file name and the cache entry name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator

from attngen.dtypes import DTYPES
from attngen.errors import SpecError, show, type_article
from attngen import masks, score_mods

HEAD_DIMS = (64, 96, 128, 256)
# Query heads per kv head; the grid holds at most 65535 query heads.
MAX_GQA_RATIO = 1024
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38
PROBLEM_FIELDS = ("head_dim", "dtype", "gqa_ratio", "mask", "softmax_scale", "score_mod", "sink", "dropout_p",
                  "deterministic", "varlen")
# Tile fields of attngen 0.1, now config fields of the fwd_sm80 family: named in a clear error.
LEGACY_TILE_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")


def _allowed(values) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_set(name: str, value) -> bool:
    """Whether a spec or problem field counts as given (keys, names, manifests): not None, for
    dropout_p not 0 and for deterministic and varlen not False, so a problem without them keeps the
    identity it had before the fields existed."""
    return value is not None and not (name == "dropout_p" and value == 0) \
        and not (name in ("deterministic", "varlen") and value is False)


def _type_hint(value, want: str) -> str:
    """' (a str, must be an integer)' for a value of the wrong type: the usual YAML slip ("128")."""
    return f" ({type_article(value)}, must be {want})"



@dataclass(frozen=True)
class Problem:
    """What to compute: the part of a spec no kernel family may change."""

    head_dim: int
    dtype: str = "bf16"
    gqa_ratio: int = 1
    mask: str = "none"
    softmax_scale: float | None = None
    score_mod: str | None = None  # None: scores as they are
    sink: str | None = None  # an attention-sink logit per row; None: no sink
    dropout_p: float = 0.0  # dropout of the attention probabilities (attngen/dropout.py); 0: none
    # Gradients bitwise repeatable: no order-dependent fp32 sums (docs/backward.md, "Deterministic").
    # Forward kernels are deterministic anyway; backward families order their dQ sums or refuse.
    deterministic: bool = False
    # Sequences packed end to end (attngen/varlen.py): q (1, total_q, Hq, D), k and v (1, total_k, Hkv, D)
    # and the int32 inputs cu_seqlens_q, cu_seqlens_k; the mask, score modifier and sink apply within each
    # sequence, in its own positions. Only forward families that tile per sequence run it (fwd_sm90).
    varlen: bool = False

    @property
    def scale(self) -> float:
        """The softmax scale the kernel applies: the spec's, else 1/sqrt(head_dim)."""
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def causal(self) -> bool:
        return self.mask == "causal"

    def label(self) -> str:
        """The problem in identifiers: causal_d128_gqa4_bf16 (and the scale's float32 bits, when set)."""
        from attngen.masks import get_mask

        from attngen.score_mods import get_score_mod

        parts = [get_mask(self.mask).slug, f"d{self.head_dim}", f"gqa{self.gqa_ratio}", self.dtype]
        if self.score_mod is not None:
            parts.insert(1, get_score_mod(self.score_mod).slug)
        if self.sink is not None:
            parts.insert(1, "sink_" + get_score_mod(self.sink).slug)
        if self.softmax_scale is not None:
            # float32 bits keep the name exact and a valid C identifier.
            parts.append("scale" + struct.pack(">f", self.softmax_scale).hex())
        if self.dropout_p:
            from attngen.dropout import slug

            parts.append(slug(self.dropout_p))
        if self.varlen:
            parts.append("varlen")
        return "_".join(parts)

    def key(self) -> str:
        """Canonical JSON of the problem's fields (what a tuned configuration is for)."""
        return json.dumps({f: getattr(self, f) for f in PROBLEM_FIELDS if is_set(f, getattr(self, f))},
                          sort_keys=True, separators=(",", ":"))


class ConfigMap(Mapping):
    """An immutable, hashable mapping of config fields (a spec's pinned `config`)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None):
        self._items = tuple(sorted(dict(items or {}).items(), key=lambda kv: str(kv[0])))

    def __getitem__(self, key: str) -> Any:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return repr(dict(self._items))


@dataclass(frozen=True)
class AttentionSpec:
    head_dim: int
    dtype: str = "bf16"
    gqa_ratio: int = 1
    mask: str = "none"
    softmax_scale: float | None = None
    family: str | None = None  # None: the dispatcher picks the best family for the GPU
    config: Mapping[str, Any] | None = None  # pinned config fields of `family`
    arch: str | None = None  # stored as the exact compile target, e.g. "sm_90a"
    score_mod: str | None = None  # an expression over score (docs/masks.md); None: scores as they are
    sink: str | None = None  # an attention-sink logit expression, e.g. "sinks[h]"; None: no sink
    dropout_p: float = 0.0  # dropout of the attention probabilities, 0 <= p < 1 (attngen/dropout.py); 0: none
    deterministic: bool = False  # bitwise repeatable gradients (docs/backward.md, "Deterministic")
    varlen: bool = False  # sequences packed end to end, described by cu_seqlens inputs (attngen/varlen.py)
    # Where the spec came from (a file path), used only to make errors name it.
    source: str | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        problems: list[tuple[str | None, str]] = []

        def fail(name: str, message: str) -> None:
            problems.append((name, message))

        def choice(name: str, allowed: tuple) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or value not in allowed or type(value) is not type(allowed[0]):
                hint = _type_hint(value, "an integer") if _is_int(allowed[0]) and not _is_int(value) else ""
                fail(name, f"{name}={show(value)} is invalid{hint}; allowed: {_allowed(allowed)}")

        choice("head_dim", HEAD_DIMS)
        choice("dtype", tuple(DTYPES))
        if not _is_int(self.gqa_ratio) or not 1 <= self.gqa_ratio <= MAX_GQA_RATIO:
            hint = "" if _is_int(self.gqa_ratio) else _type_hint(self.gqa_ratio, "an integer")
            fail("gqa_ratio", f"gqa_ratio={show(self.gqa_ratio)} is invalid{hint}; allowed: an integer in "
                              f"[1, {MAX_GQA_RATIO}]")
        if not isinstance(self.mask, str):
            hint = _type_hint(self.mask, "a string")
            fail("mask", f"mask={show(self.mask)} is invalid{hint}; allowed: {masks.ALLOWED}")
        else:
            try:
                object.__setattr__(self, "mask", masks.canonical(self.mask))
            except ValueError as exc:
                fail("mask", str(exc))
        if self.score_mod is not None:
            if not isinstance(self.score_mod, str):
                hint = _type_hint(self.score_mod, "a string")
                fail("score_mod", f"score_mod={show(self.score_mod)} is invalid{hint}; allowed: {score_mods.ALLOWED}")
            else:
                try:
                    object.__setattr__(self, "score_mod", score_mods.canonical(self.score_mod))
                except ValueError as exc:
                    fail("score_mod", str(exc))
        if self.sink is not None:
            if not isinstance(self.sink, str):
                hint = _type_hint(self.sink, "a string")
                fail("sink", f"sink={show(self.sink)} is invalid{hint}; allowed: {score_mods.SINK_ALLOWED}")
            else:
                try:
                    object.__setattr__(self, "sink", score_mods.canonical_sink(self.sink))
                except ValueError as exc:
                    fail("sink", str(exc))
        if not problems and (self.score_mod is not None or self.sink is not None):
            from attngen.families.base import problem_programs
            from attngen.runtime_inputs import declared

            try:
                declared(problem_programs(self.problem))
            except ValueError as exc:
                fail("score_mod" if self.sink is None else "sink", str(exc))
        if self.softmax_scale is not None:
            ok = isinstance(self.softmax_scale, (int, float)) and not isinstance(self.softmax_scale, bool)
            # The kernel and the name take the scale as float32: it must be a positive normal float32.
            if not ok or not FLOAT32_MIN_NORMAL <= self.softmax_scale <= FLOAT32_MAX:
                hint = "" if ok else _type_hint(self.softmax_scale, "a number")
                fail("softmax_scale", f"softmax_scale={show(self.softmax_scale)} is invalid{hint}; allowed: a float in "
                                      f"[{FLOAT32_MIN_NORMAL:.4g}, {FLOAT32_MAX:.4g}], or unset for 1/sqrt(head_dim)")
            else:
                object.__setattr__(self, "softmax_scale", float(self.softmax_scale))
        from attngen import dropout

        reason = dropout.problem(self.dropout_p)
        if reason is not None:
            fail("dropout_p", reason)
        else:
            object.__setattr__(self, "dropout_p", float(self.dropout_p))
        if not isinstance(self.deterministic, bool):
            fail("deterministic", f"deterministic={show(self.deterministic)} is invalid"
                                  f"{_type_hint(self.deterministic, 'true or false')}; allowed: true, false")
        if not isinstance(self.varlen, bool):
            fail("varlen", f"varlen={show(self.varlen)} is invalid{_type_hint(self.varlen, 'true or false')}; "
                           "allowed: true, false")
        target = None
        if self.arch is not None:
            from attngen import targets

            try:
                target = targets.target(self.arch)
                object.__setattr__(self, "arch", target.name)
            except ValueError as exc:
                fail("arch", str(exc))
        self._check_family_and_config(fail, target, problems)
        if problems:
            raise spec_error(self.source, problems)
        object.__setattr__(self, "_key", json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")))

    def _check_family_and_config(self, fail, target, problems) -> None:
        from attngen import families

        family = None
        if self.family is not None:
            try:
                family = families.get_family(self.family)
            except ValueError as exc:
                fail("family", str(exc))
        if self.config is not None:
            if not isinstance(self.config, Mapping):
                fail("config", f"config={show(self.config)} is invalid; allowed: a mapping of the family's config "
                               "fields")
                return
            object.__setattr__(self, "config", ConfigMap(self.config) if self.config else None)
        if self.config:
            if self.family is None:
                fail("config", f"config={show(dict(self.config))} is given without a family; config fields belong to a "
                               f"kernel family: set family to one of {', '.join(families.FAMILIES)}")
            elif family is not None:
                for message in family.check_config(self.config):
                    fail("config", message)
        if family is not None and target is not None and not problems:
            reason = family.supports(self.problem, target)
            if reason is not None:
                fail("family", f"family={self.family!r} cannot run this spec on arch={self.arch}: {reason}")

    # -- derived ----------------------------------------------------------
    @property
    def problem(self) -> Problem:
        return Problem(self.head_dim, self.dtype, self.gqa_ratio, self.mask, self.softmax_scale, self.score_mod,
                       self.sink, self.dropout_p, self.deterministic, self.varlen)

    @property
    def effective_scale(self) -> float:
        return self.problem.scale

    @property
    def pinned(self) -> dict[str, Any]:
        """The config fields the spec sets (empty when it sets none)."""
        return dict(self.config or {})

    @property
    def fully_configured(self) -> bool:
        """Family and every config field set: nothing left for the tuner or the defaults."""
        if self.family is None:
            return False
        from attngen.families import get_family

        return set(self.pinned) >= set(get_family(self.family).config_fields)

    def replace(self, **changes: Any) -> "AttentionSpec":
        return dataclasses.replace(self, **changes)

    def key(self) -> str:
        """Canonical JSON of the spec (every field that is set): its identity across processes."""
        return self._key

    @property
    def name(self) -> str:
        """Canonical name of the kernel this spec makes for its arch (default sm_90), e.g.
        fwd_sm80_causal_d128_gqa4_bf16_m128n64w4s2_sm90a."""
        from attngen.families import plan_spec

        return plan_spec(self).name

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "source"}
        if out["config"] is not None:
            out["config"] = dict(out["config"])
        return {k: v for k, v in out.items() if is_set(k, v)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> "AttentionSpec":
        """A spec from a mapping of its fields; every problem is reported at once (SpecError.problems)."""
        known = [f.name for f in dataclasses.fields(cls) if f.name != "source"]
        if not isinstance(data, Mapping):
            raise spec_error(source, [(None, f"a spec must be a mapping of fields, got {type(data).__name__}")])
        problems = []
        # key=str: YAML keys may mix types (1: x, foo: y), which plain sorted() cannot order.
        unknown = sorted(set(data) - set(known), key=str)
        legacy = [key for key in LEGACY_TILE_FIELDS if key in unknown]
        if legacy:
            # attngen 0.1 tile fields: one message saying what to write instead, with their values.
            config = ", ".join(f"{key}: {show(data[key])}" for key in legacy)
            what = "is a config field" if len(legacy) == 1 else "are config fields"
            problems.append((legacy[0], f"{', '.join(legacy)} {what} of the fwd_sm80 kernel family since attngen 0.2: "
                                        f"write `family: fwd_sm80` and `config: {{{config}}}` instead"))
        for key in unknown:
            if key not in legacy:
                problems.append((key, f"unknown field {show(key)}; allowed fields: {', '.join(sorted(known))}"))
        if "head_dim" not in data:
            problems.append(("head_dim", f"missing required field 'head_dim'; allowed: {_allowed(HEAD_DIMS)}"))
        if problems:
            # Check the known fields too, so one pass reports everything.
            try:
                cls(**{k: v for k, v in data.items() if k in known and k != "head_dim"},
                    head_dim=data.get("head_dim", HEAD_DIMS[0]), source=None)
            except SpecError as exc:
                problems += [p for p in exc.problems if p[0] != "head_dim" or "head_dim" in data]
            raise spec_error(source, problems)
        return cls(**dict(data), source=source)

    @classmethod
    def from_key(cls, key: str) -> "AttentionSpec":
        """The spec whose key() is `key` (ValueError naming it when it is not one)."""
        try:
            data = json.loads(key)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"spec key {key!r} is not a spec's canonical JSON: {exc}") from None
        return cls.from_dict(data)


def spec_error(source: str | None, problems: list[tuple[str | None, str]]) -> SpecError:
    """One SpecError for every (field, message) found, prefixed with the file they came from."""
    where = f"{source}: " if source else ""
    if len(problems) == 1:
        message = where + problems[0][1]
    else:
        message = f"{where}{len(problems)} problems:\n" + "\n".join(f"  - {m}" for _, m in problems)
    return SpecError(message, field=problems[0][0], problems=problems)


def load_spec(path) -> AttentionSpec:
    """Load one spec from a YAML file; see attngen.specfile."""
    from attngen.specfile import load_spec as _load

    return _load(path)
