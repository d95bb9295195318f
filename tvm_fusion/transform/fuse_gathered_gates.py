"""FuseGatheredGates: a mixture-of-experts gate GEMM on gathered expert weights becomes ONE kernel
that reads each row's expert weight in place (issue #38, part 1).

Matches, inside a dataflow block, the routed experts of transformers' ``batched_mm`` form as
torch.export -> TVM's PyTorch frontend writes them:

- ``g = take(W, ids, axis=0)`` of a constant expert weight ``W`` of shape ``(E, k*D, K)`` (or
  ``gather_nd(W, ids[:, None], batch_dims=0)``, ONNX GatherND with an ``(S, 1)`` index: the
  dynamo ONNX export of ``W[ids]``; the kernel reads the index viewed as ``(S,)``), then
  ``squeeze(matmul(g, expand_dims(x, -1)), -1)`` (``bmm(W[ids], x.unsqueeze(-1))``), or of
  shape ``(E, K, k*D)`` with ``squeeze(matmul(expand_dims(x, 1), g), 1)`` (the transposed
  experts); ``reshape`` to ``(S, K, 1)`` / ``(S, 1, K)`` and back to ``(S, k*D)`` is accepted
  for the views. ``x`` is ``(S, K)``, ``ids`` ``(S,)``;
- optionally ``+ b``: ``take(B, ids', axis=0)`` of a constant ``(E, k*D)`` expert bias with ids
  ``ids'`` computing the same values as ``ids`` (the importer writes the index chain once per
  use), or a bias broadcast along the features only (``(k*D,)``);
- the split of the result along the features into ``k`` equal pieces and the gate math on them:
  everything FuseSplitGates matches from there on (``fuse_split_gates/match.py`` for the
  pieces, ``group.py`` for the gate math: SwiGLU / GeGLU ``chunk(2)``, any op of its table).

Emits ONE ``call_tir`` per group through FuseSplitGates' emitter: per tile
``out[s, j] = gate_math(sum_k x[s, k] * W[ids[s], j, k], ...)``; the ``(S, k*D, K)`` gathered
copy and the ``(S, k*D)`` GEMM output never exist. The expert weight is laid out at compile
time per expert in FuseSplitGates' vector blocks, ``(E, D/V, K, k, V)``, and scheduled by the
same CPU rule (``schedule/cpu/gate_fusion.py``). On CUDA (GPU targets) the blocks are 4 units
(``V = 4``) at any row count and the CUDA gate rule runs its split-K GEMV per row
(``schedule/cuda/gate_gemv.py``: each row reads its own expert's weight, so no tile of rows
shares a staged slab), symbolic rows too; the topk that proves the ids in range is a sorting
kernel there, tagged by MarkDispatchedTopK. Runs before FuseSplitGates (which leaves a
gathered GEMM alone: its weight is not 2-D).

The down projection, the same gathered GEMM not split (``squeeze(bmm(W_down[ids], h))``) and
read only by ops of FuseSplitGates' table (the multiply by the routing weight), becomes one
kernel of one "gate" likewise; the top-k sum after it (``view(T, k, H).sum(1)``) stays a
separate kernel on the small ``(S, H)`` result.

Rows sorted by expert: tokens come in order, so a register tile's rows would read up to ``MR``
experts' weights and every expert's weight block would share the L2. Before each group the
rows are sorted by expert (``perm = argsort(ids)``; the kernel reads ``take(x, perm)``, the
sorted ids and its row-indexed gate-math inputs taken likewise) and the results are put back
in row order (``take(result, argsort(perm))``); the down projection reads the gate-up's sorted
result in place, in the same order (ids compared without the exporters' per-use wraps, see
:func:`_sort_rows`). Two argsorts of ``S`` ids and a few row copies: 35 us at 2 rows. CPU
targets only: on CUDA each row's GEMV reads its own expert whatever the order. From
``2 * E * MR`` rows on, each expert's segment is also padded to whole register tiles (one
expert per tile, ``_expert_tiles.py``): the kernels read ``take(x, src)`` and the expert of
each tile, the results go back by ``take(result, dst)``.

Ids out of range: the kernel reads ``W[ids[s]]`` without a check, so the pass fires only where
the graph proves ``0 <= ids < E``: ids derived from ``topk`` (also once the CPU library
dispatch made it a call of ``tvm.contrib.sort.topk``) / ``argmax`` indices over an axis of
extent at most ``E``, through views (reshape, expand_dims, squeeze, flatten, casts to an
integer type), torch's negative-index wrap ``where(i < 0, i + E, i)`` (a no-op on ids proven
non-negative), ``clip`` and integer constants. Ids it cannot bound (a model input, a computed
index) leave the graph alone: clamping would give wrong numbers, and stock's ``take`` (mode
``fast``) reads out of bounds as well.

Data types as FuseSplitGates (float32, float16, bfloat16; one dtype throughout), ids int32 or
int64.

Left alone, logged at debug level: a non-constant expert weight or bias, ids not of the rows'
shape (or of another rank), ids not proven in range, views that do not match the shapes above,
a gathered tensor or GEMM output used elsewhere, everything FuseSplitGates leaves alone in the
gate math.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import IRModule, relax, sym, topi
from tvm.ir.expr import GenericConst

from .. import target as _target
from ..tir_util import iter_stmts
from ._common import get_logger, record_rewrite, skip
from ._expert_tiles import group_tile, plan_layout
from .check_gather_bounds import CHECKED_AXIS, CHECKED_SIGNED
from .fuse_split_gates.emit import _Rewriter
from .fuse_split_gates.match import _Block, _Gemm, _int, _op, _pieces, _shape, _slice_pieces
from .fuse_split_gates.ops import _DTYPES, _ELEMENTWISE
from .mark_topk import TOPK_ATTR

logger = get_logger(__name__)
NAME = "FuseGatheredGates"
_VIEWS = ("relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten")
_INDEX_DTYPES = ("int32", "int64")
_GATHERS = {"relax.take", "relax.gather_nd"}
# One expert per register tile on CPUs (``_expert_tiles.py``); False: the rows sorted only, a
# tile's rows each reading their own expert's weight (kept for A/B measurement)
ENABLE_EXPERT_TILES = True


@tvm.transform.module_pass(opt_level=0, name=NAME)
class FuseGatheredGates:
    """Fuses ``take(W, ids) -> bmm (+ bias) -> split -> gates`` into one kernel on ``W[ids]``."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        target = _target.resolve_target(self.target)
        if not (_target.is_cpu(target) or _target.is_gpu(target)):
            skip(logger, "gathered gate GEMMs", f"target {target.kind.name} has no gate rule")
            return mod
        sorted_outputs: dict = {}  # a sorted group's result -> (its rows sorted, the ids)
        # CPU only: the CUDA rule's split-K GEMV reads each row's own expert whatever the
        # order, and the argsort emitted is the CPU library's kernel
        sort = _target.is_cpu(target)

        def prepare(bb, group, blk):
            key = _unwrapped(blk, group.gemms[0].ids)  # before _flat_ids: of the block
            _flat_ids(bb, group, rewriter)
            if sort:
                _sort_rows(bb, group, rewriter, (blk, key), sorted_outputs, target)

        rewriter = _Rewriter(
            mod, target, find=lambda blk: _find_gathered(blk, mod), prepare=prepare
        )
        out = rewriter.transform()
        record_rewrite(NAME, rewriter.count)
        return out if rewriter.count else mod


