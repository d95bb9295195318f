"""One ONNX case, run in the fuzzer's worker: ONNX Runtime's outputs (the reference), ours
(:func:`tvm_fusion.frontend.load_onnx` and the ``tvm_fusion`` pipeline for
:func:`tvm_fusion.host_target`), the comparison and the outcome; a refusal counts only where
stock TVM (its importer and pipeline) fails too. And the files of a case (``model.onnx``,
``inputs.npz``, ``reason.txt``) that the worker reads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from .common import _run_tvm, compare


def ort_outputs(model, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 4
    # ORT's graph optimisations are off: at ORT_ENABLE_ALL onnxruntime 1.31 gathers nothing
    # from Range(n - 2, -2, -1) -> Gather (an empty result where ONNX's reference has n rows)
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def _stock_runs(model, feeds) -> bool:
    """Whether stock TVM (its importer and pipeline) runs ``model`` and matches ORT."""
    from ...frontend.onnx_ops import stock_from_onnx

    try:
        outs = _run_tvm(stock_from_onnx(model), "stock", feeds)
        refs = [ort_outputs(model, f) for f in feeds]
    except Exception:
        return False
    return all(compare(o, r) is None for o, r in zip(outs, refs, strict=True))


def run_case(model, feeds, engine_fn: Callable | None = None) -> tuple[str, str]:
    """(outcome, one-line reason) of one case; ``engine_fn(model, feeds)`` replaces ours
    (load_onnx + the tvm_fusion pipeline) in tests of the checker."""
    from ...errors import TvmFusionError, first_line

    order = [i.name for i in model.graph.input]  # the imported function's parameters
    feeds = [{name: f[name] for name in order} for f in feeds]
    try:
        refs = [ort_outputs(model, f) for f in feeds]
    except Exception as err:
        return "discarded", f"ORT: {first_line(err)}"
    try:
        if engine_fn is not None:
            outs = engine_fn(model, feeds)
        else:
            from ...frontend.load import load_onnx

            outs = _run_tvm(load_onnx(model), "tvm_fusion", feeds)
    except TvmFusionError as err:
        if _stock_runs(model, feeds):
            return "failure", f"refused, but stock TVM runs it: {err}"
        return "refused", str(err)
    except Exception as err:
        return "failure", f"{type(err).__name__}: {first_line(err)}"
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        why = compare(out, ref)
        if why:
            sizes = {k: v.shape for k, v in feeds[i].items()}
            return "failure", f"wrong result on feed {i} {sizes}: {why}"
    return "ok", ""


def save_case(directory: Path, model, feeds, reason: str = "") -> Path:
    """``model.onnx``, ``inputs.npz`` (``0/x``, ``1/x``: the two feeds) and ``reason.txt``."""
    import onnx

    directory.mkdir(parents=True, exist_ok=True)
    onnx.save(model, directory / "model.onnx")
    arrays = {f"{i}/{k}": v for i, feed in enumerate(feeds) for k, v in feed.items()}
    np.savez(directory / "inputs.npz", **arrays)
    if reason:
        (directory / "reason.txt").write_text(reason.splitlines()[0] + "\n")
    return directory


def load_case(directory: Path):
    import onnx

    model = onnx.load(directory / "model.onnx")
    feeds: list[dict] = [{}, {}]
    with np.load(directory / "inputs.npz") as data:
        for key in data.files:
            i, name = key.split("/", 1)
            feeds[int(i)][name] = data[key]
    return model, feeds
