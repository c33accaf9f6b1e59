"""Band masks (attngen/maskc/bands.py) on the CPU: which expressions are bands (scalar inputs such as
context-parallel offsets included); their closed forms held to the dense mask row by row (what ROW_INTERVAL masking
needs) and over blocks of rows (sound, and the keys every row sees exact); the emitted C++ bounds held to the Python
ones (nvcc, run on the CPU, lengths up to 2^31 - 1); and what a band's kernel is: the built-ins' closed-form path,
no block table."""

from __future__ import annotations

import difflib
import random
import re
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_masks import assert_rows_are_their_intervals

from attngen import families, mask_table, masks, targets
from attngen.build.nvcc import find_nvcc
from attngen.maskc import compile_mask, cuda_preamble
from attngen.maskc.bands import band
from attngen.spec import HEAD_DIMS, AttentionSpec

BANDS = ["q_idx >= kv_idx", "kv_idx <= q_idx", "not (kv_idx > q_idx)", "q_idx - kv_idx < 4096 and kv_idx <= q_idx",
         "0 <= q_idx - kv_idx < 4", "kv_idx < 10", "kv_idx >= 7", "kv_idx == q_idx", "kv_idx - 3 == q_idx",
         "kv_idx >= q_idx + kv_len - q_len", "kv_idx + q_len <= q_idx + kv_len", "-kv_idx > -q_idx - 5",
         "2 * (kv_idx - q_idx) + 3 < kv_idx - q_idx + 10", "kv_idx < 3 * kv_len - 2 * q_len - 40",
         "kv_idx <= q_idx and kv_idx >= q_idx - 5 and kv_idx < 40 and kv_idx > 2",
         # scalar inputs: a context-parallel shard's offsets, a limit
         "kv_idx + kv_offset <= q_idx + q_offset", "kv_idx < lim", "kv_idx >= 2 * lim - q_offset + 3",
         "kv_idx + kv_offset <= q_idx + q_offset and q_idx + q_offset - kv_idx - kv_offset < 30",
         # abs, min and max that split into comparisons
         "abs(q_idx - kv_idx) <= 12", "not (abs(kv_idx - q_idx - 3) > 5)", "kv_idx < min(q_idx + 1, 40)",
         "kv_idx > max(q_idx - 30, kv_len - q_len - 40)", "max(kv_idx, q_idx - 5) < q_idx", "abs(q_idx - kv_idx) < -1",
         "kv_idx >= max(q_idx - 20, 3, lim) and abs(kv_idx - q_offset) < 50",
         # lengths read at b, and `or`s of bands that start alike: prefixes
         "prefix_lm(16)", "prefix_lm(plen[b])", "kv_idx < plen[b] + q_offset", "kv_idx < 5 or causal",
         "(kv_idx < lim or kv_idx <= q_idx) and kv_idx >= q_idx - 30", "kv_idx < plen[b] or kv_idx < 4 or q_idx >= kv_idx",
         "(kv_idx >= 3 and kv_idx < 10) or (kv_idx >= 3 and kv_idx <= q_idx)", "kv_idx < 7 or kv_idx < lim or kv_idx < q_idx - 4",
         "(kv_idx < 2 or kv_idx < plen[b]) and (kv_idx < q_idx + 40 or kv_idx < 7)"]
# The inputs' values in these tests (int32, as attngen passes them): scalars, and plen, read at b, per batch row.
INPUTS = {"q_offset": 37, "kv_offset": -11, "lim": 9, "plen": [5, 0, 60]}
NOT_BANDS = ["2 * kv_idx < q_idx", "kv_idx != q_idx", "q_idx + kv_idx < 10", "kv_idx < q_idx or kv_idx > 3",
             "kv_idx * q_idx < 5", "h == 1 and kv_idx < q_idx", "kv_idx < doc[h]", "q_idx < 5", "kv_idx % 3 != 1",
             "kv_idx < b + 3", "abs(q_idx - kv_idx) >= 5", "kv_idx < max(q_idx, 5)", "max(kv_idx, 10) < q_idx",
             "kv_idx < q_len // 2", "kv_idx <= q_idx and q_idx > 3",
             # `or`s whose sides start apart (a hole between them), reads at h or at a position
             "kv_idx < 3 or kv_idx > 5", "(kv_idx > 2 and kv_idx < 5) or kv_idx <= q_idx", "kv_idx < plen[h] or causal",
             "kv_idx < doc[b, q_idx] or causal", "kv_idx < 4 or kv_idx % 2 == 0",
             "kv_idx < 2199023255552",  # a constant past bands.MAX_CONSTANT
             # sides that would wrap around in 64 bits though their difference is small
             "kv_idx + 4611686018427387903 * q_len < q_idx + 4611686018427387903 * q_len"]

