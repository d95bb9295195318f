"""ONNX model rewrites before import: operators TVM's importer lacks (or converts as another
operator) replaced by ONNX's own function bodies, and ``Constant`` nodes in every form ONNX
allows.

Many ONNX operators are defined by a function of simpler ones (``onnx.defs``: ``Swish``,
``CenterCropPad``, the window functions, ``RotaryEmbedding``, opset 23's ``Attention`` ...),
some of them by a body built for the node at hand from its attributes and input types (a
"context-dependent" function). ONNX's backend tests run these bodies as the operator's
meaning (the ``*_expanded`` cases). :func:`expand_functions` inlines the body of each node
whose operator the importer has no converter for, or only a converter of another operator of
the same name: stock maps ``Attention`` to its ``com.microsoft`` converter, which reads a
``num_heads`` attribute opset 23's ``Attention`` does not have (and refused every such model
with ``'num_heads'``; torch.onnx writes ``Attention`` for ``scaled_dot_product_attention`` from
opset 23). The body is the one of the model's opset (``schema.function_opset_versions``); a
node whose body needs a newer opset, or whose input types shape inference cannot give, stays
and is refused by the importer as before.

:func:`normalize_constants` writes each ``Constant``'s ``value_float`` / ``value_floats`` /
``value_int`` / ``value_ints`` / ``sparse_value`` as the ``value`` tensor the importer reads
(it refused the others: "no value in Constant"; the function bodies above use them, and so can
any exporter). String constants stay (the importer refuses them as before).

Both rewrite the top graph only and leave a model without such nodes unchanged (the same
object is returned).
"""

from __future__ import annotations

import logging

from ..errors import first_line

logger = logging.getLogger(__name__)

# operators the importer converts as another operator of the same name (a contrib domain's):
# expanded even though a converter exists, unless ours takes the node (Attention's common
# form: onnx_attention.native)
WRONG_CONVERTER = frozenset({"Attention"})
_DEFAULT_DOMAINS = ("", "ai.onnx")
_MAX_ROUNDS = 4  # a body's own nodes may be functions again (bounded)


def _opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS), 0)


