"""What `attngen fuzz --decode` does differently from the forward fuzz (attngen/fuzz/command.py runs
both): its pool (the SPEC files, else the fuzz pool's problems a decode family runs), its limits
(--max-seq-len is the longest cache), its search (attngen/fuzz/decode_search.py) and its table.

Each spec runs as up to three kernels, the decode plans over pages of whole key blocks, over other
pages and over a contiguous cache (a TMA plan takes every page size in one). Spec files pinning a
decode family's config fuzz that config; a spec no decode family runs on this GPU, or one of packed
sequences (the forward's), is a usage error naming the file.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from attngen.errors import SpecError
from attngen.fuzz.command import Regime, compile_ahead_line
from attngen.fuzz.paged import DecodeLimits


def decode_regime() -> Regime:
    from attngen.fuzz.decode_search import search_decode
    from attngen.fuzz.report import print_decode_summary

    return Regime("attngen fuzz --decode", search_decode, print_decode_summary, _families,
                  lambda limits: limits.max_length, "SPEC files", compile_ahead_line)


def decode_limits(max_length: int | None) -> DecodeLimits:
    return DecodeLimits() if max_length is None else dataclasses.replace(DecodeLimits(), max_length=max_length)


def decode_pool(paths, target, only_families=()) -> tuple:
    """The SPEC files' specs, else the built-in decode problems (paged.decode_specs) that run as one of
    only_families (all, when none are named), for `target`."""
    from attngen.fuzz.case import is_packed
    from attngen.fuzz.paged import decode_specs
    from attngen.fuzz.pool import of_families
    from attngen.runtime.decode import decode_plan
    from attngen.specfile import load_spec

    given = [load_spec(path) for path in paths]
    for spec in given:
        if is_packed(spec):
            raise SpecError(f"{spec.source}: packed sequences (varlen, or attention_varlen's document arrays) are "
                            "the forward's; allowed with --decode: a spec of one sequence per cache", field="varlen")
        try:
            decode_plan(spec, target, paged=True)  # a decode family that runs it here, and its pinned config
        except SpecError as exc:
            raise SpecError(f"{spec.source}: {exc}", field=exc.field, problems=exc.problems) from None
    if given:
        return tuple(dict.fromkeys(given))
    return tuple(dict.fromkeys(of_families(decode_specs(target), only_families, lambda s: decode_family(s, target))))


def decode_family(spec, target) -> str:
    """The decode family that runs `spec` on `target`."""
    from attngen.runtime.decode import decode_plan

    return decode_plan(spec, target, paged=True).family


def _families(pool, target) -> str:
    """How many of the pool's specs run as each decode family on the target, and as how many kernels (a
    plan over pages of whole key blocks, one over other pages and one over a contiguous cache; TMA
    plans take every page size in one)."""
    from attngen.fuzz.paged import FIRST_PAGE_SIZES
    from attngen.runtime.decode import decode_plan

    counts = Counter(decode_family(spec, target) for spec in pool)
    kernels = {decode_plan(spec, target, size is not None, size).name for spec in pool for size in FIRST_PAGE_SIZES}
    families = ", ".join(f"{family}: {n}" for family, n in counts.items())
    return f"{families} ({len(kernels)} kernels: paged and contiguous)"
