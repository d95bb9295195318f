"""Targets: the host CPU by default, CUDA on request, and what schedules need to know of them.

A bare ``Target({"kind": "llvm"})`` makes LLVM emit baseline x86-64 code (SSE2, 4 float lanes)
whatever the machine has, so ``host_target()`` names the host's CPU (``mcpu``) and core count.
``parse_target`` turns the short spellings of the CLI into targets and refuses anything else with
one line: other target kinds than ``llvm`` and ``cuda`` (ROCm, Vulkan, ...: no schedule rules of
ours, and their toolchains fail deep inside the build) and CUDA architectures that the CUDA
backend cannot read (``sm_1``). A target is parsed where it enters (the CLI, the public
functions) and handed down as a ``Target``; nothing below parses it again.

A CUDA target is complete: ``cuda`` / ``cuda:sm_XX`` carry the attributes of TVM's
``nvidia/nvidia-h100`` tag (``max_threads_per_block``, ``max_shared_memory_per_block``,
``thread_warp_size``, ``registers_per_block``, ``l2_cache_size_bytes``: MetaSchedule and dlight
read them; a bare ``{"kind": "cuda"}`` lacks ``max_threads_per_block`` and tuning fails on it)
with the requested ``arch``; ``cuda:TAG`` (``cuda:nvidia/nvidia-a100``, ``cuda:nvidia-a100``)
takes a TVM target tag's attributes as they are; a JSON dict of kind ``cuda`` gets the
attributes it does not set from the H100 tag.
"""

from __future__ import annotations

import json
import os
import re

import tvm
from tvm.target import Target

from .errors import UsageError

DEFAULT_CUDA_ARCH = "sm_90"
# the tag whose attributes complete a CUDA target (thread and shared-memory limits, warp size)
DEFAULT_CUDA_TAG = "nvidia/nvidia-h100"
# kinds of target this package compiles for; a dict naming another kind is refused
KINDS = ("llvm", "cuda")
# sm_XX: TVM's CUDA backend reads a major and a minor digit at least (sm_90, sm_90a, sm_100)
_CUDA_ARCH = re.compile(r"sm_[1-9][0-9]{1,2}[a-z]?")


