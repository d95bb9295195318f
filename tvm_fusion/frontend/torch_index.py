"""torch.export's ``index.Tensor`` with negative indices (``torch_ops``' converter): each
index counted from the end of its axis before stock's converter runs, a constant one folded at
import, a run-time one through ``where(i < 0, i + n, i)``; an ``arange`` of non-negative start
and step, unsigned indices and symbolic axes left to stock."""

from __future__ import annotations

import logging

import numpy as np
from tvm import relax, tirx

logger = logging.getLogger(__name__)


_ARANGES = ("arange.default", "arange.start", "arange.start_step")


def _non_negative_arange(index) -> bool:
    """An fx ``arange`` node whose values are provably >= 0 (non-negative start and step)."""
    import torch

    if (
        not isinstance(index, torch.fx.Node)
        or getattr(index.target, "__name__", "") not in _ARANGES
    ):
        return False
    args = index.args
    start = args[0] if len(args) >= 2 else index.kwargs.get("start", 0)
    step = args[2] if len(args) >= 3 else index.kwargs.get("step", 1)
    return isinstance(start, int) and start >= 0 and isinstance(step, int) and step > 0


_COPIES = ("lift_fresh_copy.default", "alias.default", "clone.default")


def _constant(index, constants: dict) -> np.ndarray | None:
    """The value of fx node ``index`` where it is a lifted constant tensor (through copies)."""
    while getattr(index.target, "__name__", "") in _COPIES and index.args:
        index = index.args[0]
    if index.op != "placeholder" or index.name not in constants:
        return None
    return constants[index.name].detach().cpu().numpy()


def _wrapped(index, expr: relax.Expr, length, importer, constants) -> relax.Expr | None:
    """``expr`` (the import of fx node ``index``) with negative entries counted from the end of
    an axis of ``length``; None where it is left to stock (the reason logged)."""
    ty = expr.ty
    dtype = str(ty.dtype) if isinstance(ty, relax.TensorType) else ""
    if not dtype.startswith(("int", "uint")):
        return None  # boolean masks and unknown forms: stock's converter
    values = _constant(index, constants)
    if values is not None:
        if not (values < 0).any():
            return None
        if not isinstance(length, tirx.IntImm):
            logger.debug("index.Tensor: negative constant index on a symbolic axis %s", length)
            return None
        return relax.const(np.where(values < 0, values + int(length), values), dtype)
    if _non_negative_arange(index) or dtype.startswith("uint"):
        return None
    if not isinstance(length, tirx.IntImm):
        logger.debug("index.Tensor: index %s on a symbolic axis %s left to stock", index, length)
        return None
    bb = importer.block_builder
    n = relax.const(int(length), dtype)
    negative = bb.emit(relax.op.less(expr, relax.const(0, dtype)))
    shifted = bb.emit(relax.op.add(expr, n))
    return bb.emit(relax.op.where(negative, shifted, expr))


def index_tensor(node, importer, constants) -> relax.Var:
    """Stock's converter on indices made non-negative (see the module docstring)."""
    import torch

    data = importer.env[node.args[0]]
    indices = list(node.args[1])
    shape = data.ty.shape if isinstance(data.ty, relax.TensorType) else None
    seen = [i for i in indices if isinstance(i, torch.fx.Node)]
    if shape is None or not hasattr(shape, "values") or len(seen) != len(set(seen)):
        return importer._index_tensor(node)  # unknown rank, or one index on several axes
    saved = {}
    for axis, index in enumerate(indices):
        if not isinstance(index, torch.fx.Node) or axis >= len(shape.values):
            continue
        fixed = _wrapped(index, importer.env[index], shape.values[axis], importer, constants)
        if fixed is not None:
            saved[index] = importer.env[index]
            importer.env[index] = fixed
    try:
        return importer._index_tensor(node)
    finally:
        importer.env.update(saved)
