"""The fused attention kernel that :class:`~tvm_fusion.transform.fuse_attention.FuseAttention`
emits: ``softmax(Q K^T * scale + mask) V`` with an online softmax, one scheduled TIR PrimFunc
(``tirx.is_scheduled``: the schedule rules leave it as written; ``op_pattern`` opaque: FuseOps
leaves it alone).

``attention_kernel(d, dv, scale, mask_dims, empty_rows, where_fill, vector_registers, lanes,
layouts)`` -> PrimFunc
``(q (B, H, S, D), kt (B, H, D, N), v (B, H, N, Dv)[, mask (MB, MH, MS, MN)]) -> o (B, H, S, Dv)``,
float32, ``kt`` the keys transposed (what the exporters' ``Transpose`` / ``permute_dims`` of K
gives); with ``layouts`` each of ``q``, ``kt``, ``v`` is passed as the tensor it is a
``permute_dims`` of (``(B, S, H, D)`` heads; K's rows, then packed transposed). ``B, H, S,
N`` (and the mask's dims) are symbolic in the kernel, ``D`` and ``Dv`` are fixed. The mask is
4-D; ``mask_dims[i]`` False means that axis is broadcast (read at 0). An added float32 mask, or
with ``where_fill`` a boolean one that keeps or replaces scores.

Per tile of ``QB`` = 32 query rows of one (batch, head), in parallel over all tiles: the running
maximum ``m`` (a vector over the tile's rows), the running sums of ``exp(score - m)`` per row
and lane (a ``(QB, lanes)`` buffer, added up at the end) and a ``(QB, Dv)`` accumulator stay in
local buffers, the tile's Q rows scaled and transposed into a ``(D, QB)`` buffer once. The keys
go by in blocks of ``KB`` = 64 (what one correction ``exp(m_old - m_new)`` is amortised over;
the keys past the last whole block in blocks of two vectors, the last one clamped): the
block's K^T rows read together from a copy (in K^T they lie ``N`` apart, at N = 512 or 2048 in
a few L1 sets): the whole blocks packed once per (batch, head) before the tiles, into a
workspace the size of K (per tile, the copy took a sixth of the time at S = 512), the tail
blocks copied by each tile; its ``(QB, KB)`` scores as register-blocked GEMMs vectorised
along the keys (``rp`` rows x two vectors of keys per pass, accumulators in registers over
``D``: 4 x 2 ymm of 16 on AVX2, 8 x 2 where the target has 32 SIMD registers), masked, the
row maxima as vectors of lanes, then ``exp(score - m_new)`` times the block's V rows (the
accumulator in ``rp`` rows x two vectors of columns, corrected as it comes into registers). No
spills in either inner loop (znver3 assembly read: 8 accumulators, operands in ymm8-13).

Blocks the mask sets to ``-inf`` whole are skipped: per (tile, block) the mask is read first
(``QB x KB`` values, vectors; far less than the block's ``2 QB KB (D + Dv)`` flops), and a block
where it is ``-inf`` everywhere (an added ``-inf``; ``where_fill`` ``-inf`` with the condition
off) is not computed: a causal mask's blocks above the diagonal, a padding mask's padded keys.
No proof of causality needed, and exact: such a block's probabilities are 0 (the polynomial's
1.6e-38 below -87 aside), except where V there holds NaN / inf (0 x NaN: NaN unfused, not here;
torch's flash kernels skip such blocks too). The ``(B, H, S, N)`` scores never exist in memory.
Keys past ``N`` weigh exactly 0; rows past ``S`` are computed on a clamped row and not written.

``exp`` is the polynomial of :func:`tvm_fusion.lower.legalize.exp_below_max` (arguments <= 0;
below -87 it gives 1.6e-38, not 0, as the legalised softmax does). A row whose every score is
``-inf`` (fully masked) gets ``empty_rows``: ``"nan"`` (what ``softmax`` gives: 0/0) or
``"zero"`` (torch's SDPA decomposition, which replaces such rows by 0).
"""

from __future__ import annotations

import functools

from tvm import tirx
from tvm.script import tirx as T

from .legalize import _EXP_POLY, _ROUNDING

QB = 32  # query rows per tile: 8 (AVX2) or 4 register blocks sharing each key block
KB = 64  # keys per block: what one online-softmax correction is amortised over
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


def _columns(dv: int, width: int) -> int:
    """The output columns one register block holds: ``width``, or what of it divides ``Dv``."""
    while width > 1 and dv % width:
        width //= 2
    return width


