"""Targets that name an ISA, for rule tests that check a schedule's shape (habit 11 of
STYLE.md): the expectation follows the target's lanes and vector registers
(``tvm_fusion.target.vector_lanes`` / ``vector_registers``), not the host that runs the test.
Such tests only schedule (compile-only); their numbers are checked on the host's own build
(the ``target`` fixture of tests/conftest.py)."""

import pytest
from tvm.target import Target

CPU_TARGETS = {
    # SSE4.2 (x86-64-v2): 4 float lanes, 16 vector registers
    "sse42": {"kind": "llvm", "mcpu": "x86-64-v2", "num-cores": 2},
    # AVX2: 8 float lanes, 16 vector registers
    "avx2": {"kind": "llvm", "mcpu": "znver3", "num-cores": 2},
    # AVX-512: 16 float lanes, 32 vector registers
    "avx512": {"kind": "llvm", "mcpu": "znver4", "num-cores": 2},
    # AArch64 NEON: 4 float lanes, 32 vector registers
    "neon": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "neoverse-v1", "num-cores": 2},
    # Apple silicon: NEON, 4 float lanes, 32 vector registers
    "apple-m1": {
        "kind": "llvm",
        "mtriple": "arm64-apple-macos",
        "mcpu": "apple-m1",
        "num-cores": 2,
    },
}


@pytest.fixture(params=list(CPU_TARGETS))
def cpu_target(request) -> Target:
    """Each of :data:`CPU_TARGETS` in turn."""
    return Target(CPU_TARGETS[request.param])
