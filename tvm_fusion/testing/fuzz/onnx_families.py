"""The ONNX fuzzer's families: one builder ``_FAMILY(rng) -> (model, feeds, note)`` each, built
with :class:`.onnx_graph._Graph` (raising :class:`~.common.InvalidCase` where the drawn
parameters give no valid graph; :func:`.onnx_frontend.generate` draws again).

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
  ConstantOfShape / Tile / Pad / CumSum / Range on a (b, s, h) input with dynamic b, s; the
  halves of an axis also on the static h (or a static s) inside the dynamic shape, sliced "to
  the end" by INT64_MAX, 2**62, 2**31 - 1 or 2**31; maybe a Reshape to a target computed from
  an int64 input by a sign test (Where / Less / Greater / Neg / Abs).
"""

from __future__ import annotations

import numpy as np

from .common import SIZES, InvalidCase
from .onnx_graph import INT64_MAX, _dim, _Graph, _randn

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


# "to the end" as exporters write it: INT64_MAX (torch.onnx), 2**62, 2**31 - 1 (int32 max)
_TO_THE_END = (INT64_MAX, 2**62, 2**31 - 1, 2**31)


def _halves_to_the_end(g: _Graph, rng, x: str, shp: str, axis: int, dim) -> None:
    """``x[.., :n // 2]`` and ``x[.., n // 2:END]`` on ``axis`` (``n = Shape(x)[axis]``, static
    or dynamic inside a dynamic shape), END one of :data:`_TO_THE_END`, the index a scalar
    (unsqueezed) or a 1-element vector (``Shape(x)[[axis]] / 2``: the (batch, 4, 2) form that
    segfaulted in compile, issue #40). ``dim`` is the axis' ONNX dim: halves of a static even
    axis are combined by Add / Sub / Mul, the others concatenated back."""
    if rng.random() < 0.5:
        half = g.node("Div", [g.node("Gather", [shp, g.i64(axis)], axis=0), g.i64(2)])
    else:
        n = g.node("Gather", [shp, g.scalar64(axis)], axis=0)
        half = g.node("Unsqueeze", [g.node("Div", [n, g.scalar64(2)]), g.i64(0)])
    end = g.i64(int(rng.choice(_TO_THE_END)))
    ax = g.i64(axis)
    a = g.node("Slice", [x, g.i64(0), half, ax])
    c = g.node("Slice", [x, half, end, ax])
    if isinstance(dim, int) and dim % 2 == 0:
        g.output(g.node(str(rng.choice(["Add", "Mul", "Sub"])), [a, c]))
    else:
        g.output(g.node("Concat", [a, c], axis=axis))


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
            # drawn after the first pair: the seeds that found bugs in it build it as before
            if rng.random() < 0.7:
                # on a static axis: a second pair on the dynamic s fails at run time
                # (match_cast, "shape[1] mismatch"; left for now, see the branch's report)
                axis = 1 if isinstance(s, int) and rng.random() < 0.5 else 2
                _halves_to_the_end(g, rng, x, shp, axis, h if axis == 2 else s)
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
    notes = [str(c) for c in chains]
    # drawn after the chains: the earlier seeds build the graphs they built before
    if rng.random() < 0.5:
        notes.append(_signed_target(g, rng, x, feeds, b_sizes, s_sizes, h))
    return g.model(), feeds, " ".join(notes)


def _signed_target(g: _Graph, rng, x: str, feeds, b_sizes, s_sizes, h: int) -> str:
    """``Reshape(x, t)`` with ``t`` computed from an int64 input ``v`` by a sign test:
    ``Where(Less(v, 0), Neg(v), v)``, ``Where(Greater(v, 0), v, Neg(v))`` or ``Abs(v)`` (issue
    #40: PlaceShapeOnHost read ``v`` into dims, which TVM takes as >= 0, and the sign test's
    Select segfaulted CanonicalizeBindings). ``v`` holds (b*s, h), (b, s*h) or (0, s*h) (a 0
    copies the input's dim), each entry negated or not per feed."""
    from onnx import TensorProto

    v = g.input("target", [2], TensorProto.INT64)
    form = str(rng.choice(["where_less", "where_greater", "abs"]))
    if form == "where_less":
        t = g.node("Where", [g.node("Less", [v, g.scalar64(0)]), g.node("Neg", [v]), v])
    elif form == "where_greater":
        t = g.node("Where", [g.node("Greater", [v, g.scalar64(0)]), v, g.node("Neg", [v])])
    else:
        t = g.node("Abs", [v])
    layout = str(rng.choice(["bs_h", "b_sh", "0_sh"]))
    for i, feed in enumerate(feeds):
        b_, s_ = b_sizes[i], s_sizes[i]
        dims = {"bs_h": [b_ * s_, h], "b_sh": [b_, s_ * h], "0_sh": [0, s_ * h]}[layout]
        signs = np.where(rng.random(2) < 0.5, -1, 1)
        feed[v] = (np.array(dims, "int64") * signs).astype("int64")
    g.output(g.node("Reshape", [x, t]))
    return f"signed {form} {layout}"