IDENTITY = (0, 1, 2, 3)


def _inverse(axes):
    inv = [0] * 4
    for k, a in enumerate(axes):
        inv[a] = k
    return inv


def _stored(logical, axes):
    """The shape (or index) in the operand's buffer of ``logical`` (the kernel's order of the
    operand's axes), the operand being ``permute_dims(buffer, axes)``."""
    inv = _inverse(axes)
    return tuple(logical[inv[m]] for m in range(4))


def _at(buf, axes, *logical):
    """``buf`` read at the kernel's index ``logical`` (see :func:`_stored`)."""
    return buf[_stored(logical, axes)]


def attention_kernel(
    d: int,
    dv: int,
    scale: float,
    mask_dims,
    empty_rows: str = "nan",
    where_fill=None,
    vector_registers: int = 16,
    lanes: int = 8,
    layouts=None,
) -> tirx.PrimFunc:
    """The scheduled PrimFunc of :func:`_attention_kernel`, parsed once per distinct arguments
    (TVMScript's parser takes 1-2 s a kernel; a model's layers share theirs). ``layouts``:
    ``(q_axes, kt_axes, v_axes)``, each operand passed as the tensor ``x`` of which it is
    ``permute_dims(x, axes)`` (a GPT block's ``(B, S, H, D)`` heads before their transposes;
    ``V``'s last axis must stay last); None: the operands themselves."""
    layouts = (IDENTITY,) * 3 if layouts is None else tuple(tuple(map(int, a)) for a in layouts)
    if len(layouts) != 3 or any(sorted(a) != list(IDENTITY) for a in layouts):
        raise ValueError(f"layouts must be three permutations of 4 axes, not {layouts}")
    if layouts[2][3] != 3:
        raise ValueError("V's last axis must stay its last (the P V loop's vectors)")
    return _attention_kernel(
        int(d),
        int(dv),
        float(scale),
        None if mask_dims is None else tuple(bool(m) for m in mask_dims),
        empty_rows,
        None if where_fill is None else (float(where_fill[0]), bool(where_fill[1])),
        int(vector_registers),
        int(lanes),
        layouts,
    )


