"""ONNX's own node tests for the ops whose stock converters gave wrong numbers
(``tvm_fusion/frontend/onnx_fixes.py``, the runtime-shape ``Expand`` of ``onnx_ops``, and a
``Shape`` as a graph output, ``load.tensor_outputs``): each case passes against ONNX's
reference outputs, or is refused in one line; none is wrong. Run by ``onnx_node_cases``."""

from __future__ import annotations

import pytest
from onnx_node_cases import names_of, run_case

# ONNX generator modules whose every case is run here
FAMILIES = [
    "expand",
    "spacetodepth",
    "depthtospace",
    "convtranspose",
    "isinf",
    "mod",
    "layernormalization",
    "shape",
    "batch_normalization",
    "splittosequence",
    "roialign",
    "nonmaxsuppression",
]

# cases refused in one line (a converter we cannot trust, or a form the importer lacks)
REFUSED = {
    "test_roialign_mode_max",
    "test_split_to_sequence_1",  # split given as a graph input: stock needs a constant
    "test_split_to_sequence_2",
    *(n for n in names_of("nonmaxsuppression")),
}


def _cases() -> list[str]:
    names = [n for family in FAMILIES for n in names_of(family)]
    # the function-expanded forms test the ops of their bodies, not these converters; a
    # LayerNormalization axis counted from the end takes the same path as from the start
    return [
        n
        for n in names
        if "_expanded" not in n and not n.startswith("test_layer_normalization_4d_axis_neg")
    ]


@pytest.mark.parametrize("name", _cases())
def test_onnx_node_case(name):
    result = run_case(name)
    assert result == "pass" or result.startswith("refused: "), result
    if name in REFUSED:
        assert result.startswith("refused: "), result
        assert "\n" not in result
    else:
        assert result == "pass"
