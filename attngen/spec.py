"""AttentionSpec: the declarative description of one attention kernel.

A spec is validated once, at construction, and is immutable and hashable. Its
canonical name spells every parameter that changes the emitted kernel; the name
is the kernel symbol, the generated/ file name and the cache entry name.

Tile fields (block_m, block_n, num_warps, num_stages) may be left unset: the
plan fills them from the per-(head dim, arch) defaults in `tile_defaults.yaml`,
and the tuner only ever changes these fields.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from attngen.errors import SpecError
from attngen.masks import MASKS

HEAD_DIMS = (64, 96, 128, 256)
DTYPES = ("fp16", "bf16")
ARCHS = ("sm_80", "sm_90")
BLOCK_MS = (16, 32, 64, 128, 256)
BLOCK_NS = (16, 32, 64, 128)
NUM_WARPS = (1, 2, 4, 8)
NUM_STAGES = (1, 2, 3, 4)
# A warp owns 16 or 32 query rows: one or two m16 MMA tiles.
ROWS_PER_WARP = (16, 32)

# Query heads per kv head; the grid holds at most 65535 query heads.
MAX_GQA_RATIO = 1024

TILE_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38


def _allowed(values) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def rows_per_warp(self) -> int:
        return self.block_m // self.num_warps

    def label(self) -> str:
        return f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"


@dataclass(frozen=True)
class AttentionSpec:
    head_dim: int
    dtype: str = "bf16"
    gqa_ratio: int = 1
    mask: str = "none"
    softmax_scale: float | None = None
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    arch: str | None = None
    # Where the spec came from (a file path), used only to make errors name it.
    source: str | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        self._check_choice("head_dim", self.head_dim, HEAD_DIMS)
        self._check_choice("dtype", self.dtype, DTYPES)
        if isinstance(self.gqa_ratio, bool) or not isinstance(self.gqa_ratio, int) or not 1 <= self.gqa_ratio <= MAX_GQA_RATIO:
            self._fail("gqa_ratio", self.gqa_ratio, f"an integer in [1, {MAX_GQA_RATIO}]")
        self._check_choice("mask", self.mask, tuple(MASKS))
        if self.softmax_scale is not None:
            ok = isinstance(self.softmax_scale, (int, float)) and not isinstance(self.softmax_scale, bool)
            # The kernel and the name take the scale as float32: it must be a positive normal float32.
            if not ok or not FLOAT32_MIN_NORMAL <= self.softmax_scale <= FLOAT32_MAX:
                self._fail(
                    "softmax_scale",
                    self.softmax_scale,
                    f"a float in [{FLOAT32_MIN_NORMAL:.4g}, {FLOAT32_MAX:.4g}], or unset for 1/sqrt(head_dim)",
                )
            object.__setattr__(self, "softmax_scale", float(self.softmax_scale))
        if self.arch is not None:
            self._check_choice("arch", self.arch, ARCHS)
        self._check_optional_choice("block_m", self.block_m, BLOCK_MS)
        self._check_optional_choice("block_n", self.block_n, BLOCK_NS)
        self._check_optional_choice("num_warps", self.num_warps, NUM_WARPS)
        self._check_optional_choice("num_stages", self.num_stages, NUM_STAGES)
        if self.block_m is not None and self.num_warps is not None:
            rows = self.block_m / self.num_warps
            if rows not in ROWS_PER_WARP:
                self._fail(
                    "block_m",
                    self.block_m,
                    f"block_m / num_warps in {_allowed(ROWS_PER_WARP)} (num_warps={self.num_warps})",
                )

    # -- validation helpers -------------------------------------------------
    def _fail(self, name: str, value: Any, allowed: str) -> None:
        where = f"{self.source}: " if self.source else ""
        raise SpecError(f"{where}{name}={value!r} is invalid; allowed: {allowed}", field=name)

    def _check_choice(self, name: str, value: Any, allowed: tuple) -> None:
        if isinstance(value, bool) or value not in allowed or type(value) is not type(allowed[0]):
            self._fail(name, value, _allowed(allowed))

    def _check_optional_choice(self, name: str, value: Any, allowed: tuple) -> None:
        if value is not None:
            self._check_choice(name, value, allowed)

    # -- derived ----------------------------------------------------------
    @property
    def tile_is_set(self) -> bool:
        return all(getattr(self, f) is not None for f in TILE_FIELDS)

    @property
    def effective_scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def replace(self, **changes: Any) -> "AttentionSpec":
        return dataclasses.replace(self, **changes)

    def resolved(self, arch: str | None = None) -> "AttentionSpec":
        """This spec with arch and every unset tile field filled in from the defaults."""
        from attngen.tile_defaults import default_tile

        arch = self.arch or arch or "sm_90"
        default = default_tile(self.head_dim, arch)
        tile = {f: getattr(self, f) if getattr(self, f) is not None else getattr(default, f) for f in TILE_FIELDS}
        # Only one of block_m / num_warps given: keep the default rows per warp for the other.
        rows = default.rows_per_warp
        if self.block_m is None and self.num_warps is not None:
            tile["block_m"] = self.num_warps * rows if self.num_warps * rows in BLOCK_MS else self.num_warps * 16
        elif self.num_warps is None and self.block_m is not None:
            fits = [r for r in (rows, 16, 32) if self.block_m // r in NUM_WARPS and self.block_m % r == 0]
            tile["num_warps"] = self.block_m // fits[0] if fits else default.num_warps
        return self.replace(arch=arch, **tile)

    @property
    def tile(self) -> TileConfig:
        if not self.tile_is_set:
            raise SpecError("the tile config is not resolved; call spec.resolved() first", field="block_m")
        return TileConfig(self.block_m, self.block_n, self.num_warps, self.num_stages)

    @property
    def name(self) -> str:
        """Canonical name, e.g. fwd_causal_d128_gqa4_bf16_m128n64w4s2 (tile defaults filled in)."""
        spec = self if self.tile_is_set else self.resolved()
        parts = ["fwd", spec.mask, f"d{spec.head_dim}", f"gqa{spec.gqa_ratio}", spec.dtype, spec.tile.label()]
        if spec.softmax_scale is not None:
            # float32 bits keep the name exact and a valid C identifier.
            parts.append("scale" + struct.pack(">f", spec.softmax_scale).hex())
        return "_".join(parts)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "source"}
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> "AttentionSpec":
        known = {f.name for f in dataclasses.fields(cls) if f.name != "source"}
        where = f"{source}: " if source else ""
        if not isinstance(data, Mapping):
            raise SpecError(f"{where}a spec must be a mapping of fields, got {type(data).__name__}", field=None)
        # key=str: YAML keys may mix types (1: x, foo: y), which plain sorted() cannot order.
        unknown = sorted(set(data) - known, key=str)
        if unknown:
            raise SpecError(
                f"{where}unknown field {unknown[0]!r}; allowed fields: {', '.join(sorted(known))}",
                field=unknown[0],
            )
        if "head_dim" not in data:
            raise SpecError(f"{where}missing required field 'head_dim'; allowed: {_allowed(HEAD_DIMS)}", field="head_dim")
        return cls(**dict(data), source=source)


def load_spec(path: str | Path) -> AttentionSpec:
    """Load one spec from a YAML file (keys are AttentionSpec fields)."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise SpecError(f"{path}: cannot read spec file ({exc.strerror})", field=None) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}", field=None) from exc
    return AttentionSpec.from_dict(data if data is not None else {}, source=str(path))
