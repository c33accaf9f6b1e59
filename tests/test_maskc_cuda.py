"""The emitted C++ of attngen.maskc, compiled with nvcc and run on the CPU (no GPU): every
`__host__ __device__` function the emitters print is called from main() and its results are held
to the Python side: visible() to dense() over whole grids, classify() to classify() (the same
analysis, so the same answers), and score modifiers and their derivatives to dense() in float32.

The emitters compute an int node as 32-bit int where its value provably fits (cuda.static_range
over the documented variable ranges), else as long long; a wrong choice would overflow only near the
ends of those ranges. So visible() and the score modifiers also run at boundary points (q_idx,
kv_idx up to 2^31 - 2, lengths up to 2^31 - 1, b, h up to 65534), held to Python's own evaluation
with unbounded ints (skipping only points where even the long long version would overflow: products
of two large variables), and classify() runs on rectangles at the ends of the ranges.

One .cu file holds every program (built-ins, hand-written expressions and seeded random ones), so
the module costs one nvcc call. A __global__ probe calls every function too, so each is compiled
as device code as well."""

from __future__ import annotations

import random
import subprocess

import numpy as np
import pytest
import torch
from test_maskc import (
    MASK_INPUT_VALUES,
    SCORE_INPUT_VALUES,
    MaskExprs,
    ScoreExprs,
    grid,
    int_values,
    python_value,
    tensors,
    wrapped,
)

from attngen.build.nvcc import find_nvcc
from attngen.maskc import compile_mask, compile_score_mod, cuda_preamble
from attngen.maskc.cuda import VAR_RANGES, float_literal, hoisted_reads, int_literal, point_code, read_code, static_range

pytestmark = pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found (PATH or $CUDA_HOME/bin)")

MASKS = [
    "none", "causal", "sliding_window(3, 1)", "sliding_window(0, 0)", "chunked(4)", "chunked(5) and causal",
    "prefix_lm(6)", "causal and sliding_window(8, 0)",
    "doc[q_idx] == doc[kv_idx]",
    "kv_idx < lim + off[h]",
    "(q_idx - kv_idx) // 3 == -2 or (kv_idx - q_idx) % 5 == 4",
    "abs(q_idx - kv_idx) * 2 <= max(q_len, kv_len) // 4",
    "where(b == 1, causal, not causal)",
    "(0 <= q_idx - kv_idx < 4) & (h != 2)",
    "min(q_idx, kv_idx, 5) * kv_idx - q_idx * q_idx > -10",
    "doc[kv_idx % 8 + 3 * b] != off[h] % 4",
    "prefix_lm(3) and not chunked(4)",
    "(q_idx < 4) == (kv_idx >= 9)",
    "where(doc[q_idx] > 1, kv_idx, q_idx) // 2 < 5",
    # near int32: the mod mask of the kernel tests, sums that leave int32 only at the ends of the ranges
    "kv_idx % 3 != 1 or (q_idx == kv_idx and h == 0)",
    "(q_idx + kv_len) // 7 == kv_idx // 7 + h % 3",
    "(kv_len - q_len) % 5 == 0 or q_idx * 2 > kv_idx + kv_len",
    "abs(q_idx - kv_idx) % 1000 < (q_len - kv_len) // 3 + b",
    "where(h > 100, q_idx - b, kv_idx + h) % 65535 <= 3 * h",
    "min(q_len, kv_len) - max(q_idx, kv_idx) > -b and -q_idx - kv_idx < 1 - kv_len",
    "h * b + q_idx // 65536 >= kv_idx % 70000 - abs(h - b) * 32768",
    "(q_len + kv_len) % 4 == (q_idx - kv_idx) % 4 or off[kv_idx % 4] > doc[(q_idx + kv_idx) % 64]",
]
SCORE_MODS = [
    "softcap(30)", "softcap(2.5)", "alibi", "score", "score * 0.1 + bias[h]",
    "where(causal, score, score - 1000.0)",
    "min(score, 2.0) - max(score * 0.5, -1.0) + abs(score)",
    "sqrt(abs(score) + 1.0) * log(abs(score) + 2.0) / exp(tanh(score))",
    "score + (q_idx - kv_idx) // 3 * 0.5",
    "-score + q_len / 3",
    "score + (kv_idx % 7) * 0.5 - (q_idx + kv_len) // 1000000 * 0.001",
    "score * 0.001 + (q_len - kv_len) * 0.00001 + where(h * 2 < b, h - b, b + h) * 0.25",
]
RANDOM_MASKS, RANDOM_SCORE_MODS = 40, 30
# (q_len, kv_len, b, h) for the mask grids and rectangles
CONFIGS = [(13, 17, 1, 2), (20, 9, 0, 3), (16, 16, 2, 0), (1, 40, 0, 1), (33, 64, 1, 1)]
RECTS_PER_CONFIG = 30
POINTS = 48
# The ends of the documented ranges: points for visible() and the score modifiers, configs
# (q_len, kv_len, b, h) and rectangles for classify().
IDX_MAX, LEN_MAX, BH_MAX = VAR_RANGES["q_idx"][1], VAR_RANGES["q_len"][1], VAR_RANGES["h"][1]
BOUNDARY_POINTS = 96
BOUNDARY_CONFIGS = [(LEN_MAX, LEN_MAX, BH_MAX, BH_MAX), (1, LEN_MAX, 0, BH_MAX), (LEN_MAX, 1, BH_MAX, 0),
                    (LEN_MAX - 1, LEN_MAX, 1, BH_MAX - 1), (2**30, LEN_MAX - 2, 3, 2), (LEN_MAX, 2**31 - 7, 0, 1)]
