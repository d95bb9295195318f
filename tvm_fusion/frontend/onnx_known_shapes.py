"""Known input shapes for the ONNX importer's converters, from shape inference.

:func:`onnx_input_shapes` runs ONNX Runtime's symbolic shape inference (ONNX's own where it
fails) and gives each node the shapes of its inputs; ``load_onnx`` (``prepare_import``) keeps
them in :data:`_SHAPES` around one import, and :data:`_DIM_VARS` names the symbolic dims seen so
far. :class:`KnownShapes` wraps every converter (``onnx_ops.install``) so that an input the
importer lost the shape of is ``match_cast`` to those dims first.
"""

from __future__ import annotations

import logging

from tvm import relax, tirx
from tvm.ir.expr import GenericConst
from tvm.relax.frontend.onnx import onnx_frontend as _frontend

logger = logging.getLogger(__name__)

# ONNX node name -> shape of each input (per dim an int, a symbolic expression as a string
# such as "batch*seq", or None; None for an input of unknown rank), from shape inference; set by
# ``frontend.prepare_import`` around one import.
_SHAPES: dict[str, list[list[int | str | None] | None]] = {}
# symbolic dim name -> the tirx.Var it stands for in this import
_DIM_VARS: dict[str, tirx.Var] = {}


def _infer(model):
    """ONNX Runtime's symbolic shape inference (sympy-based, the one ORT's transformer tools
    use: names dims through Reshape/Concat/Slice chains as expressions of the graph inputs'
    dims); ONNX's own shape inference where it fails. It takes opset 7 and later only (it
    returns None for older models, after a warning), so those go to ONNX's directly."""
    import onnx

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        if opset is not None and opset >= 7:
            # SymbolicShapeInference.infer_shapes's own loop, less its last step: where the
            # inference is incomplete, it saves the model with its weights as external data
            # into the working directory (sym_shape_infer_temp.onnx and a file per weight,
            # 575 MB for VGG-19) before raising
            ssi = SymbolicShapeInference(2**31 - 1, True, False, 0)
            complete = False
            ssi._preprocess(model)
            while ssi.run_:
                complete = ssi._infer_impl()
            ssi._update_output_from_vi()
            if complete:
                return ssi.out_mp_
            logger.debug("symbolic shape inference incomplete; using onnx's")
    except Exception as err:  # noqa: BLE001 - fall back to ONNX's inference
        logger.debug("symbolic shape inference failed (%s); using onnx's", err)
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a help, not a requirement
        return model


def tensor_dims(type_proto) -> list[int | str | None] | None:
    """The dims of an ONNX tensor type (an int, a name, or None), or None without a shape."""
    tensor = type_proto.tensor_type if type_proto is not None else None
    if tensor is None or not tensor.HasField("shape"):
        return None
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
    ]


def onnx_input_shapes(model) -> dict[str, list[list[int | str | None] | None]]:
    """Per node, the shape of each of its inputs as shape inference finds it."""
    graph = _infer(model).graph
    shapes: dict[str, list[int | str | None]] = {}
    for info in [*graph.input, *graph.value_info, *graph.output]:
        dims = tensor_dims(info.type)
        if dims is not None:
            shapes[info.name] = dims
    for init in graph.initializer:
        shapes[init.name] = list(init.dims)
    return {node.name: [shapes.get(i) for i in node.input] for node in graph.node if node.name}


def _dim_expr(dim: int | str | None, index: int):
    """A dimension from shape inference as a TIR expression: an int, a known symbolic dim,
    an expression of them ("batch*seq"), or a fresh variable named after it."""
    if isinstance(dim, int) and dim > 0:
        return tirx.IntImm("int64", dim)
    if not isinstance(dim, str):
        return tirx.Var(f"dim{index}", "int64")
    if dim in _DIM_VARS:
        return _DIM_VARS[dim]
    expr = _parse_dim(dim)
    if expr is None:
        expr = _DIM_VARS[dim] = tirx.Var(_var_name(dim), "int64")
    return expr