def cpu_count() -> int:
    """Cores this process may use (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def host_target(num_cores: int | None = None, mcpu: str | None = None) -> Target:
    """An llvm target for this machine's CPU: its ``mcpu`` and its core count. ``mcpu``: build
    for that CPU instead (LLVM's name, checked: :func:`check_mcpu`), e.g. ``znver3`` for AVX2
    code on an AVX-512 machine."""
    from tvm.target.codegen import llvm_get_system_cpu

    cpu = check_mcpu(mcpu) if mcpu else llvm_get_system_cpu()
    return Target({"kind": "llvm", "mcpu": cpu, "num-cores": num_cores or cpu_count()})


def check_mcpu(mcpu: str, triple: str | None = None) -> str:
    """``mcpu`` when LLVM knows it for ``triple`` (default: the host's), else a UsageError (LLVM
    itself only warns and builds generic code)."""
    from tvm.target.codegen import llvm_get_system_triple, llvm_is_valid_cpu

    triple = triple or llvm_get_system_triple()
    name = str(mcpu).strip()
    if not name or not llvm_is_valid_cpu(name, triple):
        raise UsageError(
            f"unknown --mcpu {mcpu!r}: LLVM knows no such CPU for {triple} "
            "(e.g. znver3, x86-64-v3, skylake-avx512)"
        )
    return name


def with_mcpu(target: Target, mcpu: str | None) -> Target:
    """``target`` built for CPU ``mcpu`` (checked by :func:`check_mcpu` against the target's
    ``mtriple``); ``None`` returns ``target`` as it is. llvm targets only: a CUDA target is
    refused (its host is the machine that runs it)."""
    if not mcpu:
        return target
    if target.kind.name != "llvm":
        raise UsageError(f"--mcpu applies to llvm targets, not {target.kind.name}")
    attrs = {key: _plain(value) for key, value in target.attrs.items()}
    attrs["mcpu"] = check_mcpu(mcpu, attrs.get("mtriple") or None)
    attrs.pop("mattr", None)  # the host's features would undo the CPU's
    return Target({"kind": "llvm", **attrs})


# features whose code faults on a CPU without them (SIGILL): checked before a benchmark runs
_RUN_FEATURES = ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx512bf16", "avx2", "fma")


def check_runs_here(target: Target) -> None:
    """A UsageError when code built for the llvm ``target`` cannot run on this machine: another
    triple, or a feature (AVX-512, AVX2, FMA) this CPU lacks; a benchmark would die of SIGILL."""
    if target.kind.name != "llvm":
        return
    from tvm.target.codegen import llvm_get_system_triple, target_has_features

    triple = str(target.attrs.get("mtriple", "") or "")
    if triple and triple.split("-")[0] != llvm_get_system_triple().split("-")[0]:
        raise UsageError(f"code built for {triple} cannot run on this machine")
    host = host_target()
    try:
        lacking = [
            f
            for f in _RUN_FEATURES
            if target_has_features(f, target) and not target_has_features(f, host)
        ]
    except Exception:  # non-x86 hosts do not know these feature names
        return
    if lacking:
        raise UsageError(
            f"code built for mcpu {target.attrs.get('mcpu', '')} needs {', '.join(lacking)}, "
            "which this CPU lacks: it cannot run here"
        )


def cuda_target(arch: str = DEFAULT_CUDA_ARCH) -> Target:
    """A CUDA target for ``arch`` (e.g. ``sm_90``) with the host CPU as its host, and the
    limits of :data:`DEFAULT_CUDA_TAG` (the same on every NVIDIA GPU since Volta but for the L2
    size: 1024 threads and 48 KB static shared memory per block, 64K registers, warps of 32)."""
    if not _CUDA_ARCH.fullmatch(arch):
        raise UsageError(f"unknown CUDA architecture {arch!r}: expected sm_XX, e.g. sm_90")
    return Target({**_tag_attrs(DEFAULT_CUDA_TAG), "arch": arch}, host=host_target())


def cuda_tag_target(tag: str) -> Target:
    """The CUDA target of TVM's tag ``tag`` (``nvidia/nvidia-a100``; the ``nvidia/`` prefix may
    be left out) with the host CPU as its host."""
    from tvm.target.tag import list_tags

    tags = list_tags()
    name = tag if tag in tags else f"nvidia/{tag}"
    if name not in tags:
        raise UsageError(
            f"unknown CUDA target {tag!r}: expected sm_XX or a TVM target tag such as "
            f"{DEFAULT_CUDA_TAG}"
        )
    attrs = _tag_attrs(name)
    if attrs.get("kind") != "cuda":
        raise UsageError(f"target tag {name!r} is not a CUDA target")
    return Target(attrs, host=host_target())


def _tag_attrs(tag: str) -> dict:
    """A target tag's attributes as a target dict (``kind`` included, ``tag`` left out)."""
    target = Target(tag)
    attrs = {key: _plain(value) for key, value in target.attrs.items()}
    return {"kind": target.kind.name, **attrs}


def _plain(value):
    if isinstance(value, tvm.tirx.IntImm | int):
        return int(value)
    if isinstance(value, list | tuple | tvm.ir.Array):
        return [_plain(v) for v in value]
    return str(value)


def parse_target(spec: str | dict | Target | None) -> Target:
    """``llvm`` | ``cpu`` | ``cuda`` | ``cuda:sm_XX`` | ``cuda:TAG`` | a JSON dict | a Target.

    ``None`` and ``llvm`` mean the host CPU (see :func:`host_target`).
    """
    if spec is None:
        return host_target()
    if isinstance(spec, Target):
        return spec
    if isinstance(spec, dict):
        return _from_dict(spec)
    text = str(spec).strip()
    if text in ("llvm", "cpu", "host"):
        return host_target()
    if text == "cuda":
        return cuda_target()
    if text.startswith("cuda:"):
        rest = text.split(":", 1)[1]
        return cuda_target(rest) if rest.startswith("sm_") else cuda_tag_target(rest)
    if text.startswith("{"):
        try:
            return _from_dict(json.loads(text))
        except json.JSONDecodeError as err:
            raise UsageError(f"target {text!r} is not valid JSON: {err.msg}") from None
    raise UsageError(
        f"unknown target {text!r}: use llvm, cuda, cuda:sm_XX, cuda:TAG or a JSON target dict"
    )


