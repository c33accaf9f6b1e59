"""IR -> torch: dense evaluation for the reference and the tests.

Every node evaluates to a tensor; the variables are broadcast against each other, so a
(q_len, 1) q_idx and a (1, kv_len) kv_idx give a (q_len, kv_len) mask. Integers are int64 with
Python's floor division and modulo (torch's `//` and `%` on int64 tensors floor, like Python);
floats are computed in one dtype (the score's) throughout, constants included. Inputs are read
with advanced indexing, so an index must be in range for every point evaluated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from attngen.maskc.ir import Const, Input, Node, Type, Var

_ELEMENTWISE = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.div, "neg": torch.neg, "abs": torch.abs,
    "tanh": torch.tanh, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "not": torch.logical_not,
}
_REDUCING = {"min": torch.minimum, "max": torch.maximum, "and": torch.logical_and, "or": torch.logical_or}


@dataclass
class DenseEnv:
    values: dict  # variable name -> tensor
    inputs: dict
    float_dtype: torch.dtype
    device: torch.device

    def dtype(self, node_type: Type) -> torch.dtype:
        return {Type.INT: torch.int64, Type.BOOL: torch.bool, Type.FLOAT: self.float_dtype}[node_type]


def make_env(variables: dict, inputs: dict | None, float_dtype: torch.dtype | None = None) -> DenseEnv:
    """The environment for evaluate(): int64 tensors for the index variables, on the device of the
    first tensor given (CPU when none is)."""
    device = next((v.device for v in variables.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    values = {}
    for name, value in variables.items():
        if name == "score":
            values[name] = torch.as_tensor(value, dtype=float_dtype, device=device)
        else:
            values[name] = torch.as_tensor(value, device=device).to(torch.int64)
    return DenseEnv(values, dict(inputs or {}), float_dtype or torch.float32, device)


def evaluate(node: Node, env: DenseEnv) -> torch.Tensor:
    if isinstance(node, Const):
        return torch.tensor(node.value, dtype=env.dtype(node.type), device=env.device)
    if isinstance(node, Var):
        return env.values[node.name]
    if isinstance(node, Input):
        return _read_input(node, env)
    op, args = node.op, node.args
    values = [evaluate(a, env) for a in args]
    if op in _ELEMENTWISE:
        return _ELEMENTWISE[op](*values)
    if op in _REDUCING:
        return functools.reduce(_REDUCING[op], values)
    if op == "floordiv":
        return torch.div(values[0], values[1], rounding_mode="floor")
    if op == "mod":
        return torch.remainder(values[0], values[1])
    if op == "where":
        return torch.where(*values)
    if op == "to_float":
        return values[0].to(env.float_dtype)
    raise ValueError(f"no dense rule for op {op!r}")


def _read_input(node: Input, env: DenseEnv) -> torch.Tensor:
    if node.name not in env.inputs:
        raise ValueError(f"input {node.name!r} is used by the expression but not given (inputs={{...}})")
    table = torch.as_tensor(env.inputs[node.name], device=env.device).to(env.dtype(node.type))
    if table.dim() != len(node.index):
        raise ValueError(f"input {node.name!r} is read with {len(node.index)} indices but has {table.dim()} "
                         f"dimensions (shape {tuple(table.shape)})")
    if not node.index:
        return table
    return table[tuple(evaluate(i, env) for i in node.index)]


def broadcast_result(result: torch.Tensor, env: DenseEnv) -> torch.Tensor:
    """The result at the broadcast shape of all variables, even where the expression ignores some."""
    shape = torch.broadcast_shapes(result.shape, *(v.shape for v in env.values.values()))
    return result if result.shape == shape else result.expand(shape).clone()