BOUNDARY_RECTS_PER_CONFIG = 12
# Input lengths: input_ref reads every input modulo its length, so boundary points can read them.
INPUT_LENGTHS = {"off": 4, "doc": 64, "slope": 4, "bias": 4}
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

INPUTS_STRUCT = """struct Inputs {
    const long long* off; const long long* doc; long long lim; const float* slope; const float* bias;
};
"""


def input_ref(name: str, index: list) -> str:
    """Inputs routed to a struct, as a kernel template would route them to its parameters; indices
    wrap modulo the input's length (the identity for the grids, whose indices are in range)."""
    return f"in.{name}" + "".join(f"[wrap_index({i}, {INPUT_LENGTHS[name]})]" for i in index)


def _array(ctype: str, name: str, rows: list) -> str:
    literal = int_literal if ctype == "long long" else float_literal
    items = ", ".join("{" + ", ".join(literal(v) for v in row) + "}" if isinstance(row, tuple) else literal(row)
                      for row in rows)
    width = f"[{len(rows[0])}]" if isinstance(rows[0], tuple) else ""
    return f"static const {ctype} {name}[]{width} = {{{items}}};\n"


def _rects(r: random.Random) -> list:
    rects = []
    for c, (q_len, kv_len, _, _) in enumerate(CONFIGS):
        for i in range(RECTS_PER_CONFIG):
            if i < 10:  # block-aligned tiles
                bq, bk = r.choice([1, 4, 8]), r.choice([2, 8, 16])
                q_lo, kv_lo = r.randrange(0, q_len, bq), r.randrange(0, kv_len, bk)
                q_hi, kv_hi = min(q_lo + bq, q_len) - 1, min(kv_lo + bk, kv_len) - 1
            else:
                q_lo, q_hi = sorted((r.randrange(q_len), r.randrange(q_len)))
                kv_lo, kv_hi = sorted((r.randrange(kv_len), r.randrange(kv_len)))
            rects.append((c, q_lo, q_hi, kv_lo, kv_hi))
    return rects


def _points(r: random.Random) -> tuple[list, list]:
    scores = [float(np.float32(r.uniform(-20, 20))) for _ in range(POINTS)]
    where = [(r.randrange(64), r.randrange(64), r.randint(1, 64), r.randint(1, 64), r.randint(0, 2), r.randint(0, 3))
             for _ in range(POINTS)]
    return scores, where


