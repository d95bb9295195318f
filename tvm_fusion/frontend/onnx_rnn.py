"""ONNX ``LSTM``, ``GRU`` and ``RNN`` for TVM's Relax importer, which has no converter for them.

A recurrent op with a static sequence length is unrolled into Relax ops, written so that our
passes find the patterns they fuse: the input projection of all steps is one GEMM
(``X @ W^T + Wb`` over ``seq * batch`` rows: the input weights read once), and each step is
``H @ R^T + Rb`` plus the step's slice of that projection, split into the gates, then the gate
math: FuseSplitGates' GEMM with an added tensor, one gate kernel per step (a GRU with
``linear_before_reset``, torch's form: the projection's pieces meet the recurrent GEMM's in the
gate math). Constant weights stay constants, sliced per direction on the host.

Covered: ``direction`` forward / reverse / bidirectional, ``layout`` 0 and 1, ``initial_h`` /
``initial_c``, LSTM peepholes ``P``, ``input_forget``, ``clip``, GRU's ``linear_before_reset``,
every activation of the ONNX spec with ``activation_alpha`` / ``activation_beta`` (consumed per
activation position, as ONNX Runtime does), ``sequence_lens`` (rows past their length keep
their state and output zeros; with a reverse direction only when every length is the whole
sequence).

What the loop kernel covers (below) is, on a static sequence, one call per direction of a
private function marked ``rnn_loop.RECURRENCE_ATTR`` (the projection, R, Rb, the initial
states in; the unrolled steps as its body): the importer does not know the target, so
``transform/choose_recurrence.py`` makes it the loop kernel on CPU or inlines it elsewhere.

A dynamic sequence length cannot be unrolled: the input projection of all steps is still one
GEMM, and the recurrence is one loop kernel per direction (``rnn_loop.py``: a scheduled
PrimFunc that loops over time, the fused gate step as its body, the state in a workspace),
called with ``call_tir``; zero initial states (absent, or a zero constant broadcast / sliced /
reshaped, as the exporters write them) are set in the kernel, not passed. It covers default
activations, ``clip``, GRU with ``linear_before_reset = 1``, constant ``R`` / ``B``; anything
else on a dynamic sequence is refused with a one-line reason (see ARCHITECTURE.md,
"Recurrent ops").
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.ir.expr import GenericConst
from tvm.relax.frontend.onnx import onnx_frontend as _frontend

from tvm_fusion.lower import rnn_loop

_DEFAULTS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
# ONNX activation -> (default alpha, default beta)
_ACTIVATION_DEFAULTS = {
    "Relu": (None, None),
    "Tanh": (None, None),
    "Sigmoid": (None, None),
    "Softsign": (None, None),
    "Softplus": (None, None),
    "Affine": (1.0, 0.0),
    "LeakyRelu": (0.01, None),
    "ThresholdedRelu": (1.0, None),
    "ScaledTanh": (1.0, 1.0),
    "HardSigmoid": (0.2, 0.5),
    "Elu": (1.0, None),
}


def _name(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _const(value: float, dtype: str) -> relax.Expr:
    return relax.const(np.array(value, dtype))


def _activation(bb, name: str, x: relax.Expr, alpha, beta) -> relax.Expr:
    op, dtype = relax.op, str(x.ty.dtype)
    canon = {k.lower(): k for k in _ACTIVATION_DEFAULTS}.get(name.lower())
    if canon is None:
        raise ValueError(f"recurrent activation {name!r} is not an ONNX activation")
    default_alpha, default_beta = _ACTIVATION_DEFAULTS[canon]
    a = default_alpha if alpha is None else alpha
    b = default_beta if beta is None else beta
    emit = bb.emit
    if canon == "Sigmoid":
        return emit(op.sigmoid(x))
    if canon == "Tanh":
        return emit(op.tanh(x))
    if canon == "Relu":
        return emit(op.nn.relu(x))
    if canon == "Affine":
        return emit(op.add(emit(op.multiply(x, _const(a, dtype))), _const(b, dtype)))
    if canon == "LeakyRelu":
        return emit(op.nn.leakyrelu(x, a))
    if canon == "ThresholdedRelu":
        return emit(op.where(emit(op.greater(x, _const(a, dtype))), x, _const(0.0, dtype)))
    if canon == "ScaledTanh":
        return emit(
            op.multiply(emit(op.tanh(emit(op.multiply(x, _const(b, dtype))))), _const(a, dtype))
        )
    if canon == "HardSigmoid":
        lin = emit(op.add(emit(op.multiply(x, _const(a, dtype))), _const(b, dtype)))
        return emit(op.clip(lin, 0.0, 1.0))
    if canon == "Elu":
        neg = emit(
            op.multiply(emit(op.subtract(emit(op.exp(x)), _const(1.0, dtype))), _const(a, dtype))
        )
        return emit(op.where(emit(op.greater(x, _const(0.0, dtype))), x, neg))
    if canon == "Softsign":
        return emit(op.divide(x, emit(op.add(emit(op.abs(x)), _const(1.0, dtype)))))
    return emit(op.log(emit(op.add(emit(op.exp(x)), _const(1.0, dtype)))))  # Softplus


def _present(inputs, i: int):
    if len(inputs) <= i or inputs[i] is None:
        return None
    value = inputs[i]
    if isinstance(value, relax.Tuple) and not value.fields:
        return None
    return value


def _numpy(expr) -> np.ndarray | None:
    return expr.value.numpy() if isinstance(expr, GenericConst) else None


class _Direction:
    """Weights of one direction: constants when the model's are (sliced here), else Relax."""

    def __init__(self, bb, weight, d: int):
        self.bb, self.weight, self.d = bb, weight, d

    def get(self, rows: slice | None = None) -> relax.Expr | None:
        if self.weight is None:
            return None
        array = _numpy(self.weight)
        if array is not None:
            part = array[self.d] if rows is None else array[self.d][rows]
            return relax.const(np.ascontiguousarray(part))
        bb, op = self.bb, relax.op
        part = bb.emit(
            op.squeeze(bb.emit(op.strided_slice(self.weight, [0], [self.d], [self.d + 1])), [0])
        )
        if rows is not None:
            part = bb.emit(op.strided_slice(part, [0], [rows.start], [rows.stop]))
        return part