OFFSETS = "kv_idx + kv_offset <= q_idx + q_offset"
_OPS = ("<", "<=", ">", ">=", "==")
_SWAPPED = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "=="}


@st.composite
def band_texts(draw) -> str:
    """1 to 3 comparisons of kv_idx with q_idx (or nothing), the lengths and a constant, spelt in random ways."""
    terms = []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(_OPS))
        x = draw(st.sampled_from(("q_idx + ", "", "q_idx - ")))  # "q_idx - " goes to the kv side below
        lengths = draw(st.sampled_from(("", "kv_len - q_len + ", "q_len - kv_len + ", "2 * kv_len - 2 * q_len + ",
                                        "q_offset - kv_offset + ", "lim + ")))
        c = draw(st.integers(-60, 60))
        kv = "kv_idx - q_idx" if x == "q_idx - " else "kv_idx"
        right = f"{'q_idx + ' if x == 'q_idx + ' else ''}{lengths}{c}"
        term = f"{kv} {op} {right}" if draw(st.booleans()) else f"{right} {_SWAPPED[op]} {kv}"
        if op in ("<", "<=") and draw(st.integers(0, 3)) == 0:  # |kv - right| below a width, as abs()
            terms.append(f"abs({kv} - ({right})) {op} {draw(st.integers(-3, 40))}")
        elif kv == "kv_idx" and op in ("<", "<=") and draw(st.integers(0, 3)) == 0:  # a prefix: an `or` of ends
            other = draw(st.sampled_from(("plen[b]", "lim", "q_idx + kv_len - q_len", "q_idx - 9")))
            terms.append(f"({term} or kv_idx < {other} + {draw(st.integers(-5, 30))})")
        else:
            terms.append(f"not ({term})" if op != "==" and draw(st.integers(0, 3)) == 0 else term)
    return " and ".join(terms)


@pytest.mark.parametrize("text", BANDS)
def test_bands_have_closed_forms(text):
    assert band(compile_mask(text).ir) is not None and masks.get_mask(text).closed is not None


@pytest.mark.parametrize("text", NOT_BANDS)
def test_other_masks_are_not_bands(text):
    assert band(compile_mask(text).ir) is None and masks.get_mask(text).closed is None


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(BANDS) | band_texts(), st.integers(1, 90), st.integers(1, 90), st.integers(1, 40), st.data())
def test_band_bounds_are_exact_per_row_and_sound_per_block(text, Sq, Sk, block_m, data):
    """Every row sees exactly [kv_begin, kv_end) of bounds(q, q + 1) (mask.cuh.j2 ROW_INTERVAL); rows [m0, m1)
    see nothing outside [kv_begin, kv_end), and [full_begin, full_end) is exactly the keys all of them see."""
    mask = masks.get_mask(text)
    values = {name: data.draw(st.integers(-100, 100), label=name) for name in INPUTS if name != "plen"}
    values["plen"] = data.draw(st.lists(st.integers(-100, 100), min_size=3, max_size=3), label="plen")
    b = data.draw(st.integers(0, 2), label="b")
    dense = assert_rows_are_their_intervals(text, Sq, Sk, values, b)
    keys = torch.arange(Sk)
    m0 = data.draw(st.integers(0, Sq - 1))
    m1 = min(Sq, m0 + block_m)
    kv_begin, kv_end, full_begin, full_end = mask.closed_bounds(m0, m1, Sq, Sk, values, b)
    rows = dense[m0:m1]
    outside = (keys < kv_begin) | (keys >= kv_end)
    assert not rows[:, outside].any(), (text, Sq, Sk, m0, m1)
    assert torch.equal(rows.all(dim=0), (keys >= full_begin) & (keys < full_end)), (text, Sq, Sk, m0, m1)


def test_a_band_spelling_of_causal_has_causals_bounds():
    ours, causal = masks.get_mask("q_idx >= kv_idx"), masks.get_mask("causal")
    for m0, m1, S in ((0, 128, 16384), (128, 256, 16384), (16256, 16384, 16384), (0, 1, 1), (5, 77, 300)):
        assert ours.closed_bounds(m0, m1, S, S) == causal.closed_bounds(m0, m1, S, S)


