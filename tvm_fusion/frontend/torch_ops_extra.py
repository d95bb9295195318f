"""More torch.export converters that apache-tvm 0.27's ``from_exported_program`` gets wrong
(the rest of the table: ``torch_ops``, which merges this one into its ``CONVERTERS``).

- ``slice.Tensor`` to a symbolic end that torch proved in bounds (found by a BERT-style
  sequence classifier with a dynamic sequence, issue #40: ``position_ids[:, :seq]`` of a
  ``(1, max_pos)`` buffer, ``seq`` a ``Dim`` whose maximum is ``max_pos``): stock emits
  ``strided_slice`` with the end clipped, declared ``(1, T.min(seq, 16))``; added to the
  ``(batch, seq, h)`` token embeddings the broadcast cannot match ``seq`` with
  ``T.min(seq, 16)``, so the sum and everything after it lost its shape, and the loss's
  ``logits.view(-1, num_labels)`` failed to import ("Reshape expects the input tensor to have
  known shape"). Where the length torch recorded for the result (``node.meta["val"]``) is
  ``end - start`` (torch found no clipping: the ``Dim``'s range is within the axis), the slice
  is emitted with ``assume_inbound=True``: declared ``(1, seq)``, the same values. A step
  other than 1, a start that is not a non-negative integer, or a length torch leaves clipped
  (``Min(seq, 16)``) go to stock's converter as they are.
- ``empty.memory_format`` / ``empty.default`` / ``empty_permuted.default`` to a symbolic
  size (transformers' grouped experts: ``inv_perm = torch.empty_like(perm)`` of the ``T * k``
  routed pairs, decomposed to ``empty_permuted(sym_size)``): stock passes the fx nodes of the
  size to ``relax.op.zeros`` ("Expected ``Array<ir.Expr>`` but got ``Array[index 0:
  ffi.OpaquePyObject]``"); the size's entries are read from the importer's environment (their
  ``PrimExpr``), the result zeros as stock's.
"""

from __future__ import annotations

import logging

import tvm
from tvm import relax

logger = logging.getLogger(__name__)


def stock(importer, name: str):
    """Stock's converter of ``name`` (the custom map replaced it in ``importer.convert_map``)."""
    table = getattr(importer, "_tvm_fusion_stock", None)
    if table is None:
        table = importer._tvm_fusion_stock = importer.create_convert_map()
    return table[name]


def _sym_expr(value):
    """The sympy expression of a torch SymInt or int ``value`` (None for anything else)."""
    import sympy
    import torch

    if isinstance(value, torch.SymInt):
        return value.node.expr
    if isinstance(value, int) and not isinstance(value, bool):
        return sympy.Integer(value)
    return None


def _in_bounds_length(node, dim: int, start: int, end_node) -> bool:
    """torch recorded the slice's length on ``dim`` as ``end - start`` (no clipping)."""
    import sympy

    val = node.meta.get("val")
    end_val = end_node.meta.get("val")
    shape = getattr(val, "shape", None)
    if shape is None or not -len(shape) <= dim < len(shape):
        return False
    length, end = _sym_expr(shape[dim]), _sym_expr(end_val)
    if length is None or end is None:
        return False
    return sympy.expand(length - (end - start)) == 0


def _slice(node, importer) -> relax.Var:
    """``x[..., start:end]`` with a symbolic ``end`` torch proved in bounds (see the docstring)."""
    import torch

    args = list(node.args) + [None] * (5 - len(node.args))
    x_node, dim, start, end, step = args[:5]
    dim = 0 if dim is None else dim
    start = 0 if start is None else start
    step = 1 if step is None else step
    x = importer.env.get(x_node)
    if (
        not isinstance(end, torch.fx.Node)
        or not isinstance(dim, int)
        or not isinstance(start, int)
        or start < 0
        or step != 1
        or not isinstance(getattr(x, "ty", None), relax.TensorType)
        or x.ty.ndim < 0
    ):
        return stock(importer, "slice.Tensor")(node)
    end_expr = importer.env.get(end)
    if not tvm.ir.is_prim_expr(end_expr) or not _in_bounds_length(node, dim, start, end):
        return stock(importer, "slice.Tensor")(node)
    axis = dim + x.ty.ndim if dim < 0 else dim
    shape = importer.shape_of(x)
    if start == 0 and shape is not None and tvm.ir.prim.expr_deep_equal(end_expr, shape[axis]):
        return x  # the whole axis
    logger.debug("%s: slice to %s in bounds (torch's length)", node, end_expr)
    bb = importer.block_builder
    return bb.emit(relax.op.strided_slice(x, [axis], [start], [end_expr], [1], assume_inbound=True))


def _empty(name: str):
    """``empty(size)`` with symbolic entries in ``size`` (see the docstring)."""

    def convert(node, importer) -> relax.Var:
        import torch

        size = node.args[0] if node.args else None
        if not isinstance(size, list | tuple) or not any(
            isinstance(d, torch.fx.Node) for d in size
        ):
            return stock(importer, name)(node)
        dims = [importer.env[d] if isinstance(d, torch.fx.Node) else d for d in size]
        if not all(isinstance(d, int) or tvm.ir.is_prim_expr(d) for d in dims):
            return stock(importer, name)(node)
        dtype = importer._convert_data_type(
            node.kwargs.get("dtype", torch.get_default_dtype()), importer.env
        )
        return importer.block_builder.emit(relax.op.zeros(relax.ShapeExpr(dims), dtype))

    return convert


CONVERTERS = {
    "slice.Tensor": _slice,
    **{n: _empty(n) for n in ("empty.memory_format", "empty.default", "empty_permuted.default")},
}