def _flat_ids(bb: relax.BlockBuilder, group, rewriter) -> None:
    """GatherND's ``(S, 1)`` ids (see :func:`_gathered_weight`) viewed as the ``(S,)`` that the
    kernel reads, emitted before the group."""
    for gemm in group.gemms:
        shape = _shape(gemm.ids) if gemm.ids is not None else None
        if shape is not None and len(shape) == 2:
            gemm.ids = bb.emit(relax.op.reshape(rewriter.visit_expr(gemm.ids), [shape[0]]))


def _sort_rows(
    bb: relax.BlockBuilder, group, rewriter, key, sorted_outputs: dict, target=None
) -> None:
    """The group's rows sorted by expert (``perm = argsort(ids)``): the kernel runs on
    ``take(x, perm)``, ``take(ids, perm)`` and row-indexed gate-math inputs taken likewise, and
    its results are put back in row order (``take(result, argsort(perm))``, set as
    ``group.unsort`` for the emitter). Tokens come in order, so unsorted a register tile's rows
    read up to ``MR`` experts' weight vectors and all ``E`` experts' weight blocks share the
    L2; sorted, a tile's rows mostly share one expert's. A down projection reading an earlier
    group's result sorted by ids of the same value (``key``: the block and the group's ids
    there) reads that sorted result in place, in the same order. Measured (H 1024,
    I 2816, 8 experts, top 1, 1024 rows, the same kernel on ids sorted vs random, alternating,
    2 threads, load 4-4.7): 0.76x. Left unsorted: one row, several row axes, addends, GEMMs of
    different ids, a gate-math input that is neither row-indexed ``(S, n)`` nor broadcast
    along the rows.

    One expert per register tile (``transform/_expert_tiles.py``): each expert's segment of
    the sorted rows is padded to the rule's tile height, the kernel reads ``x[src]`` and the
    expert of each tile, the results go back by ``take(result, dst)``; the down projection
    reads the gate-up's padded result in place."""
    gemms = group.gemms
    ids = gemms[0].ids
    if ids is None or len(group.rows) != 1 or _int(group.rows[0]) == 1:
        return
    if any(g.ids is None or not g.ids.same_as(ids) or g.addends for g in gemms):
        return
    rows = group.rows[0]
    analyzer = sym.Analyzer()
    permuted = []  # per external: True where taken by the permutation
    for ext in group.externals:
        shape = _shape(ext)
        if shape is None or len(shape) > 2:
            return
        if len(shape) == 2 and _int(shape[0]) != 1:
            if not analyzer.can_prove_equal(shape[0], rows):
                return
            permuted.append(True)
        else:
            permuted.append(False)
    ids = rewriter.visit_expr(ids)
    blk, key = key
    # (sorted result, its block, ids, perm, unsort) of the earlier groups of this block
    same = lambda v: v[1] is blk and _same_value(blk, v[2], key)  # noqa: E731
    earlier = [v for v in sorted_outputs.values() if same(v)]
    if earlier:  # the same order as an earlier group's
        perm, group.unsort, layout = earlier[0][3:]
    else:
        perm = bb.emit(_argsort(bb, ids), "expert_order")
        group.unsort = bb.emit(_argsort(bb, perm), "row_order")
        layout = plan_layout(bb, group, ids, perm, target) if ENABLE_EXPERT_TILES else None
    order = perm
    if layout is not None:  # rows padded to one expert per tile: read x[src], put back by dst
        order, tiles, group.unsort, n_tiles, k_rows, mr = layout
        group.expert_tiles = (mr, k_rows, n_tiles, group_tile(group, target, mr))
    for gemm in gemms:
        known = sorted_outputs.get(gemm.x) if isinstance(gemm.x, relax.Var) else None
        if known is not None and same(known):
            gemm.x = known[0]
        else:
            gemm.x = bb.emit(relax.op.take(rewriter.visit_expr(gemm.x), order, axis=0))
        if layout is not None:
            gemm.ids = tiles
        else:
            gemm.ids = bb.emit(relax.op.take(ids, perm, axis=0), "experts_sorted")
    group.external_args = [
        bb.emit(relax.op.take(rewriter.visit_expr(e), order, axis=0)) if p else e
        for e, p in zip(group.externals, permuted, strict=True)
    ]
    group.sorted_outputs = sorted_outputs
    group.sort_key = (blk, key, perm, group.unsort, layout)


