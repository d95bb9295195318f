"""The fused attention kernel that :class:`~tvm_fusion.transform.fuse_attention.FuseAttention`
emits: ``softmax(Q K^T * scale + mask) V`` with an online softmax, one scheduled TIR PrimFunc
(``tirx.is_scheduled``: the schedule rules leave it as written; ``op_pattern`` opaque: FuseOps
leaves it alone).

``attention_kernel(d, dv, scale, mask_dims, empty_rows, where_fill, vector_registers)`` ->
PrimFunc
``(q (B, H, S, D), kt (B, H, D, N), v (B, H, N, Dv)[, mask (MB, MH, MS, MN)]) -> o (B, H, S, Dv)``,
float32, ``kt`` the keys transposed (what the exporters' ``Transpose`` / ``permute_dims`` of K
gives). ``B, H, S, N`` (and the mask's dims) are symbolic in the kernel, ``D`` and ``Dv`` are
fixed. The mask is 4-D; ``mask_dims[i]`` False means that axis is broadcast (read at 0). An
added float32 mask, or with ``where_fill`` a boolean one that keeps or replaces scores.

Per tile of ``QB`` query rows of one (batch, head), in parallel over all tiles: the running
maximum ``m`` (a vector over the tile's rows), the running sums of ``exp(score - m)`` per row
and key lane (a ``(QB, KB)`` buffer, added up at the end) and a ``(QB, Dv)`` accumulator stay
in local buffers, the tile's Q rows transposed into a ``(D, QB)`` buffer once. The keys go by
in blocks of ``KB``: the block's ``(QB, KB)`` scores as register-blocked GEMMs vectorised
along the keys (a K^T row is contiguous in them; ``rp`` rows per pass, their accumulators in
registers over ``D``: 4 rows x 16 keys = 8 ymm on AVX2, all 8 rows where the target has 32
SIMD registers), scaled and masked, the row maxima, the correction ``exp(m_old - m_new)``,
then ``exp(score - m_new)`` (vectors over keys) times the block's V rows (the accumulator in
``rp`` rows x ``Dv`` blocks of 16 columns, corrected as it comes into registers). A spilled
accumulator is a store-to-load chain through the stack on every iteration (the blocking of
8 x 16 accumulators before, 16 ymm plus operands, spilled 3 to 5 of them).
The ``(B, H, S, N)`` scores never exist in memory. Keys past ``N`` in the last block weigh
exactly 0 (that block reads clamped indices; the others read whole vectors); rows past ``S``
are computed on a clamped row and not written. Not yet: skipping the blocks above the
diagonal of a causal mask (the mask is read and every block computed).

``exp`` is the polynomial of :func:`tvm_fusion.lower.legalize.exp_below_max` (arguments <= 0;
below -87 it gives 1.6e-38, not 0, as the legalised softmax does). A row whose every score is
``-inf`` (fully masked) gets ``empty_rows``: ``"nan"`` (what ``softmax`` gives: 0/0) or
``"zero"`` (torch's SDPA decomposition, which replaces such rows by 0).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .legalize import _EXP_POLY, _ROUNDING

QB = 8  # query rows per tile
KB = 16  # keys per block: two AVX2 float32 vectors, one AVX-512 one
KERNEL_NAME = "fused_attention"


def _exp_nonpositive(r):
    """``exp(r)`` for ``r <= 0`` (see :func:`tvm_fusion.lower.legalize.exp_below_max`)."""
    r = tirx.max(r, tirx.const(-87.0, "float32"))
    bias = tirx.const(_ROUNDING + 127.0, "float32")
    one = tirx.const(1.0, "float32")
    biased = r * tirx.const(1.4426950408889634, "float32") + bias
    same = tirx.reinterpret("float32", tirx.reinterpret("int32", biased))
    f = r - (same - bias) * tirx.const(0.6931471805599453, "float32")
    poly = tirx.const(_EXP_POLY[0], "float32")
    for c in _EXP_POLY[1:]:
        poly = poly * f + tirx.const(c, "float32")
    two_n = tirx.reinterpret("float32", tirx.reinterpret("int32", biased) << 23)
    return ((poly * f + one) * f + one) * two_n


def _tiles(s):
    return (s + QB - 1) // QB


def _batch(t, s, h):
    """The batch of tile ``t`` (tiles ordered batch, head, row block)."""
    return t // _tiles(s) // h


def _head(t, s, h):
    return t // _tiles(s) % h


def _row0(t, s):
    return t % _tiles(s) * QB


def _lanes(dv: int) -> int:
    """The output columns one register block holds: 16, or what of it divides ``Dv``."""
    for lanes in (16, 8, 4, 2):
        if dv % lanes == 0:
            return lanes
    return 1


def attention_kernel(
    d: int,
    dv: int,
    scale: float,
    mask_dims: tuple[bool, bool, bool, bool] | None,
    empty_rows: str = "nan",
    where_fill: tuple[float, bool] | None = None,
    vector_registers: int = 16,
) -> tirx.PrimFunc:
    """The scheduled PrimFunc (see the module docstring). ``mask_dims`` None: no mask
    parameter. ``where_fill`` ``(fill, keep_when)``: the mask is boolean and selects, a score
    stays where the mask is ``keep_when`` and is ``fill`` elsewhere; None: the mask is float32
    and added. ``vector_registers``: the target's SIMD registers
    (:func:`tvm_fusion.target.vector_registers`), which size the register blocks."""
    if empty_rows not in ("nan", "zero"):
        raise ValueError(f"empty_rows must be 'nan' or 'zero', not {empty_rows!r}")
    mask_dtype = "bool" if where_fill is not None else "float32"
    has_mask = mask_dims is not None
    keep = mask_dims if has_mask else (False,) * 4
    neg_inf = tirx.const(float("-inf"), "float32")
    zero = tirx.const(0.0, "float32")
    scale_c = tirx.const(scale, "float32")

    def masked(score, mask, bb, hh, i, j):
        """The scaled score with the mask applied."""
        if not has_mask:
            return score
        index = [x if kept else 0 for x, kept in zip((bb, hh, i, j), keep, strict=True)]
        value = mask[index[0], index[1], index[2], index[3]]
        if where_fill is None:
            return score + value
        fill, keep_when = where_fill
        cond = value if keep_when else tirx.Not(value)
        return tirx.Select(cond, score, tirx.const(fill, "float32"))

    def empty_value(n):
        if empty_rows == "zero":
            return zero
        return tirx.Select(n > 0, tirx.const(float("nan"), "float32"), zero)

    def base_of(x):
        """The shift of the exponentials: the running maximum, 0 while it is -inf."""
        return tirx.Select(x == neg_inf, zero, x)

    cb = _lanes(dv)
    # register blocking: the accumulators of one pass, the operand vectors and a broadcast
    # must fit in the target's SIMD registers (AVX2: 16; a spilled accumulator is a
    # store-to-load chain through the stack on every iteration)
    rp = QB if vector_registers >= 2 * QB + 4 else QB // 2

    def key(jb, jj, n, tail):
        """Key ``jj`` of block ``jb``; in the tail block clamped to the last key."""
        return T.min(jb * KB + jj, n - 1) if tail else jb * KB + jj

    @T.macro
    def key_block(qt, kt, v, mask, acc, run_max, run_sum, new_max, corr, sc, t, jb, s, h, n, tail):
        """Scores of keys ``jb * KB ...`` for the tile's rows, the online-softmax update, and
        their probabilities times V into ``acc``. ``tail``: the block may pass ``n`` (indices
        clamped, keys past ``n`` weigh 0). ``sc`` is (rows, keys): scores, exponentials and
        sums are vector operations over the block's keys."""
        for r in range(QB):
            for jj in T.vectorized(KB):
                sc[r, jj] = zero
        # rp rows at a time, vectorised over the block's keys (K^T rows are contiguous in
        # them): the rows' accumulators stay in registers over c
        for rh in range(QB // rp):
            for c in range(d):
                for r in T.unroll(rp):
                    for jj in T.vectorized(KB):
                        sc[rh * rp + r, jj] = (
                            sc[rh * rp + r, jj]
                            + qt[c, rh * rp + r]
                            * kt[_batch(t, s, h), _head(t, s, h), c, key(jb, jj, n, tail)]
                        )
        for r in range(QB):
            for jj in T.vectorized(KB):
                sc[r, jj] = T.if_then_else(
                    jb * KB + jj < n or not tail,
                    masked(
                        sc[r, jj] * scale_c,
                        mask,
                        _batch(t, s, h),
                        _head(t, s, h),
                        T.min(_row0(t, s) + r, s - 1),
                        key(jb, jj, n, tail),
                    ),
                    neg_inf,
                )
        for r in range(QB):
            new_max[r] = run_max[r]
            for jj in range(KB):
                new_max[r] = T.max(new_max[r], sc[r, jj])
        for r in T.vectorized(QB):
            corr[r] = _exp_nonpositive(run_max[r] - base_of(new_max[r]))
        for r in range(QB):
            for jj in T.vectorized(KB):
                sc[r, jj] = T.if_then_else(
                    jb * KB + jj < n or not tail,
                    _exp_nonpositive(sc[r, jj] - base_of(new_max[r])),
                    zero,
                )
        # the running sums per (row, key lane): vector operations, added up at the end
        for r in range(QB):
            for jj in T.vectorized(KB):
                run_sum[r, jj] = run_sum[r, jj] * corr[r] + sc[r, jj]
        for r in T.vectorized(QB):
            run_max[r] = new_max[r]
        # acc[rows block, c block] stays in registers over the keys (its addresses do not
        # change in jj)
        for cbo in range(dv // cb):
            for rh in range(QB // rp):
                # the correction where the block's accumulators come into registers
                for r in T.unroll(rp):
                    for ci in T.vectorized(cb):
                        acc[rh * rp + r, cbo * cb + ci] = (
                            acc[rh * rp + r, cbo * cb + ci] * corr[rh * rp + r]
                        )
                for jj in range(KB):
                    for r in T.unroll(rp):
                        for ci in T.vectorized(cb):
                            acc[rh * rp + r, cbo * cb + ci] = (
                                acc[rh * rp + r, cbo * cb + ci]
                                + sc[rh * rp + r, jj]
                                * v[
                                    _batch(t, s, h),
                                    _head(t, s, h),
                                    key(jb, jj, n, tail),
                                    cbo * cb + ci,
                                ]
                            )

    @T.prim_func(private=True, s_tir=True)
    def fused_attention(p_q: T.handle, p_k: T.handle, p_v: T.handle, p_m: T.handle, p_o: T.handle):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        b = T.int64()
        h = T.int64()
        s = T.int64()
        n = T.int64()
        mb = T.int64()
        mh = T.int64()
        ms = T.int64()
        mn = T.int64()
        q = T.match_buffer(p_q, (b, h, s, d))
        kt = T.match_buffer(p_k, (b, h, d, n))
        v = T.match_buffer(p_v, (b, h, n, dv))
        mask = T.match_buffer(p_m, (mb, mh, ms, mn), mask_dtype)
        o = T.match_buffer(p_o, (b, h, s, dv))
        for t in T.parallel(b * h * ((s + QB - 1) // QB)):
            acc = T.decl_buffer((QB, dv), "float32", scope="local")
            run_max = T.decl_buffer((QB,), "float32", scope="local")
            run_sum = T.decl_buffer((QB, KB), "float32", scope="local")
            new_max = T.decl_buffer((QB,), "float32", scope="local")
            corr = T.decl_buffer((QB,), "float32", scope="local")
            sc = T.decl_buffer((QB, KB), "float32", scope="local")
            qt = T.decl_buffer((d, QB), "float32", scope="local")
            for c, r in T.grid(d, QB):
                qt[c, r] = q[_batch(t, s, h), _head(t, s, h), T.min(_row0(t, s) + r, s - 1), c]
            for r in range(QB):
                run_max[r] = neg_inf
                for jj in T.vectorized(KB):
                    run_sum[r, jj] = zero
                for c in T.vectorized(dv):
                    acc[r, c] = zero
            # (no names for the tile's batch, head and first row: a TVMScript assignment here
            # becomes a one-element buffer, allocated per tile and read from memory)
            for jb in range(n // KB):
                key_block(
                    qt, kt, v, mask, acc, run_max, run_sum, new_max, corr, sc, t, jb, s, h, n, False
                )
            if n % KB > 0:
                key_block(
                    qt,
                    kt,
                    v,
                    mask,
                    acc,
                    run_max,
                    run_sum,
                    new_max,
                    corr,
                    sc,
                    t,
                    n // KB,
                    s,
                    h,
                    n,
                    True,
                )
            for r in range(QB):
                corr[r] = zero  # now the row's sum
                for jj in range(KB):
                    corr[r] = corr[r] + run_sum[r, jj]
            for r in range(QB):
                if _row0(t, s) + r < s:
                    for c in T.vectorized(dv):
                        o[_batch(t, s, h), _head(t, s, h), _row0(t, s) + r, c] = T.if_then_else(
                            run_max[r] == neg_inf,
                            empty_value(n),
                            acc[r, c] * (T.float32(1.0) / corr[r]),
                        )

    if has_mask:
        return fused_attention
    params = list(fused_attention.params)
    func = fused_attention
    return tirx.PrimFunc(params[:3] + params[4:], func.body, func.ret_type, func.attrs)
