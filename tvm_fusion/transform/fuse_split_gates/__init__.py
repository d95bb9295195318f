"""FuseSplitGates: matmul (+ bias) -> split -> elementwise gates as ONE kernel (TVM #2890).

The contract (what is matched, what is emitted, where it runs, what is left alone) is the
docstring of ``fuse_split_gates.py``, the pass. Its pieces, in the order they run:

- ``views.py``: canonicalisation, a linear layer on N-D rows written as views around a 2-D GEMM
  as one GEMM on the N-D rows, torch's unbind pieces as slices;
- ``merge.py``: two linear layers summed before the split, and sibling linear layers of one
  input meeting in gate math, as one gate GEMM (joined weights and bias);
- ``match.py``: one gate GEMM and the equal pieces of its split;
- ``group.py``: the gate math grown from the pieces, GEMMs joined into groups;
- ``plan.py``: the vector block ``V``, the blocked weight ``(D/V, K, k, V)``, the emission order;
- ``emit.py``: the fused kernel's TE and the rewrite to one ``call_tir`` per group;
- ``ops.py``: the elementwise op table and the data types (shared with ``views.py``).
"""

from .emit import GATE_ATTR
from .fuse_split_gates import FuseSplitGates

__all__ = ["GATE_ATTR", "FuseSplitGates"]
