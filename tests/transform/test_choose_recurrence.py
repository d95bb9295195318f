"""ChooseRecurrence: recurrent layers over a static sequence as the loop kernel on CPU, as
unrolled gate steps on CUDA (issue #41, part 2).

- torch.export's ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (1 and 2 layers, both directions,
  ``batch_first``, odd sizes: sequence 1 and 7, hidden 5) reach the pipeline as one marked
  recurrence per layer and direction (``frontend/torch_rnn.py``); on llvm each is one loop
  kernel, numbers as torch's (rtol = atol = 1e-4) through ``tvm.compile(...,
  relax_pipeline="tvm_fusion")``; a symbolic batch (torch.export specialises the sequence
  length of these layers: a symbolic one fails in torch.export);
- on CUDA the same module keeps one fused gate kernel per step (compile-only for sm_90);
- must not fire: a marked call whose recurrent weight is not a constant (inlined: the
  unrolled steps), recurrences written out by hand (a cell with other weights at each step,
  an intermediate state returned), the pass switched off.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from helpers import needs_nvcc
from tvm import relax

import tvm_fusion
from tvm_fusion import target as _target
from tvm_fusion.build import engine
from tvm_fusion.frontend import import_exported_program, onnx_rnn
from tvm_fusion.lower import rnn_loop
from tvm_fusion.transform import ChooseRecurrence, collect_rewrites

torch = pytest.importorskip("torch")


def _outputs(module, x):
    with torch.no_grad():
        out = module(x)
    flat = []
    for item in out if isinstance(out, tuple) else (out,):
        flat += list(item) if isinstance(item, tuple) else [item]
    return [t.numpy() for t in flat]


def _run(mod, inputs, target=None, **flags):
    compiled = engine.compile_module(mod, target or tvm_fusion.host_target(), "tvm_fusion", **flags)
    return engine.TvmRunner(compiled, inputs).outputs(), compiled


def _export(module, x, dynamic=None):
    return import_exported_program(torch.export.export(module.eval(), (x,), dynamic_shapes=dynamic))


def _kernels(compiled) -> list[str]:
    return [gv.name_hint for gv, f in compiled.lowered.functions_items()]


@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("seq", [1, 7])
@pytest.mark.parametrize("layers, bidirectional, batch_first", [(1, False, False), (2, True, True)])
def test_torch_layers_run_as_loop_kernels(cell, seq, layers, bidirectional, batch_first):
    torch.manual_seed(seq)
    module = getattr(torch.nn, cell)(
        3, 5, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first
    ).eval()
    x = torch.randn(*((2, seq, 3) if batch_first else (seq, 2, 3)))
    mod = _export(module, x)
    target = tvm_fusion.host_target()
    with collect_rewrites() as counts:
        ex = tvm.compile(mod, target, relax_pipeline="tvm_fusion")
    loops = layers * (2 if bidirectional else 1)
    assert counts["ChooseRecurrence"] == loops
    assert counts["FuseSplitGates"] == 0  # no unrolled step left
    vm = relax.VirtualMachine(ex, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x.numpy()))
    got = [got] if isinstance(got, tvm.runtime.Tensor) else list(got)
    want = _outputs(module, x)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-4, atol=1e-4)


def test_symbolic_batch():
    torch.manual_seed(1)
    module = torch.nn.LSTM(4, 5, batch_first=True).eval()
    batch = torch.export.Dim("batch", min=1, max=16)
    mod = _export(module, torch.randn(2, 6, 4), ({0: batch},))
    for b in (1, 3):
        x = torch.randn(b, 6, 4)
        got, compiled = _run(mod, [x.numpy()])
        for g, w in zip(got, _outputs(module, x), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
    assert any(name.startswith("lstm_loop") for name in _kernels(compiled))


AVX2_2 = {"kind": "llvm", "mcpu": "znver3", "num-cores": 2}  # 16 ymm of 8 lanes, 2 cores
AVX512_2 = {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2}  # 32 zmm of 16 lanes


def _loop_of(target, module, x):
    """ChooseRecurrence of ``module`` for ``target`` (compile-only): the loop kernel's script."""
    mod = ChooseRecurrence(_target.parse_target(target))(_export(module, x))
    (kernel,) = [f for gv, f in mod.functions_items() if gv.name_hint.startswith("lstm_loop")]
    return kernel.script()


