"""The torch.export fuzzer's families of the ONNX fuzzer's kinds, in torch's spellings: one
builder ``_FAMILY(rng) -> Spec`` each (weights from ``torch.manual_seed``, set by
:func:`.torch_frontend.build`); the torch-only ``dtypes`` is in :mod:`.torch_dtypes`.

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
"""

from __future__ import annotations

from .common import SIZES, InvalidCase
from .torch_spec import ACTS, EXAMPLE_SIZE, Input, Spec, _act, _choice, _dim, _module, _param


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
