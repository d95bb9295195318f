"""Cross entropy without the (N, V) log-probabilities, forward and backward.

nvFuser #2556: ``F.cross_entropy`` is ``log_softmax -> gather(targets)``. Stock TVM writes the
whole ``(N, V)`` log-softmax (128 MiB at (1024, 32768) float32) only to read one value per row
back. ``FuseCrossEntropy`` computes each row's log-sum-exp and target logit in one kernel while
the row is in cache; ignore_index, class weights and the reduction run on ``(N,)`` vectors.
Run the pass before ``relax.transform.Gradient`` and the backward is one elementwise pass over
the logits, ``softmax(x) - onehot(t)`` scaled per row, from the saved log-sum-exp.

Label smoothing as ``torch.export`` decomposes it (a gather and a row sum of the same
log-probs) is one kernel too. For a language model's head, ``FuseLinearCrossEntropy`` goes one
step further: ``hidden @ W^T`` is computed in row chunks, so the ``(N, V)`` logits never exist
at once, and ``Gradient`` recomputes each chunk's logits instead of saving them.

Run it::

    .venv/bin/python tutorials/cross_entropy.py            # (512, 32768)
    .venv/bin/python tutorials/cross_entropy.py --size small
"""

import argparse

import numpy as np
import tvm
from tvm import relax

import tvm_fusion
from tvm_fusion import analysis, models
from tvm_fusion.build import engine
from tvm_fusion.models.cross_entropy import cross_entropy_torch_np, nll_module, smoothed_module
from tvm_fusion.transform import FuseCrossEntropy, FuseLinearCrossEntropy, collect_rewrites


def main(size: str = "seed", repeat: int = 5) -> dict:
    target = tvm_fusion.host_target()
    inst = models.build("cross_entropy", size)
    x, t = inst.input_list()
    n, v = x.shape
    w = np.random.default_rng(0).uniform(0.5, 1.5, v).astype("float32")
    mod = nll_module(n, v, weights=True)  # F.cross_entropy(x, t, weight=w) as exported

    # 1. The rewrite: one kernel for the rows, (N,) vectors for the rest.
    print(FuseCrossEntropy(target)(mod)["main"])

    results = {}
    for phase in ("forward", "fwd+bwd"):
        row = {}
        outputs = {}
        for pipeline in ("stock", "tvm_fusion"):
            # 2. Our pass first, then Gradient (the kernel carries its own gradient).
            m = FuseCrossEntropy(target)(mod) if pipeline == "tvm_fusion" else mod
            fn = "main"
            if phase == "fwd+bwd":
                m = relax.transform.Gradient("main", require_grads=m["main"].params[0])(m)
                fn = "main_adjoint"
            compiled = engine.compile_module(m, target, pipeline)
            runner = engine.TvmRunner(compiled, [x, t, w], fn)
            outputs[pipeline] = runner.outputs()
            timing = engine.time_runs(runner, repeat=repeat)
            largest = max(a.elements or 0 for a in analysis.allocations(compiled.lowered))
            row[pipeline] = {"median_ms": timing["median_ms"], "largest_buffer_MB": largest / 2**18}
        diff = abs(float(outputs["tvm_fusion"][0]) - float(outputs["stock"][0]))
        assert diff <= 1e-4 * max(1.0, abs(float(outputs["stock"][0]))), diff
        results[phase] = row
        s, o = row["stock"], row["tvm_fusion"]
        print(
            f"{phase} ({size}, N={n}, V={v}): stock {s['median_ms']:.3f} ms, "
            f"tvm_fusion {o['median_ms']:.3f} ms ({s['median_ms'] / o['median_ms']:.1f}x); "
            f"largest buffer {s['largest_buffer_MB']:.2f} MB -> {o['largest_buffer_MB']:.2f} MB"
        )
    results["label_smoothing"] = label_smoothing(x, t, w, target)
    results["linear"] = linear_head(size, target)
    return results


def label_smoothing(x, t, w, target) -> float:
    """3. F.cross_entropy(x, t, weight=w, label_smoothing=0.1): still one kernel."""
    n, v = x.shape
    mod = smoothed_module(n, v, 0.1, weights=True)
    with collect_rewrites() as counts:
        compiled = engine.compile_module(mod, target, "tvm_fusion")
    (loss,) = engine.TvmRunner(compiled, [x, t, w]).outputs()
    expect = cross_entropy_torch_np(x, t, w, "mean", label_smoothing=0.1)
    assert counts["FuseCrossEntropy"] == 1 and abs(float(loss) - float(expect)) < 1e-4
    print(f"label smoothing 0.1: loss {float(loss):.5f} (PyTorch semantics {float(expect):.5f})")
    return float(loss)


def linear_head(size: str, target) -> dict:
    """4. The LM head: planned peak memory of stock's graph vs the chunked one (compiled only:
    stock's unscheduled GEMM takes minutes at the seed size)."""
    inst = models.build("linear_cross_entropy", size)
    n, v = inst.inputs["hidden"].shape[0], inst.inputs["weight"].shape[0]
    rows = None if size == "seed" else 32  # small shapes fit one default (16 MiB) chunk
    chunked = tvm.transform.Sequential(
        [FuseCrossEntropy(target), FuseLinearCrossEntropy(target, rows=rows)]
    )(inst.mod)
    stock = engine.compile_module(inst.mod, target, "stock")
    ours = engine.compile_module(chunked, target, "tvm_fusion")
    (loss,) = engine.TvmRunner(ours, inst.input_list()).outputs()
    expect = inst.reference(*inst.input_list())[0]
    assert abs(float(loss) - float(expect)) <= 1e-4 * max(1.0, abs(float(expect)))
    peaks = {
        "stock_MB": analysis.peak_bytes(stock.lowered) / 2**20,
        "ours_MB": analysis.peak_bytes(ours.lowered) / 2**20,
    }
    print(
        f"LM head (N={n}, V={v}): planned peak {peaks['stock_MB']:.2f} MB (stock) -> "
        f"{peaks['ours_MB']:.2f} MB (chunked, {peaks['ours_MB'] / peaks['stock_MB']:.2f}x)"
    )
    return peaks


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="seed", choices=models.SIZES)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    main(args.size, args.repeat)
