"""ChannelsLast: a CNN whose 1x1 convolutions all write their NCHW output a scalar at a time
runs channels-last (NHWC) throughout, by stock ``ConvertLayout``.

The CPU GEMM rule runs an NCHW 1x1 convolution either with its output channels as rows and the
pixels ``h * w`` as the vector axis (``channels_as_rows``: whole-vector loads and stores), which
needs ``h * w`` to be a multiple of the lanes, or with the pixels as rows and the channels as
the vector axis, and then each register tile goes back to NCHW one scalar store per element,
across the channel planes. SqueezeNet's images are 55 x 55, 27 x 27 and 13 x 13: no vector
divides a single one of its 1x1 convolutions, and in the model those took 1.6 ms against ONNX
Runtime's ~0.6 (its NCHWc kernels store whole vectors of channels). In NHWC the pixels-as-rows
tile stores whole vectors. What NHWC gives up is WinogradConv (NCHW only) for the 3x3
convolutions, and the channels-as-rows tiles where they apply; so the model is converted only
where that trade is plainly won: every ``conv2d`` plain (NCHW / OIHW -> NCHW, one group,
float32, static shapes), at least :data:`MIN_UNALIGNED` of the 1x1 convolutions' products at
an ``h * w`` that the target's lanes do not divide, and those scalar stores many against the
model's convolution work: one per at most :data:`MACS_PER_STORE` products (SqueezeNet: one per
~320; Inception v1, whose 1x1 convolutions are as unaligned but reduce 192-832 channels: one
per ~1500, and it lost 4% in NHWC); and only on targets of at least :data:`MIN_LANES` float32
lanes: a transposed write-back costs a scalar store per lane, and built for AVX2 (``znver3``,
8 lanes) on the same host SqueezeNet lost in NHWC (6.85 -> 7.72 ms) where the AVX-512 build
won (5.05 -> 4.10 ms, ORT 3.57; one process, alternating).

Measured, whole models converted by hand (Intel Xeon ``emeraldrapids``, 2 threads, ours NCHW /
ours NHWC / ORT alternating in one process, medians): SqueezeNet 4.31 -> 3.85 ms (ORT 3.56);
the models this leaves alone lost: ResNet-50 40.0 -> 51.6 ms, DenseNet-121 38.8 -> 40.2,
Inception v1 20.8 -> 21.6 (their 1x1 work is half at 56 x 56 / 28 x 28, channels-as-rows
already), ShuffleNet 3.4 -> 43 ms (grouped convolutions left to the fallback rule in NHWC).

Emitted: ``ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})`` over the whole module: each
convolution NHWC with its weight OHWI (constants, folded at compile time), the layout carried
through elementwise ops, pooling, concatenation and reductions, ``layout_transform`` at the
edges. CPU only; runs after FoldBatchNorm and SplitGroupedConv and before StemChannelsLast and
WinogradConv (which then leave the NHWC convolutions alone).
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax

from .. import target as _target
from ._common import const_int, get_logger, op_name, record_rewrite, skip, static_shape

logger = get_logger(__name__)
NAME = "ChannelsLast"
MIN_UNALIGNED = 0.9  # of the 1x1 convolutions' products at an h * w no vector divides
MACS_PER_STORE = 1000  # at most this many of the model's conv products per such scalar store
MIN_LANES = 16  # float32 lanes: on AVX2 (8) NHWC lost (SqueezeNet 1.13x), on AVX-512 it won


@tvm.transform.module_pass(opt_level=0, name=NAME)
class ChannelsLast:
    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        target = _target.resolve_target(self.target)
        if not _target.is_cpu(target):
            return mod
        convs = [call for func in _relax_functions(mod) for call in _conv2d_calls(func)]
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
    aligned = unaligned = stores = macs = 0
    for conv in convs:
        dims = _plain(conv)
        if isinstance(dims, str):
            return dims
        (_n, c, _h, _w), (n, f, oh, ow), (kh, kw) = dims
        macs += n * f * oh * ow * c * kh * kw
        if (kh, kw) != (1, 1):
            continue
        if (oh * ow) % lanes:
            unaligned += c * f * oh * ow
            stores += n * f * oh * ow
        else:
            aligned += c * f * oh * ow
    if unaligned == 0:
        return "no 1x1 convolution writes its NCHW output a scalar at a time"
    share = unaligned / (aligned + unaligned)
    if share < MIN_UNALIGNED:
        return f"{share:.0%} of the 1x1 work unaligned (< {MIN_UNALIGNED:.0%})"
    if stores * MACS_PER_STORE < macs:
        return f"one scalar store per {macs // stores} products (> {MACS_PER_STORE})"
    return None


def _plain(conv):
    """(input dims, output dims, kernel (h, w)) of a plain conv2d, or why it is not one."""
    attrs = conv.attrs
    layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
    if layouts != ("NCHW", "OIHW", "NCHW"):
        return f"a conv2d in layouts {layouts}"
    if int(attrs.groups) != 1:
        return f"a conv2d of {int(attrs.groups)} groups"
    x, w = conv.args
    dtypes = {str(x.ty.dtype), str(w.ty.dtype), str(conv.ty.dtype)}
    if dtypes != {"float32"}:
        return f"a conv2d in {sorted(dtypes)}"
    shapes = [static_shape(e) for e in (x, conv, w)]
    dims = [None if s is None else [const_int(d) for d in s] for s in shapes]
    if any(d is None or len(d) != 4 or None in d for d in dims):
        return "a conv2d of symbolic or unknown shape"
    return dims[0], dims[1], tuple(dims[2][2:])


def _relax_functions(mod: IRModule) -> list:
    return [
        func
        for func in mod.functions.values()
        if isinstance(func, relax.Function) and not (func.attrs and "Primitive" in func.attrs)
    ]


def _conv2d_calls(func: relax.Function) -> list:
    found = []
    relax.analysis.post_order_visit(
        func, lambda e: found.append(e) if op_name(e) == "relax.nn.conv2d" else None
    )
    return found
