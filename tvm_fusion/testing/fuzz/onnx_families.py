"""Differential fuzzer: random ONNX graphs of the patterns our passes rewrite, ours vs ORT.

Each case is a small ONNX model built here with :mod:`onnx.helper` (as :mod:`.sweep` builds its
models) from a family and a seed, checked with ``onnx.checker`` and run by ONNX Runtime (CPU) on
two feeds whose dynamic dims differ (both other than any size the graph names). The worker
imports it with :func:`tvm_fusion.load_onnx`, compiles it with the ``tvm_fusion`` pipeline for
:func:`tvm_fusion.host_target`, runs both feeds and compares with ORT (floats within ``RTOL`` /
``ATOL`` times the output's scale, integers exactly, shapes and dtypes equal).

Families (:data:`FAMILIES`):

- ``gates``: ``MatMul`` / ``Gemm`` plus a bias of every broadcast shape (``()``, ``(N,)``,
  ``(1, N)``, ``(rows, 1)``, ``(rows, N)``, constant or an input), split by ``Split`` or
  ``Slice`` into 2-4 gates, each gate through Sigmoid / Tanh / Relu / Erf / Pow / nothing,
  joined by Mul / Add (LSTM-like cells among them).
- ``gemms``: sibling GEMMs of one input (one per gate) and summed GEMMs (``x @ W1 + h @ W2``).
- ``range_gather``: ``Range -> Gather`` with every start / step sign (negative starts,
  reversals, steps of 2 and 3), bounds from ``Shape`` on a dynamic dim or constants, then
  maybe a Reshape or an elementwise op.
- ``views``: chains of Reshape / Transpose / Unsqueeze / Squeeze / Flatten around elementwise
  ops and GEMMs on 3-D inputs with symbolic leading dims.
- ``cross_entropy``: LogSoftmax + GatherElements + ReduceMean / ReduceSum + Neg, Softmax ->
  Log, NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss (every reduction, with and without
  ignore_index and class weights), on (N, C) or (B, C, S) logits, maybe from an LM-head GEMM.
- ``shape_chains``: Shape / Gather / Div / Mul / Concat / Reshape / Slice / Expand /
  ConstantOfShape / Tile / Pad / CumSum / Range on a (b, s, h) input with dynamic b, s.

Outcomes (:data:`OUTCOMES`): ``ok``; ``discarded`` (ORT itself failed: not counted as run);
``refused`` (a one-line ModelError / UsageError from us where stock TVM's importer and
pipeline fail too); ``failure`` (wrong numbers or shapes, another exception, a refusal of what
stock runs), ``crash`` (the worker died) and ``hang`` (past the per-case timeout). Cases run
in a worker subprocess that handles many of them (TVM is imported once); when it dies or
hangs the case is recorded and a new worker starts. :func:`minimise` shrinks a failing case
(outputs dropped, nodes bypassed, then the feeds' dynamic dims cut) while it keeps failing
the same way.

``python scripts/fuzz.py --minutes N`` runs it and writes ``bench/fuzz.md`` / ``.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

FAMILIES = ("gates", "gemms", "range_gather", "views", "cross_entropy", "shape_chains")
OUTCOMES = ("ok", "refused", "discarded", "failure", "crash", "hang")
FAILING = ("failure", "crash", "hang")
RTOL = 1e-4
ATOL = 1e-4  # times the largest magnitude of the reference output (at least 1)
INT64_MAX = 2**63 - 1
# sizes: odd ones, primes and 1
SIZES = (1, 2, 3, 5, 6, 7, 8, 11, 13, 16, 17, 31)
OPSET = 18


class InvalidCase(Exception):
    """The generator drew parameters that give no valid graph: draw again."""


@dataclasses.dataclass
class Case:
    """One generated graph: the model, two feeds at different dynamic sizes, what it tests."""

    family: str
    seed: int
    model: object  # onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]
    note: str = ""

    @property
    def name(self) -> str:
        return f"{self.family}-{self.seed}"

    @property
    def args(self) -> tuple:
        """What :meth:`Worker.run` takes for this case."""
        return (self.model, self.feeds)


# ---------------------------------------------------------------------------------------------
# ONNX building helpers


class _Graph:
    """Nodes, inputs, initializers under construction; fresh names."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list = []
        self.inputs: list = []
        self.inits: list = []
        self.outputs: list = []
        self._n = 0

    def name(self, base: str = "t") -> str:
        self._n += 1
        return f"{base}{self._n}"

    def node(self, op: str, inputs, n_out: int = 1, **attrs):
        from onnx import helper

        outs = [self.name(op.lower()) for _ in range(n_out)]
        # named as exporters do: the importer's errors name the node
        node = helper.make_node(op, list(inputs), outs, name=f"{op}_{outs[0]}", **attrs)
        self.nodes.append(node)
        return outs[0] if n_out == 1 else outs

    def const(self, array, base: str = "c") -> str:
        from onnx import numpy_helper

        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def i64(self, *values) -> str:
        return self.const(np.array(values, dtype="int64"), "i")

    def scalar64(self, value: int) -> str:
        return self.const(np.array(value, dtype="int64"), "s")

    def f32(self, *shape, scale: float = 1.0) -> str:
        return self.const((self.rng.standard_normal(shape) * scale).astype("float32"), "w")

    def input(self, name: str, shape, elem=None) -> str:
        from onnx import TensorProto, helper

        self.inputs.append(
            helper.make_tensor_value_info(name, elem or TensorProto.FLOAT, list(shape))
        )
        return name

    def output(self, name: str) -> None:
        from onnx import helper

        self.outputs.append(helper.make_empty_tensor_value_info(name))

    def model(self):
        import onnx
        from onnx import helper

        graph = helper.make_graph(self.nodes, "fuzz", self.inputs, self.outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        # the outputs' types from ONNX's shape inference
        inferred = onnx.shape_inference.infer_shapes(model)
        types = {v.name: v for v in inferred.graph.value_info}
        for out in model.graph.output:
            if out.name not in types or not types[out.name].type.tensor_type.HasField("shape"):
                raise InvalidCase(f"no type inferred for {out.name}")
            out.CopyFrom(types[out.name])
        return model


def _two_sizes(rng, lo: int = 1) -> tuple[int, int]:
    """Two different sizes for a dynamic dim."""
    pool = [s for s in SIZES if s >= lo]
    a, b = rng.choice(pool, 2, replace=False)
    return int(a), int(b)


def _dim(rng, name: str, static_p: float = 0.3, lo: int = 1):
    """A dim: ``(onnx dim, [size for feed 0, size for feed 1])``, static or symbolic."""
    if rng.random() < static_p:
        size = int(rng.choice([s for s in SIZES if s >= lo]))
        return size, [size, size]
    return name, list(_two_sizes(rng, lo))


def _randn(rng, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype("float32")


# ---------------------------------------------------------------------------------------------
# families

UNARY = ("Sigmoid", "Tanh", "Relu", "Erf", "Pow", "Identity", "Neg")


def _act(g: _Graph, x: str, op: str) -> str:
    if op == "Identity":
        return x
    if op == "Pow":
        return g.node("Pow", [x, g.const(np.array(float(g.rng.choice([2.0, 3.0])), "float32"))])
    return g.node(op, [x])


def _bias(g: _Graph, y: str, rows, rows_sizes, n: int, feeds) -> tuple[str, str]:
    """``y + b`` with b of a random broadcast shape; returns (sum, the shape's label)."""
    kinds = ["scalar", "n", "1n"]
    if isinstance(rows, int):
        kinds += ["rows1", "rowsn"]
    kinds += ["input_rows1", "input_rowsn"]
    kind = str(g.rng.choice(kinds))
    shapes = {"scalar": (), "n": (n,), "1n": (1, n), "rows1": (rows, 1), "rowsn": (rows, n)}
    if kind in shapes:
        b = g.f32(*shapes[kind])
    else:
        cols = 1 if kind == "input_rows1" else n
        b = g.input(g.name("bias"), [rows, cols])
        for f, r in zip(feeds, rows_sizes, strict=True):
            f[b] = _randn(g.rng, (r, cols))
    return g.node("Add", [y, b] if g.rng.random() < 0.7 else [b, y]), kind


def _gemm(g: _Graph, x: str, k: int, n: int, allow_gemm: bool) -> str:
    """x @ W as MatMul, or Gemm (transB or not) when x is 2-D."""
    if allow_gemm and g.rng.random() < 0.4:
        if g.rng.random() < 0.5:
            return g.node("Gemm", [x, g.f32(n, k, scale=k**-0.5)], transB=1)
        return g.node("Gemm", [x, g.f32(k, n, scale=k**-0.5)])
    return g.node("MatMul", [x, g.f32(k, n, scale=k**-0.5)])


def _split(g: _Graph, y: str, gates: int, h: int) -> list[str]:
    how = g.rng.integers(3)
    if how == 0:
        return list(g.node("Split", [y], n_out=gates, axis=-1, num_outputs=gates))
    if how == 1:
        outs = g.node("Split", [y, g.i64(*[h] * gates)], n_out=gates, axis=1)
        return list(outs) if gates > 1 else [outs]
    return [
        g.node(
            "Slice",
            [y, g.i64(i * h), g.i64((i + 1) * h if i + 1 < gates else INT64_MAX), g.i64(-1)],
        )
        for i in range(gates)
    ]


def _epilogue(g: _Graph, parts: list[str], feeds, rows, rows_sizes, h: int) -> str:
    """Gate math over the parts: an LSTM-like cell or a random chain of Mul/Add."""
    if len(parts) == 4 and g.rng.random() < 0.4:
        c = g.input(g.name("c"), [rows, h])
        for f, r in zip(feeds, rows_sizes, strict=True):
            f[c] = _randn(g.rng, (r, h))
        i, f_, gg, o = parts
        i, f_, o = (g.node("Sigmoid", [p]) for p in (i, f_, o))
        gg = g.node("Tanh", [gg])
        c2 = g.node("Add", [g.node("Mul", [f_, c]), g.node("Mul", [i, gg])])
        g.output(c2)
        return g.node("Mul", [o, g.node("Tanh", [c2])])
    acts = [_act(g, p, str(g.rng.choice(UNARY))) for p in parts]
    out = acts[0]
    for a in acts[1:]:
        out = g.node(str(g.rng.choice(["Mul", "Add", "Mul"])), [out, a])
    return out


def _gates(rng):
    g = _Graph(rng)
    rows, rows_sizes = _dim(rng, "rows", static_p=0.5)
    k = int(rng.choice(SIZES[1:]))
    gates = int(rng.integers(2, 5))
    h = int(rng.choice(SIZES))
    if isinstance(rows, int) and rng.random() < 0.3:
        h = rows  # rows == features: a per-row bias has the size of a per-feature one
        k = max(k, 2)
    feeds = [{}, {}]
    x = g.input("x", [rows, k])
    for f, r in zip(feeds, rows_sizes, strict=True):
        f[x] = _randn(rng, (r, k))
    y = _gemm(g, x, k, gates * h, allow_gemm=True)
    kind = "none"
    if rng.random() < 0.8:
        y, kind = _bias(g, y, rows, rows_sizes, gates * h, feeds)
    parts = _split(g, y, gates, h)
    g.output(_epilogue(g, parts, feeds, rows, rows_sizes, h))
    return g.model(), feeds, f"{gates} gates of {h}, k {k}, bias {kind}"


def _gemms(rng):
    g = _Graph(rng)
    rows, rows_sizes = _dim(rng, "rows", static_p=0.5)
    k = int(rng.choice(SIZES[1:]))
    gates = int(rng.integers(2, 5))
    h = int(rng.choice(SIZES))
    if isinstance(rows, int) and rng.random() < 0.3:
        h = rows
    feeds = [{}, {}]
    x = g.input("x", [rows, k])
    for f, r in zip(feeds, rows_sizes, strict=True):
        f[x] = _randn(rng, (r, k))
    summed = rng.random() < 0.5
    notes = []
    if summed:
        k2 = int(rng.choice(SIZES[1:]))
        hin = g.input("h", [rows, k2])
        for f, r in zip(feeds, rows_sizes, strict=True):
            f[hin] = _randn(rng, (r, k2))
        a = _gemm(g, x, k, gates * h, allow_gemm=True)
        b = _gemm(g, hin, k2, gates * h, allow_gemm=True)
        y = g.node("Add", [a, b])
        kind = "none"
        if rng.random() < 0.7:
            y, kind = _bias(g, y, rows, rows_sizes, gates * h, feeds)
        parts = _split(g, y, gates, h)
        notes.append(f"summed, bias {kind}")
    else:
        parts = []
        for _ in range(gates):
            p = _gemm(g, x, k, h, allow_gemm=True)
            kind = "none"
            if rng.random() < 0.6:
                p, kind = _bias(g, p, rows, rows_sizes, h, feeds)
            parts.append(p)
            notes.append(kind)
    g.output(_epilogue(g, parts, feeds, rows, rows_sizes, h))
    return g.model(), feeds, f"{gates} x {h}, k {k}: " + ", ".join(notes)


def _range_gather(rng):
    g = _Graph(rng)
    n, n_sizes = _dim(rng, "n", static_p=0.25, lo=2)
    b, b_sizes = _dim(rng, "b", static_p=0.5)
    axis = int(rng.integers(2))
    shape = [b, n] if axis == 1 else [n, b]
    x = g.input("x", shape)
    feeds = [{x: _randn(rng, [b_sizes[i], n_sizes[i]][:: 1 if axis == 1 else -1])} for i in (0, 1)]
    # bound expressions: ("c", k) constant k, ("n", k) n + k; negative starts count from
    # the end, a step of -1 from n - 1 to -1 is the reversal
    step = int(rng.choice([1, 1, 2, 3, -1, -1, -2]))
    if step > 0:
        start = [("c", int(rng.integers(-3, 3))), ("n", -int(rng.integers(1, 4)))][
            int(rng.integers(2))
        ]
        limit = [("n", -int(rng.integers(0, 3))), ("c", int(rng.integers(1, 4)))][
            int(rng.random() < 0.3)
        ]
    else:
        start = [("n", -int(rng.integers(1, 4))), ("c", int(rng.integers(-1, 4)))][
            int(rng.random() < 0.3)
        ]
        limit = [("c", -int(rng.integers(1, 3))), ("n", -int(rng.integers(2, 5)))][
            int(rng.random() < 0.4)
        ]
    for size in n_sizes:
        s = start[1] + (size if start[0] == "n" else 0)
        e = limit[1] + (size if limit[0] == "n" else 0)
        idx = np.arange(s, e, step)
        if idx.size == 0 or idx.min() < -size or idx.max() >= size:
            raise InvalidCase("indices out of range or empty")
    nsym = None
    if "n" in (start[0], limit[0]):
        shp = g.node("Shape", [x])
        if rng.random() < 0.5:
            nsym = g.node("Gather", [shp, g.scalar64(axis)], axis=0)
        else:  # Slice + Squeeze, as some exporters write it
            nsym = g.node(
                "Squeeze",
                [g.node("Slice", [shp, g.i64(axis), g.i64(axis + 1)]), g.i64(0)],
            )

    def bound(b_):
        kind, k = b_
        if kind == "c":
            return g.scalar64(k)
        return nsym if k == 0 else g.node("Add", [nsym, g.scalar64(k)])

    idx = g.node("Range", [bound(start), bound(limit), g.scalar64(step)])
    y = g.node("Gather", [x, idx], axis=axis)
    tail = str(rng.choice(["none", "reshape", "elementwise", "reshape_elementwise"]))
    if "reshape" in tail:
        y = g.node("Reshape", [y, g.i64(-1)])
    if "elementwise" in tail:
        y = g.node(str(rng.choice(["Tanh", "Relu", "Sigmoid"])), [y])
    g.output(y)
    note = f"axis {axis}, range({start}, {limit}, {step}), then {tail}"
    return g.model(), feeds, note


def _views(rng):
    g = _Graph(rng)
    b, b_sizes = _dim(rng, "b", static_p=0.3)
    s, s_sizes = _dim(rng, "s", static_p=0.3)
    k = int(rng.choice([2, 3, 4, 6, 8, 9, 12]))
    x = g.input("x", [b, s, k])
    feeds = [{x: _randn(rng, (b_sizes[i], s_sizes[i], k))} for i in (0, 1)]
    # the current value: its dims as (static size or None, sizes per feed)
    dims = [
        (b if isinstance(b, int) else None, b_sizes),
        (s if isinstance(s, int) else None, s_sizes),
        (k, [k, k]),
    ]
    cur = x
    ops = []
    for _ in range(int(rng.integers(2, 6))):
        op = str(
            rng.choice(
                [
                    "merge",
                    "split_last",
                    "transpose",
                    "unsqueeze",
                    "squeeze",
                    "flatten",
                    "unary",
                    "add",
                    "matmul",
                    "matmul",
                ]
            )
        )
        rank = len(dims)
        if op == "merge" and rank >= 2:
            i = int(rng.integers(rank - 1))
            merged = (
                dims[i][0] * dims[i + 1][0] if dims[i][0] and dims[i + 1][0] else None,
                [p * q for p, q in zip(dims[i][1], dims[i + 1][1], strict=True)],
            )
            new = dims[:i] + [merged] + dims[i + 2 :]
            if sum(d[0] is None for d in new) > 1 and merged[0] is None:
                continue  # two unknowns after the merge: -1 is ambiguous, 0 misplaced
            target = []
            for j, d in enumerate(new):
                if d[0] is not None:
                    target.append(d[0])
                elif j < i and dims[j][0] is None:
                    target.append(0)
                else:
                    target.append(-1)
            if target.count(-1) > 1:
                continue
            cur, dims = g.node("Reshape", [cur, g.i64(*target)]), new
        elif op == "split_last" and dims[-1][0] and dims[-1][0] % 2 == 0 and dims[-1][0] > 2:
            last = dims[-1][0]
            target = [0 if d[0] is None else d[0] for d in dims[:-1]] + [2, last // 2]
            if any(t == 0 for j, t in enumerate(target[:-2]) if dims[j][0] is None) and any(
                dims[j][0] is not None and dims[j][0] == 0 for j in range(rank - 1)
            ):
                continue
            cur = g.node("Reshape", [cur, g.i64(*target)])
            dims = dims[:-1] + [(2, [2, 2]), (last // 2, [last // 2] * 2)]
        elif op == "transpose" and rank >= 2:
            perm = [int(p) for p in rng.permutation(rank)]
            cur, dims = g.node("Transpose", [cur], perm=perm), [dims[p] for p in perm]
        elif op == "unsqueeze" and rank < 5:
            i = int(rng.integers(rank + 1))
            cur = g.node("Unsqueeze", [cur, g.i64(i)])
            dims = dims[:i] + [(1, [1, 1])] + dims[i:]
        elif op == "squeeze" and any(d[0] == 1 for d in dims) and rank > 1:
            i = [j for j, d in enumerate(dims) if d[0] == 1][0]
            cur, dims = g.node("Squeeze", [cur, g.i64(i)]), dims[:i] + dims[i + 1 :]
        elif op == "flatten" and rank >= 2:
            ax = int(rng.integers(1, rank))

            def prod(ds):
                st = 1
                for d in ds:
                    if d[0] is None:
                        st = None
                    elif st is not None:
                        st *= d[0]
                return (st, [int(np.prod([d[1][f] for d in ds])) for f in (0, 1)])

            cur, dims = g.node("Flatten", [cur], axis=ax), [prod(dims[:ax]), prod(dims[ax:])]
        elif op == "unary":
            cur = g.node(str(rng.choice(["Relu", "Sigmoid", "Tanh", "Erf"])), [cur])
        elif op == "add":
            last = dims[-1][0] or 1
            cur = g.node(str(rng.choice(["Add", "Mul"])), [cur, g.f32(last)])
        elif op == "matmul" and dims[-1][0]:
            kk, n = dims[-1][0], int(rng.choice(SIZES))
            cur = g.node("MatMul", [cur, g.f32(kk, n, scale=kk**-0.5)])
            dims = dims[:-1] + [(n, [n, n])]
            if rng.random() < 0.5:
                cur = g.node("Add", [cur, g.f32(n)])
        else:
            continue
        ops.append(op)
    if not ops:
        raise InvalidCase("no view applied")
    g.output(cur)
    return g.model(), feeds, " ".join(ops)


def _cross_entropy(rng):
    from onnx import TensorProto

    g = _Graph(rng)
    c = int(rng.choice([2, 3, 5, 7, 11, 16, 31, 97]))
    layout = str(rng.choice(["nc", "nc", "bcs"]))
    spelling = str(rng.choice(["gather_mean", "gather_sum", "softmax_log", "nll", "sce", "sce"]))
    if layout == "nc":
        n, n_sizes = _dim(rng, "n", static_p=0.3)
        lshape, tshape = [n, c], [n]
        lsizes = [(r, c) for r in n_sizes]
        tsizes = [(r,) for r in n_sizes]
    else:
        bb, b_sizes = _dim(rng, "b", static_p=0.4)
        s, s_sizes = _dim(rng, "s", static_p=0.3)
        lshape, tshape = [bb, s, c], [bb, s]
        lsizes = [(b_sizes[i], s_sizes[i], c) for i in (0, 1)]
        tsizes = [(b_sizes[i], s_sizes[i]) for i in (0, 1)]
        if spelling.startswith("gather") or spelling == "softmax_log":
            spelling = "nll"
    feeds = [{}, {}]
    if rng.random() < 0.3:  # an LM head: logits = x @ W
        k = int(rng.choice([3, 8, 13]))
        x = g.input("x", lshape[:-1] + [k])
        for i in (0, 1):
            feeds[i][x] = _randn(rng, lsizes[i][:-1] + (k,))
        logits = g.node("MatMul", [x, g.f32(k, c, scale=k**-0.5)])
    else:
        logits = g.input("logits", lshape)
        for i in (0, 1):
            feeds[i][logits] = _randn(rng, lsizes[i], scale=float(rng.choice([1.0, 4.0])))
    target = g.input("target", tshape, TensorProto.INT64)
    ignore = int(rng.choice([-100, 0, 1])) if rng.random() < 0.4 else None
    if spelling in ("gather_mean", "gather_sum", "softmax_log"):
        ignore = None
    for i in (0, 1):
        t = rng.integers(0, c, size=tsizes[i]).astype("int64")
        if ignore is not None and t.size > 1:
            t.flat[rng.integers(0, t.size, size=t.size // 3 + 1)[:-1]] = ignore
            if (t == ignore).all():
                t.flat[0] = (ignore + 1) % c if ignore >= 0 else 0
        feeds[i][target] = t
    reduction = str(rng.choice(["mean", "sum", "none"]))
    weights = g.f32(c) if rng.random() < 0.3 and spelling in ("nll", "sce") else None
    if weights is not None:  # positive weights: a mean's denominator stays away from 0
        g.inits[-1].CopyFrom(
            __import__("onnx").numpy_helper.from_array(
                (rng.random(c) + 0.5).astype("float32"), weights
            )
        )
    if layout == "bcs":
        logits = g.node("Transpose", [logits], perm=[0, 2, 1])
    attrs = {"reduction": reduction}
    if ignore is not None:
        attrs["ignore_index"] = ignore
    if spelling in ("gather_mean", "gather_sum", "softmax_log"):
        if spelling == "softmax_log":
            logp = g.node("Log", [g.node("Softmax", [logits], axis=-1)])
        else:
            logp = g.node("LogSoftmax", [logits], axis=-1)
        picked = g.node("GatherElements", [logp, g.node("Unsqueeze", [target, g.i64(1)])], axis=1)
        picked = g.node("Squeeze", [picked, g.i64(1)])
        red = "ReduceSum" if spelling == "gather_sum" else "ReduceMean"
        out = g.node("Neg", [g.node(red, [picked, g.i64(0)], keepdims=0)])
        note = spelling
    elif spelling == "nll":
        logp = g.node("LogSoftmax", [logits], axis=1)
        out = g.node(
            "NegativeLogLikelihoodLoss", [logp, target] + ([weights] if weights else []), **attrs
        )
        note = f"nll {reduction} ignore {ignore} weights {weights is not None}"
    else:
        ins = [logits, target] + ([weights] if weights else [])
        two = rng.random() < 0.3
        res = g.node("SoftmaxCrossEntropyLoss", ins, n_out=2 if two else 1, **attrs)
        out = res[0] if two else res
        if two:
            g.output(res[1])
        note = f"sce {reduction} ignore {ignore} weights {weights is not None} logp {two}"
    g.output(out)
    return g.model(), feeds, f"{layout} C={c}: {note}"


def _shape_chains(rng):
    from onnx import TensorProto, helper

    g = _Graph(rng)
    b, b_sizes = _dim(rng, "b", static_p=0.3)
    s, s_sizes = _dim(rng, "s", static_p=0.3, lo=2)
    h = int(rng.choice([2, 3, 4, 5, 8]))
    x = g.input("x", [b, s, h])
    feeds = [{x: _randn(rng, (b_sizes[i], s_sizes[i], h))} for i in (0, 1)]
    shp = g.node("Shape", [x])

    def dim(i):  # a scalar int64 from Shape
        return g.node("Gather", [shp, g.scalar64(i)], axis=0)

    def vec(*items):  # Concat of 1-D pieces: scalars are unsqueezed, ints constant
        pieces = [
            g.i64(it) if isinstance(it, int) else g.node("Unsqueeze", [it, g.i64(0)])
            for it in items
        ]
        return pieces[0] if len(pieces) == 1 else g.node("Concat", pieces, axis=0)

    chains = rng.choice(
        ["reshape", "halves", "expand", "const_of_shape", "tile", "pad", "cumsum", "range"],
        size=int(rng.integers(1, 4)),
        replace=False,
    )
    for chain in chains:
        if chain == "reshape":  # (b*s, h) and back
            flat = g.node("Reshape", [x, vec(g.node("Mul", [dim(0), dim(1)]), h)])
            y = g.node("Relu", [flat])
            if rng.random() < 0.5:
                y = g.node("Reshape", [y, vec(dim(0), -1, h)])
            g.output(y)
        elif chain == "halves":  # Slice(0, s/2) and Slice(s/2, 2*(s/2) or end)
            half = g.node("Div", [dim(1), g.scalar64(2)])
            hv = g.node("Unsqueeze", [half, g.i64(0)])
            if all(v % 2 == 0 for v in s_sizes):
                end = g.i64(INT64_MAX)
            else:
                end = g.node("Mul", [hv, g.i64(2)])
            a = g.node("Slice", [x, g.i64(0), hv, g.i64(1)])
            c = g.node("Slice", [x, hv, end, g.i64(1)])
            if all(v >= 2 for v in s_sizes):
                g.output(g.node(str(rng.choice(["Add", "Mul", "Sub"])), [a, c]))
            else:
                g.output(g.node("Concat", [a, c], axis=1))
        elif chain == "expand":
            y = g.f32(1, 1, h) if rng.random() < 0.5 else g.f32(h)
            g.output(g.node("Add", [x, g.node("Expand", [y, shp])]))
        elif chain == "const_of_shape":
            val = helper.make_tensor("value", TensorProto.FLOAT, [1], [float(rng.choice([1, 2]))])
            mask = g.node("ConstantOfShape", [vec(dim(0), dim(1))], value=val)
            mask = g.node("Unsqueeze", [mask, g.i64(-1)])
            g.output(g.node("Mul", [x, mask]))
        elif chain == "tile":  # (1, h) rows tiled b times
            row = g.f32(1, h)
            g.output(g.node("Tile", [row, vec(dim(0), 1)]))
        elif chain == "pad":  # pad s up to a multiple of m
            m = int(rng.choice([2, 3, 4]))
            sv = dim(1)
            up = g.node(
                "Mul",
                [
                    g.node("Div", [g.node("Add", [sv, g.scalar64(m - 1)]), g.scalar64(m)]),
                    g.scalar64(m),
                ],
            )
            amount = g.node("Sub", [up, sv])
            pads = vec(0, 0, 0, 0, amount, 0)
            g.output(g.node("Pad", [x, pads, g.const(np.array(0.5, "float32"))]))
        elif chain == "cumsum":  # OPT's positions: cumsum of a ones mask, minus 1
            val = helper.make_tensor("value", TensorProto.INT64, [1], [1])
            ones = g.node("ConstantOfShape", [vec(dim(0), dim(1))], value=val)
            pos = g.node("Sub", [g.node("CumSum", [ones, g.scalar64(1)]), g.i64(1)])
            table = g.f32(max(s_sizes) + 1, h)
            g.output(g.node("Add", [x, g.node("Gather", [table, pos], axis=0)]))
        elif chain == "range":
            pos = g.node("Range", [g.scalar64(0), dim(1), g.scalar64(1)])
            pos = g.node("Expand", [g.node("Unsqueeze", [pos, g.i64(0)]), vec(dim(0), dim(1))])
            posf = g.node("Cast", [pos], to=TensorProto.FLOAT)
            g.output(g.node("Add", [x, g.node("Unsqueeze", [posf, g.i64(-1)])]))
    return g.model(), feeds, " ".join(str(c) for c in chains)


def family_builders(scope: dict, families=FAMILIES) -> dict[str, Callable]:
    """The builder of each of ``families`` in a fuzzer module: ``scope["_" + family]`` (its
    globals)."""
    return {family: scope[f"_{family}"] for family in families}


def draw(
    builders: dict[str, Callable], family: str, seed: int, stream=0, before=None, what="graph"
):
    """``builders[family](rng)`` for ``seed``, deterministic: the generator is seeded by
    ``(stream + the family's index in builders, seed)`` and the builder called again (at most
    100 times) while it raises :class:`InvalidCase`; ``before()`` runs before each call."""
    if family not in builders:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(builders)}")
    rng = np.random.default_rng([stream + list(builders).index(family), seed])
    for _ in range(100):
        if before is not None:
            before()
        try:
            return builders[family](rng)
        except InvalidCase:
            continue
    raise RuntimeError(f"{family} seed {seed}: no valid {what} in 100 draws")


_BUILDERS = family_builders(globals())


def generate(family: str, seed: int) -> Case:
    """The case of ``family`` for ``seed``: deterministic; redraws until the graph is valid."""
    import onnx

    model, feeds, note = draw(_BUILDERS, family, seed)
    onnx.checker.check_model(model, full_check=True)
    return Case(family, seed, model, feeds, note)


# ---------------------------------------------------------------------------------------------
# running one case (in the worker)


def ort_outputs(model, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 4
    # ORT's graph optimisations are off: at ORT_ENABLE_ALL onnxruntime 1.31 gathers nothing
    # from Range(n - 2, -2, -1) -> Gather (an empty result where ONNX's reference has n rows)
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def compare(outputs, reference, ref_name: str = "ORT") -> str | None:
    """None when ``outputs`` match ``reference`` (from ``ref_name``), else why not (one line)."""
    if len(outputs) != len(reference):
        return f"{len(outputs)} outputs, {ref_name} has {len(reference)}"
    for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
        out, ref = np.asarray(out), np.asarray(ref)
        if out.shape != ref.shape:
            return f"output {i}: shape {out.shape}, {ref_name} {ref.shape}"
        if out.dtype != ref.dtype:
            return f"output {i}: dtype {out.dtype}, {ref_name} {ref.dtype}"
        if not out.size:
            continue
        if np.issubdtype(ref.dtype, np.integer) or ref.dtype == np.bool_:
            if not np.array_equal(out, ref):
                return f"output {i}: {int((out != ref).sum())} of {ref.size} integers differ"
            continue
        finite = np.isfinite(ref)
        scale = max(1.0, float(np.abs(ref[finite]).max()) if finite.any() else 1.0)
        if not np.allclose(out, ref, rtol=RTOL, atol=ATOL * scale, equal_nan=True):
            err = np.abs(out.astype("float64") - ref)
            return f"output {i}: max abs error {np.nanmax(err):.3g} (scale {scale:.3g})"
    return None


def _run_tvm(mod, pipeline: str, feeds) -> list[list[np.ndarray]]:
    import tvm

    from ..build import engine
    from ..target import host_target

    compiled = engine.compile_module(mod, host_target(), pipeline)
    vm = compiled.vm()
    results = []
    for feed in feeds:
        args = [tvm.runtime.tensor(a, tvm.cpu()) for a in feed.values()]
        results.append(engine.as_list(vm["main"](*args)))
    return results


def _stock_runs(model, feeds) -> bool:
    """Whether stock TVM (its importer and pipeline) runs ``model`` and matches ORT."""
    from ..frontend.onnx_ops import stock_from_onnx

    try:
        outs = _run_tvm(stock_from_onnx(model), "stock", feeds)
        refs = [ort_outputs(model, f) for f in feeds]
    except Exception:
        return False
    return all(compare(o, r) is None for o, r in zip(outs, refs, strict=True))


def run_case(model, feeds, engine_fn: Callable | None = None) -> tuple[str, str]:
    """(outcome, one-line reason) of one case; ``engine_fn(model, feeds)`` replaces ours
    (load_onnx + the tvm_fusion pipeline) in tests of the checker."""
    from ..errors import TvmFusionError, first_line

    order = [i.name for i in model.graph.input]  # the imported function's parameters
    feeds = [{name: f[name] for name in order} for f in feeds]
    try:
        refs = [ort_outputs(model, f) for f in feeds]
    except Exception as err:
        return "discarded", f"ORT: {first_line(err)}"
    try:
        if engine_fn is not None:
            outs = engine_fn(model, feeds)
        else:
            from ..frontend.load import load_onnx

            outs = _run_tvm(load_onnx(model), "tvm_fusion", feeds)
    except TvmFusionError as err:
        if _stock_runs(model, feeds):
            return "failure", f"refused, but stock TVM runs it: {err}"
        return "refused", str(err)
    except Exception as err:
        return "failure", f"{type(err).__name__}: {first_line(err)}"
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        why = compare(out, ref)
        if why:
            sizes = {k: v.shape for k, v in feeds[i].items()}
            return "failure", f"wrong result on feed {i} {sizes}: {why}"
    return "ok", ""


# ---------------------------------------------------------------------------------------------
# files of a case


def save_case(directory: Path, model, feeds, reason: str = "") -> Path:
    """``model.onnx``, ``inputs.npz`` (``0/x``, ``1/x``: the two feeds) and ``reason.txt``."""
    import onnx

    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(model, directory / "model.onnx")
    arrays = {f"{i}/{k}": v for i, feed in enumerate(feeds) for k, v in feed.items()}
    np.savez(directory / "inputs.npz", **arrays)
    if reason:
        (directory / "reason.txt").write_text(reason.splitlines()[0] + "\n")
    return directory


def load_case(directory: Path):
    import onnx

    model = onnx.load(directory / "model.onnx")
    feeds: list[dict] = [{}, {}]
    with np.load(directory / "inputs.npz") as data:
        for key in data.files:
            i, name = key.split("/", 1)
            feeds[int(i)][name] = data[key]
    return model, feeds


# ---------------------------------------------------------------------------------------------
# the worker process and its pool


def _function(spec: str) -> Callable:
    """The function named ``"module:function"``."""
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def _worker_main(
    fd: int,
    runner: str = "tvm_fusion.testing.fuzz:run_case",
    loader: str = "tvm_fusion.testing.fuzz:load_case",
) -> None:
    """Reads case directories from stdin, writes one JSON line per case to ``fd``;
    ``runner`` ("module:function") runs a case (tests swap it) on what ``loader`` reads
    from its directory."""
    import logging

    logging.disable(logging.CRITICAL)
    import tvm_fusion  # noqa: F401  (TVM: imported once, before the first case's clock)
    import tvm_fusion.schedule  # noqa: F401  (imports every target's tensor intrinsics: slow)

    run, load = _function(runner), _function(loader)
    out = os.fdopen(fd, "w", buffering=1)
    out.write('{"ready": true}\n')
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        try:
            outcome, reason = run(*load(Path(path)))
        except Exception as err:  # the harness itself: reported as a failure
            outcome, reason = "failure", f"harness: {type(err).__name__}: {err}"
        out.write(json.dumps({"outcome": outcome, "reason": reason.replace("\n", " ")}) + "\n")


class Worker:
    """A subprocess running many cases; ``run`` restarts it after a crash or a hang.
    ``save(directory, *case)`` writes a case where the worker's ``loader`` reads it."""

    STARTUP_S = 1200.0  # importing TVM on a loaded machine (8 minutes seen at load 9)

    def __init__(
        self,
        timeout_s: float = 120.0,
        threads: int = 1,
        runner: str = "tvm_fusion.testing.fuzz:run_case",
        env: dict | None = None,
        save: Callable | None = None,
        loader: str = "tvm_fusion.testing.fuzz:load_case",
    ):
        self.timeout_s = timeout_s
        self.runner = runner
        self.loader = loader
        self.save = save or save_case
        self.extra_env = env or {}
        self.threads = threads
        self.proc: subprocess.Popen | None = None
        self.rfd: int | None = None
        self._buf = b""
        self.tmp = Path(tempfile.mkdtemp(prefix="tvm_fusion_fuzz_"))
        self._n = 0

    def _start(self) -> None:
        rfd, wfd = os.pipe()
        env = dict(os.environ, TVM_NUM_THREADS=str(self.threads), **self.extra_env)
        code = (
            "import tvm_fusion.testing.fuzz as f; "
            f"f._worker_main({wfd}, {self.runner!r}, {self.loader!r})"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(wfd,),
            env=env,
            cwd=os.getcwd(),
        )
        os.close(wfd)
        self.rfd, self._buf = rfd, b""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        if self.rfd is not None:
            os.close(self.rfd)
            self.rfd = None

    def close(self) -> None:
        self.stop()
        import shutil

        shutil.rmtree(self.tmp, ignore_errors=True)

    def _read_line(self, timeout_s: float) -> bytes | None:
        """The worker's next line; None past ``timeout_s``, b"" when it died."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.rfd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self.rfd, 65536)
                if not chunk:
                    return b""
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def run(self, *case) -> tuple[str, str]:
        """(outcome, reason) of one case (``model, feeds`` for ONNX), in the worker."""
        self._n += 1
        case_dir = self.save(self.tmp / f"case{self._n % 4}", *case)
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self._start()
            if not self._read_line(self.STARTUP_S):  # imports done
                self.stop()
                raise RuntimeError("the fuzz worker did not start")
        try:
            self.proc.stdin.write(f"{case_dir}\n".encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.stop()
            return "crash", "worker died before reading the case"
        line = self._read_line(self.timeout_s)
        if line is None:
            self.stop()
            return "hang", f"no result in {self.timeout_s:.0f} s"
        if not line:
            code = self.proc.wait()
            self.stop()
            return "crash", f"worker died (exit status {code})"
        result = json.loads(line)
        return result["outcome"], result["reason"]


# ---------------------------------------------------------------------------------------------
# minimisation


def _dead_code(model) -> None:
    graph = model.graph
    live = {o.name for o in graph.output}
    keep = []
    for node in reversed(list(graph.node)):
        if any(o in live for o in node.output):
            keep.append(node)
            live.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(keep))
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    inits = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    inputs = [v for v in graph.input if v.name in used]
    del graph.input[:]
    graph.input.extend(inputs)


def _shapes(model) -> dict[str, tuple]:
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    out = {}
    for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        t = v.type.tensor_type
        if not t.HasField("shape"):
            continue
        dims = tuple(
            d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in t.shape.dim
        )
        out[v.name] = (t.elem_type, dims)
    for t in model.graph.initializer:
        out[t.name] = (t.data_type, tuple(t.dims))
    return out


def _candidates(model):
    """Smaller models: one graph output dropped, or one node bypassed (its output replaced by
    one of its inputs of the same type and shape)."""
    import copy

    graph = model.graph
    if len(graph.output) > 1:
        for i in range(len(graph.output)):
            m = copy.deepcopy(model)
            del m.graph.output[i]
            _dead_code(m)
            yield m
    shapes = _shapes(model)
    for idx in reversed(range(len(graph.node))):
        node = graph.node[idx]
        if len(node.output) != 1 or node.output[0] not in shapes:
            continue
        for src in node.input:
            if src and shapes.get(src) == shapes[node.output[0]] and "?" not in str(shapes[src]):
                m = copy.deepcopy(model)
                old = m.graph.node[idx].output[0]
                del m.graph.node[idx]
                for n in m.graph.node:
                    for j, name in enumerate(n.input):
                        if name == old:
                            n.input[j] = src
                for o in m.graph.output:
                    if o.name == old:
                        o.name = src
                if len({o.name for o in m.graph.output}) != len(m.graph.output) or any(
                    o.name in {i.name for i in m.graph.input} for o in m.graph.output
                ):
                    continue
                _dead_code(m)
                yield m
                break


def _valid(model, feeds) -> bool:
    import onnx

    try:
        onnx.checker.check_model(model, full_check=True)
        for f in feeds:
            ort_outputs(
                model, {k: v for k, v in f.items() if k in {i.name for i in model.graph.input}}
            )
    except Exception:
        return False
    return True


def _smaller_feeds(model, feeds):
    """Feeds with one dynamic dim of one feed cut down (to 1, 2 or half), every input that
    names the dim sliced alike."""
    axes: dict[str, list[tuple[str, int]]] = {}
    for v in model.graph.input:
        for ax, d in enumerate(v.type.tensor_type.shape.dim):
            if d.dim_param:
                axes.setdefault(d.dim_param, []).append((v.name, ax))
    for where in axes.values():
        for i, feed in enumerate(feeds):
            size = feed[where[0][0]].shape[where[0][1]]
            for new in sorted({1, 2, size // 2} - {0}):
                if new >= size:
                    continue
                cut = dict(feed)
                for name, ax in where:
                    cut[name] = np.take(feed[name], np.arange(new), axis=ax)
                yield feeds[:i] + [cut] + feeds[i + 1 :]


def minimise(
    model, feeds, outcome: str, run: Callable, budget_s: float = 120.0
) -> tuple[object, list[dict], str]:
    """Greedily drop outputs and nodes, then shrink the dynamic dims of the feeds, while
    ``run(model, feeds)`` keeps giving ``outcome`` (within ``budget_s``); returns the smallest
    (model, feeds, reason) found."""
    deadline = time.monotonic() + budget_s
    best, reason = model, ""
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for cand in _candidates(best):
            if time.monotonic() > deadline:
                break
            names = {i.name for i in cand.graph.input}
            cfeeds = [{k: v for k, v in f.items() if k in names} for f in feeds]
            if len(cand.graph.node) >= len(best.graph.node) and len(cand.graph.output) >= len(
                best.graph.output
            ):
                continue
            if not _valid(cand, cfeeds):
                continue
            got, why = run(cand, cfeeds)
            if got == outcome:
                best, feeds, reason, improved = cand, cfeeds, why, True
                break
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for cfeeds in _smaller_feeds(best, feeds):
            if time.monotonic() > deadline:
                break
            if not _valid(best, cfeeds):
                continue
            got, why = run(best, cfeeds)
            if got == outcome:
                feeds, reason, improved = cfeeds, why, True
                break
    return best, feeds, reason


# ---------------------------------------------------------------------------------------------
# a fuzzing session


@dataclasses.dataclass
class Totals:
    counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    failures: list[dict] = dataclasses.field(default_factory=list)
    refusals: list[dict] = dataclasses.field(default_factory=list)

    def add(self, family: str, outcome: str) -> None:
        row = self.counts.setdefault(family, dict.fromkeys(OUTCOMES, 0))
        row[outcome] += 1


FRONTENDS = ("onnx", "torch")


def frontend_module(frontend: str):
    """The module that generates and runs the cases of ``frontend``: this one for ONNX,
    :mod:`tvm_fusion.testing.fuzz_torch` for torch.export. Each has ``FAMILIES``, ``generate``,
    ``RUNNER`` / ``LOADER`` / ``save_case`` (the worker's side) and ``save_failure``."""
    if frontend == "onnx":
        return sys.modules[__name__]
    if frontend == "torch":
        from . import fuzz_torch

        return fuzz_torch
    raise ValueError(f"unknown frontend {frontend!r}; known: {', '.join(FRONTENDS)}")


RUNNER = "tvm_fusion.testing.fuzz:run_case"
LOADER = "tvm_fusion.testing.fuzz:load_case"


def save_failure(
    directory: Path, case: Case, outcome: str, reason: str, worker, minimise_s: float
) -> dict:
    """Minimise a failing ONNX case and save it under ``directory``; what the report adds."""
    model, feeds, why = minimise(case.model, case.feeds, outcome, worker.run, minimise_s)
    save_case(directory, model, feeds, f"{outcome}: {why or reason}")
    return {"minimised_reason": why or reason, "nodes": len(model.graph.node)}


def fuzz(
    families=None,
    seed: int = 0,
    minutes: float | None = None,
    cases: int | None = None,
    out_dir: Path | None = None,
    timeout_s: float = 120.0,
    minimise_s: float = 120.0,
    log: Callable[[str], None] = lambda _m: None,
    progress: Callable[[Totals], None] = lambda _t: None,
    frontend: str = "onnx",
) -> Totals:
    """Cases ``seed, seed + 1, ...`` round-robin over ``families`` (default: all of
    ``frontend``'s) until ``minutes`` or ``cases`` run out; failures saved into ``out_dir``
    (``FAMILY-SEED/``; ONNX cases minimised first)."""
    front = frontend_module(frontend)
    families = tuple(families or front.FAMILIES)
    totals = Totals()
    deadline = time.monotonic() + minutes * 60 if minutes else None
    worker = Worker(timeout_s, runner=front.RUNNER, loader=front.LOADER, save=front.save_case)
    i = 0
    try:
        while True:
            if cases is not None and i >= cases * len(families):
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            family, case_seed = families[i % len(families)], seed + i // len(families)
            i += 1
            case = front.generate(family, case_seed)
            outcome, reason = worker.run(*case.args)
            totals.add(family, outcome)
            entry = {"case": case.name, "note": case.note, "reason": reason}
            if outcome == "refused":
                totals.refusals.append(entry)
            if outcome in FAILING:
                log(f"{outcome}: {case.name} ({case.note}): {reason}")
                if out_dir is not None:
                    entry.update(
                        front.save_failure(
                            out_dir / case.name, case, outcome, reason, worker, minimise_s
                        )
                    )
                entry["outcome"] = outcome
                totals.failures.append(entry)
            progress(totals)
    finally:
        worker.close()
    return totals
