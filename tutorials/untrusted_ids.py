"""Untrusted token ids: an embedding lookup that refuses a bad id instead of reading the heap.

ONNX ``Gather`` of a model input (token ids into an embedding table) is imported as
``take(table, ids, mode="fast")``: no bounds check. With an id past the table, stock TVM reads
whatever memory lies behind it (different numbers on every run) or dies; ONNX Runtime refuses
the call (``INVALID_ARGUMENT: indices element out of data bounds``). ``CheckGatherBounds`` puts
a small check kernel in front of every take whose ids are not proven in range, so a bad id
raises one ``IndexError`` naming the table and the model input, and good ids cost next to
nothing (the check writes nothing; the take reads the ids in place).

This tutorial builds a tiny embedding + projection model, compiles it with the ``tvm_fusion``
pipeline with and without the check, compares both with ONNX Runtime, times them in
alternating rounds, then feeds bad ids (past the end by one, by 10**8, and below ``-n``) to the
checked build. Stock TVM is not run on bad ids here: that would read outside the table.

Run it::

    .venv/bin/python tutorials/untrusted_ids.py
    .venv/bin/python tutorials/untrusted_ids.py --size small
"""

import argparse

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import tvm_fusion
from tvm_fusion.build import engine
from tvm_fusion.transform import collect_rewrites

SIZES = {"small": (100, 16, 7), "seed": (50257, 768, 512)}  # vocab, hidden, tokens


def embedding_model(vocab: int, hidden: int):
    """ids (batch, seq) int64 -> Gather(table, ids) @ W: the first layer of every language
    model, with a dynamic batch and sequence."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((vocab, hidden)).astype("float32")
    proj = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype("float32")
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0),
            helper.make_node("MatMul", ["emb", "proj"], ["y"]),
        ],
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", hidden])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(proj, "proj")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def main(size: str = "seed", repeat: int = 50) -> dict:
    vocab, hidden, tokens = SIZES[size]
    model = embedding_model(vocab, hidden)
    ids = np.random.default_rng(1).integers(-vocab, vocab, (1, tokens)).astype("int64")
    target = tvm_fusion.host_target()

    # 1. Compile with the check (the default) and without it.
    runners, builds = {}, {}
    for checked in (True, False):
        with collect_rewrites() as counts:
            compiled = engine.compile_module(
                tvm_fusion.load_onnx(model), target, check_gather_bounds=checked
            )
        label = "checked" if checked else "unchecked"
        print(f"{label}: CheckGatherBounds inserted {counts.get('CheckGatherBounds', 0)} check(s)")
        builds[label] = compiled
        runners[label] = engine.TvmRunner(compiled, [ids])

    # 2. Good ids (negative ones count from the end, as ONNX says): both builds give ORT's
    #    numbers, bit for bit the same as each other.
    ort = engine.onnxruntime_runner(model, {"ids": ids}, threads=1)()
    checked_out = runners["checked"].outputs()
    np.testing.assert_array_equal(checked_out[0], runners["unchecked"].outputs()[0])
    np.testing.assert_allclose(checked_out[0], ort[0], rtol=1e-4, atol=1e-4)

    # 3. What the check costs: both builds in alternating rounds, medians.
    times = engine.time_interleaved(runners, repeat=repeat, budget_s=2.0)
    on, off = times["checked"]["median_ms"], times["unchecked"]["median_ms"]
    print(f"{tokens} ids: checked {on * 1e3:.1f} us, unchecked {off * 1e3:.1f} us per call")

    # 4. Bad ids: each one raises, naming the table and the model input; none reads memory.
    vm_errors = {}
    for label, bad in (("past the end", vocab), ("10**8", 10**8), ("below -n", -vocab - 1)):
        wrong = ids.copy()
        wrong[0, -1] = bad
        try:
            engine.TvmRunner(builds["checked"], [wrong]).outputs()
        except Exception as err:  # the VM raises the kernel's assertion as a TVM error
            message = str(err).strip().splitlines()[-1]
            assert "index out of range" in message, message
            vm_errors[label] = message
            print(f"id {bad}: {message}")
        else:
            raise AssertionError(f"id {bad} was not refused")
    return {"checked_ms": on, "unchecked_ms": off, "errors": vm_errors}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="seed")
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    main(args.size, args.repeat)