class _Recurrent(_frontend.OnnxOpConverter):
    KIND = "RNN"

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        return _unroll(bb, cls.KIND, inputs, attr)

    @classmethod
    def _impl_v14(cls, bb, inputs, attr, params):
        return _unroll(bb, cls.KIND, inputs, attr)

    @classmethod
    def _impl_v22(cls, bb, inputs, attr, params):
        return _unroll(bb, cls.KIND, inputs, attr)


class LSTM(_Recurrent):
    KIND = "LSTM"


class GRU(_Recurrent):
    KIND = "GRU"


class RNN(_Recurrent):
    KIND = "RNN"


def _unroll(bb, kind: str, inputs, attr) -> relax.Expr:
    op = relax.op
    x, w, r = inputs[0], inputs[1], inputs[2]
    bias, seq_lens = _present(inputs, 3), _present(inputs, 4)
    init_h = _present(inputs, 5)
    init_c = _present(inputs, 6) if kind == "LSTM" else None
    peep = _present(inputs, 7) if kind == "LSTM" else None
    layout = int(attr.get("layout", 0))
    direction = _name(attr.get("direction", "forward"))
    dirs = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}.get(direction)
    if dirs is None:
        raise ValueError(f"{kind} direction {direction!r} is not forward/reverse/bidirectional")
    if layout == 1:  # (batch, seq, input) -> (seq, batch, input)
        x = bb.emit(op.permute_dims(x, [1, 0, 2]))
        if init_h is not None:
            init_h = bb.emit(op.permute_dims(init_h, [1, 0, 2]))
        if init_c is not None:
            init_c = bb.emit(op.permute_dims(init_c, [1, 0, 2]))
    shape = x.ty.shape.values
    gates = _GATES[kind]
    hidden = int(attr.get("hidden_size", 0)) or int(w.ty.shape.values[1]) // gates
    dtype = str(x.ty.dtype)
    activations = [_name(a) for a in attr.get("activations", [])] or _DEFAULTS[kind] * len(dirs)
    per_dir = len(_DEFAULTS[kind])
    if len(activations) != per_dir * len(dirs):
        raise ValueError(f"{kind} expects {per_dir * len(dirs)} activations, got {activations}")
    alphas = list(attr.get("activation_alpha", []))
    betas = list(attr.get("activation_beta", []))
    clip = attr.get("clip")
    operands = (w, r, bias, seq_lens, init_h, init_c, peep)
    static = isinstance(shape[0], tirx.IntImm)
    if not static or _loop_refusal(kind, x, operands, attr, dirs) is None:
        # what the loop kernel covers: on a static sequence, one marked function per direction
        # that choose_recurrence.py turns into the loop kernel or inlines, per target
        results = _loop(bb, kind, x, operands, attr, dirs, static)
        return _layout_back(bb, results, layout)
    seq, batch, features = int(shape[0]), shape[1], shape[2]
    lengths = _numpy(seq_lens) if seq_lens is not None else None
    masked = seq_lens is not None and not (lengths is not None and np.all(lengths == seq))
    if masked and any(dirs):
        raise ValueError(
            f"{kind} with a reverse direction and sequence_lens shorter than the input"
        )

    flat = bb.emit(op.reshape(x, [seq * batch, features]))
    outputs, last_h, last_c = [], [], []
    for d, reverse in enumerate(dirs):
        wd, rd = _Direction(bb, w, d), _Direction(bb, r, d)
        bd = _Direction(bb, bias, d)
        fns = [
            _Act(bb, activations[d * per_dir + i], alphas, betas, d * per_dir + i)
            for i in range(per_dir)
        ]
        # The input projection of every step is one GEMM over seq * batch rows (the weight
        # read once, not once a step); each step adds its slice to the recurrent GEMM, which
        # FuseSplitGates reads as an extra input of the step's gate kernel.
        proj = bb.emit(op.matmul(flat, bb.emit(op.permute_dims(wd.get()))))
        if bias is not None:
            proj = bb.emit(op.add(proj, bd.get(slice(0, gates * hidden))))
        proj = bb.emit(op.reshape(proj, [seq, batch, gates * hidden]))
        rb = bd.get(slice(gates * hidden, 2 * gates * hidden)) if bias is not None else None
        h = _initial(bb, init_h, d, batch, hidden, dtype)
        c = _initial(bb, init_c, d, batch, hidden, dtype) if kind == "LSTM" else None
        pd = _Direction(bb, peep, d) if peep is not None else None
        steps = range(seq - 1, -1, -1) if reverse else range(seq)
        per_step = {}
        for t in steps:
            x_t = bb.emit(op.squeeze(bb.emit(op.strided_slice(proj, [0], [t], [t + 1])), [0]))
            step = _Step(bb, kind, x_t, h, c, rd, rb, hidden, fns, clip, attr, pd, dtype)
            new_h, new_c = step.run()
            if masked:
                live = bb.emit(op.less(_const(t, str(seq_lens.ty.dtype)), seq_lens))
                live = bb.emit(op.expand_dims(live, [1]))
                out_h = bb.emit(op.where(live, new_h, _const(0.0, dtype)))
                new_h = bb.emit(op.where(live, new_h, h))
                if new_c is not None:
                    new_c = bb.emit(op.where(live, new_c, c))
            else:
                out_h = new_h
            h, c = new_h, new_c
            per_step[t] = out_h
        outputs.append([per_step[t] for t in range(seq)])
        last_h.append(h)
        last_c.append(c)

    def stack(items, axis):
        return bb.emit(op.concat([bb.emit(op.expand_dims(i, [axis])) for i in items], axis=axis))

    # Y: (seq, num_dir, batch, hidden); Y_h / Y_c: (num_dir, batch, hidden)
    y = stack([stack(outs, 0) for outs in outputs], 1)
    y_h = stack(last_h, 0)
    results = [y, y_h]
    if kind == "LSTM":
        results.append(stack(last_c, 0))
    return _layout_back(bb, results, layout)