def _rendered(text: str, family: str = "fwd_sm90", head_dim: int = 128, dtype: str = "bf16") -> tuple[str, object]:
    spec = AttentionSpec(head_dim=head_dim, dtype=dtype, mask=text, family=family)
    target = targets.target("sm_90a")
    plan = families.plan_spec(spec, target)
    return families.get_family(family).render(plan), plan


@pytest.mark.parametrize("family", ["fwd_sm90", "fwd_sm80"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_a_band_compiles_to_the_built_in_causal_kernel_but_for_its_predicate(family, head_dim):
    """`mask: "q_idx >= kv_idx"` must run as the built-in causal on each family (issue 10's 3% bar): the same
    config and schedule, closed-form bounds, row-interval masking and no block table; its source differs only in
    names, comments, the element predicate's expression and the bounds' expressions."""
    ours, ours_plan = _rendered("q_idx >= kv_idx", family, head_dim)
    causal, causal_plan = _rendered("causal", family, head_dim)
    assert mask_table.for_problem(AttentionSpec(head_dim=head_dim, mask="q_idx >= kv_idx").problem) is None
    assert "constexpr bool ROW_INTERVAL = true;" in ours and "_mask_table(" not in ours
    assert ours_plan.config == causal_plan.config
    ours, causal = (src.replace(plan.name, "NAME").splitlines() for src, plan in ((ours, ours_plan),
                                                                                  (causal, causal_plan)))
    changed = [line for line in difflib.unified_diff(causal, ours, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    allowed = re.compile(r"^[+-]\s*(//.*|return .*;)$")
    assert changed and all(allowed.match(line) for line in changed), "\n".join(changed)


def test_masks_with_closed_forms_take_causals_tile_and_other_expressions_do_not():
    """Which masks get the built-ins' tiles (masks.row_interval): those with a closed form (built-ins, their
    conjunctions, bands and prefixes), whose rows are masked by two bounds; not masks without one (an `or` with a
    hole, inputs read at a position), nor any expression with a score modifier or a sink; on fwd_sm80 beside dropout
    only causal-shaped bands without inputs, in a packed sequence only bands (what compiles without spills there)."""
    assert all(masks.row_interval(m) for m in ("none", "causal", "q_idx >= kv_idx", "sliding_window(4095, 0)", OFFSETS,
                                               "chunked(8192)", "causal and chunked(100)", "prefix_lm(16)",
                                               "prefix_lm(plen[b])"))
    assert not any(masks.row_interval(m) for m in ("doc[b, q_idx] == doc[b, kv_idx] and causal",
                                                   "kv_idx % 5 != 2 or causal", "kv_idx < plen[h] or causal"))
    sm80 = families.get_family("fwd_sm80")
    target = targets.target("sm_80")

    def tile(**fields):
        return sm80.default_config(AttentionSpec(head_dim=128, **fields).problem, target)

    assert tile(mask="q_idx >= kv_idx") == tile(mask="sliding_window(4095, 0)") == tile(mask="chunked(8192)") \
        == tile(mask="prefix_lm(16)") == tile(mask="prefix_lm(plen[b])") == tile(mask="causal")
    # a predicate per element: the expressions' tile
    assert tile(mask="kv_idx < plen[h] or causal") == tile(mask="causal", score_mod="softcap(30)") != tile(mask="causal")
    assert tile(mask="prefix_lm(plen[b])", dropout_p=0.125) != tile(mask="causal", dropout_p=0.125)
    # a prefix's `or` (the max of two ends) spilled beside a packed sequence's tile: the smaller tile there
    assert tile(mask="prefix_lm(16)", varlen=True) != tile(mask="causal", varlen=True)
    # and a prefix read per batch row spilled at d128 for sm_90a, where causal's tile is at 255 registers
    hopper = targets.target("sm_90a")
    assert sm80.default_config(AttentionSpec(head_dim=128, mask="prefix_lm(plen[b])").problem, hopper) \
        != sm80.default_config(AttentionSpec(head_dim=128, mask="causal").problem, hopper)
    assert sm80.default_config(AttentionSpec(head_dim=64, mask="prefix_lm(plen[b])").problem, hopper) \
        == sm80.default_config(AttentionSpec(head_dim=64, mask="causal").problem, hopper)
    # Chunks divide per row: beside dropout or a packed sequence they keep the expressions' tile; bands do not.
    assert tile(mask="chunked(100)", dropout_p=0.125) != tile(mask="causal", dropout_p=0.125)
    assert tile(mask="chunked(100)", varlen=True) != tile(mask="causal", varlen=True)
    assert tile(mask="sliding_window(255, 0)", varlen=True) == tile(mask="causal", varlen=True)
    assert tile(mask="sliding_window(255, 0)", dropout_p=0.125) != tile(mask="causal", dropout_p=0.125)
    assert tile(mask="q_idx >= kv_idx", dropout_p=0.125) == tile(mask="causal", dropout_p=0.125) \
        == tile(mask="none", dropout_p=0.125) == tile(mask="none")
    assert tile(mask="q_idx >= kv_idx", score_mod="softcap(30)") != tile(mask="causal")


@pytest.mark.parametrize("family", ["fwd_sm90", "fwd_sm80"])
def test_closed_forms_compile_without_spills_at_the_tiles_they_take(family):
    """The default config of a mask with a closed form at every head dim (causal's on fwd_sm80; on fwd_sm90 causal's
    for a causal-shaped one, the expressions' for a window or chunks) compiles without spills, scalar inputs and
    chunks' divisions included."""
    from concurrent.futures import ThreadPoolExecutor

    from attngen.build import nvcc

    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    target = targets.target("sm_90a" if family == "fwd_sm90" else "sm_80")
    cases = [(d, m, {}) for d in HEAD_DIMS
             for m in ("q_idx >= kv_idx", "sliding_window(4095, 0)", OFFSETS, "causal and chunked(100)",
                       "prefix_lm(plen[b])", "prefix_lm(16) and sliding_window(4095, 0)")]
    # Dropout's keep masks and (fwd_sm80) a packed sequence's tile beside them: chunks keep the smaller tile there.
    cases += [(d, m, extra) for d in (64, 128)
              for m in ("sliding_window(255, 0)", "causal and chunked(100)", OFFSETS, "prefix_lm(16)", "prefix_lm(plen[b])")
              for extra in ({"dropout_p": 0.125}, {"varlen": True}) if not (extra.get("varlen") and m in (OFFSETS, "prefix_lm(plen[b])"))]

    def spills(case):
        head_dim, mask, extra = case
        spec = AttentionSpec(head_dim=head_dim, dtype="bf16", mask=mask, family=family, **extra)
        plan = families.plan_spec(spec, target)
        report = nvcc.check_plan(plan)
        return case, plan.config.label(), report.spill_bytes + sum(k.spill_bytes for k in report.kernels.values())

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(spills, cases))
    assert all(spilled == 0 for _, _, spilled in results), results


# Lengths and rows for the C++ check: small, random, and near int32's end (the bounds are 64-bit inside).
def _cases(r: random.Random) -> list[tuple[int, int, int, int]]:
    out = []
    for _ in range(60):
        big = r.random() < 0.3
        Sq, Sk = ((r.randint(2**31 - 300, 2**31 - 1), r.randint(2**31 - 300, 2**31 - 1)) if big
                  else (r.randint(1, 500), r.randint(1, 500)))
        m0 = r.randint(0, Sq - 1)
        out.append((m0, min(Sq, m0 + r.randint(1, 200)), Sq, Sk))
    return out


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found (PATH or $CUDA_HOME/bin)")
def test_emitted_bounds_match_the_python_ones(tmp_path):
    r = random.Random(0)
    texts = BANDS + [
        "kv_idx >= q_idx - 1000 and kv_idx < q_idx + kv_len - q_len + 7", "kv_idx == q_idx + kv_len - q_len",
        "chunked(100)", "chunked(8192) and causal", "chunked(1073741824)"]  # chunks divide in 32 bits
    cases = _cases(r)
    # int32's ends, in 64 bits inside; plen is read at the batch row, c % 3 for case c
    values = {"q_offset": 2**31 - 5, "kv_offset": -(2**31) + 3, "lim": 123456, "plen": [2**31 - 7, -(2**31) + 1, 300]}
    functions, calls = [], []
    for i, text in enumerate(texts):
        closed = masks.get_mask(text).closed
        functions.append(f"static void bounds_{i}(int m0, int m1, int Sq, int Sk, int batch, const Inputs& p, int* out) {{\n"
                         "    (void)p; (void)batch;\n"
                         f"    const int v[4] = {{{', '.join(closed.cuda)}}};\n"
                         "    for (int j = 0; j < 4; ++j) out[j] = v[j];\n}\n")
        calls.append(f"    for (int c = 0; c < {len(cases)}; ++c) {{"
                     f" bounds_{i}(C[c][0], C[c][1], C[c][2], C[c][3], c % 3, p, out);"
                     f' printf("%d %d %d %d\\n", out[0], out[1], out[2], out[3]); }}')
    rows = ", ".join("{" + ", ".join(map(str, c)) + "}" for c in cases)
    fields = "".join(f"    const int* in_{name};\n" for name in values) + "    long long in_plen_s0;\n"
    storage = "".join(f"    static const int {name}_value[] = {{{', '.join(map(str, v if isinstance(v, list) else [v]))}}};\n"
                      for name, v in values.items())
    inputs = ", ".join(f"{name}_value" for name in values) + ", 1"
    source = (f"#include <cstdio>\n{cuda_preamble()}\nstruct Inputs {{\n{fields}}};\n" + "".join(functions)
              + f"static const int C[{len(cases)}][4] = {{{rows}}};\nint main() {{\n{storage}"
              + f"    const Inputs p{{{inputs}}};\n    int out[4];\n" + "\n".join(calls) + "\n    return 0;\n}\n")
    path, binary = tmp_path / "bounds.cu", tmp_path / "bounds"
    path.write_text(source)
    build = subprocess.run([find_nvcc(), "-std=c++17", "-o", str(binary), str(path)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    printed = subprocess.run([str(binary)], capture_output=True, text=True, check=True, timeout=60).stdout.split("\n")
    for i, text in enumerate(texts):
        mask = masks.get_mask(text)
        for j, case in enumerate(cases):
            expected = " ".join(map(str, mask.closed_bounds(*case, values, j % 3)))
            assert printed[i * len(cases) + j] == expected, (text, case)


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found (PATH or $CUDA_HOME/bin)")
@pytest.mark.parametrize("name", [*families.FAMILIES, *families.DECODE_FAMILIES, *families.BACKWARD_FAMILIES])
@pytest.mark.parametrize("mask, reads", [(OFFSETS, ("p.in_q_offset[0]", "p.in_kv_offset[0]")),
                                         ("prefix_lm(plen[b])", ("p.in_plen[(batch) * p.in_plen_s0]",))])
def test_every_family_builds_a_band_that_reads_inputs(name, mask, reads):
    """A context-parallel shard's causal mask, and a prefix per batch row: every family's kernel takes its bounds
    from the closed form, which reads the offsets (or the row's prefix) through the argument struct (no block
    table), and compiles without spills. (bwd_sm90 at d128 runs at 255 registers and spilled 8 bytes under the
    shard's mask through the block table too, so it is checked at d64.)"""
    from attngen.build import nvcc

    family = families.get_family(name)
    head_dim = 64 if name == "bwd_sm90" else 128
    target = next(targets.target(a) for a in ("sm_90a", "sm_80")
                  if family.supports(AttentionSpec(head_dim=head_dim, mask=mask).problem, targets.target(a)) is None)
    plan = families.plan_spec(AttentionSpec(head_dim=head_dim, mask=mask, family=name), target)
    source = family.render(plan)
    bounds = source[source.index("Bounds bounds("):]
    bounds = bounds[:bounds.index("\n}\n")]
    assert all(read in bounds for read in reads) and "_mask_table(" not in source
    assert nvcc.check_plan(plan).spill_bytes == 0


def test_a_shard_is_scheduled_as_causal():
    """A context-parallel shard's mask is causal shifted by its offsets: fwd_sm90 gives it causal's schedule (the
    counter's costs more there: docs/perf-notes.md "Per-tile cost"); a windowed shard keeps the counter."""
    target = targets.target("sm_90a")
    family = families.get_family("fwd_sm90")

    def schedule(mask):
        return family.default_config(AttentionSpec(head_dim=128, mask=mask).problem, target).schedule

    assert masks.causal_shaped(OFFSETS) and schedule(OFFSETS) == schedule("causal")
    windowed = OFFSETS + " and q_idx + q_offset - kv_idx - kv_offset < 300"
    assert not masks.causal_shaped(windowed) and schedule(windowed) == "dynamic"
    assert not masks.causal_shaped("kv_idx < lim")
