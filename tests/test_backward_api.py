"""The backward front door without a GPU: the checks name what is wrong, the backward plan is a
backward family's, the attngen::backward op's fake implementation gives the gradients' shapes,
and the forward op's autograd formula (run on CPU tensors, the ops' implementations replaced by
dense ones) gives the gradients of a dense reference, sinks' inputs included."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attngen
from attngen import api, reference, targets
from attngen.errors import SpecError
from attngen.masks import get_mask
from attngen.runtime.backward import (
    PreparedBackward,
    backward,
    backward_call,
    backward_plan,
    check_backward_inputs,
)
from attngen.runtime.tensors import TensorInfo
from attngen.spec import AttentionSpec

attngen.register()

SPEC = AttentionSpec(head_dim=128, gqa_ratio=4, mask="causal")
H100 = targets.target("sm_90a")
A100 = targets.target("sm_80")


def info(name, shape, dtype="bfloat16", strides=None, ptr=0):
    if strides is None:
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorInfo(name, "torch", ptr, tuple(shape), tuple(strides), dtype, 0)


def call_args(**changes):
    """A well-formed backward call's TensorInfos: B=2, Sq=100, Sk=50, Hq=8, Hkv=2, D=128."""
    q_shape, k_shape = (2, 100, 8, 128), (2, 50, 2, 128)
    args = dict(q=info("q", q_shape), k=info("k", k_shape), v=info("v", k_shape), out=info("out", q_shape),
                lse=info("lse", (2, 8, 100), "float32"), dout=info("dout", q_shape), dlse=None,
                dq=info("dq", q_shape), dk=info("dk", k_shape), dv=info("dv", k_shape))
    args.update(changes)
    return args


def check(problem=SPEC.problem, **changes):
    a = call_args(**changes)
    check_backward_inputs(problem, a["q"], a["k"], a["v"], a["out"], a["lse"], a["dout"], a["dlse"])


def make_call(problem=SPEC.problem, softmax_scale=None, inputs=None, **changes):
    a = call_args(**changes)
    return backward_call(problem, a["q"], a["k"], a["v"], a["out"], a["lse"], a["dout"], a["dlse"], a["dq"],
                         a["dk"], a["dv"], softmax_scale, inputs)


# -- checks -----------------------------------------------------------------------------------
def test_a_well_formed_call_passes_the_checks():
    check()
    check(dlse=info("dlse", (2, 8, 100), "float32"))
    # A transposed (BHSD-stored) dout and out, and an LSE whose size-1 dim has any stride, are fine.
    check(dout=info("dout", (2, 100, 8, 128), strides=(102400, 128, 12800, 1)),
          out=info("out", (2, 100, 8, 128), strides=(102400, 128, 12800, 1)))
    check(q=info("q", (2, 1, 8, 128)), out=info("out", (2, 1, 8, 128)), dout=info("dout", (2, 1, 8, 128)),
          lse=info("lse", (2, 8, 1), "float32", strides=(8, 1, 7)))
    # A gradient autograd hands over with batch 1 may carry any batch stride (contiguous() keeps it).
    one = dict(q=info("q", (1, 100, 8, 128)), k=info("k", (1, 50, 2, 128)), v=info("v", (1, 50, 2, 128)),
               out=info("out", (1, 100, 8, 128)), lse=info("lse", (1, 8, 100), "float32"))
    check(**one, dout=info("dout", (1, 100, 8, 128), strides=(3, 1024, 128, 1)))
    with pytest.raises(ValueError, match="rows 16-byte"):
        check(**one, dout=info("dout", (1, 100, 8, 128), strides=(102400, 1028, 128, 1)))


