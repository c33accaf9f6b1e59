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


# -- fp32 evaluation error (attngen/tolerance.py: the kernels evaluate a modifier's derivative) ------
U32 = 2.0**-24  # fp32 unit roundoff: one rounded operation
FAST_MATH = 2.0**-21  # the kernels' ex2.approx / lg2.approx: 2 ulp relative (tanh builds on them)


def evaluation_error(node: Node, env: DenseEnv) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, bound) of a float expression computed as the kernels do, in fp32 one rounding per
    operation, from exact variables and inputs (float64 env): a first-order running error bound.
    Integer and boolean parts are exact (conditions are taken as the exact ones); the score's own
    error is the caller's (it propagates through the derivative in the score)."""
    if node.type is not Type.FLOAT or isinstance(node, (Var, Input)):
        value = evaluate(node, env)
        return value, torch.zeros((), dtype=torch.float64, device=env.device)
    if isinstance(node, Const):  # a float literal rounded to fp32
        value = evaluate(node, env)
        return value, U32 * value.abs()
    op = node.op
    if op == "to_float":
        value = evaluate(node, env)
        return value, U32 * value.abs() * (value.abs() >= 2.0**24)  # exact below 2^24
    if op == "where":
        cond = evaluate(node.args[0], env)
        (a, ea), (b, eb) = (evaluation_error(x, env) for x in node.args[1:])
        return torch.where(cond, a, b), torch.where(cond, ea, eb)
    parts = [evaluation_error(a, env) for a in node.args]
    values = [p[0] for p in parts]
    errs = [p[1] for p in parts]
    r = evaluate(node, env)
    ra = r.abs()
    if op in ("add", "sub"):
        return r, errs[0] + errs[1] + U32 * ra
    if op == "mul":
        return r, values[0].abs() * errs[1] + values[1].abs() * errs[0] + U32 * ra
    if op == "truediv":
        return r, (errs[0] + ra * errs[1]) / values[1].abs() + 2 * U32 * ra
    if op in ("neg", "abs"):
        return r, errs[0]
    if op in ("min", "max"):
        return r, functools.reduce(torch.maximum, errs)
    if op == "tanh":  # 1 - 2 / (e^2x + 1) with fast exponentials, or a polynomial: a few ulp
        return r, (1 - r * r) * errs[0] + 4 * U32 * ra + FAST_MATH * (1 - ra)
    if op == "exp":
        return r, ra * (errs[0] + FAST_MATH + 2 * U32 * values[0].abs())
    if op == "log":
        return r, errs[0] / values[0].abs() + FAST_MATH * torch.clamp(ra, min=1.0)
    if op == "sqrt":
        return r, errs[0] / (2 * torch.clamp(ra, min=1e-300)) + 2 * U32 * ra
    raise ValueError(f"no error rule for op {op!r}")