def _boundary_points(r: random.Random) -> list:
    """(q_idx, kv_idx, q_len, kv_len, b, h): mostly the ends of each range, some anywhere in it."""
    def pick(name):
        lo, hi = VAR_RANGES[name]
        if r.randint(0, 4) == 0:
            return r.randint(lo, hi)
        return r.choice([v for v in (lo, lo + 1, lo + 2, hi - 2, hi - 1, hi, 2**30, 65535) if lo <= v <= hi])

    corners = [(IDX_MAX, IDX_MAX, LEN_MAX, LEN_MAX, BH_MAX, BH_MAX), (IDX_MAX, 0, 1, LEN_MAX, 0, 0),
               (0, IDX_MAX, LEN_MAX, 1, BH_MAX, 0), (IDX_MAX, IDX_MAX - 1, 1, LEN_MAX, 0, BH_MAX),
               (IDX_MAX - 1, IDX_MAX, LEN_MAX, 1, 1, 1), (0, 0, 1, 1, 0, 0)]
    names = ("q_idx", "kv_idx", "q_len", "kv_len", "b", "h")
    return corners + [tuple(pick(n) for n in names) for _ in range(BOUNDARY_POINTS - len(corners))]


def _boundary_rects(r: random.Random) -> list:
    """(config, q_lo, q_hi, kv_lo, kv_hi) inside [0, len - 1], at either end or anywhere."""
    def span(length):
        width = min(length, r.choice([1, 2, 64, 128, 2**20, length]))
        at = r.choice(["low", "high", "any"])
        lo = 0 if at == "low" else length - width if at == "high" else r.randint(0, length - width)
        return lo, lo + width - 1

    return [(c, *span(q_len), *span(kv_len)) for c, (q_len, kv_len, _, _) in enumerate(BOUNDARY_CONFIGS)
            for _ in range(BOUNDARY_RECTS_PER_CONFIG)]


def _overflows_int64(program, point, inputs) -> bool:
    """Whether some int node leaves int64 at the point: the long long code is outside its contract there."""
    names = ("q_idx", "kv_idx", "q_len", "kv_len", "b", "h")
    values = int_values(program.ir, dict(zip(names, point)), inputs)
    return any(not INT64_MIN <= v <= INT64_MAX for _, v in values)


def _classify_is_in_range(program) -> bool:
    """Whether classify()'s long long temporaries provably stay in int64 over the whole contract (no
    inputs: Python reads none out of range; every int node's static bound well inside int64)."""
    if program.inputs:
        return False
    memo = {}
    for node in _int_nodes(program.ir):
        r = static_range(node, memo)
        if r is None or max(-r[0], r[1]) >= 2**60:
            return False
    return True


def _int_nodes(node):
    from attngen.maskc.ir import Type, walk

    return [n for n in walk(node) if n.type is Type.INT]


def _hoisted(i: int, program, idx: str) -> str:
    """visible() as a forward kernel's KEYED path evaluates it (mask.cuh.j2 visible_from): the reads
    hoisted_reads takes out, each row's read where kv_idx is 0 and each key's where q_idx is 0, then
    the predicate over their values."""
    rows, keys = hoisted_reads(program.ir)
    values = {n: f"rv[{j}]" for j, n in enumerate(rows)} | {n: f"kv[{j}]" for j, n in enumerate(keys)}

    def reads(nodes, zero):
        return ", ".join(f"[&] {{ const long long {zero} = 0; (void){zero}; return (long long)({read_code(n, input_ref)}); }}()"
                         for n in nodes) or "0"

    return (f"__host__ __device__ bool hoisted_{i}({idx}, const Inputs& in) {{\n"
            f"    const long long rv[] = {{{reads(rows, 'kv_idx')}}}, kv[] = {{{reads(keys, 'q_idx')}}};\n"
            f"    (void)rv; (void)kv;\n    return {point_code(program.ir, input_ref, values)};\n}}\n")


