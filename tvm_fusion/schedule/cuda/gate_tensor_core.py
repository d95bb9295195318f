"""Tensor-core schedule for FuseSplitGates' float16 / bfloat16 gate kernels on CUDA (sm_80+).

Matched: a gate kernel (see :mod:`tvm_fusion.schedule.cuda.gate_fusion`) with one GEMM
``Y[rows, gate, d // V, d % V] += f32(x[rows, k]) * f32(Wb[d // V, k, gate, d % V])`` whose
operands ``x`` and ``Wb`` are both float16 or both bfloat16 (FuseSplitGates widens them to
float32 in the GEMM's body: the tensor cores take those casts as their input conversion), with
rows on one axis (static ``>= MIN_ROWS``, or symbolic), a static ``K`` and a vector block ``V``
that 16 divides. The gate math is whatever FuseSplitGates wrote after the GEMM, inlined into
the block that writes the results. Rows and ``K`` that the tile does not divide are padded
(``pad_einsum``): the padding is read in place by the shared-memory copies (zero-filled,
predicated ``cp.async`` of the weight slab; ``x`` with 2-byte copies where ``K`` is not a
multiple of 8, its rows then not 16-byte aligned), the warps compute whole 16-row tiles and
only the result block carries the row predicate (the masked store).

Emitted: thread blocks over (``BM = 16 x WR`` rows x ``BN = 16 x WU`` units of one weight
block), ``WR x WU x gates`` warps, each warp a 16-row x 16-unit tile of one gate (one tile of
accumulators per warp keeps every register index static): two ``mma.sync.m16n8k16`` with
float32 accumulators per 16-step of ``k`` (TVM's ``mma_f16f16f32`` intrinsic, and the same
description in bfloat16), operands read from shared memory with ``ldmatrix``. Per reduction step
of ``BK`` the block copies ``x[BM, BK]`` and the weight slab ``Wb[BK, gates, BN]`` into shared
memory with 16-byte copies (8 halves; ``cp.async`` where the build sets ``tirx.use_async_copy``,
as ``engine.compile_module`` does on sm_80+), in a 2-stage software pipeline. After the
reduction the accumulators go to a float32 ``(gates, BM, BN)`` tile in shared memory, and all
threads of the block run the gate math from it and write each result once: no ``rows x gates x
D`` buffer exists outside the block.

Two GEMMs (GRU: ``x @ W_i`` and ``h @ W_h``, whose ``n`` gate needs ``r * (W_hn h + b_hn)``
apart from ``W_in x``): the same warps run them one after the other, each over its own ``K``
with its own staging buffers and result tile, and store the first GEMM's accumulators to its
tile before the second starts. Both GEMMs accumulate in one warp buffer (TVM 0.27 lowers only
a kernel's first warp-scope buffer to registers; :func:`_one_accumulator`), and their ``K``
loops carry ``disable_unroll`` (``#pragma unroll 1``): nvcc unrolled both 16-step loops in full
and took 168 registers at 64 x 1024 x 1024; with both, 66 registers, no spills, no stack,
28 KB shared, 256 blocks x 96 threads (sm_90, float16).

The tile: of the ``WR x WU`` (at most ``MAX_WARPS`` warps) whose shared memory (both stages and
the result tile) fits ``SMEM_BUDGET``, the one with the most warps that still gives ``SMS``
thread blocks; when none does, the one with the most blocks (gate_2890, 64 x 3 x 1024: 3 warps
per block, 256 blocks). Static rows: the row block divides the rows padded to 16 (at most 15
padded rows); symbolic rows are tiled as ``SYMBOLIC_ROWS`` static rows. Few rows (static
``<= SKINNY_ROWS``, or symbolic) stream the weight rather than compute: the pipeline gets 3 or
4 stages (``SKINNY_STAGES``: the most stages that fit the shared memory, then the widest step).
Measured on an H100 and an H200 (bench/gpu.md, 2026-11-26), SwiGLU's 64 x 2048 -> 2 x 5632
float16 gate (4 x 1 x 2 warps): steps of 64 took 0.080 ms at 2 and at 3 stages, steps of 32
0.056-0.058 ms at 2, 3 or 4 stages, steps of 16 at 4 stages 0.057 (torch's cuBLAS GEMM and
two elementwise kernels 0.059-0.066): the step, not the depth, decided; this rule now takes 4
stages of 32 there (the most stages, 32 KB); gate_2890 (4 stages of 64) and the GRU cell (4 of
32) kept their tiles. ``BK``: the largest of 64, 32, 16 whose zero padding of ``K`` is at most
15 or ``K / 16`` (:func:`reduction_steps`).

Few rows: fewer than ``MIN_ROWS`` (16) static rows stay on the split-K GEMV. There both paths
read the weight once (batch-1 decode is bound by the weight's bytes), but a 16-row mma tile
computes 16 / rows times the work, and without a split of ``K`` it has ``D / 16`` thread blocks
(64 for D = 1024, half the SMs idle) against the GEMV's ``D / 4`` blocks of 64 threads over
``K``; FuseSplitGates also gives such kernels 4-unit weight blocks (``gate_fusion.gate_block``),
which a 16-unit mma tile cannot read. Not timed on a GPU (none lent).

Skipped (None, the CUDA-core schedules of ``gate_fusion`` then run): float32 kernels (their
schedule is unchanged), mixed operand dtypes, more than ``MAX_GEMMS`` GEMMs or GEMMs whose
gates, weight blocks or ``V`` differ, rows on several axes, fewer than ``MIN_ROWS`` static
rows, a symbolic ``K``, ``V`` not a multiple of 16 or a single weight block (``D == V``: its
unit iterator is dropped), gate blocks that are not inlined into the result block,
architectures before sm_80, and any schedule step that fails (logged at debug level). GeGLU
takes this schedule: its gelu (``R.nn.gelu``, ``gelu_tanh``, or ``0.5 * g * (1 + erf(g /
sqrt 2))`` written out) is inlined into the result block like SwiGLU's silu, at SwiGLU's size
too (the erf on the block's shared result tile, 40 registers at 64 x 5632 x 2048).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir import TensorIntrin
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target

from .._common import extent, is_reduction, is_static, try_inline_safe

logger = logging.getLogger(__name__)

MIN_ROWS = 16  # static rows from which tensor cores are used (the split-K GEMV below)
SYMBOLIC_ROWS = 64  # symbolic rows are tiled as this many static rows would be
MAX_GEMMS = 2  # GEMMs per kernel (GRU: the input and the hidden projection)
MMA = 16  # a warp's tile: 16 rows x 16 units x 16 k (two m16n8k16 mma.sync)
WARP = 32
ELEM = 2  # bytes per operand element
VEC = 16 // ELEM  # elements per 16-byte copy
SMS = 132  # thread blocks wanted: an H100 SXM's streaming multiprocessors
SMEM_BUDGET = 48 * 1024  # static shared memory per block
MAX_WARPS = 8
STAGES = 2  # software pipeline over the reduction steps
SKINNY_ROWS = 128  # static rows up to which (and symbolic rows) the weight stream is deepened
SKINNY_STAGES = (4, 3)  # ... to as many pipeline stages as fit the shared memory


@dataclass(frozen=True)
class TensorCoreTile:
    """``wr x wu x gates`` warps, each 16 rows x 16 units of one gate; reduction steps of
    ``bk``; ``gemms`` GEMMs of ``gates`` gates each, run one after the other by the same warps
    (GRU's input and hidden projections), each with its own result tile."""

    wr: int
    wu: int
    bk: int
    gates: int
    gemms: int = 1
    stages: int = STAGES

    @property
    def bm(self) -> int:
        return MMA * self.wr

    @property
    def bn(self) -> int:
        return MMA * self.wu

    @property
    def warps(self) -> int:
        return self.wr * self.wu * self.gates


def smem_bytes(tile: TensorCoreTile) -> int:
    """Per GEMM, both stages of the ``x`` and weight slabs (2-byte elements) and the float32
    result tile."""
    staged = tile.stages * ELEM * tile.bk * (tile.bm + tile.gates * tile.bn)
    return tile.gemms * (staged + 4 * tile.gates * tile.bm * tile.bn)


def padded(n: int, step: int) -> int:
    return -(-n // step) * step


def reduction_steps(ks) -> list[int]:
    """The steps ``BK`` (64, 32, 16, largest first) whose zero padding of every ``K`` stays
    small: at most 15 elements or a sixteenth of ``K`` (a ``K`` that 64 divides takes 64;
    ``K = 389`` takes 16, padded to 400)."""
    return [
        bk for bk in (64, 32, 16) if all(padded(k, bk) - k <= max(MMA - 1, k // 16) for k in ks)
    ]


def choose_tile(rows, units: int, block: int, gates: int, k) -> TensorCoreTile | None:
    """The tile with the most warps giving ``SMS`` blocks, else the one with the most blocks.

    ``k`` is one reduction length or a list of them (one per GEMM). Static rows are padded to
    a multiple of 16, and the row block divides that (so no more than 15 padded rows are
    computed); symbolic rows are tiled as ``SYMBOLIC_ROWS`` rows would be. None when nothing
    fits."""
    ks = [k] if isinstance(k, int) else list(k)
    skinny = not is_static(rows) or int(rows) <= SKINNY_ROWS
    rows = int(rows) if is_static(rows) else SYMBOLIC_ROWS
    rows16 = padded(rows, MMA)
    bks = reduction_steps(ks)
    candidates = []
    for wr in (4, 2, 1):
        for wu in (4, 2, 1):
            if wr * wu * gates > MAX_WARPS or block % (MMA * wu):
                continue
            if rows16 % (MMA * wr):
                continue  # row blocks must divide the rows padded to 16
            tile = next(
                (
                    t
                    for t in (TensorCoreTile(wr, wu, bk, gates, len(ks)) for bk in bks)
                    if smem_bytes(t) <= SMEM_BUDGET
                ),
                None,
            )
            if tile is not None and skinny:
                tile = _deepened(tile, bks, ks)
            if tile is not None:
                candidates.append(tile)
    if not candidates:
        return None

    def blocks(t: TensorCoreTile) -> int:
        return -(-rows // t.bm) * -(-units // t.bn)

    full = [t for t in candidates if blocks(t) >= SMS]
    if full:
        return max(full, key=lambda t: (t.warps, t.wr))
    return max(candidates, key=lambda t: (blocks(t), t.warps))


def _deepened(tile: TensorCoreTile, bks: list[int], ks: list[int]) -> TensorCoreTile:
    """Few rows: the weight stream, not the math, bounds the kernel, and a 2-stage pipeline
    leaves one step's slab in flight per block. Of ``SKINNY_STAGES`` x ``bks`` within the
    shared memory, with at least ``2 x stages`` steps of every ``K``, the one with the most
    stages, then the widest step (measured: the module docstring); ``tile`` when none has more
    bytes in flight (``bk x (stages - 1)``)."""
    deeper = [
        TensorCoreTile(tile.wr, tile.wu, bk, tile.gates, tile.gemms, stages)
        for stages in SKINNY_STAGES
        for bk in bks
    ]
    deeper = [
        t
        for t in deeper
        if smem_bytes(t) <= SMEM_BUDGET and all(padded(k, t.bk) // t.bk >= 2 * t.stages for k in ks)
    ]
    best = max(deeper, key=lambda t: (t.stages, t.bk), default=tile)
    return best if best.bk * (best.stages - 1) > tile.bk * (tile.stages - 1) else tile


# --- intrinsics ----------------------------------------------------------------------------

_STORE = "tvm_fusion_mma_store_16x16_f32_shared"


def _tc():
    """TVM's CUDA tensor intrinsics, imported on first use: the import registers every one of
    them and costs about 30 s of CPU here, which no build without tensor cores should pay."""
    from tvm.s_tir.tensor_intrin import cuda

    return cuda


def _intrinsics(dtype: str) -> dict[str, str]:
    """Names of the ldmatrix / mma / fill / store intrinsics for ``dtype`` operands.

    float16 takes TVM's own. bfloat16 takes the same descriptions and implementations with the
    element type changed (``ldmatrix`` moves 16-bit words whatever they hold; the mma
    instruction reads ``.bf16`` operands, sm_80+), registered once under our names."""
    _register_once(_STORE, _store_intrin)
    names = {
        "load_a": _tc().LDMATRIX_f16_A_INTRIN,
        "load_b": _tc().LDMATRIX_f16_B_INTRIN,
        "compute": _tc().MMA_f16f16f32_INTRIN,
        "init": _tc().MMA_fill_16x16_f32_INTRIN,
        "store": _STORE,
    }
    if dtype == "float16":
        return names
    for key in ("load_a", "load_b", "compute"):
        name = f"tvm_fusion_{names[key]}_bf16"
        _register_once(name, lambda base=names[key]: retyped(base, dtype))
        names[key] = name
    return names


def _store_intrin():
    """TVM's description of storing a warp's float32 accumulators to a 16 x 16 tile, with the
    element loop unrolled (TVM's loop keeps a dynamic index: the accumulators went to local
    memory, 28 B of spills at SwiGLU's size). TVM's ``mma_store`` instruction form cannot be
    used: TVM places the float32 tile in the float16 staging buffers' shared memory, and its
    typed pointer into them fails to lower."""
    from tvm.script import tirx as T

    desc, _ = _tc().get_mma_store_intrin("float32", 8, "shared", False)

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        acc = T.match_buffer(a, [WARP, 8], "float32", scope="warp", offset_factor=1)
        tile = T.match_buffer(
            c, [MMA, MMA], "float32", scope="shared", offset_factor=1, strides=[s0, s1]
        )
        with T.sblock("root"):
            T.reads(acc[0:WARP, 0:8])
            T.writes(tile[0:MMA, 0:MMA])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for local in T.unroll(8):
                    row, col = T.meta_var(_tc().ldmatrix_32x8_to_shared_16x16_layout(tx, local))
                    tile[row, col] = acc[tx, local]

    return desc, impl


def _register_once(name: str, make) -> None:
    if TensorIntrin.get(name, allow_missing=True) is None:
        TensorIntrin.register(name, *make())


def retyped(name: str, dtype: str) -> tuple:
    """TVM's float16 intrinsic ``name`` (description, implementation) with ``dtype`` elements:
    the printed functions with the element type and the mma operand type (``.f16`` /
    ``.bf16``) replaced, and ``ldmatrix`` told its element type (the printer drops it, and the
    CUDA code generator falls back to scalar loads without it). ``retyped(name, "float16")``
    gives back TVM's descriptions and mma (checked by the tests)."""
    import tvm

    intrin = TensorIntrin.get(name)
    out = []
    for func in (intrin.desc, intrin.impl):
        text = func.script().replace("float16", dtype)
        text = text.replace('"fp16"', f'"{_PTX_TYPE[dtype]}"')
        text = re.sub(
            r"(T\.ptx_legacy\.ldmatrix\(.*)\)\s*$", rf'\1, dtype="{dtype}")', text, flags=re.M
        )
        parsed = tvm.script.from_source(text)
        out.append(parsed if isinstance(parsed, tirx.PrimFunc) else parsed["main"])
    return tuple(out)


_PTX_TYPE = {"float16": "fp16", "bfloat16": "bf16"}


def _lane(i, j):
    return _tc().shared_16x16_to_ldmatrix_32x8_layout(i % MMA, j % MMA)


# --- matching ------------------------------------------------------------------------------


def _operand_dtype(stmt) -> str | None:
    """``float16`` / ``bfloat16`` when the GEMM block's update is ``Y + f32(a) * f32(b)``
    with ``a`` and ``b`` loads of that dtype and ``Y`` float32; else None."""
    body = stmt.body
    if not isinstance(body, tirx.BufferStore) or body.buffer.dtype != "float32":
        return None
    value = body.value
    if not isinstance(value, tirx.Add) or not isinstance(value.b, tirx.Mul):
        return None
    dtypes = set()
    for operand in (value.b.a, value.b.b):
        if not isinstance(operand, tirx.Cast) or not isinstance(operand.value, TensorLoad):
            return None
        dtypes.add(str(operand.value.source.dtype))
    if len(dtypes) != 1 or next(iter(dtypes)) not in ("float16", "bfloat16"):
        return None
    return next(iter(dtypes))


def _arch_ok(target: Target) -> bool:
    found = re.fullmatch(r"sm_(\d+)\w*", str(target.attrs.get("arch", "")))
    return found is not None and int(found.group(1)) >= 80


def schedule(func: tirx.PrimFunc, target: Target, tensorize: bool = True):
    """The tensor-core schedule of ``func`` (a gate kernel), or None when it does not apply.

    ``tensorize=False`` stops before the tensor intrinsics replace their blocks: the same
    loops, buffers and layouts, runnable on llvm once its threads are made serial (what the
    tests compare with the unscheduled function; tensorize itself checks that each replaced
    block is the intrinsic's description)."""
    if not _arch_ok(target):
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    reductions = [i.block_rv for i in infos if is_reduction(sch, i.block_rv)]
    if not 1 <= len(reductions) <= MAX_GEMMS:
        logger.debug("gate tensor core: %d GEMMs in the kernel", len(reductions))
        return None
    dtypes = {_operand_dtype(sch.get(red)) for red in reductions}
    if len(dtypes) != 1 or None in dtypes:
        return None  # float32 or mixed: the CUDA-core schedules
    try:
        return _schedule(sch, func, reductions, infos, dtypes.pop(), tensorize)
    except Exception as err:  # noqa: BLE001 - not the expected form: the CUDA-core schedules
        logger.debug("gate tensor core: schedule failed: %s", str(err)[:300])
        return None


def _gemm_form(sch, red):
    """``(gates, D / V, V, K)`` of a GEMM ``Y[rows, gates, D / V, V] += x[rows, K] * Wb[D / V,
    K, gates, V]`` with static gates, blocks and ``K``; None otherwise."""
    stmt = sch.get(red)
    out_shape = stmt.writes[0].source.shape
    reads = [r.source for r in stmt.reads if not r.source.same_as(stmt.writes[0].source)]
    ivs = list(stmt.iter_vars)
    if len(out_shape) != 4 or len(ivs) != 5 or [len(b.shape) for b in reads] != [2, 4]:
        return None
    dims = [*out_shape[1:], ivs[4].dom.extent]
    if not all(isinstance(e, tirx.IntImm) for e in dims):
        return None
    return tuple(int(e) for e in dims)


def _pad_gemm(sch, red, factors: list[int]) -> list:
    """Pad the GEMM's rows and ``K`` to the tile (``pad_einsum``; zeros past the rows and
    ``K``): the warps' tiles then carry no predicate. The cut back to the real rows is inlined
    into the gate math; the padding blocks are returned, to be inlined into the shared-memory
    copies (read in place: zero-filled copies, no padded buffer in global memory)."""
    extents = [iv.dom.extent for iv in sch.get(red).iter_vars]
    if all(
        isinstance(e, tirx.IntImm) and int(e) % f == 0
        for e, f in zip(extents, factors, strict=True)
    ):
        return []
    before = {sch.get(b).name_hint for b in sch.get_consumers(red)}
    sch.pad_einsum(red, factors)
    pads = list(sch.get_producers(red))
    for cut in sch.get_consumers(red):
        if sch.get(cut).name_hint not in before:
            sch.compute_inline(cut)
    return pads


def _schedule(sch, func, reductions, infos, dtype: str, tensorize: bool):
    others = [i for i in infos if not any(i.block_rv.same_as(r) for r in reductions)]
    remaining = [i.block_rv for i in try_inline_safe(sch, others)]
    params = set(func.params)
    if len(remaining) != 1 or not any(w.source in params for w in sch.get(remaining[0]).writes):
        logger.debug("gate tensor core: the gate math is not one block writing the results")
        return None
    (final,) = remaining
    forms = [_gemm_form(sch, red) for red in reductions]
    if None in forms or len({f[:3] for f in forms}) != 1:
        logger.debug("gate tensor core: a GEMM not x[rows, K] x Wb[D/V, K, gates, V] alike")
        return None
    gates, blocks_d, block = forms[0][:3]
    if block % MMA:
        logger.debug("gate tensor core: V = %d, not a multiple of 16", block)
        return None
    row_loops = sch.get_loops(final)[:-1]
    if len(row_loops) != 1:
        logger.debug("gate tensor core: rows on %d axes, not 1", len(row_loops))
        return None
    rows = extent(sch, row_loops[0])
    if is_static(rows) and rows < MIN_ROWS:
        logger.debug("gate tensor core: fewer than %d rows: the split-K GEMV", MIN_ROWS)
        return None
    tile = choose_tile(rows, blocks_d * block, block, gates, [f[3] for f in forms])
    if tile is None:
        logger.debug("gate tensor core: no tile fits the shared memory")
        return None
    names = _intrinsics(dtype)
    pads = [_pad_gemm(sch, red, [tile.bm, 1, 1, 1, tile.bk]) for red in reductions]

    # the result block drives the grid; all threads of a block run its gate math (rows past
    # the end: a predicate on this block only, the GEMMs compute whole padded row tiles)
    rows_loop, units_loop = sch.get_loops(final)
    by, r_in = sch.split(rows_loop, [None, tile.bm])
    bx, u_in = sch.split(units_loop, [None, tile.bn])
    sch.reorder(by, bx, r_in, u_in)
    sch.bind(by, "blockIdx.y")
    sch.bind(bx, "blockIdx.x")
    for red in reductions:
        sch.compute_at(red, bx, preserve_unit_loops=True)
    _, ty, tx = sch.split(sch.fuse(r_in, u_in), [None, tile.warps, WARP])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    staged = [
        _stage_gemm(sch, red, tile, pad, aligned_x=form[3] % VEC == 0)
        for red, pad, form in zip(reductions, pads, forms, strict=True)
    ]
    warp_blocks = [_warp_tiles(sch, *loops, stages=tile.stages) for loops in staged]
    if len(reductions) > 1:
        for loops in staged:  # nvcc unrolled both K loops in full: 168 registers at 64 x 1024
            sch.annotate(loops[1], "disable_unroll", 1)
        sch, warp_blocks = _one_accumulator(sch, warp_blocks)
    if tensorize:
        for blocks in warp_blocks:
            _tensorize(sch, names, *blocks)
    return sch


def _stage_gemm(sch, red, tile: TensorCoreTile, pads: list, aligned_x: bool) -> tuple:
    """One GEMM under the block's loops: its result tile in shared memory, laid out (gate, d //
    V, row, unit); one warp per 16 x 16 tile of one gate; ``x`` and the weight slab staged in
    shared memory (16-byte copies, 2-stage pipeline; ``pads``, the GEMM's zero padding, read
    in place by them); the operands through ``ldmatrix``, the accumulators in registers.
    Returns what :func:`_warp_tiles` takes.

    Every ``compute_at`` / ``compute_inline`` of all GEMMs comes before any ``blockize`` (in
    :func:`_warp_tiles`): with symbolic rows a blockized GEMM leaves its scope without the
    stage-pipeline property those steps require."""
    own = sch.get(red).writes[0].source
    x_index, w_index = (
        i for i, region in enumerate(sch.get(red).reads) if not region.source.same_as(own)
    )
    sch.set_scope(red, 0, "shared")
    sch.transform_layout(red, ("write", 0), lambda r, g, do, n: (g, do, r, n))
    r, g, do, n, kk = sch.get_loops(red)[2:]
    ro, r16 = sch.split(r, [None, MMA])
    no, n16 = sch.split(n, [None, MMA])
    k0, k1, k16 = sch.split(kk, [None, tile.bk // MMA, MMA])
    sch.reorder(ro, g, no, do, k0, k1, r16, n16, k16)
    warp = sch.fuse(ro, g, no)
    sch.bind(warp, "threadIdx.y")

    # x and the weight slab of one reduction step in shared memory, 16-byte copies
    copies = [sch.cache_read(red, index, "shared") for index in (x_index, w_index)]
    for pad in pads:  # the padding read in place by the copies: zeros past the rows and K
        sch.compute_inline(pad)
    for copy in copies:
        sch.compute_at(copy, k0, preserve_unit_loops=True)
    x_sh, w_sh = copies
    sch.transform_layout(w_sh, ("write", 0), lambda do, kk, g, n: (do, g, kk, n))
    for copy, aligned in ((x_sh, aligned_x), (w_sh, True)):
        loops = sch.get_loops(copy)
        depth = next(i for i, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(k0))) + 1
        if copy == w_sh:  # (d // V, gate, k, unit), the shared layout's order: a gate's slab
            sch.reorder(loops[depth + 2], loops[depth + 1])  # is then a power-of-two run
            loops = sch.get_loops(copy)  # (a 3-gate order left `// 48` in the vector's index)
        fused = sch.fuse(*loops[depth:])
        if aligned:
            _, cy, cx, vec = sch.split(fused, [None, tile.warps, WARP, VEC])
            sch.vectorize(vec)
        else:
            _, cy, cx = sch.split(fused, [None, tile.warps, WARP])
        sch.bind(cy, "threadIdx.y")
        sch.bind(cx, "threadIdx.x")

    # per 16-step of k: the warp's operands in registers (ldmatrix), accumulators in registers
    a_warp = sch.cache_read(red, x_index, "warp")
    b_warp = sch.cache_read(red, w_index, "warp")
    sch.compute_at(a_warp, k1, preserve_unit_loops=True)
    sch.compute_at(b_warp, k1, preserve_unit_loops=True)
    c_warp = sch.cache_write(red, 0, "warp")
    sch.reverse_compute_at(c_warp, warp, preserve_unit_loops=True)
    return r16, k0, k1, a_warp, b_warp, c_warp


def _warp_tiles(sch, r16, k0, k1, a_warp, b_warp, c_warp, stages: int = STAGES) -> tuple:
    """The warp tiles of one GEMM as blocks of the intrinsics' shapes (16 x 16 x 16 per warp
    and step, the operands and accumulators in the ``ldmatrix`` / ``mma`` register layouts),
    the 2-stage pipeline over ``k0``. Returns the blocks that :func:`_tensorize` replaces."""
    outer = sch.blockize(r16)
    init = sch.decompose_reduction(outer, k0)
    sch.transform_layout(a_warp, ("write", 0), lambda r, kk: (r // 16, kk // 16, *_lane(r, kk)))
    sch.transform_layout(
        b_warp, ("write", 0), lambda do, g, kk, n: (do, g, kk // 16, n // 16, *_lane(kk, n))
    )
    sch.transform_layout(
        c_warp, ("read", 0), lambda g, do, r, n: (g, do, r // 16, n // 16, *_lane(r, n))
    )
    for loop in (*sch.get_loops(b_warp)[-4:-2], *sch.get_loops(c_warp)[-4:-2]):
        sch.unroll(loop)
    sch.unroll(k1)
    sch.annotate(k0, "software_pipeline_stage", [0, 0, stages - 1])
    sch.annotate(k0, "software_pipeline_order", [0, 1, 2])
    sch.annotate(k0, "software_pipeline_async_stages", [0])
    return a_warp, b_warp, outer, init, c_warp


def _tensorize(sch, names, a_warp, b_warp, outer, init, c_warp) -> None:
    """The warp-level blocks of one GEMM replaced by ``ldmatrix`` / ``mma.sync`` / fill /
    store intrinsics (each checked against the intrinsic's description by ``tensorize``)."""
    (init_inner,) = sch.get_child_blocks(init)
    (inner,) = sch.get_child_blocks(outer)
    sch.tensorize(sch.get_loops(a_warp)[-2], names["load_a"])
    sch.tensorize(sch.get_loops(b_warp)[-2], names["load_b"])
    sch.tensorize(sch.get_loops(inner)[-3], names["compute"])
    sch.tensorize(sch.get_loops(init_inner)[-2], names["init"])
    sch.tensorize(sch.get_loops(c_warp)[-2], names["store"])


def _one_accumulator(sch, warp_blocks: list) -> tuple:
    """``sch`` with every GEMM's warp accumulators in the first GEMM's buffer, and the blocks
    of :func:`_warp_tiles` in it (the GEMMs run one after the other, each storing its
    accumulators to its result tile before the next one starts).

    TVM 0.27's ``LowerWarpMemory`` turns only the first warp-scope allocation of a kernel into
    per-thread registers (its ``SeqStmt`` visitor stops after it): a second accumulator buffer
    stays a 256-element array per thread in local memory (1072 B of stack at GRU's 64 x 1024).
    No schedule primitive merges two buffers, so the function is printed and parsed back with
    the later accumulators renamed to the first (before ``tensorize``: TVM 0.27 does not parse
    back what it prints of the mma intrinsics)."""
    import tvm

    first, *others = [sch.get(blocks[-1]).reads[0].source for blocks in warp_blocks]
    text = sch.mod["main"].script()
    for other in others:
        if [str(d) for d in other.shape] != [str(d) for d in first.shape]:
            raise ValueError(f"accumulators {first.shape} and {other.shape} differ")
        alloc = rf"^\s*{other.name} = T\.sblock_alloc_buffer\(.*\)\n"
        text, found = re.subn(alloc, "", text, flags=re.M)
        if found != 1:
            raise ValueError(f"{other.name} is not allocated once in the printed function")
        text = re.sub(rf'(?<![\w"]){other.name}(?![\w"])', first.name, text)
    parsed = tvm.script.from_source(text)
    merged = s_tir.Schedule(parsed if isinstance(parsed, tirx.PrimFunc) else parsed["main"])
    blocks = [
        tuple(merged.get_sblock(sch.get(block).name_hint) for block in group)
        for group in warp_blocks
    ]
    return merged, blocks
