"""The front door without a GPU: the torch op's fake implementation, torch.compile tracing, the
specless spec key, and the errors a user sees."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import attngen
from attngen.api import _spec_key
from attngen.errors import MissingDependency, require_cupy
from attngen.spec import HEAD_DIMS, AttentionSpec

attngen.register()  # torch.ops.attngen.* exist once registered (automatic when torch is imported first)


def fake_inputs(B=2, Sq=100, Sk=50, Hq=8, Hkv=2, D=64, dtype=torch.bfloat16):
    q = torch.empty(B, Sq, Hq, D, dtype=dtype, device="cuda")
    k = torch.empty(B, Sk, Hkv, D, dtype=dtype, device="cuda")
    return q, k, torch.empty_like(k)


def test_fake_implementation_gives_shapes_and_dtypes():
    with FakeTensorMode():
        q, k, v = fake_inputs()
        out, lse = torch.ops.attngen.forward(q, k, v, AttentionSpec(head_dim=64, gqa_ratio=4).key(), None)
        assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device and out.is_contiguous()
        assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32
        # A transposed (BHSD-stored) q still gives a contiguous BSHD output.
        qt = torch.empty(2, 8, 100, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        out, _ = torch.ops.attngen.forward(qt, k, v, AttentionSpec(head_dim=64, gqa_ratio=4).key(), 0.5)
        assert out.shape == qt.shape and out.is_contiguous()


@pytest.mark.parametrize("change, match", [
    (dict(gqa_ratio=2), "gqa_ratio=2 needs Hq == gqa_ratio \\* Hkv"),
    (dict(head_dim=128), "head_dim 64 .* spec's head_dim is 128"),
    (dict(dtype="fp16"), "dtype bfloat16, but the spec's dtype is fp16"),
])
def test_fake_implementation_checks_the_inputs(change, match):
    with FakeTensorMode():
        q, k, v = fake_inputs()
        spec = AttentionSpec(**{"head_dim": 64, "gqa_ratio": 4, **change})
        with pytest.raises(ValueError, match=match):
            torch.ops.attngen.forward(q, k, v, spec.key(), None)


def test_a_runtime_input_off_the_gpu_is_named_with_its_device():
    """At trace time a fake CPU tensor reaches the checks (device index -1): the error says cpu."""
    with FakeTensorMode():
        q, k, v = fake_inputs()
        spec = AttentionSpec(head_dim=64, gqa_ratio=4, mask="doc[b, q_idx] == doc[b, kv_idx]")
        doc = torch.zeros(2, 100, dtype=torch.int32)
        with pytest.raises(ValueError, match="input 'doc' is on cpu but q is on cuda:0"):
            torch.ops.attngen.forward(q, k, v, spec.key(), None, ["doc"], [doc])


def test_fullgraph_compile_traces_one_op_and_no_graph_break():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def layer(q, k, v):
        return attngen.attention(q, k, v, mask="causal") * 2

    def pinned(q, k, v, spec):
        return attngen.attention(q, k, v, spec, return_lse=True)

    def compiled_mask(q, k, v):  # parsed once at trace time, a constant in the graph
        return attngen.attention(q, k, v, mask="chunked(64)  and causal", score_mod="softcap(20)")

    def with_inputs(q, k, v, doc):  # runtime inputs: torch 2.11's dynamo broke the graph on bool() of their dict
        return attngen.attention(q, k, v, mask="doc[b, q_idx] == doc[b, kv_idx] and causal", inputs={"doc": doc})

    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = fake_inputs()
        out = torch.compile(layer, backend=backend, fullgraph=True)(q, k, v)
        assert out.shape == q.shape
        o, lse = torch.compile(pinned, backend=backend, fullgraph=True)(q, k, v, AttentionSpec(head_dim=64, gqa_ratio=4))
        assert o.shape == q.shape and lse.shape == (2, 8, 100)
        out = torch.compile(compiled_mask, backend=backend, fullgraph=True)(q, k, v)
        assert out.shape == q.shape
        doc = torch.empty(2, 100, dtype=torch.int32, device="cuda")
        out = torch.compile(with_inputs, backend=backend, fullgraph=True)(q, k, v, doc)
        assert out.shape == q.shape
    assert len(graphs) == 4  # fullgraph: one graph per function, no breaks
    ops = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "attngen" in str(n.target)]
    assert len(ops) == 1 and "causal" in str(ops[0].args[3])
    ops = [n for n in graphs[2].graph.nodes if n.op == "call_function" and "attngen" in str(n.target)]
    key = AttentionSpec(head_dim=64, gqa_ratio=4, mask="chunked(64) and causal", score_mod="softcap(20.0)").key()
    assert len(ops) == 1 and ops[0].args[3] == key


@settings(max_examples=60, deadline=None)
@given(d=st.sampled_from(HEAD_DIMS), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       hkv=st.integers(1, 4), ratio=st.integers(1, 8), mask=st.sampled_from(["none", "causal"]))
def test_specless_key_is_the_specs_canonical_key(d, dtype, hkv, ratio, mask):
    q = torch.empty(1, 3, hkv * ratio, d, dtype=dtype, device="meta")
    k = torch.empty(1, 5, hkv, d, dtype=dtype, device="meta")
    expected = AttentionSpec(head_dim=d, dtype={torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype],
                             gqa_ratio=ratio, mask=mask)
    assert _spec_key(q, k, None, mask) == expected.key()
    assert AttentionSpec.from_key(_spec_key(q, k, None, mask)) == expected


@pytest.mark.parametrize("q_shape, k_shape, kwargs, match", [
    ((1, 4, 2, 80), (1, 4, 2, 80), {}, r"q has head_dim 80 .*allowed: \(64, 96, 128, 256\)"),
    ((1, 4, 3, 64), (1, 4, 2, 64), {}, "q has 3 heads and k has 2; allowed: heads_kv >= 1 and heads_q a multiple of it, 1 to"),
    ((1, 4, 2, 64), (1, 4, 2, 64), {"mask": "sliding"}, "mask='sliding' is invalid: .*allowed: .*none, causal"),
    ((1, 4, 2, 64), (1, 4, 2, 64), {"mask": "q_idx.x"}, "mask='q_idx.x' is invalid: .*attribute"),
    ((4, 2, 64), (1, 4, 2, 64), {}, "q must have 4 dims"),
    ((1, 4, 0, 64), (1, 4, 2, 64), {}, "q has 0 heads and k has 2; allowed: heads_kv >= 1 and heads_q a multiple of it, 1 to"),
    ((1, 4, 2, 64), (1, 4, 2, 64), {"mask": ["causal"]}, r"mask=\['causal'\] is invalid; allowed: a mask expression"),
    ((1, 4, 2, 64), (1, 4, 2, 64), {"score_mod": {"s": 1}}, r"score_mod=\{'s': 1\} is invalid; allowed:"),
    ((1, 4, 2, 64), (1, 4, 2, 64), {"sink": ["x"]}, r"sink=\['x'\] is invalid; allowed:"),
])
def test_specless_calls_name_the_bad_argument(q_shape, k_shape, kwargs, match):
    q = torch.empty(q_shape, dtype=torch.bfloat16, device="meta")
    k = torch.empty(k_shape, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=match):
        _spec_key(q, k, None, kwargs.get("mask"), kwargs.get("score_mod"), kwargs.get("sink"))


def test_user_mistakes_are_clear_errors():
    q = torch.randn(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor, got device cpu"):
        attngen.attention(q, q, q)
    with pytest.raises(ValueError, match="mask='none' conflicts with the spec's mask='causal'"):
        attngen.attention(q, q, q, AttentionSpec(head_dim=64, mask="causal"), mask="none")
    with pytest.raises(ValueError, match="spec must be an attngen.AttentionSpec or None, got dict"):
        attngen.attention(q, q, q, {"head_dim": 64})
    with pytest.raises(ValueError, match="q must be a CUDA tensor, got device cpu"):  # with grad: the op path
        attngen.attention(q.clone().requires_grad_(), q, q)
    with pytest.raises(ValueError, match="dtype float32; allowed: float16, bfloat16"):
        attngen.attention(torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64))


def test_missing_cupy_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(MissingDependency, match=r'pip install "attngen\[cuda13\]"'):
        require_cupy()


def test_importing_attngen_needs_neither_torch_nor_cupy():
    code = "import sys, attngen, attngen.cli; assert 'torch' not in sys.modules and 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torch_imported_after_attngen_compiles_fullgraph_on_the_first_call():
    """Sorted imports put attngen before torch: the op must exist before the first call is traced
    (registering inside dynamo's trace is a graph break, an error under fullgraph=True). A probe
    for torch in between, as libraries make to see whether it is installed, changes nothing."""
    code = """
import importlib.util
import attngen
assert importlib.util.find_spec("torch") is not None
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

assert hasattr(torch.ops.attngen, "forward")
graphs = []
def backend(gm, example_inputs):
    graphs.append(gm)
    return gm.forward
def layer(q, k, v):
    out, lse = attngen.attention(q, k, v, mask="causal", return_lse=True)
    return out.float() * 2 + 1, lse
with FakeTensorMode(allow_non_fake_inputs=True):
    q = torch.empty(2, 100, 8, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.empty(2, 100, 2, 64, dtype=torch.bfloat16, device="cuda")
    torch.compile(layer, backend=backend, fullgraph=True)(q, k, k)
assert len(graphs) == 1
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_docstring_documents_the_contract():
    doc = attngen.attention.__doc__
    for phrase in ("(batch, seq_q, heads_q, head_dim)", "bottom-right", "float32 (batch, heads_q, seq_q)",
                   "lse -inf", "torch.compile(fullgraph=True)", "Raises:"):
        assert phrase in doc


def test_arguments_of_the_wrong_kind_are_named_before_anything_reads_them():
    """None, lists, numpy arrays, a non-dict inputs, non-tensor input values, a non-bool return_lse or
    deterministic: a ValueError naming the argument at each front door, where these reached an
    AttributeError, a raw TypeError or torch's dispatcher text (and a str return_lse was taken as true)."""
    import numpy as np

    from attngen.decoding import append_kv

    q = torch.randn(1, 4, 2, 64, dtype=torch.bfloat16)
    grad_q = q.clone().requires_grad_()
    for call, match in [
        (lambda: attngen.attention(None, q, q), "q is None; allowed: a torch CUDA tensor or a CuPy array"),
        (lambda: attngen.attention(q, [1], q), "k is a list; allowed: a torch CUDA tensor"),
        (lambda: attngen.attention(grad_q, q, np.zeros(3)), "v is an? ndarray; allowed: a torch CUDA tensor"),
        (lambda: attngen.attention(q, q, q, inputs=5), "inputs is an int; allowed: None or a dict"),
        (lambda: attngen.attention(grad_q, q, q, inputs={"doc": 5}), r"inputs\['doc'\] is an int; allowed"),
        (lambda: attngen.attention(q, q, q, return_lse="no"), "return_lse='no' is invalid; allowed: True, False"),
        (lambda: attngen.attention(q, q, q, deterministic="no"), "deterministic='no' is invalid"),
        (lambda: attngen.attention(grad_q, q, q, softmax_scale="x"), "softmax_scale='x' is invalid; allowed: a float"),
        (lambda: attngen.attention_varlen(q[0], q[0], q[0], None, None, softmax_scale=True), "softmax_scale=True is"),
        (lambda: attngen.decode(q, q, q, q, softmax_scale=[1.0]), r"softmax_scale=\[1.0\] is invalid"),
        (lambda: attngen.attention_varlen(q[0], np.zeros(3), q[0], None, None), "k is an? ndarray; allowed"),
        (lambda: attngen.attention_varlen(q[0], q[0], q[0], None, None, inputs=(1,)), "inputs is a tuple; allowed"),
        (lambda: attngen.decode(None, q, q, q), "q is None; allowed"),
        (lambda: attngen.decode(q, q, [q], q), "v_cache is a list; allowed"),
        (lambda: attngen.decode(q, q, q, q, page_table="p"), "page_table is a str; allowed"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    # append_kv: the shapes it used to accept or fail on inside torch.
    k, v = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    lens = torch.tensor([0, 3], dtype=torch.int32)
    new = torch.randn(2, 2, 2, 64)
    with pytest.raises(ValueError, match=r"k_new has shape \(2, 2, 2, 64\) and v_new \(2, 1, 2, 64\); allowed: the same"):
        append_kv(k, v, new, new[:, :1], lens)  # v's one token went into both slots, silently
    with pytest.raises(ValueError, match="k_cache has 1 sequences .* and cache_seqlens 2; allowed: one cache row"):
        append_kv(k[:1], v[:1], new, new, lens)
    with pytest.raises(ValueError, match=r"k_cache has shape \(4, 0, 2, 64\); allowed: a page size"):
        append_kv(torch.zeros(4, 0, 2, 64), torch.zeros(4, 0, 2, 64), new, new, lens,
                  page_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="check=None is invalid; allowed: True, False"):
        append_kv(k, v, new, new, lens, check=None)


@pytest.mark.parametrize("device", ["x", -1, 1.0, True])
def test_compile_names_a_bad_device(device):
    """A device that is no GPU index failed inside CuPy ("an integer is required")."""
    with pytest.raises(ValueError, match=r"device=.* is invalid; allowed: None \(the current GPU\) or a GPU index"):
        attngen.compile(AttentionSpec(head_dim=64), device=device)


@pytest.mark.parametrize("seqlen", [0, -5, 1.5, "512", True])
def test_compile_names_a_bad_seqlen(seqlen):
    with pytest.raises(ValueError, match=r"seqlen=.* is invalid; allowed: None \(length-free defaults\) or an int >= 1"):
        attngen.compile(AttentionSpec(head_dim=64), device=0, seqlen=seqlen)
