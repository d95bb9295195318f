"""FuseGroupedGates: transformers' grouped expert GEMM (``grouped_mm_fallback``) with its gate
epilogue becomes ONE kernel that writes only the gated ``(S, I)`` result (issue #38).

The frontend converts ``transformers::grouped_mm_fallback(x (S, K), W (E, K, N), offs (E,))``
to one ``call_tir`` of a kernel tagged ``GROUPED_ATTR`` (``frontend/torch_moe.py``: row ``r``
is ``x[r] @ W[e(r)]`` for the expert ``e(r)`` whose offset slice holds ``r``, zero for rows of
no expert). This pass matches, in a dataflow block, such a call whose weight is a constant
(``W``, or ``permute_dims(C, [0, 2, 1])`` of a constant ``C (E, N, K)``: transformers'
``gate_up_proj.transpose(-2, -1)``) and whose result is

- split along the features into equal pieces read by gate math: everything FuseSplitGates
  matches from there on (``chunk(2)`` then ``silu(g) * u``, GeGLU, any op of its table), or
- not split and read only by ops of that table (the down projection times the routing
  weight),

and hands it to FuseSplitGates' emitter as a gathered GEMM (FuseGatheredGates' kernel): each
row reads the weight of its expert in place, blocked at compile time per expert, and the gate
rule (``schedule/cpu/gate_fusion.py``) tiles rows x units in registers sized from the target
(symbolic rows padded to the tile; transformers' ``tokens * top_k`` rows become one variable
of the kernel, see ``fuse_split_gates/emit._call_on_rows``). Each row reads its own expert's
weight vectors (one expert per tile where the tile's rows share it was tried: slower, see the
branch history).
The expert of each row is one small kernel before it (:func:`expert_of_rows`, ``E``
comparisons a row, the same slices as the converter, any offsets: unsorted, negative, past
``S``); a row of no expert reads an expert ``E`` of zero weights appended to the constant, so
its GEMM result is zero, as the converter's (for finite inputs: an infinite or NaN input of
such a row gives NaN where torch writes zero, and those rows are transformers' expert-parallel
sentinels, whose inputs are real tokens). Then the gate math runs on it as torch's does.

CPU targets only (the CUDA gate rule knows no expert axis). Left alone, logged at debug level:
a weight that is not a constant, a result used other than above, everything FuseSplitGates
leaves alone in the gate math; the grouped kernel then runs as the converter made it.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import IRModule, relax, te, tirx
from tvm.ir.expr import GenericConst

from .. import target as _target
from ._common import get_logger, record_rewrite, skip
from .fuse_split_gates.emit import _Rewriter
from .fuse_split_gates.match import _Block, _Gemm, _int, _op, _pieces, _shape, _slice_pieces
from .fuse_split_gates.ops import _DTYPES, _ELEMENTWISE

logger = get_logger(__name__)
NAME = "FuseGroupedGates"
# PrimFunc attribute of the converter's grouped GEMM kernel (inputs x, weight, offs)
GROUPED_ATTR = "tvm_fusion.grouped_mm"


def expert_of_rows(rows, offs: te.Tensor, none: int) -> te.Tensor:
    """``(rows,)`` int32: the last expert ``i`` whose slice ``[offs[i-1], offs[i])`` holds the
    row (``offs[-1]`` read as 0; both bounds as Python slice bounds: negative ones wrap by
    ``rows``, then clipped to ``[0, rows]``), ``none`` where no slice does."""
    idx = offs.dtype
    (experts,) = offs.shape

    def bound(v):
        s = tirx.Cast(idx, rows)
        v = tirx.Select(v < tirx.const(0, idx), v + s, v)
        return tirx.max(tirx.min(v, s), tirx.const(0, idx))

    i = te.reduce_axis((0, experts), name="i")

    def expert(r):
        rr = tirx.Cast(idx, r)
        start = tirx.Select(i > 0, bound(offs[tirx.max(i - 1, 0)]), tirx.const(0, idx))
        hit = tirx.all(start <= rr, rr < bound(offs[i]))
        return te.max(tirx.Select(hit, tirx.Cast("int32", i), tirx.const(-1, "int32")), axis=i)

    owner = te.compute((rows,), expert, name="expert")
    if none == -1:
        return owner
    return te.compute(
        (rows,),
        lambda r: tirx.Select(owner[r] < 0, tirx.const(none, "int32"), owner[r]),
        name="expert_or_none",
    )


@tvm.transform.module_pass(opt_level=0, name=NAME)
class FuseGroupedGates:
    """Fuses ``grouped_mm(x, W, offs) -> split -> gates`` into one kernel on ``W[e(row)]``."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        target = _target.resolve_target(self.target)
        if not _target.is_cpu(target):  # the GPU gate rule has no expert axis
            skip(logger, "grouped gate GEMMs", f"target {target.kind.name} is not a CPU")
            return mod
        if not any(_is_grouped(f) for f in mod.functions.values()):
            return mod
        find = lambda blk: _find_grouped(blk, mod)  # noqa: E731
        cache: dict = {}
        prepare = lambda b, g, blk: _experts(b, g, blk, cache)  # noqa: E731
        rewriter = _Rewriter(mod, target, find=find, prepare=prepare)
        out = rewriter.transform()
        record_rewrite(NAME, rewriter.count)
        return out if rewriter.count else mod


