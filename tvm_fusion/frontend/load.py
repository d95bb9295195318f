"""Model loading: ONNX (validation, clear errors, then TVM's Relax importer) and saved
``torch.export`` programs (``.pt2``, through TVM's ``from_exported_program``).

``load_onnx(path_or_model, shapes=None)`` returns a Relax IRModule whose ``main`` takes the
model's graph inputs (initializers become bound constants). Everything that can go wrong with a
user's model is reported as one :class:`~tvm_fusion.errors.ModelError` line:
missing file, unreadable or corrupt protobuf, a model that fails ``onnx.checker``, operators the
importer does not know, and ``shapes`` that name unknown inputs or contradict the model.

``shapes`` maps input names to dimensions; a dimension is an int or a name (a symbolic
dimension, e.g. ``{"input_ids": ["batch", 128]}``). Inputs not named keep the model's shape,
its named dynamic axes becoming symbolic variables.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence

import tvm

from ..errors import ModelError, first_line

logger = logging.getLogger(__name__)

Shapes = Mapping[str, Sequence[int | str]]


def _read_model(path_or_model):
    import onnx
    from google.protobuf.message import DecodeError

    if isinstance(path_or_model, onnx.ModelProto):
        return path_or_model, "<ModelProto>"
    if isinstance(path_or_model, bytes | bytearray):
        try:
            return onnx.load_from_string(bytes(path_or_model)), "<bytes>"
        except (DecodeError, ValueError, RuntimeError) as err:
            raise ModelError(f"cannot parse ONNX model from bytes: {first_line(err)}") from None
    if not isinstance(path_or_model, str | os.PathLike):
        raise ModelError(
            f"expected an ONNX file path or onnx.ModelProto, got {type(path_or_model).__name__}"
        )
    path = os.fspath(path_or_model)
    if not os.path.exists(path):
        raise ModelError(f"model file not found: {path}")
    if os.path.isdir(path):
        raise ModelError(f"model path is a directory, not an ONNX file: {path}")
    try:
        model = onnx.load(path)
    except (DecodeError, ValueError, RuntimeError, OSError) as err:
        raise ModelError(f"cannot parse {path} as ONNX: {first_line(err)}") from None
    except Exception as err:  # protobuf raises odd types on garbage
        raise ModelError(f"cannot parse {path} as ONNX: {first_line(err)}") from None
    return model, path


def _check_model(model, where: str) -> None:
    import onnx

    if not model.graph.node and not model.graph.output:
        raise ModelError(f"{where} is not an ONNX model (empty graph)")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        raise ModelError(f"{where} is not a valid ONNX model: {first_line(err)}") from None
    except Exception as err:
        raise ModelError(f"{where} is not a valid ONNX model: {first_line(err)}") from None


def _graph_inputs(model) -> dict[str, list[int | str | None]]:
    initializers = {init.name for init in model.graph.initializer}
    inputs: dict[str, list[int | str | None]] = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        ttype = value.type.tensor_type
        if not ttype.HasField("shape"):
            inputs[value.name] = None
            continue
        dims: list[int | str | None] = []
        for dim in ttype.shape.dim:
            if dim.HasField("dim_value"):
                dims.append(int(dim.dim_value))
            elif dim.HasField("dim_param"):
                dims.append(str(dim.dim_param))
            else:
                dims.append(None)
        inputs[value.name] = dims
    return inputs


def _check_shapes(model, shapes: Shapes | None, where: str) -> dict[str, list] | None:
    if not shapes:
        return None
    declared = _graph_inputs(model)
    result: dict[str, list] = {}
    for name, dims in shapes.items():
        if name not in declared:
            known = ", ".join(declared) or "none"
            raise ModelError(
                f"shapes names input {name!r}, which {where} does not have (inputs: {known})"
            )
        if isinstance(dims, str | bytes) or not isinstance(dims, Sequence):
            raise ModelError(f"shape for input {name!r} must be a list of dims, got {dims!r}")
        model_dims = declared[name]
        if model_dims is not None and len(model_dims) != len(dims):
            raise ModelError(
                f"input {name!r} has rank {len(model_dims)} in {where}, shapes gives "
                f"{len(dims)} dims {list(dims)}"
            )
        out = []
        for i, dim in enumerate(dims):
            if isinstance(dim, bool) or not isinstance(dim, int | str):
                raise ModelError(f"dim {i} of input {name!r} must be an int or a name, got {dim!r}")
            if isinstance(dim, int) and dim < 0:
                raise ModelError(f"dim {i} of input {name!r} is negative: {dim}")
            fixed = model_dims[i] if model_dims is not None else None
            if isinstance(fixed, int) and isinstance(dim, int) and fixed != dim:
                raise ModelError(
                    f"input {name!r} dim {i} is {fixed} in {where}, shapes gives {dim}"
                )
            out.append(tvm.tirx.Var(dim, "int64") if isinstance(dim, str) else dim)
        result[name] = out
    return result


def _with_input_shapes(model, shapes: Shapes | None):
    """A copy of ``model`` whose graph inputs have the dims ``shapes`` gives (checked by
    :func:`_check_shapes`), so that shape inference and constant folding see the user's
    symbolic dims instead of the model's static ones; ``model`` itself without ``shapes``."""
    if not shapes:
        return model
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.value_info[:]  # the exporter's shapes of the old dims: inferred again
    for graph_input in out.graph.input:
        if graph_input.name not in shapes:
            continue
        tensor = graph_input.type.tensor_type
        tensor.shape.Clear()
        for dim in shapes[graph_input.name]:
            if isinstance(dim, str):
                tensor.shape.dim.add().dim_param = dim
            else:
                tensor.shape.dim.add().dim_value = dim
    return out


