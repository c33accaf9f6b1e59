"""Same-process A/B of fwd_sm90's tile schedules (grid, pairs, dynamic; dynamic also with sections of
one head, "-hm") on the issue's masks and shapes, cuDNN beside where it runs the same problem.

    PYTHONPATH=. python bench/schedule_probe.py      (on an H100; docs/perf-notes.md "Tile schedules")

Prints one line per point: milliseconds and TFLOP/s (visible pairs only for masks)."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attngen
from attngen.bench import input_sets, time_ms
from attngen.bench_masks import WINDOW, _document_ids
from attngen.families.fwd_sm90 import family as sm90
from attngen.flops import forward_flops
from attngen.runtime import dispatch
from attngen.spec import AttentionSpec

VARIANTS = [("pairs", "m128n128s2opr", None), ("dyn", "m128n128s2opd", None), ("dyn-hm", "m128n128s2opd", 1),
            ("grid", "m128n128s2op", None)]
DOC = "doc[b, q_idx] == doc[b, kv_idx] and causal"


def cfg(label):
    return sm90.Sm90Config.from_label(label).to_dict()


def run_point(name, d, mask, B, S, H, Hkv, extra=None, pairs=None, variants=VARIANTS):
    sets = input_sets(B, S, H, d, kv_heads=Hkv)
    flops = pairs * 4 * d * H * B if pairs else forward_flops(B, H, S, S, d, mask == "causal")
    line = [name]
    if mask in ("causal", "none"):
        def cudnn(q, k, v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=mask == "causal", enable_gqa=H != Hkv)
        line.append(f"cuDNN {flops / time_ms(cudnn, sets) / 1e9:.0f}")
    for vname, label, section in variants:
        sm90.L2_SECTION_BYTES = section or (25 << 20)
        dispatch.forget()
        spec = AttentionSpec(head_dim=d, mask=mask, gqa_ratio=H // Hkv, family="fwd_sm90", config=cfg(label))
        ms = time_ms(lambda q, k, v: attngen.attention(q, k, v, spec, inputs=extra), sets)
        line.append(f"{vname} {ms:.3f}ms {flops / ms / 1e9:.0f}")
    sm90.L2_SECTION_BYTES = 25 << 20
    print("  ".join(line), flush=True)


def main() -> None:
    with torch.no_grad():
        ids, lengths = _document_ids()
        doc_pairs = int(sum(n * (n + 1) // 2 for n in lengths.tolist()))
        run_point("documents", 128, DOC, 1, 16384, 16, 16, {"doc": ids.cuda()}, pairs=doc_pairs)
        wpairs = sum(min(i + 1, WINDOW) for i in range(16384))
        run_point("window4096", 128, f"sliding_window({WINDOW - 1}, 0)", 1, 16384, 16, 16, pairs=wpairs)
        run_point("causal16k", 128, "causal", 1, 16384, 16, 16)
        run_point("gqa8k", 128, "causal", 2, 8192, 32, 8)
        run_point("causal2k", 128, "causal", 8, 2048, 16, 16)
        run_point("none2k", 128, "none", 8, 2048, 16, 16)
        d64 = [("grid192", "m192n128s2op", None), ("dyn192", "m192n128s2opd", None), ("dyn192-hm", "m192n128s2opd", 1)]
        run_point("d64causal2k", 64, "causal", 8, 2048, 32, 32, variants=d64)
        run_point("d64none2k", 64, "none", 8, 2048, 32, 32, variants=d64 + [("pairs192", "m192n128s2opr", None)])
        d64 = [("grid192", "m192n128s2op", None), ("dyn192", "m192n128s2opd", None),
               ("pairs192", "m192n128s2opr", None)]
        run_point("d64none8k", 64, "none", 2, 8192, 32, 32, variants=d64)
        run_point("d64none16k", 64, "none", 1, 16384, 32, 32, variants=d64)
        run_point("d64causal16k", 64, "causal", 1, 16384, 32, 32, variants=d64)
        run_point("d64causal4k", 64, "causal", 4, 4096, 32, 32, variants=d64)


if __name__ == "__main__":
    main()