@pytest.mark.parametrize("change, message", [
    (dict(q=info("q", (2, 100, 8, 64))), "q has head_dim 64"),
    (dict(k=info("k", (2, 50, 3, 128))), "k and v must have the same shape"),
    (dict(out=info("out", (2, 99, 8, 128))), r"out has shape \(2, 99, 8, 128\); allowed: q's shape"),
    (dict(out=info("out", (2, 100, 8, 128), "float16")), "out has dtype float16; allowed: q's dtype bfloat16"),
    (dict(dout=info("dout", (2, 100, 8, 128), "float32")), "dout has dtype float32; allowed: q's dtype"),
    (dict(dout=info("dout", (2, 100, 8, 128), strides=(102400, 1024, 1, 8))),
     r"dout has strides \(102400, 1024, 1, 8\); allowed: contiguous in its last dim"),
    (dict(dout=info("dout", (2, 100, 8, 128), ptr=8)), "dout has strides .* data pointer 0x8; allowed: rows 16-byte"),
    (dict(out=info("out", (2, 100, 8, 128), strides=(102404, 1024, 128, 1))), "out has strides .*16-byte aligned"),
    (dict(dout=TensorInfo("dout", "torch", 0, (2, 100, 8, 128), (102400, 1024, 128, 1), "bfloat16", 1)),
     "dout is on cuda:1; allowed: q's device cuda:0"),
    (dict(lse=info("lse", (2, 8, 100), "bfloat16")), "lse has dtype bfloat16; allowed: float32"),
    (dict(lse=info("lse", (2, 100, 8), "float32")), r"lse has shape \(2, 100, 8\); allowed: \(batch, heads_q"),
    (dict(lse=info("lse", (2, 8, 100), "float32", strides=(800, 1, 8))),
     r"lse has strides \(800, 1, 8\); allowed: contiguous, \(800, 100, 1\)"),
    (dict(dlse=info("dlse", (2, 8, 99), "float32")), r"dlse has shape \(2, 8, 99\)"),
    (dict(dlse=info("dlse", (2, 8, 100), "float16")), "dlse has dtype float16; allowed: float32"),
])
def test_bad_inputs_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        check(**change)


@pytest.mark.parametrize("change, message", [
    (dict(dq=info("dq", (2, 50, 8, 128))), r"dq has shape \(2, 50, 8, 128\); allowed: q's shape"),
    (dict(dk=info("dk", (2, 50, 2, 128), "float16")), "dk has dtype float16; allowed: k's dtype bfloat16"),
    (dict(dv=info("dv", (2, 50, 8, 128))), r"dv has shape \(2, 50, 8, 128\); allowed: k's shape \(2, 50, 2, 128\)"),
    (dict(dv=info("dv", (2, 50, 2, 128), ptr=4)), "dv has strides .*allowed: rows 16-byte aligned"),
    (dict(softmax_scale=0.5, problem=SPEC.replace(softmax_scale=0.25).problem),
     "softmax_scale=0.5 conflicts with the spec's softmax_scale=0.25"),
    (dict(softmax_scale=-1.0), r"softmax_scale=-1.0 is invalid; allowed: a float in"),
])
def test_bad_outputs_and_arguments_are_named(change, message):
    with pytest.raises(ValueError, match=message):
        make_call(**change)


def test_the_call_carries_the_scale_and_the_runtime_inputs():
    call = make_call()
    assert call.softmax_scale == SPEC.problem.scale and call.dlse is None and call.inputs == ()
    assert (call.batch, call.seq_q, call.seq_k, call.heads_q, call.heads_kv) == (2, 100, 50, 8, 2)
    spec = SPEC.replace(score_mod="score + bias[h]", sink="sinks[h]")
    given = {"sinks": info("inputs['sinks']", (8,), "float32"), "bias": info("inputs['bias']", (8,), "float32")}
    call = make_call(spec.problem, 0.5, given)
    assert call.softmax_scale == 0.5 and [name for name, _ in call.inputs] == ["bias", "sinks"]
    assert call.input("sinks").shape == (8,)


@pytest.mark.parametrize("given, message", [
    ({}, "reads input 'bias'"),
    ({"bias": info("inputs['bias']", (8,), "int32")}, "input 'bias' has dtype int32; allowed: float32"),
    ({"bias": info("inputs['bias']", (4,), "float32")}, r"index 0 of input 'bias' takes values in \[0, 7\]"),
    ({"bias": info("inputs['bias']", (8,), "float32"), "x": info("inputs['x']", (8,), "float32")},
     r"inputs \['x'\] are not read"),
])
def test_runtime_inputs_are_checked_as_the_forward_checks_them(given, message):
    with pytest.raises(ValueError, match=message):
        make_call(SPEC.replace(score_mod="score + bias[h]").problem, None, given)


