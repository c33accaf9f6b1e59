"""Forward benchmark in the FlashAttention papers' setup, against peers in the same process.

bf16; batch * seqlen = 16k tokens; hidden 2048 (heads = 2048 / head_dim); d64 and d128;
causal and not; seqlen 512 ... 16k; plus d256 at 16k and GQA 32/8 d128 causal at 8k. attngen
runs as users get it (the preferred family for the GPU, its default config) and with the
fwd_sm80 family forced. Peers: torch SDPA's flash (FlashAttention-2) and cuDNN backends and
torch.compile(flex_attention). Timing: CUDA events around each call, warm-up first, median of
repeats, inputs rotated so the working set exceeds L2. Launch overhead: wall time per call at
tiny shapes, attngen's front door against SDPA flash.
"""

from __future__ import annotations

import datetime as _dt
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (1024, 4096, 16384)
HEAD_DIMS = (64, 128)
# (head dim, causal, seqlen, query heads per kv head): the Hopper issue's extra cells.
EXTRA = ((256, False, 16384, 1), (256, True, 16384, 1), (128, True, 8192, 4))
WARMUP = 5
REPEATS = 30
SETTLE_SECONDS = 3.0  # settle_clock: the clock falls ~12% within seconds of sustained load
# Launch overhead: (batch, seqlen, heads, head dim) at which the kernel itself takes microseconds.
OVERHEAD_SHAPES = ((1, 128, 8, 64), (1, 1024, 8, 64))
OVERHEAD_CALLS = 2000


@dataclass
class Row:
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    tflops: dict  # impl -> TFLOP/s (None when the impl is unavailable or failed)
    errors: dict  # impl -> reason it has no number
    kv_heads: int = 0
    kernels: dict = None  # attngen impl -> the kernel (plan name) it ran


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


def settle_clock(fn, seconds: float = SETTLE_SECONDS) -> int:
    """Calls fn() back to back for `seconds` of wall time, so that the timings after it see the clock a
    sustained load settles at rather than a rested GPU's falling one (the masks bench's first case, two
    kernels of one source, read 0.95x apart in a call that began on a rested GPU, even with its rounds'
    order reversed: docs/perf-notes.md "The clock at a bench's start"). Returns the calls made."""
    import torch

    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(8):
            fn()
        calls += 8
        torch.cuda.synchronize()
    return calls


ROUNDS = 6  # time_beside: runs per call, in turn with the others (an even count: the order reverses)


def time_probe_case(fns: dict, label: str, settle: bool) -> dict[str, float]:
    """A probe's case (bench/*_probe.py): time_beside over fns (no inputs), the clock settled first on the first
    fn when `settle` (a probe's first case), each call that raised printed with `label` and left out."""
    import torch

    with torch.no_grad():
        if settle:
            settle_clock(next(iter(fns.values())))
        times, errors = time_beside(fns, [()])
    for name, exc in errors.items():
        print(f"{label} {name}: {type(exc).__name__}: {exc}", flush=True)
    return times


def time_beside(fns: dict, input_sets, rounds: int = ROUNDS, repeats: int = REPEATS // ROUNDS,
                warmup: int = WARMUP) -> tuple[dict[str, float], dict[str, Exception]]:
    """Median ms of each fn(*inputs), the calls timed in turn (`rounds` runs of `repeats` each, after
    `warmup` calls of each; a call's time is the median of its runs' medians), so that every one sees
    the same clocks: the GPU's clock falls ~12% within seconds of sustained load
    (bench/window_alloc_probe.py), and a ratio of two calls timed apart compares two clocks. Every
    other round takes the calls in reverse order, so a clock that drifts steadily through the runs
    favours none of them over an even number of rounds (the masks bench's first case, causal against
    `q_idx >= kv_idx`, two kernels of one source, read 1.05x apart in two of five runs with causal always
    first: docs/perf-notes.md). A call that raises is left out, its exception returned."""
    errors: dict[str, Exception] = {}
    live = {}
    for name, fn in fns.items():
        try:
            time_ms(fn, input_sets, warmup=warmup, repeats=1)
            live[name] = fn
        except Exception as exc:  # noqa: BLE001 - a peer missing on this machine is recorded, not fatal
            errors[name] = exc
    runs: dict[str, list[float]] = {name: [] for name in live}
    for r in range(rounds):
        for name, fn in (list(live.items()) if r % 2 == 0 else list(live.items())[::-1]):
            runs[name].append(time_ms(fn, input_sets, warmup=0, repeats=repeats))
    return {name: statistics.median(values) for name, values in runs.items()}, errors