@pytest.mark.parametrize(
    "target, weight, tile, parallel",
    [
        # issue #41's nn.LSTM(256, 256) batch 8: 2**18 multiply-adds a row and step, 2**21 a step
        # of batch 8: its unit blocks in parallel from 2 rows on; 8-unit blocks (one ymm), a tile
        # of 2 rows x 4 gates (8 accumulators + 4 weight vectors + a broadcast <= 16 ymm)
        (AVX2_2, (32, 256, 4, 8), (2, 4, 8), "by_batch"),
        (AVX512_2, (16, 256, 4, 16), (4, 4, 16), "by_batch"),  # 16 lanes; 4 rows fit 32 zmm
        ({**AVX2_2, "num-cores": 1}, (32, 256, 4, 8), (2, 4, 8), "serial"),  # one core
    ],
)
def test_loop_kernel_tile_and_threads_follow_the_target(target, weight, tile, parallel):
    module = torch.nn.LSTM(256, 256, batch_first=True).eval()
    script = _loop_of(target, module, torch.randn(8, 3, 256))
    assert f"w: T.Buffer({weight}" in script, script  # the blocked recurrent weight
    assert f"acc = T.alloc_local({tile})" in script, script  # the register tile
    assert ("T.parallel" in script) == (parallel != "serial"), script
    # the parallel nest: one launch of the thread pool for all steps, a barrier after each step
    assert script.count("pragma_parallel_launch_point") == (parallel != "serial"), script
    assert script.count("pragma_parallel_barrier_when_finish") == (parallel != "serial"), script
    # by_batch: the serial nest too, chosen per call when the batch is under 2 rows
    assert ("batch >= T.int64(2)" in script) == (parallel == "by_batch"), script


def test_tile_rows_fit_the_vector_registers():
    # (rows + 1) x gates x vectors per block + 1 broadcast <= registers, at most ROWS (4)
    assert [rnn_loop.tile_rows(k, 8, 8, 16) for k in ("LSTM", "GRU", "RNN")] == [2, 4, 4]
    assert [rnn_loop.tile_rows(k, 16, 16, 32) for k in ("LSTM", "GRU", "RNN")] == [4, 4, 4]
    assert rnn_loop.tile_rows("LSTM", 16, 8, 16) == 1  # two ymm per block: 8 + 8 + 1 > 16
    assert rnn_loop.parallel_mode("LSTM", 256, 2) == "by_batch"
    assert rnn_loop.parallel_mode("LSTM", 512, 2) == "parallel"  # 2**20 a row
    assert rnn_loop.parallel_mode("GRU", 1024, 1) == "serial"