def _stack(bb, items, axis):
    op = relax.op
    return bb.emit(op.concat([bb.emit(op.expand_dims(i, [axis])) for i in items], axis=axis))


def _layout_back(bb, results, layout: int) -> relax.Expr:
    """Y (seq, num_dir, batch, hidden) and states (num_dir, batch, hidden) in ``layout``."""
    op = relax.op
    if layout == 1:  # Y: (batch, seq, num_dir, hidden); states (batch, num_dir, hidden)
        results = [bb.emit(op.permute_dims(results[0], [2, 0, 1, 3]))] + [
            bb.emit(op.permute_dims(s, [1, 0, 2])) for s in results[1:]
        ]
    return relax.Tuple(results)


def _loop_refusal(kind: str, x, inputs, attr, dirs) -> str | None:
    """Why the loop kernel does not cover this op, or None."""
    w, r, bias, seq_lens, init_h, init_c, peep = inputs
    activations = [_name(a).lower() for a in attr.get("activations", [])]
    defaults = [a.lower() for a in _DEFAULTS[kind]] * len(dirs)
    dtype = str(x.ty.dtype)
    if kind == "GRU" and not int(attr.get("linear_before_reset", 0)):
        return "linear_before_reset = 0 (its candidate GEMM reads r * h of every unit)"
    if peep is not None or int(attr.get("input_forget", 0)):
        return "peepholes or input_forget"
    if seq_lens is not None:
        return "sequence_lens"
    if activations and (activations != defaults or attr.get("activation_alpha")):
        return f"activations {activations}"
    if dtype != "float32":
        return f"dtype {dtype}"
    if _numpy(r) is None or (bias is not None and _numpy(bias) is None):
        return "R or B not constant"
    return None


