"""`attngen bench --decode`: one decode step (one new token per sequence) over a KV cache, GQA 32
query / 8 kv heads, d128, bf16, at the issue's four shapes; attngen with a contiguous cache and
with a paged one (page size 64, pages shuffled), against torch SDPA's flash and cuDNN backends
(contiguous, native GQA), all in one process. Bandwidth = K and V bytes read / time, held against
a device-to-device copy measured in the same run; the four implementations' CUDA graphs are replayed
in turn, the order reversed every other round (`_graphs_beside`), so their ratios compare one clock.
Also a decode step replayed from a CUDA graph at 1 x 4096 against the bytes-over-bandwidth floor.
Writes decode-<gpu>-<date>.json and .png."""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path

SHAPES = ((1, 32768), (8, 8192), (32, 4096), (64, 16384))
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
PAGE_SIZE = 64
GRAPH_SHAPE = (1, 4096)
REPEATS = 50
SPLIT_SWEEP = (1, 4, 8, 16, 32, 64, 128)


def _time_ms(fn, repeats: int = REPEATS) -> float:
    """Median ms of fn() between CUDA events, after warm-up (each call reads the whole cache, which
    at these shapes is larger than L2, except at 1 x 4096, where the graph test rotates caches)."""
    import torch

    for _ in range(5):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(repeats):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _capture(fn, calls: int):
    """`calls` calls of fn captured back to back in a CUDA graph (after one eager call)."""
    import torch

    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def _graph_ms(fn, calls: int = 20, replays: int = 10) -> float:
    """Median GPU ms of one fn() call: `calls` calls captured back to back in a CUDA graph, replayed
    (host overhead excluded: what the kernels take, as a serving loop's graphs see it)."""
    return _time_ms(_capture(fn, calls).replay, replays) / calls


