"""ONNX operators apache-tvm 0.27's importer lacks, added to its converter map by
:func:`install` (``load_onnx`` calls it).

- ``SoftmaxCrossEntropyLoss`` (opset 12/13): ``log_softmax(scores, axis=1)`` then
  ``nll_loss(log_prob, labels, weights, reduction, ignore_index)``; the optional second output
  is the log-probabilities (FuseCrossEntropy then leaves the graph alone, as it must).
- ``NegativeLogLikelihoodLoss`` (opset 12/13): ``nll_loss``.

Without ``ignore_index`` ONNX ignores nothing; ``nll_loss`` then gets -100, which no valid
label (``0 <= label < C``) equals. A float16/bfloat16 ``scores`` is kept in its dtype.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as _frontend

_NO_IGNORE = -100


def _attr_str(attr: dict, key: str, default: str) -> str:
    value = attr.get(key, default)
    return value.decode() if isinstance(value, bytes) else str(value)


def _nll(bb, log_prob, labels, weights, attr) -> relax.Expr:
    reduction = _attr_str(attr, "reduction", "mean")
    ignore = int(attr.get("ignore_index", _NO_IGNORE))
    if str(labels.ty.dtype) != "int64":
        labels = bb.normalize(relax.op.astype(labels, "int64"))
    return relax.op.nn.nll_loss(log_prob, labels, weights, reduction, ignore)


class SoftmaxCrossEntropyLoss(_frontend.OnnxOpConverter):
    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        scores, labels = inputs[0], inputs[1]
        weights = inputs[2] if len(inputs) > 2 else None
        log_prob = bb.normalize(relax.op.nn.log_softmax(scores, axis=1))
        loss = _nll(bb, log_prob, labels, weights, attr)
        if attr["tvm_custom"]["num_outputs"] > 1:
            return relax.Tuple([bb.normalize(loss), log_prob])
        return loss


class NegativeLogLikelihoodLoss(_frontend.OnnxOpConverter):
    @classmethod
    def _impl_v12(cls, bb, inputs, attr, params):
        weights = inputs[2] if len(inputs) > 2 else None
        return _nll(bb, inputs[0], inputs[1], weights, attr)


CONVERTERS = {
    "SoftmaxCrossEntropyLoss": SoftmaxCrossEntropyLoss,
    "NegativeLogLikelihoodLoss": NegativeLogLikelihoodLoss,
}

_INSTALLED = False


def install() -> None:
    """Add :data:`CONVERTERS` to the importer's map (idempotent; stock ones win)."""
    global _INSTALLED
    if _INSTALLED:
        return
    original = _frontend._get_convert_map

    def convert_map():
        table = dict(original())
        for name, converter in CONVERTERS.items():
            table.setdefault(name, converter)
        return table

    _frontend._get_convert_map = convert_map
    _INSTALLED = True
