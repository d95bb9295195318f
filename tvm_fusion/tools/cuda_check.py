"""What a CUDA build's kernels look like to the hardware, checked without a GPU.

For a module compiled for CUDA (``engine.compile_module(..., cuda_target())``) this reports per
kernel what ``nvcc -Xptxas -v`` and the PTX say, and the launch shape the schedule gave:

- ``registers``, ``spill_stores``/``spill_loads`` (bytes), ``stack`` (stack frame bytes: local
  arrays ptxas could not put in registers, which it does not count as spills), ``smem``
  (static shared bytes) from ptxas for ``arch``;
- ``vector_loads`` (128-bit global loads: ``ld.global[.nc].v4`` of 32-bit types, or
  ``.v2`` of 64-bit ones), ``cp_async``, ``shared_loads`` and ``barriers`` (``bar.sync``), counted
  in the kernel's PTX;
- ``mma_f32``: tensor-core ``mma.sync`` instructions with float32 accumulators (float16 /
  bfloat16 operands), counted in the PTX;
- ``blocks`` and ``threads`` per launch from the scheduled TIR's ``blockIdx``/``threadIdx``
  bindings (``None`` for a symbolic extent).

:func:`check` needs ``nvcc`` on ``PATH`` (CUDA 12 or later for sm_90) and no driver or GPU.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile

import tvm
from tvm import tirx

from ..tir_util import iter_stmts

_PTXAS_FUNC = re.compile(r"Function properties for (\S+)")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame")
_PTXAS_USED = re.compile(r"Used (\d+) registers.*?(?:, (\d+) bytes smem)?$")
_ENTRY = re.compile(r"\.entry\s+(\S+?)\s*\(")


@dataclasses.dataclass
class KernelCheck:
    name: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    smem: int = 0
    vector_loads: int = 0
    cp_async: int = 0
    shared_loads: int = 0
    barriers: int = 0
    mma_f32: int = 0
    blocks: int | None = None
    threads: int | None = None

    def to_text(self) -> str:
        launch = f"{self.blocks} blocks x {self.threads} threads" if self.blocks else "symbolic"
        return (
            f"{self.name}: {launch}, {self.registers} registers, "
            f"{self.spill_stores + self.spill_loads} B spilled, "
            + (f"{self.stack} B stack, " if self.stack else "")
            + f"{self.smem} B shared, "
            f"{self.vector_loads} 128-bit global loads, {self.cp_async} cp.async, "
            f"{self.shared_loads} shared loads, {self.barriers} bar.sync"
            + (f", {self.mma_f32} mma.sync" if self.mma_f32 else "")
        )


def have_nvcc() -> bool:
    return shutil.which("nvcc") is not None


def cuda_source(module) -> str:
    """The CUDA source of a built module (``executable.mod`` or a runtime module)."""
    if module.kind == "cuda":
        return module.inspect_source("")
    for imported in module.imports:
        found = cuda_source(imported)
        if found:
            return found
    return ""


def check(compiled, arch: str = "sm_90") -> list[KernelCheck]:
    """One :class:`KernelCheck` per CUDA kernel of ``compiled`` (an ``engine.Compiled``)."""
    source = cuda_source(compiled.executable.mod)
    ptx, log = compile_source(source, arch)
    checks = {name: KernelCheck(name) for name in _ENTRY.findall(ptx)}
    for name, body in _ptx_bodies(ptx).items():
        kc = checks.setdefault(name, KernelCheck(name))
        kc.vector_loads = len(
            re.findall(r"ld\.global(?:\.nc)?(?:\.L\w+::\w+)*\.v4\.(?:f32|b32|u32|s32)", body)
        ) + len(re.findall(r"ld\.global(?:\.nc)?(?:\.L\w+::\w+)*\.v2\.(?:f64|b64|u64)", body))
        kc.cp_async = len(re.findall(r"cp\.async\.c[ag]\.", body))
        kc.shared_loads = len(re.findall(r"ld\.shared", body))
        kc.barriers = len(re.findall(r"bar\.sync|barrier\.sync", body))
        kc.mma_f32 = len(re.findall(r"mma\.sync\.aligned\.\S+\.f32\.b?f16\.b?f16\.f32", body))
    current = None
    for line in log.splitlines():
        found = _PTXAS_FUNC.search(line)
        if found:
            current = checks.setdefault(found.group(1), KernelCheck(found.group(1)))
            continue
        if current is None:
            continue
        stack = _PTXAS_STACK.search(line)
        if stack:
            current.stack = int(stack.group(1))
        spill = _PTXAS_SPILL.search(line)
        if spill:
            current.spill_stores, current.spill_loads = int(spill.group(1)), int(spill.group(2))
        used = _PTXAS_USED.search(line.strip())
        if used:
            current.registers = int(used.group(1))
            current.smem = int(used.group(2) or 0)
    launches = launch_shapes(compiled.lowered)
    for kc in checks.values():
        base = kc.name[: -len("_kernel")] if kc.name.endswith("_kernel") else kc.name
        shape = launches.get(kc.name) or launches.get(base)
        if shape:
            kc.blocks, kc.threads = shape
    return list(checks.values())


def compile_source(source: str, arch: str) -> tuple[str, str]:
    """PTX and ptxas' ``-v`` log for CUDA ``source`` (nvcc, as TVM's build runs it)."""
    with tempfile.TemporaryDirectory() as work:
        cu = os.path.join(work, "kernels.cu")
        with open(cu, "w") as f:
            f.write(source)
        ptx = os.path.join(work, "kernels.ptx")
        base = ["nvcc", f"-arch={arch}", "-O3", "--use_fast_math", "-w"]
        subprocess.run([*base, "-ptx", "-o", ptx, cu], check=True, capture_output=True)
        proc = subprocess.run(
            [*base, "-cubin", "-Xptxas", "-v", "-o", os.path.join(work, "k.cubin"), cu],
            check=True,
            capture_output=True,
            text=True,
        )
        with open(ptx) as f:
            return f.read(), proc.stdout + proc.stderr


def _ptx_bodies(ptx: str) -> dict[str, str]:
    starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(ptx)]
    bodies = {}
    for i, (start, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(ptx)
        bodies[name] = ptx[start:end]
    return bodies


def launch_shapes(mod: tvm.IRModule) -> dict[str, tuple[int | None, int | None]]:
    """``{kernel: (blocks, threads)}`` from the thread bindings of each scheduled PrimFunc.
    A PrimFunc whose top-level thread loop nests are several kernels (a split-K GEMM and the
    sum of its partials) has one entry per kernel, named as TVM names them (``F_kernel``,
    ``F_kernel_1``, ...), and the PrimFunc's own name reports its largest grid."""
    shapes = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc) or func.attrs.get("tirx.is_host_func", False):
            continue
        name = str(func.attrs.get("global_symbol", gv.name_hint))
        kernels = [_launch(root) for root in _kernel_roots(func)]
        if not kernels:
            continue
        for i, shape in enumerate(kernels):
            shapes[f"{name}_kernel" + (f"_{i}" if i else "")] = shape
        largest = max(kernels, key=lambda shape: -1 if shape[0] is None else shape[0])
        shapes[name] = largest
        shapes.setdefault(gv.name_hint, largest)
    return shapes