def test_the_runtime_refuses_host_tensors_and_a_non_spec():
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="q must be a CUDA tensor, got device cpu"):
        backward(q, q, q, q, q, lse, AttentionSpec(head_dim=64))
    with pytest.raises(ValueError, match="spec must be an attngen.AttentionSpec, got dict"):
        backward(q, q, q, q, q, lse, {"head_dim": 64})


class StubKernel:
    """What PreparedBackward asks of a loaded kernel, recording the calls it would pack."""

    def __init__(self):
        self.bound = []

    def workspace_bytes(self, call):
        return 256

    def bind(self, call):
        self.bound.append(call)
        return ("bound", len(self.bound))

    def launch_bound(self, bound, stream):
        pass


def test_a_prepared_layout_moves_every_pointer_to_its_own_field():
    spec = SPEC.replace(sink="sinks[h] + bias[b]")
    call = make_call(spec.problem, None, {"sinks": info("inputs['sinks']", (8,), "float32"),
                                          "bias": info("inputs['bias']", (2,), "float32")},
                     dlse=info("dlse", (2, 8, 100), "float32"))
    prepared = PreparedBackward(StubKernel(), call)
    moved = prepared._at(tuple(range(1, 14)))  # the ten tensors, the workspace, then inputs by name
    assert [getattr(moved, name).ptr for name in PreparedBackward.FIELDS] == list(range(1, 11))
    assert moved.workspace == 11 and [(n, t.ptr) for n, t in moved.inputs] == [("bias", 12), ("sinks", 13)]
    assert moved.q.shape == call.q.shape and moved.dk.strides == call.dk.strides
    without = PreparedBackward(StubKernel(), make_call())._at((*range(1, 7), 0, *range(8, 12)))
    assert without.dlse is None and without.dq.ptr == 8


def test_a_prepared_empty_call_gives_zeros_and_packs_nothing():
    q_shape, k_shape = (2, 0, 8, 128), (2, 50, 2, 128)
    call = make_call(q=info("q", q_shape), out=info("out", q_shape), dout=info("dout", q_shape),
                     lse=info("lse", (2, 8, 0), "float32"), dq=info("dq", q_shape))
    prepared = PreparedBackward(None, call)
    q = torch.empty(q_shape, dtype=torch.bfloat16)
    k = torch.full(k_shape, float("nan"), dtype=torch.bfloat16)
    dq, dk, dv, head_sums = prepared.run_torch(torch, q, q, k, k, q, torch.empty(2, 8, 0), None, (), 0)
    assert head_sums.shape == (0, 8)
    assert dq.shape == q_shape and dk.shape == dv.shape == k_shape and dk.dtype == torch.bfloat16
    assert not dk.any() and not dv.any()


# -- plans ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("target", "expected"), [(A100, "bwd_sm80"), (H100, "bwd_sm90")], ids=lambda t: getattr(t, "name", t))
def test_the_backward_plan_is_the_preferred_backward_familys(target, expected):
    plan = backward_plan(SPEC, target)
    assert plan.family == expected and plan.name.startswith(f"{expected}_causal_d128_gqa4_bf16_")
    family = attngen.families.BACKWARD_FAMILIES[expected]
    assert plan.config == family.default_config(SPEC.problem, target)


def test_a_head_dim_the_hopper_backward_lacks_falls_to_the_mma_sync_family():
    plan = backward_plan(SPEC.replace(head_dim=96), H100)
    assert plan.family == "bwd_sm80"


def test_a_pinned_forward_family_leaves_the_backward_its_defaults():
    for spec in (SPEC.replace(family="fwd_sm80", config={"block_m": 64}), SPEC.replace(family="fwd_sm90")):
        plan = backward_plan(spec, H100)
        family = attngen.families.BACKWARD_FAMILIES["bwd_sm90"]
        assert plan.family == "bwd_sm90" and plan.config == family.default_config(SPEC.problem, H100)


def test_a_pinned_backward_family_keeps_its_config():
    plan = backward_plan(SPEC.replace(family="bwd_sm80", config={"block_m": 32, "num_stages": 1}), A100)
    assert plan.family == "bwd_sm80" and plan.config.block_m == 32 and plan.config.num_stages == 1


