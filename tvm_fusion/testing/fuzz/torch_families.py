"""Differential fuzzer, torch.export side: random small ``torch.nn.Module`` graphs of the
patterns our passes rewrite, exported and compiled by us, against torch eager.

Each case is a module built here from a family and a seed (weights from ``torch.manual_seed``),
its inputs' dims either static or dynamic (``torch.export.Dim.DYNAMIC``, or a named ``Dim``
where another input's dim is derived from it, ``2 * s``), and a drawn import: with torch's
decompositions (``from_exported_program``'s default, what :func:`tvm_fusion.load_model` does:
``addmm``, ``_unsafe_view``, ``_log_softmax``, ``nll_loss_forward`` ...) or without (``linear``,
``chunk``, ``unbind``, ``cross_entropy_loss`` ... as exported). The worker exports the module
at an example size that no feed uses, picks two feeds whose dynamic sizes the exported program
accepts (sizes from :data:`tvm_fusion.testing.fuzz.SIZES`: odd ones, primes and 1), imports it with
:func:`tvm_fusion.frontend.import_exported_program`, compiles it with the ``tvm_fusion``
pipeline for :func:`tvm_fusion.host_target`, and compares both feeds' outputs with the eager
module's (:func:`tvm_fusion.testing.fuzz.compare`).

Families (:data:`FAMILIES`, the ONNX fuzzer's kinds in torch's spellings):

- ``gates``: ``Linear`` (bias or not), ``F.linear``, ``addmm`` or ``x @ W.t() + b`` into
  2-4 gates by ``chunk``, ``split`` (int or sizes), ``unbind`` of a view, ``tensor_split`` or
  slices; then an LSTM cell, a GRU cell (a second GEMM of ``h``), SwiGLU, GeGLU (erf or tanh)
  or a random chain of activations (sigmoid, tanh, relu, silu, gelu, square) joined by
  mul / add / sub; 2-D or 3-D inputs.
- ``gemms``: sibling ``Linear`` s of one input, summed GEMMs (``lin(x) + lin(h)``), and
  ``nn.LSTMCell`` / ``nn.GRUCell`` / ``nn.RNNCell``.
- ``cross_entropy``: ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` (reduction none / sum /
  mean, ``ignore_index``, ``label_smoothing``, class weights), ``nll_loss(log_softmax)``,
  ``-log_softmax.gather``, ``logsumexp - gather``, ``log(softmax)``; on (N, C) logits, (B, S, C)
  viewed as (B * S, C) or permuted to (B, C, S); maybe after an LM-head ``Linear``.
- ``range_gather``: ``x[..., arange(a, b, s)]``, ``index_select`` and ``x[idx]`` with bounds
  from a dynamic ``x.shape`` or constants, steps 1-3 and reversals, then a reshape or an
  activation.
- ``views``: ``view`` / ``reshape`` / ``flatten`` / ``transpose`` / ``permute`` /
  ``unsqueeze`` / ``squeeze`` / ``expand`` chains around elementwise ops and matmuls.
- ``shape_chains``: ``sym_size`` arithmetic on a (b, s, h) input with dynamic b, s: reshapes
  to (b * s, h), halves ``x[:, :s // 2]``, GPT-2's shift ``x[:, 1:] - x[:, :-1]``, masks of
  ``new_ones((b, s))``, ``arange(s)`` positions, cumsum positions into a table, ``F.pad`` up to
  a multiple, ``repeat``, a second input of ``2 * s`` rows.
- ``dtypes`` (torch only, not in the ONNX fuzzer): integer, boolean and mixed-float
  arithmetic as models write it, on a float (b, s, h) input, int64 / int32 ids in
  [-scale, scale] and a 0 / 1 mask (int64, int32, bool or float32; each row's first 1), and
  a float16 / float32 input for the mixed chains: T5's and DeBERTa-v2's relative-position
  buckets (abs, sign, log, ceil, ``.to(long)``, ``min``, ``where``; bucket parameters whose
  boundaries are no exact floats), a mask made a float bias (``(1 - mask) * -1e4``,
  ``finfo.min``, ``masked_fill``, ``~mask.bool()``, ``where``), index arithmetic (``//``,
  ``%``, ``div`` with a rounding mode, ``remainder`` / ``fmod``, ``int / k``, ``int * 0.5``),
  position ids (RoBERTa's ``cumsum(mask) * mask``, ``arange * k``, ``pid / s``), float16 with
  float32 / int / mask operands, 0-dim tensors of another dtype (``torch.tensor(0.5,
  dtype=float64)``), ``sum`` / ``mean`` of bool / int (with ``dtype=``), and comparisons of
  int / bool tensors with floats (``ids < 2.5``, ``x[..., -1]``, ``maximum(int, float)``).

Outcomes as :mod:`tvm_fusion.testing.fuzz`: ``discarded`` when torch itself cannot run or export the
module (or accepts no two feed sizes); ``refused`` when we fail with a one-line error where
stock TVM (``from_exported_program`` without our converters, and its default pipeline) fails
too. Failing cases are not
minimised: ``--seed`` reproduces one, and ``save_failure`` keeps the exported program.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .fuzz import FAMILIES as ONNX_FAMILIES
from .fuzz import SIZES, InvalidCase, compare, draw, family_builders

# the ONNX fuzzer's families, then those of torch only
FAMILIES = (*ONNX_FAMILIES, "dtypes")
RUNNER = "tvm_fusion.testing.fuzz_torch:run_case"
LOADER = "tvm_fusion.testing.fuzz_torch:load_case"
# the size dynamic dims are exported at: none of SIZES, so no feed is the traced size and no
# static size of the graph equals it by chance (torch would tie the two)
EXAMPLE_SIZE = 10
DIM_MAX = 64


@dataclasses.dataclass
class Input:
    """A graph input: dims are ints (static), names (dynamic) or (name, factor) (derived);
    ``kind`` float (standard normal times ``scale``, in ``dtype``), target (int64 classes, some
    set to ``ignore``), int (integers in [-scale, scale], in ``dtype``) or mask (0 / 1 in
    ``dtype``, each row's first 1)."""

    shape: list
    kind: str = "float"
    scale: float = 1.0
    classes: int = 0
    ignore: int | None = None
    dtype: str = "float32"


@dataclasses.dataclass
class Spec:
    """What a family builds: the module, its inputs and how the case imports."""

    module: object  # torch.nn.Module
    inputs: list[Input]
    note: str
    decompose: bool = True


@dataclasses.dataclass
class TorchCase:
    family: str
    seed: int
    note: str

    @property
    def name(self) -> str:
        return f"{self.family}-{self.seed}"

    @property
    def args(self) -> tuple:
        return (self.family, self.seed)


# ---------------------------------------------------------------------------------------------
# helpers


def _choice(rng, items):
    return items[int(rng.integers(len(items)))]


def _dim(rng, name: str, static_p: float = 0.4, lo: int = 1):
    """A static size or the name of a dynamic dim."""
    if rng.random() < static_p:
        return int(_choice(rng, [s for s in SIZES if s >= lo]))
    return name


def _size(d, sizes: dict[str, int]) -> int:
    if isinstance(d, int):
        return d
    if isinstance(d, tuple):
        return sizes[d[0]] * d[1]
    return sizes[d]


def _act(name: str):
    import torch
    import torch.nn.functional as F

    return {
        "sigmoid": torch.sigmoid,
        "tanh": torch.tanh,
        "relu": torch.relu,
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "square": lambda t: t * t,
        "neg": torch.neg,
        "identity": lambda t: t,
    }[name]


ACTS = ("sigmoid", "tanh", "relu", "silu", "gelu", "gelu_tanh", "square", "identity")


def _module(forward: Callable, **children):
    """An ``nn.Module`` whose ``forward(self, *xs)`` is ``forward``, with ``children``
    (modules or parameters) as attributes."""
    import torch

    class Fuzz(torch.nn.Module):
        def forward(self, *xs):
            return forward(self, *xs)

    m = Fuzz()
    for name, child in children.items():
        setattr(m, name, child)
    return m.eval()


def _param(*shape, scale: float = 1.0):
    import torch

    return torch.nn.Parameter(torch.randn(*shape) * scale, requires_grad=False)


# ---------------------------------------------------------------------------------------------
# families


def _split(y, gates: int, h: int, how: str):
    import torch

    if how == "chunk":
        return list(y.chunk(gates, dim=-1))
    if how == "split":
        return list(torch.split(y, h, dim=-1))
    if how == "split_sizes":
        return list(y.split([h] * gates, dim=-1))
    if how == "unbind":
        return list(y.view(*y.shape[:-1], gates, h).unbind(-2))
    if how == "tensor_split":
        return list(torch.tensor_split(y, gates, dim=-1))
    return [y[..., i * h : (i + 1) * h] for i in range(gates)]


SPLITS = ("chunk", "split", "split_sizes", "unbind", "tensor_split", "slices")


def _gemm_of(rng, k: int, n: int):
    """(children, f(self, x)): a GEMM with or without bias in one of torch's spellings."""
    import torch
    import torch.nn.functional as F

    bias = rng.random() < 0.75
    how = _choice(rng, ["linear", "linear", "F.linear", "matmul_t", "addmm"])
    if how == "linear":
        return "Linear", {"lin": torch.nn.Linear(k, n, bias=bias)}, lambda s, x: s.lin(x)
    w = _param(n, k, scale=k**-0.5)
    b = _param(n) if bias else None
    kids = {"w": w} | ({"b": b} if bias else {})
    if how == "F.linear":
        return how, kids, lambda s, x: F.linear(x, s.w, s.b if bias else None)
    if how == "addmm" and bias:

        def addmm(s, x):
            flat = x.reshape(-1, x.shape[-1])
            return torch.addmm(s.b, flat, s.w.t()).view(*x.shape[:-1], n)

        return how, kids, addmm
    return "matmul_t", kids, lambda s, x: x @ s.w.t() + (s.b if bias else 0)


def _row_dims(rng, k: int):
    """A 2-D (rows, k) or 3-D (b, s, k) input shape and its leading dims."""
    if rng.random() < 0.6:
        lead = [_dim(rng, "rows", 0.4)]
    else:
        lead = [_dim(rng, "b", 0.5), _dim(rng, "s", 0.3)]
    return lead + [k], lead


def _gates(rng) -> Spec:
    gates = int(rng.integers(2, 5))
    h, k = int(_choice(rng, SIZES)), int(_choice(rng, SIZES[1:]))
    shape, lead = _row_dims(rng, k)
    how = _choice(rng, SPLITS)
    kinds = ["random"] + (["lstm"] if gates == 4 else [])
    kinds += ["gru"] if gates == 3 else []
    kinds += ["swiglu", "geglu"] if gates == 2 else []
    kind = _choice(rng, kinds)
    gname, kids, gemm = _gemm_of(rng, k, gates * h)
    inputs = [Input(shape)]
    acts = [_choice(rng, ACTS) for _ in range(gates)]
    joins = [_choice(rng, ["mul", "mul", "add", "sub"]) for _ in range(gates - 1)]

    def parts(s, x):
        return _split(gemm(s, x), gates, h, how)

    if kind == "lstm":
        import torch

        inputs.append(Input(lead + [h]))

        def fwd(s, x, c):
            i, f, g, o = parts(s, x)
            c2 = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            return torch.sigmoid(o) * torch.tanh(c2), c2

    elif kind == "gru":
        import torch

        inputs.append(Input(lead + [h]))
        kids["hh"] = torch.nn.Linear(h, 3 * h, bias=rng.random() < 0.8)

        def fwd(s, x, hx):
            xr, xz, xn = parts(s, x)
            hr, hz, hn = s.hh(hx).chunk(3, -1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            n = torch.tanh(xn + r * hn)
            return (1 - z) * n + z * hx

    elif kind in ("swiglu", "geglu"):
        act = _act("silu" if kind == "swiglu" else _choice(rng, ["gelu", "gelu_tanh"]))

        def fwd(s, x):
            a, b = parts(s, x)
            return act(a) * b

    else:

        def fwd(s, x):
            ps = [_act(a)(p) for a, p in zip(acts, parts(s, x), strict=True)]
            out = ps[0]
            for j, p in zip(joins, ps[1:], strict=True):
                out = out * p if j == "mul" else out + p if j == "add" else out - p
            return out

    note = f"{kind} {gates} x {h}, k {k}, {gname}, {how}, in {shape}"
    if kind == "random":
        note += f": {' '.join(acts)} by {' '.join(joins)}"
    return Spec(_module(fwd, **kids), inputs, note, rng.random() < 0.7)


def _gemms(rng) -> Spec:
    import torch

    h, k = int(_choice(rng, SIZES)), int(_choice(rng, SIZES[1:]))
    shape, lead = _row_dims(rng, k)
    kind = _choice(rng, ["siblings", "summed", "lstm_cell", "gru_cell", "rnn_cell"])
    if kind.endswith("_cell"):
        shape = [_dim(rng, "rows", 0.4), k]
        lead = shape[:1]
        bias = rng.random() < 0.8
        if kind == "lstm_cell":
            cell = torch.nn.LSTMCell(k, h, bias=bias)
            inputs = [Input(shape), Input(lead + [h]), Input(lead + [h])]
            return Spec(
                _module(lambda s, x, hx, cx: s.cell(x, (hx, cx)), cell=cell),
                inputs,
                f"LSTMCell {k} -> {h}, bias {bias}, in {shape}",
                rng.random() < 0.7,
            )
        cls = torch.nn.GRUCell if kind == "gru_cell" else torch.nn.RNNCell
        extra = {"nonlinearity": _choice(rng, ["tanh", "relu"])} if kind == "rnn_cell" else {}
        cell = cls(k, h, bias=bias, **extra)
        return Spec(
            _module(lambda s, x, hx: s.cell(x, hx), cell=cell),
            [Input(shape), Input(lead + [h])],
            f"{cls.__name__} {k} -> {h}, bias {bias} {extra}, in {shape}",
            rng.random() < 0.7,
        )
    gates = int(rng.integers(2, 5))
    acts = [_choice(rng, ACTS) for _ in range(gates)]
    if kind == "siblings":
        kids, gemms = {}, []
        for i in range(gates):
            name, sub, f = _gemm_of(rng, k, h)
            kids.update({f"{key}{i}": v for key, v in sub.items()})
            gemms.append((i, f, tuple(sub)))

        def call(s, x, i, f, keys):
            proxy = _Proxy(s, {key: f"{key}{i}" for key in keys})
            return f(proxy, x)

        def fwd(s, x):
            ps = [_act(a)(call(s, x, *g)) for a, g in zip(acts, gemms, strict=True)]
            out = ps[0]
            for p in ps[1:]:
                out = out * p
            return out

        return Spec(
            _module(fwd, **kids),
            [Input(shape)],
            f"{gates} sibling GEMMs {k} -> {h}: {' '.join(acts)}, in {shape}",
            rng.random() < 0.7,
        )
    k2 = int(_choice(rng, SIZES[1:]))
    how = _choice(rng, ["chunk", "split", "unbind", "slices"])
    kids = {
        "a": torch.nn.Linear(k, gates * h, bias=rng.random() < 0.7),
        "b": torch.nn.Linear(k2, gates * h, bias=rng.random() < 0.7),
    }

    def fwd(s, x, hx):
        ps = _split(s.a(x) + s.b(hx), gates, h, how)
        ps = [_act(a)(p) for a, p in zip(acts, ps, strict=True)]
        out = ps[0]
        for p in ps[1:]:
            out = out * p + p
        return out

    return Spec(
        _module(fwd, **kids),
        [Input(shape), Input(lead + [k2])],
        f"summed GEMMs {k} + {k2} -> {gates} x {h} by {how}: {' '.join(acts)}, in {shape}",
        rng.random() < 0.7,
    )


class _Proxy:
    """Attribute access renamed: lets one GEMM spelling read ``w3`` as ``w``."""

    def __init__(self, module, names: dict[str, str]):
        self._m, self._names = module, names

    def __getattr__(self, key):
        return getattr(self._m, self._names.get(key, key))


def _cross_entropy(rng) -> Spec:
    import torch
    import torch.nn.functional as F

    c = int(_choice(rng, [2, 3, 5, 7, 11, 16, 31, 97]))
    layout = _choice(rng, ["nc", "nc", "bsc_view", "bsc_permute"])
    spelling = _choice(
        rng, ["ce", "ce", "module", "nll", "gather", "logsumexp", "softmax_log", "masked"]
    )
    if layout == "nc":
        lead = [_dim(rng, "n", 0.3)]
    else:
        lead = [_dim(rng, "b", 0.4), _dim(rng, "s", 0.3)]
    if layout == "bsc_permute" and spelling not in ("ce", "module", "nll"):
        layout = "bsc_view"
    reduction = _choice(rng, ["mean", "sum", "none"])
    ignore = int(_choice(rng, [-100, 0, 1])) if rng.random() < 0.4 else None
    smoothing = float(_choice(rng, [0.0, 0.1, 0.25])) if spelling in ("ce", "module") else 0.0
    weight = _param(c).abs() + 0.5 if spelling in ("ce", "nll") and rng.random() < 0.3 else None
    kids = {}
    head = rng.random() < 0.3
    k = int(_choice(rng, [3, 8, 13]))
    if head:
        kids["head"] = torch.nn.Linear(k, c, bias=rng.random() < 0.5)
    if weight is not None:
        kids["weight"] = weight
    if spelling == "module":
        kids["loss"] = torch.nn.CrossEntropyLoss(
            reduction=reduction,
            ignore_index=-100 if ignore is None else ignore,
            label_smoothing=smoothing,
        )
    if spelling in ("gather", "logsumexp", "softmax_log"):
        ignore = None
    if spelling == "masked":
        ignore = -100 if ignore is None else ignore
    kw = {"reduction": reduction}
    if ignore is not None:
        kw["ignore_index"] = ignore

    def reduce(loss):
        if reduction == "mean":
            return loss.mean()
        return loss.sum() if reduction == "sum" else loss

    def fwd(s, x, t):
        logits = s.head(x) if head else x
        if layout == "bsc_view":
            logits, t = logits.view(-1, c), t.reshape(-1)
        elif layout == "bsc_permute":
            logits = logits.permute(0, 2, 1)
        w = s.weight if weight is not None else None
        if spelling == "ce":
            return F.cross_entropy(logits, t, weight=w, label_smoothing=smoothing, **kw)
        if spelling == "module":
            return s.loss(logits, t)
        if spelling == "nll":
            return F.nll_loss(F.log_softmax(logits, dim=1), t, weight=w, **kw)
        if spelling == "gather":
            logp = F.log_softmax(logits, dim=-1)
            return reduce(-logp.gather(-1, t.unsqueeze(-1)).squeeze(-1))
        if spelling == "softmax_log":
            logp = torch.log(torch.softmax(logits, dim=-1))
            return reduce(-logp.gather(1, t[:, None])[:, 0])
        if spelling == "logsumexp":
            picked = logits.gather(-1, t.unsqueeze(-1)).squeeze(-1)
            return reduce(torch.logsumexp(logits, dim=-1) - picked)
        # masked: ignored rows zeroed by a mask, mean over the kept ones
        mask = t != ignore
        safe = torch.where(mask, t, torch.zeros_like(t))
        nll = -F.log_softmax(logits, -1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        return (nll * mask).sum() / mask.sum().clamp(min=1)

    xin = Input(lead + [k] if head else lead + [c], scale=float(_choice(rng, [1.0, 4.0])))
    tin = Input(list(lead), kind="target", classes=c, ignore=ignore)
    note = (
        f"{layout} C={c} {spelling} {reduction} ignore {ignore} smoothing {smoothing} "
        f"weights {weight is not None} head {head}"
    )
    return Spec(_module(fwd, **kids), [xin, tin], note, rng.random() < 0.7)


def _range_gather(rng) -> Spec:
    import torch

    axis = int(rng.integers(2))
    n = _dim(rng, "n", 0.25, lo=2)
    b = _dim(rng, "b", 0.5)
    shape = [b, n] if axis == 1 else [n, b]
    step = int(_choice(rng, [1, 1, 2, 3, -1, -1, -2]))
    if step > 0:
        start = _choice(rng, [("c", int(rng.integers(0, 3))), ("n", -int(rng.integers(1, 4)))])
        limit = _choice(rng, [("n", -int(rng.integers(0, 3))), ("c", int(rng.integers(1, 4)))])
    else:
        start = _choice(rng, [("n", -int(rng.integers(1, 4))), ("c", int(rng.integers(0, 4)))])
        limit = _choice(rng, [("c", -1), ("n", -int(rng.integers(2, 5)))])
    how = _choice(rng, ["index", "index", "index_select", "ellipsis"])
    if how == "index" and axis == 0:
        how = "first"
    tail = _choice(rng, ["none", "reshape", "elementwise", "reshape_elementwise"])
    act = _act(_choice(rng, ["tanh", "relu", "sigmoid"]))

    def fwd(_s, x):
        size = x.shape[axis]

        def bound(bd):
            return bd[1] + (size if bd[0] == "n" else 0)

        idx = torch.arange(bound(start), bound(limit), step, device=x.device)
        if how == "index_select":
            y = x.index_select(axis, idx)
        elif how == "first":
            y = x[idx]
        elif how == "index":
            y = x[:, idx]
        else:
            y = x[..., idx] if axis == 1 else x.transpose(0, 1)[..., idx]
        if "reshape" in tail:
            y = y.reshape(-1)
        return act(y) if "elementwise" in tail else y

    note = f"axis {axis} of {shape}, arange({start}, {limit}, {step}) by {how}, then {tail}"
    return Spec(_module(fwd), [Input(shape)], note, rng.random() < 0.7)


def _views(rng) -> Spec:
    import torch

    b, s = _dim(rng, "b", 0.3), _dim(rng, "s", 0.3)
    k = int(_choice(rng, [2, 3, 4, 6, 8, 9, 12]))
    ops, kids = [], {}
    rank, last = 3, k  # rank and static last dim of the current value (None: symbolic)
    for i in range(int(rng.integers(2, 6))):
        op = _choice(
            rng,
            [
                "merge",
                "split_last",
                "transpose",
                "permute",
                "unsqueeze",
                "squeeze",
                "flatten",
                "expand",
                "unary",
                "add",
                "matmul",
                "matmul",
                "linear",
            ],
        )
        if op in ("merge", "flatten") and rank < 2:
            continue
        if op == "split_last" and not (last and last % 2 == 0 and last > 2 and rank < 5):
            continue
        if op in ("transpose", "permute") and rank < 2:
            continue
        if op in ("unsqueeze", "expand") and rank >= 5:
            continue
        if op == "squeeze" and not (ops and ops[-1][0] == "unsqueeze"):
            continue  # squeeze(d) of a dim that is not 1 is a no-op in torch, data-dependent
        if op in ("matmul", "linear") and not last:
            continue
        arg = None
        if op == "merge":
            arg = int(rng.integers(rank - 1))
            rank -= 1
            last = None if arg == rank - 1 else last
        elif op == "split_last":
            rank += 1
            last //= 2
        elif op == "transpose":
            arg = tuple(int(a) for a in rng.choice(rank, 2, replace=False))
            last = None if rank - 1 in arg else last
        elif op == "permute":
            arg = [int(p) for p in rng.permutation(rank)]
            last = None if arg[-1] != rank - 1 else last
        elif op == "unsqueeze":
            arg = int(rng.integers(rank + 1))
            last = 1 if arg == rank else last
            rank += 1
        elif op == "expand":
            arg = int(rng.integers(rank + 1)), int(_choice(rng, [1, 2, 3]))
            last = arg[1] if arg[0] == rank else last
            rank += 1
        elif op == "squeeze":  # the unsqueezed dim
            arg = ops[-1][1]
            rank -= 1
            last = None if arg == rank else last
        elif op == "flatten":
            arg = int(rng.integers(rank - 1))
            rank -= 1
            last = None if arg == rank - 1 else last
        elif op == "unary":
            arg = _choice(rng, ["relu", "sigmoid", "tanh", "gelu", "silu"])
        elif op == "add":
            arg = f"p{i}"
            kids[arg] = _param(last or 1)
        elif op in ("matmul", "linear"):
            n = int(_choice(rng, SIZES))
            arg = f"p{i}"
            if op == "matmul":
                kids[arg] = _param(last, n, scale=last**-0.5)
            else:
                kids[arg] = torch.nn.Linear(last, n, bias=rng.random() < 0.6)
            last = n
        ops.append((op, arg))

    def fwd(mod, x):
        y = x
        for op, arg in ops:
            if op == "merge":
                y = y.reshape(*y.shape[:arg], y.shape[arg] * y.shape[arg + 1], *y.shape[arg + 2 :])
            elif op == "split_last":
                y = y.view(*y.shape[:-1], 2, y.shape[-1] // 2)
            elif op == "transpose":
                y = y.transpose(*arg)
            elif op == "permute":
                y = y.permute(*arg)
            elif op == "unsqueeze":
                y = y.unsqueeze(arg)
            elif op == "expand":
                y = y.unsqueeze(arg[0])
                shape = list(y.shape)
                shape[arg[0]] = arg[1]
                y = y.expand(*shape)
            elif op == "squeeze":
                y = y.squeeze(arg)
            elif op == "flatten":
                y = y.flatten(arg, arg + 1)
            elif op == "unary":
                y = _act(arg)(y)
            elif op == "add":
                y = y + getattr(mod, arg)
            elif op == "matmul":
                y = y @ getattr(mod, arg)
            else:
                y = getattr(mod, arg)(y)
        return y

    if not ops:
        raise InvalidCase("no view applied")
    note = " ".join(
        op if arg is None or op in ("add", "matmul", "linear") else f"{op}{arg}" for op, arg in ops
    )
    return Spec(_module(fwd, **kids), [Input([b, s, k])], note, rng.random() < 0.7)


def _shape_chains(rng) -> Spec:
    import torch
    import torch.nn.functional as F

    b, s = _dim(rng, "b", 0.3), _dim(rng, "s", 0.2, lo=2)
    h = int(_choice(rng, [2, 3, 4, 5, 8]))
    names = ["reshape", "halves", "shift", "mask", "positions", "cumsum", "pad", "repeat"]
    names += ["double"] if isinstance(s, str) else []
    chains = [str(c) for c in rng.choice(names, size=int(rng.integers(1, 4)), replace=False)]
    inputs = [Input([b, s, h])]
    kids = {"table": _param(EXAMPLE_SIZE + max(SIZES) + 2, h), "row": _param(1, h)}
    m = int(_choice(rng, [2, 3, 4]))
    back = bool(rng.random() < 0.5)
    if "double" in chains:
        inputs.append(Input([b, ("s", 2)]))

    def fwd(mod, x, *rest):
        nb, ns = x.shape[0], x.shape[1]
        outs = []
        for chain in chains:
            if chain == "reshape":
                y = torch.relu(x.reshape(nb * ns, h))
                outs.append(y.view(nb, -1, h) if back else y)
            elif chain == "halves":
                half = ns // 2
                outs.append(x[:, :half] * 2 + x[:, half : 2 * half])
            elif chain == "shift":
                outs.append(x[:, 1:] - x[:, :-1])
            elif chain == "mask":
                outs.append(x * x.new_ones((nb, ns)).unsqueeze(-1))
            elif chain == "positions":
                pos = torch.arange(ns, device=x.device).unsqueeze(0).expand(nb, ns)
                outs.append(x + pos.to(x.dtype).unsqueeze(-1))
            elif chain == "cumsum":
                ones = torch.ones((nb, ns), dtype=torch.int64)
                pos = torch.cumsum(ones, dim=1) - 1
                outs.append(x + F.embedding(pos, mod.table))
            elif chain == "pad":
                amount = (ns + m - 1) // m * m - ns
                outs.append(F.pad(x, (0, 0, 0, amount), value=0.5))
            elif chain == "repeat":
                outs.append(mod.row.repeat(nb, 1))
            elif chain == "double":
                y = rest[0].view(nb, ns, 2)
                outs.append(x[..., :1] * y[..., 1:] + y.sum(-1, keepdim=True))
        return tuple(outs)

    note = f"{' '.join(chains)} on ({b}, {s}, {h})"
    return Spec(_module(fwd, **kids), inputs, note, rng.random() < 0.7)


# position-bucket parameters (num_buckets, m): T5's max_distance m - 1 and DeBERTa's
# max_position - 1 are primes above any |relative position| fed, so no bucket boundary is an
# exact float (torch and we may round a log by one ulp differently there: neighbouring buckets)
_BUCKETS = ((6, 98), (8, 102), (10, 128), (12, 132))
_COMPARES = (
    lambda a, b: a > b,
    lambda a, b: a < b,
    lambda a, b: a >= b,
    lambda a, b: a <= b,
    lambda a, b: a == b,
    lambda a, b: a != b,
)
_BOUNDS = (2.5, -0.5, 0.5, 2.0, -3.0, 1)
DTYPE_CHAINS = (
    "t5_buckets",
    "deberta_buckets",
    "mask_bias",
    "index_math",
    "positions",
    "mixed_float",
    "zero_dim",
    "reductions",
    "compare",
    "misc",
)


def _t5_bucket(torch, rel, num_buckets: int, max_distance: int, bidirectional: bool):
    """T5's ``_relative_position_bucket`` as HF writes it."""
    import math

    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).to(torch.long) * num_buckets
        rel = torch.abs(rel)
    else:
        rel = -torch.min(rel, torch.zeros_like(rel))
    exact = num_buckets // 2
    small = rel < exact
    large = exact + (
        torch.log(rel.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(small, rel, large)


def _deberta_bucket(torch, rel, bucket_size: int, max_position: int):
    """DeBERTa-v2's ``make_log_bucket_position``."""
    sign = torch.sign(rel)
    mid = bucket_size // 2
    abs_pos = torch.where(
        (rel < mid) & (rel > -mid), torch.tensor(mid - 1).type_as(rel), torch.abs(rel)
    )
    log_pos = (
        torch.ceil(
            torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid)) * (mid - 1)
        )
        + mid
    )
    return torch.where(abs_pos <= mid, rel.type_as(log_pos), log_pos * sign)


def _dtypes(rng) -> Spec:
    """Integer, boolean and mixed-float arithmetic as models write it (see the docstring)."""
    import torch
    import torch.nn.functional as F

    b, s = _dim(rng, "b", 0.4), _dim(rng, "s", 0.3)
    h = int(_choice(rng, [1, 3, 4, 5, 8]))
    chains = [str(c) for c in rng.choice(DTYPE_CHAINS, size=int(rng.integers(1, 4)), replace=False)]
    mask_dtype = _choice(rng, ["int64", "int64", "int32", "bool", "float32"])
    ids_dtype = _choice(rng, ["int64", "int64", "int32"])
    inputs = [
        Input([b, s, h]),
        Input([b, s], kind="int", scale=int(_choice(rng, [3, 7, 40])), dtype=ids_dtype),
        Input([b, s], kind="mask", dtype=mask_dtype),
    ]
    half = "mixed_float" in chains or "zero_dim" in chains
    if half:
        inputs.append(Input([b, s, h], dtype=_choice(rng, ["float16", "float32"])))
    nb, maxd = _BUCKETS[int(rng.integers(len(_BUCKETS)))]
    kids = {"table": _param(nb, h)}
    bidirectional = bool(rng.random() < 0.6)
    k = int(_choice(rng, [2, 3, 4, 7]))
    picks = {c: int(rng.integers(1 << 20)) for c in chains}  # each chain's own choices
    scalar = float(_choice(rng, [0.5, -1e4, 2.0, -0.25]))
    neg = float(_choice(rng, [-1e4, -1e9, float(torch.finfo(torch.float32).min)]))

    def pick(chain: str, i: int, n: int) -> int:
        return (picks[chain] >> (3 * i)) % n

    def fwd(mod, x, ids, mask, *rest):
        ns = x.shape[1]
        outs = []
        for chain in chains:
            p = lambda i, n, c=chain: pick(c, i, n)  # noqa: E731
            if chain == "t5_buckets":
                pos = torch.arange(ns, dtype=torch.long, device=x.device)
                rel = pos[None, :] - pos[:, None]
                bk = _t5_bucket(torch, rel, nb, maxd - 1, bidirectional)
                outs.append(bk)
                outs.append(F.embedding(bk, mod.table).permute(2, 0, 1).unsqueeze(0))
            elif chain == "deberta_buckets":
                pos = torch.arange(ns, device=x.device) if p(0, 2) else ids[0].long()
                rel = pos[:, None] - pos[None, :]
                bk = _deberta_bucket(torch, rel, nb, maxd)
                outs.append(bk)
                idx = torch.clamp(bk.long() + nb // 2, 0, nb - 1)
                outs.append(mod.table[idx] * 0.5)
            elif chain == "mask_bias":
                scores = torch.einsum("bsh,bth->bst", x, x)
                how = p(0, 6)
                if how == 0:
                    m = mask.long() if mask.dtype == torch.bool else mask
                    bias = (1 - m[:, None, :]) * neg
                elif how == 1:
                    bias = (1.0 - mask.float()[:, None, :]) * torch.finfo(torch.float32).min
                elif how == 2:
                    bias = torch.zeros_like(scores).masked_fill(mask[:, None, :] == 0, neg)
                elif how == 3:
                    bias = (~mask.bool())[:, None, :] * neg
                elif how == 4:
                    keep = mask.bool()[:, None, :]
                    scores = torch.where(keep, scores, torch.tensor(neg, dtype=scores.dtype))
                    bias = torch.zeros((), dtype=torch.float32)
                else:
                    bias = mask.to(x.dtype)[:, None, :].logical_not() * scalar
                y = scores + bias
                outs.append(torch.softmax(y, -1) if p(1, 2) else y)
            elif chain == "index_math":
                v = ids if p(0, 2) else ids.to(torch.int32)
                outs.append(v // k)
                outs.append(v % k)
                outs.append(torch.div(v, k, rounding_mode="floor" if p(1, 2) else "trunc"))
                outs.append(torch.remainder(v, -k) if p(2, 2) else torch.fmod(v, k))
                outs.append(v / k if p(3, 2) else v * scalar)
                outs.append((v + 0.5) // 2 if p(4, 2) else v // (mask.long().abs() + 1))
            elif chain == "positions":
                m = mask.long() if mask.dtype != torch.bool else mask.int()
                if p(0, 2):  # RoBERTa's create_position_ids_from_input_ids
                    pid = (torch.cumsum(m, dim=1).type_as(m) * m).long() + 1
                else:
                    pid = torch.cumsum(m, dim=-1) - 1
                    pid = pid.masked_fill(m == 0, 1)
                outs.append(pid)
                ar = torch.arange(ns, device=x.device)
                outs.append(ar * k if p(1, 2) else ar * scalar)
                outs.append(x + (pid.to(x.dtype) / ns).unsqueeze(-1))
            elif chain == "mixed_float":
                z = rest[0]
                outs.append(z + x)
                outs.append(z * scalar if p(0, 2) else z.float() * 2)
                outs.append((x.half() * 0.5 if p(1, 2) else x.to(z.dtype)) + z)
                outs.append((z * mask.unsqueeze(-1)) if p(2, 2) else z + ids.unsqueeze(-1))
            elif chain == "zero_dim":
                z = rest[0]
                c64 = torch.tensor(scalar, dtype=torch.float64)
                outs.append(ids * c64)  # an integer tensor times a float64 0-dim: float64
                outs.append(z * c64)  # a float tensor times a float64 0-dim: z's dtype
                ci = torch.tensor(k, dtype=torch.int64)
                outs.append(x * ci if p(0, 2) else mask + ci)
                outs.append(ids.float() + torch.tensor(1, dtype=torch.int32))
            elif chain == "reductions":
                outs.append(mask.sum(-1))
                outs.append(mask.bool().sum(dim=1))
                outs.append(mask.sum(dim=1, dtype=torch.float32))
                outs.append(ids.mean(-1, dtype=torch.float32) if p(0, 2) else mask.float().mean(1))
                outs.append(ids.ne(0).sum(-1) - 1)
                outs.append((x * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True))
            elif chain == "compare":
                cmp = _COMPARES[p(2, len(_COMPARES))]
                bound = _BOUNDS[p(3, len(_BOUNDS))]
                outs.append(cmp(ids, bound))
                outs.append(ids.float() < x[..., 0])
                outs.append(torch.where(cmp(ids, -bound), x[..., 0], 0.0))
                outs.append(cmp(mask, 0.5) if p(4, 2) else cmp(mask.bool(), bound))
                outs.append(torch.maximum(ids, x[..., -1]) if p(0, 2) else torch.clamp(ids, -2, 5))
                outs.append(torch.min(ids, torch.full_like(ids, k)))
                outs.append((ids == mask) if p(1, 2) else (ids >= mask.float() * 2))
            elif chain == "misc":
                keep = mask.bool()
                outs.append(torch.clamp(ids, min=0.5) if p(0, 2) else ids.clamp(max=k))
                outs.append(torch.cumsum(keep, 1) if p(1, 2) else torch.cumsum(ids, -1))
                outs.append(torch.where(keep, ids, 0.5) if p(2, 2) else torch.where(keep, 1, 0.0))
                outs.append(torch.sign(ids) * torch.abs(ids) + ids**2)
                outs.append(ids.to(torch.float16) * 0.5 if p(3, 2) else keep * 1.5)
                outs.append(2 ** ids.clamp(0, 8) if p(4, 2) else x.argmax(-1) + ids)
        return tuple(outs)

    note = f"{' '.join(chains)} on ({b}, {s}, {h}), ids {ids_dtype}, mask {mask_dtype}"
    if half:
        note += f", z {inputs[3].dtype}"
    return Spec(_module(fwd, **kids), inputs, note, rng.random() < 0.7)


_BUILDERS = family_builders(globals(), FAMILIES)


def build(family: str, seed: int) -> Spec:
    """The module of ``family`` for ``seed``: deterministic (weights included)."""
    import torch

    def reseed():
        torch.manual_seed(seed)

    return draw(_BUILDERS, family, seed, stream=100, before=reseed, what="module")


def generate(family: str, seed: int) -> TorchCase:
    spec = build(family, seed)
    note = spec.note + ("" if spec.decompose else ", not decomposed")
    return TorchCase(family, seed, note)


# ---------------------------------------------------------------------------------------------
# running one case (in the worker)


def _dims_of(inputs: list[Input]) -> list[str]:
    names: list[str] = []
    for inp in inputs:
        for d in inp.shape:
            name = d[0] if isinstance(d, tuple) else d
            if isinstance(name, str) and name not in names:
                names.append(name)
    return names


def _arrays(inputs: list[Input], sizes: dict[str, int], rng) -> list[np.ndarray]:
    out = []
    for inp in inputs:
        shape = tuple(_size(d, sizes) for d in inp.shape)
        if inp.kind == "target":
            t = rng.integers(0, inp.classes, size=shape).astype("int64")
            if inp.ignore is not None and t.size > 1:
                t.flat[rng.integers(0, t.size, size=t.size // 3)] = inp.ignore
                if (t == inp.ignore).all():
                    t.flat[0] = (inp.ignore + 1) % inp.classes if inp.ignore >= 0 else 0
            out.append(t)
        elif inp.kind == "int":
            scale = int(inp.scale)
            out.append(rng.integers(-scale, scale + 1, size=shape).astype(inp.dtype))
        elif inp.kind == "mask":
            m = rng.integers(0, 2, size=shape)
            m[..., :1] = 1
            out.append(m.astype(inp.dtype))
        else:
            out.append((rng.standard_normal(shape) * inp.scale).astype(inp.dtype))
    return out


def _dynamic_shapes(inputs: list[Input]):
    import torch

    derived = {d[0] for inp in inputs for d in inp.shape if isinstance(d, tuple)}
    named = {n: torch.export.Dim(n, min=1, max=DIM_MAX) for n in derived}
    shapes = []
    for inp in inputs:
        spec = {}
        for ax, d in enumerate(inp.shape):
            if isinstance(d, tuple):
                spec[ax] = named[d[0]] * d[1]
            elif isinstance(d, str):
                spec[ax] = named.get(d) or torch.export.Dim.DYNAMIC(min=1, max=DIM_MAX)
        shapes.append(spec or None)
    return tuple(shapes)


def _flat(out) -> list[np.ndarray]:
    if isinstance(out, tuple | list):
        return [a for o in out for a in _flat(o)]
    return [out.detach().numpy()]


def prepare(family: str, seed: int):
    """(spec, exported program, feeds, eager outputs per feed) of a case: raises
    ``_Discard`` where torch itself cannot run or export it."""
    import warnings

    import torch

    spec = build(family, seed)
    rng = np.random.default_rng([200 + FAMILIES.index(family), seed])
    dims = _dims_of(spec.inputs)
    example = _arrays(spec.inputs, dict.fromkeys(dims, EXAMPLE_SIZE), rng)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.export.export(
                spec.module,
                tuple(torch.from_numpy(a) for a in example),
                # forward(self, *xs): one argument, a tuple
                dynamic_shapes=(_dynamic_shapes(spec.inputs),) if dims else None,
            )
    except Exception as err:
        raise _Discard(f"torch.export: {_line(err)}") from None
    exported = program.module()
    # candidate sizes per dim, two feeds: the first candidates that torch runs and the
    # exported program's guards accept
    order = {d: [int(v) for v in rng.permutation(SIZES)] for d in dims}
    feeds, refs = [], []
    for j in range(len(SIZES) if dims else 2):
        sizes = {d: order[d][j] for d in dims}
        feed = _arrays(spec.inputs, sizes, rng)
        tensors = [torch.from_numpy(a) for a in feed]
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ref = _flat(spec.module(*tensors))
                exported(*tensors)
        except Exception:
            continue
        feeds.append(feed)
        refs.append(ref)
        if len(feeds) == 2:
            return spec, program, feeds, refs
    raise _Discard("fewer than two feed sizes that torch runs and the export accepts")


class _Discard(Exception):
    pass


def _line(err: BaseException) -> str:
    from ..errors import first_line

    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0] if lines else first_line(err)


def _run(mod, pipeline: str, feeds) -> list[list[np.ndarray]]:
    from .fuzz import _run_tvm

    return _run_tvm(mod, pipeline, [dict(enumerate(f)) for f in feeds])


def _stock_runs(program, spec: Spec, feeds, refs) -> bool:
    """Whether stock TVM (its importer, without our converters, and pipeline) runs the
    program and matches torch."""
    from tvm.relax.frontend.torch import from_exported_program

    try:
        mod = from_exported_program(program, run_ep_decomposition=spec.decompose)
        outs = _run(mod, "stock", feeds)
    except Exception:
        return False
    return all(compare(o, r, "torch") is None for o, r in zip(outs, refs, strict=True))


def run_case(family: str, seed: int) -> tuple[str, str]:
    """(outcome, one-line reason) of the case ``family``, ``seed``."""
    from ..errors import TvmFusionError, first_line
    from ..frontend.load import import_exported_program

    try:
        spec, program, feeds, refs = prepare(family, seed)
    except _Discard as err:
        return "discarded", str(err)
    try:
        mod = import_exported_program(program, decompose=spec.decompose)
        outs = _run(mod, "tvm_fusion", feeds)
    except TvmFusionError as err:
        if _stock_runs(program, spec, feeds, refs):
            return "failure", f"refused, but stock TVM runs it: {err}"
        return "refused", str(err)
    except Exception as err:
        return "failure", f"{type(err).__name__}: {first_line(err)}"
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        why = compare(out, ref, "torch")
        if why:
            shapes = [a.shape for a in feeds[i]]
            stock = "stock TVM right" if _stock_runs(program, spec, feeds, refs) else "stock not"
            return "failure", f"wrong result on feed {i} {shapes}: {why} ({stock})"
    return "ok", ""


# ---------------------------------------------------------------------------------------------
# the worker's files, failures


def save_case(directory: Path, family: str, seed: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "case.json").write_text(json.dumps({"family": family, "seed": seed}))
    return directory


def load_case(directory: Path) -> tuple[str, int]:
    case = json.loads((directory / "case.json").read_text())
    return case["family"], int(case["seed"])


def save_failure(
    directory: Path, case: TorchCase, outcome: str, reason: str, _worker, _budget_s
) -> dict:
    """``case.json``, ``reason.txt`` and, where torch exports it, ``program.pt2`` and the
    feeds (``inputs.npz``: ``0/0`` is feed 0's first input)."""
    save_case(directory, case.family, case.seed)
    (directory / "reason.txt").write_text(f"{outcome}: {reason}\n{case.note}\n")
    try:
        import torch

        _spec, program, feeds, _refs = prepare(case.family, case.seed)
        torch.export.save(program, str(directory / "program.pt2"))
        np.savez(
            directory / "inputs.npz",
            **{f"{i}/{j}": a for i, feed in enumerate(feeds) for j, a in enumerate(feed)},
        )
    except Exception:  # the seed still reproduces it
        pass
    return {}
