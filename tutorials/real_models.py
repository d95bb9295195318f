"""A real exported model from torch.onnx.export to a compiled ``.so``: BertForMaskedLM + loss.

``transformers``' ``BertForMaskedLM(..., labels=...)`` exported with torch's TorchScript
exporter is a typical first model for a TVM user, and stock TVM cannot import it: the loss is an
ONNX ``SoftmaxCrossEntropyLoss``, and the attention mask is built with ``ConstantOfShape`` of an
empty shape. ``tvm_fusion.load_onnx`` imports it with the batch and sequence axes symbolic; the
``tvm_fusion`` pipeline then fuses the loss (FuseCrossEntropy: the ``[N, V]`` log-probabilities
are never written), turns shape chains into symbolic shapes (PlaceShapeOnHost), slices instead of
gathering (GatherToSlice) and keeps boundary reshapes out of kernels (StripBookendViews).

Steps: 1. the ONNX file (exported here when torch, transformers and onnxscript are installed and
``--export`` is given, else the checked-in ``tests/corpus/bert_mlm_torchscript.onnx``, written
by ``scripts/export_corpus.py``); 2. stock TVM's importer on it; 3. ``load_onnx``; 4. what our
passes rewrite, kernels stock vs ours; 5. ``tvm.compile(..., relax_pipeline="tvm_fusion")`` and
``export_library`` to a ``.so``; 6. the ``.so`` loaded back and run at two batch/sequence sizes,
compared with ONNX Runtime and timed beside it.

Run it::

    .venv/bin/python tutorials/real_models.py                # batch 8, sequence 64
    .venv/bin/python tutorials/real_models.py --size small   # batch 2, sequence 5
    .venv/bin/python tutorials/real_models.py --export       # export the model again first
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import tvm
from tvm import relax

import tvm_fusion
from tvm_fusion import analysis, load_onnx
from tvm_fusion.build import engine
from tvm_fusion.errors import first_line
from tvm_fusion.frontend.onnx_ops import stock_from_onnx

ROOT = Path(__file__).resolve().parents[1]
CORPUS_FILE = ROOT / "tests" / "corpus" / "bert_mlm_torchscript.onnx"


def export(out_dir: Path) -> Path:
    """Export BertForMaskedLM (a small config, random weights) with the corpus script."""
    import importlib.util

    script_path = ROOT / "scripts" / "export_corpus.py"
    spec = importlib.util.spec_from_file_location("export_corpus", script_path)
    script = importlib.util.module_from_spec(spec)
    sys.modules["export_corpus"] = script  # its dataclasses look themselves up there
    spec.loader.exec_module(script)
    script.S = script.dataclasses.replace(script.S, out=out_dir)
    entry = script.export_one("bert_mlm", "torchscript")
    return out_dir / entry["file"]


def inputs_for(batch: int, seq: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    vocab = 128  # the corpus config's vocabulary
    labels = rng.integers(0, vocab, (batch, seq)).astype("int64")
    labels[:, ::3] = -100  # positions that are not masked: the loss ignores them
    mask = np.ones((batch, seq), "int64")
    mask[0, -1] = 0  # one padded position
    return {
        "input_ids": rng.integers(0, vocab, (batch, seq)).astype("int64"),
        "attention_mask": mask,
        "labels": labels,
    }


def main(size: str = "seed", repeat: int = 5, do_export: bool = False) -> dict:
    target = tvm_fusion.host_target()
    work = Path(tempfile.mkdtemp(prefix="tvm_fusion_real_"))

    # 1. The ONNX file.
    path = export(work) if do_export else CORPUS_FILE
    model = onnx.load(str(path))
    print(
        f"model: {path.name}, {len(model.graph.node)} ONNX nodes, inputs "
        + ", ".join(i.name for i in model.graph.input)
    )

    # 2. Stock TVM's importer (what `relax.frontend.onnx.from_onnx` does without us).
    try:
        stock_from_onnx(model)
        stock_import = "imports"
    except Exception as err:  # noqa: BLE001 - the point is to show the error
        stock_import = first_line(err)
    print(f"stock TVM import: {stock_import}")

    # 3. Our importer: batch and sequence stay symbolic.
    mod = load_onnx(path)
    print("main:", [f"{p.name}: {p.ty.shape}" for p in mod["main"].params])

    # 4. What our passes do to it.
    report = analysis.fusion_report(mod, target, name=path.stem)
    print(report.to_text().split("  stock groups:")[0])

    # 5. Compile with the registered pipeline, export a shared library.
    with target:
        executable = tvm.compile(mod, target, relax_pipeline="tvm_fusion")
    so_path = work / f"{path.stem}.so"
    executable.export_library(str(so_path))
    print(f"wrote {so_path} ({so_path.stat().st_size / 1024:.0f} KiB)")

    # 6. Load the .so (a deployment needs only TVM's runtime) and run it at two sizes.
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(so_path)), tvm.cpu())
    rng = np.random.default_rng(0)
    sizes = [(2, 5), (3, 7)] if size == "small" else [(8, 64), (4, 32)]
    results = {"stock_import": stock_import, "rewrites": dict(report.rewrites)}
    for batch, seq in sizes:
        feeds = inputs_for(batch, seq, rng)
        ort = engine.onnxruntime_runner(model, feeds, engine.threads_for(target))
        want = ort()
        args = [tvm.runtime.tensor(feeds[i.name]) for i in model.graph.input]

        def ours(args=args):
            return vm["main"](*args)

        got = engine.as_list(ours())
        err = engine.max_error(got, want)
        assert err < 1e-3, f"({batch}, {seq}): max abs error {err} against ONNX Runtime"
        t_ours = engine.time_runs(ours, repeat=repeat, budget_s=10.0)["median_ms"]
        t_ort = engine.time_runs(ort, repeat=repeat, budget_s=10.0)["median_ms"]
        print(
            f"batch {batch}, seq {seq}: loss {float(got[0]):.4f} (ORT {float(want[0]):.4f}), "
            f"max abs err {err:.2e}; median {t_ours:.3f} ms vs ORT {t_ort:.3f} ms "
            f"({t_ours / t_ort:.2f}x)"
        )
        results[(batch, seq)] = {"max_error": err, "ours_ms": t_ours, "ort_ms": t_ort}
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="seed", choices=["seed", "small"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--export", action="store_true", help="export the model with torch first")
    args = parser.parse_args()
    main(args.size, args.repeat, args.export)
