"""The ONNX fuzzer's ``convnets`` family: small random CNNs in the forms the model zoo and the
exporters write, for the convolution rules, WinogradConv, ChannelsLast, the pooling layout and
the grouped / depthwise paths.

A chain of 1-4 blocks on an NCHW input (batch static or dynamic, 1-3; sometimes symbolic
height and width), each one of:

- ``conv``: Conv of 1x1 to 7x7 (square, 1x3 / 3x1 / 1x7 / 7x1), stride 1-3, dilation 1-2,
  symmetric, asymmetric or ``auto_pad`` padding, bias or none; then maybe BatchNormalization,
  then Relu / Clip(0, 6) / LeakyRelu / Sigmoid / nothing;
- ``depthwise`` and ``grouped`` convolutions (groups = channels, or a divisor of both sides);
- ``pool``: MaxPool / AveragePool (kernels 2-3, strides, pads, ``ceil_mode``,
  ``count_include_pad``);
- ``residual``: a same-shape convolution (1x1, or 3x3 padded) added to its input, then Relu;
  or, with a stride of 2, a strided 1x1 shortcut (ResNet's downsampling block);
- ``inception``: 2-3 branches (1x1, 3x3 padded, a 3x3 max pool + 1x1) joined by Concat;
- ``shuffle``: ShuffleNet's channel shuffle (Reshape, Transpose, Reshape).

Then the feature map is the output, or a head: GlobalAveragePool / GlobalMaxPool, Flatten and
Gemm (maybe Softmax). Channel counts reach 64-128 and images 28 x 28 sometimes, so that
Winograd (16 -> 64 channels and up) and the NHWC layout fire; most cases stay small.
"""

from __future__ import annotations

import numpy as np

from .common import InvalidCase
from .onnx_graph import _Graph, _randn

IN_CHANNELS = (1, 2, 3, 3, 5, 8, 16, 17, 24, 32, 64)
OUT_CHANNELS = (1, 4, 5, 8, 16, 17, 24, 32, 48, 64, 64, 96, 128)
IMAGE = (1, 2, 3, 5, 7, 8, 9, 13, 14, 16, 17, 28)
# a quarter of the cases at the model zoo's sizes (ResNet's and DenseNet's later stages): the
# Winograd, NHWC, K-block and weight-panel paths fire there
BIG_IN_CHANNELS = (64, 96, 128, 256)
BIG_OUT_CHANNELS = (64, 128, 192, 256, 512)
BIG_IMAGE = (7, 13, 14, 28)
BLOCKS = (
    *("conv", "conv", "conv", "depthwise", "grouped"),
    *("pool", "residual", "inception", "shuffle"),
)


