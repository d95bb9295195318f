"""The fusion report: stock TVM's groups and ours side by side, and the fused graph as DOT.

``fusion_report(mod, target)`` lowers ``mod`` with stock TVM and with the ``tvm_fusion`` pipeline
to the grouped stage (after FuseOps and our Phase 3) and lists the groups side by side with the
rewrites each of our passes made and the rule that scheduled each of our kernels. ``to_dot``
draws ``main``'s dataflow. The public functions parse their target where it enters; the helpers
below them take a ``Target``.
"""

from __future__ import annotations

import dataclasses
import json

import tvm
from tvm import relax
from tvm.target import Target

from ...target import parse_target
from .kernels import KERNEL_CALL_OPS, Kernel, callee_ops, kernels, view_count
from .schedules import schedule_info


@dataclasses.dataclass
class FusionReport:
    name: str
    target: str
    stock: list[Kernel]
    ours: list[Kernel]
    rewrites: dict[str, int]
    stock_views: int = 0
    ours_views: int = 0
    # our kernels once scheduled: PrimFunc name -> the rule that scheduled it
    rules: dict[str, str | None] = dataclasses.field(default_factory=dict)
    # how stock's side was lowered when not from the module as given ("" when it was)
    stock_note: str = ""

    @property
    def fallback(self) -> list[str]:
        from ...schedule import FALLBACK_RULES

        return [name for name, rule in self.rules.items() if rule in FALLBACK_RULES]

    @property
    def stock_kernels(self) -> int:
        return len(self.stock)

    @property
    def ours_kernels(self) -> int:
        return len(self.ours)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "target": self.target,
            "kernels": {"stock": self.stock_kernels, "tvm_fusion": self.ours_kernels},
            "views": {"stock": self.stock_views, "tvm_fusion": self.ours_views},
            "rewrites": dict(self.rewrites),
            "groups": {
                "stock": [k.label() for k in self.stock],
                "tvm_fusion": [k.label() for k in self.ours],
            },
            "schedule_rules": dict(self.rules),
            "stock_note": self.stock_note,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_text(self) -> str:
        lines = [
            f"fusion report: {self.name} on {self.target}",
            f"  kernels: stock {self.stock_kernels}, tvm_fusion {self.ours_kernels}"
            f"  (zero-copy views: stock {self.stock_views}, tvm_fusion {self.ours_views})",
            "  rewrites: "
            + (
                ", ".join(f"{k} x{v}" for k, v in sorted(self.rewrites.items()))
                if self.rewrites
                else "none"
            ),
            *([f"  stock: {self.stock_note}"] if self.stock_note else []),
            "  stock groups:",
            *[f"    {i}. {k.label()}" for i, k in enumerate(self.stock, 1)],
            "  tvm_fusion groups:",
            *[f"    {i}. {k.label()}" for i, k in enumerate(self.ours, 1)],
        ]
        if self.rules:
            lines.append("  tvm_fusion kernels, scheduled by:")
            lines += [
                f"    {name}: {rule or 'a tuning record'}" for name, rule in self.rules.items()
            ]
            if self.fallback:
                lines.append(
                    f"  warning: {len(self.fallback)} kernel(s) left to the fallback rule: "
                    + ", ".join(self.fallback)
                )
        return "\n".join(lines)


def grouped(mod: tvm.IRModule, target, ours: bool, **flags) -> tvm.IRModule:
    """Lower ``mod`` to the grouped stage: Phases 0-2 (and our 1 and 3 when ``ours``).
    ``target``: what :func:`~tvm_fusion.target.parse_target` takes (None: the host)."""
    return _grouped(mod, parse_target(target), ours, flags)


def _grouped(mod: tvm.IRModule, tgt: Target, ours: bool, flags: dict) -> tvm.IRModule:
    from ...build import pipeline

    with tgt:
        if ours:
            passes = [*pipeline.dispatch_passes(tgt), *pipeline.fusion_passes(tgt, **flags)]
        else:
            passes = [*pipeline._backend(tgt).library_dispatch_passes(tgt)]
        passes += pipeline.lowering_passes()
        if ours:
            passes += pipeline.post_fusion_passes(tgt, **flags)
        return tvm.transform.Sequential(passes)(mod)