def _var_name(text: str) -> str:
    name = "".join(c if c.isalnum() else "_" for c in text).strip("_") or "dim"
    return name if not name[0].isdigit() else f"d_{name}"


def _parse_dim(text: str):
    """``batch*seq``, ``seq + 1``, ``floor(seq/2)`` over known dims; None otherwise."""
    try:
        import sympy
    except ImportError:
        return None
    try:
        tree = sympy.sympify(text, locals={n: sympy.Symbol(n) for n in _DIM_VARS})
    except Exception:  # noqa: BLE001 - not an expression: a plain name
        return None

    def conv(node):
        if isinstance(node, sympy.Integer):
            return tirx.IntImm("int64", int(node))
        if isinstance(node, sympy.Symbol):
            var = _DIM_VARS.get(node.name)
            if var is None:
                raise KeyError(node.name)
            return var
        if isinstance(node, sympy.Add | sympy.Mul):
            parts = [conv(a) for a in node.args]
            out = parts[0]
            for part in parts[1:]:
                out = out + part if isinstance(node, sympy.Add) else out * part
            return out
        if isinstance(node, sympy.floor) and isinstance(node.args[0], sympy.Mul):
            num, den = node.args[0].as_numer_denom()
            return tirx.floordiv(conv(num), conv(den))
        raise KeyError(str(node))

    try:
        return conv(tree)
    except (KeyError, TypeError):
        return None


def _learn_dims(inputs) -> None:
    """Record the symbolic dims (graph inputs' named axes, those bound so far) by name."""
    for value in inputs:
        sinfo = getattr(value, "ty", None) if isinstance(value, relax.Expr) else None
        if isinstance(sinfo, relax.TensorType) and isinstance(sinfo.shape, relax.ShapeExpr):
            for dim in sinfo.shape.values:
                if isinstance(dim, tirx.Var):
                    _DIM_VARS.setdefault(dim.name, dim)


class KnownShapes:
    """A converter whose tensor inputs all have a shape: an input the importer lost the shape
    of (``R.Tensor(ndim=4)`` or ``R.Tensor(ndim=-1)``) is ``match_cast`` to fresh symbolic
    dims first, as symbolic shape inference names them: ints, the graph inputs' named dims and
    expressions of them ("batch*seq"), a variable per other name (the same one for every use).

    Stock converters need shapes: Slice "requires a statically known input rank", Reshape
    "expects the input tensor to have known shape", ``emit_te`` "only supports Tensor that has
    ShapeExpr shape", Shape returns ``shape_of`` of it and the next Gather fails on it. Each
    such tensor comes out of a converter that could not compute its shape from a run-time
    value (a Slice whose ends are computed, a Range with a run-time limit); the fresh dims are
    bound when the program runs, so everything after it is symbolic instead of unknown.
    """

    def __init__(self, converter):
        self.converter = converter

    def __getattr__(self, name):
        return getattr(self.converter, name)

    def get_converter(self, opset):
        convert = self.converter.get_converter(opset)

        def run(bb, inputs, attr, params):
            name = attr.get("tvm_custom", {}).get("name", "")
            shapes = _SHAPES.get(name, [])
            _learn_dims(inputs)
            fixed = _frontend.onnx_input()
            for i, value in enumerate(inputs):
                fixed.append(_with_shape(bb, value, shapes[i] if i < len(shapes) else None))
            return convert(bb, fixed, attr, params)

        return run


def _with_shape(bb, value, onnx_shape: list[int | str | None] | None):
    if not isinstance(value, relax.Expr) or isinstance(value, GenericConst):
        return value
    sinfo = getattr(value, "ty", None)
    if not isinstance(sinfo, relax.TensorType) or sinfo.shape is not None:
        return value
    if onnx_shape is None or (sinfo.ndim >= 0 and len(onnx_shape) != sinfo.ndim):
        if sinfo.ndim < 0:
            return value
        onnx_shape = [None] * sinfo.ndim
    dims = [_dim_expr(d, i) for i, d in enumerate(onnx_shape)]
    return bb.match_cast(value, relax.TensorType(dims, sinfo.dtype, sinfo.vdevice))
