"""Probe a kernel family on this GPU: every listed config against the float64 reference, each in its
own process under a timeout (a hang or a sticky CUDA error stays contained), then a short timing
of each head dim's default beside torch SDPA's flash and cuDNN backends.

    python bench/family_probe.py fwd_sm90 [--configs m128n128s2op,m128n128s2] [--time] [--out DIR]

Outputs start as NaN (an unwritten element fails), shapes include odd lengths, Sq != Sk, GQA and
strided (transposed) inputs; bounds are attngen.tolerance's. Prints one line per (spec, shape) and
a table last; with --out, writes the results as JSON there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (B, Sq, Sk, Hkv, transposed)
SHAPES = [(1, 1, 1, 1, False), (2, 17, 129, 2, False), (1, 127, 127, 2, True), (1, 1000, 1000, 1, False),
          (2, 300, 40, 1, False), (1, 129, 4097, 1, True), (1, 4097, 4097, 1, False), (3, 513, 700, 2, True)]
LOGIT_SCALES = (1.0, 30.0)
TIMING = [(64, False), (64, True), (128, False), (128, True), (256, True)]
TIMING_SEQS = (2048, 8192, 16384)


def check_one(spec_key: str) -> list[dict]:
    """In a child process: one spec over SHAPES at unit logits and at logits near 1e3; a list of
    {shape, logit_scale, ok, detail}."""
    import torch

    import attngen
    from attngen import reference, tolerance
    from attngen.spec import AttentionSpec

    spec = AttentionSpec.from_key(spec_key)
    kernel = attngen.compile(spec)
    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[spec.dtype])
    results = []
    for (B, Sq, Sk, Hkv, transposed), logit_scale in ((shape, ls) for ls in LOGIT_SCALES for shape in SHAPES):
        gen = torch.Generator(device="cuda").manual_seed(Sq * 131 + Sk)
        Hq = Hkv * spec.gqa_ratio

        def rand(S, H, scale):
            shape = (B, H, S, spec.head_dim) if transposed else (B, S, H, spec.head_dim)
            x = (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype)
            return x.transpose(1, 2) if transposed else x

        q, k, v = rand(Sq, Hq, logit_scale), rand(Sk, Hkv, logit_scale), rand(Sk, Hkv, 1.0)
        out = torch.full((B, Sq, Hq, spec.head_dim), float("nan"), device="cuda", dtype=dtype)
        lse = torch.full((B, Hq, Sq), float("nan"), device="cuda", dtype=torch.float32)
        t0 = time.perf_counter()
        kernel(q, k, v, out=out, lse=lse)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        ref, ref_lse = reference.attention_for_spec(q, k, v, spec, return_lse=True)
        bad = (tolerance.check_output(out, ref, q, k, v, spec.dtype, spec.effective_scale)
               or tolerance.check_lse(lse, ref_lse, q, k, spec.effective_scale))
        results.append({"shape": [B, Sq, Sk, Hq, Hkv, transposed], "logit_scale": logit_scale, "ok": bad is None,
                        "detail": "" if bad is None else str(bad), "first_ms": round(ms, 3)})
    return results


def run_checks(specs, timeout: float) -> list[dict]:
    rows = []
    for spec in specs:
        if True:
            cmd = [sys.executable, __file__, "--child", spec.key()]
            start = time.monotonic()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ)
                tail = (proc.stdout + proc.stderr).strip().splitlines()
                if proc.returncode == 0:
                    results = json.loads(tail[-1])
                    bad = [r for r in results if not r["ok"]]
                    status = "ok" if not bad else (f"FAILED {len(bad)}/{len(results)}: {bad[0]['shape']} logits~"
                                                   f"{bad[0]['logit_scale']:g} {bad[0]['detail']}")
                else:
                    status = "ERROR: " + " | ".join(tail[-4:])[-600:]
            except subprocess.TimeoutExpired:
                status = f"TIMEOUT after {timeout:.0f} s (a hang: mbarrier or named-barrier deadlock?)"
            row = {"spec": spec.to_dict(), "name": spec.name, "status": status,
                   "seconds": round(time.monotonic() - start, 1)}
            print(f"{row['name']}: {status} ({row['seconds']} s)", flush=True)
            rows.append(row)
    return rows


def run_timing(family: str) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen.bench import input_sets, time_ms
    from attngen.flops import forward_flops
    from attngen.spec import AttentionSpec

    rows = []
    for d, causal in TIMING:
        for s in TIMING_SEQS:
            batch, heads = 16384 // s, 2048 // d
            sets = input_sets(batch, s, heads, d)
            flops = forward_flops(batch, heads, s, s, d, causal)
            row = {"d": d, "causal": causal, "seqlen": s}
            for name, fam in (("attngen", family), ("sm80", "fwd_sm80")):
                kernel = attngen.compile(AttentionSpec(head_dim=d, mask="causal" if causal else "none", family=fam))
                row[name] = flops / (time_ms(lambda q, k, v: kernel(q, k, v), sets) * 1e-3) / 1e12
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                def run(q, k, v, backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                              is_causal=causal)
                try:
                    row[name] = flops / (time_ms(run, sets) * 1e-3) / 1e12
                except Exception as exc:  # noqa: BLE001 - a missing peer is recorded
                    row[name] = None
                    row[f"{name}_error"] = str(exc)[:200]
            rows.append(row)
            fmt = lambda x: "-" if x is None else f"{x:6.1f}"  # noqa: E731
            print(f"d{d} {'causal' if causal else 'none  '} s{s:<6} {family} {fmt(row['attngen'])}  fwd_sm80 "
                  f"{fmt(row['sm80'])}  FA2 {fmt(row['flash'])}  cuDNN {fmt(row['cudnn'])}  vs cuDNN "
                  f"{row['attngen'] / row['cudnn']:.2f}x" if row.get("cudnn") else "", flush=True)
            del sets
            torch.cuda.empty_cache()
    return rows


def run_sweep(family, labels: list[str], points: list[str], variants: list[str] = ("",)) -> list[dict]:
    """TFLOP/s of each config label at each point, beside cuDNN, in this process; each label once per
    variant: `NAME=VALUE[,NAME=VALUE]` settings of the family module's host-side constants."""
    import ast
    import re

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen.bench import input_sets, time_ms
    from attngen.errors import SpecError
    from attngen.flops import forward_flops
    from attngen.spec import AttentionSpec

    rows = []
    for point in points:
        d, kind, s = re.fullmatch(r"d(\d+)([cn])(\d+)", point).groups()
        d, causal, s = int(d), kind == "c", int(s)
        batch, heads = 16384 // s, 2048 // d
        sets = input_sets(batch, s, heads, d)
        flops = forward_flops(batch, heads, s, s, d, causal)

        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=causal)
        peer = flops / (time_ms(cudnn, sets) * 1e-3) / 1e12
        line = [f"{point}: cuDNN {peer:.1f}"]
        module = sys.modules[type(family).__module__]
        for label, variant in ((label, variant) for label in labels for variant in variants):
            settings = dict(item.split("=", 1) for item in variant.split(",") if item)
            saved = {name: getattr(module, name) for name in settings}
            name = label + (f"[{variant}]" if variant else "")
            config = type(family.default_config(AttentionSpec(head_dim=d).problem, _target())).from_label(label)
            try:
                for key, value in settings.items():
                    setattr(module, key, ast.literal_eval(value))
                spec = AttentionSpec(head_dim=d, mask="causal" if causal else "none", family=family.name,
                                     config=config.to_dict())
                kernel = attngen.compile(spec)
                tf = flops / (time_ms(lambda q, k, v: kernel(q, k, v), sets) * 1e-3) / 1e12
            except (SpecError, ValueError) as exc:
                line.append(f"{name} -")
                print(f"  {name}: {exc}", flush=True)
                continue
            finally:
                for key, value in saved.items():
                    setattr(module, key, value)
            rows.append({"point": point, "label": label, "variant": variant, "tflops": tf, "cudnn": peer})
            line.append(f"{name} {tf:.1f} ({tf / peer:.2f}x)")
        print("  ".join(line), flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", nargs="?")
    parser.add_argument("--configs", default="", help="comma-separated config labels (default: each head dim's default)")
    parser.add_argument("--head-dims", default="64,96,128,256")
    parser.add_argument("--time", action="store_true", help="also time each head dim's default against peers")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--sweep", default="", help="time these config labels at --points (e.g. m128n128s2opr,...)")
    parser.add_argument("--points", default="d128c2048,d128n8192", help="d<head dim><c|n><seqlen>,...")
    parser.add_argument("--variants", default="", help="';'-separated NAME=VALUE[,NAME=VALUE] settings of the family "
                        "module's constants, each label timed under each (empty: as is)")
    parser.add_argument("--no-check", action="store_true", help="skip the reference checks")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(check_one(args.child)))
        return
    from attngen import families
    from attngen.spec import AttentionSpec

    family = families.get_family(args.family)
    specs = []
    for d in (int(x) for x in args.head_dims.split(",")):
        for mask, dtype, gqa in (("causal", "bf16", 1), ("none", "fp16", 2)):
            base = AttentionSpec(head_dim=d, dtype=dtype, gqa_ratio=gqa, mask=mask, family=family.name)
            labels = [c for c in args.configs.split(",") if c]
            if not labels:
                specs.append(base)
            for label in labels:
                config = type(family.default_config(base.problem, _target())).from_label(label)
                specs.append(base.replace(config=config.to_dict()))
    rows = [] if args.no_check else run_checks(specs, args.timeout)
    timing = run_timing(family.name) if args.time else []
    if args.sweep:
        timing += run_sweep(family, [c for c in args.sweep.split(",") if c], args.points.split(","),
                            args.variants.split(";") if args.variants else [""])
    failed = [r for r in rows if r["status"] != "ok"]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} spec runs passed" + (f"; failed: {[r['name'] for r in failed]}"
                                                                      if failed else ""))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"probe-{family.name}.json").write_text(json.dumps({"checks": rows, "timing": timing}, indent=1))
    sys.exit(1 if failed else 0)


def _target():
    from attngen import targets

    return targets.target("sm_90")


if __name__ == "__main__":
    main()