def _is_grouped(func) -> bool:
    return (
        isinstance(func, tirx.PrimFunc)
        and func.attrs is not None
        and bool(func.attrs.get(GROUPED_ATTR, False))
    )


def _experts(builder, group, blk, cache: dict) -> None:
    """Emit the expert of each row of the group's grouped GEMMs (one small kernel for each
    offsets and row count of a dataflow block: the gate-up and down GEMMs share it), read by
    their kernel in place of the offsets."""
    for gemm in group.gemms:
        key = (id(blk), gemm.offsets, str(_shape(gemm.x)[0]))
        if key not in cache:
            experts = int(_shape(gemm.offsets)[0].value)
            call = builder.call_te(
                lambda o, x, e=experts: expert_of_rows(x.shape[0], o, e),
                gemm.offsets,
                gemm.x,
                primfunc_name_hint="grouped_rows",
            )
            cache[key] = (blk, builder.emit(call, "experts"))  # blk kept alive with its id
        gemm.ids = cache[key][1]


def _find_grouped(blk: _Block, mod: IRModule) -> list[_Gemm]:
    bindings = [b for b in blk.bindings if isinstance(b, relax.VarBinding)]
    gemms = []
    for binding in bindings:
        pieces = _pieces(blk, binding) or _slice_pieces(blk, binding)
        gemm = _grouped_gemm(blk, mod, *pieces) if pieces is not None else None
        if gemm is not None:
            gemms.append(gemm)
    claimed = {v for g in gemms for v in g.chain}
    for binding in bindings:
        if binding.var in claimed or binding.var in blk.outputs:
            continue
        users = blk.users.get(binding.var, [])
        if not users or not all(_op(blk.value.get(u)) in _ELEMENTWISE for u in users):
            continue
        shape = _shape(binding.var)
        width = _int(shape[-1]) if shape is not None and len(shape) == 2 else None
        if width is not None:  # the down projection: one piece, the whole result
            gemm = _grouped_gemm(blk, mod, binding.var, [binding.var], None, width, {})
            if gemm is not None:
                gemms.append(gemm)
    return gemms


def _grouped_gemm(blk: _Block, mod: IRModule, y, pieces, chain, width, aliases) -> _Gemm | None:
    """The grouped GEMM whose result ``y`` is split into ``pieces`` (``chain``: the split and
    its items, empty for slices; None: unsplit, ``y`` is the one piece), else None."""
    call = blk.value.get(y) if isinstance(y, relax.Var) else None
    if _op(call) != "relax.call_tir" or not isinstance(call.args[0], tvm.ir.GlobalVar):
        return None
    if call.args[0] not in mod or not _is_grouped(mod[call.args[0]]):
        return None
    what = f"grouped GEMM {y.name}"
    if chain is None:
        chain = [y]
    else:  # slices (no chain): _slice_pieces checked that every user is one of them
        sliced = not chain
        if not sliced and not blk.single_use(y):
            return skip(logger, what, "its result is also used elsewhere") or None
        chain = [y, *chain, *(pieces if sliced else []), *aliases]
    x, w, offs = call.args[1].fields[:3]
    weight = _constant_nk(blk, w)
    if weight is None:
        return skip(logger, what, "the expert weight is not a constant") or None
    experts, n_feat, k_dim = weight.shape
    x_shape, o_shape, y_shape = _shape(x), _shape(offs), _shape(y)
    if x_shape is None or len(x_shape) != 2 or _int(x_shape[1]) != k_dim:
        return skip(logger, what, "rows are not (S, K) of the weight's K") or None
    if o_shape is None or len(o_shape) != 1 or _int(o_shape[0]) != experts:
        return skip(logger, what, "offsets are not one per expert") or None
    if y_shape is None or len(y_shape) != 2 or n_feat != width * len(pieces):
        return skip(logger, what, "the split does not cut the features into the pieces") or None
    dtypes = {str(x.ty.dtype), str(y.ty.dtype), str(weight.dtype)}
    if len(dtypes) != 1 or not dtypes <= set(_DTYPES):
        return skip(logger, what, f"dtypes {sorted(dtypes)}") or None
    # expert E: zero weights, read by rows of no expert
    padded = np.concatenate([weight, np.zeros((1, n_feat, k_dim), weight.dtype)])
    gemm = _Gemm(x, relax.const(padded, str(weight.dtype)), True, None, pieces, chain, width)
    gemm.aliases = aliases
    gemm.ids = offs  # read by the group's ordering; the emitter replaces it by the experts
    gemm.offsets = offs
    return gemm


def _constant_nk(blk: _Block, w) -> np.ndarray | None:
    """The expert weight as a ``(E, N, K)`` array: ``permute_dims(C, [0, 2, 1])`` of a
    constant ``C`` (transformers' transposed experts), or a constant ``(E, K, N)``."""
    if isinstance(w, GenericConst):
        return np.ascontiguousarray(w.value.numpy().transpose(0, 2, 1))
    value = blk.value.get(w) if isinstance(w, relax.Var) else None
    if _op(value) != "relax.permute_dims" or not isinstance(value.args[0], GenericConst):
        return None
    axes = value.attrs.axes
    if axes is None or [int(a) for a in axes] != [0, 2, 1]:
        return None
    return value.args[0].value.numpy()
