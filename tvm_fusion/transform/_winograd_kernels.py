"""WinogradConv's transform matrices and its two hand-scheduled transform kernels (CPU).

F(m x m, 3 x 3) with ``alpha = m + 2`` points (Lavin & Gray 2016): for a tile ``d``
(alpha x alpha input values) and a filter ``g`` (3 x 3), the m x m outputs are
``A^T [(G g G^T) * (B^T d B)] A``. F(2, 3) uses the points 0, 1, -1 and infinity; F(4, 3) adds
2 and -2 (the matrices of NNPACK and cuDNN's F(4x4, 3x3)). The weight transform ``U = G g G^T``
is computed at compile time in float64 by the pass; these kernels do the two others.

Both are ``tirx.is_scheduled`` (the schedule rules leave them as written) and ``op_pattern``
opaque, like ``lower/attention.py``'s kernels. Written as one TE expression per element (a
Select on the tile coordinate picks each coefficient), then scheduled so that the tile
coordinate is an unrolled loop: its Selects fold to constants, and the alpha^2 (input) or
alpha^2 (output) loads a tile needs are common to the unrolled iterations. Left to the
injective rule (one parallel loop, the innermost vectorised, no unrolling), the same
expressions ran at 1.6-3.9x the direct convolution's time for the whole layer (128 channels at
28 x 28, load ~3.8), because every element recomputed alpha^2 selected terms with gathered loads.

- input transform ``x[N, C, H, W] -> V[alpha^2, P, C]`` (``P = N x TH x TW`` tiles): the
  padding is read as zeros inside it; vectorised over the channels (the GEMM's reduction axis,
  contiguous in ``V``), parallel over (tiles, channel blocks);
- output transform ``M[alpha^2, P, K] -> Y[N, K, TH*m, TW*m]``: vectorised over the output
  channels (contiguous in ``M``), the m x m outputs of a tile unrolled, parallel over (image,
  tile rows, tile columns, channel blocks). ``Y`` covers whole tiles; the pass slices it to
  the convolution's output where the tiles overhang it.
"""

from __future__ import annotations

import numpy as np
from tvm import s_tir, te, tirx

_ATTRS = {"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8}

# (B^T, G, A^T) for output tiles of m = 2 and m = 4
MATRICES = {
    2: (
        np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], float),
        np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], float),
        np.array([[1, 1, 1, 0], [0, 1, -1, -1]], float),
    ),
    4: (
        np.array(
            [
                [4, 0, -5, 0, 1, 0],
                [0, -4, -4, 1, 1, 0],
                [0, 4, -4, -1, 1, 0],
                [0, -2, -1, 2, 1, 0],
                [0, 2, -1, -2, 1, 0],
                [0, 4, 0, -5, 0, 1],
            ],
            float,
        ),
        np.array(
            [
                [1 / 4, 0, 0],
                [-1 / 6, -1 / 6, -1 / 6],
                [-1 / 6, 1 / 6, -1 / 6],
                [1 / 24, 1 / 12, 1 / 6],
                [1 / 24, -1 / 12, 1 / 6],
                [0, 0, 1],
            ],
            float,
        ),
        np.array(
            [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]],
            float,
        ),
    ),
}


def weight_transform(weight: np.ndarray, m: int) -> np.ndarray:
    """``U[alpha^2, C, K]`` of an OIHW 3 x 3 weight, in float64 then rounded once to float32."""
    g = MATRICES[m][1]
    alpha = m + 2
    u = np.einsum("ai,kcij,bj->abck", g, weight.astype(np.float64), g)
    return np.ascontiguousarray(u.reshape(alpha * alpha, weight.shape[1], weight.shape[0]))