def _argsort(bb: relax.BlockBuilder, values):
    """``argsort(values)`` (int32) as the kernel that the library dispatch makes of Relax's
    argsort on a CPU (it ran before this pass)."""
    sort = lambda v: topi.argsort(v, axis=0, is_ascend=True, dtype="int32")  # noqa: E731
    return bb.call_te(sort, values, primfunc_name_hint="argsort")


def _find_gathered(blk: _Block, mod: IRModule) -> list[_Gemm]:
    blk.mod = mod  # read by _index_range (topk dispatched to a library call)
    bindings = [b for b in blk.bindings if isinstance(b, relax.VarBinding)]
    gemms = []
    for binding in bindings:
        pieces = _pieces(blk, binding) or _slice_pieces(blk, binding)
        gemm = _gathered_gemm(blk, *pieces) if pieces is not None else None
        if gemm is not None:
            gemms.append(gemm)
    claimed = {v for g in gemms for v in g.chain}  # a split GEMM is not also an unsplit one
    for binding in bindings:
        if binding.var in claimed or not _unsplit(blk, binding):
            continue
        # the down projection: one piece, the whole result
        width = _int(_shape(binding.var)[-1])
        gemm = _gathered_gemm(blk, binding.var, [binding.var], None, width, {})
        if gemm is not None:
            gemms.append(gemm)
    return gemms


