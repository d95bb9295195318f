"""WinogradConv: a 3 x 3 convolution of stride 1 becomes Winograd's F(m x m, 3 x 3) (CPU).

Matches ``R.nn.conv2d`` in NCHW / OIHW / NCHW (or NHWC / OHWI / NHWC, ChannelsLast's: the
input is then padded in place and the output transform writes NHWC) with a 3 x 3 kernel,
stride 1, dilation 1, groups 1, float32, a constant weight (after FoldBatchNorm), static
shapes and any padding, with at least ``MIN_IN_CHANNELS`` input and ``MIN_OUT_CHANNELS``
output channels and enough tiles (below). It emits

    xp = pad(permute_dims(x, NHWC))  # to whole tiles: one injective copy, fused upstream
    V = winograd_input(xp)           # [alpha^2, P, C]: B^T d B of every tile
    M = matmul(V, U)                 # U = G g G^T [alpha^2, C, K], a constant (float64 -> f32)
    Y = winograd_output(M)           # [N, K, TH*m, TW*m]: A^T m A of every tile
    y = Y[:, :, :OH, :OW]            # only where the tiles overhang the output

with ``alpha = m + 2`` and ``P = N x TH x TW`` tiles. The batched GEMM is our GEMM rule's
(rows = tiles, columns = output channels, U packed at compile time; the other orientation,
``U[alpha^2, K, C] x V[alpha^2, C, P]``, took 1.2-2.4x its time, the GEMMs alone, at the
layers below; the constant is then not the packed operand). The transforms are two
scheduled kernels (``_winograd_kernels.py``). The conv's bias, activation and residual add
stay where they were and fuse with each other (and the slice) into one injective kernel after
the output transform, not into it: the output transform written as an injective TE
expression, which FuseOps fuses with them, took 1.6-3.9x the direct convolution's time for the
whole layer (the separate epilogue: 0.04 ms at 64 x 56 x 56).

Tile: F(4, 3) (4x fewer multiplies than direct) when it gives at least ``MIN_TILES`` tiles,
else F(2, 3) (2.25x fewer) when that does, else none. Measured per layer, bias + ReLU, batch 1,
2 threads, alternating with the direct kernel (the pipeline with ``winograd_conv=False``) in
one run (``scripts/bench_winograd.py``, other jobs on the machine: load 4.0-6.1; Winograd /
direct time, * = the tile the rule picks):

    in -> out at size     F(2,3)  F(4,3)       in -> out at size     F(2,3)  F(4,3)
    64 -> 64 at 56        0.64    0.49*        64 -> 64 at 224       0.96    0.75*
    128 -> 128 at 28      0.50    0.21*        256 -> 256 at 56      0.42    0.28*
    256 -> 256 at 14      0.27*   0.49         512 -> 512 at 14      0.44*   0.54
    512 -> 512 at 7       0.65    0.74 (none)  64 -> 256 at 13       0.42*   0.48
    48 -> 192 at 13       0.62*   0.67         16 -> 64 at 55        0.97    0.74*

F(4, 3) wins on large images; at 14 x 14 and less its 4 x 4 tiles are few and overhang (16
tiles at 13 and 14, 4 at 7 x 7: 8 x 8 computed for 7 x 7). ``MIN_TILES`` = 32 leaves ResNet's
512-channel 7 x 7 layers alone: there each value of the transformed weight (16 MB for F(2, 3),
against 9 MB direct) is used by 16 tiles only, and an earlier run (slower transforms, load 3.4)
measured 1.25x the direct time; the run above, 0.65. Not settled: a quiet machine should decide.

Float32 error: the weight transform is exact to rounding; F(4, 3)'s input transform
multiplies by up to 25 and the output's by up to 64, so its error grows (1e-5 relative to the
largest output at 128 channels against the direct kernel, < 2e-5 at 512 against float64;
F(2, 3): 1e-6).

Left alone: other layouts (blocked; NHWC with a weight other than OHWI), kernels other than 3 x 3,
stride or dilation > 1, groups > 1, a weight that is not a constant, symbolic shapes, other
dtypes, fewer channels, targets other than CPUs.
"""

from __future__ import annotations

from math import prod

import tvm
from tvm import IRModule, relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import target as _target
from . import _winograd_kernels as kernels
from ._common import (
    bound_values,
    float32_conv2d,
    get_logger,
    ints,
    op_name,
    record_rewrite,
    rewrite_each_function,
    skip,
)

logger = get_logger(__name__)
NAME = "WinogradConv"
MIN_IN_CHANNELS = 16
MIN_OUT_CHANNELS = 64
MIN_TILES = 32  # tiles (N x TH x TW): the rows of the GEMM, the uses of each weight value
TILE_SIZES = (4, 2)  # m of F(m, 3), in the order tried


