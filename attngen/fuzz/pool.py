"""The specs a fuzz run draws from, asked of the kernel families: the built-in pool and random specs.

The built-in pool for a target (the GPU the runner compiles for):
  - for each problem of PROBLEMS (every head dim, both dtypes, none, causal and compiled masks,
    position offsets, block sparsity, packed sequences both ways, GQA ratios 1 to 8, an explicit
    softmax_scale) and each registered family that supports it on the target, a
    spec pinned to that family, with the family's default config, and with its default for short
    calls where that is another (fwd_sm90's rows for at most 1k tokens, which the front door runs);
  - EXTRA_CONFIGS non-default configs per family, on problems spread over PROBLEMS, each taken
    from family.configs() among those the family plans on the target: the one that adds the most
    the pool lacks so far (`variety`: config values, and the on/off choices the plan derives;
    ties broken by a fixed seed): 1 and 3 stages, narrow and wide tiles, one and two m-tiles per
    warp, Q re-read from shared memory, and the like.
Every spec file in specs/ has its problem in PROBLEMS, so the kernels the spec files make are in
the pool too (tests/test_fuzz_pool.py checks). A compile costs seconds, so the pool is small and
fixed; hypothesis shrinks towards its first spec, a problem without a mask.

Random specs (`--random-specs`): a random problem (one in five packed, where its mask and
modifier allow), a random family that supports it on the target, and three times in four a random
config of that family that plans on the target. Masks and score modifiers include random
expression trees from the whole grammar (attngen/fuzz/expressions.py, without runtime inputs).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Collection

from attngen import block_sparse, families, varlen
from attngen.dtypes import DTYPES
from attngen.errors import SpecError
from attngen.fuzz.expressions import MaskExprs, ScoreExprs
from attngen.families.base import Config, KernelFamily, Plan
from attngen.spec import HEAD_DIMS, AttentionSpec, Problem
from attngen.targets import Target


def _document_mask(mask: str, score_mod: str | None = None) -> dict:
    """The mask and modifier attention_varlen runs packed sequences with where it cannot tile per sequence."""
    texts = varlen.lowered(mask, score_mod, None)
    return {"mask": texts[0], "score_mod": texts[1]}


PROBLEMS = (
    Problem(128, "fp16"),  # first: a family's first extra config is drawn for it (fwd_sm90: its clusters)
    Problem(64, "bf16", gqa_ratio=2, mask="causal"),
    Problem(64, "bf16", mask="causal"),  # without GQA: fwd_sm90's short-call default differs
    Problem(64, "fp16"),
    Problem(128, "bf16", gqa_ratio=4, mask="causal"),
    Problem(96, "bf16", mask="causal"),
    Problem(256, "bf16", mask="causal"),
    Problem(256, "fp16", gqa_ratio=2),
    Problem(96, "bf16"),
    Problem(64, "fp16", gqa_ratio=4, mask="causal", softmax_scale=0.0625),
    # Compiled masks (docs/masks.md): a window, chunks under causal, a prefix, an expression of b and h.
    Problem(128, "bf16", mask="sliding_window(200, 0)"),
    Problem(128, "bf16", gqa_ratio=4, mask="sliding_window(4095, 0)"),
    Problem(64, "fp16", gqa_ratio=2, mask="chunked(96) and causal"),
    Problem(96, "bf16", mask="prefix_lm(40)"),
    # Bands spelt out (closed forms from attngen/maskc/bands.py): a symmetric window, causal capped by a key limit.
    Problem(64, "bf16", gqa_ratio=2, mask="abs(q_idx - kv_idx) <= 100"),
    Problem(128, "fp16", mask="kv_idx < min(q_idx + kv_len - q_len + 1, 1000)"),
    Problem(64, "bf16", mask="kv_idx < prefix[b] or causal"),  # prefix lengths per sequence
    Problem(128, "bf16", gqa_ratio=5, mask="chunked(8192) and causal"),  # Llama 4's local layers
    Problem(128, "fp16", gqa_ratio=2, mask="(q_idx + 2 * kv_idx) % 7 != 3 or h == 1 or b == 2"),
    # Score modifiers: Gemma 2's softcap under causal (its global layers) and in a 4096-key window
    # (its local ones); an ALiBi-like distance penalty in a window.
    Problem(64, "bf16", mask="causal", score_mod="softcap(20.0)"),
    Problem(256, "bf16", gqa_ratio=2, mask="causal", score_mod="softcap(50.0)"),
    Problem(256, "bf16", gqa_ratio=2, mask="sliding_window(4095, 0)", score_mod="softcap(50.0)"),
    Problem(128, "fp16", gqa_ratio=2, mask="sliding_window(96, 32)", score_mod="score - 0.125 * abs(q_idx - kv_idx)"),
    # Runtime inputs: packed documents under causal, with ALiBi slopes per head.
    Problem(128, "bf16", gqa_ratio=2, mask="doc[b, q_idx] == doc[b, kv_idx] and causal", score_mod="alibi"),
    Problem(64, "bf16", gqa_ratio=8, mask="sliding_window(127, 0)", sink="sinks[h]"),  # gpt-oss's local layers
    # Context parallelism: a shard of queries against global key positions, offsets as scalar inputs.
    Problem(128, "bf16", gqa_ratio=2, mask="kv_idx + kv_offset <= q_idx + q_offset"),
    Problem(64, "fp16", mask="kv_idx + kv_offset <= q_idx + q_offset and q_idx + q_offset - kv_idx - kv_offset < 300",
            score_mod="softcap(20.0)"),
    # ...and ALiBi over the shard's global positions, the mask's int32 offsets read by the modifier as int().
    Problem(128, "bf16", gqa_ratio=2, mask="kv_idx + kv_offset <= q_idx + q_offset",
            score_mod="score - slope[h] * abs(q_idx + int(q_offset) - kv_idx - int(kv_offset))"),
    # Block sparsity: FlexAttention BlockMasks as attention(block_mask=) lowers them, blocks of one
    # tile (partial blocks apply the element mask alone) and of sizes no tile divides.
    Problem(128, "bf16", gqa_ratio=2, mask=block_sparse.lowered("causal", 128, 128, True, True)),
    Problem(64, "fp16", mask=block_sparse.lowered("none", 96, 80, False, True)),
    # Packed sequences: kernels tiling each sequence on its own (varlen), and the document mask
    # attention_varlen lowers a call to elsewhere.
    Problem(128, "bf16", gqa_ratio=4, mask="causal", varlen=True),
    Problem(64, "fp16", gqa_ratio=2, mask="sliding_window(100, 20)", score_mod="alibi", sink="sinks[h]", varlen=True),
    Problem(256, "bf16", mask="chunked(200) and causal", score_mod="softcap(30.0)", varlen=True),
    Problem(96, "bf16", gqa_ratio=2, mask="none", varlen=True),
    Problem(128, "fp16", gqa_ratio=2, **_document_mask("causal", "alibi")),
    Problem(64, "bf16", **_document_mask("sliding_window(64, 0)", "softcap(20.0)")),
)
EXTRA_CONFIGS = 3  # non-default configs per family
RANDOM_GQA_RATIOS = (1, 2, 3, 4, 8)
RANDOM_SOFTMAX_SCALES = (0.03125, 0.1, 0.5)
RANDOM_VARLEN = 0.2  # how often a random problem that can be packed is (on families tiling per sequence)
RANDOM_TRIES = 10_000  # draws before random_spec gives up on a target no family can run anything on


def pinned_spec(problem: Problem, family: KernelFamily, config: Config | None = None) -> AttentionSpec:
    """The spec of `problem` pinned to `family` (and to all of `config`, when given)."""
    return AttentionSpec(**dataclasses.asdict(problem), family=family.name,
                         config=None if config is None else config.to_dict())


def plan_or_none(spec: AttentionSpec, target: Target) -> Plan | None:
    """The dispatcher's plan of `spec` on `target`; None when the family cannot build it there (a
    config the target's shared memory cannot hold, say)."""
    try:
        return families.plan_spec(spec, target)
    except SpecError:
        return None


