"""Run-time check kernels: small TIR functions that read shapes, scalars or a tensor's values,
write nothing, and fail with one Python exception (``T.Assert``, raised through the VM) when a
condition does not hold. The importer's and the passes' checks (Reshape targets, Gather ids,
Slice steps, run-time operands, ...) are all built here, as TVMScript text:

- :func:`assert_kernel`: one assert over the buffers' shape variables and scalar parameters;
- :func:`flag_kernel`: a loop over a buffer's elements ORing conditions into one flag, then
  one assert (LLVM vectorises the loop; an assert per element ran 3x slower on 4096 ids).

Both are ``op_pattern`` 8 (opaque), ``tirx.is_scheduled`` and meant to be called in place
(``call_tir_inplace``) on one of their buffers, so that what reads that buffer afterwards
depends on the check.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.parser import parse as tvm_script_parse


@dataclass(frozen=True)
class Buf:
    """A buffer parameter ``name`` of ``dims`` (shape variable names, declared int64, or
    literals) and ``dtype``."""

    name: str
    dims: tuple
    dtype: str


def shape_vars(prefix: str, ndim: int) -> tuple:
    """``(prefix0, prefix1, ...)``: the names of a buffer's shape variables."""
    return tuple(f"{prefix}{i}" for i in range(ndim))


def indices(ndim: int) -> str:
    """The index of one element inside :func:`flag_kernel`'s loop: ``i0, i1`` (``()`` for a
    scalar buffer)."""
    return ", ".join(f"i{i}" for i in range(ndim)) or "()"


def assert_kernel(
    name: str, bufs: list[Buf], scalars: list[str], condition: str, message: str, kind: str
) -> tirx.PrimFunc:
    """``name(bufs..., scalars...)`` (each scalar ``T.int64``): ``kind: message`` unless
    ``condition`` (TVMScript over the buffers' shape variables and the scalars)."""
    lines = _head(name, bufs, scalars)
    lines.append(f"        T.Assert({condition}, {message!r}, {kind!r})")
    return parse_kernel("\n".join(lines))


def flag_kernel(
    name: str,
    bufs: list[Buf],
    loop: tuple,
    conditions: list[str],
    message: str,
    kind: str,
    lets: tuple = (),
    scalars: tuple = (),
) -> tirx.PrimFunc:
    """``name(bufs...)``: for every index of ``loop`` (shape variable names; the index is
    :func:`indices`), ``lets`` (``v = ...`` lines) then each of ``conditions`` ORed into a
    flag; after the loop, ``kind: message`` when any condition held."""
    lines = _head(name, bufs, list(scalars))
    lines += [
        '        bad = T.sblock_alloc_buffer((1,), "int64", scope="local")',
        "        bad[0] = T.int64(0)",
    ]
    indent = "        "
    if loop:
        lines.append(f"{indent}for {indices(len(loop))} in T.grid({', '.join(loop)}):")
        indent += "    "
    lines += [f"{indent}{let}" for let in lets]
    lines += [f'{indent}bad[0] = T.max(bad[0], T.Cast("int64", {c}))' for c in conditions]
    lines.append(f"        T.Assert(bad[0] == T.int64(0), {message!r}, {kind!r})")
    return parse_kernel("\n".join(lines))


@functools.lru_cache(maxsize=512)
def parse_kernel(text: str) -> tirx.PrimFunc:
    """The PrimFunc of TVMScript ``text`` (``T`` in scope), parsed once per distinct text (the
    parser takes 0.1-0.5 s; a model's checks of one form share it)."""
    return tvm_script_parse(text, {"T": T})


def _head(name: str, bufs: list[Buf], scalars: list[str]) -> list[str]:
    params = [f"var_{b.name}: T.handle" for b in bufs] + [f"{s}: T.int64" for s in scalars]
    declared: list[str] = []
    for b in bufs:
        declared += [d for d in b.dims if d.isidentifier() and d not in declared]
    lines = [
        "@T.prim_func(private=True, s_tir=True)",
        f"def {name}({', '.join(params)}):",
        '    T.func_attr({"op_pattern": 8, "tirx.noalias": True, "tirx.is_scheduled": True})',
        *(f"    {d} = T.int64()" for d in declared),
    ]
    for b in bufs:
        shape = "(" + "".join(f"{d}, " for d in b.dims) + ")"
        lines.append(f"    {b.name} = T.match_buffer(var_{b.name}, {shape}, {b.dtype!r})")
    lines.append('    with T.sblock("root"):')
    return lines