@tvm.transform.module_pass(opt_level=0, name=NAME)
class WinogradConv:
    """Rewrites 3 x 3 stride-1 convolutions as Winograd F(2,3) / F(4,3) (see the module
    docstring)."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        target = _target.resolve_target(self.target)
        if not _target.is_cpu(target):
            return mod
        lanes = _target.vector_lanes(target, "float32")
        # the transform kernels the rewriters add to their builders come along
        count = rewrite_each_function(mod, lambda m, func: _Rewriter(m, func, lanes))
        record_rewrite(NAME, count)
        return mod


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod: IRModule, func: relax.Function, lanes: int):
        super().__init__(mod)
        self.bound = bound_values(func)
        self.lanes = lanes
        self.count = 0

    def visit_var_binding_(self, binding) -> None:
        new = self._winograd(binding.value, binding.var.name)
        if new is None:
            super().visit_var_binding_(binding)
            return
        self.set_var_remap(binding.var, new)
        self.count += 1

    def _winograd(self, call, name: str):
        if op_name(call) != "relax.nn.conv2d":
            return None
        what = f"conv2d {name}"
        attrs = call.attrs
        if ints(attrs.strides) != [1, 1] or ints(attrs.dilation) != [1, 1]:
            return skip(logger, what, "stride or dilation > 1") or None
        layout, dims, weight, why = float32_conv2d(call, self.bound)
        if why:
            return skip(logger, what, why) or None
        if weight.shape[2:] != (3, 3):
            return skip(logger, what, f"a {weight.shape[2:]} kernel") or None
        x = call.args[0]
        k_, c_ = weight.shape[:2]
        if c_ < MIN_IN_CHANNELS or k_ < MIN_OUT_CHANNELS:
            return skip(logger, what, f"{c_} -> {k_} channels") or None
        n_, _, h_, w_ = dims
        top, left, bottom, right = ints(attrs.padding)
        out_h, out_w = h_ + top + bottom - 2, w_ + left + right - 2
        if out_h < 1 or out_w < 1 or n_ < 1:
            return skip(logger, what, "an empty output") or None
        tiles = {m: n_ * prod(kernels.tiles(out_h, out_w, m)) for m in TILE_SIZES}
        m = next((m for m in TILE_SIZES if tiles[m] >= MIN_TILES), 0)
        if not m:
            return skip(logger, what, f"fewer than {MIN_TILES} tiles of {out_h} x {out_w}") or None
        pads = (top, left, bottom, right)
        return self._emit(x, weight, dims, pads, (out_h, out_w), m, name, layout == "NHWC")

    def _emit(self, x, weight, dims, pads, out_hw, m, name, nhwc):
        bb = self.builder_
        k_ = weight.shape[0]
        hp_, wp_ = kernels.padded_shape(dims, m, pads)
        top, left = pads[:2]
        bottom, right = hp_ - dims[2] - top, wp_ - dims[3] - left
        in_func, v_shape = kernels.input_transform((dims[0], hp_, wp_, dims[1]), m, self.lanes)
        out_func, y_shape = kernels.output_transform(dims[0], k_, *out_hw, m, self.lanes, nhwc)
        in_gv = bb.add_func(in_func, f"winograd_input_f{m}")
        out_gv = bb.add_func(out_func, f"winograd_output_f{m}")
        f32 = "float32"
        # NHWC, padded to whole tiles: one injective kernel, fused with x's producer's epilogue
        xp = self.visit_expr(x)
        xp = xp if nhwc else bb.emit(relax.op.permute_dims(xp, [0, 2, 3, 1]))
        pad = [0, 0, top, bottom, left, right, 0, 0]
        xp = bb.emit(relax.op.nn.pad(xp, pad), name_hint=f"{name}_x") if any(pad) else xp
        v = bb.emit(
            relax.call_tir(in_gv, [xp], relax.TensorType(v_shape, f32)), name_hint=f"{name}_v"
        )
        u = relax.const(kernels.weight_transform(weight, m).astype(f32))
        mm = bb.emit(relax.op.matmul(v, u), name_hint=f"{name}_m")
        y = bb.emit(
            relax.call_tir(out_gv, [mm], relax.TensorType(y_shape, f32)), name_hint=f"{name}_y"
        )
        hw_axes = [1, 2] if nhwc else [2, 3]
        if tuple(y_shape[a] for a in hw_axes) != tuple(out_hw):
            y = bb.emit(
                relax.op.strided_slice(y, axes=hw_axes, begin=[0, 0], end=list(out_hw)),
                name_hint=name,
            )
        return y