def input_sets(batch, seqlen, heads, head_dim, dtype="bfloat16", kv_heads=None):
    """(q, k, v) sets, enough of them that cycling through them exceeds L2 twice over."""
    import torch

    kv_heads = heads if kv_heads is None else kv_heads
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    set_bytes = batch * seqlen * (heads + 2 * kv_heads) * head_dim * 2
    count = max(2, -(-2 * l2 // set_bytes))

    def rand(h):
        return torch.randn(batch, seqlen, h, head_dim, device="cuda", dtype=getattr(torch, dtype))

    return [(rand(heads), rand(kv_heads), rand(kv_heads)) for _ in range(count)]


def _implementations(head_dim: int, causal: bool, seqlen: int, gqa_ratio: int = 1):
    """name -> callable(q, k, v) over BSHD tensors; peers get BHSD views (no copies)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen.spec import AttentionSpec

    spec = AttentionSpec(head_dim=head_dim, dtype="bf16", mask="causal" if causal else "none", gqa_ratio=gqa_ratio)
    # The kernels the front door resolves for calls of this length (fwd_sm90 has tiles for short ones).
    kernels = {"attngen": attngen.compile(spec, seqlen=seqlen),
               "attngen_sm80": attngen.compile(spec.replace(family="fwd_sm80"), seqlen=seqlen)}
    # Timed through the front door users call (attngen.attention, its prepared fast path), pinned to the
    # compiled kernel's family and config: a Kernel object called directly re-checks the tensors and
    # re-encodes the tensor maps every call (~100 us on the H100's host), which left the GPU idle between
    # the calls of sub-millisecond cells and timed the host instead (2026-11-27: d128 causal 1k at 0.57x
    # the same kernel's time through attngen.attention).
    pinned = {name: spec.replace(family=kernel.plan.family, config=kernel.plan.config.to_dict())
              for name, kernel in kernels.items()}
    impls = {name: (lambda s: lambda q, k, v: attngen.attention(q, k, v, s))(s) for name, s in pinned.items()}

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=causal, enable_gqa=gqa_ratio > 1)
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
                                         block_mask=block_mask, enable_gqa=gqa_ratio > 1)
    return impls, spec, {name: kernel.plan.name for name, kernel in kernels.items()}


def bench_config(head_dim: int, causal: bool, seqlen: int, gqa_ratio: int = 1) -> Row:
    import torch

    from attngen import reference, tolerance
    from attngen.flops import forward_flops

    batch, heads = TOKENS // seqlen, HIDDEN // head_dim * (2 if gqa_ratio > 1 else 1)
    kv_heads = heads // gqa_ratio
    sets = input_sets(batch, seqlen, heads, head_dim, kv_heads=kv_heads)
    impls, spec, kernels = _implementations(head_dim, causal, seqlen, gqa_ratio)
    flops = forward_flops(batch, heads, seqlen, seqlen, head_dim, causal)
    row = Row(head_dim, causal, seqlen, batch, heads, {}, {}, kv_heads, kernels)
    # A fast wrong kernel is worthless: check attngen on a slice of the benchmark's own inputs.
    q, k, v = sets[0][0][:1, :, :gqa_ratio], sets[0][1][:1, :, :1], sets[0][2][:1, :, :1]
    for name in kernels:
        mismatch = tolerance.check_output(impls[name](q, k, v), reference.attention_for_spec(q, k, v, spec),
                                          q, k, v, "bf16", spec.effective_scale)
        if mismatch is not None:
            raise AssertionError(f"{name} output wrong in benchmark config d{head_dim} causal={causal} s{seqlen}: "
                                 f"{mismatch}")
    times, errors = time_beside(impls, sets)
    for name in impls:
        row.tflops[name] = flops / (times[name] * 1e-3) / 1e12 if name in times else None
    for name, exc in errors.items():
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
    rows += [bench_config(d, c, s, g) for d, c, s, g in EXTRA]
    overhead = launch_overhead()
    props = torch.cuda.get_device_properties(0)
    meta = {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "date": _dt.date.today().isoformat(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "setup": f"bf16, batch*seqlen={TOKENS}, hidden={HIDDEN}, fwd FLOPs 4*B*H*S*S*D (/2 causal), "
                 f"{ROUNDS} runs of {REPEATS // ROUNDS} CUDA-event timings per implementation, in turn with "
                 f"the others (the order reversed every other round), after {WARMUP} warm-ups; median of the "
                 f"runs' medians; inputs rotated past L2",
    }
    stem = f"fwd-{_slug(props.name)}-{meta['date']}" + ("-quick" if quick else "")
    (out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows],
                                                      "launch_overhead": overhead}, indent=1))
    _plot(rows, meta, out_dir / f"{stem}.png")
    _print_table(rows, meta)
    _print_overhead(overhead)
    return [asdict(r) for r in rows]


def launch_overhead() -> list[dict]:
    """Microseconds of host wall time per call at tiny shapes (the kernels take a few microseconds),
    CUDA-synchronised once per OVERHEAD_CALLS calls: attngen's front door (eager direct path and
    through the torch op), a compiled kernel called directly, and SDPA flash."""
    import time

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from attngen import api
    from attngen.spec import AttentionSpec

    results = []
    for batch, seqlen, heads, head_dim in OVERHEAD_SHAPES:
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        kernel = attngen.compile(AttentionSpec(head_dim=head_dim, mask="causal"), seqlen=seqlen)

        def sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

        def op_path():
            api.EAGER_DIRECT = False
            try:
                return attngen.attention(q, k, v, mask="causal")
            finally:
                api.EAGER_DIRECT = True

        impls = {"attngen": lambda: attngen.attention(q, k, v, mask="causal"), "attngen_op": op_path,
                 "kernel_call": lambda: kernel(q, k, v), "sdpa_flash": sdpa}
        row = {"shape": [batch, seqlen, heads, head_dim], "us_per_call": {}}
        with torch.no_grad():
            for name, fn in impls.items():
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
                best = float("inf")
                for _ in range(3):  # the least disturbed of three runs
                    start = time.perf_counter()
                    for _ in range(OVERHEAD_CALLS):
                        fn()
                    torch.cuda.synchronize()
                    best = min(best, (time.perf_counter() - start) / OVERHEAD_CALLS * 1e6)
                row["us_per_call"][name] = best
        results.append(row)
    return results


def _print_overhead(overhead: list[dict]) -> None:
    for row in overhead:
        t = row["us_per_call"]
        parts = "  ".join(f"{name} {us:.1f} us" for name, us in t.items())
        print(f"launch overhead {tuple(row['shape'])}: {parts}  attngen/sdpa_flash {t['attngen'] / t['sdpa_flash']:.2f}x")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-")


def _print_table(rows: list[Row], meta: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"forward TFLOP/s on {meta['gpu']} ({meta['date']})")
    for col in ("d", "mask", "seqlen", "gqa", "attngen", "fwd_sm80", "FA2", "cuDNN", "flex", "vs FA2", "vs cuDNN",
                "sm80 vs FA2"):
        table.add_column(col, justify="right")
    fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    ratio = lambda a, b: "-" if a is None or not b else f"{a / b:.2f}x"  # noqa: E731
    for r in rows:
        t = r.tflops
        table.add_row(str(r.head_dim), "causal" if r.causal else "none", str(r.seqlen),
                      f"{r.heads}/{r.kv_heads}" if r.kv_heads and r.kv_heads != r.heads else "-", fmt(t.get("attngen")),
                      fmt(t.get("attngen_sm80")), fmt(t.get("sdpa_flash")), fmt(t.get("sdpa_cudnn")), fmt(t.get("flex")),
                      ratio(t.get("attngen"), t.get("sdpa_flash")), ratio(t.get("attngen"), t.get("sdpa_cudnn")),
                      ratio(t.get("attngen_sm80"), t.get("sdpa_flash")))
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
        sel = [r for r in rows if r.head_dim == d and r.causal == c and r.heads * d == HIDDEN]
        for name, label in (("attngen", "attngen"), ("attngen_sm80", "attngen fwd_sm80"), ("sdpa_flash", "SDPA flash (FA2)"),
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
