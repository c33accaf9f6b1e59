"""Same-process A/B of two versions of fwd_sm90's kernel (its headers; bench/sm90_versions.py says what a
version is and where one is read from): the working tree's against another (say the last commit's), on
the shapes where per-tile costs show, with cuDNN beside. Rounds alternate the two builds so clock and power
drift fall on both. With --configs, the working tree's configs against each other instead (the default
choices; "q2": at most two Q buffers).

    PYTHONPATH=. python bench/sm90_ab_probe.py --base git:HEAD [--rounds 2] [CASE ...]
    PYTHONPATH=. python bench/sm90_ab_probe.py --base git:HEAD --variant b=.ab/b/ [CASE ...]   (three builds)
    PYTHONPATH=. python bench/sm90_ab_probe.py --ordinary [--rounds 2] [CASE ...]   (early launch behind set-up, or not)
    PYTHONPATH=. python bench/sm90_ab_probe.py --configs [--labels L1,L2] [--rounds 2] [CASE ...]

On the device (no git history there): `python bench/sm90_versions.py git:HEAD > .ab/base.cuh` here, then
--base .ab/base.cuh. One line per case: milliseconds and TFLOP/s (visible pairs only for masks) per round
and build."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngen
from attngen.bench import input_sets, time_ms
from attngen.bench_masks import WINDOW, _document_ids
from attngen.families import get_family
from attngen.families.fwd_sm90 import family as sm90
from attngen.flops import forward_flops
from attngen.spec import AttentionSpec

import sm90_versions as versions

# name -> (head_dim, mask, batch, seqlen, heads, kv_heads, config label or None for the default)
DENSE = {
    "d128-causal-512": (128, "causal", 32, 512, 16, 16, None),
    "d128-causal-2k": (128, "causal", 8, 2048, 16, 16, None),
    "d128-causal-1k": (128, "causal", 16, 1024, 16, 16, None),
    "d128-none-2k": (128, "none", 8, 2048, 16, 16, None),
    "d128-causal-16k": (128, "causal", 1, 16384, 16, 16, None),
    "d128-none-2k-n176": (128, "none", 8, 2048, 16, 16, "m128n176s2opr"),
    "d128-none-2k-n128": (128, "none", 8, 2048, 16, 16, "m128n128s2opr"),
    "d128-none-8k-n176": (128, "none", 2, 8192, 16, 16, "m128n176s2opr"),
    "d128-none-8k-n128": (128, "none", 2, 8192, 16, 16, "m128n128s2opr"),
    "d128-none-8k-n160": (128, "none", 2, 8192, 16, 16, "m128n160s2opr"),
    "d128-none-16k-n160": (128, "none", 1, 16384, 16, 16, "m128n160s2opr"),
    "d128-none-2k-n160c": (128, "none", 8, 2048, 16, 16, "m128n160s2oprc"),  # clusters of two CTAs
    "d128-none-8k-n160c": (128, "none", 2, 8192, 16, 16, "m128n160s2oprc"),
    "d128-none-16k-n160c": (128, "none", 1, 16384, 16, 16, "m128n160s2oprc"),
    "d128-none-8k-n128c": (128, "none", 2, 8192, 16, 16, "m128n128s2oprc"),
    "d128-none-8k-n160-nopp": (128, "none", 2, 8192, 16, 16, "m128n160s2or"),
    "d128-none-8k-n128s3": (128, "none", 2, 8192, 16, 16, "m128n128s3opr"),  # three stages, one Q buffer
    "d128-none-8k-n128s3c": (128, "none", 2, 8192, 16, 16, "m128n128s3oprc"),
    "d128-none-8k-n160c-nopp": (128, "none", 2, 8192, 16, 16, "m128n160s2orc"),
    "d256-none-16k-r": (256, "none", 1, 16384, 8, 8, "m128n80s2or"),
    "d256-none-16k-rc": (256, "none", 1, 16384, 8, 8, "m128n80s2orc"),
    "d256-none-16k-p": (256, "none", 1, 16384, 8, 8, "m128n80s2op"),  # pingpong: the softmax between turns
    "d64-causal-2k-m128dyn": (64, "causal", 8, 2048, 32, 32, "m128n128s2opd"),
    "d64-causal-4k-m128dyn": (64, "causal", 4, 4096, 32, 32, "m128n128s2opd"),
    "d64-none-8k": (64, "none", 2, 8192, 32, 32, None),
    "d64-causal-8k": (64, "causal", 2, 8192, 32, 32, None),
    "d64-causal-4k": (64, "causal", 4, 4096, 32, 32, None),
    "d64-none-16k": (64, "none", 1, 16384, 32, 32, None),
    "d128-none-8k": (128, "none", 2, 8192, 16, 16, None),
    "d128-none-16k": (128, "none", 1, 16384, 16, 16, None),
    "d128-causal-8k": (128, "causal", 2, 8192, 16, 16, None),
    "d256-none-16k": (256, "none", 1, 16384, 8, 8, None),
    "d64-causal-16k": (64, "causal", 1, 16384, 32, 32, None),
    "d256-causal-16k": (256, "causal", 1, 16384, 8, 8, None),
    "d256-none-4k": (256, "none", 4, 4096, 8, 8, None),
    "d256-causal-4k": (256, "causal", 4, 4096, 8, 8, None),
    "d256-none-2k": (256, "none", 8, 2048, 8, 8, None),
    "d256-causal-2k": (256, "causal", 8, 2048, 8, 8, None),
    "d256-causal-8k": (256, "causal", 2, 8192, 8, 8, None),
    "d64-causal-2k-grid": (64, "causal", 8, 2048, 32, 32, "m192n128s2op"),
    "d64-causal-2k-pairs": (64, "causal", 8, 2048, 32, 32, "m192n128s2opr"),
    "d64-causal-2k-dyn": (64, "causal", 8, 2048, 32, 32, "m192n128s2opd"),
    "d64-causal-4k-pairs": (64, "causal", 4, 4096, 32, 32, "m192n128s2opr"),
    "d64-causal-4k-dyn": (64, "causal", 4, 4096, 32, 32, "m192n128s2opd"),
    "d64-none-2k": (64, "none", 8, 2048, 32, 32, None),
    "d64-causal-2k": (64, "causal", 8, 2048, 32, 32, None),
    "d64-causal-3k": (64, "causal", 4, 3072, 32, 32, None),  # 16 blocks of 192 rows: no idle warpgroup
    "gqa-causal-8k": (128, "causal", 2, 8192, 32, 8, None),
    "window4096-16k": (128, f"sliding_window({WINDOW - 1}, 0)", 1, 16384, 16, 16, None),
}


# Configs for the packed documents (varlen: the dynamic schedule only).
DOCUMENT_CONFIGS = ["m128n128s2opd", "m128n64s2opd", "m128n128s3opd", "m192n128s2opd", "m128n128s2od",
                    "m128n128s2opd/q2", "m128n96s3opd"]  # n96s3: three stages of K and of V beside two Q buffers

# name -> (head_dim, mask, batch, seqlen, heads, kv_heads, [config label, optionally + "/q2"])
CONFIGS = {
    "d64-causal-2k": (64, "causal", 8, 2048, 32, 32, ["m192n128s2op", "m192n128s2opd", "m192n128s2opr",
                                                      "m192n128s3opd", "m128n128s2opd", "m192n64s3opd"]),
    "d64-causal-4k": (64, "causal", 4, 4096, 32, 32, ["m192n128s2op", "m192n128s2opd", "m192n128s2opr",
                                                      "m192n128s3opd", "m128n128s2opd", "m192n64s3opd"]),
    "d64-causal-16k": (64, "causal", 1, 16384, 32, 32, ["m192n128s2op", "m192n128s2opd", "m192n128s2opr"]),
    "d128-none-2k": (128, "none", 8, 2048, 16, 16, ["m128n176s2opr", "m128n160s2opr", "m128n128s2opr", "m128n128s2opr/q2"]),
    "d128-none-4k": (128, "none", 4, 4096, 16, 16, ["m128n176s2opr", "m128n160s2opr", "m128n128s2opr"]),
    "d128-none-16k": (128, "none", 1, 16384, 16, 16, ["m128n176s2opr", "m128n160s2opr", "m128n128s2opr"]),
    "d128-causal-2k": (128, "causal", 8, 2048, 16, 16, ["m128n128s2opr", "m128n128s2opr/q2", "m128n128s2opd",
                                                        "m128n128s2op", "m128n128s3op"]),
    "d256-none-16k": (256, "none", 1, 16384, 8, 8, ["m128n80s2o", "m128n64s2o", "m128n80s2or"]),
    "d128-causal-512": (128, "causal", 32, 512, 16, 16, ["m128n128s2opr", "m128n128s2opr/q2", "m128n128s2op"]),
    "d128-causal-1k": (128, "causal", 16, 1024, 16, 16, ["m128n128s2opr", "m128n128s2opr/q2", "m128n128s2opd",
                                                         "m128n128s2op"]),
    "d128-none-512": (128, "none", 32, 512, 16, 16, ["m128n160s2opr", "m128n176s2opr", "m128n128s2opr"]),
    # Short sequences, the defaults against the smaller tiles (the bench's shapes: 16k tokens, hidden 2048).
    "d128-none-512s": (128, "none", 32, 512, 16, 16, ["m128n160s2oprc", "m128n128s2opr", "m128n128s2oprc",
                                                      "m128n128s2opd", "m128n64s3opd"]),
    "d128-none-1ks": (128, "none", 16, 1024, 16, 16, ["m128n160s2oprc", "m128n128s2opr", "m128n128s2oprc",
                                                      "m128n128s2opd"]),
    "d128-causal-512s": (128, "causal", 32, 512, 16, 16, ["m128n128s2opr", "m128n128s2opd", "m128n64s3opd",
                                                          "m128n64s2opr"]),
    "d64-causal-512": (64, "causal", 32, 512, 32, 32, ["m192n128s2opd", "m128n128s2opd", "m128n64s3opd",
                                                       "m128n128s2opr", "m192n64s3opd"]),
    "d64-causal-1k": (64, "causal", 16, 1024, 32, 32, ["m192n128s2opd", "m128n128s2opd", "m128n64s3opd",
                                                       "m128n128s2opr"]),
    "d64-none-512": (64, "none", 32, 512, 32, 32, ["m192n128s2opd", "m128n128s2opd", "m192n128s2opr",
                                                   "m128n128s2opr"]),
}


def shape_case(d, mask, batch, seqlen, heads, kv_heads):
    """Input sets past L2 and the forward FLOPs of one shape (visible pairs only for a window)."""
    sets = input_sets(batch, seqlen, heads, d, kv_heads=kv_heads)
    if mask.startswith("sliding_window"):
        flops = sum(min(i + 1, WINDOW) for i in range(seqlen)) * 4 * d * heads * batch
    else:
        flops = forward_flops(batch, heads, seqlen, seqlen, d, mask == "causal")
    return sets, flops


def runner(d, mask, heads, kv_heads, label):
    """attngen on fwd_sm90 with the config `label` (None: the default; a "/q2" suffix is the caller's)."""
    config = sm90.Sm90Config.from_label(label.split("/")[0]).to_dict() if label else None
    spec = AttentionSpec(head_dim=d, mask=mask, gqa_ratio=heads // kv_heads, family="fwd_sm90", config=config)
    return lambda q, k, v: attngen.attention(q, k, v, spec)


def cudnn_call(mask, heads, kv_heads):
    """SDPA's cuDNN backend on BSHD tensors (BHSD views), the peer of a dense case."""
    def call(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=mask == "causal", enable_gqa=heads != kv_heads)
    return call


def cudnn_ms(mask, heads, kv_heads, sets):
    return time_ms(cudnn_call(mask, heads, kv_heads), sets)


def compare_configs(names, rounds, only=None):
    for name in names:
        if name == "documents":  # attention_varlen takes no spec: its default config is swapped in
            run_with, sets, flops, _ = documents_case()
            line = [f"{name:16s}"]
        else:
            d, mask, batch, seqlen, heads, kv_heads, labels = CONFIGS[name]
            sets, flops = shape_case(d, mask, batch, seqlen, heads, kv_heads)
            ref = cudnn_ms(mask, heads, kv_heads, sets)
            line = [f"{name:16s}", f"cuDNN {ref:.3f}ms {flops / ref / 1e9:4.0f}"]
        labels = DOCUMENT_CONFIGS if name == "documents" else labels
        labels = [label for label in labels if only is None or label in only]
        for r in range(rounds):
            for label in labels if r % 2 == 0 else labels[::-1]:
                sm90.Q_BUFFERS_MAX = 2 if label.endswith("/q2") else 3
                versions.use(None)
                if name == "documents":
                    config = sm90.Sm90Config.from_label(label.split("/")[0])
                    get_family("fwd_sm90").default_config = lambda problem, target, seqlen=None, config=config: config
                    ms = time_ms(run_with, sets)
                    del get_family("fwd_sm90").default_config
                else:
                    ms = time_ms(runner(d, mask, heads, kv_heads, label), sets)
                line.append(f"{label} {ms:.3f}ms {flops / ms / 1e9:4.0f}")
        print("  ".join(line), flush=True)
    sm90.Q_BUFFERS_MAX = 3


def dense_case(name):
    d, mask, batch, seqlen, heads, kv_heads, label = DENSE[name]
    sets, flops = shape_case(d, mask, batch, seqlen, heads, kv_heads)
    run = runner(d, mask, heads, kv_heads, label)

    def cudnn():
        return cudnn_ms(mask, heads, kv_heads, sets) if mask in ("none", "causal") else None
    return run, sets, flops, cudnn


# name -> (head_dim, mask, batch, seqlen, heads, log2 rise of every row's scores per 128 keys): the keys'
# scores climb along the sequence, so a row's max passes its reference by more than RESCALE_SLACK (8) at
# every block from a rise of ~7 up (softmax.cuh speculative_softmax then takes each block's exps
# twice: its worst case) and never after the first block below ~5.
RISING = {
    "d128-none-8k-rise3": (128, "none", 2, 8192, 16, 3.0),
    "d128-none-8k-rise12": (128, "none", 2, 8192, 16, 12.0),
    "d128-causal-8k-rise12": (128, "causal", 2, 8192, 16, 12.0),
}


def rising_case(name):
    d, mask, batch, seqlen, heads, rise = RISING[name]
    q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda") for _ in range(3))
    climb = rise * torch.arange(seqlen, device="cuda") / 128  # log2 units of the scaled score
    logit = climb / 1.4426950408889634 * d ** 0.5  # q.k before the softmax scale
    k = k * 0.05 + logit[None, :, None, None] / d  # q ~ 1 along every dim: q.k ~ logit
    q = q * 0.05 + 1.0
    sets = [tuple(t.to(torch.bfloat16) for t in (q, k, v))]
    flops = forward_flops(batch, heads, seqlen, seqlen, d, mask == "causal")
    run = runner(d, mask, heads, heads, None)
    return run, sets, flops, lambda: cudnn_ms(mask, heads, heads, sets)


def documents_case():
    ids, lengths = _document_ids()
    q, k, v = (torch.randn(16384, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).cuda()
    flops = int(sum(n * (n + 1) // 2 for n in lengths.tolist())) * 4 * 128 * 16
    run = lambda q, k, v: attngen.attention_varlen(q, k, v, cu, cu, mask="causal")  # noqa: E731
    return run, [(q, k, v)], flops, lambda: None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", metavar="VERSION",
                        help="the other version of the kernel: git:REV, a directory of its headers or a file "
                             "(bench/sm90_versions.py)")
    parser.add_argument("--variant", action="append", default=[], type=versions.named, metavar="NAME=VERSION",
                        help="with --base: one more version of the kernel, timed in the same rounds")
    parser.add_argument("--ordinary", action="store_true",
                        help="the working tree's kernels launched early behind their set-up kernel (family.py "
                             "EARLY_AFTER_SETUP) against the ordinary launch")
    parser.add_argument("--configs", action="store_true",
                        help="compare the working tree's configs (CONFIGS; documents: DOCUMENT_CONFIGS)")
    parser.add_argument("--labels", type=lambda text: text.split(","), metavar="LABEL,...",
                        help="with --configs: only these of each case's configs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("cases", nargs="*")
    args = parser.parse_args()
    if args.configs:
        names = args.cases or list(CONFIGS)
        unknown = [n for n in names if n != "documents" and n not in CONFIGS]
        if unknown:
            parser.error(f"--configs cases {unknown} are not in CONFIGS; allowed: documents, {', '.join(CONFIGS)}")
        offered = {label for n in names for label in (DOCUMENT_CONFIGS if n == "documents" else CONFIGS[n][6])}
        if args.labels and (missing := [label for label in args.labels if label not in offered]):
            parser.error(f"--labels {missing} are none of these cases' configs; allowed: {', '.join(sorted(offered))}")
        with torch.no_grad():
            return compare_configs(names, args.rounds, args.labels)
    if args.base is None and not args.ordinary:
        parser.error("--base VERSION, --ordinary or --configs")
    # Builds, rounds alternating: (name, version or None for the tree's, early launch behind set-up).
    variants = tuple((name, versions.load(source), True) for name, source in args.variant)
    builds = (("base", versions.load(args.base), True), *variants, ("new", None, True)) if args.base else \
        (("ordinary", None, False), ("early", None, True))
    names = args.cases or ["documents", *DENSE, *RISING]
    torch.manual_seed(0)
    with torch.no_grad():
        for name in names:
            run, sets, flops, cudnn = documents_case() if name == "documents" else \
                rising_case(name) if name in RISING else dense_case(name)
            ref_ms = cudnn()
            line = [f"{name:20s}"] + ([f"cuDNN {ref_ms:.3f}ms {flops / ref_ms / 1e9:4.0f}"] if ref_ms else [])
            for r in range(args.rounds):
                for build, version, early in builds if r % 2 == 0 else builds[::-1]:
                    sm90.EARLY_AFTER_SETUP = early
                    versions.use(version)
                    ms = time_ms(run, sets)
                    line.append(f"{build} {ms:.3f}ms {flops / ms / 1e9:4.0f}")
            print("  ".join(line), flush=True)
    sm90.EARLY_AFTER_SETUP = True
    versions.use(None)


if __name__ == "__main__":
    main()
