"""Where paged decode loses to the contiguous cache: the same K/V bytes in different page
arrangements, decode configs (both load paths by default), and (with --header) other versions of
flash_decode.cuh beside the working tree's, same process.

Arrangements of the decode bench's shapes (GQA 32/8, d128, bf16, one new token), GPU time from
CUDA graphs, cuDNN beside:
  contiguous      (B, S, Hkv, D)
  p64-identity    pages of 64 tokens, page i of sequence b at b * per + i (the contiguous memory)
  p64-shuffled    the bench's arrangement: pages in a random order over the pool
  p64-grouped     random order within runs of 16 pages (2 MB of memory), runs in sequence order
  p256-shuffled   pages of 256 tokens, random order (any pN-shuffled, pN-identity: pages of N tokens)
If identity is as fast as contiguous and shuffled is not, the cost is where the pages lie
(translation, DRAM), not the kernel's page-table reads; grouped then tells translation (2 MB) apart.

    git show HEAD:attngen/families/decode_sm80/flash_decode.cuh > .ab/decode-base.cuh
    PYTHONPATH=. python bench/decode_paged_probe.py [--header base=.ab/decode-base.cuh ...]
        [--configs m16n64w4s3,m16n64w4s3t] [--layouts p64-shuffled,...] [--out FILE.jsonl]

One JSON line per measurement (TB/s = K and V bytes / time)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngen
from attngen.bench_decode import HEAD_DIM, HEADS_KV, HEADS_Q, SHAPES, _copy_bandwidth, _graph_ms
from attngen.families import get_family
from attngen.families.decode_sm80 import family as decode_family
from attngen.families.decode_sm80.family import DecodeConfig
from attngen.runtime import decode as decode_runtime
from attngen.runtime import dispatch

HEADER = Path(decode_family.FOLDER, "flash_decode.cuh")
ARRANGEMENTS = ("p64-identity", "p64-shuffled", "p64-grouped", "p256-shuffled")
GROUP = 16  # pages of 64 tokens x 8 heads x 128 x 2 bytes = 128 KB: 16 of them are 2 MB


def use_header(text: str | None) -> None:
    """Build decode kernels from `text` in place of the working tree's flash_decode.cuh (None: the tree's)."""
    family = get_family("decode_sm80")
    family.render = lambda plan: (decode_family.Sm80Decode.render(family, plan) if text is None else
                                  decode_family.Sm80Decode.render(family, plan).replace(HEADER.read_text(), text))
    dispatch._kernels.clear()
    dispatch.forget()
    decode_runtime._plans.clear()
    decode_runtime._prepared.clear()


def arrange(k: torch.Tensor, v: torch.Tensor, name: str, gen: torch.Generator):
    """The caches (B, S, H, D) as pages in arrangement `name`: (k pages, v pages, page table)."""
    B, S, H, D = k.shape
    page = int(name[1:].split("-")[0])
    per = S // page
    pages = B * per
    if name.endswith("identity"):
        order = torch.arange(pages)
    elif name.endswith("grouped"):
        order = torch.cat([g0 + torch.randperm(min(GROUP, pages - g0), generator=gen)
                           for g0 in range(0, pages, GROUP)])
    else:
        order = torch.randperm(pages, generator=gen)
    order = order.cuda()
    kp, vp = (torch.empty(pages, page, H, D, dtype=k.dtype, device="cuda") for _ in range(2))
    kp[order] = k.reshape(pages, page, H, D)
    vp[order] = v.reshape(pages, page, H, D)
    return kp, vp, order.reshape(B, per).to(torch.int32)


def json_lines(sink=None):
    """emit(**row): one JSON line per measurement on stdout (floats to 4 places), and into `sink` if given."""
    def emit(**row) -> None:
        line = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()
    return emit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--header", action="append", default=[], metavar="NAME=FILE",
                        help="another version of flash_decode.cuh, measured beside the tree's (rounds alternate)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shapes", default=",".join(f"{b}x{s}" for b, s in SHAPES))
    parser.add_argument("--layouts", default=",".join(ARRANGEMENTS), help="arrangements besides contiguous")
    parser.add_argument("--configs", default="m16n64w4s3,m16n64w4s3t", help="decode_sm80 config labels")
    args = parser.parse_args()
    sink = args.out.open("w") if args.out else None
    others = [(name, Path(path).read_text()) for name, path in (h.split("=", 1) for h in args.header)]
    # Two rounds, the second in reverse order, when there is something to compare against.
    builds = [("tree", None), *others]
    rounds = builds + builds[::-1] if others else builds

    emit = json_lines(sink)
    specs = {label: attngen.AttentionSpec(head_dim=HEAD_DIM, gqa_ratio=HEADS_Q // HEADS_KV, family="decode_sm80",
                                          config=DecodeConfig.from_label(label).to_dict())
             for label in args.configs.split(",")}
    emit(gpu=torch.cuda.get_device_name(0), copy_tbps=_copy_bandwidth())
    for shape in args.shapes.split(","):
        batch, seqlen = map(int, shape.split("x"))
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
        nbytes = 2 * k.numel() * 2
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        emit(shape=shape, impl="cudnn", tbps=nbytes / _graph_ms(cudnn) / 1e9)
        # Each config's answer on the contiguous cache: every arrangement and build must give it bit for bit.
        expected = {label: attngen.decode(q, k, v, lens, spec=spec) for label, spec in specs.items()}
        for name in ("contiguous", *args.layouts.split(",")):
            kc, vc, table = (k, v, None) if name == "contiguous" else arrange(k, v, name, gen)
            for label, spec in specs.items():
                for build, text in rounds:
                    use_header(text)
                    fn = lambda: attngen.decode(q, kc, vc, lens, page_table=table, spec=spec)  # noqa: E731
                    same = bool(torch.equal(fn(), expected[label]))
                    emit(shape=shape, layout=name, config=label, build=build, same_as_contiguous=same,
                         tbps=nbytes / _graph_ms(fn) / 1e9)
            del kc, vc, table
        use_header(None)
        del k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
