"""How much of a persistent forward's time is its last, partly filled round of tiles (wave quantization).

A persistent grid with one CTA per SM works through T equal tiles in ceil(T / SMs) rounds; where T is
not a multiple of the SM count the last round leaves SMs idle. Same shape per head, head counts chosen
so the tile count is just under and exactly at a multiple of the SMs: if the tail costs what the round
count says, TFLOP/s rises with the fill of the last round (and falls back to the same at whole rounds).
cuDNN beside, timed in turn (time_beside), so both see the same clocks.

    PYTHONPATH=. python bench/wave_probe.py [--label m128n160s2opr] [B,S,H ...]
"""
from __future__ import annotations

import argparse

import torch

import attngen
from attngen.bench import input_sets, time_beside
from attngen.families.fwd_sm90 import family as sm90
from attngen.flops import forward_flops
from attngen.spec import AttentionSpec

import sm90_ab_probe as ab

DEFAULT_SHAPES = ["1,16384,16", "1,16384,32", "1,16384,33", "2,8192,16", "2,8192,33", "8,2048,16", "8,2048,33"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default=None, help="fwd_sm90 config label (default: the family's default)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("shapes", nargs="*", default=DEFAULT_SHAPES, help="B,S,H")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    d = args.head_dim
    config = sm90.Sm90Config.from_label(args.label).to_dict() if args.label else None
    spec = AttentionSpec(head_dim=d, mask="none", family="fwd_sm90", config=config)
    with torch.no_grad():
        for shape in args.shapes:
            b, s, h = (int(x) for x in shape.split(","))
            sets = input_sets(b, s, h, d)
            flops = forward_flops(b, h, s, s, d, False)
            fns = {"attngen": lambda q, k, v: attngen.attention(q, k, v, spec),
                   "cudnn": ab.cudnn_call("none", h, h)}
            ms, errors = time_beside(fns, sets)
            tiles = b * h * (-(-s // 128))
            line = f"B={b} S={s} H={h} tiles={tiles} rounds={tiles / sms:.3f}"
            for name, t in ms.items():
                line += f"  {name} {t:.3f}ms {flops / t / 1e9:4.0f}"
            if len(ms) == 2:
                line += f"  ratio {ms['cudnn'] / ms['attngen']:.3f}"
            print(line, errors or "", flush=True)


if __name__ == "__main__":
    main()
