"""`attngen bench --backward`: training attention, forward + backward, in the FlashAttention papers'
setup (batch x seqlen = 16k tokens, hidden 2048, bf16), d64 and d128, causal and not, 2k..16k;
attngen through the front door (attention(), then torch.autograd.grad) against torch SDPA's flash
(FlashAttention-2) and cuDNN backends in the same process. TFLOP/s counted as the papers do: the
forward's 4*B*H*S^2*D (halved when causal), the backward 2.5 times that. Also the peak memory of
forward + backward at 4k, 16k and 64k tokens (one sequence), which must grow linearly.
Besides the default: attngen with deterministic=True, and the family that runs it (bwd_sm80)
without it, so the ordering's own cost shows.
Writes backward-<gpu>-<date>.json and .png."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from attngen.bench_decode import _time_ms

SEQLENS = (2048, 8192, 16384)
HEAD_DIMS = (64, 128)
TOKENS, HIDDEN = 16384, 2048
MEMORY_SEQLENS = (4096, 16384, 65536)
REPEATS = 10


def _flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> float:
    return 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)


def bench_case(seqlen: int, head_dim: int, causal: bool) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen

    batch, heads = TOKENS // seqlen, HIDDEN // head_dim
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    mask = "causal" if causal else "none"

    def ours_fwd():
        with torch.no_grad():
            attngen.attention(q, k, v, mask=mask)

    def ours_both():
        torch.autograd.grad(attngen.attention(q, k, v, mask=mask), (q, k, v), dout)

    def ours_both_deterministic():  # dQ added in key order (docs/backward.md, "Deterministic")
        torch.autograd.grad(attngen.attention(q, k, v, mask=mask, deterministic=True), (q, k, v), dout)

    sm80 = attngen.AttentionSpec(head_dim=head_dim, dtype="bf16", mask=mask, family="bwd_sm80")

    def ours_both_sm80():  # the family deterministic runs, without it: what the ordering itself costs
        torch.autograd.grad(attngen.attention(q, k, v, sm80), (q, k, v), dout)

    row = {"seqlen": seqlen, "head_dim": head_dim, "causal": causal, "batch": batch, "heads": heads}
    flops = _flops(batch, heads, seqlen, head_dim, causal)
    timings = {"attngen": (ours_fwd, ours_both), "attngen_deterministic": (ours_fwd, ours_both_deterministic),
               "attngen_bwd_sm80": (ours_fwd, ours_both_sm80)}
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    dt = dout.transpose(1, 2)
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def fwd(backend=backend):
            with sdpa_kernel(backend), torch.no_grad():
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        def both(backend=backend):
            with sdpa_kernel(backend):
                torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), (qt, kt, vt), dt)
        timings[name] = (fwd, both)
    for name, (fwd, both) in timings.items():
        try:
            t_fwd, t_both = _time_ms(fwd, REPEATS), _time_ms(both, REPEATS)
        except RuntimeError as exc:  # a backend that cannot run this shape on this GPU
            row[f"{name}_error"] = str(exc).splitlines()[0]
            continue
        row[f"{name}_fwd_tflops"] = flops / t_fwd / 1e9
        row[f"{name}_bwd_tflops"] = 2.5 * flops / max(t_both - t_fwd, 1e-9) / 1e9
        row[f"{name}_fwd_bwd_tflops"] = 3.5 * flops / t_both / 1e9
    return row


def peak_memory(seqlen: int, head_dim: int = 128, heads: int = 16) -> dict:
    """Peak bytes allocated during forward + backward of one causal sequence, beyond q, k, v, dout."""
    import torch

    import attngen

    q, k, v = (torch.randn(1, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.autograd.grad(attngen.attention(q, k, v, mask="causal"), (q, k, v), dout)
    torch.cuda.synchronize()
    return {"seqlen": seqlen, "peak_extra_bytes": torch.cuda.max_memory_allocated() - base,
            "qkv_bytes": 3 * q.numel() * q.element_size()}


def run_backward_bench(out_dir: Path) -> dict:
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0)
    rows = []
    for head_dim in HEAD_DIMS:
        for causal in (False, True):
            for seqlen in SEQLENS:
                row = bench_case(seqlen, head_dim, causal)
                rows.append(row)
                print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    memory = [peak_memory(s) for s in MEMORY_SEQLENS]
    print(json.dumps(memory), flush=True)
    date = datetime.date.today().isoformat()
    result = {"gpu": name, "date": date, "torch": torch.__version__, "tokens": TOKENS, "hidden": HIDDEN,
              "dtype": "bf16", "rows": rows, "memory": memory}
    slug = name.lower().replace(" ", "-")
    (out_dir / f"backward-{slug}-{date}.json").write_text(json.dumps(result, indent=1))
    _plot(result, out_dir / f"backward-{slug}-{date}.png")
    return result


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = ("attngen", "attngen_deterministic", "sdpa_flash", "sdpa_cudnn")
    fig, ax = plt.subplots(figsize=(12, 4))
    width = 0.2
    for i, n in enumerate(names):
        ax.bar([j + i * width for j in range(len(rows))], [r.get(f"{n}_fwd_bwd_tflops", 0) for r in rows], width,
               label=n)
    labels = [f"d{r['head_dim']} {'c' if r['causal'] else 'f'} {r['seqlen'] // 1024}k" for r in rows]
    ax.set_xticks([j + 1.5 * width for j in range(len(rows))], labels, fontsize=7)
    ax.set_ylabel("forward+backward TFLOP/s")
    ax.set_title(f"training attention (fwd+bwd), 16k tokens, hidden 2048, bf16 — {result['gpu']}, {result['date']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
