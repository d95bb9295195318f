"""Matching one gate GEMM: ``x @ W^T`` / ``x @ W`` (``+ b``, ``+`` non-constant addends) whose
result is split along the output-feature axis into equal pieces (``R.split``, or
``R.strided_slice`` pieces that partition the axis, equal slices counted once).

:func:`_find_gemms` returns a :class:`_Gemm` per such chain of a dataflow block (read through
:class:`_Block`); ``group.py`` then grows the gate math from the pieces. Every refusal is
logged (``skip``) with its reason.
"""

from __future__ import annotations

import dataclasses

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.ir.expr import GenericConst

from .._common import as_i64, get_logger, prove_equal, skip, vars_in
from .ops import _DTYPES

logger = get_logger(__name__)


@dataclasses.dataclass
class _Gemm:
    x: relax.Expr  # (rows..., K)
    weight: relax.Expr  # (k*D, K) when transposed, else (K, k*D)
    transposed: bool
    bias: relax.Expr | None  # broadcastable to (k*D,)
    pieces: list[relax.Var]  # in feature order
    chain: list[relax.Var]  # bindings the group replaces (matmul, add, split, items)
    width: int  # D
    aliases: dict = dataclasses.field(default_factory=dict)  # duplicate slice -> its piece
    # non-constant tensors broadcast to the GEMM output, added to it before the split (an RNN
    # step's input projection): read in the epilogue, added to the accumulator tile
    addends: list = dataclasses.field(default_factory=list)
    # a weight gathered per row (FuseGatheredGates): ``weight`` is the constant (E, k*D, K) or
    # (E, K, k*D) expert weight, ``ids`` the (rows...) expert of each row, proven in [0, E);
    # ``bias`` is then (E, k*D) and gathered likewise when ``gathered_bias``
    ids: relax.Expr | None = None
    gathered_bias: bool = False

    @property
    def gates(self) -> int:
        return len(self.pieces)


def _op(expr) -> str | None:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return None


def _shape(expr) -> list | None:
    sinfo = getattr(expr, "ty", None)
    if isinstance(sinfo, relax.TensorType) and isinstance(sinfo.shape, relax.ShapeExpr):
        return list(sinfo.shape.values)
    return None


def _int(value) -> int | None:
    return int(value.value) if isinstance(value, tirx.IntImm) else None


class _Block:
    """Bindings of one dataflow block with use counts over the whole function."""

    def __init__(self, block: relax.DataflowBlock, uses: dict, outputs: set):
        self.bindings = list(block.bindings)
        self.value = {b.var: b.value for b in self.bindings if isinstance(b, relax.VarBinding)}
        self.index = {b.var: i for i, b in enumerate(self.bindings)}
        self.uses = uses
        self.outputs = outputs  # vars used after the block (non-dataflow)
        self.users: dict = {}
        for b in self.bindings:
            for v in vars_in(b.value):
                self.users.setdefault(v, []).append(b.var)

    @classmethod
    def of(cls, block: relax.DataflowBlock, uses: dict) -> _Block:
        """The block, its outputs being the variables bound outside the dataflow."""
        outputs = {b.var for b in block.bindings if not isinstance(b.var, relax.DataflowVar)}
        return cls(block, uses, outputs)

    def single_use(self, var) -> bool:
        return self.uses.get(var, 0) == 1 and var not in self.outputs


def _find_gemms(blk: _Block) -> list[_Gemm]:
    gemms = []
    for binding in blk.bindings:
        if not isinstance(binding, relax.VarBinding):
            continue
        pieces = _pieces(blk, binding) or _slice_pieces(blk, binding)
        if pieces is None:
            continue
        source, piece_vars, chain, width, aliases = pieces
        gemm = _gemm_of(blk, source, piece_vars, chain, width, aliases)
        if gemm is not None:
            gemms.append(gemm)
    return gemms


