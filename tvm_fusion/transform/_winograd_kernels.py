"""WinogradConv's transform matrices and its two hand-scheduled transform kernels (CPU).

F(m x m, 3 x 3) with ``alpha = m + 2`` points (Lavin & Gray 2016): for a tile ``d``
(alpha x alpha input values) and a filter ``g`` (3 x 3), the m x m outputs are
``A^T [(G g G^T) * (B^T d B)] A``. F(2, 3) uses the points 0, 1, -1 and infinity; F(4, 3) adds
2 and -2 (the matrices of NNPACK and cuDNN's F(4x4, 3x3)). The weight transform ``U = G g G^T``
is computed at compile time in float64 by the pass; these kernels do the two others.

Both are ``tirx.is_scheduled`` (the schedule rules leave them as written) and ``op_pattern``
opaque, like ``lower/attention.py``'s kernels: one parallel loop over (tiles, channel blocks),
one vectorised loop over a channel block, and in it one store per transformed value, written
out as an explicit sum with the matrices' constants (zero coefficients left out; LLVM keeps the
tile's loads common to the stores). Measured at 64 channels, 56 x 56, F(4, 3), each kernel
timed alone on 2 threads under load ~3.5 (ms):

    form                                                  input   output   (GEMM 1.4-1.7)
    one injective TE element each (Select coefficients)   35.0     8.0
    TE, tile coordinate unrolled by a schedule             2.5      1.3
    explicit constant sums (these)                         0.19     0.17

- input transform ``xp[N, Hp, Wp, C] -> V[alpha^2, P, C]`` (``P = N x TH x TW`` tiles): ``xp``
  is the input in NHWC padded to whole tiles (the pass's ``permute_dims`` + ``pad``, one
  injective kernel that FuseOps fuses with the producer's epilogue), so the kernel has no
  bounds checks and its loads are contiguous vectors along the channels;
- output transform ``M[alpha^2, P, K] -> Y[N, K, TH*m, TW*m]``: loads contiguous along the
  output channels, stores strided (NCHW); writing NHWC instead and transposing in the
  epilogue took 0.7 ms more (the injective rule's transposing copy). An NHWC convolution
  (ChannelsLast's) gets ``Y[N, TH*m, TW*m, K]``, stores contiguous too. ``Y`` covers whole tiles;
  the pass slices it to the convolution's output where the tiles overhang it.

Built with TVM's IR builder (TVMScript text of the same kernels took 5.6 s to parse for
F(4, 3)'s input transform), and cached by shape.
"""

from __future__ import annotations

import functools

import numpy as np
from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.script.ir_builder import tirx as T

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


def padded_shape(x_shape, m: int, pads) -> tuple[int, int]:
    """The input's height and width padded to whole tiles: ``TH * m + 2`` x ``TW * m + 2``."""
    _, _, h_, w_ = x_shape
    top, left, bottom, right = pads
    th_, tw_ = tiles(h_ + top + bottom - 2, w_ + left + right - 2, m)
    return th_ * m + 2, tw_ * m + 2


def _lanes(extent: int, lanes: int) -> int:
    while lanes > 1 and extent % lanes:
        lanes //= 2
    return lanes


def _sum(terms):
    """``sum(coefficient * value)`` as a PrimExpr, zero coefficients left out."""
    total = None
    for coefficient, value in terms:
        if not coefficient:
            continue
        if coefficient != 1:
            value = tirx.const(float(coefficient), "float32") * value
        total = value if total is None else total + value
    return total if total is not None else tirx.const(0.0, "float32")


def _kernel(a_name, a_shape, b_name, b_shape, outer: int, lanes: int, body):
    """A PrimFunc ``(a, b)``: ``for outer (parallel): for lane (vectorised): body(a, b, outer,
    lane)``, in a root block (what ``has_reshape_pattern`` and the other analyses read)."""
    with IRBuilder() as ib, T.prim_func(is_private=True):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True, "op_pattern": 8})
        a = T.arg(a_name, T.buffer(a_shape, "float32"))
        b = T.arg(b_name, T.buffer(b_shape, "float32"))
        with T.sblock("root"):
            with T.parallel(0, outer) as o:
                with T.vectorized(0, lanes) as lane:
                    body(a, b, o, lane)
    return ib.get()


def _tile(p, th_: int, tw_: int):
    """Image, tile row and tile column of tile ``p``."""
    return p // (th_ * tw_), p // tw_ % th_, p % tw_


@functools.lru_cache(maxsize=64)
def input_transform(xp_shape, m: int, lanes: int):
    """The PrimFunc ``(xp, V)`` and V's shape ``[alpha^2, P, C]``; ``xp`` is the input in NHWC
    padded to whole tiles (:func:`padded_shape`)."""
    bt = MATRICES[m][0]
    alpha = m + 2
    n_, hp_, wp_, c_ = xp_shape
    th_, tw_ = (hp_ - 2) // m, (wp_ - 2) // m
    lanes = _lanes(c_, lanes)
    blocks = c_ // lanes
    v_shape = (alpha * alpha, n_ * th_ * tw_, c_)

    def body(xp, v, outer, lane):
        p, c = outer // blocks, outer % blocks * lanes + lane
        n, th, tw = _tile(p, th_, tw_)
        d = [[xp[n, th * m + i, tw * m + j, c] for j in range(alpha)] for i in range(alpha)]
        for xi in range(alpha):
            for nu in range(alpha):
                terms = [
                    (bt[xi, i] * bt[nu, j], d[i][j]) for i in range(alpha) for j in range(alpha)
                ]
                T.buffer_store(v, _sum(terms), [xi * alpha + nu, p, c])

    blocks_total = n_ * th_ * tw_ * blocks
    return _kernel("xp", tuple(xp_shape), "v", v_shape, blocks_total, lanes, body), v_shape


@functools.lru_cache(maxsize=64)
def output_transform(n_: int, k_: int, out_h: int, out_w: int, m: int, lanes: int, nhwc=False):
    """The PrimFunc ``(M, Y)`` and Y's shape ``[N, K, TH*m, TW*m]`` (``nhwc``:
    ``[N, TH*m, TW*m, K]``, its stores contiguous along the channels)."""
    at = MATRICES[m][2]
    alpha = m + 2
    th_, tw_ = tiles(out_h, out_w, m)
    lanes = _lanes(k_, lanes)
    blocks = k_ // lanes
    tiles_ = n_ * th_ * tw_
    y_shape = (n_, th_ * m, tw_ * m, k_) if nhwc else (n_, k_, th_ * m, tw_ * m)

    def body(mm, y, outer, lane):
        p, k = outer // blocks, outer % blocks * lanes + lane
        n, th, tw = _tile(p, th_, tw_)
        for i in range(m):
            for j in range(m):
                terms = [
                    (at[i, xi] * at[j, nu], mm[xi * alpha + nu, p, k])
                    for xi in range(alpha)
                    for nu in range(alpha)
                ]
                at_ = [n, th * m + i, tw * m + j, k] if nhwc else [n, k, th * m + i, tw * m + j]
                T.buffer_store(y, _sum(terms), at_)

    m_shape = (alpha * alpha, tiles_, k_)
    return _kernel("mm", m_shape, "y", y_shape, tiles_ * blocks, lanes, body), y_shape