def test_a_pinned_backward_family_leaves_the_forward_its_own_choice():
    """attention(spec=...) with a backward family pinned: the forward runs the forward dispatcher's
    family (attngen/runtime/dispatch.py forward_part), the backward the pinned one."""
    from attngen import families
    from attngen.runtime.dispatch import forward_part

    pinned = SPEC.replace(family="bwd_sm90", config={"num_stages": 1}, arch="sm_90a")
    forward = forward_part(pinned)
    assert forward.family is None and forward.config is None and forward.problem == pinned.problem
    assert families.plan_spec(forward, H100, operation="forward").family == "fwd_sm90"
    assert backward_plan(pinned, H100).config.num_stages == 1
    for spec in (SPEC, SPEC.replace(family="fwd_sm80", config={"block_m": 64})):
        assert forward_part(spec) is spec


def test_deterministic_goes_into_the_key_from_the_argument_or_torchs_setting():
    q, k = torch.empty(2, 64, 8, 64, dtype=torch.bfloat16), torch.empty(2, 64, 2, 64, dtype=torch.bfloat16)
    expected = AttentionSpec(head_dim=64, gqa_ratio=4, mask="causal", deterministic=True)
    assert api._spec_key(q, k, None, "causal", deterministic=True) == expected.key()
    assert api._spec_key(q, k, None, "causal", None, None, 0.1, True) == expected.replace(dropout_p=0.1).key()
    assert api._deterministic(torch, None, None) is False
    assert api._deterministic(torch, True, None) is True
    with pytest.raises(ValueError, match="deterministic='yes' is invalid; allowed: None, True, False"):
        api._deterministic(torch, "yes", None)
    with pytest.raises(ValueError, match="deterministic=True conflicts with the spec's deterministic=False"):
        api._spec_key(q, k, SPEC, None, deterministic=True)
    assert api._spec_key(q, k, expected, None, deterministic=False) == expected.key()  # the spec's applies
    torch.use_deterministic_algorithms(True)
    try:
        assert api._deterministic(torch, None, None) is True
        assert api._deterministic(torch, None, expected) is True
        with pytest.raises(RuntimeError, match="order-dependent .* allowed: a spec with deterministic=True"):
            api._deterministic(torch, None, SPEC)
        assert api._deterministic(torch, False, SPEC) is False  # asked for explicitly
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="order-dependent"):
            assert api._deterministic(torch, None, SPEC) is False
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_problem_no_backward_family_runs_says_why():
    with pytest.raises(SpecError, match="no backward kernel family can run .*head_dim 256"):
        backward_plan(AttentionSpec(head_dim=256), H100)


# -- the attngen::backward op's fake implementation ------------------------------------------------
def fake_call(B=2, Sq=100, Sk=50, Hq=8, Hkv=2, D=64, dtype=torch.bfloat16, dlse=True):
    q = torch.empty(B, Sq, Hq, D, dtype=dtype, device="cuda")
    k = torch.empty(B, Sk, Hkv, D, dtype=dtype, device="cuda")
    lse = torch.empty(B, Hq, Sq, dtype=torch.float32, device="cuda")
    return dict(dout=torch.empty_like(q), q=q, k=k, v=torch.empty_like(k), out=torch.empty_like(q), lse=lse,
                dlse=torch.empty_like(lse) if dlse else None)


def run_fake(a, spec, scale=None, names=None, inputs=None):
    return torch.ops.attngen.backward(a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], a["dlse"], spec.key(),
                                      scale, names, inputs)


@pytest.mark.parametrize("dlse", [True, False])
def test_fake_backward_gives_the_gradients_shapes_and_dtypes(dlse):
    with FakeTensorMode():
        a = fake_call(dtype=torch.float16, dlse=dlse)
        # A transposed (BHSD-stored) q: its gradient is still contiguous.
        a["q"] = torch.empty(2, 8, 100, 64, dtype=torch.float16, device="cuda").transpose(1, 2)
        dq, dk, dv, head_sums = run_fake(a, AttentionSpec(head_dim=64, gqa_ratio=4, dtype="fp16"))
        assert head_sums.shape == (0, 8) and head_sums.dtype == torch.float32  # no learnable inputs
        assert dq.shape == (2, 100, 8, 64) and dq.dtype == torch.float16 and dq.is_contiguous()
        assert dk.shape == dv.shape == (2, 50, 2, 64) and dk.dtype == dv.dtype == torch.float16
        assert dq.device == dk.device == a["q"].device


