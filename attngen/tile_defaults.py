"""Default tile configurations, read from tile_defaults.yaml (data, not code)."""

from __future__ import annotations

import functools
from importlib import resources

import yaml

from attngen.spec import TileConfig


@functools.lru_cache(maxsize=None)
def _table() -> dict:
    return yaml.safe_load(resources.files("attngen").joinpath("tile_defaults.yaml").read_text())


def default_tile(head_dim: int, arch: str) -> TileConfig:
    entry = _table()[arch][head_dim]
    return TileConfig(entry["block_m"], entry["block_n"], entry["num_warps"], entry["num_stages"])
