"""scripts/gpu_bundle.py: device code compiled here by nvcc (no CUDA source left for the GPU
machine to compile), weights lifted out of the timed modules, manifest complete."""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    shutil.which("nvcc") is None or not glob.glob("/usr/local/cuda*/lib64/libcudart.so.13*"),
    reason="CUDA 13 toolkit (nvcc, libcudart) not installed",
)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """One bundle for the checks below (each build imports TVM and runs nvcc): the gate_2890
    workload, its seed case with one more pipeline, tvm_fusion without the GateFusion rule."""
    out = tmp_path_factory.mktemp("gpu") / "bundle"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_bundle.py"),
            "--out",
            str(out),
            "--only",
            "gate_2890",
            "--without-rules",
            "GateFusion",
            "--without-cases",
            "gate_2890.seed",
            "--no-runtime",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    return out, {c["case"]: c for c in manifest["cases"]}


def test_bundle_compiles_device_code_and_lifts_weights(bundle):
    out, cases = bundle
    assert set(cases) == {"gate_2890.small", "gate_2890.small_dyn", "gate_2890.seed"}
    assert cases["gate_2890.small_dyn"]["check"]  # the tiled schedule, checked on the GPU
    small, seed = cases["gate_2890.small"], cases["gate_2890.seed"]
    assert small["check"] and (out / small["data"]).exists()
    assert seed["pipelines"]["tvm_fusion"]["kernels"] == 1
    assert seed["pipelines"]["stock"]["kernels"] == 2
    # the seed weights (3072 x 1024, packed by us) travel as parameters, not inside the .so
    lifted = seed["pipelines"]["tvm_fusion"]["lifted"]
    assert sum(int(__import__("math").prod(p["shape"])) for p in lifted) >= 3072 * 1024
    assert small["pipelines"]["tvm_fusion"]["lifted"] == []
    for case in cases.values():
        for info in case["pipelines"].values():
            blob = (out / info["file"]).read_bytes()
            assert b"__global__" not in blob, "CUDA source left in the module: nvcc not used"
            assert len(blob) < 1 << 20


def test_tvm_imported_before_the_stub_is_refused(tmp_path):
    """A script that imports TVM before the bundle loads its CUDA stub would export CUDA source
    (the GPU machine's runtime-only TVM cannot compile it): refused in one line, nothing built."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import tvm, gpu_bundle; "
        "gpu_bundle._load_cuda_runtime(__import__('pathlib').Path(sys.argv[2]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "scripts"), str(tmp_path / "stub")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "tvm was imported before the CUDA runtime stub" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "stub").exists()


def test_variant_pipeline_without_a_rule(bundle):
    """``--without-rules GateFusion --without-cases gate_2890.seed``: one more module for that
    case, tvm_fusion without the rule (the before of a before/after in one bundle)."""
    out, cases = bundle
    variant = "tvm_fusion_without_GateFusion"
    assert set(cases["gate_2890.seed"]["pipelines"]) == {"stock", "tvm_fusion", variant}
    assert set(cases["gate_2890.small"]["pipelines"]) == {"stock", "tvm_fusion"}
    info = cases["gate_2890.seed"]["pipelines"]
    ours, before = ((out / info[p]["file"]).read_bytes() for p in ("tvm_fusion", variant))
    assert ours != before  # another kernel (the rule's own tests check what it makes)


def test_runner_tables_a_variant():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_run
    finally:
        sys.path.pop(0)
    row = {"case": "attn_f16.seed", "check": False, "errors": {}, "stock": 0.34}
    row.update(tvm_fusion=0.2, torch=0.024, tvm_fusion_without_HalfTensorCore=0.44)
    row["tvm_fusion_without_HalfTensorCore_kernels"] = 4
    text = gpu_run._markdown({"device": "H100", "arch": "sm_90", "tvm": "0.27", "rows": [row]})
    assert "| attn_f16.seed | 0.44 | 0.2 | 0.4545x |" in text