def _source(masks, mods, rects, scores, where, boundary) -> str:
    parts = ["#include <cstdio>\n", cuda_preamble(), cuda_preamble(), INPUTS_STRUCT]  # the preamble is guarded
    parts.append("__host__ __device__ inline long long wrap_index(long long i, long long n) "
                 "{ return (i % n + n) % n; }\n")
    idx = "long long q_idx, long long kv_idx, long long q_len, long long kv_len, long long b, long long h"
    box = "long long q_lo, long long q_hi, long long kv_lo, long long kv_hi, long long q_len, long long kv_len, " \
          "long long b, long long h"
    for i, program in enumerate(masks):
        parts.append(f"__host__ __device__ bool visible_{i}({idx}, const Inputs& in) {{\n"
                     f"    return {program.cuda_visible(input_ref)};\n}}\n")
        parts.append(_hoisted(i, program, idx))
        body = "\n".join("    " + line for line in program.cuda_classify(input_ref).splitlines())
        parts.append(f"__host__ __device__ int classify_{i}({box}, const Inputs& in) {{\n{body}\n}}\n")
    for j, program in enumerate(mods):
        parts.append(f"__host__ __device__ float mod_{j}(float score, {idx}, const Inputs& in) {{\n"
                     f"    return {program.cuda_expr(input_ref)};\n}}\n")
    calls = [f"visible_{i}(1, 2, 3, 4, 0, 1, in) + classify_{i}(0, 1, 0, 1, 3, 4, 0, 1, in)" for i in range(len(masks))]
    calls += [f"mod_{j}(0.5f, 1, 2, 3, 4, 0, 1, in)" for j in range(len(mods))]
    parts.append("__global__ void probe(float* out, Inputs in) {\n"
                 + "".join(f"    out[{n}] = {call};\n" for n, call in enumerate(calls)) + "}\n")
    parts.append(_array("long long", "off_values", MASK_INPUT_VALUES["off"]))
    parts.append(_array("long long", "doc_values", MASK_INPUT_VALUES["doc"]))
    parts.append(_array("float", "slope_values", SCORE_INPUT_VALUES["slope"]))
    parts.append(_array("float", "bias_values", SCORE_INPUT_VALUES["bias"]))
    parts.append(_array("long long", "configs", CONFIGS))
    parts.append(_array("long long", "rects", rects))
    parts.append(_array("float", "scores", scores))
    parts.append(_array("long long", "where", where))
    parts.append(_array("long long", "bpoints", boundary["points"]))
    parts.append(_array("float", "bscores", boundary["scores"]))
    parts.append(_array("long long", "bconfigs", BOUNDARY_CONFIGS))
    parts.append(_array("long long", "brects", boundary["rects"]))
    parts.append(_array("long long", "bclassified", boundary["classified"]))
    # per program and boundary point: 1 where the long long code would overflow (not run there)
    skips = ", ".join(f'"{s}"' for s in boundary["mask_skips"] + boundary["mod_skips"])
    parts.append(f"static const char* bskip[] = {{{skips}}};\n")
    npoints = len(boundary["points"])
    parts.append(f"typedef bool (*Visible)({idx}, const Inputs&);\ntypedef int (*Classify)({box}, const Inputs&);\n"
                 f"typedef float (*Mod)(float, {idx}, const Inputs&);\n")
    parts.append(f"static Visible visibles[] = {{{', '.join(f'visible_{i}' for i in range(len(masks)))}}};\n")
    parts.append(f"static Visible hoisteds[] = {{{', '.join(f'hoisted_{i}' for i in range(len(masks)))}}};\n")
    parts.append(f"static Classify classifies[] = {{{', '.join(f'classify_{i}' for i in range(len(masks)))}}};\n")
    parts.append(f"static Mod mods[] = {{{', '.join(f'mod_{j}' for j in range(len(mods)))}}};\n")
    parts.append(f"""
int main() {{
    const Inputs in = {{off_values, doc_values, {int_literal(MASK_INPUT_VALUES["lim"])}, slope_values, bias_values}};
    for (int i = 0; i < {len(masks)}; ++i) {{
        for (int c = 0; c < {len(CONFIGS)}; ++c) {{
            const long long* g = configs[c];
            printf("V %d %d ", i, c);
            for (long long q = 0; q < g[0]; ++q)
                for (long long k = 0; k < g[1]; ++k) putchar('0' + visibles[i](q, k, g[0], g[1], g[2], g[3], in));
            putchar('\\n');
            printf("H %d %d ", i, c);
            for (long long q = 0; q < g[0]; ++q)
                for (long long k = 0; k < g[1]; ++k) putchar('0' + hoisteds[i](q, k, g[0], g[1], g[2], g[3], in));
            putchar('\\n');
        }}
        printf("C %d ", i);
        for (int r = 0; r < {len(rects)}; ++r) {{
            const long long* x = rects[r];
            const long long* g = configs[x[0]];
            putchar('0' + classifies[i](x[1], x[2], x[3], x[4], g[0], g[1], g[2], g[3], in));
        }}
        putchar('\\n');
    }}
    for (int i = 0; i < {len(masks)}; ++i) {{
        printf("B %d ", i);
        for (int p = 0; p < {npoints}; ++p) {{
            const long long* w = bpoints[p];
            putchar(bskip[i][p] == '1' ? '-' : '0' + visibles[i](w[0], w[1], w[2], w[3], w[4], w[5], in));
        }}
        putchar('\\n');
    }}
    for (int e = 0; e < {len(boundary["classified"])}; ++e) {{
        const int i = (int)bclassified[e];
        printf("D %d ", i);
        for (int r = 0; r < {len(boundary["rects"])}; ++r) {{
            const long long* x = brects[r];
            const long long* g = bconfigs[x[0]];
            putchar('0' + classifies[i](x[1], x[2], x[3], x[4], g[0], g[1], g[2], g[3], in));
        }}
        putchar('\\n');
    }}
    for (int j = 0; j < {len(mods)}; ++j) {{
        printf("T %d", j);
        for (int p = 0; p < {npoints}; ++p) {{
            const long long* w = bpoints[p];
            if (bskip[{len(masks)} + j][p] == '1') printf(" -");
            else printf(" %.9g", mods[j](bscores[p], w[0], w[1], w[2], w[3], w[4], w[5], in));
        }}
        putchar('\\n');
    }}
    for (int j = 0; j < {len(mods)}; ++j) {{
        printf("S %d", j);
        for (int p = 0; p < {POINTS}; ++p) {{
            const long long* w = where[p];
            printf(" %.9g", mods[j](scores[p], w[0], w[1], w[2], w[3], w[4], w[5], in));
        }}
        putchar('\\n');
    }}
    return 0;
}}
""")
    return "".join(parts)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every program, the inputs it ran on, and what the compiled C++ printed, parsed."""
    r = random.Random(20240611)
    mask_texts = MASKS + [MaskExprs(r).mask() for _ in range(RANDOM_MASKS)]
    masks = [compile_mask(t) for t in mask_texts]
    mods = [compile_score_mod(t) for t in SCORE_MODS]
    mods += [compile_score_mod(ScoreExprs(r).score_mod()) for _ in range(RANDOM_SCORE_MODS)]
    mods += [m.derivative() for m in list(mods)]
    rects = _rects(r)
    scores, where = _points(r)
    rb = random.Random(20240612)  # the boundary draws: the draws above stay as they were
    points = _boundary_points(rb)
    mask_inputs, mod_inputs = wrapped(MASK_INPUT_VALUES), wrapped(SCORE_INPUT_VALUES)
    boundary = {
        "points": points, "scores": [float(np.float32(rb.uniform(-20, 20))) for _ in points],
        "rects": _boundary_rects(rb),
        "classified": [i for i, m in enumerate(masks) if _classify_is_in_range(m)],
        "mask_skips": ["".join("01"[_overflows_int64(m, p, mask_inputs)] for p in points) for m in masks],
        "mod_skips": ["".join("01"[_overflows_int64(m, p, mod_inputs)] for p in points) for m in mods],
    }
    workdir = tmp_path_factory.mktemp("maskc_cuda")
    source = workdir / "programs.cu"
    source.write_text(_source(masks, mods, rects, scores, where, boundary))
    binary = workdir / "programs"
    build = subprocess.run([find_nvcc(), "-std=c++17", "-o", str(binary), str(source)], capture_output=True, text=True,
                           timeout=300, check=False)
    assert build.returncode == 0, f"nvcc failed on {source}:\n{build.stderr[-4000:]}"
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120, check=True)
    visible, hoisted, classified, modded, bvisible, bclassified, bmodded = {}, {}, {}, {}, {}, {}, {}
    for line in run.stdout.splitlines():
        tag, *fields = line.split(" ")
        if tag == "V":
            visible[int(fields[0]), int(fields[1])] = fields[2]
        elif tag == "H":
            hoisted[int(fields[0]), int(fields[1])] = fields[2]
        elif tag == "C":
            classified[int(fields[0])] = fields[1]
        elif tag == "B":
            bvisible[int(fields[0])] = fields[1]
        elif tag == "D":
            bclassified[int(fields[0])] = fields[1]
        elif tag == "T":
            bmodded[int(fields[0])] = [None if x == "-" else float(x) for x in fields[1:]]
        else:
            modded[int(fields[0])] = [float(x) for x in fields[1:]]
    return {"masks": masks, "mask_texts": mask_texts, "mods": mods, "rects": rects, "scores": scores,
            "where": where, "visible": visible, "hoisted": hoisted, "classified": classified, "modded": modded, "source": source,
            "boundary": boundary, "bvisible": bvisible, "bclassified": bclassified, "bmodded": bmodded}


def test_visible_matches_dense(compiled):
    inputs = tensors(MASK_INPUT_VALUES, torch.int64)
    for i, program in enumerate(compiled["masks"]):
        for c, (q_len, kv_len, b, h) in enumerate(CONFIGS):
            expected = "".join("01"[v] for v in grid(program, q_len, kv_len, b, h, inputs).flatten().tolist())
            assert compiled["visible"][i, c] == expected, (program.canonical, CONFIGS[c])


def test_visible_from_hoisted_reads_matches_visible(compiled):
    """The KEYED path's predicate (rows' reads where kv_idx is 0, keys' where q_idx is 0, the rest inline)
    gives visible()'s grid for every program, those with element reads or none included."""
    assert any(any(hoisted_reads(p.ir)) for p in compiled["masks"])
    for i, program in enumerate(compiled["masks"]):
        for c in range(len(CONFIGS)):
            assert compiled["hoisted"][i, c] == compiled["visible"][i, c], (program.canonical, CONFIGS[c])