@pytest.mark.parametrize("change, match", [
    (dict(dout=lambda a: torch.empty(2, 100, 8, 32, dtype=torch.bfloat16, device="cuda")), "dout has shape"),
    (dict(lse=lambda a: torch.empty(2, 8, 100, dtype=torch.bfloat16, device="cuda")), "lse has dtype bfloat16"),
    (dict(dlse=lambda a: torch.empty_strided((2, 8, 100), (800, 1, 8), device="cuda")), "dlse has strides"),
    (dict(out=lambda a: torch.empty(2, 100, 8, 64, dtype=torch.bfloat16)), "out must be a CUDA tensor"),
])
def test_fake_backward_checks_the_inputs(change, match):
    with FakeTensorMode():
        a = fake_call()
        for name, make in change.items():
            a[name] = make(a)
        with pytest.raises(ValueError, match=match):
            run_fake(a, AttentionSpec(head_dim=64, gqa_ratio=4))


def test_fake_backward_checks_the_runtime_inputs():
    spec = AttentionSpec(head_dim=64, gqa_ratio=4, sink="sinks[h]")
    with FakeTensorMode():
        a = fake_call()
        sinks = torch.empty(8, device="cuda")
        dq, *_ = run_fake(a, spec, None, ["sinks"], [sinks])
        assert dq.shape == a["q"].shape
        with pytest.raises(ValueError, match="reads input 'sinks'"):
            run_fake(a, spec)
        with pytest.raises(ValueError, match="index 0 of input 'sinks'"):
            run_fake(a, spec, None, ["sinks"], [torch.empty(4, device="cuda")])


# -- the forward op's autograd formula, on CPU through dense implementations -------------------
def dense_forward(q, k, v, spec_key, softmax_scale, input_names=None, inputs=None):
    spec = api._spec_from_key(spec_key)
    out, lse = reference.attention_for_spec(q, k, v, spec, softmax_scale, return_lse=True,
                                            inputs=dict(zip(input_names or (), inputs or ())))
    return out.contiguous(), lse


