"""The package's layering, read from the source (no TVM import): every import inside
``tvm_fusion`` (module level and inside functions) goes to a layer at or below the importer's,
and the module import graph has no cycle.

Layers, bottom up (ARCHITECTURE.md, "Where things live"): the ground modules; ``schedule``
(closest to the machine); ``lower``; ``transform``; ``frontend``; ``build`` (composes the stages);
``tools``; ``testing``. A stage may use what the stages nearer the machine offer (FuseSplitGates
asks the schedule for the weight block its kernel reads; the ONNX importer emits the RNN loop
kernel of ``lower``), never the reverse. ``tvm_fusion/__init__.py`` is the public face and
imports everything; nothing inside the package imports it but the fuzzers' worker start-up.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tvm_fusion"

GROUND = {"_compat", "check_kernels", "errors", "pool", "target", "tir_util", "models"}
LAYERS = ["schedule", "lower", "transform", "frontend", "build", "tools", "testing"]
MAX_LINES = 650  # the limit; STYLE.md asks for ~600


def _layer(module: str) -> int:
    """0 for the ground, 1.. for the stages in LAYERS; the package face above them all."""
    top = module.split(".")[1] if "." in module else ""
    if top == "":
        return len(LAYERS) + 1
    if top in GROUND:
        return 0
    if top in LAYERS:
        return LAYERS.index(top) + 1
    raise AssertionError(f"{module}: in no layer; add it to GROUND or LAYERS (and ARCHITECTURE.md)")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The tvm_fusion modules that ``module`` imports, anywhere in its body."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            # `from pkg import sub` imports the submodule; `from mod import name` the module
            names = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known]
            names = names or [source]
        else:
            continue
        for name in names:
            while name and name not in known:  # a name inside a module: the module
                name = name.rpartition(".")[0]
            if name.startswith("tvm_fusion") and name != module:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _parent_packages(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_every_module_has_a_layer():
    for module in _modules():
        _layer(module)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    upward = []
    for module, deps in _graph().items():
        if module == "tvm_fusion":
            continue
        for dep in deps:
            if dep == "tvm_fusion" and module.startswith("tvm_fusion.testing"):
                continue  # the fuzzers' workers import the package once, to register it
            if dep in _parent_packages(module):
                continue  # a module's own package face (`from . import Instance`)
            if _layer(dep) > _layer(module):
                upward.append(f"{module} -> {dep}")
    assert not upward, "imports that climb a layer:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    graph = _graph()
    # A package's face importing its own modules is not a cycle of the design: drop the edges
    # from a module back up to the packages that contain it.
    edges = {m: {d for d in deps if d not in _parent_packages(m)} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_source_file_over_the_limit():
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"
