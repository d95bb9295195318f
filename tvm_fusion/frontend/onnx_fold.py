"""ONNX model rewrite before import: constant folding of the small index and shape arithmetic
exporters write out node by node (:func:`fold_constants`), evaluated by ONNX's reference
implementation, and of ``Shape`` nodes whose selected dims ONNX shape inference knows.
``load_onnx`` runs it after the user's ``shapes`` are written into the graph inputs (a dim the
user makes symbolic is not folded as the model's static one).
"""

from __future__ import annotations

import contextlib
import logging
import warnings

from ..errors import first_line

logger = logging.getLogger(__name__)


# Operators that fold_constants evaluates when every input is a constant: the index and shape
# arithmetic exporters write out node by node (TorchScript's F.pad builds its pads from
# ConstantOfShape / Concat / Slice / Transpose), which TVM's importer keeps as Relax ops and
# then cannot use where it needs a constant ("Dynamic pads are not supported yet").
FOLDABLE = frozenset(
    "Abs Add Cast Concat ConstantOfShape Div Equal Expand Flatten Gather Greater Identity Less "
    "Max Min Mod Mul Neg Not OneHot Range ReduceProd ReduceSum Reshape Shape Size Slice Squeeze "
    "Sub Tile Transpose Unsqueeze Where".split()
)
FOLD_MAX_ELEMENTS = 4096  # shapes, pads, indices: never a weight
# Operators that only select or move the elements of their first input (every input for
# Concat): a ``Shape`` whose static dims ONNX shape inference knows flows through them with -1
# for each dynamic dim, and folds once no -1 is left (the TorchScript export of transformers'
# ``repeat_interleave(top_k)``: ``Shape(topk indices)[-1]`` is k, static, behind a dynamic
# token dim; the ``OneHot`` / ``Tile`` repeats it computes then fold, and ``Tile`` keeps its
# static dims instead of stock's ``dyn_tile`` to fresh ``tile_dim`` vars).
_SELECTING = frozenset("Concat Gather Identity Slice Squeeze Unsqueeze".split())


def _static_dims(model) -> dict:
    """Value name -> its dims (an int, or -1 where dynamic) from ONNX shape inference."""
    import onnx

    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception as err:  # noqa: BLE001 - no partial shapes, nothing else changes
        logger.debug("fold_constants: no shape inference: %s", first_line(err))
        return {}
    dims = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        tensor = info.type.tensor_type
        if tensor.HasField("shape"):
            dims[info.name] = [
                d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim
            ]
    return dims


def _partial_shape(node, dims: dict):
    """The output of a ``Shape`` node with -1 for each dynamic dim, or None."""
    import numpy as np

    shape = dims.get(node.input[0])
    if shape is None:
        return None
    attrs = {a.name: a.i for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return np.asarray(shape[start:end], dtype=np.int64)


def _evaluate(node, inputs: list, feeds: dict, opset: int) -> list:
    """``node`` alone evaluated by ONNX's reference implementation on ``feeds``."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    single = onnx.helper.make_model(
        onnx.helper.make_graph(
            [node],
            "fold",
            [onnx.helper.make_tensor_value_info(i, 0, None) for i in inputs],
            [onnx.helper.make_tensor_value_info(o, 0, None) for o in node.output],
        ),
        opset_imports=[onnx.helper.make_opsetid("", opset)],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ReferenceEvaluator(single).run(None, feeds)


def fold_constants(model, max_elements: int = FOLD_MAX_ELEMENTS):
    """``model`` with every :data:`FOLDABLE` node whose inputs are all constants (initializers,
    ``Constant`` nodes or folded outputs) and whose outputs are small replaced by initializers,
    and the number of nodes folded. Evaluated by ONNX's reference implementation; a node it
    cannot evaluate stays. The top graph only (subgraphs keep their nodes). A ``Shape`` of a
    tensor with some static dims (ONNX shape inference) folds where only those are selected
    (:data:`_SELECTING`), one whose selected dims are all static folds at once."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    graph = model.graph
    values: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            with contextlib.suppress(Exception):
                values[node.output[0]] = numpy_helper.to_array(
                    onnx.helper.get_attribute_value(node.attribute[0])
                )
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 18)
    graph_outputs = {o.name for o in graph.output}
    keep, folded = [], {}
    dims = None  # ONNX shape inference, run once a Shape of a non-constant is met
    partial: dict[str, np.ndarray] = {}  # Shape outputs and their selections, -1 if dynamic
    for node in graph.node:
        inputs = [i for i in node.input if i]
        if node.op_type == "Shape" and inputs and inputs[0] not in values:
            dims = _static_dims(model) if dims is None else dims
            shape = _partial_shape(node, dims)
            if shape is not None and -1 not in shape and node.output[0] not in graph_outputs:
                values[node.output[0]] = folded[node.output[0]] = shape
                continue
            if shape is not None:
                partial[node.output[0]] = shape
            keep.append(node)
            continue
        selected = inputs if node.op_type == "Concat" else inputs[:1]
        if (
            node.op_type in _SELECTING
            and node.domain in ("", "ai.onnx")
            and any(i in partial for i in selected)
            and all(i in values or (i in partial and i in selected) for i in inputs)
        ):
            feeds = {i: values[i] if i in values else partial[i] for i in inputs}
            try:
                result = np.asarray(_evaluate(node, inputs, feeds, opset)[0])
            except Exception as err:  # noqa: BLE001 - the importer gets the node as it is
                logger.debug("fold_constants: left %s: %s", node.op_type, first_line(err))
                keep.append(node)
                continue
            if (result == -1).any():
                partial[node.output[0]] = result
                keep.append(node)
            else:
                values[node.output[0]] = folded[node.output[0]] = result
            continue
        if (
            node.op_type not in FOLDABLE
            or node.domain not in ("", "ai.onnx")
            or not inputs
            or not all(i in values for i in inputs)
            or any(o in graph_outputs for o in node.output)
            or any(values[i].size > max_elements for i in inputs)
        ):
            keep.append(node)
            continue
        try:
            results = _evaluate(node, inputs, {i: values[i] for i in inputs}, opset)
        except Exception as err:  # the importer gets the node as it is
            logger.debug("fold_constants: left %s: %s", node.op_type, first_line(err))
            keep.append(node)
            continue
        if any(np.asarray(r).size > max_elements for r in results):
            keep.append(node)
            continue
        for name, result in zip(node.output, results, strict=True):
            values[name] = folded[name] = np.asarray(result)
    if not folded:
        return model, 0
    used = {i for n in keep for i in n.input} | graph_outputs
    for n in keep:
        for attr in n.attribute:
            if attr.g is not None:
                used |= {i for sub in attr.g.node for i in sub.input}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(keep)
    out.graph.initializer.extend(
        numpy_helper.from_array(array, name) for name, array in folded.items() if name in used
    )
    return out, len(graph.node) - len(keep)
