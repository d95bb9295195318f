"""Run ONNX's own operator conformance cases (``onnx.backend.test.case.node``) through
``load_onnx`` + the ``tvm_fusion`` pipeline on the host + the VM, in this process (or through
stock TVM's importer and pipeline, or ONNX Runtime: ``engine=``; ``scripts/onnx_conformance.py``
runs the whole suite with each case in a worker process).

``run_case(name)`` returns one line:

- ``"pass"``: every output has the declared dtype, the reference's shape and its numbers
  (rtol 1e-3, atol 1e-5, two ulps for float16 / bfloat16, NaNs where the reference has them);
- ``"refused: <line>"``: a :class:`~tvm_fusion.errors.TvmFusionError` at load or compile time
  (the model is refused in one line: never a wrong number);
- ``"wrong: <detail>"``: an output that differs (value, shape, dtype, count, or a value that is
  not a tensor, e.g. a ``Shape`` object where the model declares an int64 tensor);
- ``"error: <stage>: <type>: <line>"``: anything else raised (TVM's raw errors, at any stage);
- ``"skipped: <line>"``: a case whose inputs are not all tensors (sequences, optionals): the
  TVM runners pass tensors only.

The cases are made by ONNX's generator modules, one per operator (``expand.py`` ...): only the
modules of the cases asked for are imported (all of them take ~17 s), see :func:`case`.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import warnings

import numpy as np

RTOL, ATOL = 1e-3, 1e-5
# Two units in the last place for the half types, whose one ulp is about RTOL or more: ONNX's
# own runner allows bfloat16 two (``onnx.backend.test.runner``); float16's 1e-3 is one ulp
# above 0.5, and the fp16 Attention cases' reference, rounded to fp16 at every step, is itself
# 4.7e-4 from the float64 result (ours 6.0e-4, 2 ulps from the reference).
_HALF_RTOL = {"float16": 2.0**-9, "bfloat16": 2.0**-6}

_PACKAGE = "onnx.backend.test.case.node"

# case name prefix -> generator module, where the module's name is not the op's in lower case
_MODULES = {
    "test_batchnorm": "batch_normalization",
    "test_layer_normalization": "layernormalization",
    "test_split_to_sequence": "splittosequence",
    "test_nonmaxsuppression": "nonmaxsuppression",
    "test_convtranspose": "convtranspose",
    "test_spacetodepth": "spacetodepth",
    "test_depthtospace": "depthtospace",
    "test_roialign": "roialign",
    "test_isinf": "isinf",
    "test_mod": "mod",
    "test_expand": "expand",
    "test_shape": "shape",
    "test_constant_pad": "pad",
    "test_edge_pad": "pad",
    "test_reflect_pad": "pad",
    "test_wrap_pad": "pad",
    "test_training_dropout": "dropout",
    "test_range": "rangeop",
    "test_rotary_embedding": "rotaryembedding",
    "test_center_crop_pad": "center_crop_pad",
    "test_l1normalization": "lpnormalization",
    "test_l2normalization": "lpnormalization",
    "test_lpnormalization": "lpnormalization",
    "test_rms_normalization": "rmsnormalization",
    "test_reduce_log_sum_exp": "reduce_log_sum_exp",
    "test_reduce_max": "reducemax",
    "test_reduce_sum": "reducesum",
    "test_reduce_mean": "reducemean",
    "test_reduce_l2": "reducel2",
    "test_top_k": "topk",
}


def _module_for(name: str) -> str:
    for prefix in sorted(_MODULES, key=len, reverse=True):
        if name.startswith(prefix):
            return _MODULES[prefix]
    return name.removeprefix("test_").split("_")[0]


def _cases() -> list:
    return importlib.import_module(_PACKAGE)._NodeTestCases


_BY_MODULE: dict[str, list[str]] = {}


def names_of(module: str) -> list[str]:
    """Names of the cases ONNX's generator module ``module`` (``"expand"``) makes, in ONNX's
    order (imports the module: its ``export`` functions make the cases)."""
    if module not in _BY_MODULE:
        importlib.import_module(_PACKAGE)._TargetOpType = None  # every op's cases
        before = len(_cases())
        full = f"{_PACKAGE}.{module}"
        if full in sys.modules:
            raise RuntimeError(f"{full} was imported before: its cases are not known here")
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            importlib.import_module(full)
        _BY_MODULE[module] = [c.name for c in _cases()[before:]]
    return list(_BY_MODULE[module])


def all_names() -> dict[str, str]:
    """Every case of the suite -> the generator module whose import makes it (a module that
    another imports has its cases made by that one: they are that one's here). Imports all
    the modules (~17 s)."""
    import pkgutil

    package = importlib.import_module(_PACKAGE)
    for info in pkgutil.iter_modules(package.__path__):
        if f"{_PACKAGE}.{info.name}" not in sys.modules:
            names_of(info.name)
    return {n: module for module, names in _BY_MODULE.items() for n in names}


_EXPANDED = re.compile(r"_expanded(_ver\d+)?$")


def op_of(name: str, module: str | None = None) -> str:
    """The op a case tests: its node's, or for a function-expanded case (``..._expanded``),
    the op of the case it expands."""
    test = case(name, module)
    if len(test.model.graph.node) == 1 and not _EXPANDED.search(name):
        return test.model.graph.node[0].op_type
    base = _EXPANDED.sub("", name)
    if base != name:
        try:
            return op_of(base, module)
        except KeyError:
            pass
    return test.model.graph.node[0].op_type if test.model.graph.node else "?"


def case(name: str, module: str | None = None):
    """The ONNX test case ``name`` (``"test_expand_dim_changed"``), made by the generator
    ``module`` (default: the one its name says)."""
    module = module or _module_for(name)
    try:
        names_of(module)
    except RuntimeError:  # imported by another module: its cases are there
        pass
    for c in _cases():
        if c.name == name:
            return c
    raise KeyError(f"no ONNX node test case {name!r} (looked in {_PACKAGE}.{module})")


def _flatten(value, out: list) -> None:
    """VM results as a flat list; anything that is not a tensor stays as it is (a wrong
    output, not silently converted)."""
    import tvm

    if isinstance(value, tvm.runtime.Tensor):
        out.append(value.numpy())
    elif isinstance(value, tvm.runtime.ShapeTuple):
        out.append(value)
    elif isinstance(value, list | tuple) or type(value).__name__ == "Array":
        for item in value:
            _flatten(item, out)
    else:
        out.append(value)


def _array(value):
    """A case's input or reference output as numpy: ONNX gives some as ``TensorProto`` (types
    numpy lacks: bfloat16, float8, int4) or as numpy scalars; sequences and optionals stay."""
    import onnx

    if isinstance(value, onnx.TensorProto):
        return onnx.numpy_helper.to_array(value)
    if isinstance(value, np.generic):
        return np.asarray(value)
    return value


def _expected(outputs) -> list:
    flat: list = []
    for value in outputs:
        if isinstance(value, list | tuple):
            flat.extend(np.asarray(_array(v)) for v in value)
        else:
            flat.append(np.asarray(_array(value)))
    return flat


def compare(got: list, expected: list) -> str:
    """``"pass"`` or ``"wrong: <detail>"`` for flat lists of outputs."""
    if len(got) != len(expected):
        return f"wrong: {len(got)} outputs, expected {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if not isinstance(g, np.ndarray):
            return f"wrong: output {i} is a {type(g).__name__} ({g}), expected a {e.dtype} tensor"
        if g.shape != e.shape:
            return f"wrong: output {i} has shape {g.shape}, expected {e.shape}"
        if g.dtype != e.dtype:
            return f"wrong: output {i} has dtype {g.dtype}, expected {e.dtype}"
        rtol = _HALF_RTOL.get(e.dtype.name, RTOL)
        if e.dtype.kind in "fc" or e.dtype.name == "bfloat16":
            g64, e64 = g.astype("float64"), e.astype("float64")
            if not np.allclose(g64, e64, rtol=rtol, atol=ATOL, equal_nan=True):
                diff = np.nan_to_num(np.abs(g64 - e64), nan=np.inf)
                return f"wrong: output {i} max error {diff.max():.3g}"
        elif e.dtype.kind == "V":  # ml_dtypes' bfloat16 / float8 / int4: exact, NaN = NaN
            g32, e32 = g.astype("float32"), e.astype("float32")
            if not np.array_equal(g32, e32, equal_nan=True):
                return (
                    f"wrong: output {i} differs in {int((g32 != e32).sum())} of {e.size} elements"
                )
        elif not np.array_equal(g, e):
            return f"wrong: output {i} differs in {int((g != e).sum())} of {e.size} elements"
    return "pass"


ENGINES = ("tvm_fusion", "stock", "onnxruntime")


_ORT_IR_VERSION = 13  # onnxruntime 1.31's newest (the cases of the newest opsets declare 14)


# ``CONSTANTS=1`` in the environment (``onnx_conformance.py --operands-as-initializers``): each
# case's inputs after the first become initializers, as real models hold their axes, pads,
# scales, k... (ONNX's cases feed them at run time, which hides the converters' constant paths)
CONSTANTS_ENV = "TVM_FUSION_NODE_CASES_CONSTANTS"


def _held_as_initializers(model, inputs: list):
    """``(model, inputs)`` with the inputs after the first as initializers, or None."""
    import onnx
    from onnx import numpy_helper

    graph_inputs = list(model.graph.input)
    if len(inputs) < 2 or len(graph_inputs) != len(inputs):
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.ir_version = max(out.ir_version, 4)  # below 4 an initializer must be an input too
    for info, value in zip(graph_inputs[1:], inputs[1:], strict=True):
        out.graph.initializer.append(numpy_helper.from_array(np.asarray(value), info.name))
    del out.graph.input[:]
    out.graph.input.append(graph_inputs[0])
    return out, inputs[:1]


def _run_ort(test, model=None, inputs=None) -> list:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 4
    model = model if model is not None else test.model
    if model.ir_version > _ORT_IR_VERSION:  # the same graph, in the newest IR ORT reads
        copy = type(model)()
        copy.CopyFrom(model)
        copy.ir_version = _ORT_IR_VERSION
        model = copy
    session = ort.InferenceSession(
        model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
    )
    if inputs is None:
        inputs = [_array(v) for v in test.data_sets[0][0]]
    names = [i.name for i in model.graph.input]
    got: list = []
    for value in session.run(None, dict(zip(names, inputs, strict=False))):
        if isinstance(value, list):
            got.extend(np.asarray(v) for v in value)
        else:
            got.append(np.asarray(value) if isinstance(value, np.generic) else value)
    return got


def run_case(name: str, engine: str = "tvm_fusion", module: str | None = None) -> str:
    """Load, compile for the host and run the ONNX node test ``name`` with ``engine``
    (:data:`ENGINES`); one line (see the module docstring)."""
    from tvm_fusion.errors import TvmFusionError, first_line

    test = case(name, module)
    inputs, outputs = test.data_sets[0]
    inputs = [_array(v) for v in inputs]
    model = test.model
    if any(not isinstance(v, np.ndarray) for v in inputs):  # sequences, optionals
        kinds = sorted({type(v).__name__ for v in inputs if not isinstance(v, np.ndarray)})
        return f"skipped: the runner passes tensors only, this case takes {', '.join(kinds)}"
    if os.environ.get(CONSTANTS_ENV) == "1":
        held = _held_as_initializers(model, inputs)
        if held is None:
            return "skipped: no input after the first to hold as an initializer"
        model, inputs = held
    if engine == "onnxruntime":
        try:
            got = _run_ort(test, model, inputs)
        except Exception as err:
            return f"error: run: {type(err).__name__}: {first_line(err)}"
        return compare(got, _expected(outputs))
    import tvm_fusion
    from tvm_fusion.build import engine as engines
    from tvm_fusion.frontend.onnx_ops import stock_from_onnx

    stage = "load"
    try:
        if engine == "stock":
            mod = stock_from_onnx(model)
        else:
            mod = tvm_fusion.load_onnx(model)
        stage = "compile"
        compiled = engines.compile_module(mod, tvm_fusion.host_target(), engine)
        stage = "run"
        runner = engines.TvmRunner(compiled, [np.asarray(v) for v in inputs])
        got: list = []
        _flatten(runner(), got)
    except TvmFusionError as err:
        return f"refused: {stage}: {first_line(err)}"
    except Exception as err:
        return f"error: {stage}: {type(err).__name__}: {first_line(err)}"
    return compare(got, _expected(outputs))


# the worker process's side (tvm_fusion.testing.fuzz.worker): one case = (name, module, engine)


def save_job(directory, name: str, module: str, engine: str):
    import json
    from pathlib import Path

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "job.json").write_text(json.dumps([name, module, engine]))
    return directory


def load_job(directory) -> tuple[str, str, str]:
    import json
    from pathlib import Path

    return tuple(json.loads((Path(directory) / "job.json").read_text()))


def run_job(name: str, module: str, engine: str) -> tuple[str, str]:
    """(outcome, reason) of one case with one engine, for the worker."""
    import logging

    logging.disable(logging.CRITICAL)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        line = run_case(name, engine, module)
    outcome, _, reason = line.partition(": ")
    return outcome, reason