def _unsplit(blk: _Block, binding) -> bool:
    """A 2-D view of a matmul of a ``take`` / ``gather_nd``, read only by gate-table ops (the down
    projection times the routing weight), not split."""
    shape = _shape(binding.var)
    if _op(binding.value) not in _VIEWS or shape is None or len(shape) != 2:
        return False
    if _int(shape[-1]) is None or binding.var in blk.outputs:
        return False
    mm = _bound(blk, binding.value.args[0])
    if _op(mm) != "relax.matmul" or not {_op(_bound(blk, a)) for a in mm.args} & _GATHERS:
        return False
    users = blk.users.get(binding.var, [])
    return bool(users) and all(_op(blk.value.get(u)) in _ELEMENTWISE for u in users)


def _bound(blk: _Block, var):
    """The value bound to ``var`` in the block, else None."""
    return blk.value.get(var) if isinstance(var, relax.Var) else None


def _gathered_gemm(blk: _Block, y, pieces, chain, width, aliases) -> _Gemm | None:
    """The gathered GEMM whose result ``y`` is split into ``pieces`` (``chain``: the split and
    its items, empty for slices; None: unsplit, ``y`` is the one piece), else None."""
    what = f"gathered GEMM feeding {pieces[0].name}"
    if chain is None:
        chain = [y]
    else:
        sliced = not chain
        if _bound(blk, y) is None or (not sliced and not blk.single_use(y)):
            return None
        chain = [y, *chain, *(pieces if sliced else []), *aliases]
    n_feat = width * len(pieces)
    value = blk.value[y]
    bias = None
    gathered_bias = False
    if _op(value) == "relax.add":
        lhs, rhs = value.args
        inner, bias = (lhs, rhs) if _op(_bound(blk, lhs)) in _VIEWS else (rhs, lhs)
        if _op(_bound(blk, inner)) not in _VIEWS or not blk.single_use(inner):
            return None
        chain.insert(0, inner)
        value = blk.value[inner]
    if _op(value) not in _VIEWS or not isinstance(value.args[0], relax.Var):
        return None
    mm = value.args[0]
    if _op(_bound(blk, mm)) != "relax.matmul" or not blk.single_use(mm):
        return None
    chain.insert(0, mm)
    a, b = blk.value[mm].args
    # (S, N, K) @ (S, K, 1) or (S, 1, K) @ (S, K, N)
    transposed = _op(_bound(blk, a)) in _GATHERS
    take, vec = (a, b) if transposed else (b, a)
    if _op(_bound(blk, take)) not in _GATHERS:
        return None
    found = _gathered_weight(blk, take, what)
    if found is None:
        return None
    weight, ids = found
    if blk.single_use(take):
        chain.insert(0, take)
    else:
        return skip(logger, what, "the gathered weight is also used elsewhere") or None
    experts = _int(_shape(weight)[0])
    w_shape = [_int(d) for d in _shape(weight)]
    x = _row_vector(blk, vec, 2 if transposed else 1)
    ids_shape, x_shape = _shape(ids), _shape(x) if x is not None else None
    if x is None or x_shape is None or len(x_shape) != 2:
        return skip(logger, what, "the rows are not an (S, K) tensor viewed as (S, K, 1)") or None
    k_dim = w_shape[2] if transposed else w_shape[1]
    if (w_shape[1] if transposed else w_shape[2]) != n_feat or _int(x_shape[1]) != k_dim:
        return skip(logger, what, "weight shape does not match the split and rows") or None
    rank = 2 if _op(_bound(blk, take)) == "relax.gather_nd" else 1  # (S, 1) / (S,)
    if (
        ids_shape is None
        or len(ids_shape) != rank
        or str(ids_shape[0]) != str(x_shape[0])
        or (rank == 2 and _int(ids_shape[1]) != 1)
    ):
        return skip(logger, what, "ids are not one per row") or None
    out_shape = _shape(y)
    if (
        out_shape is None
        or len(out_shape) != 2
        or str(out_shape[0]) != str(x_shape[0])
        or _int(out_shape[1]) != n_feat
    ):
        return skip(logger, what, "the GEMM result is not viewed back as (S, N)") or None
    if bias is not None:
        found, gathered_bias = _bias(blk, bias, ids, experts, n_feat, what)
        if found is None:
            return None
        bias, take_bias = found
        if take_bias is not None and blk.single_use(take_bias):
            chain.insert(0, take_bias)
    index_range = _index_range(blk, ids)
    if index_range is None or index_range[0] < 0 or index_range[1] >= experts:
        return skip(logger, what, f"ids not proven in [0, {experts}): {index_range}") or None
    dtypes = {str(t.ty.dtype) for t in (x, weight, *([bias] if bias is not None else []))}
    dtypes |= {str(blk.value[mm].ty.dtype), str(y.ty.dtype)}
    if len(dtypes) != 1 or not dtypes <= set(_DTYPES):
        return skip(logger, what, f"dtypes {sorted(dtypes)}") or None
    gemm = _Gemm(x, weight, transposed, bias, pieces, chain, width, aliases)
    gemm.ids, gemm.gathered_bias = ids, gathered_bias
    return gemm