def resolve_target(spec: str | dict | Target | None) -> Target:
    """The target a list of passes is built for: ``spec`` parsed (:func:`parse_target`); for
    ``None``, ``Target.current()`` (``tvm.compile`` enters it), else the host. A Target is
    returned as it is."""
    if isinstance(spec, Target):
        return spec
    if spec is not None:
        return parse_target(spec)
    current = Target.current(allow_none=True)
    return current if current is not None else host_target()


def _from_dict(spec: dict) -> Target:
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind not in KINDS and kind in Target.list_kinds():
        # refused before Target() is built: some kinds (rocm) print warnings on construction
        raise UsageError(
            f"target kind {kind!r} is not supported: tvm-fusion compiles for {' and '.join(KINDS)}"
        )
    if kind == "cuda":  # complete it: the limits it does not set are the H100 tag's
        defaults = _tag_attrs(DEFAULT_CUDA_TAG)
        defaults.pop("arch")
        spec = {**defaults, **spec}
    try:
        target = Target(spec)
    except Exception as err:  # TVM raises several error types for bad dicts
        first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise UsageError(f"unknown target {json.dumps(spec)}: {first}") from None
    if target.kind.name == "cuda" and "arch" in target.attrs:
        cuda_target(str(target.attrs["arch"]))  # refuses what the CUDA backend cannot read
    return target


def is_cpu(target: Target) -> bool:
    return target.kind.name in ("llvm", "c")


def is_gpu(target: Target) -> bool:
    return "gpu" in target.keys


def async_copy(target: Target) -> bool:
    """Whether a build for ``target`` gets ``tirx.use_async_copy`` (global-to-shared copies of
    software pipelines as ``cp.async``): CUDA from sm_80 (Ampere) on."""
    arch = str(target.attrs.get("arch", "")) if target.kind.name == "cuda" else ""
    digits = "".join(c for c in arch[3:] if c.isdigit())
    return arch.startswith("sm_") and bool(digits) and int(digits) >= 80


def num_cores(target: Target) -> int:
    """Cores to parallelise over: the target's ``num-cores``, else this machine's."""
    value = target.attrs.get("num-cores", None)
    return int(value) if value else cpu_count()


def has_mcpu(target: Target) -> bool:
    return bool(target.attrs.get("mcpu", None)) or bool(target.attrs.get("mattr", None))


def vector_bits(target: Target) -> int:
    """SIMD register width in bits that LLVM will use for ``target``.

    ``llvm_get_vector_width`` reports the host's width whatever the target says, so this reads
    the target's features instead.
    """
    if not is_cpu(target):
        return 128
    from tvm.target.codegen import target_has_features

    try:
        if target_has_features("avx512f", target):
            return 512
        if target_has_features("avx", target):
            return 256
    except Exception:  # non-x86 targets do not know these feature names
        pass
    return 128


def vector_registers(target: Target) -> int:
    """SIMD registers that LLVM allocates for ``target``: 32 on AArch64 (NEON's v0-v31) and on
    x86 with AVX-512 (zmm0-zmm31), 16 on other x86 (xmm/ymm0-15) and on anything else."""
    if not is_cpu(target):
        return 16
    if _is_aarch64(target):
        return 32
    return 32 if vector_bits(target) >= 512 else 16


def _is_aarch64(target: Target) -> bool:
    triple = str(target.attrs.get("mtriple", "") or "")
    if not triple:
        from tvm.target.codegen import llvm_get_system_triple

        triple = llvm_get_system_triple()
    return triple.startswith(("aarch64", "arm64"))


def vector_lanes(target: Target, dtype: str = "float32") -> int:
    """Elements of ``dtype`` per SIMD register (at least 4 for 32-bit types)."""
    bits = tvm.DataType(dtype).bits
    return max(vector_bits(target) // bits, 2)
