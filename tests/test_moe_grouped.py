"""transformers' grouped mixture-of-experts form through torch.export (issue #38, item 2).

transformers (not a dependency) registers ``transformers::grouped_mm_fallback`` in
``transformers/integrations/moe.py``; the op is defined here the same way (schema and eager
body copied from transformers 5.24), so that programs calling it can be exported and saved.
A saved program that calls a custom op nobody registered failed to load with torch's
"We ran into an error when deserializing the saved file"; with the op registered, the import
failed with "Unsupported function types ['grouped_mm_fallback.default', 'histc.default']".
"""

from __future__ import annotations

import json
import sys
import zipfile

import numpy as np
import pytest

from tvm_fusion.build import engine
from tvm_fusion.errors import ModelError
from tvm_fusion.frontend import load
from tvm_fusion.target import host_target
from tvm_fusion.testing.moe import define_grouped_mm, grouped_experts

torch = pytest.importorskip("torch")

define_grouped_mm("transformers")


class Grouped(torch.nn.Module):
    """The op alone: offsets a model input, so that any offsets can be tried."""

    def __init__(self, experts: int, k: int = 8, n: int = 5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, n, k))

    def forward(self, x, offs):
        return torch.ops.transformers.grouped_mm_fallback(x, self.weight.transpose(-2, -1), offs)


def _run(compiled, *args):
    out = engine.TvmRunner(compiled, [np.asarray(a) for a in args]).outputs()
    return np.asarray(out[0] if isinstance(out, list | tuple) else out)


def _saved_experts(tmp_path, experts: int):
    torch.manual_seed(experts)
    model = grouped_experts(experts).eval()
    tokens = torch.export.Dim("tokens", min=1, max=128)
    args = (torch.randn(7, 8), torch.randint(0, experts, (7, 2)), torch.rand(7, 2))
    program = torch.export.export(model, args, dynamic_shapes=({0: tokens},) * 3)
    path = tmp_path / f"moe{experts}.pt2"
    torch.export.save(program, path)
    return model, path