def _known_ops() -> set[str]:
    """The ONNX operators the importer (with our converters installed) converts."""
    from tvm.relax.frontend.onnx import onnx_frontend

    from .onnx_ops import install

    install()
    return set(onnx_frontend._get_convert_map()) | {"If", "Constant"}


def _unsupported_ops(model) -> list[str]:
    known = _known_ops()
    ops: set[str] = set()

    def walk(graph):
        for node in graph.node:
            if node.domain not in ("", "ai.onnx") or node.op_type not in known:
                ops.add(node.op_type if not node.domain else f"{node.domain}.{node.op_type}")
            for attr in node.attribute:
                if attr.g is not None and attr.g.node:
                    walk(attr.g)

    walk(model.graph)
    return sorted(ops)


@contextlib.contextmanager
def prepare_import(model) -> Iterator[list[str]]:
    """Yield the operators of ``model`` that the importer cannot convert; while inside, the
    converters know the input shapes ONNX's shape inference finds
    (``onnx_known_shapes.onnx_input_shapes``)."""
    from . import onnx_known_shapes

    unsupported = _unsupported_ops(model)
    if not unsupported:
        _fresh_import_state(model)
    try:
        yield unsupported
    finally:
        onnx_known_shapes._SHAPES.clear()
        onnx_known_shapes._DIM_VARS.clear()


def _fresh_import_state(model) -> None:
    """The converters' shapes of ``model`` and no symbolic dims learned yet: set before each
    import. A retry (``load_onnx`` casts shape operands and imports again) builds new graph
    inputs with new dims; dims kept from the attempt before would be other variables of the
    same names (``s``), left undefined in the function (PlaceShapeOnHost failed: "TIR
    variables (s,) were undefined")."""
    from . import onnx_known_shapes

    onnx_known_shapes._SHAPES.clear()
    onnx_known_shapes._DIM_VARS.clear()
    onnx_known_shapes._SHAPES.update(onnx_known_shapes.onnx_input_shapes(model))


# the importer's refusal of a shape value where a tensor is expected; load_onnx casts that
# node's shape operands to int64 tensors and imports again, at most this many times
_SHAPE_REFUSED = re.compile(r"Node (.+) cannot handle ShapeExpr inputs\.")
_MAX_SHAPE_RETRIES = 16


