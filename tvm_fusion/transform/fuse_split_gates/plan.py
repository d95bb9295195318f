"""Planning a gate group's kernel: the vector block ``V`` of the target's schedule
(:func:`_plan_block`), the constant weight blocked for it (:func:`_blocked_weight`,
``W (k*D, K) -> Wb (D/V, K, k, V)``, a ``D`` that no ``V`` divides padded with zero columns;
gathered expert weights per expert, :func:`_gathered_weight`),
and the order in which a block with fused groups is emitted again (:func:`_emission_order`).
"""

from __future__ import annotations

import numpy as np

from .._common import get_logger, skip, vars_in
from .group import _Group
from .match import _Block, _int

logger = get_logger(__name__)


def _plan_block(group: _Group, target) -> int | None:
    """The vector block V of ``group`` on ``target`` (set on the group), None when none fits."""
    from ...schedule import gate_block
    from ...target import is_gpu

    # On CPU each GEMM of the group accumulates in registers on its own (one after the other in
    # a tile): its gates, not the group's, share the register budget (a GRU's two GEMMs of 3).
    n_gates = (sum if is_gpu(target) else max)(g.gates for g in group.gemms)
    rows = 1
    for d in group.rows:
        rows = rows * _int(d) if _int(d) is not None and rows is not None else None
    if is_gpu(target) and any(g.ids is not None for g in group.gemms):
        rows = 1  # gathered expert weights: the CUDA rule's per-row split-K GEMV, any rows
    block = gate_block(target, group.width, n_gates, rows)
    if block is not None and not is_gpu(target) and any(g.ids is not None for g in group.gemms):
        block = _gathered_block(target, block, group.width, n_gates, rows)
    if block is None:
        skip(logger, f"gates of width {group.width}", "no vector block divides the width")
    group.block = block
    return block


def _gathered_block(target, block: int, width: int, gates: int, rows) -> int:
    """The block of a gathered kernel (``W[ids[row]]``) on a CPU: its register tile has at
    most ``PADDED_ROWS_MAX`` rows (two pointers a row, see ``cpu/gate_fusion.tile_rows``), so
    a single gate of one vector leaves 4 accumulators, too few to hide the FMA latency; the
    block is then widened (two vectors, 8 accumulators) where that divides the width. The
    down projection of transformers' experts (1024 x 2816, 8 experts, top 2, rows sorted by
    expert, engines alternating, load 3.1-4.8): 0.92x the time at 512 tokens, 0.81x at 64."""
    from ... import target as _target
    from ...schedule.cpu.gate_fusion import PADDED_ROWS_MAX

    lanes = _target.vector_lanes(target, "float32")
    regs = _target.vector_registers(target)
    if rows is not None and rows < PADDED_ROWS_MAX:
        return block
    accumulators = PADDED_ROWS_MAX * gates * max(block // lanes, 1)
    wider = 2 * block
    if accumulators < regs // 2 and width % wider == 0 and 2 * accumulators <= regs // 2:
        return wider
    return block


def _blocked_weight(w: np.ndarray, transposed: bool, gates: int, width: int, block: int):
    """(k*D, K) or (K, k*D) -> (ceil(D/V), K, k, V); units past D (when V does not divide D)
    are zero columns whose results nothing reads."""
    wt = w if transposed else w.T  # (k*D, K)
    k_dim = wt.shape[1]
    blocks = -(-width // block)
    per_gate = wt.reshape(gates, width, k_dim)
    if blocks * block != width:
        per_gate = np.pad(per_gate, ((0, 0), (0, blocks * block - width), (0, 0)))
    blocked = per_gate.reshape(gates, blocks, block, k_dim).transpose(1, 3, 0, 2)
    return np.ascontiguousarray(blocked)


def _gathered_weight(w: np.ndarray, transposed: bool, gates: int, width: int, block: int):
    """Expert weights (E, k*D, K) or (E, K, k*D) -> (E, ceil(D/V), K, k, V): each expert
    blocked as :func:`_blocked_weight` does, the expert axis in front."""
    return np.stack([_blocked_weight(we, transposed, gates, width, block) for we in w])


def _emission_order(blk: _Block, groups: list[_Group]) -> list | None:
    """The block's bindings outside the groups and the groups (each one call), in an order
    that defines every variable before its use: block order, each group at its last binding,
    and whatever is not ready yet (a binding reading a group result that the group's place
    comes after; the next layer's gate input in a Llama block) waits for it. None on a
    cycle."""
    items: list = []
    region: set = set()
    for g in groups:
        members = set(g.ops) | {v for gemm in g.gemms for v in gemm.chain}
        region |= members
        items.append((max(blk.index[v] for v in members), 1, g))
    items += [(blk.index[b.var], 0, b) for b in blk.bindings if b.var not in region]
    items.sort(key=lambda t: (t[0], t[1]))

    def needs(item) -> set:
        if isinstance(item, _Group):
            exprs = [e for g in item.gemms for e in (g.x, g.weight, g.bias, g.ids) if e is not None]
            exprs += [a for g in item.gemms for a in g.addends]
            exprs += list(item.externals)
        else:
            exprs = [item.value]
        return {v for e in exprs for v in vars_in(e) if v in blk.index}

    def provides(item) -> list:
        return list(item.outputs) if isinstance(item, _Group) else [item.var]

    pending = [item for _, _, item in items]
    defined: set = set()
    order = []
    while pending:
        ready = next((i for i, item in enumerate(pending) if needs(item) <= defined), None)
        if ready is None:
            return None
        order.append(pending.pop(ready))
        defined.update(provides(order[-1]))
    return order