def _loop(bb, kind: str, x, inputs, attr, dirs, static: bool = False) -> list:
    """The input projection of all steps as one GEMM, then per direction the loop kernel
    (rnn_loop.py) that carries the state over time, or on a ``static`` sequence a call of a
    private function marked ``rnn_loop.RECURRENCE_ATTR`` that holds the unrolled steps
    (ChooseRecurrence decides per target). Raises a one-line ValueError for what the kernel
    does not cover."""
    op = relax.op
    w, r, bias, seq_lens, init_h, init_c, peep = inputs
    gates = _GATES[kind]
    hidden = int(attr.get("hidden_size", 0)) or int(w.ty.shape.values[1]) // gates
    dtype = str(x.ty.dtype)
    why = _loop_refusal(kind, x, inputs, attr, dirs)
    if why is not None:
        raise ValueError(
            f"{kind} with a dynamic sequence length and {why} is not supported: the loop kernel "
            "covers default activations, clip, GRU linear_before_reset = 1, constant R and B"
        )
    clip = attr.get("clip")
    seq, batch, features = x.ty.shape.values
    # X transposed from (batch, seq, features) (layout 1, or torch's batch_first): the GEMM
    # reads it untransposed and the kernel reads the projection batch-major (no transpose kernel)
    source = bb.lookup_binding(x) if isinstance(x, relax.Var) else x
    batch_major = (
        isinstance(source, relax.Call)
        and source.op == tvm.ir.Op.get("relax.permute_dims")
        and source.attrs.axes is not None
        and [int(a) for a in source.attrs.axes] == [1, 0, 2]
    )
    if batch_major:
        x = source.args[0]
    flat = bb.emit(op.reshape(x, [seq * batch, features]))
    proj_shape = [batch, seq] if batch_major else [seq, batch]
    # zero initial states (absent, or zeros broadcast and sliced, as the exporters write them)
    # are set in the kernel: no zeros / broadcast / slice kernels before it
    zero_init = _is_zero(bb, init_h) and (kind != "LSTM" or _is_zero(bb, init_c))
    ys, last_h, last_c = [], [], []
    for d, reverse in enumerate(dirs):
        wd = _Direction(bb, w, d)
        proj = bb.emit(op.matmul(flat, bb.emit(op.permute_dims(wd.get()))))
        rb = None
        if bias is not None:
            proj = bb.emit(op.add(proj, _Direction(bb, bias, d).get(slice(0, gates * hidden))))
            rb = _numpy(bias)[d][gates * hidden :]
        proj = bb.emit(op.reshape(proj, [*proj_shape, gates * hidden]))
        states = []
        if not zero_init:
            states.append(_initial(bb, init_h, d, batch, hidden, dtype))
            if kind == "LSTM":
                states.append(_initial(bb, init_c, d, batch, hidden, dtype))
        spec = {"kind": kind, "hidden": hidden, "reverse": reverse, "zero_init": zero_init}
        spec.update(batch_major=batch_major, bias=rb is not None)
        spec.update({} if clip is None else {"clip": float(clip)})
        if static:
            weights = [relax.const(_numpy(r)[d])] + ([] if rb is None else [relax.const(rb)])
            args = [proj, *weights, *states]
            gv = bb.add_func(_marked(spec, args, dtype), f"{kind.lower()}_steps")
            call = bb.emit(relax.Call(gv, args))
        else:
            call = bb.emit(rnn_loop.loop_call(bb.add_func, spec, proj, _numpy(r)[d], rb, states))
        ys.append(bb.emit(relax.TupleGetItem(call, 0)))
        last_h.append(bb.emit(relax.TupleGetItem(call, 1)))
        if kind == "LSTM":
            last_c.append(bb.emit(relax.TupleGetItem(call, 2)))
    results = [_stack(bb, ys, 1), _stack(bb, last_h, 0)]
    if kind == "LSTM":
        results.append(_stack(bb, last_c, 0))
    return results