def fusion_report(mod: tvm.IRModule, target=None, name: str = "model", **flags) -> FusionReport:
    """Groups of stock TVM and of ``tvm_fusion`` side by side, with our rewrite counts."""
    from ...build.pipeline import build_pipeline
    from ...transform import collect_rewrites

    tgt = parse_target(target)
    tuning_db = flags.pop("tuning_db", None)  # schedules only: the groups do not depend on it
    stock_mod, note = _stock_grouped(mod, tgt)
    with collect_rewrites() as counts:
        ours_mod = _grouped(mod, tgt, True, flags)
    with tgt:
        scheduled = build_pipeline(tgt, tuning_db=tuning_db, **flags)(mod)
    return FusionReport(
        name=name,
        target=str(tgt.kind.name),
        stock=kernels(stock_mod),
        ours=kernels(ours_mod),
        rewrites=dict(counts),
        stock_views=view_count(stock_mod),
        ours_views=view_count(ours_mod),
        rules={info.name: info.rule for info in schedule_info(scheduled)},
        stock_note=note,
    )


def _stock_grouped(mod: tvm.IRModule, tgt: Target) -> tuple[tvm.IRModule, str]:
    """Stock's groups of ``mod``; where stock cannot lower the importer's output (a tensor
    whose shape the importer lost: "te.compute ... 'NoneType' object is not iterable" for a
    static-shape import of DistilBERT), stock's groups of it after our PlaceShapeOnHost, as
    the model benchmark's stock-pipeline engine does; an empty module when that fails too."""
    from ...build.pipeline import fusion_passes

    try:
        return _grouped(mod, tgt, False, {}), ""
    except Exception as err:  # noqa: BLE001 - the report covers ours whatever stock does
        reason = str(err).strip().splitlines()[-1][:160] if str(err).strip() else repr(err)
    try:
        with tgt:
            shapes = [p for p in fusion_passes(tgt) if p.info.name == "PlaceShapeOnHost"]
            placed = tvm.transform.Sequential(shapes)(mod)
        return _grouped(placed, tgt, False, {}), (
            f"stock cannot lower this import ({reason}); its groups after PlaceShapeOnHost"
        )
    except Exception:  # noqa: BLE001
        return tvm.IRModule(), f"stock cannot lower this import ({reason})"


def to_dot(mod: tvm.IRModule, title: str = "tvm_fusion") -> str:
    """The dataflow of ``main`` as Graphviz DOT: kernels as boxes, views as dashed nodes."""
    func = mod["main"]
    lines = [f'digraph "{title}" {{', "  rankdir=TB;", '  node [fontname="monospace"];']
    names: dict[relax.Var, str] = {}

    def node_id(var: relax.Var) -> str:
        if var not in names:
            names[var] = f"n{len(names)}"
        return names[var]

    for param in func.params:
        lines.append(f'  {node_id(param)} [label="{param.name}", shape=ellipse];')

    def used_vars(expr) -> list[relax.Var]:
        seen: list[relax.Var] = []

        def visit(e):
            if isinstance(e, relax.Var) and e in names and e not in seen:
                seen.append(e)

        relax.analysis.post_order_visit(expr, visit)
        return seen

    def binding_label(value) -> tuple[str, str]:
        if isinstance(value, relax.Call):
            op = value.op
            if isinstance(op, tvm.ir.Op):
                if op.name in KERNEL_CALL_OPS:
                    callee = value.args[0]
                    name = getattr(callee, "name_hint", str(callee))
                    ops = callee_ops(mod, callee)
                    return f"{name}\\n{' '.join(ops[:6])}", "box"
                if op.name == "relax.reshape":
                    return "reshape (view)", "box, style=dashed"
                return op.name.removeprefix("relax."), "box"
            if isinstance(op, relax.GlobalVar):
                ops = callee_ops(mod, op)
                return f"{op.name_hint}\\n{' '.join(ops[:6])}", "box, style=bold"
        if isinstance(value, relax.TupleGetItem):
            return f"[{value.index}]", "point"
        return type(value).__name__, "plaintext"

    for block in func.body.blocks:
        for binding in block.bindings:
            label, shape = binding_label(binding.value)
            nid = node_id(binding.var)
            lines.append(f'  {nid} [label="{label}", shape={shape}];')
            for src in used_vars(binding.value):
                if src is not binding.var:
                    lines.append(f"  {names[src]} -> {nid};")
    lines.append("}")
    return "\n".join(lines) + "\n"