def _out(size, k: int, stride: int, dil: int, lo: int, hi: int, ceil: bool = False):
    """Output extent of a window (None where the input size is symbolic)."""
    if size is None:
        return None
    span = size + lo + hi - dil * (k - 1) - 1
    if span < 0:
        raise InvalidCase("window larger than the padded image")
    return (-(-span // stride) if ceil else span // stride) + 1


class _Net:
    """The current value of the CNN under construction: its name, channels and image dims
    (static size or None), and the sizes of each dim for the two feeds."""

    def __init__(self, g: _Graph, x: str, c: int, hw, hw_sizes):
        self.g, self.x, self.c = g, x, c
        self.hw = list(hw)  # [h, w]: int or None (symbolic)
        self.hw_sizes = [list(s) for s in hw_sizes]  # per dim: [feed 0 size, feed 1 size]
        self.notes: list[str] = []
        self.big = False

    def _window(self, k, stride, dil, pads, ceil=False):
        """New static dims and feed sizes after a window; InvalidCase when one is empty."""
        hw, sizes = [], []
        for d in range(2):
            lo, hi = pads[d], pads[d + 2]
            hw.append(_out(self.hw[d], k[d], stride[d], dil[d], lo, hi, ceil))
            sizes.append([_out(s, k[d], stride[d], dil[d], lo, hi, ceil) for s in self.hw_sizes[d]])
        if min(min(s) for s in sizes) < 1:
            raise InvalidCase("an empty output")
        return hw, sizes

    def conv(
        self,
        out_c: int,
        k,
        stride=(1, 1),
        dil=(1, 1),
        pads=None,
        groups=1,
        bias=True,
        auto_pad=None,
    ):
        g, rng = self.g, self.g.rng
        if self.c % groups or out_c % groups:
            raise InvalidCase("groups divide neither side")
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            # ONNX: output = ceil(in / stride); the total pad split with the odd one at the end
            # (UPPER) or the start (LOWER); only defined here for static dims
            if None in self.hw or dil != (1, 1):
                auto_pad = None
            else:
                pads = []
                for d in range(2):
                    out = -(-self.hw[d] // stride[d])
                    total = max(0, (out - 1) * stride[d] + k[d] - self.hw[d])
                    small, big = total // 2, total - total // 2
                    pads.append((small, big) if auto_pad == "SAME_UPPER" else (big, small))
                pads = [pads[0][0], pads[1][0], pads[0][1], pads[1][1]]
        if auto_pad == "VALID":
            pads = [0, 0, 0, 0]
        pads = list(pads) if pads is not None else [k[0] // 2 * dil[0], k[1] // 2 * dil[1]] * 2
        hw, sizes = self._window(k, stride, dil, pads)
        fan_in = self.c // groups * k[0] * k[1]
        w = g.f32(out_c, self.c // groups, k[0], k[1], scale=fan_in**-0.5)
        inputs = [self.x, w] + ([g.f32(out_c, scale=0.5)] if bias else [])
        attrs = dict(kernel_shape=list(k), strides=list(stride))
        if dil != (1, 1) or rng.random() < 0.2:
            attrs["dilations"] = list(dil)
        if groups != 1 or rng.random() < 0.2:
            attrs["group"] = groups
        if auto_pad is not None:
            attrs["auto_pad"] = auto_pad
        elif any(pads) or rng.random() < 0.3:
            attrs["pads"] = pads
        self.x = g.node("Conv", inputs, **attrs)
        self.c, self.hw, self.hw_sizes = out_c, hw, sizes
        self.notes.append(
            f"conv {k[0]}x{k[1]}/{stride[0]}x{stride[1]} d{dil[0]} g{groups} -> {out_c}"
            + (f" {auto_pad}" if auto_pad else f" pads {pads}")
        )
        return self

    def batch_norm(self):
        g, c = self.g, self.c
        scale, shift = g.f32(c), g.f32(c, scale=0.3)
        mean = g.f32(c, scale=0.3)
        var = g.const((g.rng.random(c) + 0.5).astype("float32"), "v")
        eps = float(g.rng.choice([1e-5, 1e-3]))
        self.x = g.node("BatchNormalization", [self.x, scale, shift, mean, var], epsilon=eps)
        self.notes.append("bn")
        return self

    def act(self, kind: str | None = None):
        g = self.g
        kind = kind or str(g.rng.choice(["Relu", "Relu", "Clip", "LeakyRelu", "Sigmoid", "none"]))
        if kind == "Clip":
            lo = g.const(np.array(0.0, "float32"))
            hi = g.const(np.array(6.0, "float32"))
            self.x = g.node("Clip", [self.x, lo, hi])
        elif kind == "LeakyRelu":
            self.x = g.node("LeakyRelu", [self.x], alpha=0.1)
        elif kind != "none":
            self.x = g.node(kind, [self.x])
        if kind != "none":
            self.notes.append(kind.lower())
        return self

    def pool(self):
        g, rng = self.g, self.g.rng
        op = str(rng.choice(["MaxPool", "AveragePool"]))
        k = int(rng.choice([2, 3, 3]))
        s = int(rng.choice([1, 2, 2]))
        p = int(rng.integers(0, k // 2 + 1))
        pads = [p, p, p, p] if rng.random() < 0.8 else [0, p, p, 0]
        ceil = bool(rng.random() < 0.3)
        if ceil and any(pads):
            # ONNX: a window that would start in the end padding is dropped (ORT agrees)
            raise InvalidCase("ceil_mode with padding: left to the node tests")
        hw, sizes = self._window((k, k), (s, s), (1, 1), pads, ceil)
        attrs = dict(kernel_shape=[k, k], strides=[s, s], pads=pads)
        if ceil:
            attrs["ceil_mode"] = 1
        if op == "AveragePool" and any(pads):
            attrs["count_include_pad"] = int(rng.integers(2))
        self.x = g.node(op, [self.x], **attrs)
        self.hw, self.hw_sizes = hw, sizes
        self.notes.append(f"{op} {k}/{s} pads {pads}" + (" ceil" if ceil else ""))
        return self


def _channels(net: _Net, rng) -> int:
    return int(rng.choice(BIG_OUT_CHANNELS if net.big else OUT_CHANNELS))


def _conv_block(net: _Net, rng) -> None:
    k = [(1, 1), (1, 1), (3, 3), (3, 3), (3, 3), (5, 5), (7, 7), (1, 3), (3, 1), (1, 7), (7, 1)]
    kh, kw = k[int(rng.integers(len(k)))]
    stride = int(rng.choice([1, 1, 1, 2, 2, 3]))
    dil = int(rng.choice([1, 1, 1, 1, 2])) if max(kh, kw) > 1 else 1
    how = int(rng.integers(5))
    auto = None
    pads = None
    if how == 1:
        pads = [0, 0, 0, 0]
    elif how == 2:
        pads = [
            int(rng.integers(0, kh)),
            int(rng.integers(0, kw)),
            int(rng.integers(0, kh)),
            int(rng.integers(0, kw)),
        ]
    elif how == 3:
        auto = str(rng.choice(["SAME_UPPER", "SAME_LOWER", "VALID"]))
    net.conv(
        _channels(net, rng),
        (kh, kw),
        (stride, stride),
        (dil, dil),
        pads,
        bias=bool(rng.random() < 0.7),
        auto_pad=auto,
    )
    if rng.random() < 0.4:
        net.batch_norm()
    net.act()


def _block(net: _Net, kind: str, rng) -> None:
    g = net.g
    if kind == "conv":
        _conv_block(net, rng)
    elif kind == "depthwise":
        k = int(rng.choice([3, 3, 5]))
        stride = int(rng.choice([1, 2]))
        net.conv(
            net.c * int(rng.choice([1, 1, 2])),
            (k, k),
            (stride, stride),
            groups=net.c,
            bias=bool(rng.random() < 0.5),
        )
        if rng.random() < 0.5:
            net.batch_norm()
        net.act()
    elif kind == "grouped":
        groups = [d for d in (2, 3, 4, 8) if net.c % d == 0]
        if not groups:
            raise InvalidCase("no group divides the channels")
        gr = int(rng.choice(groups))
        out_c = gr * int(rng.choice([1, 2, 3, 4, 8]))
        k = int(rng.choice([1, 3]))
        net.conv(out_c, (k, k), groups=gr, bias=bool(rng.random() < 0.5))
        net.act()
    elif kind == "pool":
        net.pool()
    elif kind == "residual":
        x, c, hw, sizes = net.x, net.c, net.hw, net.hw_sizes
        stride = 2 if rng.random() < 0.3 else 1
        k = int(rng.choice([1, 3]))
        net.conv(c if stride == 1 else 2 * c, (k, k), (stride, stride), bias=True).act("Relu")
        y, y_c, y_hw, y_sizes = net.x, net.c, net.hw, net.hw_sizes
        if stride == 1:
            shortcut = x
        else:  # the strided 1x1 shortcut of ResNet's downsampling block
            net.x, net.c, net.hw, net.hw_sizes = x, c, hw, sizes
            net.conv(y_c, (1, 1), (2, 2), pads=[0, 0, 0, 0], bias=True)
            if (net.hw_sizes != y_sizes) or net.hw != y_hw:
                raise InvalidCase("the shortcut's image differs")
            shortcut = net.x
        net.x = g.node("Add", [y, shortcut] if rng.random() < 0.7 else [shortcut, y])
        net.c, net.hw, net.hw_sizes = y_c, y_hw, y_sizes
        net.act("Relu")
        net.notes.append("residual")
    elif kind == "inception":
        x, c, hw, sizes = net.x, net.c, net.hw, net.hw_sizes
        outs, chans = [], 0
        for branch in rng.permutation(["1x1", "3x3", "pool"])[: int(rng.integers(2, 4))]:
            net.x, net.c, net.hw, net.hw_sizes = x, c, hw, sizes
            if branch == "pool":
                net.x = g.node(
                    "MaxPool", [x], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1]
                )
            k = 3 if branch == "3x3" else 1
            net.conv(int(rng.choice(OUT_CHANNELS[:9])), (k, k), bias=True).act("Relu")
            outs.append(net.x)
            chans += net.c
        net.x = g.node("Concat", outs, axis=1)
        net.c = chans
        net.notes.append(f"inception of {len(outs)}")
    elif kind == "shuffle":
        groups = [d for d in (2, 3, 4) if net.c % d == 0 and net.c > d]
        if not groups:
            raise InvalidCase("no shuffle of these channels")
        if None not in net.hw:
            h, w = net.hw
        elif net.hw.count(None) == 1:  # the symbolic one is Reshape's -1
            h, w = (d if d is not None else -1 for d in net.hw)
        else:
            raise InvalidCase("a shuffle of two symbolic dims")
        gr = int(rng.choice(groups))
        # batch 0: copied from the input (allowzero = 0), at the same index in both
        y = g.node("Reshape", [net.x, g.i64(0, gr, net.c // gr, h, w)])
        y = g.node("Transpose", [y], perm=[0, 2, 1, 3, 4])
        net.x = g.node("Reshape", [y, g.i64(0, net.c, h, w)])
        net.notes.append(f"shuffle {gr}")


def _convnets(rng):
    g = _Graph(rng)
    if rng.random() < 0.5:
        batch, batch_sizes = "n", [int(v) for v in rng.choice([1, 2, 3], 2, replace=False)]
    else:
        batch = int(rng.choice([1, 1, 2, 3]))
        batch_sizes = [batch, batch]
    big = rng.random() < 0.25
    c = int(rng.choice(BIG_IN_CHANNELS if big else IN_CHANNELS))
    hw, hw_sizes = [], []
    for _ in ("h", "w"):
        if big:
            size = int(rng.choice(BIG_IMAGE))
            hw.append(size)
            hw_sizes.append([size, size])
        elif rng.random() < 0.12:
            a, b = (int(v) for v in rng.choice([5, 7, 8, 9, 13, 16], 2, replace=False))
            hw.append(None)
            hw_sizes.append([a, b])
        else:
            size = int(rng.choice(IMAGE))
            hw.append(size)
            hw_sizes.append([size, size])
    if rng.random() < 0.6 and None not in hw:
        hw[1] = hw[0]
        hw_sizes[1] = list(hw_sizes[0])
    dims = [batch, c] + [d if d is not None else n for d, n in zip(hw, ("h", "w"), strict=True)]
    x = g.input("x", dims)
    feeds = [{x: _randn(rng, (batch_sizes[i], c, hw_sizes[0][i], hw_sizes[1][i]))} for i in (0, 1)]
    net = _Net(g, x, c, hw, hw_sizes)
    net.big = big
    for _ in range(int(rng.integers(1, 5 if not big else 3))):
        _block(net, str(rng.choice(BLOCKS)), rng)
    head = rng.random()
    if head < 0.35:
        pool = "GlobalAveragePool" if rng.random() < 0.7 else "GlobalMaxPool"
        y = g.node("Flatten", [g.node(pool, [net.x])], axis=1)
        classes = int(rng.choice([1, 7, 10, 100]))
        y = g.node("Gemm", [y, g.f32(classes, net.c, scale=net.c**-0.5), g.f32(classes)], transB=1)
        if rng.random() < 0.5:
            y = g.node("Softmax", [y], axis=-1)
        g.output(y)
        net.notes.append(f"{pool} head of {classes}")
    else:
        g.output(net.x)
    size = "zoo-sized, " if big else ""
    return g.model(), feeds, f"{size}{c}ch {hw_sizes} b{batch_sizes}: " + ", ".join(net.notes)
