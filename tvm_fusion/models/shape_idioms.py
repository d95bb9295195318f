"""Shape idioms as exporters write them (ONNX Runtime PR #19769): small ONNX models with
dynamic axes whose shape arithmetic runs on int64 tensors.

Each idiom mirrors what torch.onnx (TorchScript and dynamo exporters) emits for GPT-2/Llama style
attention and masks: ``Shape -> Gather -> Unsqueeze -> Concat -> Reshape`` for head splits,
``Range`` with a limit read from a shape, ``ConstantOfShape`` + ``Expand`` for masks, ``Slice``
with ends computed from a shape, shape tensors as graph inputs, ``Where`` on shape values.
``build(name, batch, seq)`` returns the model and matching inputs; the models are the corpus of
``PlaceShapeOnHost``'s tests, tutorial and benchmark (every one is checked against ONNX Runtime).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from ._build import onnx_input, onnx_model

HEADS, HEAD_DIM = 4, 8
HIDDEN = HEADS * HEAD_DIM


@dataclasses.dataclass
class Idiom:
    name: str
    summary: str
    model: object  # onnx.ModelProto
    inputs: dict[str, np.ndarray]
    # shape values that only exist at run time (computed from data): each costs one device
    # kernel (the data reduction) and one copy to the host, with or without PlaceShapeOnHost
    data_reads: int = 0


_BUILDERS: dict[str, tuple[str, Callable, int]] = {}


def _idiom(name: str, summary: str, data_reads: int = 0):
    def decorator(fn):
        _BUILDERS[name] = (summary, fn, data_reads)
        return fn

    return decorator


def names() -> list[str]:
    return list(_BUILDERS)


def build(name: str, batch: int = 2, seq: int = 5) -> Idiom:
    summary, fn, reads = _BUILDERS[name]
    nodes, inputs, outputs, inits, feed = fn(batch, seq, np.random.default_rng(19769))
    model = onnx_model(nodes, inputs, outputs, inits, name=name)
    return Idiom(name, summary, model, feed, reads)


def _x(batch, seq, gen, hidden=HIDDEN):
    return gen.standard_normal((batch, seq, hidden)).astype("float32")


def _i64(*values):
    return np.array(values, dtype="int64")


X = onnx_input("x", "float32", ["batch", "seq", HIDDEN])


def _node(op, inputs, outputs, **attrs):
    from onnx import helper

    return helper.make_node(op, inputs, outputs, **attrs)


def _output(name, shape):
    return onnx_input(name, "float32", shape)


@_idiom("split_heads", "GPT-2 split heads: Shape/Gather/Unsqueeze/Concat -> Reshape, Transpose")
def _split_heads(batch, seq, gen):
    nodes = [
        _node("Shape", ["x"], ["shp"]),
        _node("Gather", ["shp", "zero"], ["b"], axis=0),
        _node("Gather", ["shp", "one"], ["s"], axis=0),
        _node("Unsqueeze", ["b", "ax0"], ["b1"]),
        _node("Unsqueeze", ["s", "ax0"], ["s1"]),
        _node("Concat", ["b1", "s1", "tail"], ["target"], axis=0),
        _node("Reshape", ["x", "target"], ["xr"]),
        _node("Transpose", ["xr"], ["y"], perm=[0, 2, 1, 3]),
    ]
    inits = {
        "zero": np.array(0, "int64"),
        "one": np.array(1, "int64"),
        "ax0": _i64(0),
        "tail": _i64(HEADS, HEAD_DIM),
    }
    out = _output("y", ["batch", HEADS, "seq", HEAD_DIM])
    return nodes, [X], [out], inits, {"x": _x(batch, seq, gen)}


@_idiom("merge_heads", "merge heads: Reshape to (b, s, H*D) with H*D = Mul of two Gathers")
def _merge_heads(batch, seq, gen):
    xh = onnx_input("x", "float32", ["batch", HEADS, "seq", HEAD_DIM])
    nodes = [
        _node("Transpose", ["x"], ["xt"], perm=[0, 2, 1, 3]),
        _node("Shape", ["xt"], ["shp"]),
        _node("Gather", ["shp", "i0"], ["b"], axis=0),
        _node("Gather", ["shp", "i1"], ["s"], axis=0),
        _node("Gather", ["shp", "i2"], ["h"], axis=0),
        _node("Gather", ["shp", "i3"], ["d"], axis=0),
        _node("Mul", ["h", "d"], ["hd"]),
        _node("Concat", ["b", "s", "hd"], ["target"], axis=0),
        _node("Reshape", ["xt", "target"], ["y"]),
    ]
    inits = {"i0": _i64(0), "i1": _i64(1), "i2": _i64(2), "i3": _i64(3)}
    feed = {"x": gen.standard_normal((batch, HEADS, seq, HEAD_DIM)).astype("float32")}
    return nodes, [xh], [_output("y", ["batch", "seq", HIDDEN])], inits, feed


@_idiom("position_ids", "Range(0, seq) with seq read from the input's shape, added as positions")
def _position_ids(batch, seq, gen):
    nodes = [
        _node("Shape", ["x"], ["shp"]),
        _node("Gather", ["shp", "one"], ["s"], axis=0),  # scalar
        _node("Range", ["start", "s", "step"], ["pos"]),
        _node("Cast", ["pos"], ["posf"], to=1),
        _node("Unsqueeze", ["posf", "axes"], ["pos3"]),
        _node("Add", ["x", "pos3"], ["y"]),
    ]
    inits = {
        "one": np.array(1, "int64"),
        "start": np.array(0, "int64"),
        "step": np.array(1, "int64"),
        "axes": _i64(0, 2),
    }
    return nodes, [X], [_output("y", ["batch", "seq", HIDDEN])], inits, {"x": _x(batch, seq, gen)}


@_idiom("causal_mask", "ConstantOfShape((s, s)) + Trilu + Expand to (b, 1, s, s) for a mask")
def _causal_mask(batch, seq, gen):
    from onnx import TensorProto, helper

    scores = onnx_input("scores", "float32", ["batch", HEADS, "seq", "seq"])
    nodes = [
        _node("Shape", ["scores"], ["shp"]),
        _node("Gather", ["shp", "i2"], ["s"], axis=0),
        _node("Concat", ["s", "s"], ["ss"], axis=0),
        _node(
            "ConstantOfShape",
            ["ss"],
            ["ones"],
            value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]),
        ),
        _node("Trilu", ["ones"], ["tri"], upper=0),
        _node("Sub", ["tri", "one_f"], ["neg"]),
        _node("Mul", ["neg", "big"], ["mask"]),
        _node("Gather", ["shp", "i0"], ["b"], axis=0),
        _node("Concat", ["b", "one_i", "s", "s"], ["bmask"], axis=0),
        _node("Expand", ["mask", "bmask"], ["mask4"]),
        _node("Add", ["scores", "mask4"], ["y"]),
        _node("Softmax", ["y"], ["p"], axis=-1),
    ]
    inits = {
        "i0": _i64(0),
        "i2": _i64(2),
        "one_i": _i64(1),
        "one_f": np.array(1.0, "float32"),
        "big": np.array(1e4, "float32"),
    }
    feed = {"scores": gen.standard_normal((batch, HEADS, seq, seq)).astype("float32")}
    return nodes, [scores], [_output("p", ["batch", HEADS, "seq", "seq"])], inits, feed


@_idiom("chunk_slice", "chunk(2) as Slice with ends = Shape[-1] / 2 (computed at run time)")
def _chunk_slice(batch, seq, gen):
    nodes = [
        _node("Shape", ["x"], ["shp"]),
        _node("Gather", ["shp", "last"], ["h"], axis=0),
        _node("Div", ["h", "two"], ["half"]),
        _node("Slice", ["x", "zero", "half", "axes"], ["a"]),
        _node("Slice", ["x", "half", "h", "axes"], ["b"]),
        _node("Mul", ["a", "b"], ["y"]),
    ]
    inits = {"last": _i64(2), "two": _i64(2), "zero": _i64(0), "axes": _i64(2)}
    out = _output("y", ["batch", "seq", HIDDEN // 2])
    return nodes, [X], [out], inits, {"x": _x(batch, seq, gen)}


@_idiom("shape_input", "target shape as a graph input (dynamo-captured models): Reshape(x, t)")
def _shape_input(batch, seq, gen):
    target = onnx_input("target", "int64", [3])
    nodes = [_node("Reshape", ["x", "target"], ["xr"]), _node("Relu", ["xr"], ["y"])]
    feed = {"x": _x(batch, seq, gen), "target": _i64(batch * seq, HEADS, HEAD_DIM)}
    return nodes, [X, target], [_output("y", ["m", HEADS, HEAD_DIM])], {}, feed


@_idiom("where_dim", "Where(Equal(dim, 1), ...) on shape values, then Expand (the importer folds)")
def _where_dim(batch, seq, gen):
    bias = onnx_input("bias", "float32", [1, 1, HIDDEN])
    nodes = [
        _node("Shape", ["x"], ["xs"]),
        _node("Shape", ["bias"], ["bs"]),
        _node("Equal", ["bs", "ones"], ["is1"]),
        _node("Where", ["is1", "xs", "bs"], ["target"]),
        _node("Expand", ["bias", "target"], ["be"]),
        _node("Add", ["x", "be"], ["y"]),
    ]
    inits = {"ones": _i64(1, 1, 1)}
    feed = {"x": _x(batch, seq, gen), "bias": gen.standard_normal((1, 1, HIDDEN)).astype("f4")}
    return nodes, [X, bias], [_output("y", ["batch", "seq", HIDDEN])], inits, feed


@_idiom("flatten_tokens", "x.view(-1, x.size(-1)): Concat([-1], Shape[-1:]) -> Reshape, back")
def _flatten_tokens(batch, seq, gen):
    nodes = [
        _node("Shape", ["x"], ["shp"]),
        _node("Gather", ["shp", "last"], ["h"], axis=0),
        _node("Concat", ["minus1", "h"], ["target"], axis=0),
        _node("Reshape", ["x", "target"], ["flat"]),
        _node("Softmax", ["flat"], ["p"], axis=-1),
        _node("Reshape", ["p", "shp"], ["y"]),
    ]
    inits = {"last": _i64(-1), "minus1": _i64(-1)}
    return nodes, [X], [_output("y", ["batch", "seq", HIDDEN])], inits, {"x": _x(batch, seq, gen)}


@_idiom("size_mean", "Size(x) cast to float divides a sum: shape data feeding arithmetic")
def _size_mean(batch, seq, gen):
    nodes = [
        _node("Size", ["x"], ["n"]),
        _node("Cast", ["n"], ["nf"], to=1),
        _node("ReduceSum", ["x"], ["total"], keepdims=0),
        _node("Div", ["total", "nf"], ["mean"]),
        _node("Sub", ["x", "mean"], ["y"]),
    ]
    return nodes, [X], [_output("y", ["batch", "seq", HIDDEN])], {}, {"x": _x(batch, seq, gen)}


@_idiom("kv_cache_len", "past + current length: Add of two Gathers feeds Range and Expand")
def _kv_cache_len(batch, seq, gen):
    past = onnx_input("past", "float32", ["batch", "past_len", HIDDEN])
    nodes = [
        _node("Concat", ["past", "x"], ["kv"], axis=1),
        _node("Shape", ["past"], ["ps"]),
        _node("Shape", ["x"], ["xs"]),
        _node("Gather", ["ps", "one"], ["p"], axis=0),
        _node("Gather", ["xs", "one"], ["s"], axis=0),
        _node("Add", ["p", "s"], ["total"]),
        _node("Range", ["zero", "total", "step"], ["pos"]),
        _node("Cast", ["pos"], ["posf"], to=1),
        _node("Unsqueeze", ["posf", "axes"], ["pos3"]),
        _node("Add", ["kv", "pos3"], ["y"]),
    ]
    inits = {
        "one": np.array(1, "int64"),
        "zero": np.array(0, "int64"),
        "step": np.array(1, "int64"),
        "axes": _i64(0, 2),
    }
    feed = {
        "past": gen.standard_normal((batch, 3, HIDDEN)).astype("float32"),
        "x": _x(batch, seq, gen),
    }
    return nodes, [past, X], [_output("y", ["batch", "total", HIDDEN])], inits, feed


@_idiom("tile_batch", "Tile with repeats Concat(batch, 1, 1) from another input's shape")
def _tile_batch(batch, seq, gen):
    row = onnx_input("row", "float32", [1, "seq", HIDDEN])
    nodes = [
        _node("Shape", ["x"], ["xs"]),
        _node("Gather", ["xs", "zero"], ["b"], axis=0),
        _node("Concat", ["b", "ones"], ["reps"], axis=0),
        _node("Tile", ["row", "reps"], ["tiled"]),
        _node("Mul", ["x", "tiled"], ["y"]),
    ]
    inits = {"zero": _i64(0), "ones": _i64(1, 1)}
    feed = {"x": _x(batch, seq, gen), "row": gen.standard_normal((1, seq, HIDDEN)).astype("f4")}
    return nodes, [X, row], [_output("y", ["batch", "seq", HIDDEN])], inits, feed


@_idiom(
    "mask_trim",
    "x[:, :attention_mask.sum(-1).max()]: a Slice end computed from data (padding trim)",
    data_reads=1,
)
def _mask_trim(batch, seq, gen):
    mask = onnx_input("mask", "int64", ["batch", "seq"])
    nodes = [
        _node("ReduceSum", ["mask", "last"], ["lens"], keepdims=0),
        _node("ReduceMax", ["lens"], ["longest"], keepdims=1),
        _node("Slice", ["x", "zero", "longest", "one"], ["trimmed"]),
        _node("Relu", ["trimmed"], ["y"]),
    ]
    inits = {"last": _i64(-1), "zero": _i64(0), "one": _i64(1)}
    lengths = gen.integers(1, max(seq, 2), size=batch)  # every row shorter than seq: a cut
    lengths[0] = max(1, seq - 1)
    feed_mask = (np.arange(seq)[None, :] < lengths[:, None]).astype("int64")
    feed = {"x": _x(batch, seq, gen), "mask": feed_mask}
    return nodes, [X, mask], [_output("y", ["batch", "longest", HIDDEN])], inits, feed


def llama_block(hidden: int = 64, heads: int = 4, inter: int = 128, seed: int = 0):
    """A Llama-style decoder block (RMSNorm, rotary positions from ``arange(seq)``, causal mask
    built from the sequence length, attention with view/transpose, SwiGLU MLP) exported by
    torch.onnx's TorchScript exporter with dynamic batch and sequence: the shape code a real
    export emits. Needs torch; returns the ONNX model (``ModelProto``)."""
    import io

    import onnx
    import torch

    torch.manual_seed(seed)
    head_dim = hidden // heads

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
            self.o = torch.nn.Linear(hidden, hidden, bias=False)
            self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
            self.down = torch.nn.Linear(inter, hidden, bias=False)
            self.norm1 = torch.nn.Parameter(torch.ones(hidden))
            self.norm2 = torch.nn.Parameter(torch.ones(hidden))

        @staticmethod
        def rms(x, w):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.rms(x, self.norm1)).chunk(3, dim=-1)
            q, k, v = (t.view(b, s, heads, head_dim).transpose(1, 2) for t in (q, k, v))
            pos = torch.arange(s, dtype=torch.float32)
            inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
            ang = pos[:, None] * inv[None, :]
            cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)

            def rotate(t):
                t1, t2 = t[..., : head_dim // 2], t[..., head_dim // 2 :]
                return t * cos + torch.cat((-t2, t1), dim=-1) * sin

            q, k = rotate(q), rotate(k)
            scores = q @ k.transpose(-1, -2) / head_dim**0.5
            mask = torch.full((s, s), float("-inf")).triu(1)
            att = torch.softmax(scores + mask, dim=-1) @ v
            x = x + self.o(att.transpose(1, 2).reshape(b, s, hidden))
            gate, up = self.gate_up(self.rms(x, self.norm2)).chunk(2, dim=-1)
            return x + self.down(torch.nn.functional.silu(gate) * up)

    block = Block().eval()
    buf = io.BytesIO()
    example = torch.randn(2, 7, hidden)
    torch.onnx.export(
        block,
        (example,),
        buf,
        input_names=["x"],
        output_names=["y"],
        dynamic_axes={"x": {0: "batch", 1: "seq"}, "y": {0: "batch", 1: "seq"}},
        opset_version=17,
        dynamo=False,
    )
    return onnx.load_from_string(buf.getvalue())