class _Whole:
    """A weight given whole (the marked function's parameter): ``get()`` is the weight."""

    def __init__(self, weight):
        self.weight = weight

    def get(self, rows: slice | None = None) -> relax.Expr:
        assert rows is None, "a marked recurrence covers no sliced weight"
        return self.weight


def _marked(spec: dict, args: list, dtype: str) -> relax.Function:
    """One direction over a static sequence, unrolled, as a private function of ``args``'
    types (proj, R, [Rb], [h0, c0]) -> (Y (seq, batch, H), h_T[, c_T]), marked with
    ``spec`` as ``rnn_loop.RECURRENCE_ATTR``: the steps as ``_unroll`` writes them."""
    op, kind, hidden = relax.op, spec["kind"], spec["hidden"]
    names = ["proj", "r"] + (["rb"] if spec["bias"] else [])
    names += [] if spec["zero_init"] else ["h0", "c0"][: 1 + (kind == "LSTM")]
    params = [relax.Var(name, arg.ty) for name, arg in zip(names, args, strict=True)]
    fbb = relax.BlockBuilder()
    with fbb.function(f"{kind.lower()}_steps", params, private=True):
        with fbb.dataflow():
            proj = params[0]
            if spec["batch_major"]:
                proj = fbb.emit(op.permute_dims(proj, [1, 0, 2]))
            seq, batch = (int(proj.ty.shape.values[0]), proj.ty.shape.values[1])
            rb = params[2] if "rb" in names else None
            if spec["zero_init"]:
                h = fbb.emit(op.zeros(relax.ShapeExpr([batch, hidden]), dtype))
                c = fbb.emit(op.zeros(relax.ShapeExpr([batch, hidden]), dtype))
            else:
                h, c = params[names.index("h0")], params[-1]
            c = c if kind == "LSTM" else None
            fns = [_Act(fbb, a, [], [], i) for i, a in enumerate(_DEFAULTS[kind])]
            attr = {"linear_before_reset": 1}
            per_step = {}
            steps = range(seq - 1, -1, -1) if spec["reverse"] else range(seq)
            for t in steps:
                x_t = fbb.emit(op.squeeze(fbb.emit(op.strided_slice(proj, [0], [t], [t + 1])), [0]))
                step = _Step(
                    fbb,
                    kind,
                    x_t,
                    h,
                    c,
                    _Whole(params[1]),
                    rb,
                    hidden,
                    fns,
                    spec.get("clip"),
                    attr,
                    None,
                    dtype,
                )
                h, c = step.run()
                per_step[t] = h
            y = _stack(fbb, [per_step[t] for t in range(seq)], 0)
            out = fbb.emit_output(relax.Tuple([y, h] + ([c] if kind == "LSTM" else [])))
        fbb.emit_func_output(out)
    func = next(f for _, f in fbb.get().functions_items())
    return func.with_attr(rnn_loop.RECURRENCE_ATTR, spec)


