"""Shape sweep: single-op ONNX models at awkward sizes, ours against ONNX Runtime.

Held-out checks found cliffs just outside our corpus' friendly sizes: a vocabulary of 50257, a
prime number of columns, rows of 77, a GEMV of 4093 fell to slow schedules (71x ORT on GPT-2's
LM head). The sweep is how we keep that from coming back: each case is one ONNX operator (or
the handful a frontend emits for it) built here with :mod:`onnx.helper`, imported with
:func:`tvm_fusion.load_onnx`, compiled with the ``tvm_fusion`` pipeline, checked against ONNX
Runtime's output and timed against it with :func:`engine.time_interleaved` (alternating
rounds, a pause before each block, medians of warm calls). Each result also names the rule
that scheduled each kernel, so that a case that fell to the fallback rule shows.

Families: GEMM with a constant weight (ONNX ``Gemm``, transB, bias), GEMM of two inputs
(``MatMul``), batched ``MatMul`` (attention's scores and context), ``Softmax``,
``LogSoftmax``, ``LayerNormalization``, RMS norm (as exporters write it: ``Pow``,
``ReduceMean``, ``Add``, ``Sqrt``, ``Div``, ``Mul``), ``SoftmaxCrossEntropyLoss`` (our fused
cross entropy) and a gated MLP (``MatMul``, ``Split``, SiLU gate times up: our gate kernel).
Sizes come from a fixed seed in 1..4096 with primes among them, plus the vocabularies of real
models (GPT-2 50257, BERT 30522, CLIP 49408, XLM-R 250002, Llama-3 128256, Qwen 151936).

``python scripts/bench_sweep.py`` runs it and writes ``bench/sweep.json`` and ``.md``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

VOCABULARIES = {
    "gpt2": 50257,
    "bert": 30522,
    "clip": 49408,
    "xlm-r": 250002,
    "llama3": 128256,
    "qwen": 151936,
}
PRIMES = (3, 7, 13, 31, 61, 97, 127, 211, 389, 509, 769, 1021, 2039, 4093)
FAMILIES = (
    "gemm",
    "matmul",
    "bmm",
    "softmax",
    "log_softmax",
    "layer_norm",
    "rms_norm",
    "cross_entropy",
    "gate",
)


@dataclasses.dataclass
class Case:
    """One single-op model: ``family`` and its dims (``m``, ``k``, ``n``, ``batch``...)."""

    family: str
    dims: dict[str, int]
    note: str = ""

    @property
    def name(self) -> str:
        return f"{self.family} " + "x".join(str(v) for v in self.dims.values())

    def build(self, seed: int = 0):
        """(onnx.ModelProto, {input name: array})."""
        return _BUILDERS[self.family](np.random.default_rng(seed), **self.dims)


# ---------------------------------------------------------------------------------------------
# Models


def _model(nodes, inputs, outputs, initializers=(), opset: int = 18):
    from onnx import helper

    graph = helper.make_graph(nodes, "sweep", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _tensor(name: str, shape, elem=None):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, elem or TensorProto.FLOAT, list(shape))


def _init(name: str, array: np.ndarray):
    from onnx import numpy_helper

    return numpy_helper.from_array(array, name)


def _f32(rng, *shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype("float32")


def _gemm(rng, m: int, k: int, n: int):
    from onnx import helper

    w, b = _f32(rng, n, k, scale=k**-0.5), _f32(rng, n)
    node = helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)
    model = _model(
        [node], [_tensor("x", (m, k))], [_tensor("y", (m, n))], [_init("w", w), _init("b", b)]
    )
    return model, {"x": _f32(rng, m, k)}


def _matmul(rng, m: int, k: int, n: int):
    from onnx import helper

    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    model = _model([node], [_tensor("a", (m, k)), _tensor("b", (k, n))], [_tensor("y", (m, n))])
    return model, {"a": _f32(rng, m, k), "b": _f32(rng, k, n, scale=k**-0.5)}


def _bmm(rng, batch: int, m: int, k: int, n: int):
    from onnx import helper

    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    model = _model(
        [node],
        [_tensor("a", (batch, m, k)), _tensor("b", (batch, k, n))],
        [_tensor("y", (batch, m, n))],
    )
    return model, {"a": _f32(rng, batch, m, k), "b": _f32(rng, batch, k, n, scale=k**-0.5)}


def _row_op(op: str):
    def build(rng, m: int, n: int):
        from onnx import helper

        node = helper.make_node(op, ["x"], ["y"], axis=-1)
        model = _model([node], [_tensor("x", (m, n))], [_tensor("y", (m, n))])
        return model, {"x": _f32(rng, m, n, scale=3.0)}

    return build


def _layer_norm(rng, m: int, n: int):
    from onnx import helper

    node = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)
    inits = [_init("g", _f32(rng, n)), _init("b", _f32(rng, n))]
    model = _model([node], [_tensor("x", (m, n))], [_tensor("y", (m, n))], inits)
    return model, {"x": _f32(rng, m, n, scale=2.0)}


def _rms_norm(rng, m: int, n: int):
    from onnx import helper

    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["mse"]),
        helper.make_node("Sqrt", ["mse"], ["rms"]),
        helper.make_node("Div", ["x", "rms"], ["xn"]),
        helper.make_node("Mul", ["xn", "g"], ["y"]),
    ]
    inits = [
        _init("two", np.array(2.0, "float32")),
        _init("axes", np.array([-1], "int64")),
        _init("eps", np.array(1e-6, "float32")),
        _init("g", _f32(rng, n)),
    ]
    model = _model(nodes, [_tensor("x", (m, n))], [_tensor("y", (m, n))], inits)
    return model, {"x": _f32(rng, m, n, scale=2.0)}


def _cross_entropy(rng, m: int, n: int):
    from onnx import TensorProto, helper

    node = helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t"], ["loss"], reduction="mean")
    model = _model(
        [node],
        [_tensor("x", (m, n)), _tensor("t", (m,), TensorProto.INT64)],
        [_tensor("loss", ())],
    )
    return model, {"x": _f32(rng, m, n, scale=3.0), "t": rng.integers(0, n, m).astype("int64")}


def _gate(rng, m: int, k: int, n: int):
    """SwiGLU's gate: ``silu(x @ Wg) * (x @ Wu)`` with ``[Wg | Wu]`` one weight, then Split."""
    from onnx import helper

    w = _f32(rng, k, 2 * n, scale=k**-0.5)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Split", ["h"], ["g", "u"], axis=-1, num_outputs=2),
        helper.make_node("Sigmoid", ["g"], ["sg"]),
        helper.make_node("Mul", ["g", "sg"], ["silu"]),
        helper.make_node("Mul", ["silu", "u"], ["y"]),
    ]
    model = _model([*nodes], [_tensor("x", (m, k))], [_tensor("y", (m, n))], [_init("w", w)])
    return model, {"x": _f32(rng, m, k)}


