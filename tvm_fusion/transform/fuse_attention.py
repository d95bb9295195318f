"""FuseAttention: ``softmax(Q K^T * scale + mask) V`` as one kernel with an online softmax.

Stock Relax computes attention as a matmul, elementwise ops, a softmax and a second matmul, with
the ``(B, H, S, N)`` scores written to memory and read back three times (1 GiB at batch 1, 8
heads, S = N = 8192, float32). This pass replaces the chain by one ``call_tir`` of
:func:`tvm_fusion.lower.attention.attention_kernel`: per tile of query rows the running maximum
and running sum of exponentials (the log-sum-exp of :mod:`._cross_entropy_kernel`, kept online
over blocks of keys) and the output accumulator; the scores exist one block at a time.

Matched, all float32, starting from the second matmul ``O = matmul(P, V)``:

- ``P = softmax(X, axis=-1)`` (after identity casts ``astype(., float32)``, which the legacy
  ONNX exporter writes after a softmax), or torch's SDPA guard around it
  ``where(not(max(X != -inf over the row)), full_like(P0, 0), P0)`` (a fully masked row gives 0
  instead of NaN; the kernel then does the same);
- ``X = Sc + M`` / ``M + Sc`` with a mask ``M`` of rank <= 4 whose every dim is 1 or the
  scores' dim (a padding mask ``(B, 1, 1, N)``, a causal ``(S, N)`` constant or one computed
  from ``arange`` comparisons: any values), ``X = where(C, Sc, c)`` / ``where(C, c, Sc)`` with
  a boolean ``C`` of such a shape and a scalar constant ``c`` (the ONNX exporters' causal
  ``Where(tril, scores, -inf)``), or ``X = Sc``;
- ``Sc = S0 * c`` / ``c * S0`` / ``S0 / c`` for a scalar constant ``c``, or ``Sc = S0``;
- ``S0 = matmul(Q, K^T)`` with ``Q (B, H, S, D)``, ``K^T (B, H, D, N)``, ``V (B, H, N, Dv)``
  (``D``, ``Dv`` static; ``B, H, S, N`` static or symbolic). On the CPU the kernel reads ``Q``
  and ``K^T`` through the ``permute_dims`` chains that make them, scalar-constant multiplies
  folded into its scale (:meth:`_Matcher._absorb_layouts`: a GPT block's ``(B, S, H, D)``
  heads, no transposing copy kernels; it packs K^T's key blocks itself); ``V`` is read as it
  is (its rows ``H * Dv`` apart would share a few L1 sets);
- the same on 3-D operands, as torch.export decomposes SDPA: each of ``Q``, ``K^T``, ``P``,
  ``V`` is ``reshape(broadcast_to(x, shape(x)), (B * H, ., .))`` of a 4-D ``x``, the scores
  ``reshape(matmul(...), (B, H, S, N))`` and ``O`` 3-D (the kernel's 4-D result reshaped).

So the ONNX exporters' ``MatMul(Q, Transpose(K)) -> Div/Mul -> Add(mask) | Where -> Softmax
[-> Cast] -> MatMul(V)`` (both torch exporters: GPT-2, Llama, BERT, ViT... of the corpus)
and torch.export's decomposed ``scaled_dot_product_attention`` (scale folded into Q and K^T,
attn_mask / is_causal as an added float mask, the NaN guard) become one kernel.
Every intermediate (scores, scaled, masked, probabilities, the 3-D views of them) must be read
by the chain alone, else the chain stays. Run before LegalizeOps.

Size gate: where ``S`` and ``N`` are both static and one (batch, head)'s scores ``S * N`` are
below ``MIN_STATIC_SCORES`` (512 x 512), the chain is fused only when its mask can make the
kernel skip key blocks: a where with fill ``-inf`` (the ONNX exporters' causal ``Where``), a
constant holding ``-inf``, or ``where(C, 0, -inf)`` (torch's ``is_causal`` and boolean
``attn_mask``); a symbolic ``S`` or ``N`` always fuses. Measured (scripts/bench_attention.py
``--clock cpu --reps 9``, znver3, one thread, CPU time, medians, load 7-8 on 2 shared cores;
K^T packed per (batch, head), 32-row tiles), fused / unfused ours: causal B,H,S,D =
8,4,63,64: 0.79x, 1,8,256,64: 0.79x, 1,4,512,64: 0.63x, 4,8,512,64: 0.56x, 1,8,2048,64:
0.55x; without a mask 1.00x at S = 63, 1.20x at 128, 0.99x at 256 (the gate keeps these
unfused), 0.92x / 0.97x at 512, 0.87x at 2048. The memory saving holds at any size (S = N =
2048, B = 1, H = 8, D = 64: 0.021x stock's planned peak; the kernel's packed K^T, a workspace
the size of K allocated per call, is outside the plan).

CUDA targets: float32 chains without a mask, with head dims ``D, Dv <= 128`` (``Dv`` a
multiple of 4), become :func:`tvm_fusion.lower.attention_cuda.attention_kernel_cuda` (thread
blocks of 32 query rows, the scores and running statistics in registers, CUDA cores); the size
gate is the CPU's. Masked and float16 chains stay unfused there, for stock's kernels: measured
on an H100 (bench/gpu.md, 2026-11-26, B, H, S, D = 1, 8, 2048, 64), fused / stock: float32
0.82x, float32 causal 1.62x, float16 1.63x (torch's flash attention: 0.02 ms against our 0.56).
``FuseAttention(target, cuda_all_forms=True)`` (or ``CUDA_ALL_FORMS``) fuses them too
(float16 computed in float32, the output cast once; causal blocks above the diagonal skipped).
Other GPU targets: the pass does nothing.

Left alone (reason at debug level): other dtypes (float16 / bfloat16 on the CPU), a softmax
over another axis, a symbolic ``D`` / ``Dv``, a mask of another dtype, the mask added before
the scale, broadcast heads inside the matmul (K or V with one head for many: grouped-query heads
that the exporter already copied with ``expand`` + ``reshape`` are ordinary 4-D operands and do
fuse), a scale that is not a scalar constant. ``R.nn.attention`` is not matched: torch 2.13's
``torch.export`` decomposes ``scaled_dot_product_attention`` before our importer sees it (the
3-D form above), and no frontend of ours emits the op.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import IRModule, relax, tirx
from tvm.ir.expr import GenericConst
from tvm.relax.expr_functor import PyExprMutator, mutator

from .. import target as _target
from ..lower import attention_cuda
from ..lower.attention import IDENTITY, KERNEL_NAME, attention_kernel
from ._common import (
    get_logger,
    op_name,
    prove_equal_shapes,
    record_rewrite,
    skip,
    static_shape,
    use_counts,
)

NAME = "FuseAttention"
# the size gate (module docstring): static S * N of one (batch, head) below this stays unfused
MIN_STATIC_SCORES = 512 * 512
CUDA_ALL_FORMS = False  # CUDA: masked and float16 chains too (slower than stock: docstring)
logger = get_logger(__name__)


@tvm.transform.module_pass(opt_level=0, name=NAME)
class FuseAttention:
    """``softmax(Q K^T * scale + mask) V`` chains as one online-softmax kernel (see the module
    docstring). CPU and CUDA targets."""

    def __init__(self, target=None, cuda_all_forms: bool | None = None):
        self.target = target
        self.cuda_all_forms = CUDA_ALL_FORMS if cuda_all_forms is None else cuda_all_forms

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        target = self.target or tvm.target.Target.current(allow_none=True)
        cuda = target is not None and target.kind.name == "cuda"
        if target is not None and not (cuda or _target.is_cpu(target)):
            return mod
        if cuda:
            rewriter = _Rewriter(mod, None, self.cuda_all_forms)
        else:
            registers = _target.vector_registers(target) if target is not None else 16
            lanes = _target.vector_lanes(target) if target is not None else 8
            rewriter = _Rewriter(mod, (registers, min(lanes, 16)))
        mod = rewriter.transform()
        record_rewrite(NAME, rewriter.count)
        return mod


class _Plan:
    """One matched chain: the 4-D operands and what the kernel needs."""

    def __init__(self, q, kt, v, mask, scale, guard, out_3d):
        self.q, self.kt, self.v = q, kt, v
        self.mask, self.scale, self.guard, self.out_3d = mask, scale, guard, out_3d
        # CPU: the tensors the kernel reads, ``operand = permute_dims(base, axes) * factor``
        self.bases = (q, kt, v)
        self.layouts = None


class _Matcher:
    def __init__(self, func: relax.Function, cuda: bool = False, cuda_all_forms: bool = False):
        self.cuda = cuda
        # CUDA: masked chains only with cuda_all_forms (slower than stock's kernels: measured)
        self.cuda_masks = cuda_all_forms
        # float16 on CUDA: products, sums and the softmax in float32, the output cast once
        self.dtypes = ("float32", "float16") if cuda and cuda_all_forms else ("float32",)
        self.bound: dict = {}
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(binding, relax.VarBinding):
                    self.bound[binding.var] = binding.value
        self.uses = use_counts(func)

    def value(self, expr, op: str | None = None):
        """The call bound to var ``expr`` (of ``op`` when given), else None."""
        value = self.bound.get(expr) if isinstance(expr, relax.Var) else None
        if value is None or (op is not None and op_name(value) != op):
            return None
        return value

    def single_use(self, var) -> bool:
        return self.uses.get(var, 0) == 1

    def unview(self, expr, single: bool):
        """A 4-D ``x`` when ``expr`` is ``reshape(broadcast_to(x, shape(x)), (B*H, a, c))``;
        with ``single`` the two views must be read once."""
        reshape = self.value(expr, "relax.reshape")
        if reshape is None or (single and not self.single_use(expr)):
            return None
        inner = reshape.args[0]
        bcast = self.value(inner, "relax.broadcast_to")
        if bcast is not None:
            if single and not self.single_use(inner):
                return None
            x = bcast.args[0]
            if not _same_shape(static_shape(x), static_shape(inner)):
                return None
        else:
            x = inner
        src, dst = static_shape(x), static_shape(expr)
        if src is None or dst is None or len(src) != 4 or len(dst) != 3:
            return None
        if not (
            prove_equal_shapes(src[0] * src[1], dst[0])
            and prove_equal_shapes(src[2], dst[1])
            and prove_equal_shapes(src[3], dst[2])
        ):
            return None
        return x

    def match(self, call: relax.Call):
        """A :class:`_Plan` for ``O = matmul(P, V)``, else None (reason logged)."""
        what = f"matmul {call}"[:80]
        p, v = call.args
        out = static_shape(call)
        if out is None or call.ty.dtype not in self.dtypes:
            kinds = " / ".join(self.dtypes)
            return skip(logger, what, f"not a {kinds} tensor of known rank") or None
        out_3d = len(out) == 3
        if out_3d:
            p4, v4 = self.unview(p, single=True), self.unview(v, single=False)
            if p4 is None or v4 is None:
                return skip(logger, what, "3-D operands that are not views of 4-D ones") or None
            p = p4
            v = v4
        elif len(out) != 4:
            return None
        if not self.single_use(p):
            return skip(logger, what, "probabilities read elsewhere") or None
        if not p.ty.dtype == v.ty.dtype == call.ty.dtype:
            return skip(logger, what, "a matmul with another output dtype") or None
        p = self._strip_casts(p)
        if p is None:
            return skip(logger, what, "a cast of the probabilities read elsewhere") or None
        guard, sm = self._guard(p)
        if sm is None:
            return skip(logger, what, "not the matmul of a last-axis softmax") or None
        x = sm.args[0]
        if guard is None and not self.single_use(x):
            return skip(logger, what, "softmax input read elsewhere") or None
        scores, mask, where_fill = x, None, None
        add = self.value(x, "relax.add")
        where = self.value(x, "relax.where")
        if add is not None:
            a, b = add.args
            for s_, m_ in ((a, b), (b, a)):
                if self._is_scores(s_):
                    scores, mask = s_, m_
                    break
            else:
                return skip(logger, what, "an add that is not scores + mask") or None
        elif where is not None:
            cond, a, b = where.args
            for s_, fill, keep_when in ((a, b, True), (b, a, False)):
                value = _scalar(fill)
                if value is not None and self._is_scores(s_):
                    scores, mask, where_fill = s_, cond, (value, keep_when)
                    break
            else:
                return skip(logger, what, "a where that is not where(mask, scores, c)") or None
        scores, scale = self._scale(scores)
        if scores is None:
            return skip(logger, what, "no scalar-constant scale") or None
        operands = self._qk(scores)
        if operands is None:
            return skip(logger, what, "scores are not matmul(Q, K^T)") or None
        q, kt = operands
        plan = self._check(what, q, kt, v, (mask, where_fill), scale, guard, out_3d)
        if plan is not None and not self.cuda:
            self._absorb_layouts(plan)
        return plan

    def _absorb_layouts(self, plan: _Plan) -> None:
        """CPU: the kernel reads Q and K^T through the transposes of heads that make them (a
        GPT block's ``permute_dims`` of ``(B, S, H, D)`` views of its fused qkv GEMM, and of K
        again for K^T), and folds the scalar constants that multiply them (torch's SDPA
        decomposition scales both by ``scale ** 0.5``) into its scale: no copy kernel for
        either (K^T's a transposing gather). Q is read once per tile and K^T once per (batch,
        head), into the kernel's own buffers. V stays a copy: its rows are read in the P V
        loop, ``H * Dv`` apart in ``(B, N, H, Dv)`` (1 KB at 4 x 64: a block's 64 rows in 4 L1
        sets; 1 x 512 x 256 took 1.14x the time)."""
        (q, fq), (kt, fk) = (self._unpermute(x) for x in (plan.q, plan.kt))
        plan.bases = (q[0], kt[0], plan.v)
        plan.layouts = (q[1], kt[1], IDENTITY)
        plan.scale = plan.scale * fq * fk

    def _unpermute(self, x):
        """``((base, axes), factor)`` with ``x = permute_dims(base, axes) * factor`` through a
        chain of ``permute_dims`` and multiplications by finite nonzero scalar float32
        constants, of a 4-D ``base``."""
        axes, factor = IDENTITY, 1.0
        while True:
            call = self.value(x)
            name = op_name(call) if call is not None else None
            if name == "relax.permute_dims":
                inner = call.attrs.axes
                inner = [3, 2, 1, 0] if inner is None else [int(a) for a in inner]
                axes = tuple(inner[a] for a in axes)
                x = call.args[0]
                continue
            if name == "relax.multiply" and call.ty.dtype == "float32":
                a, b = call.args
                c = _scalar(b)
                if c is None:
                    a, c = b, _scalar(a)
                if c is not None and np.isfinite(c) and c != 0 and a.ty.ndim == 4:
                    factor *= c
                    x = a
                    continue
            return (x, axes), factor

    def _strip_casts(self, p):
        """``p`` past identity casts ``astype(x, float32)`` of float32 ``x`` (the legacy ONNX
        exporter's ``Cast`` after a softmax), each read once; None when one is read twice."""
        cast = self.value(p, "relax.astype")
        while cast is not None and cast.args[0].ty.dtype == cast.ty.dtype:
            p = cast.args[0]
            if not self.single_use(p):
                return None
            cast = self.value(p, "relax.astype")
        return p

    def _guard(self, p):
        """(guard?, softmax call) of ``P``: the softmax itself or torch's NaN guard around it."""
        sm = self.value(p, "relax.nn.softmax")
        if sm is not None:
            return (None, sm) if _last_axis(sm) else (None, None)
        where = self.value(p, "relax.where")
        if where is None:
            return None, None
        cond, zeros, p0 = where.args
        sm = self.value(p0, "relax.nn.softmax")
        fl = self.value(zeros, "relax.full_like")
        if sm is None or not _last_axis(sm) or fl is None or not _is_const(fl.args[1], 0.0):
            return None, None
        if not fl.args[0].same_as(p0) or self.uses.get(p0, 0) != 2:
            return None, None
        x = sm.args[0]
        # cond = not(astype(max(astype(not(equal(x, -inf)), int8), -1, keepdims), bool))
        chain = ["relax.logical_not", "relax.astype", "relax.max", "relax.astype"]
        e = cond
        for op in chain:
            value = self.value(e, op)
            if value is None:
                return None, None
            if op == "relax.max" and not _last_axis_reduce(value):
                return None, None
            e = value.args[0]
        neg = self.value(e, "relax.logical_not")
        eq = self.value(neg.args[0], "relax.equal") if neg is not None else None
        if eq is None or not eq.args[0].same_as(x) or not _is_const(eq.args[1], float("-inf")):
            return None, None
        if self.uses.get(x, 0) != 2:
            return None, None
        return True, sm

    def _is_scores(self, expr) -> bool:
        """``expr`` is the (scaled) ``Q K^T``, read once (which addend is the mask: a 4-D
        bias such as T5's ``(1, H, S, N)`` looks like scores too)."""
        shape = static_shape(expr)
        if shape is None or len(shape) != 4 or expr.ty.dtype not in self.dtypes:
            return False
        if not self.single_use(expr):
            return False
        unscaled, _ = self._scale(expr)
        return unscaled is not None and self._qk(unscaled) is not None

    def _scale(self, expr):
        """(unscaled scores, scale)."""
        for op in ("relax.multiply", "relax.divide"):
            call = self.value(expr, op)
            if call is None:
                continue
            a, b = call.args
            if op == "relax.multiply" and _scalar(a) is not None:
                a, b = b, a
            c = _scalar(b)
            if c is None or not self.single_use(a):
                return None, None
            if op == "relax.divide":
                return (a, 1.0 / c) if c != 0 else (None, None)
            return a, c
        return expr, 1.0

    def _qk(self, scores):
        """(Q, K^T) 4-D of ``scores = matmul(Q, K^T)`` (or its 3-D form reshaped)."""
        mm = self.value(scores, "relax.matmul")
        if mm is not None:
            return tuple(mm.args) if len(static_shape(scores)) == 4 else None
        reshape = self.value(scores, "relax.reshape")
        if reshape is None:
            return None
        mm = self.value(reshape.args[0], "relax.matmul")
        if mm is None or not self.single_use(reshape.args[0]):
            return None
        q, kt = (self.unview(a, single=False) for a in mm.args)
        return None if q is None or kt is None else (q, kt)

    def _check(self, what, q, kt, v, mask, scale, guard, out_3d):
        qs, kts, vs = static_shape(q), static_shape(kt), static_shape(v)
        if any(s is None or len(s) != 4 for s in (qs, kts, vs)):
            return skip(logger, what, "operands not 4-D") or None
        dtype = v.ty.dtype
        if dtype not in self.dtypes or any(e.ty.dtype != dtype for e in (q, kt)):
            return skip(logger, what, "Q, K, V of different dtypes") or None
        b, h, _s, d = qs
        n = kts[3]
        same = all(
            prove_equal_shapes(x, y)
            for x, y in ((kts[0], b), (kts[1], h), (kts[2], d), (vs[0], b), (vs[1], h), (vs[2], n))
        )
        if not same:
            return skip(logger, what, "Q, K, V shapes do not agree (broadcast heads?)") or None
        if not isinstance(d, tirx.IntImm) or not isinstance(vs[3], tirx.IntImm):
            return skip(logger, what, "head dim not static") or None
        if self.cuda and not attention_cuda.supports(int(d), int(vs[3]), dtype):
            return skip(logger, what, f"no CUDA kernel for head dims {d}, {vs[3]}") or None
        mask, where_fill = mask
        if self.cuda and mask is not None and not self.cuda_masks:
            return skip(logger, what, "masked: stock's CUDA kernels are faster (measured)") or None
        if isinstance(_s, tirx.IntImm) and isinstance(n, tirx.IntImm):
            small = int(_s) * int(n) < MIN_STATIC_SCORES
            if small and not self._skips_blocks(mask, where_fill):
                return skip(logger, what, f"static S x N = {_s} x {n}: faster unfused") or None
        mask_dims = None
        if mask is not None:
            mask_dtype = "bool" if where_fill is not None else dtype
            mask_dims = _mask_dims(mask, (b, h, _s, n), mask_dtype)
            if mask_dims is None:
                return skip(logger, what, f"mask not {mask_dtype} or not broadcastable") or None
        return _Plan(q, kt, v, (mask, mask_dims, where_fill), scale, guard, out_3d)

    def _skips_blocks(self, mask, where_fill) -> bool:
        """Whether the mask sets scores to ``-inf`` (the kernel then skips the key blocks it
        masks whole: a causal mask's above the diagonal): a where with fill ``-inf`` (the ONNX
        exporters' causal ``Where``), a constant with a ``-inf`` in it, or
        ``where(C, 0, -inf)`` / ``where(C, -inf, 0)`` (torch's ``is_causal`` and boolean
        ``attn_mask``)."""
        if mask is None:
            return False
        if where_fill is not None:
            return where_fill[0] == float("-inf")
        if isinstance(mask, GenericConst):
            values = mask.value.numpy()
            floating = values.dtype.name in ("float32", "float16")
            return floating and bool(np.isneginf(values).any())
        where = self.value(mask, "relax.where")
        if where is None:
            return False
        a, b = (self.bound.get(x, x) if isinstance(x, relax.Var) else x for x in where.args[1:])
        return {_scalar(a), _scalar(b)} == {0.0, float("-inf")}


def _same_shape(a, b) -> bool:
    return (
        a is not None
        and b is not None
        and len(a) == len(b)
        and all(prove_equal_shapes(x, y) for x, y in zip(a, b, strict=True))
    )


def _last_axis(softmax: relax.Call) -> bool:
    ndim = softmax.args[0].ty.ndim
    return ndim > 0 and int(softmax.attrs.axis) % ndim == ndim - 1


def _last_axis_reduce(call: relax.Call) -> bool:
    ndim = call.args[0].ty.ndim
    axes = call.attrs.axis
    return (
        axes is not None
        and len(axes) == 1
        and int(axes[0]) % ndim == ndim - 1
        and bool(call.attrs.keepdims)
    )


def _scalar(expr) -> float | None:
    if isinstance(expr, GenericConst):
        arr = expr.value.numpy()
        if arr.size == 1 and arr.dtype.name in ("float32", "float16"):
            return float(arr.reshape(-1)[0])
    return None


def _is_const(expr, value: float) -> bool:
    c = _scalar(expr)
    return c is not None and (c == value)


def _mask_dims(mask, dims, dtype: str):
    """Per scores axis, whether the mask varies along it (False: broadcast), or None."""
    shape = static_shape(mask)
    if shape is None or mask.ty.dtype != dtype or len(shape) > 4:
        return None
    shape = [tirx.IntImm("int64", 1)] * (4 - len(shape)) + shape
    kept = []
    for m, s in zip(shape, dims, strict=True):
        if prove_equal_shapes(m, s):
            kept.append(True)
        elif isinstance(m, tirx.IntImm) and int(m) == 1:
            kept.append(False)
        else:
            return None
    return tuple(kept)


@mutator
class _Rewriter(PyExprMutator):
    def __init__(
        self, mod: IRModule, registers: tuple[int, int] | None, cuda_all_forms: bool = False
    ):
        """``registers``: the CPU's SIMD registers and lanes; None: CUDA."""
        super().__init__(mod)
        self.mod = mod
        self.registers = registers
        self.cuda_all_forms = cuda_all_forms
        self.count = 0
        self.plans: dict = {}

    def transform(self) -> IRModule:
        for gv, func in self.mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
                continue
            matcher = _Matcher(func, self.registers is None, self.cuda_all_forms)
            self.plans = {}
            for value in matcher.bound.values():
                if op_name(value) == "relax.matmul":
                    plan = matcher.match(value)
                    if plan is not None:
                        self.plans[value] = plan
            if not self.plans:
                continue
            new_func = self.visit_expr(func)
            new_func = relax.analysis.remove_all_unused(new_func)
            self.builder_.update_func(gv, new_func)
        return self.builder_.get()

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        plan = self.plans.get(call)
        if plan is None:
            return super().visit_call_(call)
        bb = self.builder_
        q, kt, v = (self.visit_expr(x) for x in (plan.q, plan.kt, plan.v))
        mask, mask_dims, where_fill = plan.mask
        args = [q, kt, v] if plan.layouts is None else [self.visit_expr(x) for x in plan.bases]
        if mask is not None:
            mask = self.visit_expr(mask)
            if mask.ty.ndim < 4:
                shape = [1] * (4 - mask.ty.ndim) + list(mask.ty.shape.values)
                mask = bb.emit(relax.op.reshape(mask, shape))
            args.append(mask)
        qs, vs = q.ty.shape.values, v.ty.shape.values
        dtype = v.ty.dtype
        common = (int(qs[3]), int(vs[3]), plan.scale, mask_dims, "zero" if plan.guard else "nan")
        if self.registers is None:
            kernel = attention_cuda.attention_kernel_cuda(*common, where_fill, dtype)
        else:
            kernel = attention_kernel(*common, where_fill, *self.registers, plan.layouts)
        gv = bb.add_func(kernel, KERNEL_NAME)
        out_sinfo = relax.TensorType([qs[0], qs[1], qs[2], vs[3]], dtype)
        out = bb.emit(relax.call_tir(gv, args, out_sinfo))
        self.count += 1
        if plan.out_3d:
            return relax.op.reshape(out, call.ty.shape)
        return out
