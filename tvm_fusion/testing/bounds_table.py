"""Bad indices against CheckGatherBounds: one small model per indexing op, its index (or slice
bound) a model input, run with ids in range and with ids out of range by 1, by 10**8 and
below ``-n``; each outcome is compared with the reference's (onnxruntime for the ONNX ops,
torch eager for torch.export's ``embedding`` / ``index_select``).

Outcomes: ``ok`` (the reference's numbers), ``error`` (an ``IndexError`` from the VM, as the
reference raises), ``wrong`` (no error where the reference raises, or other numbers),
``crash`` (the process died: only seen through :func:`run_isolated`).

    python -m tvm_fusion.testing.bounds_table GatherND ScatterND   # JSON lines, one per case

used by ``tests/transform/test_check_gather_bounds_nd.py`` and
``scripts/bench_gather_bounds.py --table``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import numpy as np

ONNX_OPS = ["Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND", "Slice"]
TORCH_OPS = ["embedding", "index_select"]
OPS = ONNX_OPS + TORCH_OPS
BAD = ["by_1", "by_1e8", "below_minus_n"]
CASES = ["in_range", *BAD]
# a Slice step of 0 (ONNX refuses it; TVM's dynamic_strided_slice divides by it)
EXTRA = {"Slice": ["step_0"]}


def cases(op: str) -> list[str]:
    return CASES + EXTRA.get(op, [])


_W2 = np.arange(8, dtype="float32").reshape(2, 4) * 0.5 - 1
_W3 = np.arange(24, dtype="float32").reshape(2, 3, 4) * 0.25 - 2
_W43 = np.arange(12, dtype="float32").reshape(4, 3) * 0.5 - 1
_W53 = np.arange(15, dtype="float32").reshape(5, 3)


def _bad(case: str, n: int) -> int:
    return {"by_1": n, "by_1e8": 10**8, "below_minus_n": -n - 1}[case]


def feeds(op: str, case: str) -> dict[str, np.ndarray]:
    """The inputs of ``op``'s model for ``case``: the in-range ones include ONNX's negative
    ids (not torch's, which refuses them); a bad case puts one bad value among good ones."""
    i64 = lambda v: np.array(v, "int64")  # noqa: E731
    good = case == "in_range"
    if op in ("Gather", "embedding", "index_select"):  # a (4, 3) table, n = 4
        ids = ([0, 3, -1] if op == "Gather" else [0, 3, 2]) if good else [0, _bad(case, 4), 1]
        return {"ids": i64(ids)}
    if op in ("GatherElements", "ScatterElements"):  # axis 1 of a (2, 4) table
        return {"ids": i64([[0, 3], [-1, -3]] if good else [[0, _bad(case, 4)], [1, 2]])}
    if op == "GatherND":  # batch_dims 1 into (2, 3, 4): the second id indexes the axis of 4
        return {"ids": i64([[[2, 3]], [[-1, -4]]] if good else [[[0, _bad(case, 4)]], [[2, 1]]])}
    if op == "ScatterND":  # (2, 3, 4): the second id indexes the axis of 3
        return {"ids": i64([[1, 2], [-2, -3]] if good else [[0, _bad(case, 3)], [1, 2]])}
    # Slice of axis 0 (5 rows): ONNX clamps out-of-range bounds, no error
    start, end, step = {
        "in_range": (1, -1, 1),
        "by_1": (0, 6, 2),
        "by_1e8": (10**8, -(10**8), -1),
        "below_minus_n": (-6, 5, 2),
        "step_0": (0, 3, 0),
    }[case]
    return {"starts": i64([start]), "ends": i64([end]), "steps": i64([step])}


def onnx_model(op: str):
    from onnx import TensorProto, helper, numpy_helper

    def value(name, shape, elem=TensorProto.INT64):
        return helper.make_tensor_value_info(name, elem, shape)

    inits = []
    if op != "Slice":
        inputs = [value("ids", list(feeds(op, "in_range")["ids"].shape))]
    if op == "Gather":
        node, data, out = helper.make_node("Gather", ["W", "ids"], ["y"], axis=0), _W43, ["k", 3]
        inputs = [value("ids", ["k"])]
    elif op in ("GatherElements", "ScatterElements"):
        names = ["W", "ids", "upd"][: 3 if op == "ScatterElements" else 2]
        node, data = helper.make_node(op, names, ["y"], axis=1), _W2
        out = [2, 4] if op == "ScatterElements" else [2, 2]
        inits.append(numpy_helper.from_array(np.array([[10, 20], [30, 40]], "float32"), "upd"))
    elif op == "GatherND":
        node, data, out = helper.make_node(op, ["W", "ids"], ["y"], batch_dims=1), _W3, [2, 1]
    elif op == "ScatterND":
        node, data, out = helper.make_node(op, ["W", "ids", "upd"], ["y"]), _W3, [2, 3, 4]
        inits.append(numpy_helper.from_array(np.full((2, 4), 9, "float32"), "upd"))
    else:
        node = helper.make_node("Slice", ["W", "starts", "ends", "axes", "steps"], ["y"])
        data, out = _W53, ["r", 3]
        inputs = [value(name, [1]) for name in ("starts", "ends", "steps")]
        inits.append(numpy_helper.from_array(np.array([0], "int64"), "axes"))
    inits.append(numpy_helper.from_array(data, "W"))
    graph = helper.make_graph([node], op, inputs, [value("y", out, TensorProto.FLOAT)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _torch_module(op: str):
    import torch

    class Lookup(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.from_numpy(_W43.copy()))

        def forward(self, ids):
            if op == "embedding":
                return torch.nn.functional.embedding(ids, self.weight)
            return torch.index_select(self.weight, 0, ids)

    return Lookup().eval()


class Runner:
    """Compiles each op's model once (our pipeline, the host CPU) and runs its cases."""

    def __init__(self):
        self._vms, self._refs = {}, {}

    def _compiled(self, op: str):
        if op not in self._vms:
            import tvm_fusion
            from tvm_fusion.build.engine import compile_module

            if op in TORCH_OPS:
                import torch

                module = _torch_module(op)
                example = (torch.from_numpy(feeds(op, "in_range")["ids"]),)
                mod = tvm_fusion.frontend.import_exported_program(
                    torch.export.export(module, example)
                )
                self._refs[op] = lambda f, m=module: [
                    t.detach().numpy() for t in [m(*(torch.from_numpy(v) for v in f.values()))]
                ]
            else:
                import onnxruntime as ort

                model = onnx_model(op)
                mod = tvm_fusion.load_onnx(model)
                sess = ort.InferenceSession(
                    model.SerializeToString(), providers=["CPUExecutionProvider"]
                )
                self._refs[op] = lambda f, s=sess: s.run(None, f)
            self._vms[op] = compile_module(mod, "llvm").vm()
        return self._vms[op]

    def run(self, op: str, case: str) -> dict:
        """``{"op", "case", "outcome", "detail"}`` of one case (see the module docstring)."""
        import tvm

        from tvm_fusion.build.engine import as_list

        vm = self._compiled(op)
        f = feeds(op, case)
        try:
            want, ref_error = self._refs[op](f), None
        except Exception as err:  # onnxruntime's Fail / InvalidArgument, torch's IndexError
            text = str(err).split("Status Message:")[-1].strip().splitlines()[0]
            want, ref_error = None, f"{type(err).__name__}: {text[:100]}"
        try:
            got = as_list(vm["main"](*(tvm.runtime.tensor(v) for v in f.values())))
        except (IndexError, ValueError) as err:
            ok = ref_error is not None
            return _row(op, case, "error" if ok else "wrong", str(err), ref_error)
        if ref_error is not None:
            return _row(op, case, "wrong", "no error", ref_error)
        same = all(
            g.shape == w.shape and np.array_equal(g, w) for g, w in zip(got, want, strict=True)
        )
        return _row(op, case, "ok" if same else "wrong", "" if same else "other numbers", None)


def _row(op, case, outcome, detail, reference) -> dict:
    return {"op": op, "case": case, "outcome": outcome, "detail": detail, "reference": reference}


def run_isolated(todo: list[tuple[str, str]], timeout: float = 600) -> list[dict]:
    """:meth:`Runner.run` of every ``(op, case)`` in a child process (``python -m`` this module),
    restarted after a case that kills it: that case's row says ``crash``."""
    rows = []
    while todo:
        spec = json.dumps(todo)
        proc = subprocess.run(
            [sys.executable, "-m", __name__, "--json", spec],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        done = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        rows += done
        todo = todo[len(done) :]
        if todo and proc.returncode != 0:
            op, case = todo.pop(0)
            code = proc.returncode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
            rows.append(_row(op, case, "crash", how, None))
        elif todo:
            raise RuntimeError(f"bounds_table child stopped early: {proc.stderr[-400:]}")
    return rows


def main(argv=None) -> int:
    import logging

    logging.disable(logging.WARNING)
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--json"]:
        todo = json.loads(args[1])
    else:
        todo = [(op, case) for op in (args or OPS) for case in cases(op)]
    runner = Runner()
    for op, case in todo:
        print(json.dumps(runner.run(op, case)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