_BUILDERS: dict[str, Callable] = {
    "gemm": _gemm,
    "matmul": _matmul,
    "bmm": _bmm,
    "softmax": _row_op("Softmax"),
    "log_softmax": _row_op("LogSoftmax"),
    "layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "cross_entropy": _cross_entropy,
    "gate": _gate,
}


# ---------------------------------------------------------------------------------------------
# Cases


def _size(rng, low: int = 1, high: int = 4096) -> int:
    """Log-uniform in [low, high]; a prime from :data:`PRIMES` one time in three."""
    if rng.random() < 1 / 3:
        primes = [p for p in PRIMES if low <= p <= high]
        if primes:
            return int(rng.choice(primes))
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def _fit(dims: dict[str, int], budget: float, keys: Sequence[str]) -> dict[str, int]:
    """Shrink ``keys`` of ``dims`` alike until their product is within ``budget``."""
    total = math.prod(dims.values())
    if total <= budget:
        return dims
    scale = (budget / total) ** (1 / len(keys))
    return {key: max(1, int(v * scale)) if key in keys else v for key, v in dims.items()}


def cases(seed: int = 0, per_family: int = 4) -> list[Case]:
    """The sweep: ``per_family`` random cases of each family from ``seed``, then the fixed
    cases (real vocabularies, GPT-2's LM head, batch 1, tiny extents). Work per case is
    bounded (about 2 GFLOP for a GEMM, 64 M elements for a row op) to keep the run short."""
    rng = np.random.default_rng(seed)
    out: list[Case] = []
    for _ in range(per_family):
        m, k, n = _size(rng, 1, 512), _size(rng), _size(rng)
        out.append(Case("gemm", _fit({"m": m, "k": k, "n": n}, 1e9, ("k", "n"))))
        m, k, n = _size(rng, 1, 512), _size(rng), _size(rng)
        out.append(Case("matmul", _fit({"m": m, "k": k, "n": n}, 1e9, ("k", "n"))))
        b, m, k, n = _size(rng, 1, 32), _size(rng, 1, 512), _size(rng, 1, 256), _size(rng, 1, 512)
        out.append(Case("bmm", _fit({"batch": b, "m": m, "k": k, "n": n}, 2e8, ("m", "n"))))
        for family in ("softmax", "log_softmax", "layer_norm", "rms_norm", "cross_entropy"):
            m, n = _size(rng, 1, 8192), _size(rng)
            out.append(Case(family, _fit({"m": m, "n": n}, 3.2e7, ("m",))))
        m, k, n = _size(rng, 1, 256), _size(rng, 16, 2048), _size(rng, 16, 2048)
        out.append(Case("gate", _fit({"m": m, "k": k, "n": n}, 5e8, ("k", "n"))))
    for label, vocab in VOCABULARIES.items():
        family = "cross_entropy" if label in ("gpt2", "llama3", "xlm-r") else "log_softmax"
        out.append(Case(family, {"m": 64, "n": vocab}, note=f"{label} vocabulary"))
    out += [
        Case("gemm", {"m": 64, "k": 768, "n": 50257}, note="GPT-2 LM head"),
        Case("gemm", {"m": 1, "k": 4093, "n": 1021}, note="GEMV, primes"),
        Case("gemm", {"m": 97, "k": 389, "n": 211}, note="primes"),
        Case("gemm", {"m": 128, "k": 1000, "n": 999}),
        Case("gemm", {"m": 3, "k": 7, "n": 5}, note="tiny"),
        Case("bmm", {"batch": 12, "m": 129, "k": 63, "n": 127}, note="attention, odd seq"),
        Case("bmm", {"batch": 12, "m": 77, "k": 64, "n": 77}, note="CLIP attention scores"),
        Case("softmax", {"m": 1000, "n": 999}),
        Case("softmax", {"m": 4096, "n": 77}, note="CLIP seq"),
        Case("layer_norm", {"m": 8191, "n": 771}),
        Case("gate", {"m": 1, "k": 1024, "n": 2816}, note="batch 1"),
        Case("gate", {"m": 77, "k": 512, "n": 1365}, note="odd units"),
    ]
    return out