def test_cuda_classify_matches_python_classify(compiled):
    inputs = tensors(MASK_INPUT_VALUES, torch.int64)
    codes = {"empty": "0", "partial": "1", "full": "2"}
    decided = 0
    for i, program in enumerate(compiled["masks"]):
        expected = ""
        for c, q_lo, q_hi, kv_lo, kv_hi in compiled["rects"]:
            q_len, kv_len, b, h = CONFIGS[c]
            expected += codes[program.classify(q_lo, q_hi, kv_lo, kv_hi, q_len, kv_len, b, h, inputs)]
        assert compiled["classified"][i] == expected, program.canonical
        decided += sum(x != "1" for x in expected)
    assert decided > len(compiled["masks"]) * len(compiled["rects"]) // 4  # the analysis decides most tiles


def test_score_mods_and_derivatives_match_dense(compiled):
    where = torch.tensor(compiled["where"])
    scores = torch.tensor(compiled["scores"], dtype=torch.float32)
    inputs = tensors(SCORE_INPUT_VALUES, torch.float32)
    for j, program in enumerate(compiled["mods"]):
        expected = program.dense(scores, *where.unbind(1), inputs=inputs)
        got = torch.tensor(compiled["modded"][j], dtype=torch.float32)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5, msg=lambda m, p=program: f"{p.canonical}\n{m}")