def tiles(out_h: int, out_w: int, m: int) -> tuple[int, int]:
    return -(-out_h // m), -(-out_w // m)


def _coefficient(table: np.ndarray, row, col: int):
    """``table[row, col]`` for a PrimExpr ``row``: a Select chain (folds to a constant once
    ``row`` is one); None when the column is all zeros."""
    values = table[:, col]
    if not values.any():
        return None
    expr = tirx.const(float(values[-1]), "float32")
    for k in range(len(values) - 2, -1, -1):
        expr = tirx.Select(row == k, tirx.const(float(values[k]), "float32"), expr)
    return expr


def _lanes(extent: int, lanes: int) -> int:
    while lanes > 1 and extent % lanes:
        lanes //= 2
    return lanes


def _finish(sch: s_tir.Schedule):
    func = sch.mod["main"]
    for key, value in _ATTRS.items():
        func = func.with_attr(key, value)
    return func.without_attr("global_symbol")


def padded_shape(x_shape, m: int, pads) -> tuple[int, int]:
    """The input's height and width padded to whole tiles: ``TH * m + 2`` x ``TW * m + 2``."""
    _, _, h_, w_ = x_shape
    top, left, bottom, right = pads
    th_, tw_ = tiles(h_ + top + bottom - 2, w_ + left + right - 2, m)
    return th_ * m + 2, tw_ * m + 2


def input_transform(xp_shape, m: int, lanes: int):
    """The scheduled PrimFunc ``(xp, V)`` and V's shape; ``xp`` is the input padded to whole
    tiles (:func:`padded_shape`): no bounds checks in the kernel (with them, F(4, 3)'s 1296
    unrolled terms took LLVM 40-50 s to compile)."""
    bt = MATRICES[m][0]
    alpha = m + 2
    n_, c_, hp_, wp_ = xp_shape
    th_, tw_ = (hp_ - 2) // m, (wp_ - 2) // m
    x = te.placeholder(xp_shape, "float32", name="xp")

    def element(a, p, c):
        xi, nu = a // alpha, a % alpha
        n, th, tw = p // (th_ * tw_), p // tw_ % th_, p % tw_
        total = None
        for i in range(alpha):
            ci = _coefficient(bt, xi, i)
            for j in range(alpha if ci is not None else 0):
                cj = _coefficient(bt, nu, j)
                if cj is None:
                    continue
                term = ci * cj * x[n, c, th * m + i, tw * m + j]
                total = term if total is None else total + term
        return total

    v_shape = (alpha * alpha, n_ * th_ * tw_, c_)
    v = te.compute(v_shape, element, name="winograd_v")
    sch = s_tir.Schedule(te.create_prim_func([x, v]))
    block = sch.get_sblock("winograd_v")
    a, p, c = sch.get_loops(block)
    c_outer, c_inner = sch.split(c, [None, _lanes(c_, lanes)])
    sch.reorder(p, c_outer, a, c_inner)
    sch.parallel(sch.fuse(p, c_outer))
    sch.unroll(a)
    sch.vectorize(c_inner)
    return _finish(sch), v_shape


def output_transform(n_: int, k_: int, out_h: int, out_w: int, m: int, lanes: int):
    """The scheduled PrimFunc ``(M, Y)`` and Y's shape ``[N, K, TH*m, TW*m]``."""
    at = MATRICES[m][2]
    alpha = m + 2
    th_, tw_ = tiles(out_h, out_w, m)
    mm = te.placeholder((alpha * alpha, n_ * th_ * tw_, k_), "float32", name="m")

    def element(n, k, h, w):
        p = n * th_ * tw_ + h // m * tw_ + w // m
        total = None
        for xi in range(alpha):
            cx = _coefficient(at, h % m, xi)
            for nu in range(alpha if cx is not None else 0):
                cy = _coefficient(at, w % m, nu)
                if cy is None:
                    continue
                term = cx * cy * mm[xi * alpha + nu, p, k]
                total = term if total is None else total + term
        return total

    y_shape = (n_, k_, th_ * m, tw_ * m)
    y = te.compute(y_shape, element, name="winograd_y")
    sch = s_tir.Schedule(te.create_prim_func([mm, y]))
    block = sch.get_sblock("winograd_y")
    n, k, h, w = sch.get_loops(block)
    th, i = sch.split(h, [None, m])
    tw, j = sch.split(w, [None, m])
    k_outer, k_inner = sch.split(k, [None, _lanes(k_, lanes)])
    sch.reorder(n, th, tw, k_outer, i, j, k_inner)
    sch.parallel(sch.fuse(n, th, tw, k_outer))
    sch.unroll(i)
    sch.unroll(j)
    sch.vectorize(k_inner)
    return _finish(sch), y_shape