def dense_backward(dout, q, k, v, out, lse, dlse, spec_key, softmax_scale, input_names=None, inputs=None):
    """What the backward kernels compute (attngen/families/bwd_sm80/family.py), densely: P from the
    LSE, D = rowsum(dO * O) - dLSE, dS = P * (dP - D). No score modifier."""
    problem = api._spec_from_key(spec_key).problem
    assert problem.score_mod is None
    scale = problem.scale if softmax_scale is None else softmax_scale
    r, (B, Sq, Hq, D), Sk = problem.gqa_ratio, q.shape, k.shape[1]
    qh, doh, oh = (t.double().permute(0, 2, 1, 3) for t in (q, dout, out))
    kh, vh = (t.double().permute(0, 2, 1, 3).repeat_interleave(r, 1) for t in (k, v))
    visible = torch.as_tensor(get_mask(problem.mask).dense_visible(torch.arange(Sq)[:, None], torch.arange(Sk)[None],
                                                                   Sq, Sk))
    lse = lse.double()
    scores = qh @ kh.transpose(-1, -2) * scale
    p = torch.where(visible, torch.exp(scores - torch.where(lse == -math.inf, 0, lse)[..., None]), 0.0)
    delta = (doh * oh).sum(-1) - (0 if dlse is None else dlse.double())
    ds = p * (doh @ vh.transpose(-1, -2) - delta[..., None])
    dq = (ds @ kh * scale).permute(0, 2, 1, 3)
    dk = (ds.transpose(-1, -2) @ qh * scale).reshape(B, Hq // r, r, Sk, D).sum(2).permute(0, 2, 1, 3)
    dv = (p.transpose(-1, -2) @ doh).reshape(B, Hq // r, r, Sk, D).sum(2).permute(0, 2, 1, 3)
    head_sums = torch.zeros((0, Hq), dtype=torch.float32)  # no score modifier: no learnable inputs
    return (*(t.to(x.dtype).contiguous() for t, x in ((dq, q), (dk, k), (dv, v))), head_sums)


@pytest.fixture
def dense_ops(monkeypatch):
    """The ops' implementations replaced by dense CPU ones; what the backward op was called with."""
    calls = []

    def recording_backward(*args):
        calls.append(dict(zip(("dout", "q", "k", "v", "out", "lse", "dlse", "spec_key", "softmax_scale",
                                "input_names", "inputs"), args)))
        return dense_backward(*args)

    monkeypatch.setattr(api, "_forward_impl", dense_forward)
    monkeypatch.setattr(api, "_backward_impl", recording_backward)
    return calls


def leaves(B=2, Sq=5, Sk=7, Hq=4, Hkv=2, D=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, D, generator=gen, dtype=torch.float64).requires_grad_()
            for S, H in ((Sq, Hq), (Sk, Hkv), (Sk, Hkv))]


def grads_of(loss_of, tensors, run):
    """Gradients of loss_of(out, lse) w.r.t. `tensors`, through `run` (a function of them giving out, lse);
    zeros for a tensor the loss does not reach (v, when it reads only the LSE)."""
    for t in tensors:
        t.grad = None
    loss_of(*run()).backward()
    return [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in tensors]


LOSSES = {
    "out and lse": lambda out, lse: (out * torch.cos(out)).sum() + (lse * torch.arange(lse.numel()).reshape(lse.shape)
                                                                    / lse.numel()).sum(),
    "out only, expanded gradient": lambda out, lse: out.sum(),
    "lse only": lambda out, lse: (torch.where(lse.isfinite(), lse, 0.0) ** 2).sum(),
}


@pytest.mark.parametrize("loss", LOSSES, ids=str)
@pytest.mark.parametrize("mask, Sq, Sk", [("causal", 5, 7), ("causal", 9, 4), ("none", 6, 6)])
def test_autograd_matches_the_dense_reference(dense_ops, loss, mask, Sq, Sk):
    spec = AttentionSpec(head_dim=64, gqa_ratio=2, mask=mask)
    q, k, v = leaves(Sq=Sq, Sk=Sk)
    got = grads_of(LOSSES[loss], [q, k, v], lambda: torch.ops.attngen.forward(q, k, v, spec.key(), None))
    want = grads_of(LOSSES[loss], [q, k, v],
                    lambda: reference.attention_for_spec(q, k, v, spec, return_lse=True))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    (call,) = dense_ops
    # The kernels read rows of dout: an expanded gradient arrives contiguous; an unused LSE as no dlse.
    assert call["dout"].stride()[-1] == 1 and all(s % 8 == 0 for s in call["dout"].stride()[:-1])
    assert (call["dlse"] is None) == (loss == "out only, expanded gradient")
    assert call["dlse"] is None or call["dlse"].is_contiguous()


def test_only_the_gradients_asked_for_are_computed(dense_ops):
    q, k, v = leaves()
    k, v = k.detach(), v.detach()  # only q requires grad: the op still runs, with the call's scale
    out, _ = torch.ops.attngen.forward(q, k, v, AttentionSpec(head_dim=64, gqa_ratio=2).key(), 0.5)
    out.sum().backward()
    assert q.grad is not None and k.grad is None and dense_ops[-1]["softmax_scale"] == 0.5
    torch.testing.assert_close(q.grad, grads_of(LOSSES["out only, expanded gradient"], [q], lambda: reference.attention(
        q, k, v, gqa_ratio=2, softmax_scale=0.5, return_lse=True))[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sink", ["sinks[h]", "sinks[h] * 0.5 + bias[b, q_idx] - 0.01 * q_len"])
def test_sink_inputs_get_their_gradients(dense_ops, sink):
    spec = AttentionSpec(head_dim=64, gqa_ratio=2, mask="causal", sink=sink)
    q, k, v = leaves(Sq=6, Sk=4)  # causal with Sq > Sk: rows that see no key, whose LSE is their sink
    gen = torch.Generator().manual_seed(1)
    sinks = torch.randn(4, generator=gen).requires_grad_()
    bias = torch.randn(2, 6, generator=gen).requires_grad_()
    inputs = {"sinks": sinks, "bias": bias} if "bias" in sink else {"sinks": sinks}
    names = sorted(inputs)
    tensors = [q, k, v, *(inputs[n] for n in names)]
    loss = LOSSES["out and lse"]
    got = grads_of(loss, tensors, lambda: torch.ops.attngen.forward(q, k, v, spec.key(), None, names,
                                                                   [inputs[n] for n in names]))
    want = grads_of(loss, tensors, lambda: reference.attention_for_spec(q, k, v, spec, return_lse=True,
                                                                        inputs=inputs))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert all(g.abs().sum() > 0 for g in got[3:])  # the sinks' gradients are not trivially zero


def test_a_sink_row_with_lse_minus_infinity_gives_no_gradient():
    out = torch.zeros(1, 2, 1, 64)
    lse = torch.tensor([[[-math.inf, 0.5]]])  # row 0 saw no key and its sink is -inf
    sinks = torch.tensor([-math.inf]).requires_grad_()
    grads = api.sink_grads(torch, "sinks[h]", out, lse, torch.ones_like(out), torch.ones_like(lse), 3,
                           {"sinks": sinks}, ["sinks"])
    # Row 1 only: -exp(-inf - 0.5) * (0 - 1) = 0, and row 0 adds 0, not NaN.
    assert grads["sinks"].shape == (1,) and torch.isfinite(grads["sinks"]).all()


def test_inputs_of_a_score_modifier_not_read_at_h_alone_cannot_require_grad(dense_ops):
    q, k, v = leaves()
    bias = torch.zeros(7, requires_grad=True)
    for spec, names in ((AttentionSpec(head_dim=64, gqa_ratio=2, score_mod="score + bias[kv_idx]"), ["bias"]),
                        (AttentionSpec(head_dim=64, gqa_ratio=2, score_mod="score + bias[h] * bias[kv_idx]"), ["bias"]),
                        (AttentionSpec(head_dim=64, gqa_ratio=2, score_mod="score + t[h]", sink="t[h]"), ["t"])):
        with pytest.raises(ValueError, match=rf"inputs\['{names[0]}'\] requires grad, but gradients of runtime "
                                             "inputs are only supported for those the sink alone reads"):
            torch.ops.attngen.forward(q, k, v, spec.key(), None, names, [bias])
    assert not dense_ops


def test_learnable_inputs_are_the_modifiers_float_inputs_read_at_h_alone():
    from attngen.families.bwd_shared import learnable_inputs

    def names(**kw):
        return learnable_inputs(AttentionSpec(head_dim=64, **kw).problem)

    assert names(score_mod="score - slope[h] * abs(q_idx - kv_idx)") == ("slope",)
    assert names(score_mod="score + a[h] + w[q_idx] + c[h] * c[h]") == ("a", "c")
    assert names(score_mod="score + t[h]", sink="t[h]") == ()  # the sink's: torch gives those
    assert names(score_mod="softcap(30.0)") == () and names() == ()


def test_attention_refuses_a_score_modifier_input_that_requires_grad_before_running():
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"inputs\['bias'\] requires grad.*only supported for those the sink.*detach"):
        attngen.attention(q, q, q, score_mod="score + bias[q_idx]", inputs={"bias": torch.zeros(4, requires_grad=True)})
    with torch.no_grad():  # no gradient wanted: the usual checks
        with pytest.raises(ValueError, match="q must be a CUDA tensor"):
            attngen.attention(q, q, q, score_mod="score + bias[q_idx]",
                              inputs={"bias": torch.zeros(4, requires_grad=True)})


def test_attention_with_grad_reaches_the_kernel_checks():
    q = torch.randn(1, 4, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="q must be a CUDA tensor, got device cpu"):
        attngen.attention(q, q, q)


def test_attention_with_grad_takes_the_op_and_records_the_graph(dense_ops, monkeypatch):
    def no_eager(*args, **kwargs):
        raise AssertionError("a call that needs gradients must take the op")

    monkeypatch.setattr(api, "_eager", no_eager)
    q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in leaves())
    sinks = torch.zeros(4, requires_grad=True)
    out = attngen.attention(q, k, v, mask="causal", sink="sinks[h]", inputs={"sinks": sinks})
    assert out.grad_fn is not None
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and q.grad.shape == q.shape and k.grad.shape == v.grad.shape == k.shape
    assert sinks.grad.shape == (4,) and dense_ops[0]["input_names"] == ["sinks"]
    # Only the sink's input requires grad: still the op, and no backward kernel for q, k, v.
    q, k, v = (t.detach() for t in (q, k, v))
    sinks.grad = None
    attngen.attention(q, k, v, mask="causal", sink="sinks[h]", inputs={"sinks": sinks}).float().sum().backward()
    assert sinks.grad.shape == (4,) and len(dense_ops) == 1
