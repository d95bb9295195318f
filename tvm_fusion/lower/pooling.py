"""Max pooling with a stride over the width, legalised for contiguous vector loads.

``max_pool2d`` in NCHW with a stride ``s > 1`` over the width (SqueezeNet's and GoogLeNet's 3 x 3
stride 2, ResNet's stem) reads ``x[.., s * ow + kw]``: neighbouring outputs read ``s`` elements
apart. No CPU schedule vectorised that: the window rule left it to LLVM (a masked
compare-and-store per element), the row rule ran it scalar. Here it is two blocks: the input's
planes deinterleaved once, ``d[n, c, h, p, j] = x_padded[n, c, h, s * j + p]`` (its padding,
``-inf``, folded in), then the window reduction over ``d[n, c, s * oh + kh, kw % s, ow + kw // s]``,
whose innermost index moves by one with ``ow``: the window rule computes the copy of a plane
under its parallel loop and vectorises the row with plain vector loads. Exact (the same
maxima of the same elements). Other layouts, dilations, dtypes and unit strides keep the stock
legalisation (``None``), and so do GPU targets (dlight's rules inline the copy)."""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx

from .. import target as _target

_FLOAT = ("float32", "float64", "float16")


def _static(values) -> list[int] | None:
    out = []
    for v in values:
        if not isinstance(v, tirx.IntImm | int):
            return None
        out.append(int(v))
    return out


def strided_max_pool2d(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
    """The legalisation of ``relax.nn.max_pool2d`` (see the module docstring), or None."""
    current = tvm.target.Target.current(allow_none=True)
    if current is not None and _target.is_gpu(current):
        return None  # dlight's rules inline the copy back into the loads: nothing to gain
    attrs = call.attrs
    x = call.args[0]
    out_shape = getattr(call.ty, "shape", None)
    if (
        attrs.layout != "NCHW"
        or attrs.out_layout != "NCHW"
        or any(int(d) != 1 for d in attrs.dilation)
        or x.ty.dtype not in _FLOAT
        or not isinstance(out_shape, relax.ShapeExpr)
        or not isinstance(x.ty.shape, relax.ShapeExpr)
    ):
        return None
    shape = _static(x.ty.shape.values)
    out = _static(out_shape.values)
    if shape is None or out is None or len(shape) != 4:
        return None
    kh, kw = (int(k) for k in attrs.pool_size)
    sh, sw = (int(s) for s in attrs.strides)
    top, left = int(attrs.padding[0]), int(attrs.padding[1])
    if sw < 2:
        return None
    _, _, height, width = shape
    oh, ow = out[2], out[3]
    rows = (oh - 1) * sh + kh  # padded rows read
    cols = ow + (kw - 1) // sw  # deinterleaved columns read, per phase

    def compute(data):
        dtype = data.dtype
        lowest = tirx.min_value(dtype)

        def plane(n, c, h, p, j):
            w = j * sw + p - left
            inside = []
            if top > 0 or rows > top + height:
                inside += [h >= top, h < top + height]
            if left > 0:
                inside.append(w >= 0)
            if cols * sw - left > width:
                inside.append(w < width)
            value = data[n, c, h - top, w]
            return tirx.if_then_else(tirx.all(*inside), value, lowest) if inside else value

        d = te.compute(
            (shape[0], shape[1], rows, sw, cols),
            plane,
            name="deinterleaved",
            attrs={"tvm_fusion.deinterleave": 1},  # schedule.cpu.window.DEINTERLEAVE
        )
        rh = te.reduce_axis((0, kh), name="rh")
        rw = te.reduce_axis((0, kw), name="rw")
        return te.compute(
            out,
            lambda n, c, i, j: te.max(d[n, c, i * sh + rh, rw % sw, j + rw // sw], axis=[rh, rw]),
            name="pool_max",
        )

    return bb.call_te(compute, x, primfunc_name_hint="max_pool2d_strided")
