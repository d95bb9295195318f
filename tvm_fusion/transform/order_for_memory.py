"""OrderForMemory: reorder the grouped program so that large tensors die early.

FuseOps decides where each fused group is called, and it does not look at memory. Two things
it does undo what our chunked passes build (seen on FuseLinearCrossEntropy's backward, where
they kept every chunk's (C, V) logit gradient and every (V, K) weight-gradient partial alive at
once, 2.3 GB at N 2048, V 32000 instead of a few hundred MB):

- it calls a group early, at the first of its inputs, so the recomputed logits and the logit
  gradients of every chunk are made before the first chunk's matmuls read them;
- it fuses an accumulation ``acc = p1 + p2 + ... + pk`` (what ``relax.transform.Gradient``
  emits for a weight read by k chunks) into one group with k inputs, so every partial lives
  until the last one is made.

This pass runs on the grouped program (Phase 3, before FuseTIR). It splits such accumulation
groups back into their two-input steps, then reorders every dataflow block of the entry
functions, keeping each binding after its producers and before its consumers:

- a binding that frees at least as many bytes as it allocates (its inputs die there) moves up,
  right after its last producer; tuples and tuple items (views) move up too;
- a binding that allocates more than it frees moves down, right before its first consumer,
  with the producers that only it reads and the views that only read it.

Moves that would shorten no tensor's life by 64 KiB or more are not made.

Sizes come from static struct info; a symbolic size counts as unknown and nothing moves for
it. Blocks with ``match_cast`` bindings are left alone (they define symbolic variables), as are
groups whose parameters are small (under 1 MiB each): splitting those would only add launches.
"""

from __future__ import annotations

import tvm
from tvm import IRModule, relax, tirx

from ._common import get_logger, record_rewrite, vars_in

logger = get_logger(__name__)
NAME = "OrderForMemory"
MIN_SPLIT_BYTES = 1 << 20
MIN_GAIN_BYTES = 64 << 10  # a move must shorten the life of at least this much
_ACCUMULATE = ("add",)


def _bytes(sinfo) -> int | None:
    if isinstance(sinfo, relax.TupleType):
        sizes = [_bytes(f) for f in sinfo.fields]
        return None if any(s is None for s in sizes) else sum(sizes)
    if not isinstance(sinfo, relax.TensorType) or not isinstance(sinfo.shape, relax.ShapeExpr):
        return 0 if not isinstance(sinfo, relax.TensorType) else None
    total = tvm.runtime.DataType(str(sinfo.dtype)).bits // 8
    for d in sinfo.shape.values:
        if not isinstance(d, tirx.IntImm):
            return None
        total *= int(d.value)
    return total


@tvm.transform.module_pass(opt_level=0, name=NAME)
class OrderForMemory:
    """Splits accumulation groups and reorders bindings so that large tensors die early (see
    the module docstring)."""

    def __init__(self, target=None):
        self.target = target

    def transform_module(self, mod: IRModule, _ctx: tvm.transform.PassContext) -> IRModule:
        chains = {
            gv: steps
            for gv, func in mod.functions_items()
            if isinstance(func, relax.Function) and (steps := _accumulation(func)) is not None
        }
        changed = 0
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function) or func.attrs.get("Primitive", False):
                continue
            new_func, count = _rewrite_function(func, chains)
            if count:
                updates[gv] = new_func
                changed += count
        if not updates:
            return mod
        mod = IRModule(dict(mod.functions_items()), attrs=mod.attrs, global_infos=mod.global_infos)
        for gv, func in updates.items():
            mod[gv] = func
        record_rewrite(NAME, changed)
        return mod


def _accumulation(func: relax.Function) -> list | None:
    """``[(prim_gvar, out_sinfo), ...]`` when ``func`` is a group ``((p0 + p1) + p2) + ...``
    of one elementwise PrimFunc over large parameters, else None."""
    if not func.attrs.get("Primitive", False) or len(func.params) < 3:
        return None
    body = func.body
    if len(body.blocks) != 1:
        return None
    bindings = list(body.blocks[0].bindings)
    if len(bindings) != len(func.params) - 1:
        return None
    sizes = [_bytes(p.ty) for p in func.params]
    if any(s is None or s < MIN_SPLIT_BYTES for s in sizes):
        return None
    steps = []
    prev = func.params[0]
    for binding, param in zip(bindings, func.params[1:], strict=True):
        value = binding.value
        if not (
            isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.Op)
            and value.op.name == "relax.call_tir"
            and isinstance(value.args[0], relax.GlobalVar)
            and value.args[0].name_hint.rstrip("0123456789") in _ACCUMULATE
        ):
            return None
        args = list(value.args[1].fields)
        if len(args) != 2 or not (args[0].same_as(prev) and args[1].same_as(param)):
            return None
        steps.append((value.args[0], binding.var.ty))
        prev = binding.var
    if not (isinstance(body.body, relax.Var) and body.body.same_as(prev)):
        return None
    return steps