# A call length whose defaults are a family's short-call ones, where it has them (fwd_sm90: <= 1k tokens).
SHORT_CALL = 512


def short_default(problem: Problem, family: KernelFamily, target: Target) -> AttentionSpec | None:
    """`problem` pinned to `family`'s default for short calls, where that differs from its default."""
    try:
        short = family.resolve_config(problem, target, {}, SHORT_CALL)
        if short == family.resolve_config(problem, target, {}):
            return None
    except SpecError:
        return None
    spec = pinned_spec(problem, family, short)
    return spec if plan_or_none(spec, target) is not None else None


def builtin_specs(target: Target) -> tuple[AttentionSpec, ...]:
    """The built-in pool for `target` (module docstring): defaults first (each problem's, then its
    short calls' where they differ), then each family's extras."""
    defaults = [spec for problem in PROBLEMS for family in families.supporting(problem, target)
                for spec in (pinned_spec(problem, family), short_default(problem, family, target))
                if spec is not None and plan_or_none(spec, target) is not None]
    extras = [spec for family in families.FAMILIES.values() for spec in _extra_specs(family, target)]
    return tuple(dict.fromkeys(defaults + extras))


def variety(plan: Plan) -> set:
    """What a plan exercises that another may not: its config values, and the on/off choices the
    family derives from them (Q in registers or re-read from shared memory, say)."""
    return set(plan.config.to_dict().items()) | {(name, value) for name, value in plan.choices().items()
                                                  if isinstance(value, bool)}