def test_symbolic_batch_takes_the_serial_or_parallel_steps_by_its_batch(monkeypatch):
    """The step's unit blocks on one thread under ``min_rows`` batch rows, in parallel from
    there (one kernel, both nests): numbers as torch's on both sides (3 rows here)."""
    monkeypatch.setattr(rnn_loop, "PARALLEL_MIN_MACS", 3 * 4 * 19 * 19)
    torch.manual_seed(2)
    module = torch.nn.LSTM(4, 19, batch_first=True).eval()
    batch = torch.export.Dim("batch", min=1, max=16)
    mod = _export(module, torch.randn(2, 5, 4), ({0: batch},))
    target = tvm_fusion.host_target(num_cores=2)
    compiled = engine.compile_module(mod, target, "tvm_fusion")
    (kernel,) = [f for gv, f in compiled.lowered.functions_items() if "lstm_loop" in gv.name_hint]
    assert "batch >= T.int64(3)" in kernel.script() and "T.parallel" in kernel.script()
    for b in (1, 2, 3, 5):
        x = torch.randn(b, 5, 4)
        got = engine.TvmRunner(compiled, [x.numpy()]).outputs()
        for g, w in zip(got, _outputs(module, x), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def _fusion(mod, target):
    with target, collect_rewrites() as counts:
        out = tvm.transform.Sequential(tvm_fusion.fusion_passes(target))(mod)
    return out, counts


def test_loop_kernel_on_llvm_unrolled_steps_on_cuda():
    module = torch.nn.LSTM(6, 8, bidirectional=True, batch_first=True)
    mod = _export(module, torch.randn(2, 3, 6))
    cpu, counts = _fusion(mod, tvm_fusion.host_target())
    assert counts["ChooseRecurrence"] == 2 and counts["FuseSplitGates"] == 0
    names = [gv.name_hint for gv, _ in cpu.functions_items()]
    assert sum(n.startswith("lstm_loop") for n in names) == 2, names
    gpu, counts = _fusion(mod, _target.cuda_target())
    assert counts["ChooseRecurrence"] == 0 and counts["FuseSplitGates"] == 2 * 3
    names = [gv.name_hint for gv, _ in gpu.functions_items()]
    assert not any("loop" in n or "steps" in n for n in names), names  # inlined


@needs_nvcc
def test_cuda_build_keeps_the_gate_kernels():
    module = torch.nn.GRU(6, 8, batch_first=True)
    mod = _export(module, torch.randn(2, 3, 6))
    compiled = engine.compile_module(mod, _target.cuda_target(), "tvm_fusion")
    names = _kernels(compiled)
    assert not any("loop" in n for n in names), names
    assert any(n.startswith("fused_gates") for n in names), names  # equal steps share one


def _marked_module(weight_is_constant: bool):
    """``main(proj[, r])``: one marked LSTM direction (hidden 5, seq 4, batch 2)."""
    rng = np.random.default_rng(0)
    r = rng.standard_normal((20, 5)).astype("float32") * 0.5
    rb = rng.standard_normal(20).astype("float32") * 0.5
    spec = {"kind": "LSTM", "hidden": 5, "reverse": False, "zero_init": True}
    spec.update(batch_major=False, bias=True)
    proj = relax.Var("proj", relax.TensorType([4, 2, 20], "float32"))
    r_var = relax.Var("r", relax.TensorType([20, 5], "float32"))
    params = [proj] if weight_is_constant else [proj, r_var]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            args = [proj, relax.const(r) if weight_is_constant else r_var, relax.const(rb)]
            gv = bb.add_func(onnx_rnn._marked(spec, args, "float32"), "lstm_steps")
            out = bb.emit_output(bb.emit(relax.Call(gv, args)))
        bb.emit_func_output(out)
    return bb.get(), r


def test_marked_call_with_a_non_constant_weight_is_inlined():
    mod, r = _marked_module(weight_is_constant=False)
    with collect_rewrites() as counts:
        after = ChooseRecurrence(target=tvm_fusion.host_target())(mod)
    assert counts["ChooseRecurrence"] == 0
    assert [gv.name_hint for gv, _ in after.functions_items()] == ["main"]
    proj = np.random.default_rng(1).standard_normal((4, 2, 20)).astype("float32")
    constant, _ = _marked_module(weight_is_constant=True)
    unrolled, _ = _run(mod, [proj, r])
    loop, compiled = _run(constant, [proj])
    assert any(n.startswith("lstm_loop") for n in _kernels(compiled))
    for u, w in zip(unrolled, loop, strict=True):
        np.testing.assert_allclose(u, w, rtol=1e-4, atol=1e-5)


class _HandCells(torch.nn.Module):
    """An LSTMCell per step (other weights each step), or one cell whose intermediate cell
    state is returned as well."""

    def __init__(self, shared: bool):
        super().__init__()
        self.shared = shared
        self.cells = torch.nn.ModuleList(torch.nn.LSTMCell(4, 5) for _ in range(1 if shared else 3))

    def forward(self, x):
        h = c = torch.zeros(x.shape[1], 5)
        seen = []
        for t in range(x.shape[0]):
            h, c = self.cells[0 if self.shared else t](x[t], (h, c))
            seen.append(c)
        return (h, seen[1]) if self.shared else h


@pytest.mark.parametrize("shared", [False, True])
def test_hand_written_recurrences_are_left_alone(shared):
    torch.manual_seed(3)
    module = _HandCells(shared).eval()
    x = torch.randn(3, 2, 4)
    mod = _export(module, x)
    _, counts = _fusion(mod, tvm_fusion.host_target())
    assert counts["ChooseRecurrence"] == 0
    got, _ = _run(mod, [x.numpy()])
    for g, w in zip(got, _outputs(module, x), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_switched_off_keeps_the_unrolled_steps():
    torch.manual_seed(4)
    module = torch.nn.LSTM(4, 5).eval()
    x = torch.randn(3, 2, 4)
    mod = _export(module, x)
    got, compiled = _run(mod, [x.numpy()], choose_recurrence=False)
    assert not any("loop" in n for n in _kernels(compiled))
    for g, w in zip(got, _outputs(module, x), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


class _WithStates(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(4, 5, num_layers=2)

    def forward(self, x, h, c):
        return self.rnn(x, (h, c))


@pytest.mark.parametrize("proj_size", [False, True])
def test_given_states_and_proj_size(proj_size):
    """Initial states given by the caller go into the loop kernels; ``proj_size`` (not
    covered) is imported as before: torch's decomposition, unrolled steps."""
    torch.manual_seed(5)
    if proj_size:
        module, args = torch.nn.LSTM(4, 5, proj_size=3).eval(), (torch.randn(3, 2, 4),)
    else:
        args = (torch.randn(3, 2, 4), torch.randn(2, 2, 5), torch.randn(2, 2, 5))
        module = _WithStates().eval()
    mod = import_exported_program(torch.export.export(module, args))
    _, counts = _fusion(mod, tvm_fusion.host_target())
    assert counts["ChooseRecurrence"] == (0 if proj_size else 2)
    got, _ = _run(mod, [a.numpy() for a in args])
    with torch.no_grad():
        out = module(*args)
    for g, w in zip(got, [out[0], *out[1]], strict=True):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-4)