def _gathered_weight(blk: _Block, take, what: str) -> tuple | None:
    """(constant 3-D weight, ids) of ``take(W, ids, axis=0)`` or ``gather_nd(W, ids,
    batch_dims=0)`` (ids ``(S, 1)``, checked by the caller), else None."""
    call = blk.value[take]
    weight, ids = call.args
    if not isinstance(weight, GenericConst):
        return skip(logger, what, "the expert weight is not a constant") or None
    shape = _shape(weight)
    if shape is None or len(shape) != 3 or any(_int(d) is None for d in shape):
        return skip(logger, what, "the expert weight is not (E, N, K)") or None
    nd = _op(call) == "relax.gather_nd"
    if int(call.attrs.batch_dims if nd else call.attrs.axis) != 0:
        return skip(logger, what, "gather not along the expert axis") or None
    if str(getattr(ids.ty, "dtype", "")) not in _INDEX_DTYPES:
        return skip(logger, what, "ids are not integers") or None
    return weight, ids


def _row_vector(blk: _Block, vec, axis: int):
    """``x`` (S, K) of ``expand_dims(x, axis)`` (or a reshape adding that unit axis)."""
    value = _bound(blk, vec)
    if _op(value) not in ("relax.expand_dims", "relax.reshape"):
        return None
    x = value.args[0]
    x_shape, v_shape = _shape(x), _shape(vec)
    if x_shape is None or v_shape is None or len(x_shape) != 2 or len(v_shape) != 3:
        return None
    kept = [d for i, d in enumerate(v_shape) if i != axis]
    if _int(v_shape[axis]) != 1 or [str(d) for d in kept] != [str(d) for d in x_shape]:
        return None
    return x


def _bias(blk: _Block, bias, ids, experts: int, n_feat: int, what: str):
    """((bias expr, its take var or None), gathered?) or (None, False)."""
    value = _bound(blk, bias)
    if _op(value) == "relax.take":
        table, bias_ids = value.args
        shape = _shape(table)
        if (
            not isinstance(table, GenericConst)
            or shape is None
            or [_int(d) for d in shape] != [experts, n_feat]
            or int(value.attrs.axis) != 0
            or not _same_value(blk, bias_ids, ids)
        ):
            skip(logger, what, "a gathered bias not of the weight's experts")
            return None, False
        return (table, bias), True
    shape = _shape(bias)
    if (
        not isinstance(bias, GenericConst)
        or shape is None
        or any(_int(d) != 1 for d in shape[:-1])
        or (shape and _int(shape[-1]) not in (1, n_feat))
    ):
        skip(logger, what, "bias does not broadcast along the features only")
        return None, False
    return (bias, None), False