@pytest.mark.parametrize("experts", [3, 8])
def test_grouped_experts_saved_program_matches_torch(tmp_path, experts):
    model, path = _saved_experts(tmp_path, experts)
    compiled = engine.compile_module(load.load_model(path), host_target(), "tvm_fusion")
    for tokens in (1, 7, 61):
        x, ids = torch.randn(tokens, 8), torch.randint(0, experts, (tokens, 2))
        weights = torch.rand(tokens, 2)
        want = model(x, ids, weights).detach().numpy()
        got = _run(compiled, x.numpy(), ids.numpy(), weights.numpy())
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("experts", [3, 8])
def test_grouped_mm_offsets_read_at_run_time(experts):
    """Empty experts, rows past the last offset (zero), unsorted and negative offsets: the
    eager body's slices exactly, with a symbolic row count."""
    torch.manual_seed(experts)
    model = Grouped(experts).eval()
    rows = torch.export.Dim("rows", min=1, max=128)
    args = (torch.randn(7, 8), torch.tensor([2, 2, 5] + [7] * (experts - 3), dtype=torch.int32))
    program = torch.export.export(model, args, dynamic_shapes=({0: rows}, None))
    compiled = engine.compile_module(
        load.import_exported_program(program), host_target(), "tvm_fusion"
    )
    rng = np.random.default_rng(experts)
    for count in (1, 7, 61):
        cases = [
            np.sort(rng.integers(0, count + 1, experts)),  # cumulative counts, some empty
            np.sort(rng.integers(0, count // 2 + 1, experts)),  # a zero tail
            rng.integers(-count, count + 3, experts),  # neither sorted nor in range
        ]
        for offs in cases:
            offs = torch.tensor(offs, dtype=torch.int32)
            x = torch.randn(count, 8)
            want = model(x, offs).detach().numpy()
            got = _run(compiled, x.numpy(), offs.numpy())
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=str(offs))


def test_histc_matches_torch():
    class Hist(torch.nn.Module):
        def forward(self, x):
            return torch.histc(x, bins=5, min=-1.0, max=2.0)

    program = torch.export.export(
        Hist(), (torch.randn(9),), dynamic_shapes=({0: torch.export.Dim("n", max=256)},)
    )
    compiled = engine.compile_module(
        load.import_exported_program(program), host_target(), "tvm_fusion"
    )
    x = torch.cat([torch.randn(40) * 2, torch.tensor([-1.0, 2.0, 0.2, 0.8, 2.5, -3.0])])
    np.testing.assert_array_equal(_run(compiled, x.numpy()), torch.histc(x, 5, -1.0, 2.0).numpy())


def _renamed(src, dst, old: str, new: str) -> None:
    """``src`` (a saved program) with every ``old`` in its graph JSON replaced by ``new``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if "/models/" in item.filename and item.filename.endswith(".json"):
                data = json.dumps(json.loads(data)).replace(old, new).encode()
            zout.writestr(item, data)


def test_unregistered_op_is_one_line(tmp_path):
    """A transformers op nobody registered (transformers is not installed here, or lacks it)."""
    _, path = _saved_experts(tmp_path, 3)
    renamed = tmp_path / "renamed.pt2"
    _renamed(path, renamed, "grouped_mm_fallback", "grouped_mm_not_registered")
    with pytest.raises(ModelError) as err:
        load.load_model(renamed)
    message = str(err.value)
    assert "transformers::grouped_mm_not_registered" in message
    assert "pip install transformers" in message
    assert "\n" not in message


def test_op_registered_by_importing_its_library(tmp_path, monkeypatch):
    """``load_model`` imports the library that defines the op (transformers' own module in
    the real table) before reading the program."""
    _, path = _saved_experts(tmp_path, 3)
    renamed = tmp_path / "renamed.pt2"
    _renamed(path, renamed, "torch.ops.transformers.", "torch.ops.tvmfusion_moe_test.")
    (tmp_path / "tvmfusion_moe_lib.py").write_text(
        f"import {__name__} as t\nt.define_grouped_mm('tvmfusion_moe_test')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(
        load._CUSTOM_OP_MODULES, "tvmfusion_moe_test", ("tvmfusion_moe_lib", "tvmfusion_moe_lib")
    )
    assert "tvmfusion_moe_lib" not in sys.modules
    mod = load.load_model(renamed)
    assert "tvmfusion_moe_lib" in sys.modules
    assert any("grouped_mm" in gv.name_hint for gv in mod.functions)


class BatchedExperts(torch.nn.Module):
    """transformers' ``batched_mm_experts_forward`` (gated, not transposed, SwiGLU)."""

    def __init__(self, experts: int, hidden: int = 8, inter: int = 6):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden) / 3)
        self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, inter) / 3)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        num_top_k = top_k_index.size(-1)
        num_tokens, hidden_dim = hidden_states.shape
        selected = hidden_states.repeat_interleave(num_top_k, dim=0)
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        proj = torch.bmm(self.gate_up_proj[expert_ids], selected.unsqueeze(-1)).squeeze(-1)
        gate, up = proj.chunk(2, dim=-1)
        proj = torch.nn.functional.silu(gate) * up
        proj = torch.bmm(self.down_proj[expert_ids], proj.unsqueeze(-1)).squeeze(-1)
        weighted = proj * sample_weights.unsqueeze(-1)
        return weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)


def test_batched_experts_torchscript_onnx(tmp_path):
    """The TorchScript ONNX export of the batched form: ``repeat_interleave`` becomes ``Tile``
    to fresh dims, the expert GEMM's batch dims were not provably equal, and compiling failed
    with a raw "'NoneType' object is not iterable"."""
    pytest.importorskip("onnx")
    torch.manual_seed(0)
    model = BatchedExperts(3).eval()
    path = tmp_path / "batched.onnx"
    args = (torch.randn(7, 8), torch.randint(0, 3, (7, 2)), torch.rand(7, 2))
    names = ["x", "ids", "weights"]
    torch.onnx.export(
        model, args, path, dynamo=False, input_names=names,
        dynamic_axes={name: {0: "tokens"} for name in names},
    )  # fmt: skip
    compiled = engine.compile_module(load.load_model(path), host_target(), "tvm_fusion")
    for tokens in (1, 7, 61):
        x, ids = torch.randn(tokens, 8), torch.randint(0, 3, (tokens, 2))
        weights = torch.rand(tokens, 2)
        want = model(x, ids, weights).detach().numpy()
        got = _run(compiled, x.numpy(), ids.numpy(), weights.numpy())
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_histc_of_integer_ids():
    """transformers on CUDA counts integer ids (torch's CPU kernel takes floats only)."""

    class Hist(torch.nn.Module):
        def forward(self, ids):
            return torch.histc(ids, bins=8, min=0, max=7)

    ids = torch.zeros(9, dtype=torch.int32, device="meta")  # CPU's kernel refuses integers
    n = torch.export.Dim("n", max=256)
    program = torch.export.export(Hist(), (ids,), dynamic_shapes=({0: n},))
    compiled = engine.compile_module(
        load.import_exported_program(program), host_target(), "tvm_fusion"
    )
    ids = np.random.default_rng(0).integers(0, 8, 61).astype("int32")
    np.testing.assert_array_equal(_run(compiled, ids), np.bincount(ids, minlength=8))
