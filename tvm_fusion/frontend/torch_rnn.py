"""torch.export's ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (tanh) as ONNX's recurrent ops.

``torch.export``'s decompositions unroll ``aten.lstm.input`` / ``aten.gru.input`` /
``aten.rnn_tanh.input`` into one ``addmm`` / ``bmm`` chain per step, layer and direction,
which nothing of ours can turn back into a loop. :func:`import_keeping_rnns` decomposes the
program without them (``ExportedProgram.run_decompositions`` with those three taken out of
the table) and converts each with ``onnx_rnn``'s code: per layer and direction the input
projection of all steps as one GEMM and the recurrence as ``onnx_rnn`` writes it (a static
sequence: a call of a marked function that ChooseRecurrence makes the loop kernel on CPU or
inlines elsewhere; a symbolic one: the loop kernel). The weights are read from the program's
state dict (constants at import: torch's gate order i, f, g, o / r, z, n reordered into
ONNX's i, o, f, c / z, r, h; GRU is ONNX's ``linear_before_reset = 1``).

Not covered, so the program is imported as before (stock's decomposition, unrolled steps):
LSTM ``proj_size``, dropout in training mode, weights that are not parameters or buffers of
the program, ``rnn_relu``.
"""

from __future__ import annotations

import logging

import numpy as np
from tvm import relax

from . import onnx_rnn

logger = logging.getLogger(__name__)

_KINDS = {"lstm.input": "LSTM", "gru.input": "GRU", "rnn_tanh.input": "RNN"}
# torch's gate blocks in ONNX's order: LSTM i, f, g, o -> i, o, f, g; GRU r, z, n -> z, r, n
_ORDER = {"LSTM": [0, 3, 1, 2], "GRU": [1, 0, 2], "RNN": [0]}


class NotCovered(Exception):
    """A recurrent op this converter leaves to stock's decomposition."""


def rnn_ops():
    import torch

    aten = torch.ops.aten
    return [aten.lstm.input, aten.gru.input, aten.rnn_tanh.input]


def has_rnn(program) -> bool:
    ops = set(rnn_ops())
    return any(n.op == "call_function" and n.target in ops for n in program.graph.nodes)


def keep_rnns(program):
    """``program`` decomposed as ``from_exported_program`` would, but for the recurrent ops."""
    import torch

    table = torch.export.default_decompositions()
    for op in rnn_ops():
        table.pop(op, None)
    return program.run_decompositions(table)


def converters(program) -> dict:
    """``custom_convert_map`` entries for the recurrent ops of ``program`` (decomposed by
    :func:`keep_rnns`); a converter raises :class:`NotCovered` for what it leaves alone."""
    sig = program.graph_signature
    tensors = {}
    for name, target in {**sig.inputs_to_parameters, **sig.inputs_to_buffers}.items():
        tensors[name] = program.state_dict[target]
    for name, target in sig.inputs_to_lifted_tensor_constants.items():
        tensors[name] = program.constants[target]

    def convert(kind):
        return lambda node, importer: _convert(kind, node, importer, tensors)

    return {name: convert(kind) for name, kind in _KINDS.items()}


def _weight(node, tensors) -> np.ndarray:
    tensor = tensors.get(getattr(node, "name", None))
    if tensor is None:
        raise NotCovered(f"weight {node} is not a parameter of the program")
    return tensor.detach().cpu().numpy()


def _reorder(array: np.ndarray, kind: str) -> np.ndarray:
    blocks = np.split(array, len(_ORDER[kind]), axis=0)
    return np.concatenate([blocks[i] for i in _ORDER[kind]], axis=0)


def _convert(kind: str, node, importer, tensors) -> relax.Expr:
    bb, op = importer.block_builder, relax.op
    args = list(node.args)
    x, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = args[:9]
    hx = list(hx) if kind == "LSTM" else [hx]
    per_dir = 4 if has_biases else 2
    dirs = 2 if bidirectional else 1
    if len(params) != per_dir * dirs * layers:
        raise NotCovered(f"{kind} with {len(params)} weights (proj_size?)")
    if train and dropout:
        raise NotCovered(f"{kind} with dropout in training mode")
    weights = [_weight(p, tensors) for p in params]
    x = importer.env[x]
    states = [importer.env[s] for s in hx]
    if batch_first:
        x = bb.emit(op.permute_dims(x, [1, 0, 2]))
    attr = {"direction": "bidirectional" if bidirectional else "forward"}
    if kind == "GRU":
        attr["linear_before_reset"] = 1
    ys, hs, cs = x, [], []
    for layer in range(layers):
        mine = weights[layer * dirs * per_dir : (layer + 1) * dirs * per_dir]
        ws = [mine[d * per_dir + 0] for d in range(dirs)]
        rs = [mine[d * per_dir + 1] for d in range(dirs)]
        w = relax.const(np.stack([_reorder(a, kind) for a in ws]))
        r = relax.const(np.stack([_reorder(a, kind) for a in rs]))
        attr["hidden_size"] = int(rs[0].shape[1])
        b = None
        if has_biases:
            b = relax.const(
                np.stack(
                    [
                        np.concatenate(
                            [_reorder(mine[d * per_dir + k], kind) for k in (2, 3)], axis=0
                        )
                        for d in range(dirs)
                    ]
                )
            )
        init = [
            bb.emit(op.strided_slice(s, [0], [layer * dirs], [(layer + 1) * dirs])) for s in states
        ]
        inputs = [ys, w, r, b, None, *init]
        try:
            out = onnx_rnn._unroll(bb, kind, inputs, attr)
        except ValueError as err:  # what the loop kernel does not cover on a symbolic sequence
            raise NotCovered(str(err)) from None
        y, h, *c = out.fields
        # Y (seq, dirs, batch, hidden) -> (seq, batch, dirs * hidden)
        y = bb.emit(op.permute_dims(y, [0, 2, 1, 3]))
        seq, batch = y.ty.shape.values[0], y.ty.shape.values[1]
        ys = bb.emit(op.reshape(y, [seq, batch, dirs * attr["hidden_size"]]))
        hs.append(h)
        cs += c
    if batch_first:
        ys = bb.emit(op.permute_dims(ys, [1, 0, 2]))
    results = [ys, bb.emit(op.concat(hs, axis=0))]
    if kind == "LSTM":
        results.append(bb.emit(op.concat(cs, axis=0)))
    return bb.emit(relax.Tuple(results))