def _same_value(blk: _Block, a, b, depth: int = 8) -> bool:
    """Whether ``a`` and ``b`` compute the same tensor: the same variable, equal constants, or
    the same op with equal attributes on arguments of the same value."""
    if a.same_as(b):
        return True
    if isinstance(a, GenericConst) and isinstance(b, GenericConst):
        return tvm_ffi.structural_equal(a, b)
    va, vb = _bound(blk, a), _bound(blk, b)
    if depth == 0 or not isinstance(va, relax.Call) or not isinstance(vb, relax.Call):
        return False
    if not va.op.same_as(vb.op) or len(va.args) != len(vb.args):
        return False
    if not tvm_ffi.structural_equal(va.attrs, vb.attrs):
        return False
    return all(
        _same_value(blk, p, q, depth - 1)
        if isinstance(p, relax.Var | GenericConst)
        else tvm_ffi.structural_equal(p, q)
        for p, q in zip(va.args, vb.args, strict=True)
    )


def _index_range(blk: _Block, expr, depth: int = 16) -> tuple[int, int] | None:
    """``(lo, hi)`` bounding every element of the integer tensor ``expr``, from the graph; None
    when not proven (see the module docstring for the forms)."""
    if depth == 0:
        return None
    if isinstance(expr, GenericConst):
        data = expr.value.numpy()
        if data.dtype.kind not in "iu" or data.size == 0:
            return None
        return int(data.min()), int(data.max())
    if isinstance(expr, relax.TupleGetItem):
        tup = _bound(blk, expr.tuple_value)
        if _op(tup) == "relax.topk" and str(tup.attrs.ret_type) == "both" and expr.index == 1:
            return _arg_range(tup.args[0], int(tup.attrs.axis))
        library = _library_topk(blk, tup)
        if expr.index == 1 and library is not None and library[0] == "both":
            return _arg_range(tup.args[1].fields[0], library[1])
        return None
    value = _bound(blk, expr)
    if value is None:
        return None
    if isinstance(value, relax.TupleGetItem) or isinstance(value, relax.Var):
        return _index_range(blk, value, depth - 1)
    checked = _checked_range(blk, value)
    if checked is not None:
        return checked
    name = _op(value)
    library = _library_topk(blk, value)
    if library is not None and library[0] == "indices":
        return _arg_range(value.args[1].fields[0], library[1])
    if name == "relax.topk" and str(value.attrs.ret_type) == "indices":
        return _arg_range(value.args[0], int(value.attrs.axis))
    if name in ("relax.argmax", "relax.argmin") and value.attrs.axis is not None:
        return _arg_range(value.args[0], int(value.attrs.axis))
    if name in _VIEWS or name in ("relax.permute_dims", "relax.broadcast_to"):
        return _index_range(blk, value.args[0], depth - 1)
    if name == "relax.astype" and str(value.attrs.dtype) in _INDEX_DTYPES:
        return _index_range(blk, value.args[0], depth - 1)
    if name == "relax.where":
        cond, then, other = value.args
        cv = _bound(blk, cond)
        if _op(cv) == "relax.less" and _zero(cv.args[1]):
            tested = _index_range(blk, cv.args[0], depth - 1)
            if tested is not None and tested[0] >= 0:  # i < 0 never holds: the else branch
                if _same_value(blk, cv.args[0], other):
                    return tested
                return _index_range(blk, other, depth - 1)
        ranges = [_index_range(blk, e, depth - 1) for e in (then, other)]
        if None in ranges:
            return None
        return min(r[0] for r in ranges), max(r[1] for r in ranges)
    if name == "relax.add":
        ranges = [_index_range(blk, e, depth - 1) for e in value.args]
        if None in ranges:
            return None
        return ranges[0][0] + ranges[1][0], ranges[0][1] + ranges[1][1]
    if name == "relax.clip":
        inner = _index_range(blk, value.args[0], depth - 1)
        lo, hi = (_prim_int(v) for v in value.args[1:])
        if inner is None or lo is None or hi is None:
            return None
        return max(inner[0], lo), min(inner[1], hi)
    return None


def _unwrapped(blk: _Block, ids, depth: int = 8):
    """``ids`` without the no-ops that an exporter writes once per use of the ids: torch's
    negative-index wrap ``where(i < 0, i + E, i)`` of ids proven non-negative (the dynamo ONNX
    export computes ``E`` from each weight's shape), CheckGatherBounds' check (the ids
    returned in place); compared by :func:`_same_value`."""
    value = _bound(blk, ids)
    if depth == 0 or value is None:
        return ids
    if _checked_range(blk, value) is not None:
        return _unwrapped(blk, value.args[1].fields[1], depth - 1)
    if _op(value) == "relax.where":
        cond, _then, other = value.args
        cv = _bound(blk, cond)
        if _op(cv) == "relax.less" and _zero(cv.args[1]) and _same_value(blk, cv.args[0], other):
            tested = _index_range(blk, cv.args[0])
            if tested is not None and tested[0] >= 0:
                return _unwrapped(blk, other, depth - 1)
    return ids


