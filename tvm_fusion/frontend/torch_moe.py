"""torch.export converters for transformers' grouped mixture-of-experts form (issue #38, item 2).

transformers' default experts (``experts_implementation="grouped_mm"``, 5.x) sort the
``(token, expert)`` pairs by expert, count them per expert with ``histc`` and take the
``cumsum`` of the counts as offsets; each projection is then one grouped GEMM. Where
``torch.nn.functional.grouped_mm`` cannot be used (CPU with torch <= 2.8, float32 weights under
``torch.compile`` / export ...) it is the custom op transformers registers in
``transformers/integrations/moe.py``::

    transformers::grouped_mm_fallback(Tensor input, Tensor weight, Tensor offs) -> Tensor

``input`` ``(S, K)`` (rows sorted by expert), ``weight`` ``(E, K, N)`` (the experts' weights
already transposed by the caller: ``gate_up_proj.transpose(-2, -1)``), ``offs`` ``(E,)``
int32 / int64, the cumulative token counts. Its eager body::

    output = torch.zeros(S, N, dtype=input.dtype)
    start = 0
    for i, end in enumerate(offs.tolist()):
        if start == end: continue
        torch.mm(input[start:end], weight[i], out=output[start:end]); start = end

so row ``r`` is ``input[r] @ weight[i]`` for the last ``i`` whose slice
``[offs[i-1], offs[i])`` (``offs[-1]`` read as 0, both ends as Python slice bounds: negative
ones wrap by ``S``, then clipped to ``[0, S]``) holds ``r``, and zero where no slice does (rows
at or past ``offs[E-1]``: transformers' expert-parallel sentinels). The converter computes
exactly that for any offsets, sorted or not: one kernel (``emit_te``) that finds each row's
expert from the offsets at run time (``E`` comparisons a row) and reads that expert's weight in
place, ``out[r, j] = sum_k input[r, k] * weight[e(r), k, j]`` (float32 accumulation for half
types), zero for rows of no expert. No ``(S, K, N)`` gathered copy exists; empty experts cost
nothing but their comparisons.

``histc.default`` (stock has none) with explicit ``min < max``: torch's bin
``floor((x - min) * bins / (max - min))``, ``x == max`` in the last bin, values outside
``[min, max]`` dropped; counts in ``x``'s dtype (float32 arithmetic for float32 and half
types, float64 for float64 and integers: torch's CUDA kernel takes integer ids, which
transformers passes there). ``min == max`` (torch then takes the data's range) is refused in
one line.
"""

from __future__ import annotations

import logging

from tvm import relax, te, tirx

from ..errors import ModelError
from ..transform.fuse_grouped_gates import GROUPED_ATTR, expert_of_rows

logger = logging.getLogger(__name__)


def _arg(node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _tensor(importer, node, i: int, name: str):
    """The Relax tensor of argument ``i`` / ``name`` and its struct info (known rank)."""
    expr = importer.env.get(_arg(node, i, name))
    ty = getattr(expr, "ty", None)
    if not isinstance(ty, relax.TensorType) or ty.ndim < 0:
        raise ModelError(f"{node.name}: {name} is not a tensor of known rank")
    return expr, ty.ndim, str(ty.dtype)


def _grouped_mm_fallback(node, importer) -> relax.Var:
    """``transformers::grouped_mm_fallback(input, weight, offs)`` (see the module docstring)."""
    x, x_rank, dtype = _tensor(importer, node, 0, "input")
    w, w_rank, w_dtype = _tensor(importer, node, 1, "weight")
    offs, o_rank, o_dtype = _tensor(importer, node, 2, "offs")
    if (x_rank, w_rank, o_rank) != (2, 3, 1):
        raise ModelError(
            f"{node.name}: transformers::grouped_mm_fallback needs input (S, K), weight (E, K, N)"
            f" and offs (E,), got ranks {x_rank}, {w_rank}, {o_rank}"
        )
    if not o_dtype.startswith("int"):
        raise ModelError(f"{node.name}: grouped_mm_fallback offsets of dtype {o_dtype}")
    if w_dtype != dtype:
        w = importer.block_builder.emit(relax.op.astype(w, dtype))
    acc = "float32" if dtype in ("float16", "bfloat16") else dtype
    bb = importer.block_builder
    out = bb.emit_te(_grouped_te, x, w, offs, acc, primfunc_name_hint="grouped_mm")
    gv = bb.lookup_binding(out).args[0]  # tagged for FuseGroupedGates
    bb.update_func(gv, bb.get()[gv].with_attr(GROUPED_ATTR, True))
    return out


def _grouped_te(x: te.Tensor, w: te.Tensor, offs: te.Tensor, acc: str) -> te.Tensor:
    rows, depth = x.shape
    experts, _, cols = w.shape
    owner = expert_of_rows(rows, offs, -1)
    k = te.reduce_axis((0, depth), name="k")

    def gemm(r, j):
        e = tirx.max(owner[r], 0)
        return te.sum(x[r, k].astype(acc) * w[e, k, j].astype(acc), axis=k)

    prod = te.compute((rows, cols), gemm, name="grouped_gemm")
    zero = tirx.const(0, x.dtype)
    return te.compute(
        (rows, cols),
        lambda r, j: tirx.Select(owner[r] >= 0, prod[r, j].astype(x.dtype), zero),
        name="grouped_out",
    )


def _histc(node, importer) -> relax.Var:
    """``histc(x, bins, min, max)`` with ``min < max`` (see the module docstring)."""
    x, _, dtype = _tensor(importer, node, 0, "input")
    bins, lo, hi = _arg(node, 1, "bins", 100), _arg(node, 2, "min", 0), _arg(node, 3, "max", 0)
    if not all(isinstance(v, int | float) for v in (bins, lo, hi)) or not lo < hi:
        raise ModelError(
            f"{node.name}: histc with min={lo}, max={hi} (the data's range) is not supported;"
            " pass min < max"
        )
    if not dtype.startswith(("float", "int", "uint")):
        raise ModelError(f"{node.name}: histc of dtype {dtype}")
    bb = importer.block_builder
    flat = bb.emit(relax.op.reshape(x, [-1]))
    return bb.emit_te(_histc_te, flat, int(bins), float(lo), float(hi), primfunc_name_hint="histc")


def _histc_te(x: te.Tensor, bins: int, lo: float, hi: float) -> te.Tensor:
    (n,) = x.shape
    dtype = x.dtype
    k = te.reduce_axis((0, n), name="k")

    def count(b):
        v = x[k].astype("float32" if dtype in ("float32", "float16", "bfloat16") else "float64")
        pos = tirx.floor((v - lo) * bins / (hi - lo)).astype("int32")
        pos = tirx.min(pos, bins - 1)
        hit = tirx.all(v >= lo, v <= hi, pos == b)
        return te.sum(tirx.Select(hit, tirx.const(1, dtype), tirx.const(0, dtype)), axis=k)

    return te.compute((bins,), count, name="histc")


CONVERTERS = {
    "grouped_mm_fallback.default": _grouped_mm_fallback,
    "histc.default": _histc,
}
