"""CUDA rule: half-precision GEMMs with a short extent on tensor cores.

dlight's GPU ``Matmul`` tensorizes a float16 GEMM (``MatmulTensorization``: ``wmma`` fragments,
thread blocks of ``128 x 128``, reduction steps of 64, every extent padded to those) only when
no static extent of ``I``, ``J`` or ``K`` is 64 or less; otherwise it runs the GEMM on CUDA
cores. For a GEMM that ``legalize`` sums in float32 (every half-precision ``matmul``: float16
operands widened in the sum, a float32 ``C``, then a cast epilogue) that means two conversions
and a scalar float32 FMA per product, where stock TVM's own float16 sum runs two float16 FMAs
per instruction. Attention at head size 64 hits exactly that: ``Q K^T`` has ``K = 64`` and
``P V`` has ``J = 64``; our float16 attention was 1.28x stock's on an H100 (bench/gpu.md).

Matched: one reduction block that dlight normalises to ``C[S, I, J] += A[S, I, K] * B[S, J, K]``
(batched or not, elementwise producers and consumers around it), float16 operands, a float32
``C``, a CUDA target of sm_70 or newer, some static extent of ``I``, ``J``, ``K`` at most
``DLIGHT_THRESHOLD`` (else dlight tensorizes it itself), and padding to the tile that costs at
most ``MAX_PADDING`` times the work (static extents; a symbolic one counts as unpadded).
Emitted: dlight's ``MatmulTensorization`` schedule itself, float32 accumulators. Left to dlight
(with a debug reason): bfloat16 (dlight's tensor-core schedule has float16 intrinsics only),
float16 sums, float32, a GEMV's one row, and GEMMs the tile would pad more than that.
"""

from __future__ import annotations

import logging
import math

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.dlight.gpu.matmul import (
    MatmulTensorization,
    check_sm_version,
    get_index_map,
    get_reduction_blocks,
)
from tvm.target import Target

logger = logging.getLogger(__name__)

DLIGHT_THRESHOLD = 64  # dlight's Matmul tensorizes only when every static I, J, K exceeds it
TILE = (128, 128, 64)  # MatmulTensorization's padding of I, J, K
MAX_PADDING = 4.0  # padded over real products, at most


class HalfTensorCore(ScheduleRule):
    def is_target_available(self, target: Target) -> bool:
        return target.kind.name == "cuda"

    def apply(self, func, target: Target, tunable: bool):
        if (
            not isinstance(func, tirx.PrimFunc)
            or not self.is_target_available(target)
            or func.attrs.get("tirx.is_scheduled", False)
        ):
            return None
        why = refusal(func, target)
        if why is not None:
            logger.debug("half tensor core (cuda): %s", why)
            return None
        return MatmulTensorization().apply(func, target, tunable)


def refusal(func: tirx.PrimFunc, target: Target) -> str | None:
    """Why the rule leaves ``func`` to dlight, or None where it fires."""
    if check_sm_version(str(target.attrs.get("arch", ""))) < 70:
        return f"arch {target.attrs.get('arch', '')!r}: no wmma before sm_70"
    extents = gemm_extents(func)
    if isinstance(extents, str):
        return extents
    small = [e for e in extents if isinstance(e, int) and e <= DLIGHT_THRESHOLD]
    if not small:
        return "no extent <= 64: dlight's Matmul tensorizes it"
    padded = [
        math.ceil(e / t) * t / e if isinstance(e, int) else 1.0
        for e, t in zip(extents, TILE, strict=True)
    ]
    if math.prod(padded) > MAX_PADDING:
        return f"extents {[str(e) for e in extents]}: padding {math.prod(padded):.2f}x the work"
    return None


def gemm_extents(func: tirx.PrimFunc):
    """(I, J, K) of the one GEMM of ``func`` in dlight's normal form (ints where static),
    float16 operands summed in float32; or why not."""
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(get_root_block(sch))
    reductions = get_reduction_blocks(sch, blocks)
    if reductions is None or len(reductions) != 1:
        return "not one reduction block"
    main = reductions[0]
    stmt = sch.get(main)
    if len(stmt.reads) != 2 or len(stmt.writes) != 1:
        return "not a GEMM (two operands, one result)"
    operands = {str(r.source.dtype) for r in stmt.reads}
    if operands != {"float16"}:
        return f"operands {sorted(operands)}, not float16"
    if str(stmt.writes[0].source.dtype) != "float32":
        return f"sums in {stmt.writes[0].source.dtype}, not float32"
    maps = get_index_map(stmt)
    if maps is None:
        return "not a GEMM dlight normalises"
    try:
        sch.reindex(main, ("read", 0))
        sch.reindex(main, ("read", 1))
        sch.reindex(main, ("write", 0))
        sch.transform_block_layout(main, get_index_map(sch.get(main))[0])
    except Exception as err:  # noqa: BLE001 - not the normal form after all
        return f"normalisation failed: {str(err).splitlines()[0][:120]}"
    iters = sch.get(main).iter_vars
    if len(iters) != 4:
        return f"{len(iters)} iterators after normalisation"
    return tuple(
        int(iv.dom.extent) if isinstance(iv.dom.extent, tirx.IntImm) else iv.dom.extent
        for iv in iters[1:]
    )