def _checked_range(blk: _Block, call) -> tuple[int, int] | None:
    """The ids CheckGatherBounds' ``call_tir_inplace(check_bounds, (x, ids))`` lets through:
    the kernel fails at run time unless every id is in ``[0, n)`` (``[-n, n)`` when signed),
    ``n`` the static extent of ``x``'s checked axis; None for anything else."""
    if _op(call) != "relax.call_tir_inplace" or not isinstance(call.args[0], tvm.ir.GlobalVar):
        return None
    mod = getattr(blk, "mod", None)
    func = mod[call.args[0]] if mod is not None and call.args[0] in mod else None
    if not isinstance(func, tvm.tirx.PrimFunc) or func.attrs is None:
        return None
    axis = func.attrs.get(CHECKED_AXIS)
    if axis is None or not isinstance(call.args[1], relax.Tuple) or len(call.args[1].fields) != 2:
        return None
    shape = _shape(call.args[1].fields[0])
    extent = None if shape is None else _int(shape[int(axis) % len(shape)])
    if extent is None:
        return None
    return (-extent if bool(func.attrs.get(CHECKED_SIGNED, False)) else 0), extent - 1


def _library_topk(blk: _Block, call) -> tuple[str, int] | None:
    """``(ret_type, axis)`` of a ``call_tir`` of the kernel that the CPU library dispatch makes
    of ``relax.topk`` (one ``call_packed("tvm.contrib.sort.topk", data, outs..., k, axis,
    ret_type, is_ascend)``), or of a GPU dispatch's kernel tagged by MarkDispatchedTopK; None
    for anything else."""
    if _op(call) != "relax.call_tir" or not isinstance(call.args[1], relax.Tuple):
        return None
    if len(call.args[1].fields) != 1 or not isinstance(call.args[0], tvm.ir.GlobalVar):
        return None
    func = getattr(blk, "mod", None)
    func = func[call.args[0]] if func is not None and call.args[0] in func else None
    if not isinstance(func, tvm.tirx.PrimFunc):
        return None
    tag = func.attrs.get(TOPK_ATTR) if func.attrs is not None else None
    if tag is not None:  # a GPU dispatch's sorting kernel (MarkDispatchedTopK)
        return str(tag["ret_type"]), int(tag["axis"])
    found = []
    for stmt in iter_stmts(func.body):
        value = getattr(stmt, "value", None) if isinstance(stmt, tvm.tirx.Evaluate) else None
        if isinstance(value, tvm.ir.Call) and value.args:
            name = value.args[0]
            if isinstance(name, tvm.ir.StringImm) and name.value == "tvm.contrib.sort.topk":
                found.append(value)
    if len(found) != 1:
        return None
    args = found[0].args
    kinds = [i for i, a in enumerate(args) if isinstance(a, tvm.ir.StringImm)][1:]
    if len(kinds) != 1 or args[kinds[0]].value not in ("both", "indices"):
        return None
    axis = args[kinds[0] - 1]
    if not isinstance(axis, tvm.tirx.IntImm):
        return None
    return args[kinds[0]].value, int(axis.value)


def _arg_range(data, axis: int) -> tuple[int, int] | None:
    shape = _shape(data)
    if shape is None:
        return None
    extent = _int(shape[axis % len(shape)])
    return None if extent is None else (0, extent - 1)


def _zero(expr) -> bool:
    if not isinstance(expr, GenericConst):
        return False
    data = expr.value.numpy()
    return data.size == 1 and data.reshape(-1)[0] == 0


def _prim_int(expr) -> int | None:
    value = getattr(expr, "value", None)
    if isinstance(value, tvm.tirx.IntImm):
        return int(value.value)
    if isinstance(value, tvm.tirx.FloatImm) and float(value.value).is_integer():
        return int(value.value)
    return None
