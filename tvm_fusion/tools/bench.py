"""The benchmark harness behind ``tvm-fusion bench`` and ``scripts/bench.py``.

Every engine runs in this one process on the same inputs: ``tvm-stock`` (stock TVM's fusing
pipeline, ``relax.get_default_pipeline``), ``tvm-fusion`` (ours), ``onnxruntime`` (the workload's
ONNX model), ``inductor`` (``torch.compile`` of the workload's torch function: ``dynamic=False``,
``dynamic=True`` when the workload has symbolic dims; its compile time is the first call's,
reported apart, never in the run times) and ``torch`` (eager; both when torch is installed).
Each engine is prepared and its outputs are checked
against the workload's NumPy reference; then all are timed together in alternating rounds
(:func:`tvm_fusion.build.engine.time_interleaved`), so that a slow phase of the machine falls on
every engine. The median and the minimum are kept and the ratios are computed from the medians.
Results go to a JSON file and a markdown table.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import platform
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tvm.target import Target

from .. import models
from ..build import engine
from ..errors import UsageError, first_line
from ..target import check_runs_here, parse_target, with_mcpu
from .analysis import kernel_count

logger = logging.getLogger(__name__)

ENGINES = ("tvm-stock", "tvm-fusion", "onnxruntime", "inductor", "torch")


def bench_target(target: Target, mcpu: str | None = None) -> Target:
    """A benchmark's target: ``target`` built for ``mcpu`` (--mcpu) when given, refused in one
    line when its code cannot run on this machine (another ISA, AVX-512 on an AVX2 CPU)."""
    target = with_mcpu(target, mcpu)
    check_runs_here(target)
    return target


def matmul_onnx(w: np.ndarray, rows: int):
    """An ONNX model ``y = x @ w`` (``MatMul``) of an (rows, k) float32 input ``x`` by the
    constant ``w`` (k, n): a model's weight, as the GEMM benchmarks give ONNX Runtime."""
    import onnx
    from onnx import TensorProto, helper

    k, n = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])],
        [onnx.numpy_helper.from_array(np.asarray(w, "float32"), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def parse_engines(spec: str | Sequence[str] | None) -> list[str]:
    names = (
        list(ENGINES)
        if spec is None
        else (
            [s.strip() for s in spec.split(",") if s.strip()]
            if isinstance(spec, str)
            else list(spec)
        )
    )
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise UsageError(f"unknown engine(s) {', '.join(unknown)}; known: {', '.join(ENGINES)}")
    if not names:  # ``--engines ''``: an empty table, exit 0
        raise UsageError(f"--engines names no engine; known: {', '.join(ENGINES)}")
    return names


@dataclasses.dataclass
class EngineResult:
    engine: str
    median_ms: float | None = None
    min_ms: float | None = None
    runs: int = 0
    max_abs_err: float | None = None
    ok: bool | None = None
    kernels: int | None = None
    compile_s: float | None = None
    skipped: str | None = None  # why the engine did not run

    def set_timing(self, timing: dict) -> None:
        """Keep a timing of :func:`tvm_fusion.build.engine.time_interleaved` / ``time_runs``."""
        self.median_ms = timing["median_ms"]
        self.min_ms = timing["min_ms"]
        self.runs = timing["runs"]


@dataclasses.dataclass
class WorkloadResult:
    workload: str
    size: str
    expect: str
    engines: dict[str, EngineResult]

    def ratio(self, num: str, den: str) -> float | None:
        return ratio(self.engines, num, den)


def ratio(engines: dict[str, EngineResult], num: str, den: str) -> float | None:
    """Median of ``num`` over median of ``den``, None when either did not run."""
    a, b = engines.get(num), engines.get(den)
    if not a or not b or a.median_ms is None or b.median_ms is None or not b.median_ms:
        return None
    return a.median_ms / b.median_ms


def ratios(engines: dict[str, EngineResult], names: Sequence[str]) -> dict[str, float | None]:
    """``{"tvm-fusion/<engine>": ratio}`` for every other engine of ``names``."""
    return {f"tvm-fusion/{e}": ratio(engines, "tvm-fusion", e) for e in names if e != "tvm-fusion"}


def table_head(lead: Sequence[str], names: Sequence[str]) -> list[str]:
    """A table's header and rule: ``lead`` columns, ms per engine, then the columns that
    :func:`row_tail` fills (ours over every other engine, the outputs check)."""
    header = [*lead, *(f"{e} ms" for e in names)]
    if "tvm-fusion" in names:
        header += [f"ours/{e}" for e in names if e != "tvm-fusion"]
    header.append("outputs")
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]


def row_tail(engines: dict[str, EngineResult], names: Sequence[str]) -> list[str]:
    """The last cells of a table row: ours over every other engine, then the outputs check."""
    cells = []
    if "tvm-fusion" in names:
        cells += [_fmt_ratio(ratio(engines, "tvm-fusion", e)) for e in names if e != "tvm-fusion"]
    bad = [e for e, r in engines.items() if r.ok is False]
    cells.append("ok" if not bad else "MISMATCH: " + ",".join(bad))
    return cells


def skipped_notes(rows: Sequence[tuple[str, dict[str, EngineResult]]], title: str) -> list[str]:
    """``title`` and one line per engine that did not run, under a table."""
    notes = [
        f"- {label}, {name}: {r.skipped}"
        for label, engines in rows
        for name, r in engines.items()
        if r.skipped
    ]
    return ["", f"{title}:", *notes] if notes else []


def prepare_engine(
    name: str,
    inst: models.Instance,
    target: Target,
    tvm_options: dict | None = None,
) -> tuple[EngineResult, Callable | None]:
    """Prepare one engine for one workload instance and check its outputs; the runner to time
    (None when the engine is skipped). ``target``: a parsed Target."""
    result = EngineResult(name)
    if name in inst.skip:
        result.skipped = inst.skip[name]
        return result, None
    threads = engine.threads_for(target)
    reference = inst.reference(*inst.input_list())
    run: Callable
    if name in ("tvm-stock", "tvm-fusion"):
        pipeline = "stock" if name == "tvm-stock" else "tvm_fusion"
        opts = {} if pipeline == "stock" else dict(tvm_options or {})
        compiled = engine.compile_module(inst.mod, target, pipeline, **opts)
        result.kernels = kernel_count(compiled.lowered)
        result.compile_s = round(compiled.compile_s, 3)
        runner = engine.TvmRunner(compiled, inst.input_list())
        outputs = runner.outputs()
        run = runner
    elif name == "onnxruntime":
        if not _have("onnxruntime"):
            result.skipped = "onnxruntime is not installed (pip install tvm-fusion[bench])"
            return result, None
        if inst.onnx_model is None:
            result.skipped = "no ONNX model for this workload"
            return result, None
        run = engine.onnxruntime_runner(inst.onnx_model, inst.inputs, threads)
        outputs = [np.asarray(o) for o in run()]
    elif name in ("torch", "inductor"):
        if not _have("torch"):
            result.skipped = "torch is not installed"
            return result, None
        if inst.torch_fn is None:
            result.skipped = "no torch function for this workload (ONNX only)"
            return result, None
        if name == "torch":
            run = engine.torch_runner(inst.torch_fn, inst.input_list(), threads)
            outputs = run()
        else:
            dynamic = symbolic(inst.mod)
            try:
                run, outputs, compile_s = engine.inductor_runner(
                    inst.torch_fn, inst.input_list(), threads, dynamic
                )
            except Exception as err:  # Inductor's many error types (no C++ compiler, ...)
                result.skipped = f"torch.compile failed: {first_line(err)}"
                return result, None
            result.compile_s = round(compile_s, 3)
    else:  # pragma: no cover - parse_engines guards this
        raise UsageError(f"unknown engine {name}")
    result.max_abs_err = engine.max_error(outputs, reference)
    result.ok = engine.allclose(outputs, reference, inst.rtol, inst.atol)
    if not result.ok:
        logger.warning(
            "%s on %s differs from the reference (max abs err %.3g)",
            name,
            inst.name,
            result.max_abs_err,
        )
    return result, run


def symbolic(mod) -> bool:
    """Whether ``mod``'s ``main`` takes a tensor of a symbolic (or unknown) shape."""
    from tvm import relax, tirx

    for param in mod["main"].params:
        sinfo = param.ty
        if not isinstance(sinfo, relax.TensorType):
            continue
        if sinfo.shape is None or not isinstance(sinfo.shape, relax.ShapeExpr):
            return True
        if any(not isinstance(v, tirx.IntImm) for v in sinfo.shape.values):
            return True
    return False


def run_bench(
    workloads: Sequence[str] | None = None,
    engines: Sequence[str] | None = None,
    size: str = "seed",
    target=None,
    repeat: int = 10,
    budget_s: float = 10.0,
    tvm_options: dict | None = None,
    progress: Callable[[str], None] | None = None,
    min_time_s: float = 0.0,
) -> list[WorkloadResult]:
    """Every engine on every workload; ``target`` is parsed here (what
    :func:`~tvm_fusion.target.parse_target` takes; None: the host)."""
    names = list(workloads) if workloads else models.names()
    for n in names:
        models.get(n)  # unknown names fail before any work
    engine_names = parse_engines(engines)
    tgt = parse_target(target)
    results = []
    for wname in names:
        inst = models.build(wname, size)
        per_engine, runs = {}, {}
        for ename in engine_names:
            if progress:
                progress(f"{wname}: {ename}")
            per_engine[ename], run = prepare_engine(ename, inst, tgt, tvm_options)
            if run is not None:
                runs[ename] = run
        timings = engine.time_interleaved(
            runs, repeat=repeat, budget_s=budget_s, min_time_s=min_time_s
        )
        for ename, timing in timings.items():
            per_engine[ename].set_timing(timing)
        results.append(WorkloadResult(wname, size, inst.expect, per_engine))
    return results


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else (f"{value:.3f}" if value < 10 else f"{value:.1f}")


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown_table(results: Sequence[WorkloadResult], engines: Sequence[str]) -> str:
    """One row per workload: kernels, median ms per engine, ratios of ours to the others."""
    lines = table_head(["workload", "kernels stock/ours"], engines)
    for res in results:
        stock = res.engines.get("tvm-stock")
        ours = res.engines.get("tvm-fusion")
        kernels = "/".join(
            "-" if r is None or r.kernels is None else str(r.kernels) for r in (stock, ours)
        )
        row = [res.workload, kernels]
        row += [
            _fmt_ms(res.engines[e].median_ms)
            if e in res.engines and not res.engines[e].skipped
            else "skip"
            for e in engines
        ]
        row += row_tail(res.engines, engines)
        lines.append("| " + " | ".join(row) + " |")
    lines += compile_notes([(r.workload, r.engines) for r in results])
    lines += skipped_notes([(r.workload, r.engines) for r in results], "Skipped")
    return "\n".join(lines)


def compile_notes(rows: Sequence[tuple[str, dict[str, EngineResult]]]) -> list[str]:
    """One line per row: the engines' compile seconds (Inductor's: its first call), which the
    run times above leave out."""
    notes = []
    for label, engines in rows:
        cells = [f"{n} {r.compile_s:.1f}" for n, r in engines.items() if r.compile_s is not None]
        if cells:
            notes.append(f"- {label}: {', '.join(cells)}")
    return ["", "Compile s (not in the run times):", *notes] if notes else []


def machine_info(target) -> dict:
    """The machine, the versions and ``target`` (parsed here: what
    :func:`~tvm_fusion.target.parse_target` takes) of a results file."""
    import tvm

    tgt = parse_target(target)
    info = {
        "platform": platform.platform(),
        "processor": _cpu_name(),
        "python": platform.python_version(),
        "tvm": tvm.__version__,
        "target": str(tgt),
        "threads": engine.threads_for(tgt),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    for module in ("onnxruntime", "torch"):
        if _have(module):
            info[module] = __import__(module).__version__
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_results(
    results: Sequence[WorkloadResult], engines, target, path: str | Path, extra: dict | None = None
) -> Path:
    """Write ``results`` as JSON to ``path`` and the markdown table beside it (``.md``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": machine_info(target),
        **(extra or {}),
        "engines": list(engines),
        "results": [
            {
                "workload": r.workload,
                "size": r.size,
                "expect": r.expect,
                "engines": {k: dataclasses.asdict(v) for k, v in r.engines.items()},
                "ratios": ratios(r.engines, engines),
            }
            for r in results
        ],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    path.with_suffix(".md").write_text(
        f"# Benchmark ({payload['machine']['processor']}, {payload['machine']['threads']} "
        f"threads, {payload['machine']['date']})\n\nMedian ms per run, engines timed in "
        "alternating rounds.\n\n" + markdown_table(results, engines) + "\n"
    )
    return path
