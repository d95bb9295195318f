"""ONNX model rewrites before import: a no-op ``Cast(to=INT64)`` in front of the operands the
importer refuses as a shape value.

TVM's ONNX importer keeps a value computed from ``Shape`` as a shape, and refuses one at most
operands before any converter runs ("Node X cannot handle ShapeExpr inputs": only Reshape,
Expand, Concat, Slice and a few others take a shape value). ``load_onnx`` calls
:func:`cast_shape_operands` before the import (the operands in :data:`SHAPE_OPERANDS`: Tile's
repeats) and :func:`cast_operands_of` for a node the importer refused; the value then arrives as
the int64 tensor every converter takes, and PlaceShapeOnHost evaluates it symbolically again.
The converters that read such a tensor back as a shape are in :mod:`.onnx_ops`. Models the
importer takes as they are are never changed; the top graph only.
"""

from __future__ import annotations

# Operands the importer refuses as a shape value ("Node ... cannot handle ShapeExpr inputs":
# its loop lets only Reshape, Expand, Concat, Slice and a few others take one): op -> the input
# positions that carry shape numbers.
SHAPE_OPERANDS = {"Tile": (1,)}


# ops whose int64 output carries the numbers of a shape when an input does (ONNX gives these
# ops one element type for their data inputs, so a value derived from ``Shape`` through them
# is int64 and a ``Cast(to=INT64)`` of it changes nothing)
_SHAPE_CARRIERS = {
    "Gather": (0,),
    "Slice": (0,),
    "Squeeze": (0,),
    "Unsqueeze": (0,),
    "Reshape": (0,),
    "Expand": (0,),
    "Concat": None,  # any input
    "Add": None,
    "Sub": None,
    "Mul": None,
    "Div": None,
    "Mod": None,
    "Neg": None,
    "Abs": None,
    "Min": None,
    "Max": None,
}


def shape_derived(graph) -> set[str]:
    """Names of the values of ``graph`` computed from a ``Shape`` through
    :data:`_SHAPE_CARRIERS` (int64 by the ops' typing rules)."""
    derived: set[str] = set()
    for node in graph.node:  # ONNX graphs are topologically sorted
        if node.op_type == "Shape":
            derived.update(o for o in node.output if o)
            continue
        positions = _SHAPE_CARRIERS.get(node.op_type, ())
        inputs = node.input if positions is None else [node.input[p] for p in positions]
        if node.domain in ("", "ai.onnx") and any(i in derived for i in inputs if i):
            derived.update(o for o in node.output if o)
    return derived


def cast_operands_of(model, node_name: str):
    """``model`` with a ``Cast(to=INT64)`` in front of every input of the node named
    ``node_name`` that is computed from a ``Shape`` (:func:`shape_derived`), and the number
    inserted. ``load_onnx`` calls it when the importer refused that node ("Node X cannot handle
    ShapeExpr inputs": only Reshape, Expand, Concat, Slice and a few others take a shape
    value): the value then arrives as the int64 tensor every converter takes, and
    PlaceShapeOnHost evaluates it symbolically again. Models the importer takes as they are
    are never changed. The top graph only."""

    graph = model.graph
    targets = [n for n in graph.node if n.name == node_name]
    if len(targets) != 1 or not node_name:
        return model, 0
    derived = shape_derived(graph)
    if not any(i in derived for i in targets[0].input):
        return model, 0
    return _with_casts(
        model,
        lambda n: [p for p, i in enumerate(n.input) if i in derived] if n.name == node_name else (),
    )


def _with_casts(model, positions):
    """A copy of ``model`` with a ``Cast(to=INT64)`` in front of the inputs ``positions(node)``
    names for each node of its top graph, and the number inserted; each cast's output gets a
    name no value of the graph has."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    used = {i.name for i in out.graph.input} | {i.name for i in out.graph.initializer}
    used |= {o for n in out.graph.node for o in n.output}
    nodes, count = [], 0
    for node in out.graph.node:
        for pos in positions(node) if node.domain in ("", "ai.onnx") else ():
            name = node.input[pos]
            cast = f"{name}__as_int64"
            while cast in used:
                cast = f"{name}__as_int64_{count}_{len(used)}"
            used.add(cast)
            nodes.append(
                onnx.helper.make_node(
                    "Cast", [name], [cast], name=f"{cast}__cast", to=onnx.TensorProto.INT64
                )
            )
            node.input[pos] = cast
            count += 1
        nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out, count


def cast_shape_operands(model):
    """``model`` with a ``Cast(to=INT64)`` (a no-op on int64) in front of every
    :data:`SHAPE_OPERANDS` input that is not a constant, and the number inserted. A shape
    value reaching such an operand (DeBERTa's ``repeat(batch * heads // heads, 1, 1)``: a
    Concat of a ``Shape`` with constants, which the importer keeps as a shape) then arrives as
    the int64 tensor the converter takes (stock's Cast makes ``shape_to_tensor`` of it), and
    PlaceShapeOnHost evaluates it symbolically again. The top graph only."""

    graph = model.graph
    constants = {i.name for i in graph.initializer}
    constants |= {n.output[0] for n in graph.node if n.op_type == "Constant" and n.output}
    if not any(
        n.op_type in SHAPE_OPERANDS
        and any(
            p < len(n.input) and n.input[p] and n.input[p] not in constants
            for p in SHAPE_OPERANDS[n.op_type]
        )
        for n in graph.node
    ):
        return model, 0

    def positions(node):
        wanted = SHAPE_OPERANDS.get(node.op_type, ())
        return [p for p in wanted if p < len(node.input) and node.input[p] not in constants | {""}]

    return _with_casts(model, positions)