@functools.lru_cache(maxsize=64)
def _attention_kernel(
    d: int,
    dv: int,
    scale: float,
    mask_dims: tuple[bool, bool, bool, bool] | None,
    empty_rows: str = "nan",
    where_fill: tuple[float, bool] | None = None,
    vector_registers: int = 16,
    lanes: int = 8,
    layouts: tuple = (IDENTITY,) * 3,
) -> tirx.PrimFunc:
    """The scheduled PrimFunc (see the module docstring). ``mask_dims`` None: no mask
    parameter. ``where_fill`` ``(fill, keep_when)``: the mask is boolean and selects, a score
    stays where the mask is ``keep_when`` and is ``fill`` elsewhere; None: the mask is float32
    and added. ``vector_registers`` and ``lanes``: the target's SIMD registers and float32
    lanes (:func:`tvm_fusion.target.vector_registers`, :func:`~tvm_fusion.target.vector_lanes`),
    which size the register blocks."""
    if empty_rows not in ("nan", "zero"):
        raise ValueError(f"empty_rows must be 'nan' or 'zero', not {empty_rows!r}")
    if lanes < 1 or KB % (2 * lanes):
        raise ValueError(f"lanes must divide {KB // 2}, not {lanes}")
    mask_dtype = "bool" if where_fill is not None else "float32"
    has_mask = mask_dims is not None
    keep = mask_dims if has_mask else (False,) * 4
    neg_inf = tirx.const(float("-inf"), "float32")
    zero = tirx.const(0.0, "float32")
    scale_c = tirx.const(scale, "float32")
    nl = lanes
    qa, ka, va = layouts
    # K^T's buffer holds K's rows (D last: ``(B, N, H, D)``, a GPT block's heads), not K^T's
    k_rows = _inverse(ka)[3] == 2

    def mask_value(mask, bb, hh, i, j):
        index = [x if kept else 0 for x, kept in zip((bb, hh, i, j), keep, strict=True)]
        return mask[index[0], index[1], index[2], index[3]]

    def masked(score, mask, bb, hh, i, j):
        """The scaled score with the mask applied."""
        if not has_mask:
            return score
        value = mask_value(mask, bb, hh, i, j)
        if where_fill is None:
            return score + value
        fill, keep_when = where_fill
        cond = value if keep_when else tirx.Not(value)
        return tirx.Select(cond, score, tirx.const(fill, "float32"))

    # blocks whose every score the mask makes -inf are skipped (a causal mask's blocks above
    # the diagonal): with an added mask of -inf (a NaN score plus -inf stays NaN unfused: the
    # NaN inputs' rows are NaN either way) or a where with fill -inf
    skips = has_mask and (where_fill is None or where_fill[0] == float("-inf"))

    def visible(mask, bb, hh, i, j):
        """1 where the mask lets the score through, 0 where it makes it -inf."""
        value = mask_value(mask, bb, hh, i, j)
        one = tirx.const(1.0, "float32")
        if where_fill is None:
            return tirx.Select(value == neg_inf, zero, one)
        cond = value if where_fill[1] else tirx.Not(value)
        return tirx.Select(cond, one, zero)

    def empty_value(n):
        if empty_rows == "zero":
            return zero
        return tirx.Select(n > 0, tirx.const(float("nan"), "float32"), zero)

    def base_of(x):
        """The shift of the exponentials: the running maximum, 0 while it is -inf."""
        return tirx.Select(x == neg_inf, zero, x)

    # register blocks: rp rows x two vectors of accumulators, the operand vectors and a
    # broadcast within the target's SIMD registers (AVX2: 4 x 2 + 2 + 1 of 16 ymm; 32
    # registers: 8 x 2 + 2 + 1). A spilled accumulator is a store-to-load chain through the
    # stack on every iteration. (6 x 2 on AVX2 with QB = 24 was 7-9 % faster again, but 24
    # does not divide KB: a tile straddling a block boundary would read a causal mask's
    # masked block for its upper rows.)
    rp = 8 if vector_registers >= 32 else 4
    ks = 2 * nl  # keys per QK^T register block
    cb = _columns(dv, 2 * nl)  # output columns per P V register block

    def key(k0, jj, n, tail):
        """Key ``jj`` of the block from ``k0``; in the tail block clamped to the last key."""
        return T.min(k0 + jj, n - 1) if tail else k0 + jj

    def k_of(kbuf, kp, t, k0, c, j, s, n):
        """The block's K^T row ``c``, key ``j``: from ``kp`` (packed per (batch, head) before
        the tiles) where the block is whole, else from ``kbuf`` (copied by the tile)."""
        if kp is None:
            return kbuf[c, j]
        return kp[t // _tiles(s) * (n // KB * KB * d) + k0 * d + c * KB + j]

    @T.macro
    def block_live(mask, live, vmax, t, k0, kb, s, h, n, tail):
        """``live[0] > 0`` unless the mask makes every score of the block ``-inf`` (then the
        block is skipped: the causal blocks above the diagonal)."""
        for ln in T.vectorized(nl):
            vmax[0, ln] = zero
        for r in range(QB):
            for jo in range(kb // nl):
                for ln in T.vectorized(nl):
                    vmax[0, ln] = T.max(
                        vmax[0, ln],
                        visible(
                            mask,
                            _batch(t, s, h),
                            _head(t, s, h),
                            T.min(_row0(t, s) + r, s - 1),
                            key(k0, jo * nl + ln, n, tail),
                        ),
                    )
        live[0] = zero
        for ln in range(nl):
            live[0] = T.max(live[0], vmax[0, ln])

    @T.macro
    def key_block(
        qt,
        kt,
        kbuf,
        kp,
        v,
        mask,
        acc,
        run_max,
        run_sum,
        vmax,
        new_max,
        corr,
        sc,
        t,
        k0,
        kb,
        s,
        h,
        n,
        tail,
    ):
        """Scores of keys ``jb * KB ...`` for the tile's rows, the online-softmax update, and
        their probabilities times V into ``acc``. ``tail``: the block may pass ``n`` (indices
        clamped, keys past ``n`` weigh 0). ``sc`` is (rows, keys): scores, exponentials and
        sums are vector operations over the block's keys."""
        # the block's K^T rows copied together: in K^T they lie N apart, at a large power of
        # two (N = 512, 2048...) in a few L1 sets, evicting each other between the passes
        if kp is None and k_rows:
            for jj in range(kb):
                for c in T.vectorized(d):
                    kbuf[c, jj] = _at(
                        kt, ka, _batch(t, s, h), _head(t, s, h), c, key(k0, jj, n, tail)
                    )
        elif kp is None:
            for c in range(d):
                for jj in T.vectorized(kb):
                    kbuf[c, jj] = _at(
                        kt, ka, _batch(t, s, h), _head(t, s, h), c, key(k0, jj, n, tail)
                    )
        # rp rows x ks keys at a time, vectorised over the keys (K^T rows are contiguous in
        # them): the accumulators stay in registers over c
        for rh in range(QB // rp):
            for ko in range(kb // ks):
                for r in T.unroll(rp):
                    for jj in T.vectorized(ks):
                        sc[rh * rp + r, ko * ks + jj] = zero
                for c in range(d):
                    for r in T.unroll(rp):
                        for jj in T.vectorized(ks):
                            sc[rh * rp + r, ko * ks + jj] = sc[rh * rp + r, ko * ks + jj] + (
                                qt[c, rh * rp + r] * k_of(kbuf, kp, t, k0, c, ko * ks + jj, s, n)
                            )
        # masked, and the rows' maxima as vectors of lanes
        for r in range(QB):
            for ln in T.vectorized(nl):
                vmax[r, ln] = run_max[r]
            for jo in range(kb // nl):
                for ln in T.vectorized(nl):
                    sc[r, jo * nl + ln] = T.if_then_else(
                        k0 + jo * nl + ln < n or not tail,
                        masked(
                            sc[r, jo * nl + ln],
                            mask,
                            _batch(t, s, h),
                            _head(t, s, h),
                            T.min(_row0(t, s) + r, s - 1),
                            key(k0, jo * nl + ln, n, tail),
                        ),
                        neg_inf,
                    )
                    vmax[r, ln] = T.max(vmax[r, ln], sc[r, jo * nl + ln])
            new_max[r] = vmax[r, 0]
            for ln in range(1, nl):
                new_max[r] = T.max(new_max[r], vmax[r, ln])
        for r in range(QB):
            for jo in range(kb // nl):
                for ln in T.vectorized(nl):
                    sc[r, jo * nl + ln] = T.if_then_else(
                        k0 + jo * nl + ln < n or not tail,
                        _exp_nonpositive(sc[r, jo * nl + ln] - base_of(new_max[r])),
                        zero,
                    )
        for r in T.vectorized(QB):
            corr[r] = _exp_nonpositive(run_max[r] - base_of(new_max[r]))
        for r in T.vectorized(QB):
            run_max[r] = new_max[r]
        # the running sums per (row, lane): vector operations, added up at the end
        for r in range(QB):
            for ln in T.vectorized(nl):
                run_sum[r, ln] = run_sum[r, ln] * corr[r]
            for jo in range(kb // nl):
                for ln in T.vectorized(nl):
                    run_sum[r, ln] = run_sum[r, ln] + sc[r, jo * nl + ln]
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
                for jj in range(kb):
                    for r in T.unroll(rp):
                        for ci in T.vectorized(cb):
                            acc[rh * rp + r, cbo * cb + ci] = acc[rh * rp + r, cbo * cb + ci] + sc[
                                rh * rp + r, jj
                            ] * _at(
                                v,
                                va,
                                _batch(t, s, h),
                                _head(t, s, h),
                                key(k0, jj, n, tail),
                                cbo * cb + ci,
                            )

    @T.macro
    def maybe_block(
        qt,
        kt,
        kbuf,
        kp,
        v,
        mask,
        acc,
        run_max,
        run_sum,
        vmax,
        new_max,
        corr,
        sc,
        live,
        t,
        k0,
        kb,
        s,
        h,
        n,
        tail,
    ):
        if skips:
            block_live(mask, live, vmax, t, k0, kb, s, h, n, tail)
            if live[0] > zero:
                key_block(
                    qt,
                    kt,
                    kbuf,
                    kp,
                    v,
                    mask,
                    acc,
                    run_max,
                    run_sum,
                    vmax,
                    new_max,
                    corr,
                    sc,
                    t,
                    k0,
                    kb,
                    s,
                    h,
                    n,
                    tail,
                )
        else:
            key_block(
                qt,
                kt,
                kbuf,
                kp,
                v,
                mask,
                acc,
                run_max,
                run_sum,
                vmax,
                new_max,
                corr,
                sc,
                t,
                k0,
                kb,
                s,
                h,
                n,
                tail,
            )

    @T.prim_func(private=True, s_tir=True)
    def fused_attention(p_q: T.handle, p_k: T.handle, p_v: T.handle, p_m: T.handle, p_o: T.handle):
        T.func_attr(
            {
                "tirx.is_scheduled": True,
                "tirx.noalias": True,
                "op_pattern": 8,
                "tvm_fusion.dense_kernel": True,
            }
        )
        b = T.int64()
        h = T.int64()
        s = T.int64()
        n = T.int64()
        mb = T.int64()
        mh = T.int64()
        ms = T.int64()
        mn = T.int64()
        q = T.match_buffer(p_q, _stored((b, h, s, d), qa))
        kt = T.match_buffer(p_k, _stored((b, h, d, n), ka))
        v = T.match_buffer(p_v, _stored((b, h, n, dv), va))
        mask = T.match_buffer(p_m, (mb, mh, ms, mn), mask_dtype)
        o = T.match_buffer(p_o, (b, h, s, dv))
        # the whole key blocks' K^T rows, packed once per (batch, head): (d, KB) each, as
        # the tiles read them (in K^T they lie N apart, at N = 512, 2048... in a few L1 sets)
        kp = T.decl_buffer((b * h * (n // KB * KB * d),), "float32")
        # (K rows, D apart in K^T's buffer: read along them; else along K^T's rows)
        for bh in T.parallel(b * h):
            if k_rows:
                for jb, jj in T.grid(n // KB, KB):
                    for c in T.vectorized(d):
                        kp[bh * (n // KB * KB * d) + (jb * d + c) * KB + jj] = _at(
                            kt, ka, bh // h, bh % h, c, jb * KB + jj
                        )
            else:
                for jb, c in T.grid(n // KB, d):
                    for jj in T.vectorized(KB):
                        kp[bh * (n // KB * KB * d) + (jb * d + c) * KB + jj] = _at(
                            kt, ka, bh // h, bh % h, c, jb * KB + jj
                        )
        for t in T.parallel(b * h * ((s + QB - 1) // QB)):
            acc = T.decl_buffer((QB, dv), "float32", scope="local")
            run_max = T.decl_buffer((QB,), "float32", scope="local")
            run_sum = T.decl_buffer((QB, nl), "float32", scope="local")
            vmax = T.decl_buffer((QB, nl), "float32", scope="local")
            new_max = T.decl_buffer((QB,), "float32", scope="local")
            corr = T.decl_buffer((QB,), "float32", scope="local")
            live = T.decl_buffer((1,), "float32", scope="local")
            sc = T.decl_buffer((QB, KB), "float32", scope="local")
            kbuf = T.decl_buffer((d, KB), "float32", scope="local")
            qt = T.decl_buffer((d, QB), "float32", scope="local")
            # the scale folded into Q
            # along Q's rows (their D elements are contiguous in every layout taken)
            for r, c in T.grid(QB, d):
                qt[c, r] = (
                    _at(q, qa, _batch(t, s, h), _head(t, s, h), T.min(_row0(t, s) + r, s - 1), c)
                    * scale_c
                )
            for r in range(QB):
                run_max[r] = neg_inf
                for ln in T.vectorized(nl):
                    run_sum[r, ln] = zero
                for c in T.vectorized(dv):
                    acc[r, c] = zero
            # (no names for the tile's batch, head and first row: a TVMScript assignment here
            # becomes a one-element buffer, allocated per tile and read from memory)
            # blocks of KB keys, then what is left in blocks of ks keys, the last one clamped
            for jb in range(n // KB):
                maybe_block(
                    qt,
                    kt,
                    kbuf,
                    kp,
                    v,
                    mask,
                    acc,
                    run_max,
                    run_sum,
                    vmax,
                    new_max,
                    corr,
                    sc,
                    live,
                    t,
                    jb * KB,
                    KB,
                    s,
                    h,
                    n,
                    False,
                )
            for jb in range(n % KB // ks):
                maybe_block(
                    qt,
                    kt,
                    kbuf,
                    None,
                    v,
                    mask,
                    acc,
                    run_max,
                    run_sum,
                    vmax,
                    new_max,
                    corr,
                    sc,
                    live,
                    t,
                    n // KB * KB + jb * ks,
                    ks,
                    s,
                    h,
                    n,
                    False,
                )
            if n % ks > 0:
                maybe_block(
                    qt,
                    kt,
                    kbuf,
                    None,
                    v,
                    mask,
                    acc,
                    run_max,
                    run_sum,
                    vmax,
                    new_max,
                    corr,
                    sc,
                    live,
                    t,
                    n // ks * ks,
                    ks,
                    s,
                    h,
                    n,
                    True,
                )
            for r in range(QB):
                corr[r] = zero  # now the row's sum
                for ln in range(nl):
                    corr[r] = corr[r] + run_sum[r, ln]
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
