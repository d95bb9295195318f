"""CUDA: no vectorized loops over boolean buffers (apache-tvm 0.27 emits wrong loads for them).

TVM's CUDA codegen loads two lanes of a ``bool`` buffer as ``*(ushort2*)(mask + i)``: four bytes
for two one-byte elements, so the lanes hold the wrong elements (``mask[i] | mask[i + 1] << 8``
and ``mask[i + 2] | ...``), and at an offset that is not a multiple of four the load faults
(``cudaErrorMisalignedAddress``). dlight's Matmul vectorizes its epilogue by two, so a
float16 causal attention (``where(tril, scores, -inf)`` fused after ``Q K^T``) crashed on an
H100, stock TVM's build as well as ours (bench/gpu.md).

:class:`ScalarBoolAccess` runs after scheduling on CUDA: a vectorized loop around a block that
reads or writes a ``bool`` buffer becomes an unrolled one (the same iterations, scalar code).
"""

from __future__ import annotations

import logging

import tvm
from tvm import s_tir, tirx

from ...tir_util import blocks

logger = logging.getLogger(__name__)


def _bool_blocks(func: tirx.PrimFunc) -> list[str]:
    return [
        b.name_hint
        for b in blocks(func)
        if any(str(r.source.dtype) == "bool" for r in (*b.reads, *b.writes))
    ]


def scalar_bool_access(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """``func`` with its vectorized loops around boolean accesses unrolled; None if it has none."""
    names = _bool_blocks(func)
    if not names:
        return None
    sch = s_tir.Schedule(func)
    changed = False
    for name in dict.fromkeys(names):
        try:
            block = sch.get_sblock(name)
        except Exception:  # noqa: BLE001 - a name shared by two blocks: left as it is
            logger.debug("scalar bool access: block %s not unique", name)
            continue
        for loop in sch.get_loops(block):
            if sch.get(loop).kind == tirx.ForKind.VECTORIZED:
                sch.unroll(loop)
                changed = True
    return sch.mod["main"] if changed else None


@tvm.transform.module_pass(opt_level=0, name="ScalarBoolAccess")
class ScalarBoolAccess:
    """:func:`scalar_bool_access` on every PrimFunc of the module."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updated = {}
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc):
                new = scalar_bool_access(func)
                if new is not None:
                    updated[gv] = new
        for gv, func in updated.items():
            mod[gv] = func
        return mod
