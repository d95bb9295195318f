"""Gate workloads: a GEMM whose output is split into gates and combined elementwise.

- ``gate_2890``: TVM issue #2890's example, ``x @ W^T + b -> split(3) -> sigmoid + tanh * exp``
  at x(64, 1024), W(3072, 1024);
- ``lstm_cell``: one LSTM step, gates i, f, g, o from one GEMM; outputs h and c;
  at x(1, 1024), W(4096, 1024);
- ``gru_cell``: one GRU step with both GEMMs (input and hidden), whose ``r * (W_hn h + b_hn)``
  term needs the hidden GEMM's gate piece;
- ``swiglu``: LLaMA's MLP, ``silu(gate) * up`` from one GEMM chunked in two, then the down
  projection; hidden 2048 -> 2 x 5632;
- ``geglu``: the same with ``gelu(gate) * up``.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax import op as R

from . import Instance, register
from ._build import (
    const,
    dim,
    gelu_np,
    onnx_input,
    onnx_model,
    randn,
    rng,
    sigmoid_np,
    tensor_var,
)


def _linear(bb: relax.BlockBuilder, x, w: np.ndarray, b: np.ndarray | None):
    """``x @ w^T (+ b)`` as frameworks and the ONNX importer write it."""
    y = bb.emit(R.matmul(x, bb.emit(R.permute_dims(const(w)))))
    if b is not None:
        y = bb.emit(R.add(y, const(b)))
    return y


def _split(bb: relax.BlockBuilder, y, k: int):
    parts = bb.emit(R.split(y, k, axis=-1))
    return [bb.emit(relax.TupleGetItem(parts, i)) for i in range(k)]


def _sizes(size: str, seed: tuple, small: tuple) -> tuple:
    return seed if size == "seed" else small


# ---------------------------------------------------------------------------------------------


@register("gate_2890", "gate", "x @ W^T + b -> split(3) -> sigmoid + tanh * exp (TVM #2890)")
def gate_2890(size: str = "seed", dynamic: bool = False) -> Instance:
    n_val, k_in, d = _sizes(size, (64, 1024, 1024), (4, 32, 16))
    gen = rng(2890)
    w = randn(gen, 3 * d, k_in, scale=k_in**-0.5)
    b = randn(gen, 3 * d, scale=0.1)
    x_np = randn(gen, n_val, k_in)

    n = dim("n", n_val, dynamic)
    x = tensor_var("x", (n, k_in))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            s, t, e = _split(bb, _linear(bb, x, w, b), 3)
            s = bb.emit(R.sigmoid(s))
            t = bb.emit(R.tanh(t))
            e = bb.emit(R.exp(e))
            out = bb.emit_output(R.add(s, bb.emit(R.multiply(t, e))))
        bb.emit_func_output(out)

    def reference(x):
        y = x @ w.T + b
        s, t, e = np.split(y, 3, axis=1)
        return [sigmoid_np(s) + np.tanh(t) * np.exp(e)]

    from onnx import helper

    nodes = [
        helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1),
        helper.make_node("Split", ["y"], ["s", "t", "e"], axis=1, num_outputs=3),
        helper.make_node("Sigmoid", ["s"], ["s1"]),
        helper.make_node("Tanh", ["t"], ["t1"]),
        helper.make_node("Exp", ["e"], ["e1"]),
        helper.make_node("Mul", ["t1", "e1"], ["te"]),
        helper.make_node("Add", ["s1", "te"], ["out"]),
    ]
    model = onnx_model(
        nodes,
        [onnx_input("x", "float32", ["n", k_in])],
        [onnx_input("out", "float32", ["n", d])],
        {"w": w, "b": b},
    )

    def torch_fn(torch):
        tw, tb = torch.from_numpy(w), torch.from_numpy(b)

        def fn(x):
            s, t, e = torch.nn.functional.linear(x, tw, tb).chunk(3, dim=1)
            return (torch.sigmoid(s) + torch.tanh(t) * torch.exp(e),)

        return fn

    return Instance(
        "gate_2890",
        bb.get(),
        {"x": x_np},
        reference,
        model,
        torch_fn,
        rtol=1e-4,
        atol=1e-4,
        expect="FuseSplitGates: GEMM + split + gates in one kernel",
    )


@register("lstm_cell", "gate", "LSTM cell: x @ W^T + b -> i, f, g, o -> h, c")
def lstm_cell(size: str = "seed", dynamic: bool = False) -> Instance:
    n_val, k_in, d = _sizes(size, (1, 1024, 1024), (3, 32, 16))
    gen = rng(1997)
    w = randn(gen, 4 * d, k_in, scale=k_in**-0.5)
    b = randn(gen, 4 * d, scale=0.1)
    x_np = randn(gen, n_val, k_in)
    c_np = randn(gen, n_val, d)

    n = dim("n", n_val, dynamic)
    x = tensor_var("x", (n, k_in))
    c = tensor_var("c", (n, d))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, c]):
        with bb.dataflow():
            i, f, g, o = _split(bb, _linear(bb, x, w, b), 4)
            i = bb.emit(R.sigmoid(i))
            f = bb.emit(R.sigmoid(f))
            g = bb.emit(R.tanh(g))
            o = bb.emit(R.sigmoid(o))
            c_new = bb.emit(R.add(bb.emit(R.multiply(f, c)), bb.emit(R.multiply(i, g))))
            h_new = bb.emit(R.multiply(o, bb.emit(R.tanh(c_new))))
            out = bb.emit_output(relax.Tuple([h_new, c_new]))
        bb.emit_func_output(out)

    def reference(x, c):
        i, f, g, o = np.split(x @ w.T + b, 4, axis=1)
        c_new = sigmoid_np(f) * c + sigmoid_np(i) * np.tanh(g)
        return [sigmoid_np(o) * np.tanh(c_new), c_new]

    from onnx import helper

    nodes = [
        helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1),
        helper.make_node("Split", ["y"], ["i", "f", "g", "o"], axis=1, num_outputs=4),
        helper.make_node("Sigmoid", ["i"], ["i1"]),
        helper.make_node("Sigmoid", ["f"], ["f1"]),
        helper.make_node("Tanh", ["g"], ["g1"]),
        helper.make_node("Sigmoid", ["o"], ["o1"]),
        helper.make_node("Mul", ["f1", "c"], ["fc"]),
        helper.make_node("Mul", ["i1", "g1"], ["ig"]),
        helper.make_node("Add", ["fc", "ig"], ["c_new"]),
        helper.make_node("Tanh", ["c_new"], ["tc"]),
        helper.make_node("Mul", ["o1", "tc"], ["h_new"]),
    ]
    model = onnx_model(
        nodes,
        [onnx_input("x", "float32", ["n", k_in]), onnx_input("c", "float32", ["n", d])],
        [onnx_input("h_new", "float32", ["n", d]), onnx_input("c_new", "float32", ["n", d])],
        {"w": w, "b": b},
    )

    def torch_fn(torch):
        tw, tb = torch.from_numpy(w), torch.from_numpy(b)

        def fn(x, c):
            i, f, g, o = torch.nn.functional.linear(x, tw, tb).chunk(4, dim=1)
            c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c_new), c_new

        return fn

    return Instance(
        "lstm_cell",
        bb.get(),
        {"x": x_np, "c": c_np},
        reference,
        model,
        torch_fn,
        expect="FuseSplitGates: the 4-gate GEMM and the cell update in one kernel",
    )


@register("gru_cell", "gate", "GRU cell: two GEMMs, r * (W_hn h + b_hn), h' = (1-z) n + z h")
def gru_cell(size: str = "seed", dynamic: bool = False) -> Instance:
    n_val, k_in, d = _sizes(size, (1, 1024, 1024), (3, 24, 16))
    gen = rng(2014)
    w_ih = randn(gen, 3 * d, k_in, scale=k_in**-0.5)
    w_hh = randn(gen, 3 * d, d, scale=d**-0.5)
    b_ih = randn(gen, 3 * d, scale=0.1)
    b_hh = randn(gen, 3 * d, scale=0.1)
    x_np = randn(gen, n_val, k_in)
    h_np = randn(gen, n_val, d)

    n = dim("n", n_val, dynamic)
    x = tensor_var("x", (n, k_in))
    h = tensor_var("h", (n, d))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, h]):
        with bb.dataflow():
            i_r, i_z, i_n = _split(bb, _linear(bb, x, w_ih, b_ih), 3)
            h_r, h_z, h_n = _split(bb, _linear(bb, h, w_hh, b_hh), 3)
            r = bb.emit(R.sigmoid(bb.emit(R.add(i_r, h_r))))
            z = bb.emit(R.sigmoid(bb.emit(R.add(i_z, h_z))))
            cand = bb.emit(R.tanh(bb.emit(R.add(i_n, bb.emit(R.multiply(r, h_n))))))
            one_minus_z = bb.emit(R.subtract(relax.const(1.0, "float32"), z))
            h_new = bb.emit(
                R.add(bb.emit(R.multiply(one_minus_z, cand)), bb.emit(R.multiply(z, h)))
            )
            out = bb.emit_output(h_new)
        bb.emit_func_output(out)

    def reference(x, h):
        i_r, i_z, i_n = np.split(x @ w_ih.T + b_ih, 3, axis=1)
        h_r, h_z, h_n = np.split(h @ w_hh.T + b_hh, 3, axis=1)
        r = sigmoid_np(i_r + h_r)
        z = sigmoid_np(i_z + h_z)
        cand = np.tanh(i_n + r * h_n)
        return [(1 - z) * cand + z * h]

    from onnx import helper

    one = np.array(1.0, dtype="float32")
    nodes = [
        helper.make_node("Gemm", ["x", "w_ih", "b_ih"], ["gi"], transB=1),
        helper.make_node("Gemm", ["h", "w_hh", "b_hh"], ["gh"], transB=1),
        helper.make_node("Split", ["gi"], ["i_r", "i_z", "i_n"], axis=1, num_outputs=3),
        helper.make_node("Split", ["gh"], ["h_r", "h_z", "h_n"], axis=1, num_outputs=3),
        helper.make_node("Add", ["i_r", "h_r"], ["ar"]),
        helper.make_node("Sigmoid", ["ar"], ["r"]),
        helper.make_node("Add", ["i_z", "h_z"], ["az"]),
        helper.make_node("Sigmoid", ["az"], ["z"]),
        helper.make_node("Mul", ["r", "h_n"], ["rh"]),
        helper.make_node("Add", ["i_n", "rh"], ["an"]),
        helper.make_node("Tanh", ["an"], ["cand"]),
        helper.make_node("Sub", ["one", "z"], ["omz"]),
        helper.make_node("Mul", ["omz", "cand"], ["p1"]),
        helper.make_node("Mul", ["z", "h"], ["p2"]),
        helper.make_node("Add", ["p1", "p2"], ["h_new"]),
    ]
    model = onnx_model(
        nodes,
        [onnx_input("x", "float32", ["n", k_in]), onnx_input("h", "float32", ["n", d])],
        [onnx_input("h_new", "float32", ["n", d])],
        {"w_ih": w_ih, "w_hh": w_hh, "b_ih": b_ih, "b_hh": b_hh, "one": one},
    )

    def torch_fn(torch):
        cell = torch.nn.GRUCell(k_in, d)
        with torch.no_grad():
            cell.weight_ih.copy_(torch.from_numpy(w_ih))
            cell.weight_hh.copy_(torch.from_numpy(w_hh))
            cell.bias_ih.copy_(torch.from_numpy(b_ih))
            cell.bias_hh.copy_(torch.from_numpy(b_hh))
        return lambda x, h: (cell(x, h),)

    return Instance(
        "gru_cell",
        bb.get(),
        {"x": x_np, "h": h_np},
        reference,
        model,
        torch_fn,
        expect="FuseSplitGates: both GEMMs and the gate math in one kernel",
    )


def _glu_mlp(name: str, act: str, size: str, dynamic: bool) -> Instance:
    n_val, hidden, inter = _sizes(size, (64, 2048, 5632), (4, 32, 48))
    gen = rng(2020 if act == "silu" else 2021)
    w_gu = randn(gen, 2 * inter, hidden, scale=hidden**-0.5)
    w_down = randn(gen, hidden, inter, scale=inter**-0.5)
    x_np = randn(gen, n_val, hidden)

    n = dim("n", n_val, dynamic)
    x = tensor_var("x", (n, hidden))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            gate, up = _split(bb, _linear(bb, x, w_gu, None), 2)
            gate = bb.emit(R.nn.silu(gate) if act == "silu" else R.nn.gelu(gate))
            act_out = bb.emit(R.multiply(gate, up))
            out = bb.emit_output(_linear(bb, act_out, w_down, None))
        bb.emit_func_output(out)

    def reference(x):
        gate, up = np.split(x @ w_gu.T, 2, axis=1)
        gate = gate * sigmoid_np(gate) if act == "silu" else gelu_np(gate)
        return [(gate * up) @ w_down.T]

    from onnx import helper

    act_nodes = (
        [
            helper.make_node("Sigmoid", ["gate"], ["sg"]),
            helper.make_node("Mul", ["gate", "sg"], ["ga"]),
        ]
        if act == "silu"
        else [helper.make_node("Gelu", ["gate"], ["ga"])]
    )
    nodes = [
        helper.make_node("Gemm", ["x", "w_gu"], ["y"], transB=1),
        helper.make_node("Split", ["y"], ["gate", "up"], axis=1, num_outputs=2),
        *act_nodes,
        helper.make_node("Mul", ["ga", "up"], ["a"]),
        helper.make_node("Gemm", ["a", "w_down"], ["out"], transB=1),
    ]
    model = onnx_model(
        nodes,
        [onnx_input("x", "float32", ["n", hidden])],
        [onnx_input("out", "float32", ["n", hidden])],
        {"w_gu": w_gu, "w_down": w_down},
        opset=20,
    )

    def torch_fn(torch):
        tgu, tdown = torch.from_numpy(w_gu), torch.from_numpy(w_down)
        act_fn = torch.nn.functional.silu if act == "silu" else torch.nn.functional.gelu

        def fn(x):
            gate, up = torch.nn.functional.linear(x, tgu).chunk(2, dim=1)
            return (torch.nn.functional.linear(act_fn(gate) * up, tdown),)

        return fn

    return Instance(
        name,
        bb.get(),
        {"x": x_np},
        reference,
        model,
        torch_fn,
        rtol=1e-3,
        atol=1e-3,
        expect="FuseSplitGates: gate/up GEMM + activation * up in one kernel",
    )


@register("swiglu", "gate", "SwiGLU MLP: x @ W_gu^T -> chunk(2) -> silu(gate) * up -> @ W_down^T")
def swiglu(size: str = "seed", dynamic: bool = False) -> Instance:
    return _glu_mlp("swiglu", "silu", size, dynamic)


@register("geglu", "gate", "GeGLU MLP: x @ W_gu^T -> chunk(2) -> gelu(gate) * up -> @ W_down^T")
def geglu(size: str = "seed", dynamic: bool = False) -> Instance:
    return _glu_mlp("geglu", "gelu", size, dynamic)