def _extra_specs(family: KernelFamily, target: Target) -> list[AttentionSpec]:
    supported = [p for p in PROBLEMS if family.supports(p, target) is None]
    defaults = [plan_or_none(pinned_spec(p, family), target) for p in supported]
    covered = set().union(*(variety(plan) for plan in defaults if plan is not None))
    rng = random.Random(f"attngen-fuzz-pool-{family.name}-{target.name}")
    chosen: list[AttentionSpec] = []
    for i in range(EXTRA_CONFIGS if supported else 0):
        problem = supported[i * len(supported) // EXTRA_CONFIGS]
        default = family.resolve_config(problem, target, {})
        short = short_default(problem, family, target)  # in the pool already, where there is one
        candidates = []
        for config in family.configs(problem, target):
            if config == default or (short is not None and config.to_dict() == dict(short.config)):
                continue
            try:
                spec = pinned_spec(problem, family, config)
            except SpecError:  # a config the family's own check refuses: not one to fuzz
                continue
            plan = plan_or_none(spec, target)
            if plan is not None and spec not in chosen:
                candidates.append((variety(plan), spec))
        if not candidates:
            continue
        rng.shuffle(candidates)  # ties go to a fixed but arbitrary candidate
        values, spec = max(candidates, key=lambda c: len(c[0] - covered))
        covered |= values
        chosen.append(spec)
    return chosen


def random_mask(rng: random.Random) -> str:
    """none or causal half the time, else a built-in with random parameters, possibly combined, or
    (one non-trivial draw in nine) a random expression tree from the whole grammar, without runtime
    inputs."""
    tree = lambda: MaskExprs(rng, inputs=False).mask()  # noqa: E731
    choices = [
        lambda: rng.choice(("none", "causal")),
        lambda: f"sliding_window({rng.randint(0, 300)}, {rng.choice((0, 0, rng.randint(0, 100)))})",
        lambda: f"chunked({rng.randint(1, 300)})",
        lambda: f"prefix_lm({rng.randint(0, 200)})",
        lambda: f"causal and sliding_window({rng.randint(0, 300)}, 0)",
        lambda: f"chunked({rng.randint(1, 300)}) and causal",
        lambda: f"kv_idx % {rng.randint(1, 9)} != {rng.randint(0, 3)} or q_idx < {rng.randint(0, 50)}",
        lambda: f"kv_idx + kv_offset <= q_idx + q_offset{rng.choice(('', f' + {rng.randint(0, 200)}'))}",
        lambda: f"abs(q_idx - kv_idx + {rng.randint(-50, 50)}) <= {rng.randint(0, 300)}",  # a band spelt out
        lambda: block_sparse.lowered(rng.choice(("none", "causal", f"sliding_window({rng.randint(0, 300)}, 0)")),
                                     rng.choice((64, 128, 256, rng.randint(1, 300))),
                                     rng.choice((64, 128, 256, rng.randint(1, 300))), rng.random() < 0.5,
                                     rng.random() < 0.5),
        tree,
    ]
    return choices[0]() if rng.random() < 0.5 else rng.choice(choices[1:])()


def random_score_mod(rng: random.Random) -> str:
    """A modifier that does not blow logits up (the tolerances assume scores no larger than scale * q.k):
    a built-in or fixed form, or a random expression tree (without runtime inputs) kept to a
    perturbation of the score within +-0.5 through tanh."""
    return rng.choice([
        lambda: f"softcap({rng.choice((5.0, 20.0, 50.0))})",
        lambda: f"score - {rng.choice((0.01, 0.1, 0.5))} * abs(q_idx + (kv_len - q_len) - kv_idx)",
        lambda: f"where(kv_idx % {rng.randint(2, 5)} == 0, score - 1.0, score)",
        lambda: f"score + 0.5 * tanh({ScoreExprs(rng, inputs=False, smooth=True).float(rng.randint(1, 3))})",
    ])()


def of_families(specs, names: Collection[str], family_of) -> list[AttentionSpec]:
    """The specs that run as one of the named families (family_of(spec): the family that runs it); all of
    them when no family is named."""
    return [spec for spec in specs if not names or family_of(spec) in names]


def random_spec(rng: random.Random, target: Target, only: Collection[str] | None = None) -> AttentionSpec:
    """A random problem, pinned to a random family that supports it on `target` (one of `only`, when
    given), three times in four with a random config of that family; always one the dispatcher plans
    on `target`."""
    for _ in range(RANDOM_TRIES):
        problem = Problem(head_dim=rng.choice(HEAD_DIMS), dtype=rng.choice(sorted(DTYPES)),
                          gqa_ratio=rng.choice(RANDOM_GQA_RATIOS), mask=random_mask(rng),
                          softmax_scale=rng.choice(RANDOM_SOFTMAX_SCALES) if rng.random() < 0.25 else None,
                          score_mod=random_score_mod(rng) if rng.random() < 0.25 else None)
        if rng.random() < RANDOM_VARLEN and varlen.native_reason(problem) is None:
            problem = dataclasses.replace(problem, varlen=True)
        supporting = [f for f in families.supporting(problem, target) if only is None or f.name in only]
        if not supporting:
            continue
        family = rng.choice(supporting)
        config = rng.choice(family.configs(problem, target)) if rng.random() < 0.75 else None
        try:
            spec = pinned_spec(problem, family, config)
        except SpecError:
            continue
        if plan_or_none(spec, target) is not None:  # the target must hold the config (shared memory, say)
            return spec
    named = f"of {', '.join(map(repr, only))} " if only is not None else ""
    raise ValueError(f"no kernel family {named}plans a random problem on {target.name} in {RANDOM_TRIES} draws; "
                     f"families: {', '.join(families.FAMILIES)}")


def random_spec_pool(seed: int, count: int, target: Target,
                     only: Collection[str] | None = None) -> tuple[AttentionSpec, ...]:
    """`count` distinct random specs for `target`, the same for the same seed. A pool (not a spec per
    case) keeps the number of compiles bounded; hypothesis still shrinks towards the pool's first spec."""
    rng = random.Random(f"attngen-random-specs-{seed}")
    pool: dict[AttentionSpec, None] = {}
    for _ in range(100 * count):
        if len(pool) == count:
            break
        pool[random_spec(rng, target, only)] = None
    return tuple(pool)