def _pieces(blk: _Block, binding) -> tuple | None:
    """A split of ``y`` along its last axis into equal pieces: (y, pieces, chain, width, {})."""
    value = binding.value
    if _op(value) != "relax.split":
        return None
    y = value.args[0]
    shape = _shape(y)
    if shape is None or len(shape) < 2:
        return None
    axis = int(value.attrs.axis) % len(shape)
    what = f"split {binding.var.name}"
    if axis != len(shape) - 1:
        return skip(logger, what, "not on the output-feature (last) axis") or None
    total = _int(shape[-1])
    if total is None:
        return skip(logger, what, "feature axis is symbolic") or None
    sections = value.attrs.indices_or_sections
    if isinstance(sections, tirx.IntImm | int):
        k = int(sections)
        bounds = [total * i // k for i in range(k + 1)]
    else:
        bounds = [0, *[int(i) for i in sections], total]
    widths = {b - a for a, b in zip(bounds, bounds[1:], strict=False)}
    if len(widths) != 1:
        return skip(logger, what, f"unequal pieces {sorted(widths)}") or None
    users = blk.users.get(binding.var, [])
    items: dict[int, relax.Var] = {}
    for user in users:
        item = blk.value.get(user)
        if not isinstance(item, relax.TupleGetItem) or user in items.values():
            return skip(logger, what, "the split tuple is used other than by indexing") or None
        items[int(item.index)] = user
    k = len(bounds) - 1
    if sorted(items) != list(range(k)) or binding.var in blk.outputs:
        return skip(logger, what, "not every piece is taken exactly once") or None
    return y, [items[i] for i in range(k)], [binding.var, *items.values()], widths.pop(), {}


def _last_axis_range(call, shape) -> tuple[int, int] | None:
    """(begin, end) of a stride-1 ``strided_slice`` of the last axis; other axes it names must
    be whole (begin 0, end the dim: what the importer writes for a Slice with computed bounds
    once PlaceShapeOnHost made them symbolic)."""
    fields = [list(a.fields) if isinstance(a, relax.Tuple) else None for a in call.args[1:]]
    if any(f is None for f in fields[:3]) or len({len(f) for f in fields[:3]}) != 1:
        return None
    strides = fields[3] if len(fields) > 3 and fields[3] else [1] * len(fields[0])
    found = None
    for axis, begin, end, stride in zip(*fields[:3], strides, strict=False):
        axis = _int(axis)
        if axis is None or (stride != 1 and _int(stride) != 1):  # 1: strides not given
            return None
        axis %= len(shape)
        if axis == len(shape) - 1:
            found = (_int(begin), _int(end))
            continue
        whole = _int(end) is not None and _int(shape[axis]) is not None
        whole = whole and _int(end) >= _int(shape[axis])
        if _int(begin) != 0 or not (whole or str(end) == str(shape[axis])):
            return None
    if found is None or None in found:
        return None
    return found


def _same_slice(a: relax.Call, b: relax.Call) -> bool:
    """Whether two ``strided_slice`` calls compute the same tensor: the same input and attributes,
    and axes, begins, ends and strides equal field by field (symbolic bounds structurally equal,
    or proven equal by the arith analyzer)."""
    if len(a.args) != len(b.args) or not a.args[0].same_as(b.args[0]):
        return False
    if not tvm_ffi.structural_equal(a.attrs, b.attrs):
        return False
    for fa, fb in zip(a.args[1:], b.args[1:], strict=True):
        if not isinstance(fa, relax.Tuple) or not isinstance(fb, relax.Tuple):
            if not tvm_ffi.structural_equal(fa, fb):
                return False
            continue
        if len(fa.fields) != len(fb.fields):
            return False
        for p, q in zip(fa.fields, fb.fields, strict=True):
            if tvm_ffi.structural_equal(p, q):
                continue
            if not (_is_index(p) and _is_index(q) and prove_equal(as_i64(p), as_i64(q))):
                return False
    return True


def _is_index(expr) -> bool:
    ty = getattr(expr, "ty", None)
    return isinstance(ty, tvm.ir.PrimType) and str(ty.dtype) in ("int32", "int64")


def _dedup_slices(blk: _Block, users: list) -> tuple[list, dict]:
    """The distinct slices among ``users`` (strided_slice bindings of one tensor, block order)
    and ``{duplicate: the first equal slice}``: torch's TorchScript exporter writes a ``chunk``
    piece as a Slice once per use."""
    distinct: list = []
    aliases: dict = {}
    for u in users:
        for d in distinct:
            if tvm_ffi.structural_equal(u.ty, d.ty) and _same_slice(blk.value[u], blk.value[d]):
                aliases[u] = d
                break
        else:
            distinct.append(u)
    return distinct, aliases


def _slice_pieces(blk: _Block, binding) -> tuple | None:
    """``y`` read only by ``strided_slice`` pieces of the last axis that partition it into equal
    widths (ONNX Slice pieces, a chunk written with slices; equal slices are one piece):
    (y, pieces, chain, width, {duplicate slice: its piece})."""
    y = binding.var
    shape = _shape(y)
    users = blk.users.get(y, [])
    if shape is None or len(shape) < 2 or not users or y in blk.outputs:
        return None
    if any(_op(blk.value.get(u)) != "relax.strided_slice" for u in users):
        return None
    total = _int(shape[-1])
    if total is None:
        return None
    users, aliases = _dedup_slices(blk, list(dict.fromkeys(users)))
    ranges = []
    for u in users:
        piece = _last_axis_range(blk.value[u], shape)
        if piece is None:
            return None
        begin, end = piece
        begin, end = (
            begin % total if begin < 0 else begin,
            min(end if end >= 0 else end + total, total),
        )
        ranges.append((begin, end, u))
    ranges.sort(key=lambda r: r[0])
    widths = {e - b for b, e, _ in ranges}
    bounds_ok = (
        ranges[0][0] == 0
        and ranges[-1][1] == total
        and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    )
    if len(widths) != 1 or not bounds_ok:
        skip(logger, f"slices of {y.name}", "the slices do not partition the axis equally")
        return None
    return y, [u for _, _, u in ranges], [], widths.pop(), aliases


def _gemm_of(blk: _Block, y, pieces, chain, width, aliases) -> _Gemm | None:
    what = f"GEMM feeding {pieces[0].name}"
    sliced = not chain  # strided_slice pieces read y directly (several uses, all pieces)
    if not isinstance(y, relax.Var) or y not in blk.value:
        return skip(logger, what, "GEMM output not computed in this block") or None
    if not sliced and not blk.single_use(y):
        return skip(logger, what, "GEMM output used elsewhere") or None
    value = blk.value[y]
    chain = [y, *chain, *(pieces if sliced else []), *aliases]
    addends = []
    while _op(value) == "relax.add" and len(addends) < 4:
        inner = _addend_split(blk, value, width * len(pieces), _shape(y))
        if inner is None:
            break
        var, addend = inner
        addends.append(addend)
        chain.insert(0, var)
        value = blk.value[var]
    bias = None
    if _op(value) == "relax.add":
        lhs, rhs = value.args
        if _op(blk.value.get(lhs)) == "relax.matmul" and isinstance(lhs, relax.Var):
            mm, bias = lhs, rhs
        elif _op(blk.value.get(rhs)) == "relax.matmul" and isinstance(rhs, relax.Var):
            mm, bias = rhs, lhs
        else:
            return skip(logger, what, "an add that is not matmul + bias") or None
        if not blk.single_use(mm):
            return skip(logger, what, "matmul output also used elsewhere") or None
        bias_shape = _shape(bias)
        total = width * len(pieces)
        if (
            bias_shape is None
            or any(_int(d) != 1 for d in bias_shape[:-1])
            or (bias_shape and _int(bias_shape[-1]) not in (1, total))
        ):
            return skip(logger, what, "bias does not broadcast along the features only") or None
        chain.insert(0, mm)
        value = blk.value[mm]
    if _op(value) != "relax.matmul":
        return skip(logger, what, "split input is not a matmul") or None
    x, w = value.args
    x_shape, out_shape = _shape(x), _shape(y)
    if x_shape is None or out_shape is None or len(x_shape) < 2:
        return skip(logger, what, "unknown shapes") or None
    if len(x_shape) != len(out_shape):  # a bias of more dims than the GEMM result
        return skip(logger, what, "the bias adds leading axes to the GEMM result") or None
    if any(str(a) != str(b) for a, b in zip(x_shape[:-1], out_shape[:-1], strict=True)):
        return skip(logger, what, "batched weight") or None
    transposed = False
    if isinstance(w, relax.Var) and _op(blk.value.get(w)) == "relax.permute_dims":
        perm = blk.value[w]
        axes = perm.attrs.axes
        w_shape = _shape(perm.args[0])
        if (
            w_shape is not None
            and len(w_shape) == 2
            and (axes is None or [int(a) for a in axes] == [1, 0])
        ):
            if blk.single_use(w):
                chain.insert(0, w)
            w, transposed = perm.args[0], True
    w_shape = _shape(w)
    if w_shape is None or len(w_shape) != 2:
        return skip(logger, what, "weight is not a 2-D tensor") or None
    n_feat = _int(w_shape[0] if transposed else w_shape[1])
    if n_feat != width * len(pieces):
        return skip(logger, what, "weight rows do not match the split") or None
    dtypes = [str(t.ty.dtype) for t in (x, w, *([bias] if bias is not None else []), *addends)]
    dtypes += [str(value.ty.dtype), str(y.ty.dtype)]  # the matmul's out_dtype, the split input
    if dtypes[0] not in _DTYPES:
        return skip(logger, what, f"dtype {dtypes[0]} (float32, float16, bfloat16 only)") or None
    if len(set(dtypes)) != 1:  # e.g. a float16 GEMM plus a float32 bias
        return skip(logger, what, f"mixed dtypes {sorted(set(dtypes))}") or None
    return _Gemm(x, w, transposed, bias, pieces, chain, width, aliases, addends)


def _addend_split(blk: _Block, add: relax.Call, n_features: int, out_shape) -> tuple | None:
    """``(inner var, addend)`` of ``add(inner, addend)`` where ``inner`` is a matmul or a sum
    (read only here) and ``addend`` a non-constant tensor that broadcasts to the GEMM output
    ``out_shape`` with all ``n_features`` features (an RNN step's input projection), else
    None."""
    for inner, addend in (add.args, add.args[::-1]):
        if not isinstance(inner, relax.Var) or isinstance(addend, GenericConst):
            continue
        if _op(blk.value.get(inner)) not in ("relax.matmul", "relax.add"):
            continue
        shape = _shape(addend)
        if (
            not blk.single_use(inner)
            or shape is None
            or out_shape is None
            or not 2 <= len(shape) <= len(out_shape)
            or _int(shape[-1]) != n_features
            or [str(d) for d in (_shape(inner) or [])] != [str(d) for d in out_shape]
        ):
            continue
        if all(
            _int(a) == 1 or prove_equal(a, b)
            for a, b in zip(shape[:-1], out_shape[-len(shape) : -1], strict=True)
        ):
            return inner, addend
    return None
