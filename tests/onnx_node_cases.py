"""Run ONNX's own operator conformance cases (``onnx.backend.test.case.node``) through
``load_onnx`` + the ``tvm_fusion`` pipeline on the host + the VM, in this process.

``run_case(name)`` returns one line:

- ``"pass"``: every output has the declared dtype, the reference's shape and its numbers
  (rtol 1e-3, atol 1e-5, NaNs where the reference has them);
- ``"refused: <line>"``: a :class:`~tvm_fusion.errors.TvmFusionError` at load or compile time
  (the model is refused in one line: never a wrong number);
- ``"wrong: <detail>"``: an output that differs (value, shape, dtype, count, or a value that is
  not a tensor, e.g. a ``Shape`` object where the model declares an int64 tensor);
- ``"error: <type>: <line>"``: anything else raised (TVM's raw errors, at any stage).

The cases are made by ONNX's generator modules, one per operator (``expand.py`` ...): only the
modules of the cases asked for are imported (all of them take ~17 s), see :func:`case`.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import numpy as np

RTOL, ATOL = 1e-3, 1e-5

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


def case(name: str):
    """The ONNX test case ``name`` (``"test_expand_dim_changed"``)."""
    module = _module_for(name)
    names_of(module)
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


def _expected(outputs) -> list:
    flat: list = []
    for value in outputs:
        if isinstance(value, list | tuple):
            flat.extend(np.asarray(v) for v in value)
        else:
            flat.append(np.asarray(value))
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
        if e.dtype.kind in "fc":
            if not np.allclose(g, e, rtol=RTOL, atol=ATOL, equal_nan=True):
                diff = np.nan_to_num(np.abs(g.astype("float64") - e.astype("float64")), nan=np.inf)
                return f"wrong: output {i} max error {diff.max():.3g}"
        elif not np.array_equal(g, e):
            return f"wrong: output {i} differs in {int((g != e).sum())} of {e.size} elements"
    return "pass"


def run_case(name: str) -> str:
    """Load, compile for the host and run the ONNX node test ``name``; one line (see the
    module docstring)."""
    import tvm_fusion
    from tvm_fusion.build import engine
    from tvm_fusion.errors import TvmFusionError, first_line

    test = case(name)
    inputs, outputs = test.data_sets[0]
    if any(not isinstance(v, np.ndarray) for v in inputs):
        kinds = sorted({type(v).__name__ for v in inputs if not isinstance(v, np.ndarray)})
        return f"refused: the runner passes tensors only, this case takes {', '.join(kinds)}"
    stage = "load"
    try:
        mod = tvm_fusion.load_onnx(test.model)
        stage = "compile"
        compiled = engine.compile_module(mod, tvm_fusion.host_target(), "tvm_fusion")
        stage = "run"
        runner = engine.TvmRunner(compiled, [np.asarray(v) for v in inputs])
        got: list = []
        _flatten(runner(), got)
    except TvmFusionError as err:
        return f"refused: {first_line(err)}"
    except Exception as err:
        return f"error: {stage}: {type(err).__name__}: {first_line(err)}"
    return compare(got, _expected(outputs))