class _Act:
    def __init__(self, bb, name: str, alphas, betas, index: int):
        self.bb, self.name = bb, name
        self.alpha = float(alphas[index]) if index < len(alphas) else None
        self.beta = float(betas[index]) if index < len(betas) else None

    def __call__(self, x):
        return _activation(self.bb, self.name, x, self.alpha, self.beta)


# ops whose output is all zeros when their data input (argument 0) is
_ZERO_PRESERVING = {
    "relax.broadcast_to",
    "relax.strided_slice",
    "relax.squeeze",
    "relax.expand_dims",
    "relax.reshape",
    "relax.permute_dims",
}


def _is_zero(bb, state, depth: int = 8) -> bool:
    """Whether ``state`` is absent or provably all zeros: a constant of zeros, ``zeros``, or a
    chain of broadcasts / slices / reshapes of one (looked up through ``bb``'s bindings)."""
    if state is None:
        return True
    for _ in range(depth):
        array = _numpy(state)
        if array is not None:
            return not np.any(array)
        if isinstance(state, relax.Var):
            bound = bb.lookup_binding(state)
            if bound is None:
                return False
            state = bound
            continue
        if not isinstance(state, relax.Call) or not isinstance(state.op, tvm.ir.Op):
            return False
        if state.op.name == "relax.zeros":
            return True
        if state.op.name not in _ZERO_PRESERVING:
            return False
        state = state.args[0]
    return False


def _initial(bb, state, d: int, batch, hidden: int, dtype: str) -> relax.Expr:
    if state is None:
        return bb.emit(relax.op.zeros(relax.ShapeExpr([batch, hidden]), dtype))
    part = bb.emit(relax.op.strided_slice(state, [0], [d], [d + 1]))
    return bb.emit(relax.op.squeeze(part, [0]))


