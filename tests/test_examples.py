"""The examples stay runnable: their models build and run a step on the CPU with the PyTorch
reference attention (the attngen runs themselves need a GPU: examples/gpt_documents_dropout.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpt_example_trains_a_step_with_the_reference_attention_on_the_cpu():
    torch = pytest.importorskip("torch")
    gpt = _load("gpt_documents_dropout")
    tokens, docs = gpt.make_data(2, 64, 50)
    assert tokens.shape == (2, 65) and docs.shape == (2, 64) and docs.dtype == torch.int32
    assert (docs[:, 1:] >= docs[:, :-1]).all()  # packed documents: sorted ids
    model = gpt.GPT(50, 64, 32, 4, 2, 0.1, "reference")
    logits = model(tokens[:, :-1], docs)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))
    loss.backward()
    assert torch.isfinite(loss) and model.tok.weight.grad is not None
