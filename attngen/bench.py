"""Forward benchmark in the FlashAttention papers' setup, against peers in the same process.

bf16; batch * seqlen = 16k tokens; hidden 2048 (heads = 2048 / head_dim); d64 and d128;
causal and not; seqlen 512 ... 16k. Peers: torch SDPA's flash (FlashAttention-2) and
cuDNN backends and torch.compile(flex_attention). Timing: CUDA events around each call,
warm-up first, median of repeats, inputs rotated so the working set exceeds L2.
"""

from __future__ import annotations

import datetime as _dt
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (1024, 4096, 16384)
HEAD_DIMS = (64, 128)
WARMUP = 5
REPEATS = 30


@dataclass
class Row:
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    tflops: dict  # impl -> TFLOP/s (None when the impl is unavailable or failed)
    errors: dict  # impl -> reason it has no number


def fwd_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> float:
    flops = 4.0 * batch * heads * seqlen * seqlen * head_dim
    return flops / 2 if causal else flops


def time_ms(fn, input_sets, warmup: int = WARMUP, repeats: int = REPEATS) -> float:
    """Median milliseconds of fn(*inputs), cycling through input_sets (rotation defeats L2 reuse)."""
    import torch

    for i in range(warmup):
        fn(*input_sets[i % len(input_sets)])
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(repeats):
        args = input_sets[i % len(input_sets)]
        starts[i].record()
        fn(*args)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _input_sets(batch, seqlen, heads, head_dim, dtype="bfloat16", kv_heads=None):
    """(q, k, v) sets, enough of them that cycling through them exceeds L2 twice over."""
    import torch

    kv_heads = heads if kv_heads is None else kv_heads
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    set_bytes = batch * seqlen * (heads + 2 * kv_heads) * head_dim * 2
    count = max(2, -(-2 * l2 // set_bytes))

    def rand(h):
        return torch.randn(batch, seqlen, h, head_dim, device="cuda", dtype=getattr(torch, dtype))

    return [(rand(heads), rand(kv_heads), rand(kv_heads)) for _ in range(count)]


def _implementations(head_dim: int, causal: bool, seqlen: int):
    """name -> callable(q, k, v) over BSHD tensors; peers get BHSD views (no copies)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen.spec import AttentionSpec

    spec = AttentionSpec(head_dim=head_dim, dtype="bf16", mask="causal" if causal else "none")
    kernel = attngen.compile(spec)
    impls = {"attngen": lambda q, k, v: kernel(q, k, v)[0]}

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=causal)
        return run

    impls["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    impls["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # A fresh compile per shape: dynamo's recompile limit would otherwise silently fall back
    # to the unfused (dense) flex_attention after a few configurations.
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if causal:
        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seqlen, seqlen, device="cuda")
    impls["flex"] = lambda q, k, v: flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         block_mask=block_mask)
    return impls, spec


def bench_config(head_dim: int, causal: bool, seqlen: int) -> Row:
    import torch

    from attngen import reference, tolerance

    batch, heads = TOKENS // seqlen, HIDDEN // head_dim
    sets = _input_sets(batch, seqlen, heads, head_dim)
    impls, spec = _implementations(head_dim, causal, seqlen)
    flops = fwd_flops(batch, heads, seqlen, head_dim, causal)
    row = Row(head_dim, causal, seqlen, batch, heads, {}, {})
    # A fast wrong kernel is worthless: check attngen on a slice of the benchmark's own inputs.
    q, k, v = (x[:1, :, :2] for x in sets[0])
    mismatch = tolerance.check_output(impls["attngen"](q, k, v), reference.attention_for_spec(q, k, v, spec),
                                      q, k, v, "bf16", spec.effective_scale)
    if mismatch is not None:
        raise AssertionError(f"attngen output wrong in benchmark config d{head_dim} causal={causal} s{seqlen}: "
                             f"{mismatch}")
    for name, fn in impls.items():
        try:
            ms = time_ms(fn, sets)
            row.tflops[name] = flops / (ms * 1e-3) / 1e12
        except Exception as exc:  # a peer missing on this machine is recorded, not fatal
            row.tflops[name] = None
            row.errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    del sets
    torch.cuda.empty_cache()
    return row


def run_bench(out_dir: Path, quick: bool = False) -> list[dict]:
    import torch

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seqlens = QUICK_SEQLENS if quick else SEQLENS
    rows = [bench_config(d, c, s) for d in HEAD_DIMS for c in (False, True) for s in seqlens]
    props = torch.cuda.get_device_properties(0)
    meta = {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "date": _dt.date.today().isoformat(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "setup": f"bf16, batch*seqlen={TOKENS}, hidden={HIDDEN}, fwd FLOPs 4*B*H*S*S*D (/2 causal), "
                 f"median of {REPEATS} CUDA-event timings after {WARMUP} warm-ups, inputs rotated past L2",
    }
    stem = f"fwd-{_slug(props.name)}-{meta['date']}" + ("-quick" if quick else "")
    (out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    _plot(rows, meta, out_dir / f"{stem}.png")
    _print_table(rows, meta)
    return [asdict(r) for r in rows]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-")


def _print_table(rows: list[Row], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"forward TFLOP/s on {meta['gpu']} ({meta['date']})")
    for col in ("d", "mask", "seqlen", "attngen", "FA2", "cuDNN", "flex", "vs FA2", "vs cuDNN"):
        table.add_column(col, justify="right")
    fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    ratio = lambda a, b: "-" if a is None or not b else f"{a / b:.2f}x"  # noqa: E731
    for r in rows:
        t = r.tflops
        table.add_row(str(r.head_dim), "causal" if r.causal else "none", str(r.seqlen), fmt(t.get("attngen")),
                      fmt(t.get("sdpa_flash")), fmt(t.get("sdpa_cudnn")), fmt(t.get("flex")),
                      ratio(t.get("attngen"), t.get("sdpa_flash")), ratio(t.get("attngen"), t.get("sdpa_cudnn")))
    Console(width=140).print(table)
    for r in rows:
        for name, err in r.errors.items():
            print(f"note: {name} d{r.head_dim} s{r.seqlen}: {err}")


def _plot(rows: list[Row], meta: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib missing; no plot written")
        return
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2), sharey=True)
    panels = [(d, c) for d in HEAD_DIMS for c in (False, True)]
    for ax, (d, c) in zip(axes, panels):
        sel = [r for r in rows if r.head_dim == d and r.causal == c]
        for name, label in (("attngen", "attngen"), ("sdpa_flash", "SDPA flash (FA2)"),
                            ("sdpa_cudnn", "SDPA cuDNN"), ("flex", "FlexAttention")):
            pts = [(r.seqlen, r.tflops.get(name)) for r in sel if r.tflops.get(name) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d{d} {'causal' if c else 'non-causal'}")
        ax.set_xlabel("seqlen")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"attention forward, bf16, 16k tokens, hidden 2048 — {meta['gpu']}, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