def _rewrite_function(func: relax.Function, chains: dict):
    count = 0
    blocks = []
    for block in func.body.blocks:
        bindings = list(block.bindings)
        if isinstance(block, relax.DataflowBlock):
            bindings, split = _split_accumulations(bindings, chains)
            count += split
            if not any(isinstance(b, relax.MatchCast) for b in bindings):
                bindings, moved = _reorder(bindings)
                count += moved
            blocks.append(relax.DataflowBlock(bindings))
        else:
            blocks.append(block)
    if not count:
        return func, 0
    body = relax.SeqExpr(blocks, func.body.body)
    new = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)
    return relax.BlockBuilder().normalize(new), count


def _split_accumulations(bindings: list, chains: dict):
    out = []
    split = 0
    for binding in bindings:
        value = binding.value
        steps = None
        if isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar):
            steps = chains.get(value.op)
        if steps is None:
            out.append(binding)
            continue
        args = list(value.args)
        acc = args[0]
        for i, ((prim, sinfo), operand) in enumerate(zip(steps, args[1:], strict=True)):
            call = relax.Call(
                tvm.ir.Op.get("relax.call_tir"), [prim, relax.Tuple([acc, operand])], None, [sinfo]
            )
            if i == len(steps) - 1:
                var = binding.var
            else:
                var = relax.DataflowVar(f"{binding.var.name}_acc{i}", sinfo)
            out.append(relax.VarBinding(var, call))
            acc = var
        split += 1
    return out, split


def _exclusive_producers(i, inputs, users, index_of_var, keep) -> set:
    """``i`` and, transitively, the producers whose every reader is in the set: the bindings
    that can move with ``i`` without changing anyone else's inputs."""
    members = {i}
    stack = [i]
    while stack:
        j = stack.pop()
        for v in inputs[j]:
            k = index_of_var[v]
            if k in members or k in keep:
                continue
            if users[k] and all(u in members for u in users[k]):
                members.add(k)
                stack.append(k)
    return members


def _downstream_views(i, users, views, inputs, index_of_var) -> set:
    """Tuples and tuple items that (transitively) read only ``i``'s output."""
    found: set = set()
    stack = [i]
    while stack:
        j = stack.pop()
        for u in users[j]:
            if u in views and u not in found:
                if all(index_of_var[v] in found | {i} for v in inputs[u]):
                    found.add(u)
                    stack.append(u)
    return found


def _reorder(bindings: list):
    """Hoist bindings that free at least what they allocate, sink those that allocate more."""
    index_of_var = {}
    for i, b in enumerate(bindings):
        index_of_var[b.var] = i
    inputs = [[v for v in vars_in(b.value) if v in index_of_var] for b in bindings]
    sizes = [_bytes(b.var.ty) for b in bindings]
    if any(s is None for s in sizes):
        return bindings, 0
    # tuples and their items are views: they allocate nothing
    views = {
        i for i, b in enumerate(bindings) if isinstance(b.value, relax.Tuple | relax.TupleGetItem)
    }
    allocs = [0 if i in views else sizes[i] for i in range(len(bindings))]
    order = list(range(len(bindings)))  # order[position] = binding index
    keep = {i for i, b in enumerate(bindings) if not isinstance(b.var, relax.DataflowVar)}

    def consumers(i):
        return [j for j in range(len(bindings)) if bindings[i].var in inputs[j]]

    users = [consumers(i) for i in range(len(bindings))]

    def freed(i, where, pos):
        total = 0
        for v in set(inputs[i]):
            k = index_of_var[v]
            if k in keep:
                continue
            if all(pos[u] < where for u in users[k] if u != i):
                total += sizes[k]
        return total

    moved = 0
    for i in range(len(bindings)):  # hoist views, then what frees at least what it allocates
        pos = {b: p for p, b in enumerate(order)}
        producers = [pos[index_of_var[v]] for v in inputs[i]]
        target = max(producers) + 1 if producers else 0
        if target < pos[i] and (
            i in views or freed(i, target, pos) >= max(allocs[i], MIN_GAIN_BYTES)
        ):
            order.remove(i)
            order.insert(target, i)
            moved += 1
    for i in reversed(range(len(bindings))):  # sink, with the producers only it reads
        pos = {b: p for p, b in enumerate(order)}
        if i in views:
            continue
        members = _exclusive_producers(i, inputs, users, index_of_var, keep)
        after = _downstream_views(
            i, users, views, inputs, index_of_var
        )  # tuples / items of the output move along
        readers = {u for m in after | {i} for u in users[m]} - after
        if not readers:
            continue
        first = min(pos[u] for u in readers)
        group = sorted(members | after, key=pos.get)
        if all(pos[m] == first - len(group) + k for k, m in enumerate(group)):
            continue  # already right before its first reader
        outside = {index_of_var[v] for m in members for v in inputs[m]} - members
        dying = sum(
            sizes[k]
            for k in outside
            if k not in keep and all(pos[u] < first for u in users[k] if u not in members)
        )
        if allocs[i] - dying >= MIN_GAIN_BYTES:
            for m in group:
                order.remove(m)
            at = order.index(min(readers, key=pos.get))
            order[at:at] = group
            moved += 1
    if order == list(range(len(bindings))):
        return bindings, 0
    return [bindings[i] for i in order], moved
