"""Helpers shared by the schedule rules."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.ir.expr import Call, TensorLoad
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from .. import target as _target

# The attribute FuseSplitGates (and FuseGatheredGates) put on a gate kernel: hints for the gate
# rules (``block``: the vector block V of the weight layout, ``gates``, ``width``). One
# definition: the transform writes it, the CPU and CUDA rules (and tuning spaces) read it.
GATE_ATTR = "tvm_fusion.gate_fusion"


class CPURule(ScheduleRule):
    """A rule that only applies to llvm targets and to PrimFuncs not yet scheduled."""

    def is_target_available(self, target: Target) -> bool:
        return _target.is_cpu(target)

    def applicable(self, func, target: Target) -> bool:
        return (
            isinstance(func, tirx.PrimFunc)
            and self.is_target_available(target)
            and not func.attrs.get("tirx.is_scheduled", False)
        )


def extent(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV) -> int | tirx.Expr:
    value = sch.get(loop).extent
    return int(value.value) if isinstance(value, tirx.IntImm) else value


def is_reduction(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    """A block with an init or a reduction iterator, even one of extent 1.

    dlight's ``normalize_prim_func`` drops unit loops and then reports a reduction over one
    element as injective; inlining an epilogue into such a block makes TVM emit the epilogue
    in both the init and the update (found by tests/test_differential.py).
    """
    stmt = sch.get(block)
    return stmt.init is not None or any(iv.iter_type == iv.CommReduce for iv in stmt.iter_vars)


def is_trivial_reduction(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    """A reduction whose every reduction iterator has extent 1 (a GEMM with K = 1, a softmax
    over rows of one element): elementwise in effect, the init folds away once lowered."""
    stmt = sch.get(block)
    reduce = [iv for iv in stmt.iter_vars if iv.iter_type == iv.CommReduce]
    # dlight's normalize_prim_func drops unit iterators: an init with none left is one too
    return (bool(reduce) or stmt.init is not None) and all(
        isinstance(iv.dom.extent, tirx.IntImm) and int(iv.dom.extent) == 1 for iv in reduce
    )


# Inlining substitutes a producer's expression at every load of it: a consumer that reads it k
# times gets k copies. Fast-math polynomials read their input ~15 times, so a chain of them
# grows exponentially (a tanh(tanh(sigmoid(x))) chain reached gigabytes of IR). Inlining stops
# when the consumer would grow past this many expression nodes.
MAX_INLINED_EXPR = 4000
# TIR's simplifier proves each Select's branches under its condition, so its time grows
# exponentially with the Selects nested in one expression, not with its size: DeBERTa's
# relative-position buckets (where / abs / log / sign / isfinite over ``i - j``) inlined into
# one block of ~60 Selects took 50 s to lower (HoistIfThenElse, RemoveNoOp, StmtSimplify).
# Inlining stops when the consumer would hold more Selects than this.
MAX_INLINED_SELECTS = 16


def _store_value(sch: s_tir.Schedule, block):
    body = sch.get(block).body
    return body.value if isinstance(body, tirx.BufferStore) else None


def inline_is_cheap(sch: s_tir.Schedule, producer, consumers) -> bool:
    """Inlining ``producer`` into ``consumers`` keeps every expression small."""
    from ..tir_util import count_loads, count_selects, expr_size

    value = _store_value(sch, producer)
    if value is None:
        return False
    size = expr_size(value, MAX_INLINED_EXPR + 1)
    selects = count_selects(value, MAX_INLINED_EXPR + 1)
    out = sch.get(producer).writes[0].source
    for consumer in consumers:
        cvalue = _store_value(sch, consumer)
        if cvalue is None:
            return False
        uses = count_loads(cvalue, out)
        grown = expr_size(cvalue, MAX_INLINED_EXPR + 1) + uses * size
        if grown > MAX_INLINED_EXPR:
            return False
        nested = count_selects(cvalue, MAX_INLINED_EXPR + 1) + uses * selects
        if uses and nested > MAX_INLINED_SELECTS:
            return False
    return True


def same_domain(sch: s_tir.Schedule, producer, consumer) -> bool:
    """The consumer writes a buffer of the producer's shape (an elementwise epilogue).

    TVM 0.27's ``reverse_compute_inline`` accepts a consumer that reads one point of a larger
    producer (a slice) and emits a loop over the producer's domain that writes the slice's
    output at every point, a wrong result (found by tests/test_differential.py). Only
    same-shape consumers are reverse-inlined.
    """
    p_out = sch.get(producer).writes
    c_out = sch.get(consumer).writes
    if len(p_out) != 1 or len(c_out) != 1:
        return False
    p_shape = [str(d) for d in p_out[0].source.shape]
    c_shape = [str(d) for d in c_out[0].source.shape]
    return p_shape == c_shape


def covered_by(sch: s_tir.Schedule, producer, consumer) -> bool:
    """Whether ``consumer`` writes no more than ``producer`` does (an elementwise epilogue, a
    transpose, a slice, the cut back of padded rows), so that ``reverse_compute_at`` may move it
    under a loop of the producer. TVM 0.27's ``reverse_compute_at`` derives the consumer's loops
    from the region the producer writes under that loop: a larger consumer loses the points that
    read nothing of it. A Pad after a Conv or a pool (ONNX ``auto_pad="SAME_UPPER"``: the
    importer pads in an op of its own, which FuseOps fuses into the producer's kernel) lost its
    padded column or row, read uninitialised by the next Conv (errors up to 53 at a scale of 6;
    found by the fuzzer's ``convnets`` family). Larger: provably more elements, or of the same
    rank each dim provably at least the producer's and one provably larger (a symbolic pad)."""
    from tvm import sym

    p_out = sch.get(producer).writes
    c_out = sch.get(consumer).writes
    if len(p_out) != 1 or len(c_out) != 1:
        return False
    p_shape, c_shape = list(p_out[0].source.shape), list(c_out[0].source.shape)
    analyzer = sym.Analyzer()

    def numel(shape):
        size = tirx.IntImm("int64", 1)
        for dim in shape:
            size = size * dim
        return size

    if analyzer.can_prove(numel(c_shape) > numel(p_shape)):
        return False
    if len(p_shape) == len(c_shape):
        pairs = list(zip(c_shape, p_shape, strict=True))
        if all(analyzer.can_prove(c >= p) for c, p in pairs) and any(
            analyzer.can_prove(c > p) for c, p in pairs
        ):
            return False
    return True


def sole_consumer(sch: s_tir.Schedule, producer) -> bool:
    """``producer`` has one consumer block. TVM 0.27's ``reverse_compute_inline`` does not
    check it: inlining one of two consumers into the producer makes the producer write the
    consumer's buffer, and the other consumer reads a buffer nobody writes any more ("Buffer
    matmul_intermediate is used before its definition" at build time; found by
    tests/test_differential.py on ``silu(tanh(x @ W + b))``, whose silu reads its input twice
    after inlining)."""
    return len(sch.get_consumers(producer)) == 1


def try_inline_safe(sch: s_tir.Schedule, infos: list) -> list:
    """dlight's ``try_inline`` minus inlining into or out of reduction blocks and minus
    inlining that would blow expressions up (see :data:`MAX_INLINED_EXPR`)."""
    remaining = list(infos)
    progress = True
    while progress:
        progress = False
        for info in list(remaining):
            block = info.block_rv
            if is_reduction(sch, block):
                continue
            consumers = sch.get_consumers(block)
            if consumers and inline_is_cheap(sch, block, consumers):
                try:
                    sch.compute_inline(block)
                    remaining.remove(info)
                    progress = True
                    continue
                except Exception:  # noqa: BLE001 - not inlinable: try the other direction
                    pass
            producers = sch.get_producers(block)
            if len(producers) != 1 or is_reduction(sch, producers[0]):
                continue
            if not sole_consumer(sch, producers[0]):
                continue
            if not same_domain(sch, producers[0], block):
                continue
            if not inline_is_cheap(sch, producers[0], [block]):
                continue
            try:
                sch.reverse_compute_inline(block)
            except Exception:  # noqa: BLE001
                continue
            remaining.remove(info)
            progress = True
    return remaining


def single_reduction(func: tirx.PrimFunc) -> tuple | None:
    """``(sch, infos, at)``: a new schedule of ``func``, its blocks as dlight's
    ``normalize_prim_func`` reads them, and the index of its one reduction that is not trivial;
    None where the blocks cannot be read or there is not exactly one such reduction."""
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if not infos:
        return None
    reductions = [
        i
        for i, info in enumerate(infos)
        if not info.is_injective() and not is_trivial_reduction(sch, info.block_rv)
    ]
    if len(reductions) != 1:
        return None
    return sch, infos, reductions[0]


def gate_blocks(func: tirx.PrimFunc):
    """A new schedule of a gate kernel with the blocks that can be inlined inlined, and its
    blocks: ``(sch, reductions, finals, inner)``, ``finals`` the blocks that write parameters
    (the results), ``inner`` the others left; None where there is no reduction or no other
    block."""
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    reductions = [i.block_rv for i in infos if is_reduction(sch, i.block_rv)]
    others = [i for i in infos if not is_reduction(sch, i.block_rv)]
    if not reductions or not others:
        return None
    remaining = [i.block_rv for i in try_inline_safe(sch, others)]
    params = set(func.params)
    finals = [b for b in remaining if any(w.source in params for w in sch.get(b).writes)]
    inner = [b for b in remaining if b not in finals]
    return sch, reductions, finals, inner


def is_vectorized(sch: s_tir.Schedule, loop: s_tir.schedule.LoopRV) -> bool:
    return sch.get(loop).kind == tirx.ForKind.VECTORIZED


def is_static(value) -> bool:
    return isinstance(value, int)


def block_dtype(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> str:
    stmt = sch.get(block)
    return str(stmt.writes[0].source.dtype) if stmt.writes else "float32"


def vectorize_innermost(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int, max_unroll: int = 1
) -> s_tir.schedule.LoopRV | None:
    """Vectorise the innermost loop of ``block`` by ``lanes`` (or a divisor of its extent).

    Returns the loop left outside the vector loop, or None when nothing was vectorised.
    A static extent that ``lanes`` does not divide is vectorised by its largest power-of-two
    divisor (at least 2), so no predicate lands inside the vector loop. A symbolic extent is
    left to LLVM (see below).
    """
    loops = sch.get_loops(block)
    if not loops:
        return None
    inner = loops[-1]
    ext = extent(sch, inner)
    if is_static(ext):
        if ext < 2:
            return None
        width = lanes
        while width > 1 and ext % width:
            width //= 2
        if width < 2:
            return None
        if ext == width:
            sch.vectorize(inner)
            return None
        outer, vec = sch.split(inner, [None, width])
        sch.vectorize(vec)
        if max_unroll > 1 and ext // width % max_unroll == 0 and ext // width > max_unroll:
            outer, unrolled = sch.split(outer, [None, max_unroll])
            sch.unroll(unrolled)
        return outer
    # A symbolic extent stays one plain loop: split by ``lanes`` it needs a predicate, and
    # VectorizeLoop scalarises a predicated vector body on x86 (buffer-level predication is
    # only for VLA targets, and only for accesses whose index is the predicate's own ramp).
    # LLVM's loop vectoriser does vectorise the plain loop, with a scalar epilogue: a softmax
    # over a symbolic (4, 4, 128, 128) runs 0.21 ms so against 0.89 ms split (0.19 static).
    return None


def takes_vector_tail(ext, lanes: int, min_vectors: int = 2) -> bool:
    """Whether :func:`vectorize_with_tail` vectorises an innermost loop of extent ``ext``:
    static, ``min_vectors`` whole vectors or more, and a remainder."""
    return is_static(ext) and ext >= min_vectors * lanes and ext % lanes != 0


def vectorize_with_tail(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int, min_vectors: int = 2
) -> bool:
    """A static innermost loop that :func:`vectorize_innermost` left scalar because ``lanes``
    does not divide it (a softmax row of 77, 999): partitioned into the whole vectors,
    vectorised, and a tail of fewer than ``lanes`` iterations, vectorised too: LLVM computes a
    13-lane vector in one register (its loads and stores in pieces of 8, 4, 1), where a scalar
    tail evaluated softmax's polynomial exp 13 times per row of 77. The last step of a
    schedule: the block is replaced by the two parts (``block`` is no longer valid). Only
    where the loop holds ``min_vectors`` whole vectors or more. Returns whether it did so."""
    loops = sch.get_loops(block)
    if not loops or is_vectorized(sch, loops[-1]):
        return False
    ext = extent(sch, loops[-1])
    if not takes_vector_tail(ext, lanes, min_vectors):
        return False
    try:
        head, tail = sch.loop_partition(loops[-1], [ext - ext % lanes, None])
        _, vec = sch.split(head, [None, lanes])
        sch.vectorize(vec)
    except Exception:  # noqa: BLE001 - the loop stays whole, for LLVM's vectoriser
        return False
    if ext % lanes > 1:
        sch.vectorize(tail)
    return True


# Scope of the CPU GEMM rules' accumulator tile (``cache_write``). TVM 0.27 keeps a "global"
# allocation under 1024 bytes on the stack (LowerTVMBuiltin's kMaxStackAlloca), where LLVM
# promotes the tile to registers; a "local" one of the same size became a workspace that each
# tile zeroed with a call to memset and stored twice (896 bytes: Winograd's 7 x 2 vectors on
# AVX-512, 0.164 -> 0.112 ms for 36 x 196 x 16 @ 16 x 64). A tile of 1024 bytes or more (8 x 2
# AVX-512 vectors) is a workspace either way: the tiles stay under it (cpu/_tiles.STACK_TILE_BYTES).
ACC_SCOPE = "global"

# A parallel region costs a few microseconds to launch: not worth it for less work than this
# (iterations of the whole loop nest, when static).
MIN_PARALLEL_WORK = 4096


def loop_nest_work(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> int | None:
    """Iterations of all loops around ``block``; None when an extent is symbolic."""
    total = 1
    for loop in sch.get_loops(block):
        ext = extent(sch, loop)
        if not is_static(ext):
            return None
        total *= ext
    return total


def parallelize_outer(
    sch: s_tir.Schedule,
    loops: list,
    cores: int,
    min_extent_per_core: int = 4,
    work: int | None = None,
) -> s_tir.schedule.LoopRV | None:
    """Fuse leading loops until there are enough iterations for ``cores``, then parallelise.

    ``work`` (the iterations of the whole nest, see :func:`loop_nest_work`) below
    :data:`MIN_PARALLEL_WORK` leaves the loops serial.
    """
    if not loops or cores < 2 or (work is not None and work < MIN_PARALLEL_WORK):
        return None
    chosen = []
    total = 1
    for loop in loops:
        chosen.append(loop)
        ext = extent(sch, loop)
        if not is_static(ext):
            total = None
            break
        total *= ext
        if total >= cores * min_extent_per_core:
            break
    if total is not None and total < 2:
        return None
    fused = sch.fuse(*chosen) if len(chosen) > 1 else chosen[0]
    sch.parallel(fused)
    return fused


def block_realize(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV):
    """The ``SBlockRealize`` of ``block`` in the schedule's current function (its iterators'
    bindings to the loops), or None."""
    from ..tir_util import iter_stmts

    name = sch.get(block).name_hint
    return next(
        (
            node
            for node in iter_stmts(sch.mod["main"].body)
            if isinstance(node, s_tir.SBlockRealize) and node.block.name_hint == name
        ),
        None,
    )


def write_order(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> None:
    """Reorder the loops of a copy so that the innermost one walks the last index of what it
    writes (a B panel's ``j % NR``): the GEMM rule's run-time packing of B iterated the
    columns outside ``k``, each vector a gather of 16 elements a row apart and a strided store
    (136 x 1024 @ 1024 x 2048: 3x ONNX Runtime's time)."""
    from ..tir_util import vars_in

    stmt = sch.get(block)
    if len(stmt.writes) != 1 or not stmt.writes[0].region:
        return
    last = vars_in(stmt.writes[0].region[-1].min)
    realize = block_realize(sch, block)
    if realize is None:
        return
    driving = set()
    for iv, value in zip(stmt.iter_vars, realize.iter_values, strict=True):
        if iv.var in last:
            driving |= vars_in(value)
    loops = sch.get_loops(block)
    inner = [i for i, loop in enumerate(loops) if sch.get(loop).loop_var in driving]
    if not inner or inner[-1] == len(loops) - 1:
        return
    i = inner[-1]
    try:
        sch.reorder(*loops[i + 1 :], loops[i])
    except Exception:  # noqa: BLE001 - a loop shared with another block: keep the order
        pass


def schedule_copy(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int, cores: int):
    """A copy block (packed weight, padded input): loops in the order of what it writes
    (:func:`write_order`), innermost loop vectorised, the rest parallel."""
    write_order(sch, block)
    loops = sch.get_loops(block)
    vectorize_innermost(sch, block, lanes)
    parallelize_outer(sch, sch.get_loops(block)[: max(len(loops) - 1, 1)], cores)


def _clamped_copy(store):
    """``P[v..] = if_then_else(v_a < n_a and .., X[idx..], 0)`` (a ``pad_einsum`` copy) as
    ``(P[v..] = X[min(v_a, n_a - 1), ..], the padded positions of P)``, or None when the copy
    has another form."""
    value = store.value
    if not (isinstance(value, Call) and getattr(value.op, "name", "").endswith(".if_then_else")):
        return None
    cond, load, _zero = value.args
    if not isinstance(load, TensorLoad):
        return None
    bounds = {}
    stack = [cond]
    while stack:
        c = stack.pop()
        if isinstance(c, tirx.And):
            stack += [c.a, c.b]
        elif isinstance(c, tirx.LT) and isinstance(c.a, tirx.Var):
            bounds[c.a] = c.b
        else:
            return None
    from ..tir_util import vars_in

    indices = []
    clamp = list(bounds)
    for index in load.indices:
        if isinstance(index, tirx.Var) and index in bounds:
            indices.append(tirx.Min(index, bounds.pop(index) - 1))
        elif any(v in bounds for v in vars_in(index)):
            return None
        else:
            indices.append(index)
    if bounds:
        return None
    padded = {i for i, index in enumerate(store.indices) if any(index.same_as(v) for v in clamp)}
    store = tirx.BufferStore(store.buffer, tirx.BufferLoad(load.source, indices), store.indices)
    return store, padded


def _reads_padding_spatially(sch: s_tir.Schedule, pad, padded: set) -> bool:
    """Every reader of ``pad``'s buffer indexes its padded positions by spatial iterators only:
    a padded reduction axis needs the zeros of the copy."""
    from ..tir_util import expr_children, vars_in

    buffer = sch.get(pad).writes[0].source
    for consumer in sch.get_consumers(pad):
        block = sch.get(consumer)
        reduce = {iv.var for iv in block.iter_vars if iv.iter_type == iv.CommReduce}
        stack = [block.body.value] if isinstance(block.body, tirx.BufferStore) else None
        if stack is None:
            return False
        while stack:
            e = stack.pop()
            if isinstance(e, TensorLoad) and e.source.same_as(buffer):
                for i in padded:
                    if any(v in reduce for v in vars_in(e.indices[i])):
                        return False
            stack.extend(expr_children(e))
    return True


def _replace_blocks(stmt, new_bodies: dict):
    """``stmt`` with the bodies of the SBlocks named in ``new_bodies`` replaced; None when the
    path to one of them holds a statement kind this walk does not rebuild."""
    if isinstance(stmt, s_tir.SBlockRealize):
        block = _replace_blocks(stmt.block, new_bodies)
        if block is None:
            return None
        if block.same_as(stmt.block):
            return stmt
        return s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, block)
    if isinstance(stmt, s_tir.SBlock):
        body = new_bodies.get(stmt.name_hint)
        if body is None:
            body = _replace_blocks(stmt.body, new_bodies)
            if body is None:
                return None
        if body.same_as(stmt.body):
            return stmt
        return s_tir.SBlock(
            stmt.iter_vars,
            stmt.reads,
            stmt.writes,
            stmt.name_hint,
            body,
            stmt.init,
            stmt.alloc_buffers,
            stmt.match_buffers,
            stmt.annotations,
        )
    if isinstance(stmt, tirx.SeqStmt):
        seq = [_replace_blocks(s, new_bodies) for s in stmt.seq]
        if any(s is None for s in seq):
            return None
        if all(a.same_as(b) for a, b in zip(seq, stmt.seq, strict=True)):
            return stmt
        return tirx.SeqStmt(seq)
    if isinstance(stmt, tirx.For):
        body = _replace_blocks(stmt.body, new_bodies)
        if body is None:
            return None
        if body.same_as(stmt.body):
            return stmt
        return tirx.For(
            stmt.loop_var,
            stmt.min,
            stmt.extent,
            stmt.kind,
            body,
            stmt.thread_binding,
            stmt.annotations,
        )
    if isinstance(stmt, tirx.BufferStore | tirx.Evaluate):
        return stmt
    return None


def same_blocks(old: s_tir.Schedule, new: s_tir.Schedule, blocks: list) -> list:
    """``blocks`` of schedule ``old`` as block RVs of ``new`` (a schedule of a rebuilt
    function, see :func:`inline_padding`), found by name."""
    return [new.get_sblock(old.get(b).name_hint) for b in blocks]


def inline_padding(sch: s_tir.Schedule, pads: list) -> s_tir.Schedule | None:
    """Read the inputs of a ``pad_einsum``-padded block in place instead of through padded
    copies.

    ``pad_einsum`` copies each input into a buffer padded to the tile (``P[v] = v < n ? X[v] :
    0``): a pass over every input element per call (a 512 x 1024 activation costs 0.2 ms
    here) and, for a GEMM, a second copy before the B panels are packed. When the padded axes
    are spatial (rows and columns, never the reduction: a padded reduction needs the zeros),
    the padded rows may read anything finite, since their results are cut off: each copy
    becomes ``X[min(v, n - 1)]`` and is inlined into its reader, where the clamp is loop
    invariant in the reduction. (Inlining the ``if_then_else`` copy instead halves the GEMM's
    speed: a branch per load.) TIR has no Python statement mutator in TVM 0.27 and schedules
    cannot change a block's body, so this rebuilds the function and returns a new schedule
    of it with the copies inlined (block RVs of ``sch`` do not carry over:
    :func:`same_blocks` finds them in it); None when a copy has another form, pads an axis
    its reader reduces over, or does not inline (``sch`` is unchanged)."""
    new_bodies = {}
    names = []
    for pad in pads:
        block = sch.get(pad)
        clamped = _clamped_copy(block.body) if isinstance(block.body, tirx.BufferStore) else None
        if clamped is None or not _reads_padding_spatially(sch, pad, clamped[1]):
            return None
        new_bodies[block.name_hint] = clamped[0]
        names.append(block.name_hint)
    func = sch.mod["main"]
    body = _replace_blocks(func.body, new_bodies)
    if body is None:
        return None
    new = s_tir.Schedule(func.with_body(body))
    try:
        for name in names:
            new.compute_inline(new.get_sblock(name))
    except Exception:  # noqa: BLE001 - a copy that does not inline: keep the copies
        return None
    return new