# ---------------------------------------------------------------------------------------------
# Running


@dataclasses.dataclass
class SweepResult:
    case: str
    family: str
    dims: dict[str, int]
    note: str
    ours_ms: float | None = None
    ort_ms: float | None = None
    ratio: float | None = None
    ok: bool | None = None
    max_abs_err: float | None = None
    rules: dict[str, str | None] = dataclasses.field(default_factory=dict)
    fallback: list[str] = dataclasses.field(default_factory=list)
    compile_s: float | None = None
    error: str | None = None


def run_case(
    case: Case,
    target,
    repeat: int = 20,
    budget_s: float = 2.0,
    min_time_s: float = 0.3,
    rtol: float = 1e-3,
    atol: float = 1e-4,
) -> SweepResult:
    """Compile ``case`` with our pipeline, check it against ONNX Runtime, time both."""
    from ..build import engine
    from ..frontend.load import load_onnx
    from . import analysis

    result = SweepResult(case.name, case.family, dict(case.dims), case.note)
    model, inputs = case.build()
    threads = engine.threads_for(target)
    try:
        ort_run = engine.onnxruntime_runner(model, inputs, threads)
        reference = [np.asarray(o) for o in ort_run()]
        start = time.perf_counter()
        compiled = engine.compile_module(load_onnx(model), target, "tvm_fusion")
        result.compile_s = round(time.perf_counter() - start, 2)
        ours = engine.TvmRunner(compiled, [inputs[name] for name in inputs])
        outputs = ours.outputs()
    except Exception as err:  # noqa: BLE001 - a failure is a row of the table, not the end
        result.error = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        return result
    result.rules = {info.name: info.rule for info in analysis.schedule_info(compiled.lowered)}
    result.fallback = analysis.fallback_kernels(compiled.lowered)
    result.max_abs_err = engine.max_error(outputs, reference)
    result.ok = engine.allclose(outputs, reference, rtol, atol)
    timing = engine.time_interleaved(
        {"ours": ours, "ort": ort_run}, repeat=repeat, budget_s=budget_s, min_time_s=min_time_s
    )
    result.ours_ms = round(timing["ours"]["median_ms"], 4)
    result.ort_ms = round(timing["ort"]["median_ms"], 4)
    result.ratio = round(result.ours_ms / result.ort_ms, 3) if result.ort_ms else None
    return result