def test_emitted_source_has_no_double_math(compiled):
    source = compiled["source"].read_text()
    for name in ("tanh(", "exp(", "log(", "sqrt(", "fabs(", "double"):
        assert f" {name}" not in source and f"({name}" not in source, name


def test_visible_matches_python_at_the_ends_of_the_ranges(compiled):
    """Where an int32 choice could overflow: Python's unbounded ints are the reference."""
    points = compiled["boundary"]["points"]
    inputs = wrapped(MASK_INPUT_VALUES)
    checked = 0
    for i, (text, program) in enumerate(zip(compiled["mask_texts"], compiled["masks"])):
        skip = compiled["boundary"]["mask_skips"][i]
        expected = "".join("-" if s == "1" else "01"[bool(python_value(text, *p, inputs=inputs))]
                           for p, s in zip(points, skip))
        assert compiled["bvisible"][i] == expected, (program.canonical, [
            (p, e, g) for p, e, g in zip(points, expected, compiled["bvisible"][i]) if e != g])
        checked += skip.count("0")
    assert checked > 0.9 * len(points) * len(compiled["masks"])  # few points are out of int64 reach
    for i, text in enumerate(MASKS):  # the hand-written ones stay in int64 everywhere
        assert "1" not in compiled["boundary"]["mask_skips"][i], text


