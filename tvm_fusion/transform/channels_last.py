"""ChannelsLast: a CNN whose 1x1 convolutions all write their NCHW output a scalar at a time
runs channels-last (NHWC) throughout, by stock ``ConvertLayout``.

The CPU GEMM rule runs an NCHW 1x1 convolution either with its output channels as rows and the
pixels ``h * w`` as the vector axis (``channels_as_rows``: whole-vector loads and stores), which
needs ``h * w`` to be a multiple of the lanes, or with the pixels as rows and the channels as
the vector axis, and then each register tile goes back to NCHW one scalar store per element,
across the channel planes. SqueezeNet's images are 55 x 55, 27 x 27 and 13 x 13: no vector
divides a single one of its 1x1 convolutions, and in the model those took 1.6 ms against ONNX
Runtime's ~0.6 (its NCHWc kernels store whole vectors of channels). In NHWC the pixels-as-rows
tile stores whole vectors, and WinogradConv takes the NHWC 3x3 convolutions too (its output
transform then stores contiguously as well). The model is converted where every ``conv2d`` is
plain (NCHW / OIHW -> NCHW, one group, float32, static shapes), at least
:data:`MIN_UNALIGNED` of the 1x1 convolutions' products are at an ``h * w`` the target's lanes
do not divide (on 16 lanes or more, AVX-512: any of them, :data:`MIN_UNALIGNED_WIDE`), and the
target has at least :data:`MIN_LANES` float32 lanes (the ISA levels measured: AVX2 and AVX-512;
NEON's 4 lanes not).

Measured, whole models (Intel Xeon ``emeraldrapids``, 2 threads, alternating in one process,
medians, ms; NHWC with WinogradConv on NHWC): SqueezeNet 5.90 -> 3.79 (ORT 3.87), built for
AVX2 (``znver3``) 7.75 -> 6.11; Inception v1 (as unaligned: 55, 27, 13, 6) 21.2 -> 18.0 (ORT
27.9). Left NCHW by the share at first: ResNet-50 (53% unaligned) 42.9 -> 41.4 by hand,
Inception v2 (70%) 20.0 -> 19.9, DenseNet-121 (38%) 38.2 -> 38.7: within the noise; since the
AVX-512 tiles stay under 1024 bytes (7 x 2 in NHWC, 4 x 2 in NCHW's channels-as-rows) NHWC wins
there (see :data:`MIN_UNALIGNED_WIDE`). ShuffleNet (grouped convolutions, which fall back in
NHWC) 3.4 -> 43: refused.

Emitted: ``ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})`` over the whole module: each
convolution NHWC with its weight OHWI (``permute_dims`` of the constant, which WinogradConv
reads at compile time and the GEMM rule's packing folds), the layout carried through
elementwise ops, pooling, concatenation and reductions, ``permute_dims`` at the edges. CPU
only; runs after FoldBatchNorm and SplitGroupedConv and before StemChannelsLast (which then
leaves the NHWC stem alone) and WinogradConv.
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax

from .. import target as _target
from ._common import (
    const_int,
    float32_conv2d_form,
    get_logger,
    graph_functions,
    op_name,
    record_rewrite,
    skip,
    static_shape,
)

logger = get_logger(__name__)
NAME = "ChannelsLast"
MIN_UNALIGNED = 0.9  # of the 1x1 convolutions' products at an h * w no vector divides
# ... on targets of WIDE_LANES float32 lanes or more (AVX-512): any share. There the NHWC 1x1
# GEMMs take 7 x 2 vector tiles (the pixel counts of ImageNet CNNs, 56 x 56 down to 7 x 7, are
# multiples of 7) and NCHW's channels-as-rows tiles 4 x 2 (_tiles.STACK_TILE_BYTES); NHWC / NCHW,
# alternating, 2026-11-27: ResNet-50 0.947 and 0.951, DenseNet-121 0.951, Inception v2 0.949
# and 0.904. Built for AVX2 (znver3) Inception v2 took 2.14x the time in NHWC: the 0.9 stays.
MIN_UNALIGNED_WIDE = 0.0
WIDE_LANES = 16
MIN_LANES = 8  # float32 lanes: AVX2 and AVX-512 measured (both won); NEON's 4 not


@tvm.transform.module_pass(opt_level=0, name=NAME)
class ChannelsLast:
    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        target = _target.resolve_target(self.target)
        if not _target.is_cpu(target):
            return mod
        convs = [call for _, func in graph_functions(mod) for call in _conv2d_calls(func)]
        if not convs:
            return mod
        lanes = _target.vector_lanes(target, "float32")
        why = refusal(convs, lanes) if lanes >= MIN_LANES else f"{lanes} float32 lanes"
        if why is not None:
            skip(logger, "the module", why)
            return mod
        converted = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})(mod)
        record_rewrite(NAME, len(convs))
        return converted


def refusal(convs: list, lanes: int) -> str | None:
    """Why a module with these ``conv2d`` calls stays NCHW, or None to convert it."""
    aligned = unaligned = 0
    for conv in convs:
        dims = _plain(conv)
        if isinstance(dims, str):
            return dims
        (_n, c, _h, _w), (n, f, oh, ow), (kh, kw) = dims
        if (kh, kw) != (1, 1):
            continue
        if (oh * ow) % lanes:
            unaligned += n * c * f * oh * ow
        else:
            aligned += n * c * f * oh * ow
    if unaligned == 0:
        return "no 1x1 convolution writes its NCHW output a scalar at a time"
    share = unaligned / (aligned + unaligned)
    least = MIN_UNALIGNED_WIDE if lanes >= WIDE_LANES else MIN_UNALIGNED
    if share < least:
        return f"{share:.0%} of the 1x1 work unaligned (< {least:.0%})"
    return None


def _plain(conv):
    """(input dims, output dims, kernel (h, w)) of a plain conv2d, or why it is not one."""
    layout, in_dims, why = float32_conv2d_form(conv)
    if why or layout != "NCHW":
        return f"a conv2d: {why or 'layout ' + layout}"
    dims = [static_shape(e) for e in (conv, conv.args[1])]
    dims = [None if s is None else [const_int(d) for d in s] for s in dims]
    if any(d is None or len(d) != 4 or None in d for d in dims):
        return "a conv2d of symbolic or unknown shape"
    return in_dims, dims[0], tuple(dims[1][2:])


def _conv2d_calls(func: relax.Function) -> list:
    found = []
    relax.analysis.post_order_visit(
        func, lambda e: found.append(e) if op_name(e) == "relax.nn.conv2d" else None
    )
    return found
