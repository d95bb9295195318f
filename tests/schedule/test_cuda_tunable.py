"""Tunable tiles of the CUDA gate rule for MetaSchedule, checked without a GPU (issue #26,
item 5).

- ``tunable_tiles`` offers the default tile first, then others, all within the register,
  shared-memory and thread budgets, none giving fewer blocks than the default (or ``SMS``);
- the tune contexts give gate kernels our space (``gate_space``: the rule with
  ``tunable=True``, the tile or the GEMV's split a ``sample_categorical`` decision): every
  sample the search generates keeps the GEMMs and the gate math in one kernel (no global
  buffer), and, built for sm_90 (skipped without nvcc), stays within 48 KB of shared memory
  and 128 registers without spills; for the tiled schedule (64 rows) and the split-K GEMV
  (LSTM cell, batch 1). (The search's first use of VerifyGPUCode takes a minute here.)
"""

from __future__ import annotations

import shutil

import pytest
import tvm
from helpers import assert_gate_tile_fits
from tvm.s_tir import meta_schedule as ms

from tvm_fusion import models, tir_util
from tvm_fusion import target as _target
from tvm_fusion.build import tuning
from tvm_fusion.schedule.cuda.gate_fusion import SMS, blocks, choose_tile, tunable_tiles
from tvm_fusion.tools import cuda_check


@pytest.mark.parametrize(
    "rows, units, gemm_gates, k",
    [(64, 1024, [3], 1024), (64, 5632, [2], 2048), (19, 128, [3], 389), (None, 1024, [4], 1024)],
)
def test_tunable_tiles_are_valid_and_start_with_the_default(rows, units, gemm_gates, k):
    rows = rows if rows is not None else tvm.tirx.Var("n", "int64")
    options = tunable_tiles(rows, units, 32, gemm_gates, k)
    assert options[0] == choose_tile(rows, units, 32, gemm_gates, k)
    assert len(options) > 1 and len(set(options)) == len(options)
    for tile in options:
        assert_gate_tile_fits(tile, gemm_gates)
        assert tile.bn <= 32 and tile.bk >= 8
        if isinstance(rows, int):
            wanted = min(SMS, blocks(options[0], rows, units))
            assert blocks(tile, rows, units) >= wanted, tile


WORKLOADS = {  # name: the gate workload whose kernel is sampled
    "tiled_gate_2890_64_rows": lambda: models.build("gate_2890", "seed").mod,
    "gemv_lstm_batch_1": lambda: models.build("lstm_cell", "seed").mod,
}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_search_samples_only_valid_fused_schedules(name, tmp_path):
    tgt = _target.cuda_target()
    fused = tuning.fused_module(WORKLOADS[name](), tgt)
    tasks = [
        t
        for t in ms.relax_integration.extract_tasks(fused, tgt)
        if "tvm_fusion.gate_fusion" in t.dispatched[0]["main"].attrs
    ]
    assert len(tasks) == 1
    contexts, _ = tuning.tune_contexts(tasks, tgt, tmp_path, "evolutionary", 1, seed=7)
    (samples,) = tuning.sample_candidates(contexts, 5).values()
    assert len(samples) == 5
    for sch in samples:
        kinds = [inst.kind.name for inst in sch.trace.decisions]
        assert kinds == ["SampleCategorical"], kinds  # the tile (or split) is the decision
        scopes = {b.scope() for b in tir_util.allocated_buffers(sch.mod["main"])}
        assert scopes <= {"shared", "local"}, scopes  # GEMMs and gates in one kernel
    if shutil.which("nvcc") is None:
        return
    for mod in (sch.mod for sch in samples):
        lib = tuning.build_candidate(mod, tgt)
        ptx, log = cuda_check.compile_source(cuda_check.cuda_source(lib), "sm_90")
        assert len(cuda_check._ENTRY.findall(ptx)) == 1, "one kernel per gate group"
        found = cuda_check._PTXAS_USED.search(
            next(line for line in log.splitlines() if "Used" in line).strip()
        )
        registers, smem = int(found.group(1)), int(found.group(2) or 0)
        assert registers <= 128 and smem <= 48 * 1024, log
        assert "0 bytes spill stores, 0 bytes spill loads" in log, log