def test_cuda_classify_matches_python_classify_at_the_ends_of_the_ranges(compiled):
    codes = {"empty": "0", "partial": "1", "full": "2"}
    classified = compiled["boundary"]["classified"]
    assert sorted(compiled["bclassified"]) == classified
    # every hand-written mask without inputs but the one with q_idx * q_idx (up to 2^62), and more
    left_out = [text for i, text in enumerate(MASKS) if not compiled["masks"][i].inputs and i not in classified]
    assert left_out == ["min(q_idx, kv_idx, 5) * kv_idx - q_idx * q_idx > -10"] and len(classified) > 20
    decided = 0
    for i in classified:
        program = compiled["masks"][i]
        expected = ""
        for c, q_lo, q_hi, kv_lo, kv_hi in compiled["boundary"]["rects"]:
            expected += codes[program.classify(q_lo, q_hi, kv_lo, kv_hi, *BOUNDARY_CONFIGS[c])]
        assert compiled["bclassified"][i] == expected, program.canonical
        decided += sum(x != "1" for x in expected)
    assert decided > len(classified) * len(compiled["boundary"]["rects"]) // 4


def test_score_mods_match_dense_at_the_ends_of_the_ranges(compiled):
    points = torch.tensor(compiled["boundary"]["points"])
    scores = torch.tensor(compiled["boundary"]["scores"], dtype=torch.float32)
    # dense() indexes its inputs by h; tile them so every h up to 65534 reads what wrap_index reads
    inputs = {name: torch.tensor([v[i % len(v)] for i in range(BH_MAX + 1)], dtype=torch.float32)
              for name, v in SCORE_INPUT_VALUES.items()}
    checked = 0
    for j, program in enumerate(compiled["mods"]):
        keep = torch.tensor([s == "0" for s in compiled["boundary"]["mod_skips"][j]])
        expected = program.dense(scores, *points.unbind(1), inputs=inputs)[keep]
        got = torch.tensor([g for g in compiled["bmodded"][j] if g is not None], dtype=torch.float32)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5, equal_nan=True,
                                   msg=lambda m, p=program: f"{p.canonical}\n{m}")
        checked += int(keep.sum())
    assert checked > 0.9 * len(points) * len(compiled["mods"])
