"""ONNX's ``Attention`` (opset 23 on; torch.onnx writes it for ``scaled_dot_product_attention``)
imported as the chain :class:`~tvm_fusion.transform.fuse_attention.FuseAttention` fuses.

Stock apache-tvm 0.27 converts ``Attention`` with its ``com.microsoft`` converter and refused
every opset-23 model ("'num_heads'"). ONNX defines the operator by a function body, which
:mod:`.onnx_functions` inlines, but that body (shape arithmetic for the GQA interleave, the scale
as ``sqrt(scale)`` on Q and on K^T, a bias built by ``ConstantOfShape``) is not the chain the
fusion pass reads. The common form is converted here instead, as the opset-18 exporters write
it: ``softmax(matmul(Q, K^T) * scale (+ mask | where(cond, ., -inf))) V``:

- Q, K, V float32, all 4-D ``(B, H, S, D)`` or all 3-D ``(B, S, H * D)`` with
  ``q_num_heads`` / ``kv_num_heads`` (heads split and moved by reshape + transpose); static
  head counts and head sizes, ``B``, ``S``, ``N`` static or symbolic; grouped heads (GQA / MQA:
  ``Hq`` a multiple of ``Hkv``) repeat each K / V head ``Hq / Hkv`` times, as ONNX's body;
- ``scale`` or ``1 / sqrt(D)``; ``is_causal``: query ``i`` sees key ``j <= i`` (the offset is 0
  without a past), from ``arange`` comparisons;
- ``attn_mask`` boolean (``True`` attends) or float (added), broadcastable to ``(B, Hq, S, N)``
  with a last dim of ``N`` or 1; a row every key of which is masked gives zeros (ONNX's body
  and torch's SDPA guard), not NaN.

Everything else (past key / value and the present outputs, ``nonpad_kv_seqlen``, softcap,
``qk_matmul_output``, a ``softmax_precision`` other than float, sliding windows, other dtypes,
a mask shorter than the keys) is left to the function body: :func:`native` tells
:mod:`.onnx_functions` which nodes are not to be expanded.
"""

from __future__ import annotations

import math

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _frontend

from ..errors import ModelError
from .onnx_fixes import _node
from .onnx_known_shapes import tensor_dims

_KNOWN_ATTRS = {
    "is_causal",
    "kv_num_heads",
    "q_num_heads",
    "qk_matmul_output_mode",
    "scale",
    "softcap",
    "softmax_precision",
    "left_window_size",
    "right_window_size",
}
_FLOAT, _BOOL = 1, 9


def native(node, types: dict, opset: int) -> bool:
    """Whether :class:`Attention` converts ``node`` (see the module docstring)."""
    import onnx

    if opset < 23:
        return False
    names = list(node.input) + [""] * (7 - len(node.input))
    if any(names[4:]) or any(node.output[1:]) or not all(names[:3]):
        return False
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if set(attrs) - _KNOWN_ATTRS:
        return False
    if attrs.get("softcap", 0.0) != 0.0 or attrs.get("softmax_precision", _FLOAT) != _FLOAT:
        return False
    if attrs.get("left_window_size", -1) != -1 or attrs.get("right_window_size", -1) != -1:
        return False
    if attrs.get("is_causal", 0) not in (0, 1):
        return False
    typed = [types.get(n) for n in names[:3]]
    if any(t is None or t.tensor_type.elem_type != _FLOAT for t in typed):
        return False
    q, k, v = (tensor_dims(t) for t in typed)
    if q is None or k is None or v is None or not len(q) == len(k) == len(v) in (3, 4):
        return False
    if len(q) == 3:
        hq, hkv = attrs.get("q_num_heads", 0), attrs.get("kv_num_heads", 0)
        sizes = [q[2], k[2], v[2]]
        if hq <= 0 or hkv <= 0 or not all(isinstance(s, int) and s > 0 for s in sizes):
            return False
        if q[2] % hq or k[2] % hkv or v[2] % hkv or q[2] // hq != k[2] // hkv:
            return False
        kv_len = k[1]
    else:
        hq, hkv = q[1], k[1]
        sizes = [hq, hkv, v[1], q[3], k[3], v[3]]
        if not all(isinstance(s, int) and s > 0 for s in sizes) or v[1] != hkv or q[3] != k[3]:
            return False
        kv_len = k[2]
    if hq % hkv:
        return False
    if names[3]:
        mask = types.get(names[3])
        dims = tensor_dims(mask)
        if dims is None or mask.tensor_type.elem_type not in (_FLOAT, _BOOL) or len(dims) > 4:
            return False
        if not dims or (dims[-1] != 1 and (dims[-1] is None or dims[-1] != kv_len)):
            return False
    return True