def _kernel_roots(func: tirx.PrimFunc) -> list:
    """The outermost thread-bound loops of ``func``, in program order: one kernel each."""
    roots: list = []
    stack = [func.body]
    while stack:  # pre-order, not descending into a thread-bound loop
        node = stack.pop()
        if isinstance(node, tirx.For) and node.thread_binding is not None:
            roots.append(node)
            continue
        stack.extend(reversed(_children(node)))
    return roots


def _children(node) -> list:
    if isinstance(node, tirx.SeqStmt):
        return list(node.seq)
    if isinstance(node, tvm.s_tir.SBlockRealize):
        return [node.block]
    if isinstance(node, tvm.s_tir.SBlock):
        return [c for c in (node.init, node.body) if c is not None]
    if isinstance(node, tirx.IfThenElse):
        return [c for c in (node.then_case, node.else_case) if c is not None]
    body = getattr(node, "body", None)
    return [body] if isinstance(body, tirx.Stmt) else []


def _launch(root) -> tuple[int | None, int | None]:
    extents: dict[str, int | None] = {}
    for loop in [root, *(s for s in iter_stmts(root.body) if isinstance(s, tirx.For))]:
        if loop.thread_binding is None:
            continue
        tag = str(loop.thread_binding.thread_tag)
        value = int(loop.extent.value) if isinstance(loop.extent, tirx.IntImm) else None
        old = extents.get(tag, 0)
        extents[tag] = None if value is None or old is None else max(old, value)
    return _product(extents, "blockIdx"), _product(extents, "threadIdx")


def _product(extents: dict, prefix: str) -> int | None:
    total = 1
    for tag, value in extents.items():
        if tag.startswith(prefix):
            if value is None:
                return None
            total *= value
    return total
