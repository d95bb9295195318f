"""Emitting a gate group: the TE of its fused kernel (:func:`_compute`: GEMM stages on the
blocked or in-place weight, bias and addends added to the accumulator tile, the pieces read
from it, the gate math, each result rounded once) and :class:`_Rewriter`, which replaces each
group of a dataflow block by ONE ``call_tir`` of that kernel, marked opaque (``op_pattern``
8) and tagged with ``GATE_ATTR`` hints (block, gates, width) for the schedule.
"""

from __future__ import annotations

import math

from tvm import IRModule, relax, sym, te, tirx, topi
from tvm.ir import is_prim_expr
from tvm.ir.expr import GenericConst
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.tirx.analysis import undefined_vars

from ... import target as _target
from ...schedule._common import GATE_ATTR
from .._common import get_logger, skip, use_counts
from .group import _Group, _grow
from .match import _Block, _find_gemms, _int
from .ops import _ACC, _HALF, _emit_op
from .plan import _blocked_weight, _emission_order, _gathered_weight, _plan_block

logger = get_logger(__name__)


def _gemm_stage(
    x, w, layout: str, block: int, width: int, gates: int, n_rows: int, name: str, ids=None,
    pad_rows: int | None = None, tile: int | None = None,
):  # fmt: skip
    """``Y[rows, gate, d] = sum_k x[rows, k] * W(gate, d, k)`` for one weight layout. With the
    blocked weight, ``Y`` is blocked like it, ``Y[rows, gate, d // V, d % V]``: every index is
    then a plain iterator (an einsum, which ``pad_einsum`` can pad) and one ``V`` block of
    units is one contiguous vector of each gate. ``gathered``: the blocked weight of expert
    ``ids[rows]``, ``Wg[ids[rows], d // V, k, gate, d % V]``, read in place; with
    ``pad_rows``, ``Y`` has the rows rounded up to a multiple of it, the padded ones reading
    the last row (``pad_einsum`` refuses the indirect read: the rule's tile of ``pad_rows``
    rows then has no tail). With ``tile`` (one expert per register tile, see
    ``transform/_expert_tiles.py``), ``ids`` holds the expert of each ``tile`` rows:
    ``Wg[ids[row // tile], ...]``, one weight vector per ``k`` for all the tile's rows.
    Half-precision ``x`` and ``w`` are widened: the sum accumulates in float32."""
    kk = te.reduce_axis((0, x.shape[-1]), name="k")

    def mul(a, b):
        if a.dtype == _ACC:
            return a * b
        return a.astype(_ACC) * b.astype(_ACC)

    if layout == "gathered":  # (E, D/V, K, gates, V), expert ids[rows]
        lead = list(x.shape[:-1])
        if pad_rows is not None:  # one row axis (a gathered x is (S, K))
            last = lead[-1] - 1
            lead[-1] = (lead[-1] + pad_rows - 1) // pad_rows * pad_rows

        def gathered(*idx):
            rows, gate, do, di = idx[:n_rows], idx[n_rows], idx[n_rows + 1], idx[n_rows + 2]
            row = rows[-1]
            if pad_rows is not None:
                rows = (*rows[:-1], tirx.min(rows[-1], last))
            expert = ids[rows] if tile is None else _tile_expert(ids, row, rows[-1], tile)
            return te.sum(mul(x[(*rows, kk)], w[expert, do, kk, gate, di]), axis=kk)

        blocks = -(-width // block)
        return te.compute((*lead, gates, blocks, block), gathered, name=name)

    if layout == "blocked":  # (D/V, K, gates, V)

        def blocked(*idx):
            rows, gate, do, di = idx[:n_rows], idx[n_rows], idx[n_rows + 1], idx[n_rows + 2]
            return te.sum(mul(x[(*rows, kk)], w[do, kk, gate, di]), axis=kk)

        blocks = -(-width // block)  # the last block padded (zero weight columns)
        return te.compute((*x.shape[:-1], gates, blocks, block), blocked, name=name)

    def weight(gate, d):
        if layout == "nk":  # (gates*D, K)
            return w[gate * width + d, kk]
        return w[kk, gate * width + d]  # (K, gates*D)

    def body(*idx):
        rows, gate, d = idx[:n_rows], idx[n_rows], idx[n_rows + 1]
        return te.sum(mul(x[(*rows, kk)], weight(gate, d)), axis=kk)

    return te.compute((*x.shape[:-1], gates, width), body, name=name)


def _tile_expert(ids, row, clamped, tile: int):
    """The expert of ``row`` laid out one expert per tile of ``tile`` rows: ``ids`` is
    ``(tiles, per_row)`` (``transform/_expert_tiles.py``); ``per_row``'s last element set: the
    rows are sorted only, each reads its own expert. The CPU gate rule unswitches the select
    (``UNSWITCH``), each branch scheduled alike: one weight vector a ``k`` per tile."""
    tiles, per_row = ids
    flag = per_row[per_row.shape[0] - 1]
    return tirx.Select(flag != 0, per_row[clamped], tiles[row // tile])


def _bias_stage(y, bias, width: int, n_rows: int, name: str, ids=None, tile=None):
    """``y + bias``; with ``ids``, ``bias`` is ``(E, gates * width)`` and row ``r`` adds the
    row of expert ``ids[r]`` (``ids[r // tile]`` with ``tile``, see :func:`_gemm_stage`)."""
    if ids is not None:
        blocked = len(y.shape) == n_rows + 3

        def gathered(*idx):
            gate = idx[n_rows]
            d = idx[n_rows + 1] * y.shape[-1] + idx[n_rows + 2] if blocked else idx[n_rows + 1]
            if blocked and _int(y.shape[-1]) * _int(y.shape[-2]) != width:
                d = tirx.min(d, width - 1)
            row = idx[n_rows - 1]
            expert = ids[idx[:n_rows]] if tile is None else _tile_expert(ids, row, row, tile)
            value = bias[expert, gate * width + d]
            return y(*idx) + _widen(bias, value, y.dtype)

        return te.compute(y.shape, gathered, name=name)
    if not bias.shape:  # a scalar bias (ONNX Add of a 0-d constant)
        return te.compute(y.shape, lambda *idx: y(*idx) + _widen(bias, bias(), y.dtype), name=name)
    per_feature = _int(bias.shape[-1]) != 1
    lead = [0] * (len(bias.shape) - 1)
    blocked = len(y.shape) == n_rows + 3
    block = y.shape[-1] if blocked else None

    def body(*idx):
        gate = idx[n_rows]
        d = idx[n_rows + 1] * block + idx[n_rows + 2] if blocked else idx[n_rows + 1]
        if blocked and _int(block) * _int(y.shape[-2]) != width:  # padded units: any bias
            d = tirx.min(d, width - 1)
        return y(*idx) + _widen(
            bias, bias[(*lead, gate * width + d if per_feature else 0)], y.dtype
        )

    return te.compute(y.shape, body, name=name)


def _addend_stage(y, addend, width: int, n_rows: int, name: str):
    """``y + addend`` with ``addend`` of shape ``(*rows[-r:], gates * width)``: axes of size 1
    broadcast, padded units of a blocked ``y`` read the last unit."""
    blocked = len(y.shape) == n_rows + 3
    block = y.shape[-1] if blocked else None
    lead = len(addend.shape) - 1

    def body(*idx):
        gate = idx[n_rows]
        d = idx[n_rows + 1] * block + idx[n_rows + 2] if blocked else idx[n_rows + 1]
        if blocked and _int(block) * _int(y.shape[-2]) != width:
            d = tirx.min(d, width - 1)
        rows = idx[n_rows - lead : n_rows]
        at = [0 if _int(e) == 1 else r for r, e in zip(rows, addend.shape[:-1], strict=True)]
        return y(*idx) + _widen(addend, addend[(*at, gate * width + d)], y.dtype)

    return te.compute(y.shape, body, name=name)


def _widen(tensor: te.Tensor, value, dtype: str):
    """``value``, read from ``tensor``, as ``dtype`` (a half-precision bias or addend read into
    the float32 tile)."""
    return value if tensor.dtype == dtype else tirx.Cast(dtype, value)


def _piece_stage(y, gate: int, width: int, n_rows: int, name: str, rows=None):
    """Piece ``gate`` of ``y`` over ``rows`` (``y``'s own by default; the real rows of a
    ``y`` whose rows are padded)."""
    blocked = len(y.shape) == n_rows + 3
    block = y.shape[-1] if blocked else None

    def body(*idx):
        if blocked:
            return y[(*idx[:-1], gate, idx[-1] // block, idx[-1] % block)]
        return y[(*idx[:-1], gate, idx[-1])]

    return te.compute((*(rows or y.shape[:n_rows]), width), body, name=name)


def _compute(
    group: _Group, blk: _Block, block: int, fast_math: bool, layouts: list[str], pad_rows=None,
    tile=None,
):  # fmt: skip
    """The TE function for the group: (inputs...) -> outputs; ``pad_rows``: the row multiple
    of gathered GEMMs, ``tile``: their rows per expert (see :func:`_gemm_stage`)."""
    n_rows = len(group.rows)
    width = group.width
    # float16 / bfloat16: the gate math runs on float32 tensors (half-precision inputs widened
    # where read), each result is rounded to its dtype once, where it is written
    wide = str(group.gemms[0].x.ty.dtype) in _HALF

    def fn(*tensors):
        pos = 0
        env: dict = {}
        for gi, g in enumerate(group.gemms):
            x, w = tensors[pos], tensors[pos + 1]
            pos += 2
            ids = None
            if g.ids is not None:  # the expert of each row, after the weight
                ids = tensors[pos]
                pos += 1
                if tile is not None:  # (tiles, per_row)
                    ids = (ids, tensors[pos])
                    pos += 1
            pad = pad_rows if layouts[gi] == "gathered" else None
            y = _gemm_stage(
                x, w, layouts[gi], block, width, g.gates, n_rows, f"gemm{gi}", ids, pad, tile
            )
            if g.bias is not None:
                row_ids = ids if g.gathered_bias else None
                y = _bias_stage(y, tensors[pos], width, n_rows, f"gemm{gi}_bias", row_ids, tile)
                pos += 1
            for ai in range(len(g.addends)):
                y = _addend_stage(y, tensors[pos], width, n_rows, f"gemm{gi}_add{ai}")
                pos += 1
            for gate, piece in enumerate(g.pieces):
                env[piece] = _piece_stage(
                    y, gate, width, n_rows, f"gate{gi}_{gate}", list(x.shape[:-1])
                )
            for dup, piece in g.aliases.items():
                env[dup] = env[piece]
        externals = list(tensors[pos : pos + len(group.externals)])
        if wide:
            externals = [topi.cast(t, _ACC) if t.dtype in _HALF else t for t in externals]

        def external(expr):
            for i, ext in enumerate(group.externals):
                if ext.same_as(expr):
                    return externals[i]
            raise KeyError(expr)

        for var in group.ops:
            value = blk.value[var]
            args = [
                env[a]
                if isinstance(a, relax.Var) and a in env
                else a
                if is_prim_expr(a)
                else external(a)
                for a in value.args
            ]
            env[var] = _emit_op(value, args, fast_math, wide)
        outs = [env[o] for o in group.outputs]
        if wide:
            outs = [_round_to(t, str(o.ty.dtype)) for t, o in zip(outs, group.outputs, strict=True)]
        if len(outs) == 1:
            return outs
        # Several results (the LSTM's h and c): one block writes them all, so that the
        # schedule can compute every other stage at the output tile (TIR refuses compute_at
        # of an output block, and reverse_compute_at cannot place a block that reads a gate
        # at a constant index).
        return list(te.compute(outs[0].shape, lambda *i: [o(*i) for o in outs], name="gates"))

    return fn


def _round_to(t: te.Tensor, dtype: str) -> te.Tensor:
    return t if t.dtype == dtype else topi.cast(t, dtype)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, target, find=_find_gemms, prepare=None):
        super().__init__(mod)
        self.mod = mod
        self.target = target
        self.find = find  # _Block -> [_Gemm] (FuseGatheredGates passes its own)
        # (builder, group, block) -> None, run before a group is emitted (FuseGroupedGates emits the
        # expert of each row there)
        self.prepare = prepare
        self.count = 0
        self.uses: dict = {}
        self._blk: _Block | None = None

    def transform(self) -> IRModule:
        for gv, func in self.mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
                continue
            self.uses = use_counts(func)
            new_func = self.visit_expr(func)
            new_func = relax.analysis.remove_all_unused(new_func)
            self.builder_.update_func(gv, new_func)
        return self.builder_.get()

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.BindingBlock:
        blk = _Block.of(block, self.uses)
        self._blk = blk
        gemms = self.find(blk)
        groups = _grow(blk, gemms) if gemms else []
        groups = [g for g in groups if _plan_block(g, self.target) is not None]
        if not groups:
            return super().visit_dataflow_block_(block)
        return self._emit(block, blk, groups)

    def _emit(self, block, blk: _Block, groups: list[_Group]) -> relax.BindingBlock:
        order = _emission_order(blk, groups)
        if order is None:
            skip(logger, "gate groups of a block", "their inputs and results form a cycle")
            return super().visit_dataflow_block_(block)
        self.builder_._begin_dataflow_block()
        for item in order:
            if isinstance(item, _Group):
                self._emit_group(item)
            else:
                self.visit_binding(item)
        return self.builder_._end_block()

    def _emit_group(self, group: _Group) -> None:
        if self.prepare is not None:
            self.prepare(self.builder_, group, self._blk)
        fast_math = _target.is_cpu(self.target)
        args = []
        layouts = []
        for gemm in group.gemms:
            args.append(self.visit_expr(gemm.x))
            if gemm.ids is not None:  # matched only with a constant expert weight
                w = gemm.weight.value.numpy()
                blocked = _gathered_weight(w, gemm.transposed, gemm.gates, gemm.width, group.block)
                args.append(relax.const(blocked, str(gemm.weight.ty.dtype)))
                ids = gemm.ids if isinstance(gemm.ids, tuple) else (gemm.ids,)
                args += [self.visit_expr(i) for i in ids]
                layouts.append("gathered")
            elif isinstance(gemm.weight, GenericConst):
                w = gemm.weight.value.numpy()
                args.append(
                    relax.const(
                        _blocked_weight(w, gemm.transposed, gemm.gates, gemm.width, group.block),
                        str(gemm.weight.ty.dtype),
                    )
                )
                layouts.append("blocked")
            else:
                args.append(self.visit_expr(gemm.weight))
                layouts.append("nk" if gemm.transposed else "kn")
            if gemm.bias is not None:
                args.append(self.visit_expr(gemm.bias))
            args += [self.visit_expr(a) for a in gemm.addends]
        # FuseGatheredGates' rows sorted by expert: the externals read in that order
        externals = getattr(group, "external_args", group.externals)
        args += [self.visit_expr(e) for e in externals]
        tiled = getattr(group, "expert_tiles", None)
        pad = _pad_rows(group, self.target) if tiled is None else None  # not None: one row axis
        rows = group.rows[0] if pad is not None else None
        call = None
        if tiled is not None:  # (MR, rows, tiles, the rule's tile)
            mr, k_rows, k_tiles, pad = tiled
            # the rows sorted only: the gathered tile (a weight pointer a row); the GEMM rows
            # padded to a multiple of both tiles (only the tiles that the rows need are run)
            sorted_tile = _sorted_tile(group, self.target)
            multiple = math.lcm(mr, sorted_tile)
            fn = _compute(group, self._blk, group.block, fast_math, layouts, multiple, tile=mr)
            if _int(k_rows) is None:  # symbolic: the rows and tiles variables of the kernel
                call = _call_on_rows(self.builder_, fn, args, k_rows, _name(group), k_tiles)
            if call is None:
                call = self.builder_.call_te(fn, *args, primfunc_name_hint=_name(group))
        elif rows is not None and _int(rows) is None and not isinstance(rows, tirx.Var):
            # rows such as tokens * top_k: the kernel's rows one variable of its own
            fn = _compute(group, self._blk, group.block, fast_math, layouts, pad)
            call = _call_on_rows(self.builder_, fn, args, rows, _name(group))
            if call is None:  # unpadded: the gate rule takes it with tiles of one row
                pad = None
        if call is None:
            fn = _compute(group, self._blk, group.block, fast_math, layouts, pad)
            call = self.builder_.call_te(fn, *args, primfunc_name_hint=_name(group))
        gv = call.args[0]
        func = self.builder_.get()[gv]
        hints = {
            "block": group.block,
            "gates": sum(g.gates for g in group.gemms),
            "width": group.width,
        }
        if pad is not None:  # the rule's tile: the rows the GEMMs were built padded to
            hints["rows"] = pad
        if tiled is not None:  # the rule unswitches the expert select (see _tile_expert)
            hints["unswitch"] = 1
            hints["rows_sorted"] = sorted_tile
        self.builder_.update_func(gv, func.with_attrs({"op_pattern": 8, GATE_ATTR: hints}))
        self.count += 1
        if getattr(group, "unsort", None) is not None:
            self._emit_unsorted(group, call)
            return
        if len(group.outputs) == 1:
            out = group.outputs[0]
            self.builder_.emit_normalized(relax.VarBinding(out, self.builder_.normalize(call)))
            return
        fused = self.builder_.emit(call, "gates")
        for i, out in enumerate(group.outputs):
            self.builder_.emit_normalized(relax.VarBinding(out, relax.TupleGetItem(fused, i)))

    def _emit_unsorted(self, group: _Group, call) -> None:
        """The results of a group whose rows FuseGatheredGates sorted by expert, put back in
        row order (``take(result, group.unsort)``); each sorted result is remembered for a
        later group that reads it sorted by the same ids."""
        fused = self.builder_.emit(call, "sorted_gates")
        outs = [fused]
        if len(group.outputs) > 1:
            outs = [
                self.builder_.emit(relax.TupleGetItem(fused, i)) for i in range(len(group.outputs))
            ]
        for out, done in zip(group.outputs, outs, strict=True):
            group.sorted_outputs[out] = (done, *group.sort_key)
            back = self.builder_.normalize(relax.op.take(done, group.unsort, axis=0))
            self.builder_.emit_normalized(relax.VarBinding(out, back))


def _pad_rows(group: _Group, target) -> int | None:
    """The row multiple of the group's gathered GEMMs: the CPU gate rule's tile of rows where
    it would pad them (symbolic rows, static ones that it does not divide); None where the
    group has no gathered GEMM, adds a bias or addend read per row (not padded), or the tile
    is one row."""
    from ...schedule import gate_tile_rows

    gathered = [g for g in group.gemms if g.ids is not None]
    if not gathered or not _target.is_cpu(target) or len(group.rows) != 1:
        return None
    if any(g.gathered_bias or g.addends for g in group.gemms):
        return None
    rows = _int(group.rows[0])
    mr = gate_tile_rows(target, rows, max(g.gates for g in group.gemms), group.block, True)
    if mr <= 1 or (rows is not None and rows % mr == 0):
        return None
    return mr


def _sorted_tile(group: _Group, target) -> int:
    """The CPU gate rule's tile for the group's gathered GEMMs on rows sorted only (each row
    reads its own expert's weight): ``cpu/gate_fusion.tile_rows`` of a gathered kernel."""
    from ...schedule import gate_tile_rows

    return gate_tile_rows(target, None, max(g.gates for g in group.gemms), group.block, True)


def _call_on_rows(builder, fn, args: list, rows, name: str, tiles=None):
    """``call_te(fn, *args)`` with the kernel's row count ``rows`` (an expression such as
    transformers' ``tokens * top_k``) one fresh variable of the kernel, bound by the rows of
    its first argument: with rows a product of symbols, TVM 0.27's ``compute_at`` refuses the
    results' tile over a GEMM built with padded rows ("not a stage pipeline"), and the gate
    rule fell to tiles of one row; over a plain variable it takes the tile. The call keeps the
    Relax shapes (``rows``); None where an argument or result has another symbolic dim.
    ``tiles``: the count of expert tiles (``transform/_expert_tiles.py``), a second variable
    of the kernel (dims ``rows + c`` become ``n + c`` too: the flag after the row experts)."""
    n = tirx.Var("rows", "int64")
    t = tirx.Var("tiles", "int64")
    analyzer = sym.Analyzer()
    pairs = [(rows, n)] + ([(tiles, t)] if tiles is not None else [])

    def rebind(shape):
        out = []
        for d in shape:
            for expr, var in pairs:
                extra = analyzer.simplify(d - expr)
                if isinstance(extra, tirx.IntImm) and (tiles is not None or not int(extra)):
                    out.append(var + extra if int(extra) else var)
                    break
            else:
                out.append(d)
        return out

    inputs = []
    for i, arg in enumerate(args):
        ty = arg.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            return None
        hint = arg.name if isinstance(arg, relax.Var) else f"const{i}"
        inputs.append(te.placeholder(rebind(ty.shape.values), ty.dtype, hint))
    outs = fn(*inputs)
    outs = [outs] if isinstance(outs, te.Tensor) else list(outs)
    dims = [d for x in [*inputs, *outs] for d in x.shape]
    own = [var for _, var in pairs]
    if any(not any(v.same_as(o) for o in own) for d in dims for v in undefined_vars(d)):
        return None
    binding = inputs[:1] if tiles is None else inputs  # each variable a whole dim somewhere
    if not all(any(d.same_as(v) for x in binding for d in x.shape) for v in own):
        return None
    func = te.create_prim_func([*inputs, *outs], "int64").without_attr("global_symbol")
    gv = builder.add_func(func, name)
    vdevice = args[0].ty.vdevice

    def back(d):
        for expr, var in pairs:
            d = _substitute(d, var, expr)
        return d

    out_ty = [relax.TensorType([back(d) for d in x.shape], x.dtype, vdevice) for x in outs]
    return relax.call_tir(gv, args, out_ty[0] if len(out_ty) == 1 else out_ty)


def _substitute(dim, var, value):
    """``dim`` with ``var`` replaced by ``value`` (the kernel's row variable by the rows)."""
    if dim.same_as(var):
        return value
    analyzer = sym.Analyzer()
    analyzer.bind(var, value)
    return analyzer.simplify(dim)


def _name(group: _Group) -> str:
    return "fused_gates_" + "_".join(str(len(g.pieces)) for g in group.gemms)
