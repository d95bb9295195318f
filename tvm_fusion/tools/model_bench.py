"""``tvm-fusion bench --models DIR``: ONNX files against ONNX Runtime and stock TVM.

Every ``*.onnx`` in ``DIR`` (a corpus written by ``scripts/export_corpus.py``, or any folder of
models) runs in this one process on the same inputs with up to four engines:

- ``tvm-stock``: what a new TVM user gets, stock ``relax.frontend.onnx.from_onnx`` and stock
  TVM's fusing pipeline (``relax.get_default_pipeline``); when the import or the build fails,
  the row says so in one line (most exported transformers models);
- ``stock-pipeline``: our importer (:func:`tvm_fusion.load_onnx`) and PlaceShapeOnHost, then
  stock TVM's pipeline, so that the gain of our fusion and scheduling is measured apart from
  the import fixes. (PlaceShapeOnHost is needed: stock's VM codegen fails on the dims the
  importer binds with ``match_cast`` - "PrimExpr ... has not been computed" - until the pass
  makes them symbolic expressions of the inputs' dims.)
- ``tvm-fusion``: ``load_onnx`` and the ``tvm_fusion`` pipeline; the rewrites each of our passes
  made are counted while it compiles;
- ``onnxruntime``: the reference. Every TVM engine's outputs are compared with its outputs on
  the same inputs.

Inputs: ``<model>.npz`` beside the model (arrays ``in:<input name>``, as the corpus saves them),
else random inputs built from the graph's input types (integers in [0, 2), floats from a normal
distribution). ``dims`` resizes named dynamic axes (``{"batch": 8, "seq": 64}``): a saved int
input is resampled from its own values (token ids stay in the vocabulary, labels keep their
ignore index), a float one from a normal distribution of its mean and deviation. Axis names come
from the corpus manifest's ``dynamic_axes`` or from the ONNX inputs' ``dim_param``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
from tvm.target import Target

from ..build import engine
from ..errors import TvmFusionError, UsageError, first_line
from ..target import parse_target
from .analysis import kernel_count
from .bench import (
    EngineResult,
    _fmt_ms,
    compile_notes,
    machine_info,
    ratio,
    ratios,
    row_tail,
    skipped_notes,
    table_head,
)

logger = logging.getLogger(__name__)

MODEL_ENGINES = ("tvm-stock", "stock-pipeline", "tvm-fusion", "onnxruntime")
RTOL = ATOL = 1e-3


@dataclasses.dataclass
class ModelCase:
    name: str
    path: Path
    inputs: dict[str, np.ndarray]  # in the graph's input order


@dataclasses.dataclass
class ModelResult:
    model: str
    shapes: dict[str, list[int]]
    engines: dict[str, EngineResult]
    rewrites: dict[str, int] = dataclasses.field(default_factory=dict)

    def ratio(self, num: str, den: str) -> float | None:
        return ratio(self.engines, num, den)

    @property
    def stock_kernels(self) -> int | None:
        for name in ("tvm-stock", "stock-pipeline"):
            r = self.engines.get(name)
            if r is not None and r.kernels is not None:
                return r.kernels
        return None


def parse_model_engines(spec: str | Sequence[str] | None) -> list[str]:
    if spec is None:
        return list(MODEL_ENGINES)
    names = [s.strip() for s in spec.split(",") if s.strip()] if isinstance(spec, str) else spec
    unknown = [n for n in names if n not in MODEL_ENGINES]
    if unknown:
        torch_only = [n for n in unknown if n in ("inductor", "torch")]
        why = (
            f" ({' and '.join(torch_only)} need a torch module; --models runs ONNX files)"
            if torch_only
            else ""
        )
        raise UsageError(
            f"unknown engine(s) for --models: {', '.join(unknown)}; "
            f"known: {', '.join(MODEL_ENGINES)}{why}"
        )
    return list(names)


# ---------------------------------------------------------------------------------------------
# inputs


def _graph_inputs(model) -> list:
    initializers = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in initializers]


def _axis_names(model, manifest_entry: Mapping | None) -> dict[str, dict[int, str]]:
    names: dict[str, dict[int, str]] = {}
    for value in _graph_inputs(model):
        dims = value.type.tensor_type.shape.dim
        names[value.name] = {i: d.dim_param for i, d in enumerate(dims) if d.dim_param}
    for inp, axes in ((manifest_entry or {}).get("dynamic_axes") or {}).items():
        names.setdefault(inp, {}).update({int(k): v for k, v in axes.items()})
    return names


def _resample(base: np.ndarray, shape: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    if tuple(shape) == base.shape:
        return base
    if base.dtype.kind in "iub":
        return rng.choice(base.ravel(), size=tuple(shape)).astype(base.dtype)
    mean, std = float(base.mean()), float(base.std()) or 1.0
    return (rng.standard_normal(tuple(shape)) * std + mean).astype(base.dtype)


def _random_input(value, dims: Mapping[str, int], rng: np.random.Generator) -> np.ndarray:
    import onnx

    ttype = value.type.tensor_type
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type))
    shape = []
    for d in ttype.shape.dim:
        if d.HasField("dim_value"):
            shape.append(d.dim_value)
        elif d.dim_param in dims:
            shape.append(dims[d.dim_param])
        else:
            raise UsageError(
                f"input {value.name!r} has a dynamic axis {d.dim_param or '?'!r} and no saved "
                f"inputs: give its size with --dim {d.dim_param or 'NAME'}=N"
            )
    if dtype.kind in "iu":
        return rng.integers(0, 2, size=shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.standard_normal(shape).astype(dtype)


def load_cases(
    directory: str | Path,
    dims: Mapping[str, int] | None = None,
    only: Sequence[str] | None = None,
    seed: int = 0,
) -> list[ModelCase]:
    """The models of ``directory`` (sorted by name) with their inputs; see module docstring."""
    from ..frontend.load import _read_model

    directory = Path(directory)
    if not directory.is_dir():
        raise UsageError(f"--models expects a directory of .onnx files, got {directory}")
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    files = sorted(directory.glob("*.onnx"))
    if not files:
        raise UsageError(f"no .onnx files in {directory}")
    known = [f.stem for f in files]
    unknown = [n for n in only or () if n not in known]
    if unknown:
        raise UsageError(f"no model {', '.join(unknown)} in {directory}; there: {', '.join(known)}")
    dims = dict(dims or {})
    rng = np.random.default_rng(seed)
    cases = []
    for path in files:
        if only and path.stem not in only:
            continue
        entry = manifest.get(path.stem)
        if entry and "skipped" in entry:
            continue
        model, _ = _read_model(path)
        axis_names = _axis_names(model, entry)
        saved_path = path.with_suffix(".npz")
        saved = np.load(saved_path) if saved_path.exists() else None
        inputs = {}
        for value in _graph_inputs(model):
            key = f"in:{value.name}"
            if saved is not None and key in saved:
                base = saved[key]
                shape = [
                    dims.get(axis_names.get(value.name, {}).get(i, ""), n)
                    for i, n in enumerate(base.shape)
                ]
                inputs[value.name] = _resample(base, shape, rng)
            else:
                inputs[value.name] = _random_input(value, dims, rng)
        cases.append(ModelCase(path.stem, path, inputs))
    return cases


# ---------------------------------------------------------------------------------------------
# engines


def _tvm_engine(
    name: str, case: ModelCase, target, ours: Callable, rewrites: dict
) -> tuple[Callable, object]:
    """Compile and run one TVM engine; ``ours()`` is the model imported by ``load_onnx``
    (imported once per model, shared by stock-pipeline and tvm-fusion)."""
    import onnx

    from ..frontend.onnx_ops import stock_from_onnx
    from ..transform import collect_rewrites

    stage = "import"
    try:
        if name == "tvm-stock":
            mod = stock_from_onnx(onnx.load_from_string(case.path.read_bytes()))
        else:
            mod = ours()
        stage = "build"
        if name == "stock-pipeline":
            mod = _place_shapes(mod, target)
        if name == "tvm-fusion":
            with collect_rewrites() as counts:
                compiled = engine.compile_module(mod, target, "tvm_fusion")
            rewrites.update(counts)
        else:
            compiled = engine.compile_module(mod, target, "stock")
        stage = "run"
        runner = engine.TvmRunner(compiled, list(case.inputs.values()))
        outputs = runner.outputs()
    except TvmFusionError as err:
        raise _Failed(f"{stage} failed: {err}") from None
    except Exception as err:  # TVM raises many types; the row says which stage failed
        raise _Failed(f"{stage} failed: {first_line(err)}") from None
    return runner, (outputs, compiled)


def _place_shapes(mod, target):
    import tvm

    from ..build.pipeline import fusion_passes

    with target:
        shapes = [p for p in fusion_passes(target) if p.info.name == "PlaceShapeOnHost"]
        return tvm.transform.Sequential(shapes)(mod)


class _Failed(Exception):
    pass


def run_case(
    case: ModelCase,
    engines: Sequence[str],
    tgt: Target,
    repeat: int,
    budget_s: float,
    progress: Callable[[str], None] | None = None,
    min_time_s: float = 0.0,
) -> ModelResult:
    import onnx

    threads = engine.threads_for(tgt)
    result = ModelResult(case.name, {k: list(v.shape) for k, v in case.inputs.items()}, {})
    ort_run = engine.onnxruntime_runner(onnx.load(str(case.path)), case.inputs, threads)
    reference = [np.asarray(o) for o in ort_run()]
    from ..frontend.load import load_onnx

    ours = functools.cache(lambda: load_onnx(case.path))  # a failure is raised again per engine
    runs: dict[str, Callable] = {}
    for name in engines:
        if progress:
            progress(f"{case.name}: {name}")
        res = EngineResult(name)
        result.engines[name] = res
        if name == "onnxruntime":
            run = ort_run
        else:
            start = time.perf_counter()
            try:
                run, (outputs, compiled) = _tvm_engine(name, case, tgt, ours, result.rewrites)
            except _Failed as why:
                res.skipped = str(why)
                logger.info("%s on %s: %s", name, case.name, why)
                continue
            res.compile_s = round(time.perf_counter() - start, 3)
            res.kernels = kernel_count(compiled.lowered)
            res.max_abs_err = engine.max_error(outputs, reference)
            res.ok = engine.allclose(outputs, reference, RTOL, ATOL)
            if not res.ok:
                logger.warning(
                    "%s on %s differs from ONNX Runtime (max abs err %.3g)",
                    name,
                    case.name,
                    res.max_abs_err,
                )
        runs[name] = run
    if progress and runs:
        progress(f"{case.name}: timing {', '.join(runs)} in alternating rounds")
    timings = engine.time_interleaved(runs, repeat=repeat, budget_s=budget_s, min_time_s=min_time_s)
    for name, timing in timings.items():
        result.engines[name].set_timing(timing)
    return result


def run_models(
    directory: str | Path,
    engines: Sequence[str] | None = None,
    dims: Mapping[str, int] | None = None,
    only: Sequence[str] | None = None,
    target=None,
    repeat: int = 10,
    budget_s: float = 10.0,
    progress: Callable[[str], None] | None = None,
    min_time_s: float = 0.0,
) -> list[ModelResult]:
    engine_names = parse_model_engines(engines)
    cases = load_cases(directory, dims, only)
    tgt = parse_target(target)
    return [run_case(c, engine_names, tgt, repeat, budget_s, progress, min_time_s) for c in cases]


# ---------------------------------------------------------------------------------------------
# reporting


def markdown_table(results: Sequence[ModelResult], engines: Sequence[str]) -> str:
    lines = table_head(["model", "kernels stock/ours", "rewrites"], engines)
    for res in results:
        ours = res.engines.get("tvm-fusion")
        kernels = "/".join(
            "-" if k is None else str(k)
            for k in (res.stock_kernels, ours.kernels if ours else None)
        )
        rewrites = ", ".join(f"{k} {v}" for k, v in sorted(res.rewrites.items())) or "-"
        row = [res.model, kernels, rewrites]
        row += [
            "fail" if res.engines[e].skipped else _fmt_ms(res.engines[e].median_ms) for e in engines
        ]
        row += row_tail(res.engines, engines)
        lines.append("| " + " | ".join(row) + " |")
    lines += compile_notes([(r.model, r.engines) for r in results])
    lines += skipped_notes([(r.model, r.engines) for r in results], "Failed")
    return "\n".join(lines)


def write_results(
    results: Sequence[ModelResult],
    engines: Sequence[str],
    target,
    path: str | Path,
    directory: str | Path,
    dims: Mapping[str, int] | None = None,
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    machine = machine_info(target)
    payload = {
        "machine": machine,
        "models_dir": str(directory),
        "dims": dict(dims or {}),
        "engines": list(engines),
        "results": [
            {
                "model": r.model,
                "shapes": r.shapes,
                "rewrites": r.rewrites,
                "kernels": {
                    "stock": r.stock_kernels,
                    "tvm_fusion": r.engines["tvm-fusion"].kernels
                    if "tvm-fusion" in r.engines
                    else None,
                },
                "engines": {k: dataclasses.asdict(v) for k, v in r.engines.items()},
                "ratios": ratios(r.engines, engines),
            }
            for r in results
        ],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    dims_text = ", ".join(f"{k}={v}" for k, v in (dims or {}).items()) or "saved inputs"
    path.with_suffix(".md").write_text(
        f"# Models of {directory} ({machine['processor']}, {machine['threads']} threads, "
        f"{machine['date']})\n\nInputs: {dims_text}. Median ms per run, engines timed in "
        f"alternating rounds; outputs compared with "
        f"ONNX Runtime's (rtol = atol = {RTOL}). Kernels: stock TVM's pipeline (on stock's "
        "import where it works, else on ours) vs ours.\n\n"
        + markdown_table(results, engines)
        + "\n"
    )
    return path