def _heads(bb, x, heads: int, three_d: bool):
    """``x`` as ``(B, H, L, D)``: a 3-D ``(B, L, H * D)`` split and transposed."""
    if not three_d:
        return x
    b, length, hidden = x.ty.shape.values
    split = bb.normalize(relax.op.reshape(x, (b, length, heads, int(hidden) // heads)))
    return bb.normalize(relax.op.permute_dims(split, [0, 2, 1, 3]))


class Attention(_frontend.OnnxOpConverter):
    """ONNX's ``Attention`` in the form :func:`native` accepts (see the module docstring)."""

    @classmethod
    def _impl_v23(cls, bb, inputs, attr, params):
        inputs = list(inputs) + [None] * (7 - len(inputs))
        if any(x is not None for x in inputs[4:]):
            where = _node("Attention", attr)
            raise ModelError(f"{where}: past key / value or nonpad_kv_seqlen")
        q, k, v = (bb.normalize(x) for x in inputs[:3])
        three_d = q.ty.ndim == 3
        hq = int(attr.get("q_num_heads", 0)) if three_d else int(q.ty.shape.values[1])
        hkv = int(attr.get("kv_num_heads", 0)) if three_d else int(k.ty.shape.values[1])
        q = _heads(bb, q, hq, three_d)
        k, v = _heads(bb, k, hkv, three_d), _heads(bb, v, hkv, three_d)
        if hq != hkv:
            k = bb.normalize(relax.op.repeat(k, hq // hkv, axis=1))
            v = bb.normalize(relax.op.repeat(v, hq // hkv, axis=1))
        head_size = int(q.ty.shape.values[3])
        scale = float(attr.get("scale", 1.0 / math.sqrt(head_size)))
        kt = bb.normalize(relax.op.permute_dims(k, [0, 1, 3, 2]))
        scores = bb.normalize(relax.op.matmul(q, kt))
        scores = bb.normalize(relax.op.multiply(scores, relax.const(scale, "float32")))
        seq, total = scores.ty.shape.values[2], scores.ty.shape.values[3]
        cond = None
        if int(attr.get("is_causal", 0)):
            rows = relax.op.expand_dims(relax.op.arange(0, seq, 1, "int64"), 1)
            cols = relax.op.expand_dims(relax.op.arange(0, total, 1, "int64"), 0)
            cond = bb.normalize(relax.op.less_equal(cols, rows))
        mask = bb.normalize(inputs[3]) if inputs[3] is not None else None
        neg_inf = relax.const(float("-inf"), "float32")
        if mask is not None and mask.ty.dtype == "bool":
            cond = mask if cond is None else bb.normalize(relax.op.logical_and(cond, mask))
            mask = None
        if mask is not None and cond is not None:
            mask = bb.normalize(relax.op.where(cond, mask, neg_inf))
            cond = None
        if mask is not None:
            x = bb.normalize(relax.op.add(scores, mask))
        elif cond is not None:
            x = bb.normalize(relax.op.where(cond, scores, neg_inf))
        else:
            x = scores
        probs = bb.normalize(relax.op.nn.softmax(x, axis=-1))
        if inputs[3] is not None:
            probs = _zero_masked_rows(bb, x, probs)
        out = bb.normalize(relax.op.matmul(probs, v))
        if not three_d:
            return out
        b, heads, length, dv = out.ty.shape.values
        moved = bb.normalize(relax.op.permute_dims(out, [0, 2, 1, 3]))
        return relax.op.reshape(moved, (b, length, heads * dv))


def _zero_masked_rows(bb, x, probs):
    """``probs`` with zeros where every element of ``x``'s row is -inf (torch's SDPA guard,
    the form FuseAttention reads)."""
    finite = relax.op.logical_not(relax.op.equal(x, relax.const(float("-inf"), "float32")))
    seen = relax.op.max(relax.op.astype(finite, "int8"), axis=[-1], keepdims=True)
    empty = bb.normalize(relax.op.logical_not(relax.op.astype(seen, "bool")))
    return relax.op.where(empty, relax.op.full_like(probs, relax.const(0.0, "float32")), probs)