class _Step:
    """One time step of one direction: the new hidden state (and LSTM cell state)."""

    def __init__(self, bb, kind, x_t, h, c, rd, rb, hidden, fns, clip, attr, peep, dtype):
        self.bb, self.kind, self.x_t, self.h, self.c = bb, kind, x_t, h, c
        self.rd, self.rb, self.hidden, self.fns = rd, rb, hidden, fns
        self.clip = None if clip is None else float(clip)
        self.attr, self.peep, self.dtype = attr, peep, dtype

    def _clip(self, x):
        if self.clip is None:
            return x
        return self.bb.emit(relax.op.clip(x, -self.clip, self.clip))

    def _recurrent(self, rows: slice | None = None, h=None):
        """``h @ R[rows]^T + Rb[rows]``."""
        bb, op = self.bb, relax.op
        weight = self.rd.get(rows)
        out = bb.emit(op.matmul(self.h if h is None else h, bb.emit(op.permute_dims(weight))))
        if self.rb is not None:
            bias = self.rb
            if rows is not None:
                array = _numpy(bias)
                bias = (
                    relax.const(np.ascontiguousarray(array[rows]))
                    if array is not None
                    else bb.emit(op.strided_slice(bias, [0], [rows.start], [rows.stop]))
                )
            out = bb.emit(op.add(out, bias))
        return out

    def run(self):
        return {"LSTM": self._lstm, "GRU": self._gru, "RNN": self._rnn}[self.kind]()

    def _rnn(self):
        bb, op = self.bb, relax.op
        pre = self._clip(bb.emit(op.add(self.x_t, self._recurrent())))
        return self.fns[0](pre), None

    def _lstm(self):
        bb, op, n = self.bb, relax.op, self.hidden
        f_act, g_act, h_act = self.fns
        pre = bb.emit(op.add(self.x_t, self._recurrent()))
        parts = bb.emit(op.split(pre, 4, axis=-1))  # ONNX order: i, o, f, c
        i, o, f, cand = (bb.emit(relax.TupleGetItem(parts, k)) for k in range(4))
        if self.peep is not None:  # P: (3 * hidden) as p_i, p_o, p_f
            p_i, p_o, p_f = (self.peep.get(slice(k * n, (k + 1) * n)) for k in range(3))
            i = bb.emit(op.add(i, bb.emit(op.multiply(p_i, self.c))))
            f = bb.emit(op.add(f, bb.emit(op.multiply(p_f, self.c))))
        i = f_act(self._clip(i))
        if int(self.attr.get("input_forget", 0)):
            f = bb.emit(op.subtract(_const(1.0, self.dtype), i))
        else:
            f = f_act(self._clip(f))
        cand = g_act(self._clip(cand))
        c = bb.emit(op.add(bb.emit(op.multiply(f, self.c)), bb.emit(op.multiply(i, cand))))
        if self.peep is not None:
            o = bb.emit(op.add(o, bb.emit(op.multiply(p_o, c))))
        o = f_act(self._clip(o))
        return bb.emit(op.multiply(o, h_act(c))), c

    def _gru(self):
        bb, op, n = self.bb, relax.op, self.hidden
        f_act, g_act = self.fns
        xs = bb.emit(op.split(self.x_t, 3, axis=-1))  # ONNX order: z, r, h
        xz, xr, xh = (bb.emit(relax.TupleGetItem(xs, k)) for k in range(3))
        if int(self.attr.get("linear_before_reset", 0)):
            hs = bb.emit(op.split(self._recurrent(), 3, axis=-1))
            hz, hr, hh = (bb.emit(relax.TupleGetItem(hs, k)) for k in range(3))
            z = f_act(self._clip(bb.emit(op.add(xz, hz))))
            r = f_act(self._clip(bb.emit(op.add(xr, hr))))
            cand = bb.emit(op.add(xh, bb.emit(op.multiply(r, hh))))
        else:
            hs = bb.emit(op.split(self._recurrent(slice(0, 2 * n)), 2, axis=-1))
            hz, hr = (bb.emit(relax.TupleGetItem(hs, k)) for k in range(2))
            z = f_act(self._clip(bb.emit(op.add(xz, hz))))
            r = f_act(self._clip(bb.emit(op.add(xr, hr))))
            reset = bb.emit(op.multiply(r, self.h))
            cand = bb.emit(op.add(xh, self._recurrent(slice(2 * n, 3 * n), h=reset)))
        cand = g_act(self._clip(cand))
        keep = bb.emit(op.multiply(z, self.h))
        new = bb.emit(op.multiply(bb.emit(op.subtract(_const(1.0, self.dtype), z)), cand))
        return bb.emit(op.add(new, keep)), None


CONVERTERS = {"LSTM": LSTM, "GRU": GRU, "RNN": RNN}
