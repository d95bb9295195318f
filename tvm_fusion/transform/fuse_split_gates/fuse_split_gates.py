"""FuseSplitGates: matmul (+ bias) -> split -> elementwise gates becomes ONE kernel (TVM #2890).

Matches, inside a dataflow block:

- one or more gate GEMMs ``y = x @ W^T`` / ``x @ W`` (``R.matmul``, with ``R.permute_dims`` of
  the weight or not, optionally ``+ b``: what ``FuseTransposeMatmul``'s input, the ONNX
  importer's Gemm/MatMul and frameworks' ``linear`` produce), each split along the
  output-feature axis into ``k`` pieces of equal width ``D`` (``R.split`` by sections or
  indices, or ``R.strided_slice`` pieces covering the axis: ONNX Split/Slice, torch ``chunk``;
  equal slices of the GEMM output, which torch's TorchScript exporter writes once per use of a
  ``chunk`` piece, count as one piece);
- the elementwise/broadcast ops that consume the pieces (sigmoid, tanh, exp, silu, gelu,
  gelu_tanh, relu, add, multiply, ...), together with other tensors broadcast to ``(rows, D)``
  (the LSTM cell state, the GRU hidden state, constants, boolean masks of ``where``; ``clip``'s
  bounds).
  Several GEMMs whose pieces meet in these ops (the GRU cell's input and hidden GEMMs) form one
  group; a GEMM that reads another group's results (the next step of an unrolled RNN: ONNX
  LSTM / GRU, or torch.export's ``nn.LSTM``) starts its own group, which reads them as inputs;
- non-constant tensors added to the GEMM output before the split that broadcast to it with
  all its features (torch.export's ``nn.LSTM``: per step ``h @ W_hh^T + b`` plus the step's
  slice of the input projection computed for all steps): read by the kernel and added to the
  accumulator tile with the bias.

A linear layer on N-D rows written as views around a 2-D GEMM (TVM's PyTorch frontend:
``reshape(x, (b*s, K)) -> matmul (+ bias) -> reshape((b, s, N))``), whose result is split or
meets a sibling's in gate math, is first folded into one GEMM on the N-D rows
(``views.py``; torch's ``unflatten(-1, (k, D)).unbind(-2)`` pieces become slices of the
last axis there too); the fold is kept only when a gate group then fuses.

Two rewrites then bring other spellings of a gate GEMM to that form (constant weights only):
two linear layers summed before the split (torch's LSTMCell: ``x @ Wih^T + h @ Whh^T``) become
one GEMM over ``concat(x, h)``; sibling linear layers of one input whose results meet in the
gate math (Llama's ``silu(x @ Wg) * (x @ Wu)``, GeGLU alike) become one GEMM over the joined
weights, split into the members' results, where the group then fuses. Only a bias that
broadcasts along the features alone (``(N,)``, ``(1, ..., 1, N)`` or a scalar) joins a merged
GEMM; any other constant added to a member (a per-row ``(rows, 1)``, a full ``(rows, N)``) keeps
its add, as gate math where it broadcasts to the pieces, and a summed pair with one is left
alone.

Emits ONE ``call_tir`` whose PrimFunc computes, per output tile, every gate of every GEMM for
``V`` hidden units, then the gate math on that tile: the ``(rows, k * D)`` GEMM output never
exists in memory. Constant weights (and biases) are laid out at compile time in vector-width
blocks, ``W (k*D, K) -> Wb (D/V, K, k, V)``: for each block of ``V`` units and each step of the
reduction, the ``k`` gates' ``V`` weights are contiguous, so one output tile holds all ``k``
gates of ``V`` units. ``V`` comes from the target's schedule (``schedule.gate_block``); a ``D``
that no ``V`` divides is padded to whole blocks with zero columns that nothing reads. A weight
that is a runtime input is read in place (fused without reordering); reordering it every call
would cost a full pass over it, as much as a batch-1 GEMV itself.

Data types: float32, float16 and bfloat16. In a half-precision group every GEMM input, weight,
bias and addend has the model's dtype; the kernel widens them where it reads them, accumulates the
GEMM in float32, runs the gate math on the float32 tile (an ``astype`` to a half type inside it
rounds there) and rounds each result to its dtype once, where it is written: at least as accurate
as stock TVM, whose unfused kernels round the GEMM and each op's result (float16 also accumulates
in float16).

Where it must run: before LegalizeOps (Phase 1); the kernel is marked opaque so that FuseOps
keeps it whole, and ``schedule/cpu/gate_fusion.py`` (llvm) or ``schedule/cuda/gate_fusion.py``
schedule it.

Left alone, with the reason logged at debug level: a piece also used outside the group, a GEMM
output (or its bias sum) used by anything but the split, a split on another axis or into
unequal pieces, a bias that does not broadcast along the features only (or adds leading axes
to the GEMM result), ops not in the elementwise table, tensors that do not broadcast to the
pieces' shape, data other than float32 / float16 / bfloat16, mixed dtypes (a float16 GEMM
with a float32 result or bias, an ``astype`` between GEMM and split), a split piece no op reads
(an ONNX LSTM with ``input_forget``), and groups whose external inputs depend on the group's
own results (a GRU with ``linear_before_reset = 0``: its second GEMM reads the reset gate).

The pieces, in the order they run: ``views.py`` (canonicalisation), ``merge.py`` (summed and
sibling GEMMs), ``match.py`` (one GEMM and its pieces), ``group.py`` (the gate math grown from
the pieces), ``plan.py`` (the block ``V``, the blocked weight), ``emit.py`` (the kernel and the
rewrite); ``ops.py`` holds the elementwise op table and the data types.
"""

from __future__ import annotations

import tvm
from tvm import IRModule

from ... import target as _target
from .._common import get_logger, record_rewrite, skip
from .emit import _Rewriter
from .merge import _merge_siblings, _MergeSummedGemms
from .views import fold_row_views, unbind_to_slices

logger = get_logger(__name__)
NAME = "FuseSplitGates"


@tvm.transform.module_pass(opt_level=0, name=NAME)
class FuseSplitGates:
    """Fuses ``matmul(+bias) -> split -> elementwise gates`` into one kernel, weights blocked."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        target = _target.resolve_target(self.target)
        folded = fold_row_views(unbind_to_slices(mod))
        count, out = self._fuse(folded, target)
        if count == 0 and folded is not mod:
            skip(logger, "views of linear layers", "no gate group fused through them")
            count, out = self._fuse(mod, target)
        record_rewrite(NAME, count)
        return out

    @staticmethod
    def _fuse(mod: IRModule, target) -> tuple[int, IRModule]:
        mod = _MergeSummedGemms(mod).transform()
        mod = _merge_siblings(mod, target)
        rewriter = _Rewriter(mod, target)
        mod = rewriter.transform()
        return rewriter.count, mod