def _graphs_beside(fns: dict, calls: int = 20, replays: int = 12) -> tuple[dict[str, float], dict[str, Exception]]:
    """_graph_ms of each call, the graphs replayed in turn (attngen/bench.py time_beside: short runs, the
    order reversed every other round), so that attngen and the peers whose ratio a bar reads see the
    same clocks; a call that cannot be captured or replayed is left out, its exception returned."""
    from attngen.bench import ROUNDS, time_beside

    graphs, errors = {}, {}
    for name, fn in fns.items():
        try:
            graphs[name] = _capture(fn, calls)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run this shape is reported, not fatal
            errors[name] = exc
    times, failed = time_beside({name: graph.replay for name, graph in graphs.items()}, [()],
                                repeats=max(1, replays // ROUNDS), warmup=2)
    return {name: ms / calls for name, ms in times.items()}, {**errors, **failed}


def _copy_bandwidth() -> float:
    import torch

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = _time_ms(lambda: b.copy_(a), 20)
    return 2 * a.numel() / (ms * 1e-3) / 1e12  # read + write


def _paged(k, v, gen):
    """The contiguous caches (B, S, H, D) as pages of PAGE_SIZE in shuffled order, with the table."""
    import torch

    B, S, H, D = k.shape
    per = S // PAGE_SIZE
    order = torch.randperm(B * per, generator=gen, device="cpu").cuda()
    table = order.reshape(B, per).to(torch.int32)
    kp, vp = (torch.empty(B * per, PAGE_SIZE, H, D, dtype=k.dtype, device="cuda") for _ in range(2))
    kp[order] = k.reshape(B * per, PAGE_SIZE, H, D)
    vp[order] = v.reshape(B * per, PAGE_SIZE, H, D)
    return kp, vp, table


def bench_shape(batch: int, seqlen: int, copy_tbps: float) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    kp, vp, table = _paged(k, v, gen)
    bytes_read = 2 * k.numel() * 2
    row = {"batch": batch, "seqlen": seqlen, "bytes": bytes_read}
    ref = attngen.decode(q, k, v, lens)
    paged = attngen.decode(q, kp, vp, lens, page_table=table)
    row["paged_matches_contiguous"] = bool(torch.equal(ref, paged))
    impls = {
        "attngen": lambda: attngen.decode(q, k, v, lens),
        "attngen_paged": lambda: attngen.decode(q, kp, vp, lens, page_table=table),
    }
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's (B, H, S, D) views
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        try:
            run()
            impls[name] = run
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run this shape is reported, not fatal
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    for name, fn in impls.items():
        row[f"{name}_eager_ms"] = _time_ms(fn)  # with each call's host overhead
    graph_ms, errors = _graphs_beside(impls)
    for name, exc in errors.items():
        row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    for name, ms in graph_ms.items():
        row[f"{name}_ms"] = ms
        row[f"{name}_tbps"] = bytes_read / (ms * 1e-3) / 1e12
        row[f"{name}_vs_copy"] = row[f"{name}_tbps"] / copy_tbps
    # The split count the heuristic chose, and the time of others (the heuristic's evidence).
    from attngen.runtime.decode import _checked

    spec = attngen.AttentionSpec(head_dim=HEAD_DIM, gqa_ratio=HEADS_Q // HEADS_KV)
    row["splits"] = _checked(q, kp, vp, lens, table, spec, None, None, None)[1].num_splits
    row["paged_ms_by_splits"] = {s: _graph_ms(lambda s=s: attngen.decode(q, kp, vp, lens, page_table=table,
                                                                          num_splits=s))
                                 for s in SPLIT_SWEEP if s <= seqlen // 128}
    peers = [row[f"{n}_ms"] for n in ("sdpa_flash", "sdpa_cudnn") if f"{n}_ms" in row]
    if peers:
        row["attngen_vs_best_peer"] = min(peers) / row["attngen_ms"]
        row["attngen_paged_vs_best_peer"] = min(peers) / row["attngen_paged_ms"]
    return row


def bench_graph(copy_tbps: float) -> dict:
    """A decode step's attention (the split kernel and the combine; appending the new token's K/V is
    not timed) captured in a CUDA graph and replayed, at 1 x 4096 tokens, paged; caches rotated so
    L2 does not hold them. SDPA's flash and cuDNN backends the same way, on the contiguous caches,
    for what the floor's bar asks against what the peers reach."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen

    batch, seqlen = GRAPH_SHAPE
    gen = torch.Generator().manual_seed(1)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bytes_read = 2 * batch * seqlen * HEADS_KV * HEAD_DIM * 2
    count = max(2, -(-3 * l2 // bytes_read))
    steps = []
    for _ in range(count):  # one cache per step, so no step finds its cache in L2
        k = torch.randn(batch, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kp, vp, table = _paged(k, v, gen)
        q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
        steps.append((q, kp, vp, lens, table, *(t.transpose(1, 2) for t in (q, k, v))))
    it = iter(range(10**9))

    def step():
        q, kp, vp, lens, table = steps[next(it) % count][:5]
        return attngen.decode(q, kp, vp, lens, page_table=table)

    ms = _graph_ms(step, calls=4 * count)
    floor_ms = bytes_read / (copy_tbps * 1e12) * 1e3
    row = {"batch": batch, "seqlen": seqlen, "graph_replay_ms": ms, "floor_ms": floor_ms, "vs_floor": ms / floor_ms}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def peer(backend=backend):
            qt, kt, vt = steps[next(it) % count][5:]
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        try:
            peer_ms = _graph_ms(peer, calls=4 * count)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run this shape is reported, not fatal
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        row[f"{name}_graph_replay_ms"] = peer_ms
        row[f"{name}_vs_floor"] = peer_ms / floor_ms
    return row


def run_decode_bench(out_dir: Path) -> dict:
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0)
    copy_tbps = _copy_bandwidth()
    rows = []
    for batch, seqlen in SHAPES:
        row = bench_shape(batch, seqlen, copy_tbps)
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    graph = bench_graph(copy_tbps)
    print(json.dumps(graph), flush=True)
    date = datetime.date.today().isoformat()
    result = {"gpu": name, "date": date, "torch": torch.__version__, "copy_tbps": copy_tbps,
              "shape": {"heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM, "dtype": "bf16",
                        "page_size": PAGE_SIZE}, "rows": rows, "graph": graph}
    slug = name.lower().replace(" ", "-")
    (out_dir / f"decode-{slug}-{date}.json").write_text(json.dumps(result, indent=1))
    _plot(result, out_dir / f"decode-{slug}-{date}.png")
    return result


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = ("attngen", "attngen_paged", "sdpa_flash", "sdpa_cudnn")
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.2
    for i, n in enumerate(names):
        ax.bar([j + i * width for j in range(len(rows))], [r.get(f"{n}_tbps", 0) for r in rows], width, label=n)
    ax.axhline(result["copy_tbps"], color="k", linestyle="--", label="copy")
    ax.set_xticks([j + 1.5 * width for j in range(len(rows))], [f"{r['batch']}x{r['seqlen']}" for r in rows])
    ax.set_ylabel("TB/s (K+V bytes / time)")
    ax.set_title(f"decode, GQA 32/8, d128, bf16 — {result['gpu']}, {result['date']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