def _named_nodes(model):
    """``model`` with a name (``<op>_<index>``, unused in the graph) for each node of its top
    graph that has none: the importer's refusals name the node ("Node X cannot handle ShapeExpr
    inputs"), which ``load_onnx`` then casts (function-expanded ops have unnamed nodes)."""
    import onnx

    if all(n.name for n in model.graph.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    used = {n.name for n in out.graph.node}
    for i, node in enumerate(out.graph.node):
        if not node.name:
            name = f"{node.op_type}_{i}"
            while name in used:
                name += "_"
            node.name = name
            used.add(name)
    return out


def load_onnx(path_or_model, shapes: Shapes | None = None) -> tvm.IRModule:
    """Validate an ONNX model and import it as a Relax IRModule (see module docstring)."""
    model, where = _read_model(path_or_model)
    _check_model(model, where)
    shape_dict = _check_shapes(model, shapes, where)
    model = _with_input_shapes(model, shapes)
    try:
        return _import(model, where, shape_dict)
    except ModelError:
        newer = _newer_opset(model)
        if newer is None:
            raise
        logger.debug("%s: imported again at opset %d", where, _UPGRADE_OPSET)
        return _import(newer, where, shape_dict)  # its refusal names what is left


# a model below this opset that the importer refuses is tried again after ONNX's version
# converter (stock's converters take the old forms of Resize, Upsample, Slice as the new ones)
_UPGRADE_BELOW, _UPGRADE_OPSET = 11, 13


def _newer_opset(model):
    """``model`` converted to :data:`_UPGRADE_OPSET` by ONNX's version converter when its opset
    is below :data:`_UPGRADE_BELOW`, else (or when the converter fails) None."""
    import onnx
    from onnx import version_converter

    from .onnx_functions import _opset

    opset = _opset(model)
    if not 0 < opset < _UPGRADE_BELOW:
        return None
    try:
        converted = version_converter.convert_version(model, _UPGRADE_OPSET)
        for node in converted.graph.node:
            # Resize 10 and Upsample map coordinates as "asymmetric" and take the floor for
            # nearest; the converter leaves opset 11's defaults (half_pixel,
            # round_prefer_floor): linear resizes, and nearest ones by 3, came out wrong
            given = {a.name for a in node.attribute}
            if node.op_type != "Resize":
                continue
            for name, value in (
                ("coordinate_transformation_mode", "asymmetric"),
                ("nearest_mode", "floor"),  # opset 10's nearest pixel (ONNX Runtime's)
            ):
                if name not in given:
                    node.attribute.append(onnx.helper.make_attribute(name, value))
        onnx.checker.check_model(converted)
    except Exception as err:  # noqa: BLE001 - the first refusal stands
        logger.debug("version converter: %s", first_line(err))
        return None
    return converted


def _import(model, where: str, shape_dict):
    """The checked ``model`` through our ONNX rewrites and TVM's importer."""
    from tvm.relax.frontend.onnx import from_onnx

    from . import onnx_functions, onnx_shape_operands
    from .onnx_fold import fold_constants

    model, _ = onnx_functions.normalize_constants(model)
    model, expanded = onnx_functions.expand_functions(model, _known_ops())
    if expanded:
        logger.debug("%s: %d nodes replaced by their ONNX function bodies", where, expanded)
    model, folded = fold_constants(model)
    if folded:
        logger.debug("%s: %d constant nodes folded before import", where, folded)
    model = _named_nodes(model)
    model, cast = onnx_shape_operands.cast_shape_operands(model)
    if cast:
        logger.debug("%s: %d shape operands cast to int64 tensors", where, cast)
    with prepare_import(model) as unsupported:
        if unsupported:
            raise ModelError(
                f"{where} uses ONNX operators that cannot be imported: {', '.join(unsupported)}"
            )
        for attempt in range(_MAX_SHAPE_RETRIES + 1):
            if attempt:
                _fresh_import_state(model)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    mod = from_onnx(model, shape_dict=shape_dict, keep_params_in_input=False)
                return tensor_outputs(mod, model)
            except tvm.error.OpNotImplemented as err:
                raise ModelError(f"{where}: {first_line(err)}") from None
            except Exception as err:
                refused = _SHAPE_REFUSED.search(first_line(err))
                if refused:
                    model, cast = onnx_shape_operands.cast_operands_of(model, refused.group(1))
                    if cast:
                        logger.debug("%s: %s's shape operands cast", where, refused.group(1))
                        continue
                raise ModelError(f"cannot import {where}: {first_line(err)}") from None
        raise ModelError(f"cannot import {where}: shape values reach too many operands")


def tensor_outputs(mod: tvm.IRModule, model) -> tvm.IRModule:
    """``mod`` with each output of ``main`` that is a shape value (``Shape`` of a static input
    imports as ``R.shape([3, 4, 5])``) made the int64 tensor the model declares (the VM would
    return a ``tvm_ffi.Shape``, not a tensor: ``.numpy()`` fails on it)."""
    from tvm import relax

    func = mod["main"]
    seq = func.body
    if not isinstance(seq, relax.SeqExpr):
        return mod
    out = seq.body
    ty = out.ty
    fields = list(ty.fields) if isinstance(ty, relax.TupleType) else [ty]
    if not any(isinstance(f, relax.ShapeType) for f in fields):
        return mod
    declared = model.graph.output
    bb = relax.BlockBuilder()
    bindings, values, types = [], [], []
    for i, field in enumerate(fields):
        value = out if not isinstance(ty, relax.TupleType) else relax.TupleGetItem(out, i)
        if isinstance(field, relax.ShapeType) and i < len(declared):
            if not declared[i].type.HasField("tensor_type"):
                continue
            if isinstance(value, relax.TupleGetItem):  # a leaf to normalize the call on
                item = relax.Var(f"{declared[i].name or 'shape'}_shape", field)
                bindings.append(relax.VarBinding(item, value))
                value = item
            call = bb.normalize(relax.op.shape_to_tensor(value))
            var = relax.Var(f"{declared[i].name or 'shape'}_tensor", call.ty)
            bindings.append(relax.VarBinding(var, call))
            value, field = var, call.ty
        values.append(value)
        types.append(field)
    if not bindings:
        return mod
    tupled = isinstance(ty, relax.TupleType)
    result = relax.Tuple(values) if tupled else values[0]
    ret = relax.TupleType(types) if tupled else types[0]
    body = relax.SeqExpr([*seq.blocks, relax.BindingBlock(bindings)], result)
    mod["main"] = relax.Function(func.params, body, ret, func.is_pure, func.attrs, func.span)
    return relax.transform.Normalize()(mod)


def load_exported_program(path, shapes: Shapes | None = None) -> tvm.IRModule:
    """A program saved by ``torch.export.save`` (``.pt2``) as a Relax IRModule, through TVM's
    ``from_exported_program`` with the weights bound as constants. Its dynamic dims are the
    ``torch.export.Dim`` s of the export (their bounds become ``tir_var_upper_bound``), so
    ``shapes`` cannot change them; needs torch."""
    if shapes:
        raise ModelError("shapes apply to ONNX models; a .pt2 program keeps its export's dims")
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelError(f"model file not found: {path}")
    if os.path.isdir(path):
        raise ModelError(f"model path is a directory, not a .pt2 file: {path}")
    try:
        import torch
    except ImportError:
        raise ModelError(f"{path}: reading a torch.export program needs torch") from None
    _register_custom_ops(path)
    quiet = logging.getLogger("torch.export")  # it logs a traceback before raising
    level = quiet.level
    try:
        quiet.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.export.load(path)
    except Exception as err:
        raise ModelError(
            f"cannot read {path} as a torch.export program: {first_line(err)}"
        ) from None
    finally:
        quiet.setLevel(level)
    return import_exported_program(program, path)


# custom ops a program may call -> the module whose import registers them
_CUSTOM_OP_MODULES = {"transformers": ("transformers.integrations.moe", "transformers")}
_TARGET = re.compile(r'"target":\s*"torch\.ops\.(\w+)\.(\w+)\.(\w+)"')


def _custom_ops(path: str) -> list[tuple[str, str]]:
    """``(namespace, name)`` of the ops outside ``aten`` / ``prims`` / ``_`` the saved graphs of
    ``path`` call (read from the archive's ``models/*.json``; none if it is not a zip)."""
    import zipfile

    found: dict[tuple[str, str], None] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                if "/models/" in name and name.endswith(".json"):
                    text = archive.read(name).decode("utf-8", "replace")
                    for ns, op, _ in _TARGET.findall(text):
                        if ns not in ("aten", "prims", "higher_order", "_"):
                            found[(ns, op)] = None
    except (OSError, zipfile.BadZipFile, KeyError):
        return []
    return list(found)


def _register_custom_ops(path: str) -> None:
    """Registers the custom ops ``path`` calls that torch does not know yet, by importing the
    library that defines them (``transformers::grouped_mm_fallback``: transformers' grouped
    experts); one ModelError line naming the op and the remedy where that is impossible, in
    place of torch's "We ran into an error when deserializing the saved file"."""
    import importlib

    import torch

    def known(ns: str, op: str) -> bool:
        try:
            getattr(getattr(torch.ops, ns), op)
        except (AttributeError, RuntimeError):
            return False
        return True

    for ns, op in _custom_ops(path):
        if known(ns, op):
            continue
        module, package = _CUSTOM_OP_MODULES.get(ns, (None, None))
        if module is not None:
            try:
                importlib.import_module(module)
            except Exception as err:  # not installed, or a version without the op
                logger.debug("importing %s for %s::%s: %s", module, ns, op, err)
        if not known(ns, op):
            remedy = (
                f"install {package} (pip install {package})"
                if package
                else "import the library that defines it before loading"
            )
            raise ModelError(
                f"{path}: the program calls the custom op {ns}::{op}, which is not registered;"
                f" {remedy}"
            )


def import_exported_program(program, where: str = "the program", decompose: bool = True):
    """An in-memory ``torch.export`` program as a Relax IRModule (weights bound as
    constants); ``decompose=False`` imports it without torch's decompositions (``linear``,
    ``chunk`` ... as exported). Converters stock gets wrong are replaced (``torch_ops``); an
    importer failure is one ModelError line naming ``where``."""
    from tvm.relax.frontend.torch import from_exported_program

    from . import torch_rnn
    from .torch_ops import converters

    if decompose and torch_rnn.has_rnn(program):
        # nn.LSTM / GRU / RNN kept whole: one recurrence per layer and direction (torch_rnn)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                kept = torch_rnn.keep_rnns(program)
                return from_exported_program(
                    kept,
                    keep_params_as_input=False,
                    run_ep_decomposition=False,
                    custom_convert_map={**converters(kept), **torch_rnn.converters(kept)},
                )
        except Exception as why:  # NotCovered, or this path failed: the import as before
            logger.debug("%s: recurrent op left to torch's decomposition: %s", where, why)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return from_exported_program(
                program,
                keep_params_as_input=False,
                run_ep_decomposition=decompose,
                custom_convert_map=converters(program),
            )
    except Exception as err:
        raise ModelError(f"cannot import {where}: {first_line(err)}") from None


def load_model(path, shapes: Shapes | None = None) -> tvm.IRModule:
    """An ONNX file or a saved ``torch.export`` program (by its ``.pt2`` suffix)."""
    if isinstance(path, str | os.PathLike) and os.fspath(path).endswith(".pt2"):
        return load_exported_program(path, shapes)
    return load_onnx(path, shapes)