def summary(results: Sequence[SweepResult]) -> dict:
    ratios = [r.ratio for r in results if r.ratio]
    worst = max((r for r in results if r.ratio), key=lambda r: r.ratio, default=None)
    return {
        "cases": len(results),
        "timed": len(ratios),
        "geomean_ratio": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3)
        if ratios
        else None,
        "worst": {"case": worst.case, "ratio": worst.ratio} if worst else None,
        "over_1_3": sum(r > 1.3 for r in ratios),
        "wrong": [r.case for r in results if r.ok is False],
        "failed": [r.case for r in results if r.error],
        "fallback": [r.case for r in results if r.fallback],
    }


def markdown(results: Sequence[SweepResult], machine: dict) -> str:
    s = summary(results)
    lines = [
        "# Shape sweep: ours vs ONNX Runtime",
        "",
        f"Machine: {machine.get('processor', '?')}, {machine.get('threads', '?')} threads, "
        f"target `{machine.get('target', '?')}`, {machine.get('date', '')}. Medians of warm "
        "calls, engines alternating in rounds. Command: `python scripts/bench_sweep.py`.",
        "",
        f"Cases {s['cases']}, timed {s['timed']}; geometric mean ours/ORT "
        f"**{s['geomean_ratio']}**; worst {s['worst']}; over 1.3x: {s['over_1_3']}; wrong: "
        f"{len(s['wrong'])}; failed: {len(s['failed'])}; a kernel on the fallback rule: "
        f"{len(s['fallback'])}.",
        "",
        "| case | note | ours ms | ORT ms | ours/ORT | max err | rules |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rules = ", ".join(sorted({str(v) for v in r.rules.values()})) if r.rules else ""
        if r.error:
            lines.append(f"| {r.case} | {r.note} | | | | | failed: {r.error} |")
            continue
        err = f"{r.max_abs_err:.1e}" if r.max_abs_err is not None else ""
        flag = "" if r.ok else " WRONG"
        lines.append(
            f"| {r.case} | {r.note} | {r.ours_ms} | {r.ort_ms} | {r.ratio} | {err}{flag} "
            f"| {rules} |"
        )
    return "\n".join(lines) + "\n"


def write(results: Sequence[SweepResult], output: str | Path, machine: dict) -> None:
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "machine": machine,
        "summary": summary(results),
        "results": [dataclasses.asdict(r) for r in results],
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    md = path.with_suffix(".md")
    md.write_text(markdown(results, machine))