def normalize_constants(model):
    """``model`` with every ``Constant`` holding its value as a ``value`` tensor, and the
    number of nodes rewritten (see the module docstring)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    forms = {
        "value_float": lambda a: np.asarray(a.f, np.float32),
        "value_floats": lambda a: np.asarray(list(a.floats), np.float32),
        "value_int": lambda a: np.asarray(a.i, np.int64),
        "value_ints": lambda a: np.asarray(list(a.ints), np.int64),
        "sparse_value": lambda a: numpy_helper.to_array(a.sparse_tensor),
    }
    todo = [
        i
        for i, n in enumerate(model.graph.node)
        if n.op_type == "Constant"
        and n.domain in _DEFAULT_DOMAINS
        and len(n.attribute) == 1
        and n.attribute[0].name in forms
    ]
    if not todo:
        return model, 0
    model = _copy(model)
    for i in todo:
        node = model.graph.node[i]
        attr = node.attribute[0]
        try:
            array = forms[attr.name](attr)
        except Exception as err:  # noqa: BLE001 - the importer refuses the node as before
            logger.debug("normalize_constants: left %s: %s", node.name, first_line(err))
            continue
        tensor = numpy_helper.from_array(array)
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("value", tensor))
    return model, len(todo)


def expand_functions(model, known_ops) -> tuple[object, int]:
    """``model`` with each default-domain node whose op is not in ``known_ops`` (the
    importer's converters), or is in :data:`WRONG_CONVERTER`, replaced by the nodes of its ONNX
    function body; and the number of nodes expanded."""
    count = 0
    for _ in range(_MAX_ROUNDS):
        todo = [
            i
            for i, n in enumerate(model.graph.node)
            if n.domain in _DEFAULT_DOMAINS
            and (n.op_type not in known_ops or n.op_type in WRONG_CONVERTER)
        ]
        if not todo:
            break
        types = _value_types(model)
        opset = _opset(model)
        todo = [i for i in todo if not _converted_natively(model.graph.node[i], types, opset)]
        bodies = {}
        for i in todo:
            body = _body(model.graph.node[i], opset, types, f"_fn{count + len(bodies)}_")
            if body is not None:
                bodies[i] = body
        if not bodies:
            break
        if count == 0:
            model = _copy(model)
        nodes = []
        for i, node in enumerate(model.graph.node):
            nodes.extend(bodies.get(i, [node]))
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        count += len(bodies)
    if count:
        model, _ = normalize_constants(model)
    return model, count


def _converted_natively(node, types: dict, opset: int) -> bool:
    """Whether our converter of a :data:`WRONG_CONVERTER` op takes ``node`` as it is."""
    if node.op_type == "Attention":
        from .onnx_attention import native

        return native(node, types, opset)
    return False


def _copy(model):
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _value_types(model) -> dict:
    """Value name -> its TypeProto, from ONNX shape inference (empty if it fails)."""
    import onnx

    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception as err:  # noqa: BLE001 - nothing is expanded without types
        logger.debug("expand_functions: no shape inference: %s", first_line(err))
        graph = model.graph
    types = {i.name: i.type for i in [*graph.input, *graph.value_info, *graph.output]}
    for init in graph.initializer:
        types[init.name] = onnx.helper.make_tensor_type_proto(init.data_type, list(init.dims))
    return types


def _function(node, opset: int, types: dict):
    """The FunctionProto of ``node``'s op at ``opset`` (with the schema's default attributes
    added to ``node``), or None."""
    import onnx

    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except Exception:  # noqa: BLE001 - not an ONNX operator at this opset
        return None
    plain = [v for v in schema.function_opset_versions if v <= opset]
    dependent = [v for v in schema.context_dependent_function_opset_versions if v <= opset]
    given = {a.name for a in node.attribute}
    for name, attr in schema.attributes.items():
        if name not in given and attr.default_value.name:
            node.attribute.append(attr.default_value)
    function = onnx.FunctionProto()
    try:
        if plain and (not dependent or max(plain) >= max(dependent)):
            function.ParseFromString(schema.get_function_with_opset_version(max(plain)))
        elif dependent:
            if any(i and i not in types for i in node.input):
                return None
            in_types = [
                (types[i] if i else onnx.TypeProto()).SerializeToString() for i in node.input
            ]
            data = schema.get_context_dependent_function_with_opset_version(
                max(dependent), node.SerializeToString(), in_types
            )
            function.ParseFromString(data)
        else:
            return None
    except Exception as err:  # noqa: BLE001 - the importer refuses the node as before
        logger.debug("expand_functions: no body for %s: %s", node.op_type, first_line(err))
        return None
    if not function.node or (_opset(function) or opset) > opset:
        return None
    return function


def _same_version(op: str, written: int, model: int) -> bool:
    """Whether ``op`` of opset ``written`` is the same operator version at ``model``."""
    import onnx

    try:
        return (
            onnx.defs.get_schema(op, written, "").since_version
            == onnx.defs.get_schema(op, model, "").since_version
        )
    except Exception:  # noqa: BLE001 - unknown op: not inlined
        return False


def _body(node, opset: int, types: dict, prefix: str):
    """The nodes that replace ``node`` (its function body, values renamed, attribute
    references resolved, at the model's opset), or None."""
    import onnx

    work = onnx.NodeProto()
    work.CopyFrom(node)
    function = _function(work, opset, types)
    if function is None:
        return None
    prefix = f"{node.name or node.op_type}{prefix}"
    names = {}
    for index, name in enumerate(function.input):
        names[name] = work.input[index] if index < len(work.input) else ""
    for index, name in enumerate(function.output):
        if index < len(work.output) and work.output[index]:
            names[name] = work.output[index]
    attrs = {a.name: a for a in work.attribute}

    def rename(name: str) -> str:
        if name in names:
            return names[name]
        return f"{prefix}{name}" if name else ""

    nodes = []
    for index, inner in enumerate(function.node):
        if inner.domain not in _DEFAULT_DOMAINS or any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
            for a in inner.attribute
        ):
            return None  # subgraphs and other domains: not inlined here
        new = onnx.NodeProto()
        new.CopyFrom(inner)
        del new.input[:], new.output[:], new.attribute[:]
        new.input.extend(rename(i) for i in inner.input)
        new.output.extend(rename(o) for o in inner.output)
        new.name = f"{prefix}{inner.name or inner.op_type}_{index}"
        for attr in inner.attribute:
            if attr.ref_attr_name:
                if attr.ref_attr_name not in attrs:
                    continue
                ref = onnx.AttributeProto()
                ref.CopyFrom(attrs[attr.ref_attr_name])
                ref.name = attr.name
                new.attribute.append(ref)
            else:
                new.attribute.append(attr)
        nodes.append(new)
    written = _opset(function) or opset
    if not all(_same_version(n.op_type, written, opset) for n in nodes):
        return _converted(nodes, written, opset, node, types, prefix)
    return nodes


def _converted(nodes, written: int, opset: int, node, types: dict, prefix: str):
    """The body ``nodes`` (attribute references resolved) brought from opset ``written`` to
    ``opset`` by ONNX's version converter (some of their ops changed in between: ReduceMean's
    axes became an input), values it adds prefixed; or None where it cannot."""
    import onnx
    from onnx import helper, version_converter

    inputs = [
        helper.make_value_info(i, types[i] if i in types else onnx.TypeProto())
        for i in dict.fromkeys(i for i in node.input if i)
    ]
    outputs = [helper.make_value_info(o, onnx.TypeProto()) for o in node.output if o]
    model = helper.make_model(
        helper.make_graph(nodes, "body", inputs, outputs),
        opset_imports=[helper.make_opsetid("", written)],
    )
    try:
        converted = version_converter.convert_version(model, opset).graph.node
    except Exception as err:  # noqa: BLE001 - the importer refuses the node as before
        logger.debug("expand_functions: %s's body not converted: %s", node.op_type, first_line(err))
        return None
    known = {v for n in nodes for v in [*n.input, *n.output]} | set(node.input)
    added = {o for n in converted for o in n.output if o not in known}
    result = []
    for index, new in enumerate(converted):
        for field in (new.input, new.output):
            field[:] = [f"{prefix}{v}" if v in added else v for v in field]
        new.name = f"{prefix}converted_{index}"
        result.append(new)
    return result
